"""The AMX prefill attention kernel (csrc/attention/prefill_attention.cpp) against an fp32 reference:
causal from the chunk's offset in its context, grouped-query heads, ragged sizes, strided q/k/v
as the projections leave them; and the engine's two prefill paths through it."""
from __future__ import annotations

import pytest
import torch

from native.prefill_attention import prefill_attention, prefill_attention_available

pytestmark = pytest.mark.skipif(not prefill_attention_available(), reason="needs a CPU with AVX512-BF16")


def reference(q, k, v, scale, window=0):
    """fp32 softmax(scale q k^T) v, query i seeing keys 0 .. L - n + i (above L - n + i - window)."""
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    g = heads // kv_heads
    qf = q.float().transpose(0, 1)
    kf, vf = (t.float().transpose(0, 1).repeat_interleave(g, 0) for t in (k, v))
    s = qf @ kf.transpose(1, 2) * scale
    i, j = torch.arange(n).unsqueeze(1), torch.arange(ctx).unsqueeze(0)
    s = s.masked_fill(j > ctx - n + i, float("-inf"))
    if window:
        s = s.masked_fill(j <= ctx - n + i - window, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1)


def qkv_views(n, ctx, heads, kv_heads, d, seed):
    """q [n, H, D], k/v [ctx, KVH, D] as strided views of one [ctx, H + 2 KVH, D] projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(ctx, heads + 2 * kv_heads, d, generator=g).bfloat16()
    return qkv[ctx - n:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


@pytest.mark.parametrize("n,ctx", [(1, 1), (5, 5), (16, 16), (17, 17), (33, 33), (100, 100), (530, 530),
                                   (1, 40), (17, 40), (100, 700), (31, 64)])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (4, 1, 256), (12, 1, 64)])
def test_matches_fp32_reference(n, ctx, heads, kv_heads, d):
    q, k, v = qkv_views(n, ctx, heads, kv_heads, d, seed=n * 7 + ctx + d)
    scale = d ** -0.5
    got = prefill_attention(q, k, v, scale)
    assert got.shape == (n, heads, d) and got.dtype == torch.bfloat16
    # bf16 output (~3 significant digits) and P rounded to bf16 before the product with V
    torch.testing.assert_close(got.float(), reference(q, k, v, scale), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n,ctx,window", [(530, 530, 512), (700, 700, 64), (100, 700, 512), (1, 600, 512),
                                          (33, 100, 40), (17, 40, 1), (300, 300, 600)])
def test_sliding_window_matches_fp32_reference(n, ctx, window):
    q, k, v = qkv_views(n, ctx, 4, 1, 256, seed=n + ctx + window)
    got = prefill_attention(q, k, v, 0.0625, window)
    torch.testing.assert_close(got.float(), reference(q, k, v, 0.0625, window), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [0, 512, 100])
def test_a_chunk_gets_the_bits_of_the_whole(window):
    """Queries cut into chunks (each chunk's keys: from a multiple of 32 up to its last query,
    the window's unseen keys zeroed) give bitwise what the one-chunk call gives them."""
    n = 1300
    q, k, v = qkv_views(n, n, 4, 1, 256, seed=3)
    whole = prefill_attention(q, k, v, 0.0625, window)
    for c0, c1 in [(0, 384), (384, 768), (768, 1299), (1299, 1300), (600, 601), (1000, 1100)]:
        a = max(0, c0 - window + 1) // 32 * 32 if window else 0
        kk, vv = k[a:c1].clone(), v[a:c1].clone()
        if window:  # keys no query of the chunk sees: zeros, as the ring gives garbage there
            dead = max(0, c0 - window + 1) - a
            kk[:dead], vv[:dead] = 0, 0
        got = prefill_attention(q[c0:c1], kk, vv, 0.0625, window)
        assert torch.equal(got, whole[c0:c1]), (c0, c1)


def test_first_query_sees_only_the_context_up_to_its_position():
    """A value that only a future key carries must not leak into earlier queries."""
    n, d = 20, 64
    q, k, v = (torch.zeros(n, 1, d, dtype=torch.bfloat16) for _ in range(3))
    v[-1] = 1000.0  # the last key's value
    out = prefill_attention(q, k, v, 1.0)
    assert out[:-1].abs().max().item() == 0.0
    assert out[-1].float().mean().item() == pytest.approx(1000.0 / n, rel=1e-2)


@pytest.mark.parametrize("bad", ["fp32", "head_dim", "short_context", "heads", "window"])
def test_bad_inputs_raise(bad):
    q, k, v = qkv_views(8, 8, 4, 2, 64, seed=0)
    if bad == "fp32":
        q = q.float()
    elif bad == "head_dim":
        q, k, v = (t[..., :48].contiguous() for t in (q, k, v))
    elif bad == "short_context":
        k, v = k[:4], v[:4]
    elif bad == "heads":
        q = q[:, :3]
    with pytest.raises(RuntimeError):
        prefill_attention(q, k, v, 0.125, -1 if bad == "window" else 0)


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_engine_prefill_with_kernel_matches_sdpa_path(model, monkeypatch):
    """bf16 logits of a first chunk and of a chunk after a cached prefix, kernel vs SDPA."""
    import engine.layers.attention as attention
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", kv_cache_gb=0.25, max_num_batched_tokens=64))
    # the modules' attention, whose two paths this compares (the step plan calls the kernel itself
    # and equals the modules bit for bit: tests/unit/engine/test_decode_plan.py)
    eng.runner.model.use_decode_plan = False
    prompt = torch.randint(100, 20000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)

    calls = []

    def counted(*args):
        calls.append(args[1].shape[0])  # keys: the chunk's own, or its context
        return prefill_attention(*args)

    monkeypatch.setattr(attention, "prefill_attention", counted)

    def first_token_top5(kernel: bool) -> dict[int, float]:
        monkeypatch.setattr(attention, "prefill_kernel_usable", lambda q: kernel)
        return dict(eng.generate([prompt], params)[0].logprobs[0].top)

    # 150 tokens in chunks of 64: the second and third attend over earlier context (the masked
    # path; Gemma's sliding layers take the kernel with its window, their keys padded down to a
    # multiple of 32). The two paths round differently (bf16), so compare distributions, not bits.
    a = first_token_top5(True)
    assert 64 in calls and 150 in calls  # the kernel ran on a first chunk and over context
    calls.clear()
    b = first_token_top5(False)
    assert not calls
    common = sorted(set(a) & set(b))
    assert len(common) >= 4
    # Tolerance from SDPA alone: the same prompt in chunks of 64 vs in one chunk moves these
    # logprobs by up to 0.08 on SmolLM2 and 0.14 on Gemma (bf16; measured). The kernel vs SDPA
    # at equal chunking: up to 0.09 and 0.16.
    assert [a[t] for t in common] == pytest.approx([b[t] for t in common], abs=0.25)
