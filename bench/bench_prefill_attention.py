"""Prefill attention: the AMX kernel (csrc/attention/prefill_attention.cpp) against torch's SDPA, same run.

    .venv/bin/python bench/bench_prefill_attention.py [--lens 530 2048] [--context 512:4096]
        [--pairs 25] [--threads 1]

One layer's causal attention of a prefill chunk of n tokens over ctx keys (ctx = n: a first
chunk; ctx > n: a chunk after a cached prefix), q/k/v as strided views of one
[ctx, H + 2 KVH, D] projection (as the engine has them), bf16. The reference is the engine's
SDPA path (`engine.layers.attention._sdpa`: transposes, GQA head repeat, torch's fused CPU
kernel; causal for a first chunk, the engine's additive mask after a prefix).
The two sides alternate call by call, and the speed-up is the median of per-pair ratios (this
VM's speed drifts by tens of percent within minutes). Shapes: SmolLM2-135M (9 q / 3 kv heads,
D 64) and Gemma 3 270M (4 / 1, D 256). Prints a markdown table. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from engine.layers.attention import _sdpa
from native.prefill_attention import (
    prefill_attention,
    prefill_attention_available,
)

SHAPES = (("smollm2-135m", 9, 3, 64), ("gemma-3-270m", 4, 1, 256))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[530, 2048])
    ap.add_argument("--context", nargs="*", default=["512:4096"], help="n:ctx chunks after a prefix")
    ap.add_argument("--pairs", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not prefill_attention_available():
        raise SystemExit("the kernel needs a CPU with AMX (and a C++ compiler)")
    torch.set_num_threads(args.threads)
    cases = [(n, n) for n in args.lens] + [tuple(int(x) for x in c.split(":")) for c in args.context]
    print(f"| shape | tokens / keys | SDPA ms | kernel ms | speed-up (median of {args.pairs} pairs) |")
    print("|---|---:|---:|---:|---:|")
    for name, heads, kv_heads, d in SHAPES:
        for n, ctx in cases:
            qkv = torch.randn(ctx, heads + 2 * kv_heads, d).bfloat16()
            q, k, v = qkv[ctx - n:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
            scale = d ** -0.5
            mask = None
            if ctx > n:  # the engine's additive mask (forward_batch): key j visible to query i iff j <= ctx - n + i
                i, j = torch.arange(n).unsqueeze(1), torch.arange(ctx).unsqueeze(0)
                mask = torch.zeros(n, ctx, dtype=torch.bfloat16).masked_fill_(j > ctx - n + i, float("-inf"))[None, None]
            sdpa = partial(_sdpa, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale,
                           causal=mask is None)
            kernel = partial(prefill_attention, q, k, v, scale)

            for fn in (sdpa, kernel, sdpa, kernel):  # warm-up
                fn()
            pairs = [(timed(sdpa), timed(kernel)) for _ in range(args.pairs)]
            a = statistics.median(p[0] for p in pairs)
            b = statistics.median(p[1] for p in pairs)
            ratio = statistics.median(p[0] / p[1] for p in pairs)
            print(f"| {name} ({heads}/{kv_heads} heads, D {d}) | {n} / {ctx} | {a * 1e3:.2f} | {b * 1e3:.2f} "
                  f"| {ratio:.2f}x |")


if __name__ == "__main__":
    main()
