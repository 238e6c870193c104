"""HostCache store/load against fake device pools: bytes round-trip, eviction, pins, counters, events."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from hicache.cache import HostCache
from hicache.index import PrefixIndex, namespace_key, page_keys
from hicache.pool import HostPool, HostPoolLayout, default_shm_name

PS = 4
PAGE = (2, 2, PS, 2, 8)  # [full layers, K/V, page_size, kvh, hd]
RING = (3, 2, 8, 2, 8)  # [swa layers, K/V, window, kvh, hd]


@pytest.fixture
def make_cache():
    made = []

    def make(num_pages: int, num_states: int = 0) -> HostCache:
        lay = HostPoolLayout(default_shm_name(), "float32", num_pages, PAGE, num_states, RING)
        cache = HostCache(HostPool.create(lay), PrefixIndex(namespace_key("m", "float32", PS), PS),
                          has_swa=num_states > 0)
        cache.record_events = True
        made.append(cache)
        return cache

    yield make
    for cache in made:
        assert all(n.refs == 0 for n in cache.index.nodes()), "a pin leaked"
        # Accounting back to zero: evicting everything returns every page and state.
        while (node := cache.index.evict_page()) is not None:
            cache.pool.free_page(node.page)
            if node.state is not None:
                cache.pool.free_state(node.state)
        assert cache.pool.free_pages == cache.pool.num_pages and cache.pool.free_states == cache.pool.num_states
        cache.close()


def device(num_pages=16, num_slots=2):
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(full=torch.randn(num_pages, *PAGE, generator=g),
                           swa=torch.randn(num_slots, *RING, generator=g))


def tokens(n, start=10):
    return list(range(start, start + n))


def test_store_then_load_round_trips_pages_and_state(make_cache):
    cache = make_cache(8, 2)
    src, dst = device(), device()
    dst.full.zero_()
    dst.swa.zero_()
    prompt = tokens(3 * PS)
    assert cache.store(prompt, src, [5, 2, 9], swa_slot=1) == 3
    assert cache.stats()["states_used"] == 1
    hit = cache.lookup(prompt + [1])
    assert hit.num_tokens == 3 * PS and hit.state is not None
    assert all(n.refs == 1 for n in hit.path)
    cache.load(hit, dst, [0, 1, 2], swa_slot=0)
    assert torch.equal(dst.full[[0, 1, 2]], src.full[[5, 2, 9]])
    assert torch.equal(dst.swa[0], src.swa[1])
    c = cache.counters
    page_bytes = src.full[0].numel() * 4
    ring_bytes = src.swa[0].numel() * 4
    assert c.bytes_d2h == 3 * page_bytes + ring_bytes == c.bytes_h2d
    assert (c.lookups, c.hits, c.hit_tokens, c.lookup_tokens) == (1, 1, 3 * PS, 3 * PS + 1)


def test_store_adds_only_missing_pages_and_is_idempotent(make_cache):
    cache = make_cache(8)
    kv = device()
    prompt = tokens(4 * PS)
    assert cache.store(prompt[:2 * PS], kv, [0, 1], None) == 2
    assert cache.store(prompt, kv, [0, 1, 2, 3], None) == 2
    assert cache.store(prompt, kv, [0, 1, 2, 3], None) == 0
    assert cache.store(prompt[:PS + 2], kv, [0, 1], None) == 0  # partial page: not stored
    assert cache.counters.stores == 2 and cache.counters.stored_pages == 4
    events = cache.drain_events()
    assert [e.kind for e in events] == ["page_stored", "page_stored"]
    assert [k for e in events for k in e.keys] == page_keys(prompt, PS, cache.index.root)
    assert cache.drain_events() == []


def test_full_cache_degrades_to_fewer_pages_and_evicts_lru_tails(make_cache):
    cache = make_cache(4)
    kv = device()
    a, b = tokens(3 * PS, 100), tokens(3 * PS, 200)
    assert cache.store(a, kv, [0, 1, 2], None) == 3
    assert cache.store(b, kv, [3, 4, 5], None) == 3  # evicts a's tail pages 2 and 1
    assert cache.counters.evicted_pages == 2
    hits = cache.lookup(a + [1]), cache.lookup(b + [1])
    assert [len(h.path) for h in hits] == [1, 3]
    for hit in hits:
        cache.release(hit)
    # A chain longer than the pool: its own pages are pinned while it is stored, so it stops short.
    c = tokens(6 * PS, 300)
    assert cache.store(c, kv, list(range(6)), None) == 4
    assert cache.counters.store_skipped_pages == 2
    evicted = [k for e in cache.drain_events() if e.kind == "page_evicted" for k in e.keys]
    assert len(evicted) == cache.counters.evicted_pages == 6
    assert len(cache.index) == 4


def test_pinned_hit_survives_pressure_until_released(make_cache):
    cache = make_cache(3)
    kv = device()
    a = tokens(2 * PS, 100)
    cache.store(a, kv, [0, 1], None)
    hit = cache.lookup(a + [1])  # pinned, as while a load or transfer is in flight
    assert cache.store(tokens(2 * PS, 200), kv, [2, 3], None) == 1  # one free page, a is pinned
    assert cache.counters.evicted_pages == 0
    cache.release(hit)
    cache.release(hit)  # idempotent
    assert cache.store(tokens(3 * PS, 300), kv, [4, 5, 6], None) == 3
    assert cache.counters.evicted_pages == 3


def test_state_slots_evict_lru_and_follow_their_page(make_cache):
    cache = make_cache(16, num_states=2)
    kv = device()
    chains = [tokens(2 * PS, 100 * i) for i in (1, 2, 3)]
    for i, t in enumerate(chains):
        cache.store(t, kv, [2 * i, 2 * i + 1], swa_slot=i % 2)
    assert cache.counters.stored_states == 3 and cache.counters.evicted_states == 1
    assert cache.lookup(chains[0] + [1]).path == []  # its state went: nothing usable for a hybrid model
    hit = cache.lookup(chains[2] + [1])
    assert hit.num_tokens == 2 * PS
    cache.release(hit)
    kinds = [e.kind for e in cache.drain_events()]
    assert kinds.count("state_stored") == 3 and kinds.count("state_evicted") == 1


def test_no_state_without_a_page_boundary_or_missing_pages(make_cache):
    cache = make_cache(2, num_states=2)
    kv = device()
    cache.store(tokens(2 * PS + 1), kv, [0, 1, 2], swa_slot=0)  # not a boundary
    assert cache.index.num_states == 0
    cache.store(tokens(3 * PS, 50), kv, [0, 1, 2], swa_slot=0)  # 2-page pool: the 3rd page is missing
    assert cache.index.num_states == 0


def test_for_engine_sizing(tiny_model_dir):
    mc = ModelConfig.from_hf_dir(tiny_model_dir("gemma3"))
    cfg = EngineConfig(model="x", dtype="float32", page_size=PS, hicache_size_gb=0.001, hicache_state_slots=3)
    cache = HostCache.for_engine(cfg, mc, max_model_len=256)
    try:
        s = cache.stats()
        assert s["states_total"] == 3 and s["pages_total"] > 0
        assert cache.pool.layout.path.exists()
    finally:
        cache.close()
    with pytest.raises(ValueError, match="hicache_state_slots"):
        HostCache.for_engine(EngineConfig(model="x", dtype="float32", hicache_size_gb=1e-6), mc, 256)


def test_a_cache_salt_isolates_its_pages_from_other_salts_and_from_none(make_cache):
    cache = make_cache(8)
    src = device()
    prompt = tokens(3 * PS)
    assert cache.store(prompt, src, [1, 2, 3], None, salt="tenant-a") == 3
    for salt in ("", "tenant-b"):
        hit = cache.lookup(prompt + [1], salt=salt)
        assert hit.num_tokens == 0, salt
        cache.release(hit)
    hit = cache.lookup(prompt + [1], salt="tenant-a")
    assert hit.num_tokens == 3 * PS
    cache.release(hit)
    assert cache.store(prompt, src, [1, 2, 3], None) == 3, "unsalted: pages of their own"
