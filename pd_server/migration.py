"""Request migration: a dead rank's sub-requests go on elsewhere, the client sees no error.

When the dispatcher declares a rank dead (its process exited, it fell silent, or it never
became ready), every sub-request it held is offered to Migrator.move before it is failed:
  1. Bounded: at most --max-migrations moves per sub-request (0 turns migration off).
  2. Every other live rank of the request (a PD request's decode rank that may be pulling a
     dead prefill rank's KV, or the prefill rank prefilling for, or pinning the handoff of, a
     dead decode rank) gets Abort, and is a target only when no other rank is live (the Abort
     goes first on the same socket; a Handoff of the dead rank that arrives after it finds a
     tombstone and is dropped, decode/handoff_receiver.py).
  3. The target: a live rank of the same kind that has room if any does (else any live one):
     another colocated rank for a colocated request, a decode rank for a PD request, chosen by
     the routing policy on prompt + tokens so far (a host-cache hit makes the recompute cheap).
  4. It gets a Generate with decode_rank -1 and resume_ids = the tokens already delivered to the
     client: the engine recomputes prompt + those tokens and decodes on (engine add_request
     output_ids), with the same seeded noise, penalties, grammar state and held-back stop-string
     text, so the stream goes on with no repeated and no missing token; the token offsets go on
     from the count delivered. Usage stays truthful: the prompt is the original one.
  5. The request is then booked as a colocated request on the target (Pending.decode None); it
     counts in pdserve_migrations_total{role, cause} and the log names it, the dead rank and the
     new one.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from cluster.protocol.router_rank import Abort, Generate
from pd_server.config import RouterConfig
from pd_server.metrics import RouterMetrics
from pd_server.ranks import Rank, RankRegistry
from pd_server.request_state import Pending
from pd_server.routing import RouteRequest, RoutingPolicy

log = logging.getLogger("pd_server.migration")


def cause_of(reason: str) -> str:
    """The metric label of a death reason (ranks.find_dead's words)."""
    for word in ("exited", "silent", "ready"):
        if word in reason:
            return {"ready": "start_timeout"}.get(word, word)
    return "other"


class Migrator:
    def __init__(self, cfg: RouterConfig, registry: RankRegistry, policy: RoutingPolicy, metrics: RouterMetrics,
                 send: Callable[[Rank, msgspec.Struct], None]) -> None:
        self.cfg, self.registry, self.policy, self.metrics, self._send = cfg, registry, policy, metrics, send

    def move(self, sid: str, p: Pending, dead: Rank, reason: str) -> bool:
        """Steps 1-5 for sub-request `sid` of dead rank `dead`; False (nothing sent, nothing
        changed) when it may not or cannot move: the caller fails it then."""
        if p.migrations >= self.cfg.max_migrations:
            return False
        others = [r for r in p.ranks() if r is not dead and r.live]  # they may still hold it
        role = "colocated" if p.rank.role == "colocated" else "decode"
        live = [r for r in self.registry.live(role) if r not in others] or self.registry.live(role)
        if not live:
            return False
        tokens = list(p.tokens)
        if len(tokens) >= p.msg.sampling.max_tokens:
            return False  # its last event was on the way: nothing left to generate
        route = RouteRequest(p.msg.prompt_ids + tokens, 1, cache_salt=p.msg.sampling.cache_salt)
        room = [r for r in live if len(r.inflight) < self.cfg.max_inflight_per_rank]
        target = self.policy.choose(room or live, route)
        for r in others:  # idempotent there (a prefill rank may still pin the dead decode rank's handoff)
            r.inflight.discard(sid)
            self._send(r, Abort(sid))
        dead.inflight.discard(sid)
        msg = Generate(sid, p.msg.prompt_ids, p.msg.sampling, time.time(), -1, resume_ids=tokens)
        p.msg, p.rank, p.decode, p.migrations = msg, target, None, p.migrations + 1
        p.early.clear()
        target.inflight.add(sid)
        self._send(target, msg)
        self.metrics.migrations.labels(dead.role, cause_of(reason)).inc()
        log.warning("moved %s from dead %s to %s after %d token(s) (%s)", sid, dead.name, target.name,
                    len(tokens), reason)
        return True
