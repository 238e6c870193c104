"""Where a PD request's prompt is prefilled (--disagg): the router's side of disagg.py's rule.

Placer gathers what DisaggPolicy.decide needs for one request (the chosen decode rank, a prefill
rank picked by the routing policy, each one's expected host-cache hit, the prefill work queued on
both, the decode rank's batch and mean context from its RankStats) and returns the prefill rank
(None: the decode rank prefills), the Placement and each sub-request's estimated prefill
seconds, which the dispatcher books on its Pending so later requests see the queue.
"""
from __future__ import annotations

import logging
import os

from cluster.protocol.router_rank import Sampling
from pd_server.config import RouterConfig
from pd_server.disagg import DisaggPolicy, Placement, PlacementInput
from pd_server.disagg_costs import find_costs
from pd_server.errors import APIError
from pd_server.ranks import PD_ROLES, Rank, RankRegistry
from pd_server.request_state import Pending
from pd_server.routing import RouteRequest, RoutingPolicy, expected_hit_tokens, pick_rank

log = logging.getLogger("pd_server.placement")


class Placer:
    def __init__(self, cfg: RouterConfig, registry: RankRegistry, routing: RoutingPolicy,
                 pending: dict[str, Pending]) -> None:
        """`pending`: the dispatcher's requests in flight, by sub-request id (read, never written)."""
        self.cfg, self.registry, self.routing, self.pending = cfg, registry, routing, pending
        # --disagg auto's curves, read now (a bad --disagg-costs fails at start); the policy is made
        # at the first PD request, when the ranks (and so each one's share of the cores) are known.
        self._cost_file = find_costs(registry.model, cfg.disagg_costs) if cfg.disagg == "auto" else None
        self._policy: DisaggPolicy | None = None

    @property
    def policy(self) -> DisaggPolicy:
        """The --disagg policy (made at the first PD request: auto prices a rank's steps at its
        share of this host's cores, cores // PD ranks, as the launcher divides them)."""
        if self._policy is None:
            costs = None
            if self._cost_file is not None:
                ranks = sum(1 for r in self.registry.ranks.values() if r.role in PD_ROLES)
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                costs = self._cost_file.at(max(1, cores // max(1, ranks)))
                log.info("disagg auto: cost curves %s at %d thread(s) a rank", self._cost_file.source, costs.threads)
            self._policy = DisaggPolicy(self.cfg.disagg, costs)
        return self._policy

    def place(self, decode: Rank, route: RouteRequest, work: list[tuple[list[int], Sampling]],
              cap: int) -> tuple[Rank | None, Placement, list[float]]:
        """(the prefill rank, or None when the decode rank prefills; the placement; each
        sub-request's estimated prefill seconds where it goes, for the queue of later ones).
        Raises APIError like pick_rank only in `always` mode; auto places on the decode rank
        when no prefill rank lives or has room."""
        policy = self.policy
        prefill = None
        if policy.mode != "never":
            try:
                prefill = pick_rank(self.registry, self.routing, route, "prefill", cap)
            except APIError:
                if policy.mode == "always":
                    raise
        if policy.mode != "auto" or prefill is None:
            placement = policy.decide(PlacementInput((), prefill_available=prefill is not None))
            est = [policy.prefill_s(len(p), 0) for p, _ in work]
            return (None if placement.local else prefill), placement, est
        hits: dict[int, tuple[int, int, int]] = {}  # n choices of a prompt share its ids list: look up once
        seqs = []
        for prompt, sampling in work:
            h = hits.get(id(prompt))
            if h is None:
                salt = sampling.cache_salt
                h = hits[id(prompt)] = (len(prompt), expected_hit_tokens(prefill, prompt, salt),
                                        expected_hit_tokens(decode, prompt, salt))
            seqs.append(h)
        s, hello = decode.stats, decode.hello
        ctx = s.pages_used * hello.page_size / s.running if s and s.running and hello else float(seqs[0][0])
        placement = policy.decide(PlacementInput(tuple(seqs), self.queued_prefill_s(prefill),
                                                 self.queued_prefill_s(decode), max(1, len(decode.inflight)), ctx))
        if placement.local:
            return None, placement, [policy.prefill_s(n, hd) for n, _, hd in seqs]
        return prefill, placement, [policy.prefill_s(n, hp) for n, hp, _ in seqs]

    def queued_prefill_s(self, rank: Rank) -> float:
        """Estimated seconds of prefill queued on `rank`: the requests the router sent it to
        prefill that have not returned a first token (a partly prefilled one counts in full)."""
        total = 0.0
        for sid in rank.inflight:
            p = self.pending.get(sid)
            if p is not None and p.rank is rank and not p.last:
                total += p.prefill_s
        return total
