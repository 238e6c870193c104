"""nn.Linear with its own bf16 CPU kernel for decode steps and prefill chunks.

A decode step multiplies a handful of rows by every weight matrix once, so its
time is the time to stream the weights from memory. `csrc/small_linear.cpp`
(torch.ops.pdserve.small_linear: AMX tiles, else AVX512-BF16 on a copy of the weight
packed once in k pairs, `pack_weight`) streams them at close to the machine's read
bandwidth, where oneDNN's bf16 GEMV reached about half of it, and gives each row the
same result whatever batch it is in and at any thread count. Prefill chunks take it too:
where the CPU has AMX, up to GEMM_ROWS rows, above 16 rows on an AMX GEMM
(`csrc/amx_gemm.cpp`, reading the layer's GEMM copy; larger inputs keep torch's GEMM, oneDNN); elsewhere the packed
AVX512-BF16 kernel at any row count (1.1-1.2x oneDNN's speed at 64-1024 rows on AMD
Zen 4); both with the per-row bits of a decode batch. The layer keeps the packed copy
(made at model load: one more copy of the weights in memory). The first call JIT-builds
the kernel (`-march=native`); on a CPU or compiler without AVX512-BF16 the op says it is
unsupported and torch's linear is used. Set PDSERVE_SMALL_LINEAR=0 to force torch's path, PDSERVE_CHUNK_GEMM=0
to keep prefill chunks (more than MAX_ROWS rows) on it (for comparison).

Where the AMX GEMM runs, the layer keeps the GEMM's own copy of the weight too (`gemm_weight`,
made at model load: the B-tile layout the GEMM would otherwise make per call, a pass over the
weight each time). With it the GEMM takes inputs of more than 16 rows (it reads the copy as one
sequential stream: 0.84x the 16-row W-tile path's time at 32 rows, 0.68x at 128); without it,
PDSERVE_GEMM_COPY=0, more than 128 rows.

Where the checkpoint is a GGUF model's dequantized values (the model cache converts GGUF to fp32
safetensors), the loader also gives each layer a block-quantized copy of its weight
(`attach_quant`, `pack_quant_weight`): every 32-weight block found exactly in Q4_1's form (d q + m;
SmolLM2's layers: 5 bits a weight read, d and m kept as fp16 where they are exactly GGUF's fp16
values, else as fp32: 6 bits, as Gemma 3's Q4_K blocks give) or Q8_0's (d q; its embedding, the
tied head: 9 bits). Decode batches of up to 16 rows read it instead of the bf16 weight and
rebuild each 16 x 32 tile in L1 before its tile product: the same bf16 values, so the same bits
(each copy is checked weight for weight against the bf16 weight when it is made), from 2.4x fewer
bytes. SmolLM2, one thread, in-process: a 4-row decode step 36-40 -> 26-30 ms, 16 rows 62-68 ->
54-57 ms (the rebuild, not the reads, is most of the layers' time: ~5 cycles a 32-weight block).
Without AMX (AMD Zen 4) batches of up to 2 rows read the AVX-512 path's form of the copy
(`csrc/packed_quant.cpp`: each zmm of the packed k-pair layout rebuilt in registers before its
vdpbf16ps; a GatedLinear's copy in its gated layout; a 1-row step on one core 13.4-14.5 -> 11.4-12.1
ms, 3 rows unchanged: the rebuild costs what the reads save). PDSERVE_QUANT_COPY=0 turns it off.

GatedLinear, a gated MLP's fused gate|up projection, runs the activation in the kernel's
epilogue (`forward_act`) where the AVX-512 path covers the whole matrix, and on the AMX GEMM
(its copy in the gated layout): the [T, 2 I] gate|up product is never written and read back,
and no separate activation call is made (same bits as the product followed by act_and_mul).
PDSERVE_FUSED_GATED=0 turns both off.
"""
from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import act_and_mul
from engine.layers.jit import load_kernel

