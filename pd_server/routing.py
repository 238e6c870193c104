"""Which rank serves a request: pluggable policies over the live ranks.

A policy sees only live ranks with room for the request (`pick_rank` filters dead and
full ones first) and returns one. Policies keep their own state (a round-robin cursor),
never the registry's; `cache-aware` reads each rank's prefix index (Rank.cache, fed by the
rank's CacheEvents, see cache_index.py), which the registry keeps and drops with the rank.

    cache-aware   (default) best expected host-cache hit balanced against load, see CacheAware
    affinity      blake2b of the conversation's first user message, mod the ranks
    least-loaded  fewest requests in flight, then queue depth and KV use
    round-robin   in turn
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_server.errors import APIError
from pd_server.ranks import Rank, RankRegistry


@dataclass(frozen=True)
class RouteRequest:
    prompt_ids: list[int]
    num_seqs: int  # n: sub-requests that will all go to the chosen rank
    affinity_key: str = ""  # the conversation's first user message (for `affinity`)
    cache_salt: str = ""  # its prefix-cache salt: only that salt's pages are a hit


class RoutingPolicy(ABC):
    name = ""

    @abstractmethod
    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        """Pick one of `ranks` (non-empty, all live, all with room for req.num_seqs)."""


class LeastLoaded(RoutingPolicy):
    """Fewest in-flight requests as the router counts them (exact and immediate), then the
    rank's own queue depth and KV use from its last stats, then who got fewer requests ever
    (so equal ranks alternate)."""

    name = "least-loaded"

    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        return min(ranks, key=_load)


def _load(r: Rank):
    s = r.stats
    pages = s.pages_used / s.pages_total if s and s.pages_total else 0.0
    return (len(r.inflight), s.waiting if s else 0, pages, r.routed, r.index)


class CacheAware(RoutingPolicy):
    """The rank with the best expected prefix hit, balanced against its load:

        score(rank) = hit_tokens(rank) - load_tokens * inflight(rank)

    hit_tokens: prompt tokens the rank's host cache would serve, as its prefix index says
    (0 for a rank without a host cache); inflight: requests the router has in flight on it
    (running or queued, exact). load_tokens (default 256) prices one request in flight in
    prompt tokens: a rank one request busier wins only with a hit longer by more than that
    (a shared 1,000-token prefix outweighs up to 3 requests of queue; one cached page never
    outweighs a busier rank). Highest score wins; ties go to the least loaded (LeastLoaded's
    order), so with no host caches anywhere this is least-loaded.
    """

    name = "cache-aware"

    def __init__(self, load_tokens: int = 256) -> None:
        self.load_tokens = load_tokens

    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        hit = cached_tokens(req, lambda c, keys: c.hit_tokens(keys))
        return min(ranks, key=lambda r: (self.load_tokens * len(r.inflight) - hit(r), *_load(r)))


def cached_tokens(req: RouteRequest, count) -> Callable[[Rank], int]:
    """rank -> count(its cache index, the prompt's page keys) (0 without a cache); the keys are
    hashed once per namespace (ranks of one model share one)."""
    keys: dict[tuple[bytes, int], list[bytes]] = {}  # (salted with req.cache_salt)

    def tokens(r: Rank) -> int:
        c = r.cache
        if c is None:
            return 0
        ns = (c.root, c.page_size)
        if ns not in keys:
            keys[ns] = c.keys(req.prompt_ids, req.cache_salt)
        return count(c, keys[ns])

    return tokens


class Affinity(RoutingPolicy):
    """Every turn of a conversation to the same rank: blake2b of its first user message mod
    the ranks (by index). Stable across router restarts; moves when the ranks with room
    change. Requests with no user message (completions) go to the least loaded."""

    name = "affinity"

    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        if not req.affinity_key:
            return LeastLoaded().choose(ranks, req)
        h = int.from_bytes(hashlib.blake2b(req.affinity_key.encode(), digest_size=8).digest(), "little")
        return sorted(ranks, key=lambda r: r.index)[h % len(ranks)]


def expected_hit_tokens(rank: Rank, prompt_ids: Sequence[int], salt: str = "") -> int:
    """Prompt tokens `rank`'s host cache should serve, as the router's index has it (for logs)."""
    return rank.cache.expected_hit_tokens(prompt_ids, salt) if rank.cache else 0


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        rank = ranks[self._next % len(ranks)]
        self._next += 1
        return rank


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (CacheAware, Affinity, LeastLoaded, RoundRobin)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()


def pick_decode_rank(registry: RankRegistry, req: RouteRequest, max_inflight: int, pack: int = 0,
                     load_tokens: int = 256) -> Rank:
    """The decode rank for a PD request: fewest requests in flight as the router counts them
    (exact, and counts requests still prefilling for it), then fewest KV pages used and
    running sequences from its last stats. Raises APIError like pick_rank.

    `pack` > 0 (--decode-pack): fill one rank first. Among ranks already holding requests that
    stay within `pack` with this one, the fullest takes it; only when none can does the least
    loaded (an idle rank, or one past `pack` once every rank is) take it. Each decode step reads
    every weight once, however many rows it runs, so where the ranks share cores one step of 8
    rows costs less CPU than two of 4, and the idle rank lends its core (core_board.py).
    Otherwise the prompt's leading pages a rank's host cache holds (an earlier turn handed off
    there: it reads only the rest) count as in CacheAware: `load_tokens` prompt tokens of reuse
    outweigh one request in flight."""
    live = registry.live("decode")
    if not live:
        state = "still loading" if registry.status == "loading" else "not available"
        raise APIError(503, f"no live decode rank: the model is {state}; retry shortly")
    room = [r for r in live if len(r.inflight) + req.num_seqs <= max_inflight]
    if not room:
        raise APIError(429, f"every decode rank is full ({max_inflight} requests each); retry later")

    def load(r: Rank):
        s = r.stats
        return (len(r.inflight), s.pages_used if s else 0, s.running if s else 0, r.routed, r.index)

    if pack > 0:
        filling = [r for r in room if r.inflight and len(r.inflight) + req.num_seqs <= pack]
        if filling:
            return min(filling, key=lambda r: (-len(r.inflight), *load(r)[1:]))
    reuse = cached_tokens(req, lambda c, keys: c.page_hit_tokens(keys))
    return min(room, key=lambda r: (load_tokens * len(r.inflight) - reuse(r), *load(r)[1:]))


def pick_rank(registry: RankRegistry, policy: RoutingPolicy, req: RouteRequest, role: str,
              max_inflight: int) -> Rank:
    """The rank for `req` among live ranks of `role`. Raises APIError 503 when none lives
    (or all still load), 429 when every live rank holds max_inflight requests already."""
    live = registry.live(role)
    if not live:
        state = "still loading" if registry.status == "loading" else "not available"
        raise APIError(503, f"no live {role} rank: the model is {state}; retry shortly")
    room = [r for r in live if len(r.inflight) + req.num_seqs <= max_inflight]
    if not room:
        raise APIError(429, f"every {role} rank is full ({max_inflight} requests each); retry later")
    return policy.choose(room, req)
