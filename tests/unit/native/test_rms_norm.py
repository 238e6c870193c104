"""rms_norm (csrc/elementwise/rms_norm.cpp) against the torch formulas it replaces (HF's RMSNorm numerics)."""
from __future__ import annotations

import pytest
import torch

from engine.layers.norm import GemmaRMSNorm, RMSNorm
from native.rms_norm import MAX_FP32_ROWS


def make(cls, dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = cls(dim, 1e-6)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.randn(dim, generator=g) * 0.5).to(dtype)
    return norm


def rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


# fp32: the kernel sums squares in another order (a few ulps of the scale); bf16: one bf16 ulp.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40, 600])
@pytest.mark.parametrize("dim", [96, 100])  # 100: a tail past the 16-lane vectors
def test_kernel_matches_torch_formula(cls, dtype, rows, dim):
    norm = make(cls, dim, dtype, seed=rows)
    x, res = rand(rows, dim, dtype=dtype, seed=1), rand(rows, dim, dtype=dtype, seed=2)
    torch.testing.assert_close(norm(x), norm._torch(x), **TOL[dtype])
    out, total = norm.add_norm(x, res)
    assert torch.equal(total, x + res)  # the residual sum is rounded exactly as torch rounds it
    torch.testing.assert_close(out, norm._torch(x + res), **TOL[dtype])


def test_first_layer_has_no_residual():
    norm = make(RMSNorm, 64, torch.bfloat16, seed=0)
    x = rand(2, 64, dtype=torch.bfloat16, seed=3)
    out, total = norm.add_norm(x, None)
    assert total is x and torch.equal(out, norm(x))


def test_views_and_prefill_sized_inputs_take_the_torch_path():
    norm = make(GemmaRMSNorm, 32, torch.float32, seed=0)
    x = rand(4, 3, 32, dtype=torch.float32, seed=4)[:, 1:]  # [T, H, D] views, as q/k norms see
    assert torch.equal(norm(x), norm._torch(x))
    big = rand(MAX_FP32_ROWS + 1, 32, dtype=torch.float32, seed=5)
    assert torch.equal(norm(big), norm._torch(big))
