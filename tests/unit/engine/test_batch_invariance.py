"""A prompt's tokens and logprobs do not depend on how the scheduler cut it into chunks or on
what else shared its steps, as long as every step stays within `invariant_rows()` (the
kernels' paths: the linear kernel (AMX GEMM or AVX512-BF16), the prefill attention kernel,
paged attention). Without the prefill kernel (no AVX512-BF16, or PDSERVE_KERNELS=torch) prompts
take torch's SDPA, whose blocking depends on the chunk's length, so the test is skipped then.

This is what makes PD output equal colocated output under load: a colocated rank's chunk
boundaries depend on how many decode rows shared the step's token budget, a prefill rank's
do not."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from native.linear import invariant_rows
from native.prefill_attention import prefill_attention_available


def _run(prompts, budget: int, together: bool, model: str | None = None) -> dict[str, list]:
    kw = {"model": model} if model else {}
    eng = LLMEngine(EngineConfig(num_threads=1, kv_cache_gb=0.25, max_num_batched_tokens=budget, **kw))
    out: dict[str, list] = {}
    try:
        groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
        for group in groups:
            for i in group:
                eng.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=6, temperature=0,
                                                                     ignore_eos=True, logprobs=2))
            while eng.has_unfinished():
                for o in eng.step():
                    out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
    finally:
        eng.close()
    return out


@pytest.mark.parametrize("model", [None, "gemma-3-270m"], ids=["smollm2", "gemma3"])
def test_chunking_and_batching_leave_the_bits_alone(model):
    limit = invariant_rows()
    if limit < 1024 or not prefill_attention_available():
        pytest.skip("needs the chunk GEMM and the prefill attention kernel (steps of up to 1024 rows on the kernels' paths)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (1300, 530, 90)]
    alone = _run(prompts, limit, together=False, model=model)  # chunks of 1024 (+276), 530, 90
    mixed = _run(prompts, 384, together=True, model=model)  # chunks of 384 next to other prompts and decodes
    assert alone == mixed and all(len(v) == 6 for v in alone.values())


def _collect(eng, requests) -> dict[str, list]:
    out: dict[str, list] = {}
    for rid, prompt, params, done in requests:
        eng.add_request(rid, prompt, params, output_ids=done)
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
    return out


@pytest.mark.parametrize("model", [None, "gemma-3-270m"], ids=["smollm2", "gemma3"])
def test_a_resumed_request_goes_on_with_the_bits_of_the_uninterrupted_one(model):
    """A request moved from a dead rank (add_request output_ids) recomputes the tokens it had
    generated as decode rows, as the steps that made them did, so its next tokens and logprobs
    have the uninterrupted run's bits (a prefill over them rounds differently: in bf16 a near
    tie then flips a later greedy token)."""
    limit = invariant_rows()
    if not limit:
        pytest.skip("needs the linear kernel (torch's GEMM gives a row other bits in another batch)")
    kw = {"model": model} if model else {}
    eng = LLMEngine(EngineConfig(num_threads=1, kv_cache_gb=0.25, max_num_batched_tokens=min(limit, 1024), **kw))
    g = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(100, 30000, (n,), generator=g).tolist() for n in (300, 120))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    try:
        whole = _collect(eng, [("whole", prompt, params, [])])["whole"]
        cut = 25
        moved = _collect(eng, [("other", other, params, []),
                               ("moved", prompt, params, [t for t, _, _ in whole[:cut]])])
    finally:
        eng.close()
    assert moved["moved"] == whole[cut:] and len(moved["other"]) == 40
