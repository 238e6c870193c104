"""small_linear (csrc/linear/small_linear.cpp) against an fp32 reference, and the Linear layer's dispatch.

The kernel accumulates bf16 products in fp32 and rounds once, so it must match the
fp32 product of the same bf16 inputs to bf16 rounding, and a row's result must not
depend on the batch it ran in. Skipped where the CPU or compiler lacks AVX512-BF16.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import linear
from engine.layers.linear import Linear
from native import linear as kernel
from native.linear import small_linear, small_linear_available

pytestmark = pytest.mark.skipif(not small_linear_available(), reason="no AVX512-BF16 on this CPU/compiler")


def bf16(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def reference(x, w, b=None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return (out if b is None else out + b.float()).bfloat16()


@pytest.mark.parametrize("m", [1, 2, 4, 5, 9, 16, 17, 33])
# K % 32 == 0 with N >= 16 runs on AMX tiles where present (N past the last full 16 rows,
# and every other shape, on AVX-512): cover full tiles, tails and the AVX-only shapes.
@pytest.mark.parametrize("k,n", [(576, 960), (64, 50), (96, 33), (64, 7), (40, 5), (100, 33), (1536, 1), (32, 4),
                                 (101, 70), (7, 3)])
def test_matches_fp32_reference(m, k, n):
    x, w = bf16(m, k, seed=1), bf16(n, k, seed=2)
    out = small_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # Both round an fp32 sum once; the sums differ only in order (a few fp32 ulps),
    # which can move a value across a bf16 rounding boundary: one bf16 ulp at most.
    torch.testing.assert_close(out.float(), reference(x, w).float(), atol=1e-2, rtol=8e-3)


def test_bias_is_added_before_rounding():
    x, w, b = bf16(3, 96, seed=3), bf16(11, 96, seed=4), bf16(11, seed=5)
    torch.testing.assert_close(small_linear(x, w, b).float(), reference(x, w, b).float(), atol=1e-2, rtol=8e-3)


def test_rows_do_not_depend_on_the_batch():
    w = bf16(300, 576, seed=6)
    xs = bf16(20, 576, seed=7)
    alone = torch.cat([small_linear(xs[i:i + 1], w) for i in range(20)])
    for m in range(1, 21):
        assert torch.equal(small_linear(xs[:m], w), alone[:m])
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(small_linear(xs, w), alone)
    finally:
        torch.set_num_threads(with_threads)


def test_empty_shapes():
    assert small_linear(bf16(0, 64, seed=8), bf16(5, 64, seed=9)).shape == (0, 5)
    assert small_linear(bf16(2, 64, seed=8), bf16(0, 64, seed=9)).shape == (2, 0)


@pytest.mark.parametrize("bad", [
    lambda: small_linear(bf16(2, 64, seed=1).float(), bf16(3, 64, seed=2)),  # dtype
    lambda: small_linear(bf16(2, 64, seed=1), bf16(3, 32, seed=2)),  # K mismatch
    lambda: small_linear(bf16(64, 2, seed=1).T, bf16(3, 64, seed=2)),  # not contiguous
    lambda: small_linear(bf16(2, 64, seed=1), bf16(3, 64, seed=2), bf16(4, seed=3)),  # bias size
])
def test_bad_inputs_raise(bad):
    with pytest.raises(RuntimeError, match="small_linear"):
        bad()


def test_layer_routes_bf16_batches_to_the_kernel(monkeypatch):
    """With AMX up to GEMM_ROWS rows (oneDNN above); without it, every row count."""
    layer = Linear(64, 24, bias=True).to(torch.bfloat16).requires_grad_(False)
    calls = []
    monkeypatch.setattr(linear, "small_linear", lambda *a: calls.append(a[0].shape[0]) or small_linear(*a))
    limit = kernel.gemm_rows()
    amx = torch.ops.pdserve.small_linear_amx()
    assert limit == (kernel.GEMM_ROWS if amx else kernel.ALL_ROWS) == kernel.invariant_rows()
    for m in (1, 32, kernel.GEMM_ROWS, kernel.GEMM_ROWS + 1):
        x = bf16(m, 64, seed=m)
        torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(),
                                   atol=2e-2, rtol=2e-2)
    layer.float()(bf16(1, 64, seed=1).float())  # fp32 stays on torch's path
    assert calls == [1, 32, kernel.GEMM_ROWS] + ([] if amx else [kernel.GEMM_ROWS + 1])


@pytest.mark.parametrize("m,n,k,span", [(129, 48, 64, 33), (147, 40, 96, 16), (530, 960, 576, 64),
                                        (200, 576, 1536, 32), (164, 17, 32, 16), (1400, 80, 576, 700),
                                        (700, 27, 4100, 5)])
def test_gemm_rows_equal_the_decode_path_bitwise(m, n, k, span):
    """Prefill-sized inputs (above 128 rows the AMX GEMM where there is AMX: w packed per block,
    x rows as A tiles, spans of rows, k in slices; elsewhere the AVX-512 broadcast kernel over
    slices of x rows that fit L2): every row gets exactly the bits the streaming path gives it
    in a small batch, tails of rows and of columns included, with a bias."""
    x, w, b = bf16(m, k, seed=11), bf16(n, k, seed=12), bf16(n, seed=13)
    big = small_linear(x, w, b)
    torch.testing.assert_close(big.float(), reference(x, w, b).float(), atol=3e-2, rtol=8e-3)
    pieces = torch.cat([small_linear(x[i:i + 16], w, b) for i in range(0, m, 16)])
    assert torch.equal(big, pieces)
    assert torch.equal(small_linear(x[:span], w, b), big[:span])


@pytest.mark.parametrize("m", [1, 3, 40, 300])
def test_a_weight_rows_output_does_not_depend_on_its_neighbours(m):
    """Each output column is one fp32 lane of a 64-column panel whatever columns share it (the
    panel cut short by N, a panel boundary moved by dropping leading rows): same bits."""
    x, w, b = bf16(m, 200, seed=16), bf16(150, 200, seed=17), bf16(150, seed=18)
    full = small_linear(x, w, b)
    for n in (1, 5, 7, 9, 15, 23, 64, 65, 129):
        assert torch.equal(small_linear(x, w[:n].contiguous(), b[:n].contiguous()), full[:, :n])
    assert torch.equal(small_linear(x, w[3:].contiguous(), b[3:].contiguous()), full[:, 3:])


def test_the_layers_packed_copy_gives_the_same_bits_and_follows_the_weight():
    layer = Linear(96, 130, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = bf16(5, 96, seed=19)
    layer.prepare()
    packed = layer.packed_weight()
    assert packed.dtype == torch.bfloat16 and packed.shape[1:] == (48, 64, 2)
    assert torch.equal(layer(x), small_linear(x, layer.weight, layer.bias))
    assert torch.equal(small_linear(x, layer.weight, layer.bias, packed), layer(x))
    layer.weight.mul_(2)  # changed in place: packed again
    assert layer.packed_weight() is not packed
    torch.testing.assert_close(layer(x).float(), reference(x, layer.weight, layer.bias).float(),
                               atol=3e-2, rtol=8e-3)
    layer.weight = torch.nn.Parameter(bf16(130, 96, seed=20), requires_grad=False)  # replaced
    assert torch.equal(layer(x), small_linear(x, layer.weight, layer.bias))


def test_a_packed_copy_of_another_shape_is_refused():
    w = bf16(70, 64, seed=21)
    with pytest.raises(RuntimeError, match="small_linear: packed"):
        small_linear(bf16(2, 64, seed=22), w, None, kernel.pack_weight(bf16(70, 96, seed=23)))


def test_gemm_bits_do_not_depend_on_the_thread_count():
    x, w = bf16(530, 576, seed=14), bf16(960, 576, seed=15)
    with_threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(small_linear(x, w))
    finally:
        torch.set_num_threads(with_threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# The gate|up projection with the activation in the kernel's epilogue (GatedLinear). Where AMX
# runs these shapes the fused path is not used (gated_usable is False): those tests skip.
needs_gated = pytest.mark.skipif(not kernel.gated_usable(torch.zeros(64, 32, dtype=torch.bfloat16), None),
                                 reason="the gated epilogue runs on the AVX-512 path only (not under AMX)")


@needs_gated
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 64, 542])
@pytest.mark.parametrize("i,k", [(1536, 576), (32, 64), (64, 33), (96, 640)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_equals_the_product_then_act_and_mul_bitwise(m, i, k, gelu):
    from native.activation import act_and_mul
    w = bf16(2 * i, k, seed=20) * 0.1
    x = bf16(m, k, seed=21) * 3
    want = act_and_mul(small_linear(x, w, None, kernel.pack_weight(w)), gelu)
    got = kernel.small_linear_gated(x, kernel.pack_gated_weight(w), gelu)
    assert got.shape == (m, i) and torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_gated
def test_gated_linear_fuses_and_keeps_the_plain_product(monkeypatch):
    from native.activation import act_and_mul
    lin = linear.GatedLinear(64, 2 * 96, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(bf16(2 * 96, 64, seed=22))
    x = bf16(9, 64, seed=23)
    assert lin.gated()
    fused = lin.forward_act(x, False)
    plain = lin(x)  # the product itself, though the packed copy is the gated layout
    assert torch.equal(plain, small_linear(x, lin.weight))
    assert torch.equal(fused, act_and_mul(plain, False))
    with torch.no_grad():  # the packed copy follows the weight
        lin.weight.mul_(2)
    assert torch.equal(lin.forward_act(x, True), act_and_mul(small_linear(x, lin.weight), True))


def test_gated_shapes_it_cannot_take_fall_back():
    from native.activation import act_and_mul
    lin = linear.GatedLinear(64, 2 * 40, bias=False).bfloat16()  # I = 40: not a multiple of 32
    with torch.no_grad():
        lin.weight.copy_(bf16(80, 64, seed=24))
    x = bf16(5, 64, seed=25)
    assert not lin.gated()
    assert torch.equal(lin.forward_act(x, False), act_and_mul(small_linear(x, lin.weight), False))
    with pytest.raises(RuntimeError, match="pack_gated_linear_weight"):
        kernel.pack_gated_weight(lin.weight)


@needs_gated
def test_gated_bits_do_not_depend_on_the_thread_count():
    w, x = bf16(2 * 1536, 576, seed=26) * 0.1, bf16(300, 576, seed=27)
    packed = kernel.pack_gated_weight(w)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.small_linear_gated(x, packed, False)
        torch.set_num_threads(max(2, with_threads))
        assert torch.equal(kernel.small_linear_gated(x, packed, False), one)
    finally:
        torch.set_num_threads(with_threads)


# The AMX GEMM's own copy of a weight (pack_gemm_weight, made at load) and its gated epilogue:
# only where the GEMM runs (AMX); elsewhere these skip.
needs_amx_gemm = pytest.mark.skipif(not kernel.amx_gemm_rows(), reason="no AMX GEMM on this CPU")


@needs_amx_gemm
@pytest.mark.parametrize("m,n,k", [(129, 48, 64), (147, 40, 96), (542, 1728, 576), (200, 576, 1536), (164, 17, 32),
                                   (700, 27, 640)])
def test_the_gemm_copy_gives_the_bits_of_packing_per_call(m, n, k):
    """Blocks of 32 rows, a last block of 16, columns past the last 16 (AVX-512), a bias."""
    x, w, b = bf16(m, k, seed=31), bf16(n, k, seed=32), bf16(n, seed=33)
    gemm = kernel.pack_gemm_weight(w)
    assert gemm is not None and gemm.dtype == torch.int32
    want = small_linear(x, w, b)
    assert torch.equal(small_linear(x, w, b, None, gemm), want)
    for rows in (16, 17, 40, 128):  # up to 16 rows the weight itself is read; from 17 the copy
        assert torch.equal(small_linear(x[:rows], w, b, None, gemm), want[:rows])


@needs_amx_gemm
def test_shapes_the_gemm_cannot_take_have_no_copy_and_a_wrong_copy_is_refused():
    assert kernel.pack_gemm_weight(bf16(64, 40, seed=34)) is None  # K % 32
    assert kernel.pack_gemm_weight(bf16(8, 64, seed=35)) is None  # N < 16
    assert kernel.pack_gemm_weight(bf16(2 * 40, 64, seed=36), True) is None  # I % 16
    assert kernel.pack_gemm_weight(bf16(5000, 2048, seed=37)) is None  # the vocabulary head's size: no GEMM
    w = bf16(64, 64, seed=38)
    with pytest.raises(RuntimeError, match="small_linear: gemm"):
        small_linear(bf16(200, 64, seed=39), w, None, None, kernel.pack_gemm_weight(bf16(64, 96, seed=40)))
    with pytest.raises(RuntimeError, match="gemm"):  # another weight's copy
        kernel.small_linear_gated_amx(bf16(200, 64, seed=39), w, kernel.pack_gemm_weight(bf16(96, 64, seed=40), True),
                                      False)
    with pytest.raises(RuntimeError, match="rows"):
        kernel.small_linear_gated_amx(bf16(8, 64, seed=39), w, kernel.pack_gemm_weight(w, True), False)


@needs_amx_gemm
@pytest.mark.parametrize("m", [17, 40, 129, 542])
@pytest.mark.parametrize("i,k", [(1536, 576), (16, 64), (48, 640)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_amx_equals_the_product_then_act_and_mul_bitwise(m, i, k, gelu):
    from native.activation import act_and_mul
    w = bf16(2 * i, k, seed=41) * 0.1
    x = bf16(m, k, seed=42) * 3
    want = act_and_mul(small_linear(x, w), gelu)
    got = kernel.small_linear_gated_amx(x, w, kernel.pack_gemm_weight(w, True), gelu)
    assert got.shape == (m, i) and torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_amx_gemm
def test_gated_amx_bits_do_not_depend_on_the_thread_count():
    w, x = bf16(2 * 1536, 576, seed=43) * 0.1, bf16(300, 576, seed=44)
    gemm = kernel.pack_gemm_weight(w, True)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.small_linear_gated_amx(x, w, gemm, False)
        torch.set_num_threads(max(2, with_threads))
        assert torch.equal(kernel.small_linear_gated_amx(x, w, gemm, False), one)
    finally:
        torch.set_num_threads(with_threads)


@needs_amx_gemm
def test_layers_keep_the_gemm_copy_and_gated_linear_fuses_on_it(monkeypatch):
    from native.activation import act_and_mul
    lin = Linear(64, 96, bias=True).to(torch.bfloat16).requires_grad_(False)
    gated = linear.GatedLinear(64, 2 * 96, bias=False).to(torch.bfloat16).requires_grad_(False)
    lin.prepare()
    gated.prepare()
    assert lin.gemm_weight() is not None and gated.gemm_weight() is not None
    copy = lin.gemm_weight()
    seen = []
    real = linear.small_linear
    monkeypatch.setattr(linear, "small_linear", lambda *a: seen.append(a[4]) or real(*a))
    x = bf16(200, 64, seed=45)
    assert torch.equal(lin(x), real(x, lin.weight, lin.bias))
    assert seen[-1] is copy
    lin(x[:16].contiguous())  # decode-size batches read the weight itself
    assert seen[-1] is None and kernel.amx_gemm_rows() == 17
    assert torch.equal(lin(x[:17].contiguous()), real(x[:17].contiguous(), lin.weight, lin.bias)) and seen[-1] is copy
    fused = gated.forward_act(x, False)
    assert torch.equal(fused, act_and_mul(real(x, gated.weight), False))
    assert torch.equal(gated(x), real(x, gated.weight))  # the plain product: not the gated copy
    assert seen[-1] is None
    lin.weight.mul_(2)  # changed in place: packed again
    assert lin.gemm_weight() is not copy and torch.equal(lin(x), real(x, lin.weight, lin.bias))


@needs_amx_gemm
def test_fp32_layers_have_no_gemm_copy_and_keep_torchs_path():
    lin = linear.GatedLinear(64, 2 * 96, bias=False).requires_grad_(False)  # fp32
    x = torch.randn(200, 64)
    assert lin.gemm_weight() is None
    gate, up = F.linear(x, lin.weight).chunk(2, dim=-1)
    torch.testing.assert_close(lin.forward_act(x, False), F.silu(gate) * up)
