"""The L3 tier (hicache/store.py) and the host cache over it: pages and SWA states written
through, read back (read ahead, then adopted) by another cache (another rank, or the next start)
over the same directory, bytes equal; a missing, short or corrupt object is a miss from there on;
a full writer skips the store rather than pin the cache; the directory stays under its capacity;
keys of another namespace never hit."""
from __future__ import annotations

import os
import time

import pytest
import torch

from hicache.cache import HostCache
from hicache.index import PrefixIndex, namespace_key, page_keys
from hicache.pool import HostPool, HostPoolLayout, default_shm_name
from hicache.store import FileStore, StoreUnavailable, StoreWriter, bytes_view, parse_store, store_for_launch

from test_hicache_cache import PAGE, PS, RING, device, tokens


def make(tmp_path, num_pages=8, num_states=0, ns="m", store_dir="l3") -> HostCache:
    lay = HostPoolLayout(default_shm_name(), "float32", num_pages, PAGE, num_states, RING)
    cache = HostCache(HostPool.create(lay), PrefixIndex(namespace_key(ns, "float32", PS), PS),
                     has_swa=num_states > 0, store=FileStore(tmp_path / store_dir, 1.0))
    cache.record_events = True
    return cache


def flushed(cache: HostCache) -> HostCache:
    """Wait for the writer, then unpin what it wrote (as the next lookup or store would)."""
    deadline = time.monotonic() + 10
    while cache.writer.pending_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    cache._unpin_written()
    assert all(n.refs == 0 for n in cache.index.nodes())
    return cache


def from_store(cache: HostCache, prompt: list[int]):
    """A lookup as the engine makes it: what the store holds past the host hit read ahead
    (prefetch, waited for) and adopted first."""
    job = cache.prefetch(prompt, wait_s_per_page=10.0)
    if job is not None:
        deadline = time.monotonic() + 10
        while not job.done and time.monotonic() < deadline:
            time.sleep(0.005)
        cache.adopt(job)
    return cache.lookup(prompt)


def test_pages_written_through_are_a_hit_for_another_cache(tmp_path):
    src = device()
    prompt = tokens(5 * PS)
    a = make(tmp_path)
    assert a.store(prompt[:4 * PS], src, [3, 1, 4, 7], None) == 4
    flushed(a)
    assert a.stats()["bytes_l3_written"] == 4 * src.full[0].numel() * 4
    b = make(tmp_path)  # another rank on the host (or this one after a restart): an empty host cache
    hit = from_store(b, prompt)
    assert hit.num_tokens == 4 * PS
    dst = device()
    dst.full.zero_()
    b.load(hit, dst, [0, 1, 2, 3], None)
    assert torch.equal(dst.full[:4], src.full[[3, 1, 4, 7]])
    c = b.counters
    assert (c.l3_read_pages, c.l3_hit_tokens, c.hit_tokens) == (4, 4 * PS, 4 * PS)
    assert [e.kind for e in b.drain_events()] == ["page_stored"]  # the router learns of them
    hit = b.lookup(prompt)  # now a host hit: nothing read again
    assert hit.num_tokens == 4 * PS and b.counters.l3_read_pages == 4 and b.counters.l3_hit_tokens == 4 * PS
    b.release(hit)
    for cache in (a, b):
        cache.close()


def test_a_host_hit_is_extended_by_the_store_and_state_comes_with_it(tmp_path):
    src = device()
    prompt = tokens(4 * PS)
    a = make(tmp_path, num_states=2)
    a.store(prompt[:2 * PS], src, [0, 1], swa_slot=None)
    a.store(prompt, src, [0, 1, 2, 3], swa_slot=1)  # pages 3-4 and the state at 4 pages
    flushed(a)
    b = make(tmp_path, num_states=2)
    b.store(prompt[:2 * PS], src, [0, 1], swa_slot=None)  # b holds the first two pages itself
    flushed(b)
    hit = from_store(b, prompt + [99])
    assert hit.num_tokens == 4 * PS and hit.state is not None
    dst = device()
    b.load(hit, dst, [4, 5, 6, 7], swa_slot=0)
    assert torch.equal(dst.full[4:8], src.full[:4]) and torch.equal(dst.swa[0], src.swa[1])
    assert (b.counters.l3_read_pages, b.counters.l3_read_states, b.counters.l3_hit_tokens) == (2, 1, 2 * PS)
    for cache in (a, b):
        cache.close()


