"""Sliding-window attention of a first prefill chunk longer than the window, in window-sized
query blocks (PagedAttention._first_chunk_blocked), against one SDPA call with the full mask."""
from __future__ import annotations

import pytest
import torch

from engine.layers.attention import PagedAttention, _sdpa


@pytest.mark.parametrize("n,w", [(9, 8), (16, 8), (21, 8), (40, 5)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_blocked_first_chunk_equals_single_masked_call(n, w, heads, kv_heads):
    g = torch.Generator().manual_seed(n * w + heads)
    q = torch.randn(n, heads, 16, generator=g)
    k = torch.randn(n, kv_heads, 16, generator=g)
    v = torch.randn(n, kv_heads, 16, generator=g)
    attn = PagedAttention(layer_id=0, sliding=True, scale=0.25)
    got = attn._first_chunk_blocked(q, k, v, w)  # [heads, n, D]
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    visible = (j <= i) & (j > i - w)
    mask = torch.zeros(n, n).masked_fill_(~visible, float("-inf"))[None, None]
    ref = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, 0.25)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
