"""The step plan (engine/models/llama.py: a step as one flat loop over the CPU kernels: decode
entries, prefill chunks or both) gives what the modules give, bit for bit, and follows weight
changes."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.llama import LlamaDecodePlan
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(num_threads=1, kv_cache_gb=0.1, max_num_batched_tokens=512))
    if not isinstance(eng.runner.model.decode_plan(), LlamaDecodePlan):
        # None where no kernel runs; LlamaDecodePlanF32 on float32 (AVX2-only CPUs: --dtype auto
        # is float32 there), which test_float32_plan_matches_the_modules_bit_for_bit covers
        eng.close()
        pytest.skip("no bf16 decode plan here (needs the bf16 CPU kernels)")
    yield eng
    eng.close()


def _run(eng: LLMEngine, prompts, use_plan: bool) -> dict[str, list]:
    eng.runner.model.use_decode_plan = use_plan
    out: dict[str, list] = {}
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True,
                                                       logprobs=3))
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
    finally:
        eng.runner.model.use_decode_plan = True
    return out


def test_plan_matches_the_modules_bit_for_bit(engine):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (70, 300, 5, 130)]
    calls = []
    run = LlamaDecodePlan.run
    LlamaDecodePlan.run = lambda self, *a: calls.append(1) or run(self, *a)
    try:
        planned = _run(engine, prompts, use_plan=True)
    finally:
        LlamaDecodePlan.run = run
    # the prompts fit one prefill step; the 16 steps after it (the longest request's 17 tokens,
    # the first from the prefill) are decode only: all 17 took the plan
    assert len(calls) == 8 + 3 * 3
    assert planned == _run(engine, prompts, use_plan=False)
    assert [len(v) for v in planned.values()] == [8, 11, 14, 17]


def test_plan_matches_the_modules_for_chunks_context_and_mixed_steps(engine):
    """Prompts past the step budget (512 here) go in chunks, the later ones over their earlier
    context from the pages; requests added while others decode share steps with them (decode
    rows and prefill rows in one step); a repeated prompt hits the prefix cache (a chunk over
    cached context). Every such step takes the plan, and the bits are the modules'."""
    g = torch.Generator().manual_seed(6)
    base = torch.randint(100, 30000, (700,), generator=g).tolist()
    waves = [[base, torch.randint(100, 30000, (40,), generator=g).tolist()],
             [torch.randint(100, 30000, (300,), generator=g).tolist(), base[:600] + [7, 8, 9]]]

    def run(use_plan: bool, calls: list) -> dict:
        eng = engine
        eng.runner.model.use_decode_plan = use_plan
        out: dict[str, list] = {}
        orig = LlamaDecodePlan.run
        LlamaDecodePlan.run = lambda self, model, fb, pool: calls.append((fb.num_decode, len(fb.prefills))) or orig(
            self, model, fb, pool)
        try:
            for w, prompts in enumerate(waves):
                for i, p in enumerate(prompts):
                    eng.add_request(f"w{w}-{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                                    logprobs=2))
                for _ in range(3 if w == 0 else 10**6):  # the second wave arrives mid-decode
                    if not eng.has_unfinished():
                        break
                    for o in eng.step():
                        out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
        finally:
            LlamaDecodePlan.run = orig
            eng.runner.model.use_decode_plan = True
        return out

    planned_calls: list = []
    planned = run(True, planned_calls)
    assert planned == run(False, [])
    assert sorted(planned) == ["w0-0", "w0-1", "w1-0", "w1-1"] and all(len(v) == 6 for v in planned.values())
    assert any(b and p for b, p in planned_calls)  # a mixed step
    assert sum(p for _, p in planned_calls) >= 5  # 700 tokens in two chunks, and the others


def test_plan_matches_the_modules_above_the_kernels_rows():
    """A step of more tokens than the linear kernel takes (gemm_rows(): 1024 where AMX runs) has
    its linears on torch's GEMM in the plan as in the modules; the last layer's sampled rows go
    back to the kernel."""
    from native.linear import gemm_rows, small_linear_available

    if not small_linear_available():
        pytest.skip("no decode plan here (needs the bf16 CPU kernels)")
    n = gemm_rows() + 200
    if n > 4096:
        pytest.skip("the kernel takes every row count here")
    eng = LLMEngine(EngineConfig(num_threads=1, kv_cache_gb=0.1, max_num_batched_tokens=n + 100))
    try:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(100, 30000, (m,), generator=g).tolist() for m in (n - 300, 300)]
        calls = []
        orig = LlamaDecodePlan.run
        LlamaDecodePlan.run = lambda self, model, fb, pool: calls.append(fb.num_tokens) or orig(self, model, fb, pool)
        try:
            planned = _run(eng, prompts, use_plan=True)
        finally:
            LlamaDecodePlan.run = orig
        assert calls[0] == n  # both prompts in one step, past the kernel's rows
        assert planned == _run(eng, prompts, use_plan=False)
    finally:
        eng.close()