def test_a_store_page_without_its_state_is_no_hit_for_a_hybrid_model(tmp_path):
    src = device()
    prompt = tokens(3 * PS)
    a = make(tmp_path, num_states=2)
    a.store(prompt, src, [0, 1, 2], swa_slot=None)  # pages, no state
    flushed(a)
    b = make(tmp_path, num_states=2)
    hit = from_store(b, prompt + [1])
    assert hit.num_tokens == 0 and b.counters.l3_read_pages == 0
    for cache in (a, b):
        cache.close()


def test_missing_short_or_unreadable_objects_end_the_hit_there(tmp_path):
    src = device()
    prompt = tokens(4 * PS)
    a = make(tmp_path)
    a.store(prompt, src, [0, 1, 2, 3], None)
    flushed(a)
    keys = page_keys(prompt, PS, a.index.root)
    store = a.l3
    os.truncate(store._path(keys[2].hex() + ".kv"), 100)  # a torn object: its size gives it away
    b = make(tmp_path)
    assert from_store(b, prompt + [1]).num_tokens == 2 * PS
    assert b.stats()["l3_read_failures"] == 1
    os.unlink(store._path(keys[1].hex() + ".kv"))
    c = make(tmp_path)
    assert from_store(c, prompt + [1]).num_tokens == 1 * PS
    for cache in (a, b, c):
        cache.index.unpin([n for n in cache.index.nodes() if n.refs])
        cache.close()


def test_another_namespace_never_hits(tmp_path):
    src = device()
    prompt = tokens(3 * PS)
    a = make(tmp_path, ns="model-a")
    a.store(prompt, src, [0, 1, 2], None)
    flushed(a)
    b = make(tmp_path, ns="model-b")
    assert from_store(b, prompt + [1]).num_tokens == 0 and b.counters.l3_read_pages == 0
    for cache in (a, b):
        cache.close()


def test_a_full_writer_skips_the_store_and_pins_nothing(tmp_path):
    a = make(tmp_path)
    a.writer.close()
    a.writer = StoreWriter(a.l3, max_pending_bytes=0)  # no room at all
    assert a.store(tokens(2 * PS), device(), [0, 1], None) == 2
    assert a.counters.l3_skipped_pages == 2 and all(n.refs == 0 for n in a.index.nodes())
    a.close()


def test_file_store_round_trip_atomic_names_and_trim(tmp_path):
    store = FileStore(tmp_path / "s", capacity_gb=3 * 4096 / 2**30)  # room for three 4 KiB objects
    data = torch.arange(1024, dtype=torch.float32)
    for i in range(5):
        store.write(f"{i:032x}.kv", bytes_view(data + i))
        time.sleep(0.01)  # distinct modification times
    out = torch.empty(1024)
    assert not store.read_into(f"{0:032x}.kv", bytes_view(out))  # the oldest were trimmed
    assert store.read_into(f"{4:032x}.kv", bytes_view(out)) and torch.equal(out, data + 4)
    assert not store.read_into(f"{4:032x}.kv", bytes_view(torch.empty(10)))  # size checked first
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "s").rglob("*"))
    assert sum(p.stat().st_size for p in (tmp_path / "s").rglob("*") if p.is_file()) <= 3 * 4096
    assert store.leading([f"{4:032x}.kv", f"{3:032x}.kv", f"{0:032x}.kv", f"{4:032x}.kv"]) == 2


def test_store_spec_and_directory_checks(tmp_path):
    assert parse_store("file:/x/y") == ("file", "/x/y")
    assert parse_store("mooncake") == ("mooncake", "")
    url = "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata"
    assert parse_store(url) == ("mooncake", url)
    for bad in ("file:", "mooncake:", "mooncake://host", "disk:/x", ""):
        with pytest.raises(ValueError):
            parse_store(bad)
    with store_for_launch("file:/x/y", tmp_path) as spec:
        assert spec == "file:/x/y"
    with pytest.raises(StoreUnavailable):
        with store_for_launch("disk:/x", tmp_path):
            pass
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ValueError, match="writable"):
        FileStore(d)
