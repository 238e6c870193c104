"""Sampler: greedy, filters, penalties, seeded reproducibility, distribution, logprobs."""
from __future__ import annotations

import pytest
import torch

import engine.sampler as sampler_mod
from engine.sampler import Sampler, SamplingBatch, apply_penalties
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None = None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    batch = SamplingBatch.build(params, [[] for _ in params], outputs, logits.shape[1], CPU)
    return Sampler()(logits, batch)


@pytest.fixture(autouse=True)
def _fixed_global_rng():
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def test_greedy_equals_argmax_for_half_and_float():
    logits = torch.randn(6, 50)
    for dtype in (torch.float32, torch.bfloat16):
        out = sample(logits.to(dtype), [SamplingParams(temperature=0.0)] * 6)
        assert torch.equal(out.token_ids, logits.to(dtype).float().argmax(-1))
        assert out.logprobs is None and out.top_ids is None


def test_mixed_greedy_and_random_rows():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    # Random rows should scatter over the near-flat tail sometimes; greedy rows never.
    logits[1::2, 3] = 0.0
    seen_random = set()
    for _ in range(20):
        out = sample(logits, params)
        assert out.token_ids[0::2].tolist() == [3, 3]
        seen_random.update(out.token_ids[1::2].tolist())
    assert len(seen_random) > 1


def test_seed_is_independent_of_batch_composition_and_position():
    torch.manual_seed(0)
    row = torch.randn(32)
    seeded = SamplingParams(temperature=1.0, seed=42)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=7)]
    history = [1, 2, 3]  # step 3
    alone = sample(row.unsqueeze(0), [seeded], [history]).token_ids[0]
    for pos in range(4):
        logits = torch.randn(4, 32)
        logits[pos] = row
        params = others[:pos] + [seeded] + others[pos:]
        outputs = [[5]] * pos + [history] + [[6, 7]] * (3 - pos)
        torch.manual_seed(100 + pos)  # a different global RNG state each time
        assert sample(logits, params, outputs).token_ids[pos] == alone


def test_seeded_row_ignores_filters_of_other_rows():
    """On the CPU kernel path filters turn into -inf logits per row; a row without filters must
    see its raw logits whatever the others ask for."""
    torch.manual_seed(0)
    row = torch.randn(64)
    seeded = SamplingParams(temperature=0.9, seed=11)
    alone = [sample(row.unsqueeze(0), [seeded], [[4] * s]).token_ids[0] for s in range(12)]
    others = [SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(top_k=3, min_p=0.2, seed=1)]
    for s in range(12):
        logits = torch.stack([torch.randn(64), row, torch.randn(64)])
        out = sample(logits, [others[0], seeded, others[1]], [[1], [4] * s, [2]])
        assert out.token_ids[1] == alone[s]


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_filters_and_distribution_on_both_paths(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(sampler_mod, "_race_kernel_usable", lambda logits: False)
    n = 3000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    tokens = sample(logits.repeat(n, 1), [SamplingParams(temperature=0.9, top_k=4)] * n).token_ids
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    expected = (logits[:4] / 0.9).softmax(-1) * n
    chi2 = ((torch.bincount(tokens, minlength=4).float() - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27, chi2  # 99.9th percentile, 3 dof
    tokens = sample(logits.repeat(200, 1), [SamplingParams(temperature=1.0, min_p=0.5)] * 200).token_ids
    assert set(tokens.tolist()) <= {0, 1} and len(set(tokens.tolist())) == 2  # e^-0.5 > 0.5 > e^-1


def test_seeded_tokens_vary_with_step_and_seed():
    logits = torch.zeros(1, 8)  # uniform: any token is equally likely
    by_step = {sample(logits, [SamplingParams(seed=3)], [[0] * s]).token_ids.item() for s in range(40)}
    by_seed = {sample(logits, [SamplingParams(seed=s)]).token_ids.item() for s in range(40)}
    assert len(by_step) > 3 and len(by_seed) > 3


def test_top_k_one_and_tiny_top_p_equal_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 100)
    expected = logits.argmax(-1)
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.5)):
        for _ in range(5):
            assert torch.equal(sample(logits, [p] * 16).token_ids, expected)