def test_plan_matches_the_modules_for_a_batch_above_16_rows(engine):
    """20 rows a step: where the AMX GEMM runs, its copies of the weights (and the gate|up
    projection fused with the activation) take these steps; the bits stay the modules'."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 30000, (5 + 3 * i,), generator=g).tolist() for i in range(20)]
    planned = _run(engine, prompts, use_plan=True)
    assert planned == _run(engine, prompts, use_plan=False)
    assert len(planned) == 20


def test_the_embedded_models_quant_copies_decode_its_bits(engine):
    """SmolLM2's GGUF is Q4_1 (layers) and Q8_0 (embedding, tied head): where AMX runs, every
    Linear gets the exact block copy at load and decode batches read it; the tokens and logprobs
    are the bf16 weights', bit for bit (before any test here changes a weight)."""
    from engine.layers.linear import Linear

    if not torch.ops.pdserve.small_linear_amx():
        pytest.skip("no AMX on this CPU: no quant copies")
    model = engine.runner.model
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant_weight() is not None for m in lins)
    head = model.lm_head.weight
    assert model.lm_head.quant_weight().numel() == head.shape[0] // 16 * head.shape[1] // 32 * 576  # Q8_0
    lin = model.layers[0].self_attn.o_proj
    assert lin.quant_weight().numel() == lin.weight.numel() // 512 * 320  # Q4_1, GGUF's fp16 d and m
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (40, 90, 7)]
    with_quant = _run(engine, prompts, use_plan=True)
    saved = {m: m._quant for m in lins}
    try:
        for m in lins:
            m._quant = None
        model.__dict__.pop("_decode_plan", None)
        assert with_quant == _run(engine, prompts, use_plan=True)
        assert with_quant == _run(engine, prompts, use_plan=False)
    finally:
        for m, q in saved.items():
            m._quant = q
        model.__dict__.pop("_decode_plan", None)


def test_plan_is_rebuilt_when_a_weight_changes(engine):
    model = engine.runner.model
    plan = model.decode_plan()
    assert model.decode_plan() is plan
    w = model.layers[3].mlp.down_proj.weight
    w.mul_(1)  # in place (same values): the version moves
    assert model.decode_plan() is not plan
    plan = model.decode_plan()
    lin = model.layers[0].self_attn.o_proj
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    assert model.decode_plan() is not plan and model.decode_plan().current()


def test_no_plan_off_the_kernels(monkeypatch):
    monkeypatch.setattr("engine.models.llama.small_linear_available", lambda: False)  # as without AVX512-BF16
    eng = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=1, kv_cache_gb=0.05, max_num_batched_tokens=256))
    try:
        assert eng.runner.model.decode_plan() is None
    finally:
        eng.close()


def test_float32_plan_matches_the_modules_bit_for_bit():
    """float32 (CPUs without AVX512-BF16): steps of decode rows only, up to the quant-copy
    kernel's 16, take llama_plan_f32.py's plan; steps with prompt chunks and larger batches go
    through the modules; the bits are the modules' either way; a weight changed in place loses
    its quant copy, and the model its plan."""
    from engine.models.llama_plan_f32 import LlamaDecodePlanF32

    eng = LLMEngine(EngineConfig(dtype="float32", num_threads=1, kv_cache_gb=0.1, max_num_batched_tokens=512,
                                 prefill_pack_tokens=0))  # (all four prompts in one step)
    try:
        model = eng.runner.model
        plan = model.decode_plan()
        if plan is None:
            pytest.skip("no float32 plan here (needs the AVX2 quant-copy kernel)")
        assert isinstance(plan, LlamaDecodePlanF32)
        g = torch.Generator().manual_seed(8)
        prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (70, 300, 5, 130)]
        calls = []
        orig = LlamaDecodePlanF32.run
        LlamaDecodePlanF32.run = lambda self, model, fb, pool: calls.append(fb.num_tokens) or orig(self, model, fb, pool)
        try:
            planned = _run(eng, prompts, use_plan=True)
            assert calls == [4] * 7 + [3] * 3 + [2] * 3 + [1] * 3  # every decode step, none with a prompt
            assert planned == _run(eng, prompts, use_plan=False)
            calls.clear()
            many = [torch.randint(100, 30000, (5 + i,), generator=g).tolist() for i in range(20)]
            planned = _run(eng, many, use_plan=True)  # 20 rows: the modules, until 16 are left
            assert calls and max(calls) == 16
            assert planned == _run(eng, many, use_plan=False)
        finally:
            LlamaDecodePlanF32.run = orig
        w = model.layers[2].mlp.down_proj.weight
        w.mul_(1)  # in place: the Linear drops its quant copy, so that layer takes torch's GEMM again
        assert model.layers[2].mlp.down_proj.quant_weight() is None and model.decode_plan() is None
    finally:
        eng.close()
