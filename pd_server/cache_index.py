"""The router's picture of one rank's host cache: which prefix pages (and SWA states) it holds.

Fed only by the rank's CacheEvents (protocol/rank_router.py), in order, so it mirrors the
rank's hicache.index.PrefixIndex as of the rank's last step: a page stored and then evicted
is gone. The router computes a prompt's page keys itself with hicache.index.page_keys under
the rank's namespace (Hello.cache_root, Hello.page_size), so equal keys on both sides mean
equal token prefixes. Keys are chained (each hashes its parent), so the longest stored prefix
is the first run of keys found, with no tree needed. A rank that dies loses its index
(RankRegistry.mark_dead). The picture may lag the rank by one step, and a hit it promises can
be evicted before the request arrives: routing treats it as an expectation, never a promise.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.protocol.rank_router import CacheUpdate
from hicache.index import page_keys, salted_root


class RankCacheIndex:
    def __init__(self, root: bytes, page_size: int, needs_state: bool) -> None:
        self.root = root
        self.page_size = page_size
        self.needs_state = needs_state  # hybrid models: a hit ends at a page holding an SWA state
        self.pages: set[bytes] = set()
        self.states: set[bytes] = set()

    def apply(self, updates: Iterable[CacheUpdate]) -> None:
        """Replay a rank's cache events, oldest first."""
        for u in updates:
            if u.kind == "page_stored":
                self.pages.update(u.keys)
            elif u.kind == "page_evicted":
                self.pages.difference_update(u.keys)
                self.states.difference_update(u.keys)  # the rank evicts a page's state with it
            elif u.kind == "state_stored":
                self.states.update(u.keys)
            else:  # state_evicted
                self.states.difference_update(u.keys)

    def keys(self, prompt_ids: Sequence[int], salt: str = "") -> list[bytes]:
        """The prompt's page keys a lookup on the rank could hit: like PrefixIndex.lookup, at
        most (len - 1) // page_size pages, so one token is always left to compute; under the
        request's cache_salt, as the rank keys them."""
        return page_keys(prompt_ids, self.page_size, salted_root(self.root, salt),
                         max(len(prompt_ids) - 1, 0) // self.page_size)

    def hit_tokens(self, keys: Sequence[bytes]) -> int:
        """Prompt tokens the rank's cache would serve for a prompt with these page keys."""
        hit = 0
        for i, key in enumerate(keys):
            if key not in self.pages:
                break
            if not self.needs_state or key in self.states:
                hit = i + 1
        return hit * self.page_size

    def page_hit_tokens(self, keys: Sequence[bytes]) -> int:
        """Prompt tokens of the leading pages the rank holds, states aside: what a decode rank
        reuses of a handoff (the SWA rings come with it)."""
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n * self.page_size

    def expected_hit_tokens(self, prompt_ids: Sequence[int], salt: str = "") -> int:
        return self.hit_tokens(self.keys(prompt_ids, salt))
