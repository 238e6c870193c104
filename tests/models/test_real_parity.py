"""The embedded models: greedy output equals HF transformers' on the same fp32 weights."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "Water boils at a temperature of",
    # Long: > Gemma's 512-token window, and chunked (budget 256 below).
    "The history of the river valley is long and complicated. " * 60 + "In summary,",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
def pair(request):
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(EngineConfig(model=request.param, dtype="float32", kv_cache_gb=0.5,
                                 max_num_batched_tokens=256, page_size=16, device=TEST_DEVICE))
    hf = AutoModelForCausalLM.from_pretrained(str(eng.model_dir), dtype=torch.float32).eval().to(TEST_DEVICE)
    return eng, hf


def test_greedy_equals_transformers_mixed_batch(pair):
    eng, hf = pair
    ids = [eng.tokenizer(p).input_ids for p in PROMPTS]
    if eng.model_cfg.sliding_window:
        assert max(map(len, ids)) > eng.model_cfg.sliding_window
    outs = eng.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(ids, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt], device=TEST_DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.new_token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    assert eng.pool.used_pages == 0


def test_logits_close_at_fp32(pair):
    eng, hf = pair
    prompt = eng.tokenizer(PROMPTS[-1]).input_ids
    out = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device=TEST_DEVICE)).logits[0, -1].float().log_softmax(-1).cpu()
    ids = [t for t, _ in out.logprobs[0].top]
    ours = torch.tensor([lp for _, lp in out.logprobs[0].top])
    torch.testing.assert_close(ours, ref[ids], atol=2e-3, rtol=0)
    assert ids[:5] == ref.topk(5).indices.tolist()
