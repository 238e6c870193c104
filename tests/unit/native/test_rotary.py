"""apply_rotary: the bf16 CPU kernel (csrc/elementwise/rotary.cpp) against the torch ops it replaces."""
from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.layers.rotary import RotaryEmbedding, _rotate_half, apply_rotary
from native.rotary import fused_rotary_available

pytestmark = pytest.mark.skipif(not fused_rotary_available(), reason="PDSERVE_KERNELS=torch")


def torch_rotary(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


@pytest.mark.parametrize("heads,d", [(15, 64), (4, 256), (1, 32), (9, 128)])
def test_bitwise_equal_to_torch(heads, d):
    g = torch.Generator().manual_seed(heads * d)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), d, 4096, torch.bfloat16, torch.device("cpu"))
    positions = torch.randint(0, 4096, (37,), generator=g)
    cos, sin = rope.tables(positions)
    x = (torch.randn(37, heads, d, generator=g) * 3).to(torch.bfloat16)
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, torch_rotary(x, cos, sin))


def test_strided_tokens_as_in_a_fused_qkv_projection():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(11, (9 + 2 * 3) * 64, generator=g).to(torch.bfloat16)
    qk = qkv[:, : 12 * 64].view(11, 12, 64)  # token stride 960, heads dense
    rope = RotaryEmbedding(RopeConfig(theta=100000.0), 64, 64, torch.bfloat16, torch.device("cpu"))
    cos, sin = rope.tables(torch.arange(11) + 40)
    assert torch.equal(apply_rotary(qk, cos, sin), torch_rotary(qk, cos, sin))
    assert apply_rotary(qk[:0], cos[:0], sin[:0]).shape == (0, 12, 64)


def test_bad_inputs_raise():
    x = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    cos = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pdserve.rotary(torch.zeros(3, 2, 48, dtype=torch.bfloat16), cos[:, :48], cos[:, :48])
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.pdserve.rotary(x, cos[:2], cos[:2])
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.pdserve.rotary(x.float(), cos, cos)
