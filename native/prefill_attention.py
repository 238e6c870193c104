"""Causal attention of a prefill chunk on the CPU's tile unit, or its AVX512-BF16 dot products
where there is no AMX (`csrc/attention/prefill_attention.cpp`), in place of torch's SDPA.

Both products run as AMX tile products (AVX512-BF16 dot products without AMX) and the softmax
lane-wise over keys. It takes q/k/v in the layout the projections produce ([tokens, heads, D],
any token stride), so no transposes or head repeats are made. bf16 on a CPU with AVX512-BF16
only; anything else (fp32 parity runs, CUDA, other CPUs, PDSERVE_KERNELS=torch) keeps SDPA.
The kernel gives a query the same bits however its prompt is chunked, which SDPA does not (its
blocking depends on the chunk's length).
"""
from __future__ import annotations

import functools

import torch

from native import build


@functools.cache
def prefill_attention_available() -> bool:
    """True when the kernel is built and this CPU runs it (cached per process)."""
    return build("native.prefill_attention", "prefill_attention_cpu", ["attention/prefill_attention.cpp"],
                 ["include/amx_tiles.h", "include/bf16_vec.h", "include/cephes_exp.h", "include/transpose16.h"]
                 ) and bool(torch.ops.pdserve.prefill_attention_supported())


def usable(q: torch.Tensor) -> bool:
    """Whether `q` (and its k/v) can take the kernel: bf16 on the CPU, head dim a multiple of 32, <= 256."""
    d = q.shape[-1]
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and d % 32 == 0 and d <= 256
            and prefill_attention_available())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int = 0) -> torch.Tensor:
    """q [n, H, D], k/v [L, KVH, D] (bf16, each token's heads contiguous; L >= n) -> [n, H, D]:
    softmax(scale * q k^T) v with query i seeing keys 0 .. L - n + i (the chunk's keys are the
    last n), and with window > 0 only those above L - n + i - window. Accumulates in fp32.
    A query's bits depend on its keys and their indices mod 32 only, not on the chunk it is
    in. Mutates nothing. Raises RuntimeError on bad shapes or layouts."""
    return torch.ops.pdserve.prefill_attention(q, k, v, scale, window)
