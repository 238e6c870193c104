"""bf16 CPU linear kernels (csrc/linear/): decode steps and prefill chunks, with every row's bits
independent of its batch and of the thread count.

small_linear streams a weight at close to the machine's read bandwidth. Paths, chosen in C++ by
CPU feature and row count: AMX tiles (decode batches; above amx_gemm_rows() rows the AMX GEMM,
reading its own copy of the weight, `pack_gemm_weight`), else AVX512-BF16 dot products on a copy
packed in k pairs (`pack_weight`), any row count. Without AVX512-BF16 (or with
PDSERVE_KERNELS=torch) `small_linear_available()` is False and the layers run torch's linear.
Copies made at model load: the packed weight; the AMX GEMM's; a block-quantized copy where the
weights are a GGUF model's dequantized values (`pack_quant_weight`: every 32-weight block exactly
Q4_1's or Q8_0's form, read by decode batches instead of the bf16 weight, same bits); a gated
MLP's gate|up weight in a layout whose kernel runs the activation in its epilogue
(`small_linear_gated`, `small_linear_gated_amx`). docs/kernels.md has what each path measured.
"""
from __future__ import annotations

import functools
import sys

import torch

from native import build

# Rows up to which the kernel is used where the CPU has AMX: decode batches and prefill chunks
# (larger inputs take torch's GEMM, oneDNN, faster there). Its bits do not depend on the thread
# count, which lets such steps borrow idle cores.
GEMM_ROWS = 1024
# Without AMX the packed AVX512-BF16 kernel takes inputs of any row count.
ALL_ROWS = sys.maxsize


@functools.cache
def small_linear_available() -> bool:
    """True when the kernel is built and this CPU runs it (cached per process)."""
    return build("native.linear", "small_linear_cpu",
                 [f"linear/{f}.cpp" for f in ("small_linear", "packed_linear", "packed_quant", "amx_rows", "amx_gemm")],
                 [f"include/{h}.h" for h in ("act_vec", "amx_tiles", "amx_gemm", "bf16_vec", "cephes_exp", "dynamic_for",
                                             "packed_linear", "quant_blocks", "transpose16")]
                 ) and bool(torch.ops.pdserve.small_linear_supported())


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None, gemm: torch.Tensor | None = None,
                 quant: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias, all bf16 contiguous on the CPU -> [M, N] bf16.

    Accumulates in fp32 in an order that depends only on K, rounds once. `packed` is
    pack_weight(weight) (without it the call packs a copy itself, a pass over the weight);
    `gemm` is pack_gemm_weight(weight), read where the AMX GEMM runs (packed per call without it);
    `quant` is pack_quant_weight(weight's fp32 values, weight), read instead of the weight by the
    AMX tiles of batches up to 16 rows (same bits; larger ones take the paths above).
    Raises RuntimeError on other dtypes, layouts or shapes, or when unsupported here.
    """
    return torch.ops.pdserve.small_linear(x, weight, bias, packed, gemm, quant)


def pack_quant_weight(w32: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """The block-quantized copy of a bf16 [N, K] weight that small_linear's decode batches can read
    instead of it, found from the fp32 values `w32` it was rounded from: where every 32-weight
    block is exactly a GGUF Q4_1 block (w = d q + m, 5 bits a weight read with fp16 d and m, 6
    where they are not fp16 values) or Q8_0 block (w = d q, 9 bits), every rebuilt weight checked
    against `weight`. In the AMX tiles' form where AMX runs, else the AVX-512 path's
    (`csrc/linear/packed_quant.cpp`; gated: a gate|up weight's copy for small_linear_gated). None
    where that does not hold."""
    if w32.dtype != torch.float32 or weight.dim() != 2 or not small_linear_available():
        return None
    t = torch.ops.pdserve.pack_quant_weight(w32.contiguous(), weight, gated)
    return t if t.numel() else None


@functools.cache
def amx_gemm_rows() -> int:
    """The fewest rows small_linear runs on the AMX GEMM (cached per process); 0 where it does not
    run (no AMX)."""
    if not small_linear_available():
        return 0
    return int(torch.ops.pdserve.amx_gemm_rows())


def pack_gemm_weight(weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """The AMX GEMM's copy of a bf16 [N, K] weight (gated: a gate|up weight [2 I, K] in the layout
    small_linear_gated_amx reads); None where the GEMM does not run this shape here."""
    t = torch.ops.pdserve.pack_amx_gemm_weight(weight, gated)
    return t if t.numel() else None


def small_linear_gated_amx(x: torch.Tensor, weight: torch.Tensor, gemm: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act_and_mul(small_linear(x, weight), gelu), bit for bit, on the AMX GEMM with the activation
    in its epilogue: x [M, K] with M >= amx_gemm_rows(), gemm = pack_gemm_weight(weight, True)."""
    return torch.ops.pdserve.small_linear_gated_amx(x, weight, gemm, gelu)


def pack_gated_weight(weight: torch.Tensor) -> torch.Tensor:
    """pack_weight of a gate|up weight [2 I, K] with its rows interleaved in blocks of 32 (gate
    32 p .., then up 32 p ..), the copy small_linear_gated reads (gated_usable(weight) only)."""
    return torch.ops.pdserve.pack_gated_linear_weight(weight)


def small_linear_gated(x: torch.Tensor, packed: torch.Tensor, gelu: bool, quant: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ gate.T) * (x @ up.T) -> [M, I] bf16, with packed = pack_gated_weight(gate|up);
    bitwise act_and_mul(small_linear(x, gate|up), gelu). `quant`: pack_quant_weight(w32, gate|up,
    gated=True), read instead of `packed` by decode batches (same bits)."""
    return torch.ops.pdserve.small_linear_gated(x, packed, x.shape[1], gelu, quant)


def gated_usable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a gate|up weight [2 I, K] can take small_linear_gated here: bf16 contiguous on the
    CPU, no bias, I a multiple of 32, the AVX-512 path for the whole shape (not AMX)."""
    return (bias is None and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and _gated_shape(weight.shape[0], weight.shape[1]))


@functools.cache
def _gated_shape(n: int, k: int) -> bool:
    return small_linear_available() and bool(torch.ops.pdserve.small_linear_gated_supported(n, k))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The copy of a bf16 [N, K] weight that small_linear's AVX-512 path reads: panels of 64
    output columns, k in pairs (VNNI); only the columns that path computes (where AMX runs a
    shape, those past the last full 16)."""
    return torch.ops.pdserve.pack_linear_weight(weight)


@functools.cache
def gemm_rows() -> int:
    """Rows up to which Linear uses the kernel (cached per process): GEMM_ROWS with AMX, else
    ALL_ROWS; 0 where the kernel does not run."""
    if small_linear_available():
        return GEMM_ROWS if torch.ops.pdserve.small_linear_amx() else ALL_ROWS
    return 0


def invariant_rows() -> int:
    """Inputs up to this many rows give every row the same bits at any thread count and in any
    batch (the kernel's paths): gemm_rows(), 0 when the kernel is not used here (torch's GEMM is not)."""
    return gemm_rows()
