"""race_sample (csrc/sampler/race_sample.cpp): the exponential race in one pass per row."""
from __future__ import annotations

import pytest
import torch

from native.sampler import argmax_rows, race_sample, race_sample_available

if not race_sample_available():  # PDSERVE_KERNELS=torch
    pytest.skip("race_sample disabled in this environment", allow_module_level=True)


def keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_tokens_follow_the_softmax_at_the_temperature(temperature):
    n, vocab = 40000, 50
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    tokens = race_sample(logits.repeat(n, 1), torch.full((n,), 1 / temperature), keys(n))
    expected = (logits / temperature).softmax(-1) * n
    keep = expected >= 5  # chi-square over the cells with enough mass, the rest pooled
    counts = torch.bincount(tokens, minlength=vocab).float()
    obs, exp = counts[keep], expected[keep]
    if not keep.all():
        obs, exp = torch.cat([obs, counts[~keep].sum().view(1)]), torch.cat([exp, expected[~keep].sum().view(1)])
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    dof = len(obs) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 sigma


def test_a_row_depends_only_on_its_logits_temperature_and_key():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 49152, generator=g).to(torch.bfloat16)
    t, k = torch.rand(9, generator=g) + 0.5, keys(9, 3)
    full = race_sample(x, t, k)
    perm = torch.randperm(9, generator=g)
    assert torch.equal(race_sample(x[perm], t[perm], k[perm]), full[perm])
    for i in range(9):
        assert race_sample(x[i:i + 1], t[i:i + 1], k[i:i + 1]).item() == full[i].item()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(race_sample(x, t, k), full)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(race_sample(x.float(), t, k), full)  # bf16 widens exactly
    assert len(set(race_sample(x[:1].repeat(64, 1), t[:1].repeat(64), keys(64, 4)).tolist())) > 30


def test_minus_inf_never_wins_and_ragged_vocab():
    x = torch.full((500, 37), float("-inf"))
    x[:, 5], x[:, 36] = 0.0, -0.3  # the last (tail) lane holds a live token
    tokens = race_sample(x, torch.full((500,), 0.7), keys(500, 5))
    assert set(tokens.tolist()) == {5, 36}
    one = torch.zeros(3, 1)
    assert race_sample(one, torch.ones(3), keys(3)).tolist() == [0, 0, 0]


def test_low_temperature_takes_the_argmax():
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(6))
    assert torch.equal(race_sample(x, torch.full((64,), 1e4), keys(64)), x.argmax(-1))


@pytest.mark.parametrize("bad", [
    lambda: race_sample(torch.zeros(2, 4, dtype=torch.float16), torch.ones(2), keys(2)),
    lambda: race_sample(torch.zeros(2, 4), torch.ones(3), keys(2)),
    lambda: race_sample(torch.zeros(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.int32)),
    lambda: race_sample(torch.zeros(4), torch.ones(4), keys(4)),
])
def test_bad_inputs_raise(bad):
    with pytest.raises(RuntimeError):
        bad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 17, 49152, 49153])
def test_argmax_rows_is_torchs_argmax(dtype, vocab):
    """The same index as torch.argmax: the first of tied maxima, a NaN above every number (the
    first NaN), an all -inf row's index 0, in a full vector or the tail past the last one."""
    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[1] = 1.0
    x[2] = float("-inf")
    if vocab > 3:
        x[3, 3] = float("nan")
        x[4, vocab - 1] = 100.0
        x[5, 1] = float("inf")
        x[6, vocab - 1] = float("nan")
        x[7, 2] = x[7, vocab - 2] = 50.0
    assert torch.equal(argmax_rows(x), x.argmax(-1))
