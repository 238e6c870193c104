"""The quant copy (native/linear.py `pack_quant_weight`): a weight whose 32-weight blocks are
exactly GGUF Q4_1's or Q8_0's form, rebuilt in the AMX tiles (csrc/linear/amx_rows.cpp) where the CPU has
AMX, else in the AVX-512 path's registers (csrc/linear/packed_quant.cpp), gives the bf16 weight's bits;
anything else gets no copy."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from engine.layers.linear import GatedLinear, Linear
from native import linear as kernel
from native.activation import act_and_mul
from native.linear import small_linear, small_linear_available

pytestmark = pytest.mark.skipif(not small_linear_available(), reason="no AVX512-BF16 kernel on this CPU")


def _amx() -> bool:
    return bool(torch.ops.pdserve.small_linear_amx())


def _copy_bytes(n: int, k: int, bits: int) -> int | None:
    """The copy's size for [n, k] at 5, 6 or 9 bits a weight on this CPU's path; None for no copy
    (AMX: 16-row tiles, the rows past the last 16 left out; AVX-512: units of 32 rows)."""
    if k % 32:
        return None
    if _amx():
        return n // 16 * k // 32 * {5: 320, 6: 384, 9: 576}[bits] if n >= 16 else None
    return n // 32 * k // 32 * {5: 640, 6: 768, 9: 1152}[bits] if n % 32 == 0 else None


def _q4_1(n: int, k: int, seed: int = 0, fp16_m: bool = True) -> torch.Tensor:
    """fp32 [n, k] weights as GGUF Q4_1 dequantizes them: d q + m per 32-weight block, d and m fp16
    (fp16_m=False: m not an fp16 value, so the copy keeps d and m as fp32)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.15
    if fp16_m:
        m = m.half().float()
    else:
        m = m - 1e-6  # (an fp16 m has 11 significant bits)
        assert (m.half().float() != m).any()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # as Q4_1 quantizes: the block's min and max are q = 0 and 15
    return (d * q + m).reshape(n, k).contiguous()


