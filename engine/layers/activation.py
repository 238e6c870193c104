"""Gated MLP activation: act(gate) * up over a fused [T, 2 * I] gate|up projection.

bf16 CPU inputs go to `csrc/activation.cpp` (torch.ops.pdserve.act_and_mul: one
pass instead of torch's act-then-multiply, same two bf16 roundings); other dtypes
and devices run the torch ops, which the kernel reproduces. PDSERVE_FUSED_ACT=0
forces the torch path (for comparison).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine.layers.jit import load_kernel


@functools.cache
def fused_act_available() -> bool:
    if os.environ.get("PDSERVE_FUSED_ACT", "1") == "0":
        return False
    load_kernel("engine.layers.activation", "activation_cpu", ["activation.cpp"], ("-O3", "-march=native", "-fopenmp"),
                headers=["include/act_vec.h", "include/bf16_vec.h", "include/cephes_exp.h"])
    return True


def act_and_mul_torch(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """x [T, 2 * I] (gate | up) -> [T, I]; `gelu` picks gelu-tanh over silu."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and fused_act_available():
        return torch.ops.pdserve.act_and_mul(x.contiguous(), gelu)
    return act_and_mul_torch(x, gelu)
