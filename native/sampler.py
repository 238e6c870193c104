"""Temperature sampling in one pass per row: loader for `csrc/sampler/race_sample.cpp`.

`race_sample(logits, inv_temp, keys)` returns, per row, argmax_i p_i / q_i with p the
row's softmax at its temperature and q_i ~ Exp(1) a pure function of (the row's 64-bit
key, i) (a counter hash on torch.rand's 24-bit float grid): the exponential race the
torch path in engine/sampler.py runs, without its [B, V] noise tensor and eight passes.
CPU only; the first call builds the kernel (native/loader.py). PDSERVE_KERNELS=torch keeps the
torch path.
"""
from __future__ import annotations

import functools

import torch

from native import build


@functools.cache
def race_sample_available() -> bool:
    """True when the kernel may be used in this process (built on first call, cached)."""
    return build("native.sampler", "race_sample_cpu", ["sampler/race_sample.cpp"],
                 ["include/bf16_vec.h", "include/cephes_exp.h"])


def race_sample(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32/bf16 CPU, inv_temp [B] fp32 (> 0), keys [B] int64 -> tokens [B] int64.

    Raises RuntimeError on other dtypes, shapes or devices.
    """
    return torch.ops.pdserve.race_sample(logits.contiguous(), inv_temp, keys)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for contiguous fp32/bf16 [B, V] CPU logits (the same indices:
    first maximum, a NaN counting above every number), one vector pass per row."""
    return torch.ops.pdserve.argmax_rows(logits)
