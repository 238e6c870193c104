"""Engine vs Hugging Face transformers on tiny random checkpoints of every supported family."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE, TINY_FAMILIES

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENS = (5, 17, 40, 1)


def _prompts(lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", page_size=4, kv_cache_gb=0.01, max_num_seqs=8,
               max_num_batched_tokens=16, device=TEST_DEVICE)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _page_bytes(path) -> int:
    return KVPool.bytes_per_page(ModelConfig.from_hf_dir(path), 4, torch.float32)


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().to(TEST_DEVICE)


def _hf_greedy(hf, prompt, n):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt], device=TEST_DEVICE), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_matches_hf_mixed_batch_chunked(tiny_model_dir, family):
    path = tiny_model_dir(family)
    eng = _engine(path)
    prompts = _prompts()
    outs = eng.generate(prompts, GREEDY)
    hf = _hf(path)
    for p, o in zip(prompts, outs):
        assert o.new_token_ids == _hf_greedy(hf, p, GREEDY.max_tokens), f"{family} prompt len {len(p)}"
    assert eng.pool.used_pages == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_logprobs_match_hf_logits(tiny_model_dir, family):
    path = tiny_model_dir(family)
    eng = _engine(path)
    prompts = _prompts((23, 9))
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    hf = _hf(path)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf(torch.tensor([p], device=TEST_DEVICE)).logits[0, -1].float().log_softmax(-1).cpu()
        top = o.logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=1e-4, rtol=0)
        assert ids.tolist() == ref.topk(20).indices.tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_preemption_recomputes_to_same_output(tiny_model_dir, family):
    """A pool too small for all sequences at once forces preemption; outputs do not change."""
    path = tiny_model_dir(family)
    prompts = _prompts((30, 30, 30, 30), seed=7)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = [o.new_token_ids for o in _engine(path).generate(prompts, params)]
    # 50 tokens per sequence -> 13 pages of 4; 30 pages fit two, not four.
    small = _engine(path, kv_cache_gb=30 * _page_bytes(path) / 2**30)
    outs = small.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == ref
    assert small.scheduler.num_preemptions > 0
    assert small.pool.used_pages == 0 and small.pool.free_slots == small.pool.num_slots




def test_abort_in_every_phase_frees_pages(tiny_model_dir):
    eng = _engine(tiny_model_dir("gemma3"), max_num_seqs=2)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    prompts = _prompts((40, 40, 40))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    eng.step()  # r0 prefilling (chunk of 16), r1/r2 waiting
    assert eng.abort("r2").finish_reason == "abort"  # waiting
    eng.step()
    assert eng.abort("r0").finished  # mid-prefill
    for _ in range(8):
        eng.step()
    assert eng.abort("r1").finish_reason == "abort"  # decoding
    assert eng.abort("r1") is None  # idempotent
    assert not eng.has_unfinished()
    assert eng.pool.used_pages == 0 and eng.pool.free_slots == eng.pool.num_slots


def test_swa_memory_does_not_grow_with_context(tiny_model_dir):
    """Gemma-style model: only full-attention layers take pages; SWA state is one fixed slot."""
    eng = _engine(tiny_model_dir("gemma3"))
    per_page = eng.pool.full.shape[1]
    assert per_page == 2  # two full layers of four
    assert eng.pool.swa.shape[3] == 8  # the ring holds exactly `window` tokens
    eng.add_request("long", _prompts((120,))[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    eng.step()
    ring_bytes = eng.pool.swa[0].numel()
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.swa[0].numel() == ring_bytes and eng.pool.used_pages == 0


def test_seeded_sampling_reproducible_and_batch_independent(tiny_model_dir):
    eng = _engine(tiny_model_dir("llama"))
    p = _prompts((10, 20, 30))
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    alone = eng.generate([p[0]], seeded)[0].new_token_ids
    mixed = eng.generate([p[1], p[0], p[2]], [other, seeded, other])[1].new_token_ids
    assert alone == mixed
    assert eng.generate([p[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=99,
                                               ignore_eos=True))[0].new_token_ids != alone


def test_prefill_only_export_then_decode_only_import_equals_colocated(tiny_model_dir):
    """The roles a PD split uses: prefill on one engine, continue on another from its KV export."""
    for family in ("llama", "gemma3"):
        path = tiny_model_dir(family)
        prompts = _prompts((37, 12))
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        colocated = [o.new_token_ids for o in _engine(path).generate(prompts, params)]
        pre, dec = _engine(path), _engine(path, page_size=4)
        for i, prompt in enumerate(prompts):
            pre.add_request(f"p{i}", prompt, params, prefill_only=True)
            out = None
            while pre.has_unfinished():
                for o in pre.step():
                    out = o
            assert out.finished and out.kv_export is not None and len(out.new_token_ids) == 1
            assert pre.pool.used_pages == 0
            dec.add_imported(f"d{i}", prompt, out.new_token_ids, params, out.kv_export)
            toks = list(out.new_token_ids)
            while dec.has_unfinished():
                for o in dec.step():
                    toks += o.new_token_ids
            assert toks == colocated[i], family
        assert dec.pool.used_pages == 0


def test_invalid_requests_rejected(tiny_model_dir):
    eng = _engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("b", [10**6], GREEDY)
    with pytest.raises(ValueError, match="context"):
        eng.add_request("c", [5] * 10_000, GREEDY)
    eng.add_request("d", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="in use"):
        eng.add_request("d", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_token_ids_outside_the_vocabulary_are_refused_at_admission(tiny_model_dir):
    """An id-valued field past the vocabulary (min_tokens turns stop_token_ids into a logits
    index) is refused alone, at admission, with every kind of admission; the request beside it
    runs as if alone."""
    eng = _engine(tiny_model_dir("llama"))
    v = eng.model_cfg.vocab_size
    for bad in ((v,), (-1,), (3, v + 100)):
        params = SamplingParams(max_tokens=4, min_tokens=1, temperature=0, stop_token_ids=bad)
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.add_request("bad", [5, 6, 7], params)
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.add_request("bad", [5, 6, 7], params, output_ids=[8])
        res = eng.reserve_kv(3)
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.add_prefilled("bad", [5, 6, 7], [8], params, res)
    assert not eng.seqs and eng.pool.used_pages == 0
    ok = SamplingParams(max_tokens=4, min_tokens=1, temperature=0, ignore_eos=True, stop_token_ids=(v - 1,))
    alone = eng.generate([[5, 6, 7]], ok)[0]
    assert len(alone.new_token_ids) == 4 and eng.pool.used_pages == 0


def test_logit_bias_moves_the_logits_before_sampling_and_logprobs_and_bad_ids_are_refused(tiny_model_dir):
    """+100 forces a token under greedy and beats a penalty; -100 removes the greedy choice;
    logprobs are of the biased logits (as OpenAI reports them); the row beside is untouched."""
    path = tiny_model_dir("llama")
    eng = _engine(path)
    prompt = _prompts((9,))[0]
    plain = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))[0]
    first = plain.new_token_ids[0]
    forced = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, logit_bias=((7, 100.0),),
                            repetition_penalty=1.5)
    banned = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logit_bias=((first, -100.0),))
    outs = eng.generate([prompt, prompt, prompt], [forced, banned, GREEDY])
    assert outs[0].new_token_ids == [7, 7, 7] and outs[0].logprobs[0].top[0][0] == 7
    assert outs[0].logprobs[0].logprob > -1e-3  # after the bias the token holds ~all the mass
    assert outs[1].new_token_ids[0] != first
    assert outs[2].new_token_ids[:3] == plain.new_token_ids
    v = eng.model_cfg.vocab_size
    with pytest.raises(ValueError, match="logit_bias: token id"):
        eng.add_request("bad", prompt, SamplingParams(max_tokens=2, logit_bias=((v, 1.0),)))
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(max_tokens=2, logit_bias=((1, float("nan")),))
    assert eng.pool.used_pages == 0


def test_length_finish_at_context_end(tiny_model_dir):
    eng = _engine(tiny_model_dir("llama"), max_model_len=20)
    out = eng.generate([[5] * 15], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.prompt_tokens + out.completion_tokens == 20


def test_stop_string_across_tokens_and_stop_ids(tiny_model_dir):
    eng = _engine(tiny_model_dir("llama"))
    prompt = _prompts((9,))[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    toks, text = free.new_token_ids, free.text
    # A stop string that starts inside token 3's text and ends inside token 5's.
    pieces = [eng.tokenizer.decode(toks[:i]) for i in range(len(toks) + 1)]
    start, end = len(pieces[3]) - 1, len(pieces[5]) + 1
    stop = text[start:end]
    assert stop and text.find(stop) == start
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.stop_str == stop and out.text == text[:start]
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(toks[4],)))[0]
    assert out.new_token_ids == toks[:toks.index(toks[4]) + 1] and out.finish_reason == "stop"
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.new_token_ids == toks[:6] and out.finish_reason == "length"


def test_min_tokens_masks_eos(tiny_model_dir):
    eng = _engine(tiny_model_dir("llama"))
    prompt = _prompts((9,))[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].new_token_ids
    stop_tok = free[1]
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_tok,),
                                                min_tokens=4))[0]
    assert stop_tok not in out.new_token_ids[:4] and len(out.new_token_ids) >= 4
