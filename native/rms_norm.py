"""RMSNorm with the residual add fused in (csrc/elementwise/rms_norm.cpp, torch.ops.pdserve.rms_norm:
one call instead of about eight small ops), for engine/layers/norm.py, which keeps the torch
formulas the kernel reproduces for everything else (CUDA, the [T, H, D] views q/k norms see,
PDSERVE_KERNELS=torch).
"""
from __future__ import annotations

import functools

import torch

from native import build

# fp32 rows up to which the kernel runs (decode steps): its fp32 path is one scalar pass
# per row, slower than torch's vectorised ops for prefill chunks. bf16 rows are vectorised
# and take the kernel at any count.
MAX_FP32_ROWS = 64


@functools.cache
def available() -> bool:
    """The kernel is built and allowed (not PDSERVE_KERNELS=torch)."""
    return build("native.rms_norm", "rms_norm_cpu", ["elementwise/rms_norm.cpp"], ["include/bf16_vec.h"])


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm takes x: 2-D contiguous on the CPU, bf16 (fp32: up to MAX_FP32_ROWS rows),
    the weight's dtype."""
    if x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        return False
    if x.dtype == torch.float32 and x.shape[0] > MAX_FP32_ROWS:
        return False
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    return available()


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) (residual None: (norm(x), x)); gemma scales by
    (1 + weight). Only where usable(x, weight)."""
    return torch.ops.pdserve.rms_norm(x, residual, weight, eps, gemma)
