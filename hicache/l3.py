"""The host cache's side of the L3 tier (hicache/store.py), on its engine thread: the pages a
Prefetcher (hicache/prefetch.py) read ahead on its own thread, past a prompt's host hit, indexed
as host pages (`L3ReadAhead`: HostCache's prefetch / adopt / cancel; `adopt_job`),
and what the host cache stores queued for the writer thread (`write_through`). They use
HostCache's index, pool, allocators, counters and events (cache.py, step 5 of its life cycle).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.index import Node, page_keys, salted_root
from hicache.prefetch import PrefetchJob
from hicache.store import bytes_view

if TYPE_CHECKING:
    from hicache.cache import HostCache

# L3 read-ahead: the staging memory of one rank's Prefetcher (at most the size of its host pool),
# and the least a request waits for its prefetch (the engine adds a share of the compute it saves).
PREFETCH_STAGING_BYTES = 256 * 2**20
MIN_PREFETCH_WAIT_S = 0.005


def adopt_job(cache: "HostCache", job: PrefetchJob) -> int:
    """Index what `job` has read so far (it reads no more) in host pages, after the host hit as
    it is now, and its SWA state where read; returns the pages added. Nothing when the host lost
    a page before the job's first (the run would hang from nothing); pages another rank stored
    meanwhile are kept, not copied. Stops at the first page it cannot allocate."""
    ready, state_ok = job.stop()
    if not ready:
        return 0
    keys = job.keys[:job.first + ready]
    host = cache.index.match_and_pin(keys)
    path: list[Node] = []  # the pages indexed (or, shared index, stored by another rank meanwhile)
    added: list[Node] = []
    try:
        if len(host) < job.first or len(host) == len(keys):
            return 0
        skip = len(host) - job.first  # (another rank stored these meanwhile)
        parent = host[-1] if host else None
        for i, key in enumerate(keys[len(host):]):
            page = cache._alloc_page()
            if page is None:
                break
            bytes_view(cache.pool.pages[page])[:] = bytes_view(job.pages[skip + i])
            parent = cache.index.insert(parent, key, page)
            cache.index.pin([parent])
            path.append(parent)
            if parent.page == page:
                added.append(parent)
            else:
                cache._free_page(page)
        cache.counters.l3_read_pages += len(added)
        if added:
            cache._event("page_stored", [a.key for a in added])
        at = job.state_at - skip if state_ok else -1
        if 0 <= at < len(path) and path[at].state is None and (slot := cache._alloc_state()) is not None:
            bytes_view(cache.pool.states[slot])[:] = bytes_view(job.state)
            if cache.index.set_state(path[at], slot):
                cache.counters.l3_read_states += 1
                cache._event("state_stored", [path[at].key])
        cache.index.touch(host + path)
    finally:
        cache.index.unpin(host + path)
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


class L3ReadAhead:
    """HostCache's side of the read-ahead (hicache/prefetch.py), on the engine thread; uses its
    index, counters and `prefetcher`."""

    def prefetch(self, tokens: Sequence[int], salt: str = "", wait_s_per_page: float = 0.0) -> PrefetchJob | None:
        """Start reading the pages of `tokens` past the host hit that the L3 store holds; None
        when there is no store, nothing past the host hit, or the store is stuck in an earlier
        read (Prefetcher.stalled). The request should wait for the
        job (`prefetch_ready`) at most MIN_PREFETCH_WAIT_S + `wait_s_per_page` a page it looks
        for, then `adopt` it (or `cancel` it), once."""
        if self.prefetcher is None:
            return None
        ps = self.page_size
        keys = page_keys(tokens, ps, salted_root(self.index.root, salt), max(len(tokens) - 1, 0) // ps)
        host = self.index.match_and_pin(keys)
        self.index.unpin(host)
        if len(host) == len(keys):
            return None
        if self.prefetcher.stalled:
            self.counters.l3_prefetch_skipped += 1
            return None
        wait = MIN_PREFETCH_WAIT_S + wait_s_per_page * (len(keys) - len(host))
        job = PrefetchJob(keys, len(host), self.has_swa, time.monotonic() + wait)
        self.prefetcher.submit(job)
        self.counters.l3_prefetches += 1
        return job

    def prefetch_ready(self, job: PrefetchJob, now: float) -> bool:
        """The job is done, or its request has waited long enough (time.monotonic() `now`)."""
        return job.done or now >= job.deadline

    def wait_prefetch(self, timeout_s: float) -> None:
        """Block up to `timeout_s`, or until some prefetch finishes."""
        if self.prefetcher is not None:
            self.prefetcher.wait_any(timeout_s)

    def adopt(self, job: PrefetchJob) -> int:
        """Index what `job` read (it reads no more) as host pages; returns how many pages."""
        c = self.counters
        c.l3_prefetch_late += not job.done
        try:
            n = adopt_job(self, job)
        finally:
            self.prefetcher.release(job)
            c.seconds_l3_prefetch_wait += time.monotonic() - job.submitted
        if n and (not job.need_state or job.state_ok):  # a hit for the lookup that follows
            c.l3_hit_tokens += n * self.page_size
        return n

    def cancel(self, job: PrefetchJob) -> None:
        """Drop a job whose request went away."""
        job.stop()
        self.prefetcher.release(job)