def test_top_k_and_top_p_keep_the_expected_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2000, 1)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 2000).token_ids
    assert set(top_k.tolist()) == {0, 1}
    # Mass before token 2 is 0.7 < 0.75, so it stays; token 3 (0.9 before it) goes.
    top_p = sample(logits, [SamplingParams(top_p=0.75)] * 2000).token_ids
    assert set(top_p.tolist()) == {0, 1, 2}


def test_min_p_removes_low_probability_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])  # min_p 0.2 -> threshold 0.1 drops token 3
    logits = probs.log().repeat(3000, 1)
    tokens = sample(logits, [SamplingParams(min_p=0.2)] * 3000).token_ids
    assert set(tokens.tolist()) == {0, 1, 2}
    unfiltered = sample(logits, [SamplingParams()] * 3000).token_ids
    assert 3 in unfiltered.tolist()


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
    ]
    batch = SamplingBatch.build(params, [[0], [0]], [[1, 1, 2], [1, 1, 2]], 4, CPU)
    got = apply_penalties(logits, batch)
    # Row 0: repetition over {0, 1, 2} -> [1, -2, 0.25, 3]; then token 1 (count 2)
    # loses 0.5 * 2 + 1 and token 2 (count 1) loses 0.5 * 1 + 1. Row 1: no penalties.
    assert torch.allclose(got[0], torch.tensor([1.0, -4.0, -1.25, 3.0]))
    assert torch.equal(got[1], logits[1])
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0]))  # input untouched


def test_penalty_flips_greedy_choice_and_no_penalty_builds_nothing():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [p], [[0]]).token_ids.item() == 1
    plain = SamplingBatch.build([SamplingParams(temperature=0.0)], [[0]], [[0]], 3, CPU)
    assert plain.all_greedy and not plain.has_penalties and plain.temperature is None


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_distribution_matches_softmax(seeded):
    n = 4000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    temperature = 0.8
    expected = (logits / temperature).softmax(-1) * n
    if seeded:  # per-row generators must also give Exp(1) noise
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(n)]
    else:
        params = [SamplingParams(temperature=temperature)] * n
    tokens = sample(logits.repeat(n, 1), params).token_ids
    counts = torch.bincount(tokens, minlength=5).float()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47, (chi2, counts, expected)  # 99.9th percentile of chi-square, 4 dof


def test_logprobs_are_raw_log_softmax_with_sorted_top_ids():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=1.0),
    ]
    batch = SamplingBatch.build(params, [[1, 2]] * 3, [[3]] * 3, 30, CPU)
    out = Sampler()(logits.to(torch.bfloat16), batch)
    raw = logits.to(torch.bfloat16).float().log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.top_logprobs, raw.gather(1, out.top_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_ids[:, 0], raw.argmax(-1))


def test_logprobs_zero_gives_empty_top_columns():
    out = sample(torch.randn(2, 7), [SamplingParams(temperature=0.0, logprobs=0), SamplingParams()])
    assert out.logprobs.shape == (2,) and out.top_ids.shape == (2, 0)


def test_seeded_tokens_survive_rounding_noise_in_the_logits():
    """A prefix-cache hit or another batch shape changes logits in their last bits; a seeded
    row must still pick the same token almost always (an inverse-CDF sampler flipped ~half)."""
    n, vocab = 200, 4000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(n, vocab, generator=g) * 2.5
    noisy = logits + torch.randn(n, vocab, generator=g) * 0.01
    params = [SamplingParams(temperature=1.2, seed=s) for s in range(n)]
    a, b = sample(logits, params).token_ids, sample(noisy, params).token_ids
    assert (a != b).float().mean() < 0.05
