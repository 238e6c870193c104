"""RMSNorm in the two flavours the supported families use (HF numerics, fp32 inside).

`forward(x)` normalises; `add_norm(x, residual)` first adds the residual stream
(rounded to the model dtype, as HF's `residual + x`) and returns (norm(sum), sum),
so a decoder layer hands its residual to the next layer's input norm (vLLM's
fused add-norm pattern). On the CPU, 2-D contiguous bf16 inputs (fp32: up to MAX_FP32_ROWS rows) go to
`csrc/rms_norm.cpp` (torch.ops.pdserve.rms_norm: one call instead of about eight
small ops); anything else (CUDA, the [T, H, D] views q/k norms see) runs the
torch formulas below, which the kernel reproduces.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers.jit import load_kernel


@functools.cache
def _load_ops() -> None:
    load_kernel("engine.layers.norm", "rms_norm_cpu", ["rms_norm.cpp"], ("-O3", "-march=native", "-fopenmp"),
                headers=["include/bf16_vec.h"])


# fp32 rows up to which the kernel runs (decode steps): its fp32 path is one scalar pass
# per row, slower than torch's vectorised ops for prefill chunks. bf16 rows are vectorised
# and take the kernel at any count.
MAX_FP32_ROWS = 64


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        return False
    if x.dtype == torch.float32 and x.shape[0] > MAX_FP32_ROWS:
        return False
    if x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float32):
        return False
    _load_ops()
    return True


class RMSNorm(nn.Module):
    """Llama-style: normalise in fp32, cast back, then scale by `weight`."""

    gemma = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x, self.weight):
            return torch.ops.pdserve.rms_norm(x, None, self.weight, self.eps, self.gemma)[0]
        return self._torch(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in x's dtype; residual None means zero (the first layer)."""
        if residual is None:
            return self(x), x
        if _fused(x, self.weight) and residual.is_contiguous() and residual.shape == x.shape:
            out, total = torch.ops.pdserve.rms_norm(x, residual, self.weight, self.eps, self.gemma)
            return out, total
        total = x + residual
        return self._torch(total), total

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: scale by (1 + weight) in fp32, then cast back."""

    gemma = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
