"""The embedded models with the host cache: multi-turn hits give the tokens of no cache at all.

Gemma's conversation is longer than its 512-token window from the first turn, so every
hit restores a stored SWA state, not only pages.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from hicache.cache import HostCache
from tests.conftest import TEST_DEVICE

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
SYSTEM = "You are a careful assistant who explains river geography in plain words. " * 2
DOC = "The history of the river valley is long and complicated, shaped by floods and trade. " * 30
TURNS = ["Summarise the passage in one sentence.", "Now name one cause of the floods.",
         "And what did the traders carry?"]


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_multi_turn_hits_equal_no_cache(model):
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_gb=0.25, max_num_batched_tokens=256,
                                 page_size=16, device=TEST_DEVICE, hicache_size_gb=0.25, hicache_state_slots=4),
                    host_cache=HostCache.for_engine)
    tok = eng.tokenizer
    on = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    off = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1, prefix_cache=False)
    prompt = tok(SYSTEM + DOC).input_ids
    window = eng.model_cfg.sliding_window
    if window:
        assert len(prompt) > window
    try:
        for turn, text in enumerate(TURNS):
            prompt = prompt + tok("\nUser: " + text + "\nAssistant:", add_special_tokens=False).input_ids
            ref = eng.generate([prompt], off)[0]
            out = eng.generate([prompt], on)[0]
            assert out.new_token_ids == ref.new_token_ids, f"turn {turn} ({len(prompt)} tokens)"
            torch.testing.assert_close(torch.tensor([t.logprob for t in out.logprobs]),
                                       torch.tensor([t.logprob for t in ref.logprobs]), atol=2e-3, rtol=0)
            if turn:
                assert out.cached_tokens >= prev_len - 16 and (not window or out.cached_tokens > window)
            prev_len = len(prompt)
            prompt = prompt + out.new_token_ids
        s = eng.stats()["hicache"]
        assert s["hits"] == len(TURNS) - 1 and (not window or s["states_used"] >= len(TURNS))
        assert eng.pool.used_pages == 0 and all(n.refs == 0 for n in eng.hicache.index.nodes())
    finally:
        eng.close()
