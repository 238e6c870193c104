"""Decode attention (one query token per sequence) straight from the paged KV pool.

The CPU kernel is `csrc/attention/paged_attention.cpp`; it reads K/V rows in place through
the page table, so no `[B, KVH, L, D]` copy of the context is ever made. It
registers `torch.ops.pdserve.paged_decode_attention`; the first call builds it
(native/loader.py). CUDA tensors take the plain-torch path (`reference_decode_attention`),
the test reference too; there is no other CPU path, so PDSERVE_KERNELS=torch leaves it on.
"""
from __future__ import annotations

import functools

import torch

from native.loader import load_kernel

# -fopenmp: at::parallel_for is header code over OpenMP; without it the kernel runs
# on one thread. The extension shares torch's already-loaded libgomp.so.1.
_CFLAGS = ("-O3", "-march=native", "-fopenmp")


@functools.cache
def _load_ops() -> None:
    """Build (or find cached) and load the kernel into torch.ops.pdserve."""
    load_kernel("native.paged_attention", "paged_attention_cpu", ["attention/paged_attention.cpp"], _CFLAGS,
                headers=["include/cephes_exp.h", "include/bf16_vec.h", "include/lane_pairs.h",
                         "include/paged_attention_item.h", "include/paged_attention_avx2.h"])


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns [B, H, D].

    q: [B, H, D] with H a multiple of KVH, same dtype as kv (fp32, bf16 or fp16).
    kv: [num_pages, 2, page_size, KVH, D] (dim 1: 0 = K, 1 = V), any strides for the
        first three dims (e.g. `pool.full[:, layer]`, or `pool.swa[:, layer]` with a
        ring slot as one page of size `window`); each [KVH, D] row block must be dense.
    page_table: [B, max_pages] int32/int64; token t of sequence b is
        `kv[page_table[b, t // page_size], :, t % page_size]`. Entries past a
        sequence's last page are not read (padding may be anything).
    ctx_lens: [B] int32/int64, 0 <= ctx_lens[b] <= max_pages * page_size; a 0 row
        yields zeros.
    Computes softmax(scale * q.k) @ v per head in fp32 and reads nothing else; mutates
    nothing. CUDA tensors, and head dims the kernel lacks (not a multiple of 32, or
    over 512), take `reference_decode_attention`. Raises RuntimeError on bad shapes,
    dtypes, strides or page ids, or when no C++ compiler can build the kernel.
    """
    d = q.shape[-1]
    if q.is_cuda or kv.is_cuda or d % 32 or d > 512:  # the kernel's head dims: 32, 64, .., 512
        return reference_decode_attention(q, kv, page_table, ctx_lens, scale)
    _load_ops()
    return torch.ops.pdserve.paged_decode_attention(q, kv, page_table, ctx_lens, scale)


def write_kv(kv: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv[pages, 0, offs] = k and kv[pages, 1, offs] = v: one step's K/V [T, KVH, D] into a
    layer's pages ([num_pages, 2, page_size, KVH, D], as paged_decode_attention reads them).
    On the CPU one call of row copies (csrc/attention/paged_attention.cpp, in place of two
    index_puts), else the index_puts. Raises on an index outside the pool before writing."""
    if (kv.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu" and kv.dim() == 5
            and pages.dtype == offs.dtype == torch.long and k.dtype == v.dtype == kv.dtype
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (kv, k, v))):
        _load_ops()
        torch.ops.pdserve.write_kv(kv, pages, offs, k, v)
        return
    kv[pages, 0, offs] = k
    kv[pages, 1, offs] = v


def set_split_threads(n: int) -> None:
    """Plan split-K for `n` threads whatever torch's thread count (0: follow it), so that a
    sequence's result does not change when a step runs on borrowed threads."""
    _load_ops()
    torch.ops.pdserve.set_decode_split_threads(n)


def reference_decode_attention(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor,
                               ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch `paged_decode_attention` (gather pages, mask, fp32 softmax); same contract."""
    b, h, d = q.shape
    kvh = kv.shape[3]
    g = kv[page_table.long()].float()  # [B, Pmax, 2, ps, KVH, D]
    g = g.transpose(1, 2).flatten(2, 3)  # [B, 2, L, KVH, D]
    k = g[:, 0].permute(0, 2, 1, 3).repeat_interleave(h // kvh, dim=1)  # [B, H, L, D]
    v = g[:, 1].permute(0, 2, 1, 3).repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    valid = torch.arange(k.shape[2], device=q.device) < ctx_lens.to(q.device).long()[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row (ctx 0) -> zeros
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)
