"""float32 linear for decode batches on AVX2 CPUs (csrc/linear/quant_f32.cpp), reading a
block-quantized copy of the weight where it is a GGUF model's dequantized values.

Where the bf16 kernels do not run (no AVX512-BF16: `--dtype auto` computes in float32) a decode
step streams every fp32 weight; when each 32-weight block is exactly Q4_1's or Q8_0's form
(`pack_quant_f32` checks every weight), `quant_linear_f32` rebuilds the same fp32 weights from
6 or 9 bits each. Each output's sum runs in an order fixed by K alone, so a row's bits do not
depend on its batch or the thread count (they are not torch's: the last bits differ from
F.linear's). docs/kernels.md has what it measured.
"""
from __future__ import annotations

import functools

import torch

from native import build

# Inputs up to this many rows (decode batches) take the kernel; more (prefill chunks, and decode
# rows riding with one) take torch's GEMM, faster there.
QUANT_F32_ROWS = 16


@functools.cache
def quant_f32_available() -> bool:
    """True when the kernel is built and this CPU runs it (cached per process)."""
    return build("native.quant_linear", "quant_linear_f32", ["linear/quant_f32.cpp"],
                 ["include/quant_blocks.h"]) and bool(torch.ops.pdserve.quant_f32_supported())


def pack_quant_f32(w32: torch.Tensor) -> torch.Tensor | None:
    """The copy of an fp32 [N, K] weight that quant_linear_f32 reads, where every 32-weight block
    is exactly a Q4_1 or a Q8_0 block (and N % 8 == 0, K % 32 == 0); None otherwise."""
    if w32.dtype != torch.float32 or w32.dim() != 2 or w32.device.type != "cpu" or not quant_f32_available():
        return None
    t = torch.ops.pdserve.pack_quant_f32(w32)
    return t if t.numel() else None


def quant_linear_f32(x: torch.Tensor, quant: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 contiguous @ weight.T + bias -> [M, N] fp32, the weight read from its copy
    `quant` = pack_quant_f32(weight). Raises RuntimeError on other dtypes or shapes."""
    return torch.ops.pdserve.quant_linear_f32(x, quant, bias)
