"""Which rank serves a request: pluggable policies over the live ranks.

A policy sees only live ranks with room for the request (`pick_rank` filters dead and
full ones first) and returns one. Policies keep their own state (a round-robin cursor;
later a prefix index fed by the ranks' cache events for `cache-aware`, a hash ring for
`affinity`), never the registry's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pd_server.errors import APIError
from pd_server.ranks import Rank, RankRegistry


@dataclass(frozen=True)
class RouteRequest:
    prompt_ids: list[int]
    num_seqs: int  # n: sub-requests that will all go to the chosen rank
    affinity_key: str = ""  # the conversation's first user message (for `affinity`)


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
        def load(r: Rank):
            s = r.stats
            pages = s.pages_used / s.pages_total if s and s.pages_total else 0.0
            return (len(r.inflight), s.waiting if s else 0, pages, r.routed, r.index)

        return min(ranks, key=load)


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, ranks: list[Rank], req: RouteRequest) -> Rank:
        rank = ranks[self._next % len(ranks)]
        self._next += 1
        return rank


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (LeastLoaded, RoundRobin)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()


def pick_decode_rank(registry: RankRegistry, req: RouteRequest, max_inflight: int) -> Rank:
    """The decode rank for a PD request: fewest requests in flight as the router counts them
    (exact, and counts requests still prefilling for it), then fewest KV pages used and
    running sequences from its last stats. Raises APIError like pick_rank."""
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

    return min(room, key=load)


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
