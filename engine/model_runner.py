"""Loads the model, owns the KV pool, and runs one scheduled step: forward + sample."""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.config import EngineConfig, ModelConfig
from engine.forward_batch import build_forward_batch
from engine.grammar import apply_bitmask, fill_bitmask
from engine.kv_cache import KVPool
from engine.models import build_model
from engine.models.weights import WeightLoader
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """One model on one device with its KV pool. Not thread-safe."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model_dir) -> None:
        self.cfg = cfg
        self.device = cfg.torch_device
        self.last_step = (0, 0)  # the last step's (decode rows, prompt tokens computed): a rank's step log
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
        if cfg.dtype == "float16" and self.device.type == "cpu":
            raise ValueError("float16 is for CUDA; use bfloat16 or float32 on the CPU")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        max_len = min(model_cfg.max_position, cfg.max_model_len or model_cfg.max_position)
        page_bytes = KVPool.bytes_per_page(model_cfg, cfg.page_size, cfg.torch_dtype)
        if page_bytes:
            num_pages = int(cfg.kv_cache_gb * 2**30 // page_bytes)
        else:  # no full-attention layer: pages are bookkeeping only
            num_pages = cfg.max_num_seqs * -(-max_len // cfg.page_size)
        if num_pages < 1:
            raise ValueError(f"kv_cache_gb={cfg.kv_cache_gb} holds no page of {page_bytes} bytes")
        self.max_model_len = min(max_len, num_pages * cfg.page_size)
        self.model_cfg = dataclasses.replace(model_cfg, max_position=self.max_model_len + 1)
        # Seconds of each load phase, in order (the rank logs them with its warm-up's).
        self.load_phases: dict[str, float] = {}
        t0 = t = time.perf_counter()
        self.model = build_model(self.model_cfg, cfg.torch_dtype, self.device)
        t = self._phase("build", t)

        def load() -> None:  # adds the "weights", "quant" and "pack" phases
            self.model.load_weights(WeightLoader(model_dir), self.load_phases)

        self.shared_weights = None
        if cfg.shared_weights_dir and self.device.type == "cpu":
            from engine.shared_weights import share_weights, weights_identity

            identity = weights_identity(model_dir, cfg.dtype)  # hashes the checkpoint
            t = self._phase("key", t)
            # Loads the model where it is the first rank here (or cannot use the file), else maps it.
            self.shared_weights = share_weights(self.model, cfg.shared_weights_dir, identity, load)
        else:
            load()
        loading = sum(self.load_phases.get(k, 0.0) for k in ("weights", "quant", "pack"))
        if self.shared_weights is None and self.device.type == "cpu":
            _packed_to_huge_pages(self.model)
        t = self._phase("share", t)
        self.load_phases["share"] -= loading  # (load()'s own phases)
        log.info("loaded %s (%s, %s) in %.1fs", model_dir, cfg.dtype, cfg.device, t - t0)
        self.pool = KVPool(self.model_cfg, cfg.page_size, num_pages, cfg.max_num_seqs, cfg.torch_dtype, self.device)
        self.sampler = Sampler()
        self._grammar_pool: ThreadPoolExecutor | None = None  # started by the first constrained step
        self._phase("kv", t)

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.load_phases[name] = self.load_phases.get(name, 0.0) + now - since
        return now

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step. Returns the sequences that got a token this step and their samples.

        A sequence gets a token when this step computes its last uncomputed token.
        Advances num_computed of every scheduled sequence.
        """
        needs = [seq.num_computed + n == seq.num_tokens for seq, n in scheduled]
        prompt_rows = [seq.prompt_logprob_rows(n) for seq, n in scheduled]
        if not any(prompt_rows):
            prompt_rows = None
        fb = build_forward_batch(scheduled, self.cfg.page_size, self.pool.window, needs, self.device, prompt_rows)
        self.last_step = (fb.num_decode, fb.num_tokens - fb.num_decode)  # (decode rows, prompt tokens)
        matchers = [seq.matcher for (seq, _), need in zip(scheduled, needs) if need]
        masks = None
        if any(m is not None for m in matchers):  # the grammar masks, filled while the model runs
            masks = self._grammar_thread().submit(fill_bitmask, matchers, len(matchers), self.model_cfg.vocab_size)
        hidden = self.model(fb, self.pool)
        rows = [seq for (seq, _), need in zip(scheduled, needs) if need]
        if prompt_rows is not None:
            fill_prompt_logprobs(self.model, hidden[len(rows):], scheduled, prompt_rows)
            hidden = hidden[:len(rows)]
        for seq, n in scheduled:
            seq.num_computed += n
        if not rows:
            return rows, None
        logits = self.model.compute_logits(hidden)  # [S, V] float32
        self._add_logit_bias(rows, logits)
        self._mask_early_stop(rows, logits)
        if masks is not None:
            apply_bitmask(logits, masks.result())
        batch = SamplingBatch.build([s.params for s in rows], [s.prompt_ids for s in rows],
                                    [s.output_ids for s in rows], logits.shape[1], self.device)
        return rows, self.sampler(logits, batch)

    def close(self) -> None:
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown()
            self._grammar_pool = None

    def _grammar_thread(self) -> ThreadPoolExecutor:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._grammar_pool

    @staticmethod
    def _add_logit_bias(rows: list[Sequence], logits: torch.Tensor) -> None:
        """OpenAI's logit_bias, before everything the sampler does (and the logprobs it reports)."""
        at = [(i, t, b) for i, seq in enumerate(rows) for t, b in seq.params.logit_bias]
        if at:
            r, t, b = zip(*at)
            logits.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=logits.dtype).to(logits.device),
                              accumulate=True)

    def _mask_early_stop(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """min_tokens: stop tokens cannot be sampled before a row has min_tokens outputs (not
        under a grammar, which decides where the output may end)."""
        eos = self.model_cfg.eos_token_ids
        for i, seq in enumerate(rows):
            p = seq.params
            if p.min_tokens and len(seq.output_ids) < p.min_tokens and seq.matcher is None:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
                if ids:
                    logits[i, ids] = float("-inf")


PROMPT_LOGPROB_BLOCK = 256  # prompt rows whose [rows, vocab] logits are held at once


def fill_prompt_logprobs(model, hidden: torch.Tensor, scheduled: list[tuple[Sequence, int]],
                         prompt_rows: list[int]) -> None:
    """Prompt logprobs from the hidden states of this step's prompt rows (in scheduled order,
    Sequence.prompt_logprob_rows each): row j of a sequence (position num_computed + j, before the
    step advances it) scores prompt token num_computed + j + 1. The raw log-softmax of the logits,
    a block of rows at a time (a chunk of 2048 rows would be 400 MB of logits at once)."""
    at = 0
    for (seq, _), m in zip(scheduled, prompt_rows):
        if not m:
            continue
        plp, nc = seq.prompt_lp, seq.num_computed
        for b in range(0, m, PROMPT_LOGPROB_BLOCK):
            e = min(m, b + PROMPT_LOGPROB_BLOCK)
            logits = model.compute_logits(hidden[at + b:at + e]).float()  # [rows, V]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            target = torch.tensor(seq.prompt_ids[nc + b + 1:nc + e + 1], device=logits.device).unsqueeze(1)
            chosen = logits.gather(1, target)
            ranks = ((logits > chosen).sum(dim=1, dtype=torch.int32) + 1).tolist()  # (int32: half the time)
            lps = (chosen - lse).squeeze(1).tolist()
            tops = top_ids = None
            if plp.k:
                top = logits.topk(plp.k, dim=-1, sorted=True)
                tops, top_ids = (top.values - lse).tolist(), top.indices.tolist()
            for r in range(e - b):
                j = nc + b + r  # entry j: prompt token j + 1
                plp.logprobs[j], plp.ranks[j] = lps[r], ranks[r]
                if tops is not None:
                    plp.top_ids[j], plp.top_logprobs[j] = top_ids[r], tops[r]
        at += m


def _packed_to_huge_pages(model) -> None:
    """Move the linear kernel's packed weight copies and quant copies (what a decode step streams)
    to huge pages (engine/hugepages.py); the shared weights' mapping has them already."""
    from engine import hugepages
    from engine.layers.linear import Linear

    mods = [m for m in model.modules() if isinstance(m, Linear)]
    copies = [(m, "_packed") for m in mods if m._packed is not None]
    copies += [(m, "_quant") for m in mods if m.quant_weight() is not None]
    views = hugepages.empty_like_all([getattr(m, attr)[1] for m, attr in copies])
    if views is None:
        return
    for (m, attr), v in zip(copies, views):  # each 4 KB copy is freed as soon as it is copied
        key, t = getattr(m, attr)
        setattr(m, attr, (key, v.copy_(t)))
    hugepages.release_freed_memory()  # their heap pages
