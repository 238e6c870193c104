"""nn.Linear whose bf16 CPU inputs run native/linear.py's kernels (decode steps and prefill
chunks), with the weight's copies the kernels read made once at model load (`prepare`) and
remade when the weight is replaced or changed in place; fp32 CPU decode batches of a GGUF model's
weights run native/quant_linear.py's kernel on their quant copy; anything else runs torch's linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native.activation import act_and_mul
from native.linear import (amx_gemm_rows, gated_usable, gemm_rows, pack_gated_weight, pack_gemm_weight,
                           pack_quant_weight, pack_weight, small_linear, small_linear_available, small_linear_gated,
                           small_linear_gated_amx)
from native.quant_linear import QUANT_F32_ROWS, pack_quant_f32, quant_f32_available, quant_linear_f32


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and names) that routes bf16 CPU inputs of up to
    gemm_rows() rows to the kernel, with the weight's packed copy made once (prepare(), or the
    first such call) and remade if the weight is replaced or changed in place."""

    _packed: tuple[tuple, torch.Tensor] | None = None  # (packed_key(), the copy)
    _gemm: tuple[tuple, torch.Tensor | None] | None = None  # (gemm_key(), the AMX GEMM's copy or None)
    _gemm_gated = False  # whether the GEMM's copy is the gated layout (GatedLinear's, where usable)
    _quant: tuple[tuple, torch.Tensor] | None = None  # (Linear.packed_key(), the block-quantized copy)

    def attach_quant(self, w32: torch.Tensor) -> bool:
        """Make the quant copy at model load: for a bf16 weight from the fp32 values it was rounded
        from (the loader's `w32`, pack_quant_weight); an fp32 weight is its own values
        (pack_quant_f32, which checks every weight against its block). True where one was made."""
        w = self.weight
        if w.device.type != "cpu" or not w.is_contiguous():
            return False
        if w.dtype == torch.float32:
            q = pack_quant_f32(w)
        elif w.dtype == torch.bfloat16:
            q = pack_quant_weight(w32, w, isinstance(self, GatedLinear) and self.gated())
        else:
            return False
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
        does not run this layer's shape here."""
        w = self.weight
        if not amx_gemm_rows() or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous():
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
        if (w.dtype == torch.float32 and x.dim() == 2 and x.dtype == w.dtype and x.shape[0] <= QUANT_F32_ROWS
                and (q := self.quant_weight()) is not None and quant_f32_available()):  # loads the op: the copy
            # may come from the launch's shared weight file, not from this process
            return quant_linear_f32(x.contiguous(), q, self.bias)
        return F.linear(x, w, self.bias)


class GatedLinear(Linear):
    """A gated MLP's fused gate|up projection ([2 I, K]: gate rows, then up rows). Where
    gated_usable(), its packed copy is the gated layout and `forward_act` runs the activation in
    the kernel; the plain product (`forward`, not on the model's path then) packs a copy per call."""

    def gated(self) -> bool:
        """The packed copy is pack_gated_weight's (forward_act runs fused)."""
        return gated_usable(self.weight, self.bias)

    @property
    def _gemm_gated(self) -> bool:  # the GEMM's copy in the gated layout (the fused path) without a bias
        return self.bias is None

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