def _q8_0(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """fp32 [n, k] weights as GGUF Q8_0 dequantizes them: d q per 32-weight block, d fp16."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k).contiguous()


@pytest.mark.parametrize("form,bits", [(_q4_1, 5), (partial(_q4_1, fp16_m=False), 6), (_q8_0, 9)],
                         ids=["q4_1", "q4_1_fp32_m", "q8_0"])
@pytest.mark.parametrize("n,k", [(64, 64), (48, 576), (960, 576), (40, 96), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_quant_copy_gives_the_bits_of_the_bf16_weight(form, bits, n, k, bias):
    w32 = form(n, k)
    w = w32.bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    q = kernel.pack_quant_weight(w32, w)
    if _copy_bytes(n, k, bits) is None:
        assert q is None
        return
    assert q is not None and q.dtype == torch.uint8
    assert q.numel() == _copy_bytes(n, k, bits)
    for m in (1, 2, 3, 4, 7, 8, 9, 15, 16):
        x = torch.randn(m, k).bfloat16()
        assert torch.equal(small_linear(x, w, b, None, None, q), small_linear(x, w, b)), m


@pytest.mark.skipif(not small_linear_available() or bool(torch.ops.pdserve.small_linear_amx()),
                    reason="the gated copy is the AVX-512 path's (no AMX)")
@pytest.mark.parametrize("form", [_q4_1, partial(_q4_1, fp16_m=False), _q8_0], ids=["q4_1", "q4_1_fp32_m", "q8_0"])
@pytest.mark.parametrize("i,k", [(32, 64), (1536, 576)])
@pytest.mark.parametrize("gelu", [False, True])
def test_the_gated_quant_copy_gives_the_bits_of_the_gated_product(form, i, k, gelu):
    w32 = form(2 * i, k)
    w = w32.bfloat16()
    packed = kernel.pack_gated_weight(w)
    q = kernel.pack_quant_weight(w32, w, gated=True)
    assert q is not None and q.numel() == kernel.pack_quant_weight(w32, w).numel()
    for m in (1, 2, 5, 8, 9):
        x = torch.randn(m, k).bfloat16()
        want = act_and_mul(small_linear(x, w), gelu)
        assert torch.equal(kernel.small_linear_gated(x, packed, gelu, q), want), m
        assert torch.equal(kernel.small_linear_gated(x, packed, gelu), want), m


def test_weights_not_in_a_block_form_get_no_quant_copy():
    w32 = _q4_1(64, 64)
    w32[5, 7] += 1e-4  # one weight off its block's grid
    assert kernel.pack_quant_weight(w32, w32.bfloat16()) is None
    assert kernel.pack_quant_weight(torch.randn(64, 64), torch.randn(64, 64).bfloat16()) is None
    w32 = _q4_1(64, 64)
    w = w32.bfloat16()
    w[0, 0] = w[0, 0] + 1  # a bf16 weight that is not the fp32 values rounded: refused, not trusted
    assert kernel.pack_quant_weight(w32, w) is None
    assert kernel.pack_quant_weight(_q4_1(8, 64), _q4_1(8, 64).bfloat16()) is None  # no full 16 (32) rows
    assert kernel.pack_quant_weight(w32[:, :48].contiguous(), w32[:, :48].bfloat16()) is None  # K % 32


def test_a_quant_copy_of_another_shape_is_refused():
    w32 = _q4_1(64, 64)
    q = kernel.pack_quant_weight(w32, w32.bfloat16())
    with pytest.raises(RuntimeError, match="quant"):
        small_linear(torch.randn(2, 64).bfloat16(), _q4_1(32, 64).bfloat16(), None, None, None, q)


def _spy_quant(monkeypatch, op: str, arg: int) -> list[bool]:
    """Records, per call of torch.ops.pdserve.<op>, whether its argument `arg` (the quant copy) was given."""
    calls: list[bool] = []
    real = getattr(torch.ops.pdserve, op)

    def spy(*a):
        calls.append(a[arg] is not None)
        return real(*a)
    monkeypatch.setattr(torch.ops.pdserve, op, spy, raising=False)
    return calls


def test_the_layer_keeps_its_quant_copy_until_the_weight_changes(monkeypatch):
    w32 = _q4_1(96, 64)
    lin = Linear(64, 96, bias=False)
    lin.weight = torch.nn.Parameter(w32.bfloat16(), requires_grad=False)
    assert lin.attach_quant(w32) and lin.quant_weight() is not None
    x = torch.randn(4, 64).bfloat16()
    calls = _spy_quant(monkeypatch, "small_linear", 5)
    y = lin(x)
    assert calls == [True] and torch.equal(y, small_linear(x, lin.weight))
    chunk = torch.randn(40, 64).bfloat16()  # a prefill chunk: the kernel reads the bf16 weight (or its GEMM copy)
    assert torch.equal(lin(chunk), small_linear(chunk, lin.weight))
    with torch.no_grad():
        lin.weight.mul_(2)  # changed in place: the copy no longer matches and is dropped
    assert lin.quant_weight() is None
    assert torch.equal(lin(x), small_linear(x, lin.weight))


def test_the_gated_layer_reads_its_quant_copy_in_decode_batches(monkeypatch):
    w32 = _q4_1(128, 64)
    lin = GatedLinear(64, 128, bias=False)
    lin.weight = torch.nn.Parameter(w32.bfloat16(), requires_grad=False)
    made = lin.attach_quant(w32)
    x = torch.randn(2, 64).bfloat16()
    want = act_and_mul(small_linear(x, lin.weight), False)
    if not lin.gated():  # AMX: the plain product takes the copy
        assert made and torch.equal(lin.forward_act(x, False), want)
        return
    calls = _spy_quant(monkeypatch, "small_linear_gated", 4)
    assert made and torch.equal(lin.forward_act(x, False), want) and calls == [True]


def test_quant_copy_bits_do_not_depend_on_the_thread_count():
    w32 = _q4_1(4096, 576, seed=3)  # 64 passes of 4 row blocks (128 chunks of units): the threads split them
    w = w32.bfloat16()
    q = kernel.pack_quant_weight(w32, w)
    x = torch.randn(2, 576).bfloat16()  # a decode batch that reads the copy on either path
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_linear(x, w, None, None, None, q)
        torch.set_num_threads(2)
        two = small_linear(x, w, None, None, None, q)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, small_linear(x, w))