# Rows up to which the kernel is used with PDSERVE_CHUNK_GEMM=0: decode batches.
MAX_ROWS = 32
# Rows up to which the kernel is used by default where the CPU has AMX: prefill chunks too. Its
# bits do not depend on the thread count, which lets such steps borrow idle cores. AMX GEMM at
# 512-600 rows: oneDNN's speed (same-process alternation), at 2048 rows oneDNN is ~25% faster.
GEMM_ROWS = 1024
# Without AMX the packed AVX512-BF16 kernel takes inputs of any row count (AMD Zen 4, one
# thread: 1.1-1.2x oneDNN at 64-1024 rows, x in slices that fit L2 above that).
ALL_ROWS = sys.maxsize
_CFLAGS = ("-O3", "-march=native", "-fopenmp")


@functools.cache
def small_linear_available() -> bool:
    """True when the kernel is built and this CPU runs it (cached per process)."""
    if os.environ.get("PDSERVE_SMALL_LINEAR", "1") == "0":
        return False
    load_kernel("engine.layers.linear", "small_linear_cpu",
                ["small_linear.cpp", "packed_linear.cpp", "packed_quant.cpp", "amx_rows.cpp", "amx_gemm.cpp"], _CFLAGS,
                headers=["include/act_vec.h", "include/amx_tiles.h", "include/amx_gemm.h", "include/bf16_vec.h",
                         "include/cephes_exp.h", "include/dynamic_for.h", "include/packed_linear.h",
                         "include/quant_blocks.h", "include/transpose16.h"])
    return bool(torch.ops.pdserve.small_linear_supported())


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
    (`csrc/packed_quant.cpp`; gated: a gate|up weight's copy for small_linear_gated). None where
    that does not hold, or PDSERVE_QUANT_COPY=0."""
    if (os.environ.get("PDSERVE_QUANT_COPY", "1") == "0" or w32.dtype != torch.float32 or weight.dim() != 2
            or not small_linear_available()):
        return None
    t = torch.ops.pdserve.pack_quant_weight(w32.contiguous(), weight, gated)
    return t if t.numel() else None


@functools.cache
def amx_gemm_rows() -> int:
    """The fewest rows small_linear runs on the AMX GEMM (cached per process); 0 where it does not
    run (no AMX, or PDSERVE_CHUNK_GEMM=0)."""
    if gemm_rows() <= MAX_ROWS or not small_linear_available():
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
            and weight.is_contiguous() and os.environ.get("PDSERVE_FUSED_GATED", "1") != "0"
            and _gated_shape(weight.shape[0], weight.shape[1]))


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
    ALL_ROWS; MAX_ROWS with PDSERVE_CHUNK_GEMM=0 (prefill chunks on oneDNN)."""
    if os.environ.get("PDSERVE_CHUNK_GEMM", "1") != "0" and small_linear_available():
        return GEMM_ROWS if torch.ops.pdserve.small_linear_amx() else ALL_ROWS
    return MAX_ROWS


def invariant_rows() -> int:
    """Inputs up to this many rows give every row the same bits at any thread count and in any
    batch (the kernel's paths); 0 when the kernel is not used here (torch's GEMM is not)."""
    return gemm_rows() if small_linear_available() else 0


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and names) that routes bf16 CPU inputs of up to
    gemm_rows() rows to the kernel, with the weight's packed copy made once (prepare(), or the
    first such call) and remade if the weight is replaced or changed in place."""

    _packed: tuple[tuple, torch.Tensor] | None = None  # (packed_key(), the copy)
    _gemm: tuple[tuple, torch.Tensor | None] | None = None  # (gemm_key(), the AMX GEMM's copy or None)
    _gemm_gated = False  # whether the GEMM's copy is the gated layout (GatedLinear's, where usable)
    _quant: tuple[tuple, torch.Tensor] | None = None  # (Linear.packed_key(), the block-quantized copy)

    def attach_quant(self, w32: torch.Tensor) -> bool:
        """Make the quant copy (pack_quant_weight) from the fp32 values the bf16 weight was
        rounded from (the loader's, at model load); True where one was made."""
        w = self.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous():
            return False
        q = pack_quant_weight(w32, w, isinstance(self, GatedLinear) and self.gated())
        self._quant = None if q is None else (Linear.packed_key(self), q)
        return q is not None

    def quant_weight(self) -> torch.Tensor | None:
        """The quant copy while the weight is the one it was made from (dropped, not remade, once
        the weight is replaced or changed: its fp32 values are gone)."""
        if self._quant is not None and self._quant[0] != Linear.packed_key(self):
            self._quant = None
        return None if self._quant is None else self._quant[1]

    def prepare(self) -> None:
        """Pack the weight now (model load) rather than on the first step that needs it."""
        w = self.weight
        if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() and small_linear_available():
            self.packed_weight()
            self.gemm_weight()

    def gemm_weight(self) -> torch.Tensor | None:
        """The AMX GEMM's copy (made once, remade when the weight changes); None where the GEMM
        does not run this layer's shape here, or with PDSERVE_GEMM_COPY=0."""
        w = self.weight
        if (not amx_gemm_rows() or os.environ.get("PDSERVE_GEMM_COPY", "1") == "0" or w.dtype != torch.bfloat16
                or w.device.type != "cpu" or not w.is_contiguous()):
            return None
        key = self.gemm_key()
        if self._gemm is None or self._gemm[0] != key:
            self._gemm = (key, pack_gemm_weight(self.weight, self._gemm_gated))
        return self._gemm[1]

    def gemm_key(self) -> tuple:
        """What the GEMM's copy was made from: packed_key() and which layout."""
        return (*Linear.packed_key(self), self._gemm_gated)

    def packed_key(self) -> tuple:
        """What the packed copy was made from: the weight's storage, version and shape."""
        w = self.weight
        return (w.data_ptr(), w._version, tuple(w.shape))

    def _pack(self) -> torch.Tensor:
        return pack_weight(self.weight)

    def packed_weight(self) -> torch.Tensor:
        key = self.packed_key()
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, self._pack())
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dim() == 2 and w.dtype == torch.bfloat16 and x.dtype == w.dtype and w.device.type == "cpu"
                and x.shape[0] <= gemm_rows() and w.is_contiguous() and small_linear_available()):
            gemm = None
            if x.shape[0] >= amx_gemm_rows() > 0 and not self._gemm_gated:
                gemm = self.gemm_weight()
            return small_linear(x.contiguous(), w, self.bias, self.packed_weight(), gemm, self.quant_weight())
        return F.linear(x, w, self.bias)


