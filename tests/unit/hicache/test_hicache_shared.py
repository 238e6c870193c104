"""One host cache per host (hicache/shared_index.py): clients in one and in several processes
share hits, concurrent writers and readers never see a page that is not whole, a killed writer
or a reader killed holding pins leaves nothing stuck, and the last client removes the files."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.cache import HostCache
from hicache.index import namespace_key, page_keys
from hicache.pool import HostPoolLayout, default_shm_name
from hicache.shared_index import VALID, WRITING, attach_or_create, index_path

PS = 4
PAGE = (2, 2, PS, 2, 8)  # [full layers, K/V, page_size, kvh, hd]
RING = (3, 2, 8, 2, 8)  # [swa layers, K/V, window, kvh, hd]
ROOT = namespace_key("m", "float32", PS)


def _layout(name: str, num_pages: int, num_states: int = 0) -> HostPoolLayout:
    return HostPoolLayout(name, "float32", num_pages, PAGE, num_states, RING)


@pytest.fixture
def shared():
    """make(num_pages, num_states) -> a HostCache on the host cache named for this test (each call
    another client of the same one)."""
    name, made = default_shm_name(), []

    def make(num_pages: int = 8, num_states: int = 0, root: bytes = ROOT) -> HostCache:
        pool, index = attach_or_create(_layout(name, num_pages, num_states), root, PS)
        cache = HostCache(pool, index, has_swa=num_states > 0)
        cache.record_events = True
        made.append(cache)
        return cache

    make.name = name
    yield make
    for cache in made:
        assert not cache.index._t.pins[cache.index.me].any(), "a pin leaked"
        cache.close()
    lay = _layout(name, 1)
    assert not lay.path.exists() and not index_path(lay).exists(), "the last client left the files"


def device(num_pages=16, num_slots=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(full=torch.randn(num_pages, *PAGE, generator=g),
                           swa=torch.randn(num_slots, *RING, generator=g))


def tokens(n, start=10):
    return list(range(start, start + n))


def test_a_prefix_stored_by_one_client_is_a_hit_for_another_with_its_bytes_and_state(shared):
    a, b = shared(8, 2), shared(8, 2)
    src, dst = device(), device(seed=1)
    prompt = tokens(3 * PS)
    assert a.store(prompt, src, [5, 2, 9], swa_slot=1) == 3
    hit = b.lookup(prompt + [1])
    assert hit.num_tokens == 3 * PS and hit.state is not None
    b.load(hit, dst, [0, 1, 2], swa_slot=0)
    assert torch.equal(dst.full[[0, 1, 2]], src.full[[5, 2, 9]])
    assert torch.equal(dst.swa[0], src.swa[1])
    assert b.store(prompt, src, [5, 2, 9], swa_slot=1) == 0, "already stored (by the other client)"
    assert [e.kind for e in a.drain_events()] == ["page_stored", "state_stored"]
    assert b.stats()["pages_used"] == 3 and b.stats()["states_used"] == 1


def test_eviction_by_one_client_takes_the_other_clients_lru_tails_and_spares_its_pins(shared):
    a, b = shared(4), shared(4)
    src = device()
    a.store(tokens(2 * PS, 100), src, [0, 1], None)  # old chain
    pinned = a.lookup(tokens(2 * PS, 200) + [1])  # nothing yet
    a.release(pinned)
    a.store(tokens(2 * PS, 200), src, [2, 3], None)
    keep = a.lookup(tokens(2 * PS, 200) + [1])  # pinned by a
    assert keep.num_tokens == 2 * PS
    assert b.store(tokens(2 * PS, 300), src, [4, 5], None) == 2, "evicts the unpinned old chain"
    ev = b.drain_events()
    assert [e.kind for e in ev] == ["page_evicted", "page_evicted", "page_stored"]
    assert set(k for e in ev[:2] for k in e.keys) == set(page_keys(tokens(2 * PS, 100), PS, ROOT))
    assert b.store(tokens(2 * PS, 400), src, [6, 7], None) == 2, "evicts b's own chain, a's pinned one stays"
    a.release(keep)
    hit = b.lookup(tokens(2 * PS, 200) + [1])
    assert hit.num_tokens == 2 * PS
    b.release(hit)


def test_a_name_holding_another_layout_or_model_is_refused(shared):
    shared(8)
    with pytest.raises(ValueError, match="another host cache"):
        attach_or_create(_layout(shared.name, 9), ROOT, PS)
    with pytest.raises(ValueError, match="another host cache"):
        attach_or_create(_layout(shared.name, 8), namespace_key("other-model", "float32", PS), PS)


# ---- several processes ---------------------------------------------------------------------
def _value(key: bytes) -> float:
    return float(int.from_bytes(key[:3], "little"))


def _worker(name: str, num_pages: int, seed: int, rounds: int, conn) -> None:
    """Store and read random chains; every page read must hold its key's value throughout."""
    pool, index = attach_or_create(_layout(name, num_pages), ROOT, PS)
    rng = np.random.default_rng(seed)
    bad = reads = 0
    for _ in range(rounds):
        start = int(rng.integers(0, 12)) * 1000
        keys = page_keys(tokens(3 * PS, start), PS, ROOT)
        path = index.match_and_pin(keys)
        for node in path:
            reads += 1
            bad += int(not torch.all(pool.pages[node.page] == _value(node.key)))
        if path:
            index.unpin(path)
        missing = keys[len(path):]
        pages, _ = index.alloc_pages(len(missing))
        parent = path[-1] if path else None
        for key, page in zip(missing, pages):
            pool.pages[page].fill_(_value(key))
            node = index.insert(parent, key, page)
            if node.page != page:
                index.free_page(page)
            parent = node
    conn.send((bad, reads))
    index.close()


