"""The host cache's side of the L3 tier (hicache/store.py): reading a prompt's pages past its
host hit from the store into host pages, and queueing what the host cache stores for the
writer thread. HostCache (cache.py, step 5 of its life cycle) calls these; they use its index,
pool, allocators, counters and events, on its engine thread.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.index import Node, page_keys
from hicache.store import bytes_view

if TYPE_CHECKING:
    from hicache.cache import HostCache


def read_into_host(cache: "HostCache", tokens: Sequence[int], need_state: bool, root: bytes) -> tuple[int, int]:
    """Read the run of `tokens`' pages past the host hit that the store holds (and, hybrid
    models, the deepest SWA state among them, without which they are no hit) into host
    pages, indexed as stored. Returns (pages the host had, pages read). Stops at the first
    object it cannot read: the request computes from there."""
    ps = cache.page_size
    keys = page_keys(tokens, ps, root, max(len(tokens) - 1, 0) // ps)
    host = cache.index.match_and_pin(keys)
    try:
        return _read(cache, keys, host, need_state)
    finally:
        cache.index.unpin(host)


def _read(cache: "HostCache", keys: list[bytes], host: list[Node], need_state: bool) -> tuple[int, int]:
    rest = keys[len(host):]
    names = [k.hex() + ".kv" for k in rest]
    n = cache.l3.leading(names) if rest else 0
    state_at = -1
    if n and need_state:  # the deepest state among them (probed deepest first: one call, usually)
        state_at = next((i for i in reversed(range(n)) if cache.l3.leading([rest[i].hex() + ".swa"])), -1)
        if state_at < 0:
            return len(host), 0
        n = state_at + 1
    if not n:
        return len(host), 0
    c, t0 = cache.counters, time.perf_counter()
    path: list[Node] = []  # the pages read (or, shared index, stored by another rank meanwhile)
    read: list[Node] = []
    try:
        parent = host[-1] if host else None
        for key, name in zip(rest[:n], names):
            page = cache._alloc_page()
            if page is None:
                break
            if not cache.l3.read_into(name, bytes_view(cache.pool.pages[page])):
                cache._free_page(page)
                c.l3_read_failures += 1
                break
            parent = cache.index.insert(parent, key, page)
            cache.index.pin([parent])
            path.append(parent)
            if parent.page == page:
                read.append(parent)
            else:
                cache._free_page(page)
        c.l3_read_pages += len(read)
        c.bytes_l3_read += len(read) * cache.pool.layout.page_bytes
        if read:
            cache._event("page_stored", [a.key for a in read])
        if 0 <= state_at < len(path) and path[state_at].state is None:
            node, slot = path[state_at], cache._alloc_state()
            if slot is not None and cache.l3.read_into(node.key.hex() + ".swa",
                                                         bytes_view(cache.pool.states[slot])):
                if cache.index.set_state(node, slot):
                    c.l3_read_states += 1
                    c.bytes_l3_read += cache.pool.layout.state_bytes
                    cache._event("state_stored", [node.key])
            elif slot is not None:
                cache._free_state(slot)
                c.l3_read_failures += 1
        cache.index.touch(host + path)
    finally:
        cache.index.unpin(path)
        c.seconds_l3_read += time.perf_counter() - t0
    return len(host), len(path)


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
