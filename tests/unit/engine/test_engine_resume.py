"""A request resumed from tokens it generated elsewhere (add_request output_ids: the router moved
it from a dead rank) goes on exactly as the uninterrupted one: greedy, seeded sampling,
penalties. (The detokenizer is primed with the resumed tokens as for add_imported.)"""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", page_size=4, kv_cache_gb=0.01,
                                 max_num_seqs=8, max_num_batched_tokens=16, device=TEST_DEVICE))
    yield eng
    eng.close()


def _run(eng, rid, prompt, params, output_ids=()):
    eng.add_request(rid, prompt, params, output_ids=list(output_ids))
    toks, text, last = [], "", None
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            text += o.text
            last = o
    return toks, text, last


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, frequency_penalty=0.5),
], ids=["greedy", "seeded-penalised", "seeded-top-p"])
@pytest.mark.parametrize("cut", [1, 6, 13])
def test_resumed_equals_uninterrupted(engine, params, cut):
    prompt = [5, 17, 40, 99, 3, 250, 7]
    whole, _, _ = _run(engine, "whole", prompt, params)
    rest, _, rlast = _run(engine, "rest", prompt, params, whole[:cut])
    assert whole[:cut] + rest == whole
    assert rlast.completion_tokens == len(whole) and rlast.prompt_tokens == len(prompt)
    assert engine.pool.used_pages == 0


def test_resume_checks(engine):
    p = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="room for a new token"):
        engine.add_request("x", [1, 2], p, output_ids=[4, 5, 6])
    with pytest.raises(ValueError, match="prefill-only"):
        engine.add_request("y", [1, 2], p, output_ids=[4], prefill_only=True)
    assert not engine.has_unfinished()
