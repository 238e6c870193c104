"""paged_decode_attention (the CPU kernel) against the plain-torch reference.

Pools are laid out like the engine's (`[pages, layers, 2, page_size, KVH, D]`, one
layer viewed, so pages are strided) with shuffled page tables and ragged context
lengths. The first test in a fresh cache builds the kernel (~20 s on 2 cores).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from native.paged_attention import paged_decode_attention, reference_decode_attention

TOL = {  # (atol, rtol): fp32 differs from the reference only in summation order
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def make_case(ctx_lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int,
              dtype: torch.dtype, seed: int = 0, layers: int = 3, layer: int = 1, pad: int = 0):
    """(q, kv, page_table, ctx_lens): kv = pool[:, layer] of a bigger pool; each sequence
    gets distinct random pages; table rows are padded with `pad` past their last page."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page_size) for n in ctx_lens]
    max_pages = max(max(per_seq), 1)
    num_pages = sum(per_seq) + 7  # spare pages nobody reads
    pool = torch.randn(num_pages, layers, 2, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    kv = pool[:, layer]
    ids = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(ctx_lens), max_pages), pad, dtype=torch.long)
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.long)
        ids = ids[n:]
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=gen).to(dtype)
    return q, kv, table, torch.tensor(ctx_lens, dtype=torch.long)


