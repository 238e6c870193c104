"""Gated MLP activation act(gate) * up over a fused [T, 2 * I] gate|up projection
(csrc/elementwise/activation.cpp, torch.ops.pdserve.act_and_mul: one pass instead of torch's
act-then-multiply, the same two bf16 roundings). bf16 CPU inputs take the kernel; other dtypes
and devices, and PDSERVE_KERNELS=torch, run the torch ops, which the kernel reproduces.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from native import build


@functools.cache
def fused_act_available() -> bool:
    return build("native.activation", "activation_cpu", ["elementwise/activation.cpp"],
                 ["include/act_vec.h", "include/bf16_vec.h", "include/cephes_exp.h"])


def act_and_mul_torch(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """x [T, 2 * I] (gate | up) -> [T, I]; `gelu` picks gelu-tanh over silu."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and fused_act_available():
        return torch.ops.pdserve.act_and_mul(x.contiguous(), gelu)
    return act_and_mul_torch(x, gelu)
