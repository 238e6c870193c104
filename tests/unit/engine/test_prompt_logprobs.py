"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax on the same
prompt: chunked prefill, a prefix the host cache holds, a sliding last layer, and rows beside them
that must not change."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from hicache.cache import HostCache
from tests.conftest import TEST_DEVICE


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", page_size=4, kv_cache_gb=0.01, max_num_seqs=8,
               max_num_batched_tokens=16, device=TEST_DEVICE)
    cfg.update(kw)
    host = HostCache.for_engine if cfg.get("hicache_size_gb") else None
    return LLMEngine(EngineConfig(**cfg), host_cache=host)


def _prompt(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _reference(path, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().to(TEST_DEVICE)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt], device=TEST_DEVICE)).logits[0].float().cpu()
    return logits.log_softmax(-1)  # [n, V]: row j scores token j + 1


def _check(plp, ref, prompt, k):
    n = len(prompt)
    assert len(plp.logprobs) == n - 1
    want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(plp.logprobs), want, atol=1e-4, rtol=0)
    for j in range(n - 1):
        # (a logit within float error of the token's may fall on either side)
        assert int((ref[j] > want[j] + 1e-4).sum()) + 1 <= plp.ranks[j] <= int((ref[j] > want[j] - 1e-4).sum()) + 1
        if k:
            top = ref[j].topk(k)
            assert plp.top_ids[j] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(plp.top_logprobs[j]), top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_prompt_logprobs_equal_transformers_over_chunks(tiny_model_dir, family):
    """A 37-token prompt in chunks of at most 16 (mistral: every layer sliding, so its last layer
    takes the sampled and the prompt rows in one pass)."""
    path = tiny_model_dir(family)
    prompt = _prompt(37)
    out = _engine(path).generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5))[0]
    _check(out.prompt_logprobs, _reference(path, prompt), prompt, 5)


def test_rows_beside_a_prompt_logprob_request_are_unchanged(tiny_model_dir):
    """Other requests of the same steps decode what they decode alone; a prompt of one token has
    no prompt logprobs; a request without them gets none."""
    path = tiny_model_dir("llama")
    others = [_prompt(9, seed=5), _prompt(21, seed=6)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [o.new_token_ids for o in _engine(path).generate(others, greedy)]
    eng = _engine(path)
    asks = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = eng.generate(others + [_prompt(30, seed=7), [42]], [greedy, greedy, asks, asks])
    assert [o.new_token_ids for o in outs[:2]] == alone
    assert outs[0].prompt_logprobs is None
    assert outs[3].prompt_logprobs.logprobs == []
    _check(outs[2].prompt_logprobs, _reference(path, _prompt(30, seed=7)), _prompt(30, seed=7), 0)
    assert eng.pool.used_pages == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompt_logprobs_with_a_cached_prefix_recompute_it(tiny_model_dir, family):
    """The host cache holds the prompt's first pages (an earlier request stored them): a request
    asking for prompt logprobs computes them anyway and gets every position; one that does not
    ask still hits."""
    path = tiny_model_dir(family)
    prompt = _prompt(33)
    eng = _engine(path, hicache_size_gb=0.01, hicache_state_slots=8)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    eng.generate([prompt[:24]], greedy)
    out = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert out.cached_tokens == 0
    _check(out.prompt_logprobs, _reference(path, prompt), prompt, 3)
    assert eng.generate([prompt], greedy)[0].cached_tokens > 0


def test_a_resumed_request_does_not_recompute_them(tiny_model_dir):
    """A request moved here with tokens it already generated sent its prompt logprobs already."""
    path = tiny_model_dir("llama")
    eng = _engine(path)
    p = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    eng.add_request("r", _prompt(12), p, output_ids=[7])
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert all(o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