def check(q, kv, table, ctx, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = paged_decode_attention(q, kv, table, ctx, scale)
    ref = reference_decode_attention(q, kv, table, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 256), (4, 1, 256)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_matches_reference(dtype, heads, kv_heads, head_dim, page_size):
    # 1 token, exact page multiples, one past a page, long, and odd lengths.
    ctx = [1, page_size, 2 * page_size, page_size + 1, 3000, 37, 129]
    check(*make_case(ctx, heads, kv_heads, head_dim, page_size, dtype))


@pytest.mark.parametrize("batch", [1, 2, 7, 33])
def test_batch_sizes(batch):
    gen = torch.Generator().manual_seed(batch)
    ctx = torch.randint(1, 700, (batch,), generator=gen).tolist()
    check(*make_case(ctx, 9, 3, 64, 16, torch.float32, seed=batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_other_head_dims_and_fp16(dtype):
    check(*make_case([5, 300, 64], 12, 4, 128, 16, dtype))
    check(*make_case([5, 300, 64], 6, 2, 96, 16, dtype))  # runtime head-dim path
    check(*make_case([5, 300], 4, 2, 80, 16, dtype))  # not a multiple of 32: torch fallback


def test_empty_contexts_give_zeros():
    q, kv, table, ctx = make_case([0, 50, 0, 1], 9, 3, 64, 16, torch.float32, pad=-1)
    out = check(q, kv, table, ctx)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    q, kv, table, ctx = make_case([0, 0], 4, 1, 256, 16, torch.bfloat16)
    assert torch.equal(paged_decode_attention(q, kv, table, ctx, 0.1), torch.zeros_like(q))


@pytest.mark.parametrize("threads", [2, 8])
def test_split_context_across_threads(threads):
    # Fewer (sequence, kv head) pairs than threads: long contexts are cut into chunks
    # whose softmax states are merged; short and empty sequences leave empty chunks.
    # (The kernel uses a thread per 2048 rows at most, so these contexts are long.)
    with num_threads(threads):
        check(*make_case([5000], 4, 1, 256, 16, torch.float32))
        check(*make_case([4096, 100, 0], 4, 1, 64, 64, torch.float32))
        check(*make_case([6000, 1], 8, 2, 128, 16, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (8, 2, 128)])
def test_sequence_bits_do_not_depend_on_the_batch(heads, kv_heads, head_dim, dtype):
    # A decode row's attention has the same bits alone and next to other sequences (tiles
    # of 16 tokens reduced together, partial last tiles, several kv heads per item; fp32 on
    # an AVX2 CPU without AVX-512: blocks of 8 tokens, short blocks padded).
    q, kv, table, ctx = make_case([531, 17, 64, 1, 250, 7], heads, kv_heads, head_dim, 16, dtype, seed=9)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    with num_threads(1):
        together = paged_decode_attention(q, kv, table, ctx, 0.125)
        for b in range(len(ctx)):
            alone = paged_decode_attention(q[b:b + 1], kv, table[b:b + 1], ctx[b:b + 1], 0.125)
            assert torch.equal(alone[0].view(bits), together[b].view(bits)), b


def test_int32_indices_and_padded_table():
    q, kv, table, ctx = make_case([40, 200, 3], 9, 3, 64, 16, torch.float32, pad=-1)
    ref = reference_decode_attention(q, kv, table, ctx, 0.125)
    out = paged_decode_attention(q, kv, table.int(), ctx.int(), 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_ring_as_pages():
    # The SWA ring [slots, layers, 2, W, KVH, D][:, li]: a slot is one page of W tokens.
    gen = torch.Generator().manual_seed(3)
    ring = torch.randn(6, 2, 2, 512, 1, 256, generator=gen)[:, 0]
    q = torch.randn(3, 4, 256, generator=gen)
    slots = torch.tensor([[4], [0], [2]])
    check(q, ring, slots, torch.tensor([512, 17, 300]))


def test_large_scores_are_stable():
    # Scores in the hundreds: the running max must keep exp() from overflowing.
    q, kv, table, ctx = make_case([900, 33], 4, 2, 64, 16, torch.float32, seed=5)
    check(q * 30, kv, table, ctx, scale=1.0)


def test_rejects_bad_inputs():
    q, kv, table, ctx = make_case([40, 20], 4, 2, 64, 16, torch.float32)
    bad = table.clone()
    bad[1, 0] = kv.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention(q, kv, bad, ctx, 0.1)
    with pytest.raises(RuntimeError, match="ctx_lens"):
        paged_decode_attention(q, kv, table, torch.tensor([40, 10_000]), 0.1)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        paged_decode_attention(q[:, :3], kv, table, ctx, 0.1)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        paged_decode_attention(q.bfloat16(), kv, table, ctx, 0.1)
    swapped = torch.randn(kv.shape[0], 2, 16, 64, 2).transpose(3, 4)  # [P, 2, ps, KVH, D], D strided
    with pytest.raises(RuntimeError, match="dense"):
        paged_decode_attention(q, swapped, table, ctx, 0.1)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1)])
def test_bf16_dot_products_and_fp32_products_both_match_the_reference(head_dim, heads, kv_heads):
    """bf16 K/V take vdpbf16ps products where the CPU has AVX512-BF16 (token pairs for P V, the
    weights rounded to bf16; a short tile's odd token paired with itself at weight 0), else the
    fp32 products; set_decode_bf16_dots(False) forces the latter. Odd and tile-crossing lengths."""
    ops = torch.ops.pdserve
    paged_decode_attention(*make_case([5], 2, 1, 64, 16, torch.bfloat16), 0.125)  # builds the kernel
    case = make_case([1, 7, 63, 65, 130, 301], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=3)
    try:
        outs = []
        for on in (True, False):
            ops.set_decode_bf16_dots(on)
            outs.append(check(*case))
    finally:
        ops.set_decode_bf16_dots(True)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [1, 4, 300, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_equals_the_index_puts(tokens, dtype):
    from native.paged_attention import write_kv
    g = torch.Generator().manual_seed(tokens)
    pool = torch.randn(64, 3, 2, 16, 3, 64, generator=g).to(dtype)  # [pages, layers, 2, ps, KVH, D]
    want = pool.clone()
    slots = torch.randperm(64 * 16, generator=g)[:tokens]
    pages, offs = slots // 16, slots % 16
    qkv = torch.randn(tokens, 15 * 64, generator=g).to(dtype)  # k and v are strided views, as in a layer
    k, v = qkv[:, 9 * 64:12 * 64].view(tokens, 3, 64), qkv[:, 12 * 64:].view(tokens, 3, 64)
    write_kv(pool[:, 1], pages, offs, k, v)
    want[:, 1][pages, 0, offs] = k
    want[:, 1][pages, 1, offs] = v
    assert torch.equal(pool, want)


def test_write_kv_rejects_an_index_outside_the_pool_before_writing():
    from native.paged_attention import write_kv
    pool = torch.zeros(4, 2, 16, 2, 32, dtype=torch.bfloat16)
    k = torch.ones(3, 2, 32, dtype=torch.bfloat16)
    for pages, offs in (([0, 1, 4], [0, 0, 0]), ([0, 1, 2], [0, 16, 0]), ([0, -1, 2], [0, 0, 0])):
        with pytest.raises(RuntimeError, match="outside a pool"):
            write_kv(pool, torch.tensor(pages), torch.tensor(offs), k, k)
        assert not pool.any()
