"""Per-step attention metadata: which KV slots each token writes and which keys each reads.

A step runs a flat list of T tokens. Decode entries (generated tokens: one a
sequence while decoding, several where a sequence recomputes the ones it had
generated) come first and are attended as one padded batch, a row per token;
each prefill chunk (prompt tokens, even a single one) is attended on its own.

Full-attention layers: new K/V are written into the sequence's pages first, then
each query reads keys [0, its position] through the page table.
Sliding-window layers, prefill chunks: each query reads the sequence's ring as it
was before the step (positions num_computed-window .. num_computed-1) plus the
step's new keys, masked to the window (key visible iff q - window < k <= q);
afterwards the last `window` new tokens are written into the ring.
Sliding-window layers, one-token entries: the new token is written into the ring
first (it replaces position p - window, which query p no longer sees), then the
ring is read like a single page of min(p + 1, window) valid entries. A sequence
appears once per step, so this never disturbs a prefill chunk's reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence


@dataclass
class PrefillMeta:
    start: int  # first token index in the step's flat batch
    length: int  # new tokens
    ctx: int  # full layers' keys: num_computed + length (the chunk's own keys are the last `length`)
    pages: torch.Tensor  # [num_pages] covering positions [0, ctx)
    swa_slot: int
    window: int = 0  # the sliding-window layers' window (0: the model has none)
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _swa_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def has_context(self) -> bool:
        """Whether keys before the chunk exist (a later chunk, or a prefix-cache hit)."""
        return self.ctx > self.length

    def full_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[1, 1, length, ctx] additive: query i sees keys 0 .. ctx - length + i. Built on first use
        and kept for the step's other layers; the AMX prefill kernel needs none (at 2048 new tokens
        over 10k keys building it took ~70 ms a step)."""
        if self._mask is None:
            q_pos = torch.arange(self.ctx - self.length, self.ctx)
            self._mask = _additive(torch.arange(self.ctx).unsqueeze(0) <= q_pos.unsqueeze(1), dtype).to(device)
        return self._mask

    @property
    def within_window(self) -> bool:
        """A first chunk that fits the window: nothing in the ring yet and no key out of reach,
        so sliding-window layers attend causally over its own keys, without a mask."""
        return not self.has_context and self.length <= self.window

    def window_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[1, 1, length, window + length] additive visibility of (the ring as it was, the new
        keys) for sliding-window layers on SDPA; built on first use and kept for the step's other
        layers (the AMX prefill kernel needs none)."""
        if self._swa_mask is None:
            nc = self.ctx - self.length
            self._swa_mask = _additive(_ring_mask(nc, torch.arange(nc, self.ctx), self.window), dtype).to(device)
        return self._swa_mask


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_page: torch.Tensor  # [T] page id per token (full layers)
    write_off: torch.Tensor  # [T] offset within the page
    num_decode: int  # B: the first B tokens are decode rows (generated tokens)
    dec_pages: torch.Tensor | None  # [B, Pmax] page table (padded with page 0)
    dec_ctx: torch.Tensor | None  # [B] keys per sequence incl. the new token (full layers)
    dec_slots: torch.Tensor | None  # [B, 1] SWA slot per sequence, a one-page table into the rings
    dec_swa_ctx: torch.Tensor | None  # [B] valid ring entries once the new token is written
    prefills: list[PrefillMeta]
    swa_write_slot: torch.Tensor | None  # [Nw] ring writes; the first num_decode are the one-token entries
    swa_write_idx: torch.Tensor | None  # [Nw] ring index (position % window)
    swa_write_tok: torch.Tensor | None  # [Nw] token index in the flat batch
    logits_indices: torch.Tensor  # [S] token index whose logits are sampled
    window: int
    # [E] token indices whose logits give prompt logprobs (Sequence.prompt_logprob_rows), in
    # scheduled order; None when no sequence of the step asks for them.
    prompt_indices: torch.Tensor | None = None
    # Per rope type (layer type): (cos, sin) [T, 1, D] for this step's positions; set by the model.
    rope: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _ring_mask(num_computed: int, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[len(q_pos), window + len(q_pos)] visibility of (old ring, new keys) for queries q_pos."""
    r = torch.arange(window)
    base = num_computed - 1
    ring_pos = base - torch.remainder(base - r, window)  # position held at ring index r
    n = q_pos.shape[0]
    new_pos = torch.arange(num_computed, num_computed + n)
    key_pos = torch.cat([ring_pos, new_pos])
    valid = torch.cat([ring_pos >= 0, torch.ones(n, dtype=torch.bool)])
    q = q_pos.unsqueeze(1)
    return valid & (key_pos <= q) & (key_pos > q - window)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [Lq, Lk] -> additive [1, 1, Lq, Lk] in the model dtype.

    NOTE: torch's fused CPU attention takes only 4-D masks; a 3-D or [Lq, Lk] mask
    drops to the math path (about 8x slower for a 1k x 3k chunk), and additive
    float masks run faster than boolean ones.
    """
    out = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return out[None, None]


def build_forward_batch(scheduled: list[tuple[Sequence, int]], page_size: int, window: int,
                        needs_logits: list[bool], device: torch.device,
                        prompt_rows: list[int] | None = None) -> ForwardBatch:
    """Flatten `scheduled` (decode entries first) into tensors for one model step; the masks that
    torch's SDPA paths need are built on first use (PrefillMeta.full_mask / window_mask).

    Precondition: every sequence has pages for num_computed + n tokens and, for
    sliding models, an SWA slot.
    """
    ids: list[int] = []
    pos: list[int] = []
    wpage: list[int] = []
    woff: list[int] = []
    logits_idx: list[int] = []
    dec_tables: list[list[int]] = []
    dec_ctx: list[int] = []
    dec_slots: list[int] = []
    prefills: list[PrefillMeta] = []
    sw_slot: list[int] = []
    sw_idx: list[int] = []
    sw_tok: list[int] = []
    num_decode = 0
    prompt_idx: list[int] = []
    for i, ((seq, n), want_logits) in enumerate(zip(scheduled, needs_logits)):
        start = len(ids)
        if prompt_rows:
            prompt_idx.extend(range(start, start + prompt_rows[i]))
        nc = seq.num_computed
        toks = seq.token_ids[nc:nc + n]
        ids.extend(toks)
        positions = range(nc, nc + n)
        pos.extend(positions)
        pages = seq.pages
        wpage.extend(pages[p // page_size] for p in positions)
        woff.extend(p % page_size for p in positions)
        if want_logits:
            logits_idx.append(start + n - 1)
        if window:
            for j in range(max(0, n - window), n):
                sw_slot.append(seq.swa_slot)
                sw_idx.append((nc + j) % window)
                sw_tok.append(start + j)
        ctx = nc + n
        num_ctx_pages = -(-ctx // page_size)
        if seq.decodes(n):  # a row per token, each reading the keys up to its own position
            assert len(prefills) == 0, "decode entries must come first"
            assert n == 1 or not window, "a sliding-window model recomputes one generated token a step"
            num_decode += n
            for c in range(nc + 1, ctx + 1):
                dec_tables.append(pages[:-(-c // page_size)])
                dec_ctx.append(c)
            if window:
                dec_slots.append(seq.swa_slot)
        else:
            prefills.append(PrefillMeta(
                start=start, length=n, ctx=ctx, pages=torch.tensor(pages[:num_ctx_pages], dtype=torch.long),
                swa_slot=seq.swa_slot if window else -1, window=window))
    dec_pages = dec_ctx_t = dec_slot_t = dec_swa_ctx = None
    if num_decode:
        pmax = max(len(t) for t in dec_tables)
        dec_pages = torch.tensor([t + [0] * (pmax - len(t)) for t in dec_tables], dtype=torch.long)
        dec_ctx_t = torch.tensor(dec_ctx, dtype=torch.long)
        if window:
            dec_slot_t = torch.tensor(dec_slots, dtype=torch.long).unsqueeze(1)
            dec_swa_ctx = dec_ctx_t.clamp(max=window)
    to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
    for p in prefills:
        p.pages = to(p.pages)
    lt = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=lt(ids), positions=lt(pos), write_page=lt(wpage), write_off=lt(woff),
        num_decode=num_decode, dec_pages=to(dec_pages), dec_ctx=to(dec_ctx_t), dec_slots=to(dec_slot_t),
        dec_swa_ctx=to(dec_swa_ctx), prefills=prefills,
        swa_write_slot=lt(sw_slot) if window else None, swa_write_idx=lt(sw_idx) if window else None,
        swa_write_tok=lt(sw_tok) if window else None, logits_indices=lt(logits_idx), window=window,
        prompt_indices=lt(prompt_idx) if prompt_idx else None)
