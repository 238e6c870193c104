"""The engine with a host cache on tiny models: hits give the same greedy tokens as no cache."""
from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from hicache.cache import HostCache
from tests.conftest import TEST_DEVICE

PS = 4
# Logprobs too: a tiny random model's greedy tokens can survive a wrong KV entry, its logprobs cannot.
ON = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
OFF = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prefix_cache=False)


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", page_size=PS, kv_cache_gb=0.01, max_num_seqs=8,
               max_num_batched_tokens=16, device=TEST_DEVICE, hicache_size_gb=0.01, hicache_state_slots=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), host_cache=HostCache.for_engine)


def _rand(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same(out, ref, msg="") -> None:
    assert out.new_token_ids == ref.new_token_ids, msg
    got = torch.tensor([[lp for _, lp in t.top] for t in out.logprobs])
    want = torch.tensor([[lp for _, lp in t.top] for t in ref.logprobs])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=msg)


def _assert_idle(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.pool.used_pages == 0 and eng.pool.free_slots == eng.pool.num_slots
    assert all(n.refs == 0 for n in eng.hicache.index.nodes())
    assert eng.hicache.pool.free_pages + len(eng.hicache.index) == eng.hicache.pool.num_pages


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_multi_turn_hits_equal_no_cache(tiny_model_dir, family):
    """Turn N+1 extends turn N (prompt + answer + new text); gemma3's window is 8 < every prompt."""
    eng = _engine(tiny_model_dir(family))
    prompt = _rand(21, seed=1)
    for turn in range(4):
        ref = eng.generate([prompt], OFF)[0]
        out = eng.generate([prompt], ON)[0]
        _assert_same(out, ref, f"turn {turn}")
        assert ref.cached_tokens == 0
        if turn:
            # the previous prompt's last page boundary (hybrid: its stored state) is reused
            assert out.cached_tokens == (prev_len // PS) * PS
        prev_len = len(prompt)
        prompt = prompt + out.new_token_ids + _rand(5 + 2 * turn, seed=10 + turn)
    s = eng.stats()["hicache"]
    assert s["hits"] == 3 and s["lookups"] == 4  # prefix_cache=False did not look up
    if family == "gemma3":
        assert s["states_used"] >= 4 and s["bytes_h2d"] > 0
    _assert_idle(eng)
    eng.close()


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_repeat_of_aligned_and_unaligned_prompts(tiny_model_dir, family):
    """A repeat hits up to the last boundary before its last token, for both alignments.

    mistral: every layer slides, so host pages carry no bytes and the state is the whole hit.
    """
    eng = _engine(tiny_model_dir(family))
    for n in (24, 23):  # 24 = 6 pages exactly: the repeat can reuse 5
        prompt = _rand(n, seed=n)
        ref = eng.generate([prompt], OFF)[0]
        _assert_same(eng.generate([prompt], ON)[0], ref)
        again = eng.generate([prompt], ON)[0]
        _assert_same(again, ref)
        assert again.cached_tokens == (n - 1) // PS * PS
    _assert_idle(eng)


def test_prefix_cache_false_bypasses_lookup_and_store(tiny_model_dir):
    eng = _engine(tiny_model_dir("gemma3"))
    eng.generate([_rand(30, 3)] * 2, OFF)
    s = eng.stats()["hicache"]
    assert s["lookups"] == 0 and s["stores"] == 0 and s["pages_used"] == 0


def test_shared_prefix_in_one_batch_and_preemption(tiny_model_dir):
    """Identical and overlapping prompts admitted together, in a device pool that forces preemption."""
    for family in ("llama", "gemma3"):
        path = tiny_model_dir(family)
        base = _rand(26, 5)
        prompts = [base, base, base[:17] + _rand(12, 6), _rand(30, 7)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        ref = [o.new_token_ids for o in _engine(path, hicache_size_gb=0).generate(prompts, params)]
        page = KVPool.bytes_per_page(ModelConfig.from_hf_dir(path), PS, torch.float32)
        eng = _engine(path, kv_cache_gb=26 * page / 2**30)
        assert [o.new_token_ids for o in eng.generate(prompts, params)] == ref, family
        assert eng.scheduler.num_preemptions > 0
        assert [o.new_token_ids for o in eng.generate(prompts, params)] == ref, family
        assert eng.stats()["hicache"]["hits"] > 0
        _assert_idle(eng)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eviction_under_a_tiny_cache_stays_correct(tiny_model_dir, family):
    """A host cache of 12 pages and 2 states against 3 conversations growing to ~60 tokens (~45 pages).

    Conversations take two turns each in turn (0 0 1 1 2 2 0 0 ...): the second turn of a
    visit can hit, the first cannot (LRU evicted it while serving the other two).
    """
    path = tiny_model_dir(family)
    mc = ModelConfig.from_hf_dir(path)
    page, state = KVPool.bytes_per_page(mc, PS, torch.float32), KVPool.bytes_per_slot(mc, torch.float32)
    eng = _engine(path, hicache_size_gb=(12 * page + 2 * state) / 2**30, hicache_state_slots=2)
    assert eng.stats()["hicache"]["pages_total"] == 12
    convs = [_rand(14, 20 + i) for i in range(3)]
    for turn in range(2):
        for i in (0, 0, 1, 1, 2, 2):
            prompt = convs[i]
            ref = eng.generate([prompt], OFF)[0]
            out = eng.generate([prompt], ON)[0]
            _assert_same(out, ref, f"turn {turn} conversation {i}")
            convs[i] = prompt + out.new_token_ids + _rand(4, 100 * turn + i)
    s = eng.stats()["hicache"]
    assert s["evicted_pages"] > 0 and s["pages_used"] <= 12 and s["states_used"] <= 2
    assert s["lookups"] == 12 and 0 < s["hits"] <= 6
    print(f"{family}: hit rate {s['hit_rate']:.2f}, token hit rate {s['token_hit_rate']:.2f}, "
          f"evicted {s['evicted_pages']} pages / {s['evicted_states']} states")
    _assert_idle(eng)


def test_prefill_only_export_after_a_hit_decodes_the_same(tiny_model_dir):
    """A PD prefill rank with a cache hit still exports the whole prompt's KV."""
    path = tiny_model_dir("gemma3")
    prompt = _rand(29, 9)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = _engine(path, hicache_size_gb=0).generate([prompt], params)[0].new_token_ids
    pre, dec = _engine(path), _engine(path, hicache_size_gb=0)
    pre.generate([prompt], params)  # warms the cache
    pre.add_request("p", prompt, params, prefill_only=True)
    out = [o for _ in range(10) for o in pre.step() if o.finished][0]
    assert out.cached_tokens == 28 and out.kv_export.num_tokens == 29
    dec.add_imported("d", prompt, out.new_token_ids, params, out.kv_export)
    toks = list(out.new_token_ids)
    while dec.has_unfinished():
        toks += [t for o in dec.step() for t in o.new_token_ids]
    assert toks == ref


def test_write_through_waits_for_the_flush_unless_the_row_finishes(tiny_model_dir):
    """A running prompt's pages reach the host cache at flush_write_through() (a rank calls it once
    the step's tokens have left) or the next step(); one that finishes in its step is stored before
    step() returns (its pages are freed then)."""
    eng = _engine(tiny_model_dir("llama"), max_num_batched_tokens=64)
    going, ending = _rand(13, seed=40), _rand(11, seed=41)
    eng.add_request("going", going, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.add_request("ending", ending, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step()}  # both prompts in one step
    assert outs["ending"].finished and not outs["going"].finished
    assert len(eng.hicache.index) == len(ending) // PS  # stored before its pages went
    eng.flush_write_through()
    assert len(eng.hicache.index) == len(ending) // PS + len(going) // PS
    while eng.has_unfinished():
        eng.step()
    _assert_idle(eng)


def test_a_host_cache_size_without_a_factory_is_refused(tiny_model_dir):
    """engine/ does not import hicache/: an engine asked for a host cache must be given its factory."""
    with pytest.raises(ValueError, match="needs a host cache"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", hicache_size_gb=0.01))

    def unused(*_):
        raise AssertionError("the factory is called only when hicache_size_gb > 0")

    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_gb=0.01),
                    host_cache=unused)
    assert eng.hicache is None and "hicache" not in eng.stats()
    eng.close()


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_an_l3_store_serves_another_engine_the_same_tokens(tiny_model_dir, tmp_path, family):
    """--kv-store file:DIR: what one engine stored is a hit for another over the same directory
    (another rank of the host, or the next start), with the tokens and logprobs of no cache."""
    path, store = tiny_model_dir(family), f"file:{tmp_path / 'l3'}"
    prompt = _rand(21, seed=3)
    a = _engine(path, kv_store=store)
    ref = a.generate([prompt], OFF)[0]
    a.generate([prompt], ON)
    a.close()  # its writer finishes what it queued
    b = _engine(path, kv_store=store)
    out = b.generate([prompt], ON)[0]
    _assert_same(out, ref)
    s = b.stats()["hicache"]
    assert out.cached_tokens == s["l3_hit_tokens"] == s["hit_tokens"] > 0 and s["l3"] == "file"
    longer = prompt + out.new_token_ids + _rand(6, seed=4)
    _assert_same(b.generate([longer], ON)[0], b.generate([longer], OFF)[0])
    while b.hicache.writer.pending_bytes:  # the last writes pin their pages until done
        time.sleep(0.01)
    b.hicache._unpin_written()
    _assert_idle(b)
    b.close()
