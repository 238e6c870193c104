"""L3 read-ahead (hicache/prefetch.py): the pages past the host hit are read on the prefetcher's
thread and adopted as host pages, bytes equal, the SWA state with them; a store that is slow
gives the pages ready by the deadline (a hit that far); one that hangs costs the deadline and
nothing else (no pin, no page, no staging left); a job whose request went away is dropped; the
engine waits for a healthy store and not for a hung one, with the tokens of no cache."""
from __future__ import annotations

import threading
import time

import torch

from hicache.store import KVStore

from test_hicache_cache import PS, device, tokens
from test_hicache_engine import OFF, ON, _assert_idle, _assert_same, _engine, _rand
from test_hicache_store import flushed, make


class Gated(KVStore):
    """A store whose reads (and probes) wait for permits: the test decides how far a job gets."""

    kind = "gated"

    def __init__(self, inner: KVStore, reads: int = 1 << 30, probes: int = 1 << 30) -> None:
        self.inner = inner
        self.reads, self.probes = threading.Semaphore(reads), threading.Semaphore(probes)

    def leading(self, names):
        self.probes.acquire()
        return self.inner.leading(names)

    def read_into(self, name, out):
        self.reads.acquire()
        return self.inner.read_into(name, out)

    def write(self, name, data):
        self.inner.write(name, data)


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _stored(tmp_path, prompt, pages, num_states=0, swa_slot=None):
    """A cache that wrote `prompt`'s pages (device pages `pages`) through to the store."""
    src = device()
    a = make(tmp_path, num_states=num_states)
    a.store(prompt, src, pages, swa_slot)
    flushed(a).close()
    return src


def _no_pins(cache) -> bool:
    return all(n.refs == 0 for n in cache.index.nodes())


def test_read_ahead_pages_load_as_host_hits(tmp_path):
    prompt = tokens(5 * PS)
    src = _stored(tmp_path, prompt[:4 * PS], [3, 1, 4, 7])
    b = make(tmp_path)
    job = b.prefetch(prompt, wait_s_per_page=1.0)
    _until(lambda: job.done)
    assert b.prefetch_ready(job, time.monotonic()) and b.adopt(job) == 4
    hit = b.lookup(prompt)
    assert hit.num_tokens == 4 * PS
    dst = device()
    dst.full.zero_()
    b.load(hit, dst, [0, 1, 2, 3], None)
    assert torch.equal(dst.full[:4], src.full[[3, 1, 4, 7]])
    s = b.stats()
    assert (s["l3_prefetches"], s["l3_prefetch_late"], s["l3_read_pages"], s["l3_hit_tokens"]) == (1, 0, 4, 4 * PS)
    assert s["bytes_l3_read"] == 4 * src.full[0].numel() * 4
    assert b.prefetch(prompt) is None  # all on the host now: nothing to read
    assert b.prefetcher.staged_bytes == 0 and _no_pins(b)
    b.close()


def test_the_state_comes_with_the_pages_for_a_hybrid_model(tmp_path):
    prompt = tokens(4 * PS)
    src = _stored(tmp_path, prompt, [0, 1, 2, 3], num_states=2, swa_slot=1)
    b = make(tmp_path, num_states=2)
    job = b.prefetch(prompt + [99], wait_s_per_page=1.0)
    _until(lambda: job.done)
    assert b.adopt(job) == 4
    hit = b.lookup(prompt + [99])
    assert hit.num_tokens == 4 * PS and hit.state is not None
    dst = device()
    b.load(hit, dst, [4, 5, 6, 7], swa_slot=0)
    assert torch.equal(dst.full[4:8], src.full[:4]) and torch.equal(dst.swa[0], src.swa[1])
    assert b.counters.l3_read_states == 1 and _no_pins(b)
    b.close()


