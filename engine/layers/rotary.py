"""Rotary position embeddings (HF's rotate-half form) with default/linear/llama3 scaling."""
from __future__ import annotations

import math

import torch

from engine.config import RopeConfig
from native import rotary as kernel


def inv_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim // 2] fp32 inverse frequencies, scaled as the config asks."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    A plain object, not an nn.Module: models are built on the meta device and
    materialised by loading weights; these tables are computed, not loaded.
    """

    def __init__(self, rope: RopeConfig, dim: int, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv = inv_frequencies(rope, dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T] -> each [T, 1, D]; computed once per step, shared by layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated by the step's tables ([T, 1, D] each).

    bf16 on the CPU runs in one pass (native/rotary.py), bitwise equal to the torch ops below.
    """
    if kernel.usable(x, cos, sin):
        return kernel.rotary(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
