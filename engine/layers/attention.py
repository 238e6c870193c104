"""Paged attention over the KV pool, driven by a ForwardBatch (see engine/forward_batch.py)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVPool
from native.paged_attention import paged_decode_attention, write_kv
from native.prefill_attention import prefill_attention
from native.prefill_attention import usable as prefill_kernel_usable


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, causal: bool = False):
    """q [.., H, Lq, D], k/v [.., KVH, Lk, D] -> [.., H, Lq, D] (grouped-query aware).

    NOTE: on the CPU, torch's fused (flash) SDPA kernel only takes 4-D contiguous
    inputs with equal head counts; 3-D or enable_gqa inputs fall back to the math
    path, 10-15x slower for a 2k-token prefill. Hence the reshape and repeat here.
    """
    squeeze = q.dim() == 3
    if squeeze:  # masks come 4-D already ([1, 1, Lq, Lk], see forward_batch)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    out = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=mask,
                                         is_causal=causal, scale=scale)
    return out.squeeze(0) if squeeze else out


class PagedAttention(torch.nn.Module):
    """Attention for one layer: writes the step's K/V and reads the context from the pool."""

    def __init__(self, layer_id: int, sliding: bool, scale: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding = sliding
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, pool: KVPool):
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        if self.sliding:
            return self._sliding(q, k, v, fb, pool)
        li = pool.layer_index[self.layer_id]
        layer = pool.full[:, li]  # [P, 2, page_size, KVH, D] view
        write_kv(layer, fb.write_page, fb.write_off, k, v)
        b = fb.num_decode
        fused = bool(fb.prefills) and prefill_kernel_usable(q)
        # A step that is one prefill chunk and nothing else returns the kernel's output as it is.
        alone = fused and not b and len(fb.prefills) == 1 and fb.prefills[0].length == q.shape[0]
        out = None if alone else torch.empty_like(q)
        if b:  # one query per sequence: the C++ kernel reads the pages in place
            out[:b] = paged_decode_attention(q[:b].contiguous(), layer, fb.dec_pages, fb.dec_ctx, self.scale)
        for p in fb.prefills:
            s, n = p.start, p.length
            if not p.has_context:  # the step's own K/V are the whole context: [n, KVH, D]
                kk, vv = k[s:s + n], v[s:s + n]
            else:  # gathered from the pages: [ctx, KVH, D]
                kk, vv = (layer[p.pages, i].flatten(0, 1)[:p.ctx] for i in (0, 1))
            if fused:  # the kernel: causal from the chunk's offset in its context, no mask
                o = prefill_attention(q[s:s + n], kk, vv, self.scale)
                if alone:
                    return o
                out[s:s + n] = o
                continue
            mask = p.full_mask(q.dtype, q.device) if p.has_context else None
            o = _sdpa(q[s:s + n].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), mask, self.scale,
                      causal=mask is None)
            out[s:s + n] = o.transpose(0, 1)
        return out

    def _sliding(self, q, k, v, fb: ForwardBatch, pool: KVPool):
        li = pool.layer_index[self.layer_id]
        ring = pool.swa[:, li]  # [S, 2, W, KVH, D] view
        out = torch.empty_like(q)
        b = fb.num_decode
        if b:  # write first (see forward_batch), then read the ring as one page per sequence
            slot, idx, tok = fb.swa_write_slot[:b], fb.swa_write_idx[:b], fb.swa_write_tok[:b]
            ring[slot, 0, idx] = k[tok]
            ring[slot, 1, idx] = v[tok]
            out[:b] = paged_decode_attention(q[:b].contiguous(), ring, fb.dec_slots, fb.dec_swa_ctx, self.scale)
        w = ring.shape[2]
        fused = bool(fb.prefills) and prefill_kernel_usable(q)
        for p in fb.prefills:
            s, n = p.start, p.length
            if fused:  # the kernel, windowed: a chunk gets the bits it would get in one piece
                kk, vv = self._window_keys(ring[p.swa_slot], k[s:s + n], v[s:s + n], p.ctx - n, w)
                out[s:s + n] = prefill_attention(q[s:s + n], kk, vv, self.scale, w)
                continue
            if p.within_window:  # causal over its own keys
                kk, vv = k[s:s + n].transpose(0, 1), v[s:s + n].transpose(0, 1)  # [KVH, n, D]
                o = _sdpa(q[s:s + n].transpose(0, 1), kk, vv, None, self.scale, causal=True)
            elif not p.has_context:  # a first chunk longer than the window: nothing in the ring yet
                o = self._first_chunk_blocked(q[s:s + n], k[s:s + n], v[s:s + n], w)
            else:
                old = ring[p.swa_slot]  # [2, W, KVH, D]
                kk = torch.cat([old[0], k[s:s + n]]).transpose(0, 1)  # [KVH, W+n, D]
                vv = torch.cat([old[1], v[s:s + n]]).transpose(0, 1)
                o = _sdpa(q[s:s + n].transpose(0, 1), kk, vv, p.window_mask(q.dtype, q.device), self.scale)
            out[s:s + n] = o.transpose(0, 1)
        # Prefill chunks write only after all their queries have read the old ring.
        if fb.prefills:
            slot, idx, tok = fb.swa_write_slot[b:], fb.swa_write_idx[b:], fb.swa_write_tok[b:]
            ring[slot, 0, idx] = k[tok]
            ring[slot, 1, idx] = v[tok]
        return out

    @staticmethod
    def _window_keys(old: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nc: int, w: int):
        """Keys and values for the windowed kernel, a chunk of new tokens at positions nc ...:
        from position a (the first one the chunk's first query sees, rounded down to a multiple
        of 32, so key steps fall where they fall in a one-piece prefill) up to its last token.
        Positions below nc come from the ring `old` [2, W, KVH, D] (position p at p % W); the
        ones no query sees (below nc - w + 1) are zeros."""
        if nc == 0:
            return k, v
        lo = max(0, nc - w + 1)
        a = lo // 32 * 32
        idx = torch.arange(lo, nc, device=k.device) % w
        pad = k.new_zeros(lo - a, *k.shape[1:])
        return (torch.cat([pad, old[0, idx], k]), torch.cat([pad, old[1, idx], v]))

    def _first_chunk_blocked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int) -> torch.Tensor:
        """Sliding-window attention of a sequence's first n > w tokens: [n, H, D] -> [H, n, D].

        Queries in blocks of w: block b sees keys [(b - 1) w, (b + 1) w) at most, so each SDPA
        call is [w, 2w] with one shared mask, where the single-mask form costs [n, w + n] (at
        n = 2048, w = 512: 2.6x the work, all but w keys per row masked out).
        """
        n = q.shape[0]
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, n, D]
        out = torch.empty_like(qt)
        out[:, :w] = _sdpa(qt[:, :w], kt[:, :w], vt[:, :w], None, self.scale, causal=True)
        band = _band_mask(w, q.dtype, q.device)  # [1, 1, w, 2w]: query i sees keys (i, i + w]
        for b0 in range(w, n, w):
            nq = min(w, n - b0)
            lo = b0 - w
            out[:, b0:b0 + nq] = _sdpa(qt[:, b0:b0 + nq], kt[:, lo:b0 + nq], vt[:, lo:b0 + nq],
                                       band[..., :nq, :nq + w], self.scale)
        return out


@functools.cache
def _band_mask(w: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, w, 2w]: row i (query at block offset i) sees columns i + 1 .. i + w, the
    keys at offsets (i - w, i] relative to the block's first query."""
    i = torch.arange(w).unsqueeze(1)
    j = torch.arange(2 * w).unsqueeze(0)
    visible = (j > i) & (j <= i + w)
    return torch.zeros(w, 2 * w, dtype=dtype).masked_fill_(~visible, float("-inf"))[None, None].to(device)