class GatedLinear(Linear):
    """A gated MLP's fused gate|up projection ([2 I, K]: gate rows, then up rows). Where
    gated_usable(), its packed copy is the gated layout and `forward_act` runs the activation in
    the kernel; the plain product (`forward`, not on the model's path then) packs a copy per call."""

    def gated(self) -> bool:
        """The packed copy is pack_gated_weight's (forward_act runs fused)."""
        return gated_usable(self.weight, self.bias)

    @property
    def _gemm_gated(self) -> bool:  # the GEMM's copy in the gated layout unless the fusion is off
        return self.bias is None and os.environ.get("PDSERVE_FUSED_GATED", "1") != "0"

    def packed_key(self) -> tuple:
        return (*super().packed_key(), self.gated())  # and which layout

    def _pack(self) -> torch.Tensor:
        return pack_gated_weight(self.weight) if self.gated() else pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.gated() and x.dim() == 2 and x.dtype == w.dtype and x.shape[0] <= gemm_rows():
            return small_linear(x.contiguous(), w, self.bias, None)
        return super().forward(x)

    def forward_act(self, x: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act_and_mul(self(x), gelu): [T, K] -> [T, I]; `gelu` picks gelu-tanh over silu."""
        if x.dim() == 2 and x.dtype == self.weight.dtype and x.shape[0] <= gemm_rows():
            if self.gated():
                return small_linear_gated(x.contiguous(), self.packed_weight(), gelu, self.quant_weight())
            if x.shape[0] >= amx_gemm_rows() > 0 and self._gemm_gated and (gemm := self.gemm_weight()) is not None:
                return small_linear_gated_amx(x.contiguous(), self.weight, gemm, gelu)
        return act_and_mul(self(x), gelu)
