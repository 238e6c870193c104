"""Batched token sampling: one step's logits [B, V] -> one token per row.

Per step, for every row at once (vLLM's order and semantics):
1. Penalties on float32 logits: repetition (prompt + output tokens; positive
   logits divided, negative multiplied), then frequency/presence (output tokens
   only: logits -= freq * count + presence * (count > 0)). Skipped when no row
   uses them. min_tokens is not handled here: the engine masks stop ids itself.
2. Greedy rows (temperature == 0) take the argmax of the penalised logits;
   their top-k/top-p/min-p are ignored.
3. Random rows: logits / temperature, then top-k, top-p (sort based, the top
   token always kept), min-p; each filter skipped when no random row uses it.
4. Exponential race: token = argmax(probs / q), q ~ Exp(1) per (row, token).
   Mixed batches sample all rows, then torch.where picks the greedy argmax.
5. Logprobs (only if some row asked) come from the RAW logits as passed in,
   before penalties and temperature: the chosen token's and the top K, K the
   largest count any row asked for.

On the CPU steps 3-4 run in `csrc/sampler/race_sample.cpp` (native/sampler.py): the filters
become -inf logits, and one pass per row runs the race on the raw logits at the row's
temperature, drawing q_i from a counter hash of (the row's key, i); no [B, V] noise tensor.

Seed contract: a seeded row's noise q is a pure function of (seed, step,
vocab size, device type), where step = len(output_ids) of that row when the
batch is built, i.e. the number of tokens already generated. On the CPU it is the kernel's
hash keyed by `_mix_seed(seed, step)`; elsewhere it is drawn from
`torch.Generator(device).manual_seed(_mix_seed(seed, step))`. Never from the
global RNG (unseeded rows take their keys from it), so the row gets the same token wherever
it sits in the batch and whatever else is batched, and another process (a rank resuming the
request, with the same output_ids) reproduces it. Bitwise-equal logits are the model's
business; the CPU and CUDA draw different streams.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from native.sampler import argmax_rows, race_sample, race_sample_available
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a 64-bit generator seed per row and step."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def _count(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] float32 occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]  # the pad column soaks up the padding


@dataclass
class SamplingBatch:
    """Tensors for one batch of rows, built once per step.

    A field is None when no row needs it, so the common all-greedy,
    no-penalty batch builds no tensors at all.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # [B] bool; None when no row is greedy
    temperature: torch.Tensor | None = None  # [B] float32, greedy rows hold 1.0
    top_k: torch.Tensor | None = None  # [B, 1] int64 in [1, V]; V disables
    top_p: torch.Tensor | None = None  # [B, 1] float32; 1.0 disables
    min_p: torch.Tensor | None = None  # [B, 1] float32; 0.0 disables
    repetition_penalty: torch.Tensor | None = None  # [B, 1] float32
    seen_mask: torch.Tensor | None = None  # [B, V] bool: token in prompt or output
    frequency_penalty: torch.Tensor | None = None  # [B, 1] float32
    presence_penalty: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, V] float32
    seeded_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, generator seed)
    max_logprobs: int | None = None  # None when no row asked for logprobs

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        """Row i samples for params[i] given its prompt and the tokens it has generated.

        len(output_ids[i]) is the step index of the seed contract (module docstring).
        Raises ValueError when the three lists differ in length.
        """
        if not len(params) == len(prompt_ids) == len(output_ids):
            raise ValueError("params, prompt_ids and output_ids must have one entry per row")
        b = cls(num_rows=len(params), vocab_size=vocab_size, all_greedy=all(p.greedy for p in params))
        randoms = [p for p in params if not p.greedy]

        def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        if randoms:
            if len(randoms) < len(params):
                b.greedy = torch.tensor([p.greedy for p in params], device=device)
            b.temperature = column([p.temperature or 1.0 for p in params], torch.float32)
            # Greedy rows get disabling values so they never switch a filter on.
            if any(p.top_k > 0 for p in randoms):
                ks = [min(p.top_k, vocab_size) if p.top_k > 0 and not p.greedy else vocab_size for p in params]
                b.top_k = column(ks, torch.int64)
            if any(p.top_p < 1.0 for p in randoms):
                b.top_p = column([1.0 if p.greedy else p.top_p for p in params], torch.float32)
            if any(p.min_p > 0.0 for p in randoms):
                b.min_p = column([0.0 if p.greedy else p.min_p for p in params], torch.float32)
            b.seeded_rows = [
                (i, _mix_seed(p.seed, len(out)))
                for i, (p, out) in enumerate(zip(params, output_ids))
                if p.seed is not None and not p.greedy
            ]

        if any(p.repetition_penalty != 1.0 for p in params):
            b.repetition_penalty = column([p.repetition_penalty for p in params], torch.float32)
            seen = [list(pr) + list(out) for pr, out in zip(prompt_ids, output_ids)]
            b.seen_mask = _count(_padded(seen, vocab_size, device), vocab_size) > 0
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            b.frequency_penalty = column([p.frequency_penalty for p in params], torch.float32)
            b.presence_penalty = column([p.presence_penalty for p in params], torch.float32)
            b.output_counts = _count(_padded([list(o) for o in output_ids], vocab_size, device), vocab_size)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        b.max_logprobs = max(asked) if asked else None
        return b

    @property
    def has_penalties(self) -> bool:
        return self.seen_mask is not None or self.output_counts is not None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, chosen token's raw logprob; None when no row asked
    top_ids: torch.Tensor | None  # [B, K] int64, best first; rows that asked for fewer slice
    top_logprobs: torch.Tensor | None  # [B, K] float32


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return new float32 [B, V] logits with the batch's penalties applied; input untouched."""
    out = logits.to(torch.float32, copy=True)
    if batch.seen_mask is not None:
        pen = batch.repetition_penalty
        out = torch.where(batch.seen_mask, torch.where(out > 0, out / pen, out * pen), out)
    if batch.output_counts is not None:
        counts = batch.output_counts
        out -= batch.frequency_penalty * counts + batch.presence_penalty * (counts > 0)
    return out


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask to -inf what top-k then top-p drop; one descending sort serves both."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if batch.top_k is not None:
        pos = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits.masked_fill_(pos >= batch.top_k, float("-inf"))
    if batch.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass strictly before it is < top_p: the top
        # token (mass 0 before it) always survives. top_p == 1 rows skip the
        # test, since float rounding could otherwise drop their tail.
        before = probs.cumsum(dim=-1) - probs
        drop = (before >= batch.top_p) & (batch.top_p < 1.0)
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(shape: torch.Size, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """[B, V] Exp(1) noise: global RNG for unseeded rows, per-row generators for seeded ones."""
    # -log(U), U ~ U[0, 1): torch's exponential_ draws the same distribution ~5x slower on the
    # CPU (21 vs 4.3 ms for 16 x 49k on one core). Inverse-CDF sampling (one uniform per row)
    # would be faster still but is not robust: a cumulative sum over the vocabulary carries
    # every logit's rounding noise, so bf16-level noise (a prefix-cache hit, another batch
    # shape) flipped ~50% of sampled tokens in a simulation, against ~0.3% for this race.
    q = torch.rand(shape, dtype=torch.float32, device=device).log_().neg_()
    for row, gen_seed in batch.seeded_rows:
        gen = torch.Generator(device=device).manual_seed(gen_seed)
        q[row] = torch.rand(shape[1], dtype=torch.float32, device=device, generator=gen).log_().neg_()
    # An exact 0 would turn probs / q into inf or nan.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _race_kernel_usable(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and race_sample_available()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), by the kernel's one pass a row on the CPU (the same indices)."""
    if logits.dim() == 2 and logits.is_contiguous() and _race_kernel_usable(logits):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def _row_keys(batch: SamplingBatch) -> torch.Tensor:
    """[B] int64 race keys: _mix_seed(seed, step) for seeded rows, the global RNG for the rest."""
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (batch.num_rows,), dtype=torch.int64)
    for row, gen_seed in batch.seeded_rows:
        keys[row] = gen_seed - (1 << 64) if gen_seed >= 1 << 63 else gen_seed
    return keys


