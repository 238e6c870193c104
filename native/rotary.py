"""Rotary embedding in one pass (csrc/elementwise/rotary.cpp, torch.ops.pdserve.rotary), bitwise
equal to engine/layers/rotary.py's torch ops, which run for everything it does not take."""
from __future__ import annotations

import functools

import torch

from native import build


@functools.cache
def fused_rotary_available() -> bool:
    """The kernel is built and allowed (not PDSERVE_KERNELS=torch)."""
    return build("native.rotary", "rotary_cpu", ["elementwise/rotary.cpp"], ["include/bf16_vec.h"])


def usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [T, heads, D] bf16 on the CPU, D a multiple of 32, each token's heads dense; bf16 tables."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 3 and x.shape[-1] % 32 == 0
            and x.stride(-1) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[-1])
            and cos.dtype == sin.dtype == torch.bfloat16 and fused_rotary_available())


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the step's tables ([T, 1, D] each); only where usable(x, cos, sin)."""
    t, d = x.shape[0], x.shape[-1]
    return torch.ops.pdserve.rotary(x, cos.reshape(t, d), sin.reshape(t, d))
