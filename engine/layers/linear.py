"""nn.Linear with a bandwidth-bound path for decode steps (a few rows, bf16, CPU).

A decode step multiplies a handful of rows by every weight matrix once, so its
time is the time to stream the weights from memory. `csrc/small_linear.cpp`
(torch.ops.pdserve.small_linear: AMX tiles, else AVX512-BF16 dot products)
streams them at close to the machine's read bandwidth, where oneDNN's bf16 GEMV
reached about half of it, and gives each row the same result whatever batch it
is in. Larger inputs (prefill chunks) keep torch's GEMM (oneDNN). The first call
JIT-builds the kernel (`-march=native`); on a CPU or compiler without
AVX512-BF16 the op says it is unsupported and torch's linear is used.
Set PDSERVE_SMALL_LINEAR=0 to force torch's path (for comparison).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.jit import load_kernel

# Rows up to which the kernel is used: decode batches. Prefill chunks (hundreds of
# rows) are compute-bound and oneDNN's blocked GEMM is faster there.
MAX_ROWS = 32
_CFLAGS = ("-O3", "-march=native", "-fopenmp")


@functools.cache
def small_linear_available() -> bool:
    """True when the kernel is built and this CPU runs it (cached per process)."""
    if os.environ.get("PDSERVE_SMALL_LINEAR", "1") == "0":
        return False
    load_kernel("engine.layers.linear", "small_linear_cpu", ["small_linear.cpp"], _CFLAGS, headers=["include/amx_tiles.h"])
    return bool(torch.ops.pdserve.small_linear_supported())


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias, all bf16 contiguous on the CPU -> [M, N] bf16.

    Accumulates in fp32 in an order that depends only on K, rounds once. Raises
    RuntimeError on other dtypes, layouts or shapes, or when unsupported here.
    """
    return torch.ops.pdserve.small_linear(x, weight, bias)


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and names) that routes decode-sized inputs to the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dim() == 2 and x.shape[0] <= MAX_ROWS and w.dtype == torch.bfloat16 and x.dtype == w.dtype
                and w.device.type == "cpu" and small_linear_available()):
            return small_linear(x.contiguous(), w, self.bias)
        return F.linear(x, w, self.bias)
