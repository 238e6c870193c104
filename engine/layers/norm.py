"""RMSNorm in the two flavours the supported families use (HF numerics, fp32 inside).

`forward(x)` normalises; `add_norm(x, residual)` first adds the residual stream
(rounded to the model dtype, as HF's `residual + x`) and returns (norm(sum), sum),
so a decoder layer hands its residual to the next layer's input norm (vLLM's
fused add-norm pattern). On the CPU, 2-D contiguous inputs go to native/rms_norm.py's kernel;
anything else (CUDA, the [T, H, D] views q/k norms see) runs the torch formulas below, which
the kernel reproduces.
"""
from __future__ import annotations

import torch
from torch import nn

from native import rms_norm as kernel


class RMSNorm(nn.Module):
    """Llama-style: normalise in fp32, cast back, then scale by `weight`."""

    gemma = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel.usable(x, self.weight):
            return kernel.rms_norm(x, None, self.weight, self.eps, self.gemma)[0]
        return self._torch(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in x's dtype; residual None means zero (the first layer)."""
        if residual is None:
            return self(x), x
        if kernel.usable(x, self.weight) and residual.is_contiguous() and residual.shape == x.shape:
            return kernel.rms_norm(x, residual, self.weight, self.eps, self.gemma)
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