def _hold(name: str, num_pages: int, what: str, conn) -> None:
    """Pin a stored chain (or take pages to write) and wait to be killed."""
    pool, index = attach_or_create(_layout(name, num_pages), ROOT, PS)
    if what == "pin":
        index.match_and_pin(page_keys(tokens(2 * PS), PS, ROOT))
    else:
        index.alloc_pages(3)
    conn.send("ready")
    signal.pause()


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def test_writers_and_readers_in_three_processes_only_ever_read_whole_pages(shared):
    cache = shared(10)  # ~36 keys in play for 10 pages: constant eviction
    procs = [_spawn(_worker, shared.name, 10, seed, 150) for seed in range(3)]
    results = [conn.recv() for _, conn in procs]
    for proc, _ in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert sum(r[1] for r in results) > 0, "some reads hit"
    assert sum(r[0] for r in results) == 0, results
    t = cache.index._t
    assert not t.pin_total.any() and not (t.status == WRITING).any()


@pytest.mark.parametrize("what", ["pin", "write"])
def test_a_killed_reader_holding_pins_or_writer_mid_write_leaves_nothing_stuck(shared, what):
    cache = shared(4)
    src = device()
    cache.store(tokens(2 * PS), src, [0, 1], None)
    proc, conn = _spawn(_hold, shared.name, 4, what)
    assert conn.recv() == "ready"
    t = cache.index._t
    if what == "pin":
        assert int(t.pin_total.sum()) == 2
    else:
        assert int((t.status == WRITING).sum()) == 3
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    # The dead client's pins and unfinished pages are reclaimed the next time pages run short.
    assert cache.store(tokens(4 * PS, 500), src, [2, 3, 4, 5], None) == 4
    assert not t.pin_total.any() and not (t.status == WRITING).any()
    assert int((t.status == VALID).sum()) == 4
    assert cache.index.clients() == 1


def test_the_launcher_names_one_cache_for_the_host_and_sizes_it_from_the_ram(monkeypatch, tmp_path):
    from engine.config import EngineConfig
    from hicache import host_plan
    from launcher.launch import _pools_for_dtype
    from rank_runtime.config import HandoffConfig

    monkeypatch.setattr(host_plan, "available_gib", lambda: 20.0)
    assert host_plan.default_host_cache_gb(0.5, 4) == 2.0  # a tenth of the RAM, above the ranks' 4 x 0.5
    assert host_plan.default_host_cache_gb(2.0, 4) == 5.0  # the ranks' 8, capped at a quarter of the RAM
    monkeypatch.setattr(host_plan, "available_gib", lambda: 400.0)
    assert 2.0 < host_plan.default_host_cache_gb(0.5, 4) <= host_plan.MAX_DEFAULT_GB  # (or half of /dev/shm)
    cfg = EngineConfig(dtype="float32", hicache_size_gb=0.25, hicache_scope="host")
    e, _ = _pools_for_dtype(cfg, HandoffConfig(), [], 4)
    assert e.hicache_shm_name.startswith(f"pdserve-hostcache-{os.getpid()}-")
    assert e.hicache_size_gb == host_plan.default_host_cache_gb(0.5, 4)
    assert e.hicache_state_slots == 4 * cfg.hicache_state_slots  # the four ranks' states, in one cache
    e, _ = _pools_for_dtype(cfg, HandoffConfig(), ["--hicache-size-gb", "0.25"], 4)
    assert e.hicache_size_gb == 0.25  # given: the host's size as given
    # A dead launcher's files go; a live one's (this process) stay.
    dead = tmp_path / "pdserve-hostcache-999999999-ab.idx"
    live = tmp_path / f"pdserve-hostcache-{os.getpid()}-cd"
    dead.touch(), live.touch()
    assert host_plan.remove_stale_host_caches(tmp_path) == [dead] and live.exists()
