"""PD mode with a hybrid model: Gemma 3 (sliding window 512) over NIXL, prompts longer than the
window so the SWA rings travel with the pages. Greedy outputs equal the engine run in this
process (the colocated path) token for token.
"""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import start_system, stop_system

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def pd_gemma(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("pd-gemma"),
                          ["--prefill", "1", "--decode", "1", "--transfer", "nixl", "--model", MODEL,
                           "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "8",
                           "--handoff-pool-gb", "0.1", "--disagg", "always"], timeout=420)
    try:
        yield system
    finally:
        stop_system(system)


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, kv_cache_gb=0.25, num_threads=1, max_num_seqs=8))


def test_gemma_pd_equals_colocated_past_the_window(pd_gemma, engine):
    from engine.sampling_params import SamplingParams

    assert engine.model_cfg.sliding_window == 512 and engine.model_cfg.swa_layers
    text = " ".join(f"Line {i}: the {'cat' if i % 2 else 'dog'} counts to {i * 3}." for i in range(150))
    ids = engine.tokenizer(text).input_ids
    for prompt in (ids[:20], ids[:700], ids[:1100 + 5]):  # 700 > window; 1105: a partial last page
        ref = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
        r = httpx.post(pd_gemma.url + "/v1/completions", timeout=300,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                             "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == ref.new_token_ids, len(prompt)
        assert choice["text"] == ref.text
    ranks = pd_gemma.ranks()
    pd_gemma.wait_until(lambda: all(x["pages_used"] == 0 and x["handoff_pages_used"] == 0
                                    for x in pd_gemma.ranks().values()), 5, "idle ranks")
    assert ranks["decode-0"]["state"] == "ready"
