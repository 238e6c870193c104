"""The host cache's side of the L3 tier (hicache/store.py): reading a prompt's pages past its
host hit from the store into host pages, and queueing what the host cache stores for the
writer thread. HostCache (cache.py, step 5 of its life cycle) calls these; they use its index,
pool, allocators, counters and events, on its engine thread.

Two ways in: `read_into_host` reads on the caller's thread (a lookup that may wait on the
store), `adopt` takes what a Prefetcher (hicache/prefetch.py) read ahead on its own thread.
Both end in `insert_run`, which indexes a run of pages after the host hit as if stored.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hicache.index import Node, page_keys
from hicache.store import KVStore, bytes_view

if TYPE_CHECKING:
    from hicache.cache import HostCache
    from hicache.prefetch import PrefetchJob


def probe(store: KVStore, rest: Sequence[bytes], need_state: bool) -> tuple[int, int]:
    """(pages of `rest`, from the first, the store holds; the index among them of the deepest
    SWA state, -1 for none). With `need_state` (hybrid models) the run ends at that state,
    without which its pages are no hit: (0, -1) when there is none."""
    n = store.leading([k.hex() + ".kv" for k in rest]) if rest else 0
    if not n or not need_state:
        return n, -1
    # (probed deepest first: one call, usually)
    state_at = next((i for i in reversed(range(n)) if store.leading([rest[i].hex() + ".swa"])), -1)
    return (state_at + 1, state_at) if state_at >= 0 else (0, -1)


def read_into_host(cache: "HostCache", tokens: Sequence[int], need_state: bool, root: bytes) -> tuple[int, int]:
    """Read the run of `tokens`' pages past the host hit that the store holds (and, hybrid
    models, the deepest SWA state among them) into host pages, indexed as stored. Returns
    (pages the host had, pages read). Stops at the first object it cannot read: the request
    computes from there."""
    ps = cache.page_size
    keys = page_keys(tokens, ps, root, max(len(tokens) - 1, 0) // ps)
    host = cache.index.match_and_pin(keys)
    c, t0 = cache.counters, time.perf_counter()
    try:
        rest = keys[len(host):]
        n, state_at = probe(cache.l3, rest, need_state)
        if not n:
            return len(host), 0
        nbytes = [0]

        def page(i: int, view: memoryview) -> bool:
            ok = cache.l3.read_into(rest[i].hex() + ".kv", view)
            nbytes[0] += view.nbytes if ok else 0
            c.l3_read_failures += not ok
            return ok

        def state(view: memoryview) -> bool:
            ok = cache.l3.read_into(rest[state_at].hex() + ".swa", view)
            nbytes[0] += view.nbytes if ok else 0
            c.l3_read_failures += not ok
            return ok

        read = insert_run(cache, host, rest[:n], page, state_at, state)
        c.bytes_l3_read += nbytes[0]
        return len(host), read
    finally:
        cache.index.unpin(host)
        c.seconds_l3_read += time.perf_counter() - t0


def adopt(cache: "HostCache", job: "PrefetchJob") -> int:
    """Index what `job` has read so far (it reads no more) after the host hit as it is now;
    returns the pages added. Nothing when the host lost a page before the job's first (the
    run would hang from nothing); pages another rank stored meanwhile are kept, not copied."""
    ready, state_ok = job.stop()
    if not ready:
        return 0
    keys = job.keys[:job.first + ready]
    host = cache.index.match_and_pin(keys)
    try:
        if len(host) < job.first or len(host) == len(keys):
            return 0
        skip = len(host) - job.first  # (another rank stored these meanwhile)

        def page(i: int, view: memoryview) -> bool:
            return _copy(job.pages[skip + i], view)

        def state(view: memoryview) -> bool:
            return _copy(job.state, view)

        at = job.state_at - skip if state_ok else -1
        return insert_run(cache, host, keys[len(host):], page, at, state)
    finally:
        cache.index.unpin(host)


def _copy(src, view: memoryview) -> bool:
    view[:] = bytes_view(src)
    return True


def insert_run(cache: "HostCache", host: list[Node], keys: Sequence[bytes],
               fill_page: Callable[[int, memoryview], bool], state_at: int,
               fill_state: Callable[[memoryview], bool]) -> int:
    """Index `keys` (the pages right after the pinned `host` path) in host pages that
    `fill_page(i, view)` writes, and at `keys[state_at]` (>= 0) the state `fill_state` writes.
    Stops at the first page it cannot fill or allocate. Returns the pages added."""
    cache_c = cache.counters
    path: list[Node] = []  # the pages indexed (or, shared index, stored by another rank meanwhile)
    added: list[Node] = []
    try:
        parent = host[-1] if host else None
        for i, key in enumerate(keys):
            page = cache._alloc_page()
            if page is None:
                break
            if not fill_page(i, bytes_view(cache.pool.pages[page])):
                cache._free_page(page)
                break
            parent = cache.index.insert(parent, key, page)
            cache.index.pin([parent])
            path.append(parent)
            if parent.page == page:
                added.append(parent)
            else:
                cache._free_page(page)
        cache_c.l3_read_pages += len(added)
        if added:
            cache._event("page_stored", [a.key for a in added])
        if 0 <= state_at < len(path) and path[state_at].state is None:
            node, slot = path[state_at], cache._alloc_state()
            if slot is not None and fill_state(bytes_view(cache.pool.states[slot])):
                if cache.index.set_state(node, slot):
                    cache_c.l3_read_states += 1
                    cache._event("state_stored", [node.key])
            elif slot is not None:
                cache._free_state(slot)
        cache.index.touch(host + path)
    finally:
        cache.index.unpin(path)
    return len(added)


def write_through(cache: "HostCache", added: list[Node], state_node: Node | None) -> None:
    """Queue the pages just stored (and the state at `state_node`) for the store; each node
    stays pinned until the writer is done with it (HostCache._unpin_written)."""
    regions = [(a.key.hex() + ".kv", cache.pool.pages[a.page], a) for a in added]
    if state_node is not None:
        regions.append((state_node.key.hex() + ".swa", cache.pool.states[state_node.state], state_node))
    for name, region, node in regions:
        cache.index.pin([node])
        if cache.writer.submit(name, bytes_view(region), node):
            cache.counters.l3_queued_pages += 1
        else:
            cache.index.unpin([node])
            cache.counters.l3_skipped_pages += 1