def _gated(tmp_path, **permits):
    """A prompt whose first 4 pages the store holds, and an empty cache reading it through a Gated store."""
    prompt = tokens(5 * PS)
    _stored(tmp_path, prompt[:4 * PS], [0, 1, 2, 3])
    b = make(tmp_path)
    gate = b.prefetcher.store = Gated(b.l3, **permits)
    return prompt, b, gate


def test_a_slow_store_gives_the_pages_ready_by_the_deadline(tmp_path):
    prompt, b, gate = _gated(tmp_path, reads=2)
    job = b.prefetch(prompt)  # deadline: MIN_PREFETCH_WAIT_S
    _until(lambda: job.ready == 2)
    assert not job.done and b.prefetch_ready(job, time.monotonic())
    assert b.adopt(job) == 2  # what was read by then
    assert b.counters.l3_prefetch_late == 1
    gate.reads.release(5)  # the thread finishes its read, which no longer counts
    _until(lambda: job.done)
    assert len(b.index) == 2 and b.prefetcher.staged_bytes == 0 and _no_pins(b)
    hit = b.lookup(prompt)
    assert hit.num_tokens == 2 * PS
    b.release(hit)
    b.close()


def test_a_hung_store_costs_one_deadline_and_leaves_nothing(tmp_path):
    prompt, b, gate = _gated(tmp_path, probes=0)
    job = b.prefetch(prompt)
    queued = b.prefetch(prompt)  # behind it
    b.cancel(queued)  # its request went away
    _until(lambda: b.prefetcher._current is job and b.prefetch_ready(job, time.monotonic()))
    assert b.adopt(job) == 0 and not job.done
    assert b.prefetcher.stalled and b.prefetch(prompt) is None  # stuck in a read nobody waits for:
    assert b.counters.l3_prefetch_skipped == 1  # the next request does not wait at all
    gate.probes.release(3)
    _until(lambda: job.done and queued.done)
    assert len(b.index) == 0 and b.prefetcher.staged_bytes == 0 and b.counters.l3_read_pages == 0
    again = b.prefetch(prompt, wait_s_per_page=1.0)  # the store answers again
    _until(lambda: again.done)
    assert b.adopt(again) == 4 and _no_pins(b)
    b.close()


def test_the_engine_waits_for_a_healthy_store_and_not_for_a_hung_one(tiny_model_dir, tmp_path):
    path, store = tiny_model_dir("llama"), f"file:{tmp_path / 'l3'}"
    prompt = _rand(21, seed=5)
    a = _engine(path, kv_store=store)
    ref = a.generate([prompt], OFF)[0]
    a.generate([prompt], ON)
    a.close()
    b = _engine(path, kv_store=store)  # an empty host cache, the store holds the prompt
    gate = b.hicache.prefetcher.store = Gated(b.hicache.l3, probes=0)
    out = b.generate([prompt], ON)[0]  # the store never answers: computed, same tokens
    _assert_same(out, ref)
    assert out.cached_tokens == 0 and b.stats()["hicache"]["l3_prefetch_late"] == 1
    b.hicache.prefetcher.store = Gated(b.hicache.l3, probes=0)  # (another hang, once the first is over)
    gate.probes.release(1)
    _until(lambda: not b.hicache.prefetcher.stalled)
    gate = b.hicache.prefetcher.store
    b.add_request("gone", prompt + _rand(8, seed=9), ON)  # aborted while its new pages are looked for
    assert b.stats()["waiting"] == 1 and "gone" in b.read_aheads.pending
    b.abort("gone")
    assert not b.has_unfinished()
    gate.probes.release(1 << 20)
    _settled(b)
    b.close()
    c = _engine(path, kv_store=store)
    out = c.generate([prompt], ON)[0]
    _assert_same(out, ref)
    assert out.cached_tokens == c.stats()["hicache"]["l3_hit_tokens"] > 0
    _settled(c)
    c.close()


def _settled(eng) -> None:
    """The engine is idle once its last writes to the store are done (they pin their pages)."""
    _until(lambda: not eng.hicache.writer.pending_bytes)
    eng.hicache._unpin_written()
    _assert_idle(eng)
