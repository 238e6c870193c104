"""The engine loop: admit requests, step the scheduler and runner, check stops, emit outputs.

Request life cycle:
  1. add_request() validates and queues a Sequence (WAITING); add_imported()
     queues one whose prompt KV was computed elsewhere (a decode-only rank).
  2. step(): the scheduler picks running + newly admitted sequences under the
     token budget (chunked prefill; preemption by recompute when pages run out).
  3. The runner computes the step and samples one token for each sequence whose
     last token was computed.
  4. Stop checks: eos / stop ids / stop strings -> "stop"; max_tokens or the
     context -> "length". A prefill-only sequence finishes after its first token
     and carries its KV export (pages + SWA state) in the output.
  5. Finished or aborted sequences free their pages and SWA slot at once.
With a host cache (hicache_size_gb > 0), admission loads the prompt's longest
stored prefix and prefill writes the prompt through to it. With an L3 store behind it, a new
request first waits outside the queue while its pages are read ahead (engine/read_ahead.py). The engine takes it from
its builder as a factory (engine/host_cache.py; hicache.cache.HostCache.for_engine).
Roles: colocated = both; prefill-only = add_request(prefill_only=True);
decode-only = add_imported() with the prefill side's KVExport, or (PD decode rank, KV
read straight into device pages) reserve_kv() -> transfer into its pages -> add_prefilled().
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarCompiler
from engine.host_cache import HostCacheFactory, HostCacheLike
from engine.kv_cache import KVPool
from engine.model_cache import cached_model_dir
from engine.model_runner import ModelRunner
from engine.outputs import KVExport, KVReservation, PromptLogprobs, RequestOutput, TokenLogprob
from engine.read_ahead import ReadAheads
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from engine.step_bounds import StepBounds
from engine.text_decoder import BackendDecoder, load_decoder

log = logging.getLogger(__name__)


class LLMEngine(StepBounds):
    def __init__(self, cfg: EngineConfig, host_cache: HostCacheFactory | None = None) -> None:
        """`host_cache` builds the host KV cache when cfg.hicache_size_gb > 0 (e.g.
        hicache.cache.HostCache.for_engine); it is required then, and unused otherwise."""
        if cfg.hicache_size_gb > 0 and host_cache is None:
            raise ValueError(f"hicache_size_gb={cfg.hicache_size_gb} needs a host cache: pass "
                             "LLMEngine(cfg, host_cache=hicache.cache.HostCache.for_engine)")
        self.cfg = cfg
        t0 = time.perf_counter()
        self.model_dir = cached_model_dir(cfg.model)
        model_cfg = ModelConfig.from_hf_dir(self.model_dir)
        t1 = time.perf_counter()
        # The detokenizer's decode, without transformers where its state is saved (engine/text_decoder.py).
        self.decoder = load_decoder(self.model_dir)
        t2 = time.perf_counter()
        self.runner = ModelRunner(cfg, model_cfg, self.model_dir)
        # Seconds of each load phase, in order (rank_runtime/loading.py load_engine logs them).
        self.load_phases = {"config": t1 - t0, "tokenizer": t2 - t1, **self.runner.load_phases}
        self.model_cfg = self.runner.model_cfg
        self.pool = self.runner.pool
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_pack_tokens)
        self.scheduler.on_admit = self._on_admit
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._imports: dict[str, KVExport] = {}
        self.eos_ids = frozenset(self.model_cfg.eos_token_ids)
        # Constrained requests (SamplingParams.grammar): the tokenizer loads on the first one.
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.model_cfg.vocab_size,
                                        list(self.model_cfg.eos_token_ids))
        self._reserved = 0  # outstanding KVReservations (they count against max_num_seqs)
        # PD prefill rank: called on a prefill-only sequence that got its first token and goes
        # on elsewhere, before its pages are freed; copies its KV out (pages + SWA slot) and
        # returns what becomes RequestOutput.kv_export. None: a KVExport of cloned tensors.
        # It may take the sequence's device pages and SWA slot (seq.pages = [], seq.swa_slot =
        # None): the engine then frees neither, and the hook's owner must free them
        # (KVPool.free / free_slot) before the next step() (prefill/handoff_sender.py does).
        self.export_kv: Callable[[Sequence, KVPool], object] | None = None
        self.hicache: HostCacheLike | None = None
        if cfg.hicache_size_gb > 0:
            t = time.perf_counter()
            self.hicache = host_cache(cfg, self.model_cfg, self.max_model_len)
            self.load_phases["hicache"] = time.perf_counter() - t
        self.read_aheads = ReadAheads(self.hicache, cfg.page_size)  # requests outside the queue meanwhile
        # The last step's rows not yet written through to the host cache (flush_write_through).
        self._unstored: list[tuple[Sequence, int]] = []

    @functools.cached_property
    def tokenizer(self):
        """The model's transformers tokenizer (encode, chat template), loaded on first use: the
        engine itself only decodes, with `decoder`."""
        if not isinstance(self.decoder, BackendDecoder):
            return self.decoder  # load_decoder loaded it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    # ---- admission -----------------------------------------------------------
    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; this model's context is "
                             f"{self.max_model_len} (prompt plus at least one new token)")
        v = self.model_cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= v:
            raise ValueError(f"prompt token ids must be in [0, {v})")
        params.check_vocab(v)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    *, prefill_only: bool = False, output_ids: list[int] = ()) -> None:
        """Queue a request. `output_ids`: tokens it already generated elsewhere (a request the
        router moved here from a dead rank): they are recomputed with the prompt and decoding
        goes on after them, as from a preemption (same seeded noise, penalties, grammar state
        and held-back text). Raises ValueError (nothing queued) on invalid input."""
        prompt_ids, output_ids = list(prompt_ids), list(output_ids)
        self._validate(request_id, prompt_ids + output_ids, params)
        if output_ids and (prefill_only or len(output_ids) >= params.max_tokens):
            raise ValueError("a resumed request needs room for a new token and cannot be prefill-only")
        seq = Sequence(request_id, prompt_ids, params, output_ids=output_ids, prefill_only=prefill_only,
                       matcher=self._matcher(params, output_ids))
        if params.prompt_logprobs is not None and not output_ids:  # (a resumed request sent them)
            seq.prompt_lp = PromptLogprobs.empty(len(prompt_ids), params.prompt_logprobs)
        self._track(seq)
        det = self._detok[request_id]
        for t in output_ids:  # their text was streamed by the rank that made them
            det.append(t)

    def add_imported(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                     params: SamplingParams, kv: KVExport) -> None:
        """Queue a request whose prompt KV was computed elsewhere; decoding continues from output_ids."""
        prompt_ids = list(prompt_ids)
        self._validate(request_id, prompt_ids, params)
        if kv.num_tokens != len(prompt_ids):
            raise ValueError("kv export does not cover the prompt")
        seq = Sequence(request_id, prompt_ids, params, output_ids=list(output_ids),
                       matcher=self._matcher(params, output_ids))
        self._imports[request_id] = kv
        self._track(seq)
        det = self._detok[request_id]
        for t in output_ids:
            det.append(t)

    def reserve_kv(self, num_tokens: int) -> KVReservation | None:
        """Take pages for `num_tokens` and an SWA slot for a prompt whose KV a transfer will fill.

        None (taking nothing) when pages, a slot or a sequence place (max_num_seqs, counting
        running, waiting and reserved) are short: the caller retries after a step.
        """
        pool, sched = self.pool, self.scheduler
        n = pool.pages_for(num_tokens)
        if (sched.num_unfinished + self._reserved >= self.cfg.max_num_seqs or n > pool.free_pages
                or (pool.swa_layers and pool.free_slots == 0)):
            return None
        self._reserved += 1
        return KVReservation(num_tokens, pool.allocate(n), pool.allocate_slot())

    def release_kv(self, res: KVReservation) -> None:
        """Give back a reservation that will not be committed (failed or aborted transfer)."""
        self._reserved -= 1
        self.pool.free(res.pages)
        self.pool.free_slot(res.swa_slot)

    def add_prefilled(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                      params: SamplingParams, res: KVReservation, cached_tokens: int = 0) -> None:
        """Start decoding a request whose prompt KV is in `res` (filled by a transfer).

        Takes ownership of `res`: the sequence runs from the next step, decoding from
        output_ids. `cached_tokens` is reported as usage. Raises ValueError (and releases
        `res`) on invalid input.
        """
        prompt_ids = list(prompt_ids)
        try:
            self._validate(request_id, prompt_ids, params)
            if res.num_tokens != len(prompt_ids) or not output_ids:
                raise ValueError("reservation does not cover the prompt, or no first token")
            matcher = self._matcher(params, output_ids)
        except ValueError:
            self.release_kv(res)
            raise
        self._reserved -= 1
        seq = Sequence(request_id, prompt_ids, params, output_ids=list(output_ids), pages=res.pages,
                       swa_slot=res.swa_slot, num_computed=res.num_tokens, num_cached_prompt=cached_tokens,
                       matcher=matcher)
        self._track(seq, running=True)
        det = self._detok[request_id]
        for t in output_ids:
            det.append(t)

    def _matcher(self, params: SamplingParams, output_ids: list[int]):
        """The grammar matcher of a request (None without a grammar), having accepted the
        tokens it generated elsewhere. Raises ValueError (GrammarError) on a bad grammar."""
        if params.grammar is None:
            return None
        return self.grammars.matcher(params.grammar, output_ids)

    def _track(self, seq: Sequence, running: bool = False) -> None:
        p = seq.params
        self._detok[seq.request_id] = IncrementalDetokenizer(
            self.decoder, seq.prompt_ids, stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        self.seqs[seq.request_id] = seq
        if running:
            self.scheduler.add_running(seq)
        elif not self.read_aheads.start(seq):
            self.scheduler.add(seq)

    def poll_prefetch(self, wait: bool = False) -> bool:
        """Queue the requests read ahead (ReadAheads.poll; `wait`: with nothing else to run).
        Returns whether the scheduler has something to run."""
        if self.read_aheads:
            for seq in self.read_aheads.poll(wait and not self.scheduler.num_unfinished):
                self.scheduler.add(seq)
        return self.scheduler.num_unfinished > 0

    def _on_admit(self, seq: Sequence) -> bool:
        kv = self._imports.get(seq.request_id)
        if kv is None:
            return self.hicache.admit(seq, self.pool) if self.hicache is not None else True
        n = kv.pages.shape[0]
        if n > self.pool.free_pages:
            return False
        seq.pages = self.pool.allocate(n)
        self.pool.import_pages(seq.pages, kv.pages)
        if kv.swa is not None:
            self.pool.import_swa(seq.swa_slot, kv.swa)
        seq.num_computed = kv.num_tokens
        del self._imports[seq.request_id]
        return True

    # ---- the loop -------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.read_aheads)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort in any phase; idempotent. Frees the request's pages and slot at once."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        return self._finish(seq, [], "", None)

    def step(self) -> list[RequestOutput]:
        self.flush_write_through()
        self.poll_prefetch(wait=True)
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        t0 = time.perf_counter()
        rows, out = self.runner.execute(sched.scheduled)
        self.read_aheads.observe(time.perf_counter() - t0, self.runner.last_step[1])
        if self.hicache is not None:
            # Written through by flush_write_through, or row by row before a row's pages go
            # (_store_now): a rank flushes after the step's tokens have left, so a prompt's
            # copy to the host cache (~1.5 ms for 530 tokens) is not in its time to first token.
            self._unstored = list(sched.scheduled)
        if out is None:
            return []
        tokens = out.token_ids.tolist()
        lps = tops_ids = tops_lp = None
        if out.logprobs is not None:
            lps, tops_ids, tops_lp = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        results = []
        for i, seq in enumerate(rows):
            tok = tokens[i]
            seq.output_ids.append(tok)
            lp = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                lp = [TokenLogprob(tok, lps[i], list(zip(tops_ids[i][:k], tops_lp[i][:k])))]
            plp, seq.prompt_lp = seq.prompt_lp, None  # complete: the prompt's last position was sampled
            out_i = self._after_token(seq, tok, lp)
            out_i.prompt_logprobs = plp
            results.append(out_i)
        return results

    def flush_write_through(self) -> None:
        """Write the last step's rows through to the host cache (the next step() does it first)."""
        if self._unstored:
            rows, self._unstored = self._unstored, []
            self.hicache.write_through(rows, self.pool)

    def _store_now(self, seq: Sequence) -> None:
        """Write `seq`'s share of the last step through now: it is about to finish (or hand its
        pages to export_kv)."""
        mine = [e for e in self._unstored if e[0] is seq]
        if mine:
            self._unstored = [e for e in self._unstored if e[0] is not seq]
            self.hicache.write_through(mine, self.pool)

    def _after_token(self, seq: Sequence, tok: int, lp) -> RequestOutput:
        p = seq.params
        text, stop_str = self._detok[seq.request_id].append(tok)
        reason = None
        if seq.matcher is not None and not seq.matcher.accept_token(tok):
            # The mask allowed only what the grammar accepts: a token it refuses is a bug.
            log.error("request %s: token %d does not follow its grammar; ending it", seq.request_id, tok)
            reason = FinishReason.STOP
        elif seq.matcher is not None and seq.matcher.is_terminated():
            reason = FinishReason.STOP  # the grammar is complete and took an end-of-sequence token
        elif stop_str is not None:
            reason, seq.stop_str = FinishReason.STOP, stop_str
        elif (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None and not seq.prefill_only:
            return self._output(seq, [tok], text, lp, finished=False)
        self._store_now(seq)  # before export_kv may take its pages
        seq.finish_reason = reason
        export = None
        if seq.prefill_only and reason is None and self.export_kv is not None:
            export = self.export_kv(seq, self.pool)
        elif seq.prefill_only:
            n = len(seq.prompt_ids)
            pages = seq.pages[:self.pool.pages_for(n)]
            swa = self.pool.export_swa(seq.swa_slot, n) if seq.swa_slot is not None else None
            export = KVExport(n, self.pool.export_pages(pages), swa)
        return self._finish(seq, [tok], text, lp, export)

    def _finish(self, seq: Sequence, toks, text, lp, export=None) -> RequestOutput:
        self.read_aheads.cancel(seq.request_id)
        self._store_now(seq)
        self.scheduler.finish(seq)
        self._imports.pop(seq.request_id, None)
        det = self._detok.pop(seq.request_id)
        # A prefill-only sequence that goes on elsewhere keeps held-back text for the decode
        # side (whose detokenizer replays the first token), so no flush.
        handed_off = seq.prefill_only and seq.finish_reason is None
        if seq.stop_str is None and not handed_off:
            text += det.flush()
            # A stop string can complete only at flush (a held-back partial character).
            if det.matched_stop is not None and seq.finish_reason is not FinishReason.ABORT:
                seq.finish_reason, seq.stop_str = FinishReason.STOP, det.matched_stop
        del self.seqs[seq.request_id]
        return self._output(seq, toks, text, lp, finished=True, export=export)

    def _output(self, seq, toks, text, lp, finished, export=None) -> RequestOutput:
        reason = seq.finish_reason.value if (finished and seq.finish_reason) else None
        return RequestOutput(seq.request_id, toks, text, finished, reason, seq.stop_str, lp,
                             len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_prompt, export)

    # ---- convenience ------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion as one batch; returns one merged output per prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}-{self._counter()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        merged = {rid: RequestOutput(rid, [], "", False) for rid in ids}
        while any(not merged[r].finished for r in ids):
            for o in self.step():
                m = merged[o.request_id]
                m.new_token_ids += o.new_token_ids
                m.text += o.text
                if o.logprobs:
                    m.logprobs = (m.logprobs or []) + o.logprobs
                m.finished, m.finish_reason, m.stop_str = o.finished, o.finish_reason, o.stop_str
                m.prompt_tokens, m.completion_tokens, m.cached_tokens = \
                    o.prompt_tokens, o.completion_tokens, o.cached_tokens
                m.kv_export = o.kv_export
                m.prompt_logprobs = m.prompt_logprobs or o.prompt_logprobs
        return [merged[r] for r in ids]

    _n = 0

    def _counter(self) -> int:
        LLMEngine._n += 1
        return LLMEngine._n

    @property
    def last_step(self) -> tuple[int, int]:
        """The last step's (decode rows, prompt tokens computed; prefix hits excluded)."""
        return self.runner.last_step

    def stats(self) -> dict:
        sched = self.scheduler
        out = {"running": len(sched.running), "waiting": len(sched.waiting) + len(self.read_aheads),
               "pages_used": self.pool.used_pages, "pages_total": self.pool.num_pages,
               # What still fits: tokens of KV, and sequences (bounded by slots and max_num_seqs).
               "tokens_free": self.pool.free_pages * self.pool.page_size,
               "seqs_free": self.cfg.max_num_seqs - len(self.scheduler.running),
               "swa_slots_free": self.pool.free_slots}
        if self.hicache is not None:
            out["hicache"] = self.hicache.stats()
        return out

    def close(self) -> None:
        """Release host resources (unlinks the host cache's shared memory, ends the grammar
        thread); idempotent."""
        if self.hicache is not None:
            self.hicache.close()
        self.runner.close()