def _filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits with -inf where top-k, top-p or min-p (decided at each row's temperature) drop a
    token; the logits themselves when no row filters, so an unfiltered row's input to the race
    is the same whatever else is batched."""
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        return logits
    scaled = logits.to(torch.float32) / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        scaled = _top_k_top_p(scaled, batch)
    drop = scaled == float("-inf")
    if batch.min_p is not None:
        probs = scaled.softmax(dim=-1)
        drop |= probs < batch.min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Stateless; the engine builds a SamplingBatch per step and calls this."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V] any float dtype (not modified); computes in float32.

        Unseeded random rows advance the global RNG of logits.device.
        """
        assert logits.shape == (batch.num_rows, batch.vocab_size), (logits.shape, batch.num_rows)
        if batch.all_greedy and not batch.has_penalties:
            # Fast path: upcasting half types to float32 is exact, so argmax is unchanged.
            token_ids = _argmax(logits)
        elif not batch.has_penalties and _race_kernel_usable(logits):
            token_ids = self._sample(logits, batch)  # the kernel reads the raw logits: no float32 copy
        else:
            token_ids = self._sample(apply_penalties(logits, batch), batch)
        if batch.max_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        # -9999 for a token a grammar masked (-inf), as vLLM reports it: JSON has no -Infinity.
        raw = logits.to(torch.float32).log_softmax(dim=-1).clamp_min_(-9999.0)  # [B, V]
        chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs, top_ids = raw.topk(batch.max_logprobs, dim=-1, sorted=True)
        return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: penalised float32 [B, V], owned by us (or, on the kernel path, the raw
        logits, not modified). Returns [B] int64."""
        if batch.all_greedy:
            return _argmax(logits)
        greedy_ids = _argmax(logits) if batch.greedy is not None else None
        if _race_kernel_usable(logits):
            sampled = race_sample(_filtered(logits, batch), 1.0 / batch.temperature.squeeze(1), _row_keys(batch))
            return sampled if greedy_ids is None else torch.where(batch.greedy, greedy_ids, sampled)
        logits = logits / batch.temperature
        if batch.top_k is not None or batch.top_p is not None:
            logits = _top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)  # [B, V]
        if batch.min_p is not None:
            threshold = batch.min_p * probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
        # argmax(probs / q) ignores each row's scale, so no renormalising is needed.
        sampled = (probs / _exponential_noise(probs.shape, batch, probs.device)).argmax(dim=-1)
        if greedy_ids is None:
            return sampled
        return torch.where(batch.greedy, greedy_ids, sampled)
