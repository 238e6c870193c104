"""Decode attention: the paged CPU kernel next to the torch path the engine decodes with today.

    .venv/bin/python bench/bench_attention.py [--batches 1 8 32 64] [--ctx 512 2048 8192] [--reps 7] [--threads N]
        [--dtype bfloat16|float32] [--layers 1]

For each model shape, batch size B and context length (every sequence at that
length) it times one layer's decode attention over a bf16 (or --dtype float32: the pool of
models that compute in float32, CPUs without AVX512-BF16) pool laid out like the
engine's (`[pages, layers, 2, page_size, KVH, D]`, layer view `pool[:, 0]`, pages
shuffled) and prints the median of --reps runs:
  kernel  native.paged_attention.paged_decode_attention
  torch   the decode branch of PagedAttention.forward: gather the pages, reshape to
          [B, KVH, L, D], repeat to H heads, contiguous, SDPA with a bool mask
and speed-up = torch / kernel, the kernel's K/V read rate (GB/s), plus the largest
|kernel - torch| as a sanity check. --layers N (default 1: every call reads the same layer, from
cache where it fits) has each call read the next of N layers in turn, as a decode step does: with 30 (SmolLM2's) the K/V come from memory, not
from the cache (the pool is then N x batch x ctx x KVH x D x 2 elements: mind the RAM).
Other processes on the machine add noise; the medians absorb some of it.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from native.paged_attention import paged_decode_attention

MODELS = {  # name: (H, KVH, D)
    "smollm2": (9, 3, 64),
    "gemma3": (4, 1, 256),
}
PAGE_SIZE = 16
NUM_LAYERS = 2  # at least: >1 so the layer view is strided across pages, as in the engine


def torch_decode(q: torch.Tensor, layer: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q [B, H, D], layer [P, 2, ps, KVH, D], pages [B, Pmax], mask [B, 1, 1, Pmax*ps] -> [B, H, D]."""
    g = layer[pages]  # [B, Pmax, 2, ps, KVH, D]
    kv = g.transpose(2, 1).flatten(2, 3).transpose(2, 3)  # [B, 2, KVH, L, D]
    groups = q.shape[1] // kv.shape[2]
    k = kv[:, 0].repeat_interleave(groups, dim=1).contiguous()  # [B, H, L, D]
    v = kv[:, 1].repeat_interleave(groups, dim=1).contiguous()
    out = F.scaled_dot_product_attention(q[:, :, None].contiguous(), k, v, attn_mask=mask, scale=scale)
    return out.squeeze(2)


def median_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()  # warm-up: builds the kernel on first use
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_row(h: int, kvh: int, d: int, batch: int, ctx: int, reps: int,
              dtype: torch.dtype = torch.bfloat16, layers: int = 1) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(batch * 100_003 + ctx)
    per_seq = -(-ctx // PAGE_SIZE)
    num_pages = batch * per_seq + 1
    pool = torch.randn(num_pages, max(NUM_LAYERS, layers), 2, PAGE_SIZE, kvh, d, generator=gen).to(dtype)
    views = itertools.cycle([pool[:, i] for i in range(max(1, layers))])  # [P, 2, ps, KVH, D], strided
    layer = pool[:, 0]
    pages = torch.randperm(num_pages, generator=gen)[: batch * per_seq].view(batch, per_seq)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.long)
    mask = (torch.arange(per_seq * PAGE_SIZE) < ctx_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    q = torch.randn(batch, h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    kernel = median_ms(lambda: paged_decode_attention(q, next(views), pages, ctx_lens, scale), reps)
    ref = median_ms(lambda: torch_decode(q, next(views), pages, mask, scale), reps)
    diff = (paged_decode_attention(q, layer, pages, ctx_lens, scale).float()
            - torch_decode(q, layer, pages, mask, scale).float()).abs().max().item()
    return kernel, ref, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--ctx", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="q and K/V pool dtype")
    ap.add_argument("--layers", type=int, default=1, help="layers read in turn, one a call (30: K/V from memory)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, page_size {PAGE_SIZE}, "
          f"{args.layers} layer(s) read in turn, median of {args.reps}")
    print("| model | H/KVH/D | B | ctx | kernel ms | torch ms | speed-up | kernel K/V GB/s | max abs diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        h, kvh, d = MODELS[name]
        for batch in args.batches:
            for ctx in args.ctx:
                kernel, ref, diff = bench_row(h, kvh, d, batch, ctx, args.reps, dtype, args.layers)
                gbs = batch * ctx * kvh * d * 2 * dtype.itemsize / kernel / 1e6
                print(f"| {name} | {h}/{kvh}/{d} | {batch} | {ctx} | {kernel:.3f} | {ref:.3f} | "
                      f"{ref / kernel:.1f}x | {gbs:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
