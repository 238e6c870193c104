"""What HostCache (cache.py) hands out and counts: its events, its counters, a pinned lookup."""
from __future__ import annotations

from dataclasses import dataclass, field

from hicache.index import Node


@dataclass(frozen=True)
class CacheEvent:
    """What changed, for a router that tracks which prefixes a rank holds."""

    kind: str  # "page_stored" | "page_evicted" | "state_stored" | "state_evicted"
    keys: tuple[bytes, ...]  # page keys (hicache.index.page_keys); a state's is its page's


@dataclass
class HostCacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one page
    lookup_tokens: int = 0
    hit_tokens: int = 0
    stores: int = 0  # write-throughs that added at least one page or state
    stored_pages: int = 0
    stored_states: int = 0
    store_skipped_pages: int = 0  # pages a store left out because everything was pinned
    evicted_pages: int = 0
    evicted_states: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    seconds_h2d: float = 0.0
    seconds_d2h: float = 0.0
    l3_hit_tokens: int = 0  # of hit_tokens, those read from the L3 store for this lookup
    l3_read_pages: int = 0
    l3_read_states: int = 0
    l3_read_failures: int = 0  # objects the store listed but could not give back (a miss then)
    bytes_l3_read: int = 0
    seconds_l3_read: float = 0.0
    l3_queued_pages: int = 0  # pages and states queued for a write to L3
    l3_prefetches: int = 0  # requests whose pages past the host hit were looked for in L3 ahead
    l3_prefetch_late: int = 0  # of those, requests that stopped waiting at their deadline
    l3_prefetch_skipped: int = 0  # requests that did not wait: the store was stuck in an earlier read
    seconds_l3_prefetch_wait: float = 0.0  # arrival to adoption, summed over prefetches
    l3_skipped_pages: int = 0  # stored pages and states the writer had no room to queue


@dataclass
class Hit:
    """A pinned lookup result; pass it to `load` or `release` exactly once."""

    path: list[Node]
    page_size: int
    released: bool = field(default=False)

    @property
    def num_tokens(self) -> int:
        return len(self.path) * self.page_size

    @property
    def state(self) -> int | None:
        return self.path[-1].state if self.path else None
