"""RMSNorm in the two flavours the supported families use (HF numerics, fp32 inside)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style: normalise in fp32, cast back, then scale by `weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style: scale by (1 + weight) in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
