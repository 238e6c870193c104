"""quant_linear_f32 (csrc/linear/quant_f32.cpp): fp32 decode batches from a GGUF model's exact
Q4_1 / Q8_0 block copy, and the Linear layer routing fp32 decode batches to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native.quant_linear import QUANT_F32_ROWS, pack_quant_f32, quant_f32_available, quant_linear_f32

if not quant_f32_available():  # PDSERVE_KERNELS=torch, or a CPU without AVX2 and FMA
    pytest.skip("quant_linear_f32 does not run here", allow_module_level=True)


def q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Every 32-weight block exactly fma(d, q, m), q in 0..15 (both ends used), d and m fp16 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().double()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().double()
    return (d * q + m).float().reshape(n, k)  # exact in double, one rounding to fp32: what GGUF's fma gives


def q8_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.002 + 1e-4).half().float()
    return (d * q).reshape(n, k)


def ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("make,bits", [(q4_weight, 6.0), (q8_weight, 9.0)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16])
def test_matches_the_product_of_the_weights_it_was_made_from(make, bits, rows):
    n, k = 200, 576
    w = make(n, k)
    q = pack_quant_f32(w)
    assert q is not None and abs(q.numel() * 8 / w.numel() - bits) < 0.1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    for b in (None, bias):
        y = quant_linear_f32(x, q, b)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        torch.testing.assert_close(y.double(), ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_rows_bits_do_not_depend_on_the_batch_or_the_thread_count():
    w = q4_weight(3072, 576)
    q = pack_quant_f32(w)
    x = torch.randn(QUANT_F32_ROWS, 576, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_linear_f32(x[i:i + 1].contiguous(), q) for i in range(len(x))])
        torch.set_num_threads(2)
        for m in (2, 3, 5, 8, QUANT_F32_ROWS):
            assert torch.equal(quant_linear_f32(x[:m].contiguous(), q), alone[:m])
    finally:
        torch.set_num_threads(threads)


def test_no_copy_where_a_block_is_not_exactly_quantized():
    w = q4_weight(64, 64)
    w[3, 5] += 1e-3  # one weight off its block's grid
    assert pack_quant_f32(w) is None
    assert pack_quant_f32(torch.randn(64, 64)) is None
    assert pack_quant_f32(q4_weight(60, 64)) is None  # N not a multiple of 8
    assert pack_quant_f32(q4_weight(64, 64).bfloat16()) is None


def test_bad_inputs_raise():
    q = pack_quant_f32(q4_weight(64, 64))
    with pytest.raises(RuntimeError):
        quant_linear_f32(torch.randn(2, 32), q)  # K mismatch
    with pytest.raises(RuntimeError):
        quant_linear_f32(torch.randn(2, 64).bfloat16(), q)
    with pytest.raises(RuntimeError):
        quant_linear_f32(torch.randn(2, 64), torch.zeros(100, dtype=torch.uint8))


def test_linear_routes_fp32_decode_batches_to_the_copy():
    from engine.layers.linear import Linear

    w = q4_weight(256, 576)
    lin = Linear(576, 256, bias=False)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    assert lin.attach_quant(w)
    x = torch.randn(QUANT_F32_ROWS + 4, 576)
    small = x[:4].contiguous()
    assert torch.equal(lin(small), quant_linear_f32(small, lin.quant_weight()))
    assert torch.equal(lin(x), F.linear(x, lin.weight))  # more rows: torch's GEMM
    with torch.no_grad():
        lin.weight.mul_(2)  # changed in place: the copy is dropped, torch's linear runs
    assert lin.quant_weight() is None
    torch.testing.assert_close(lin(small), F.linear(small, lin.weight))
