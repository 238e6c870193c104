"""Prometheus metrics for GET /metrics, in the router's own registry (no import-time globals).

Latencies are measured at the router (what a client sees, minus the network): TTFT from
the request's arrival to its first token event, inter-token latency between events,
end-to-end to the last. Phase times come from the ranks' PhaseTimes (rank clocks; the
router and the ranks share a host today, so wall clocks agree).
"""
from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class TokenHistogram(Histogram):
    """A label-less Histogram for per-token observations (inter-token latency), same buckets and
    exposition as prometheus_client's. observe() runs once per streamed token on the router's hot
    path, so it only counts into plain lists (bucket found by bisection, where prometheus_client
    scans linearly); the counts move into prometheus_client's locked values when the metric is
    collected. The router observes and serves /metrics on one event-loop thread, so no lock is
    needed in between (at 256 streams the locked increments were ~7% of the router's CPU)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._pending = [0] * len(self._upper_bounds)
        self._pending_sum = 0.0

    def observe(self, amount: float, exemplar=None) -> None:
        self._pending_sum += amount
        self._pending[bisect_left(self._upper_bounds, amount)] += 1

    def observe_all(self, amounts: list[float]) -> None:
        pending, bounds = self._pending, self._upper_bounds
        for a in amounts:
            pending[bisect_left(bounds, a)] += 1
        self._pending_sum += sum(amounts)

    def _child_samples(self):
        pending, self._pending = self._pending, [0] * len(self._upper_bounds)
        for bucket, n in zip(self._buckets, pending):
            if n:
                bucket.inc(n)
        if self._pending_sum:
            self._sum.inc(self._pending_sum)
            self._pending_sum = 0.0
        return super()._child_samples()


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("pdserve_cached_prompt_tokens", "prompt tokens served from a prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("pdserve_completion_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "arrival to first token", buckets=_LAT,
                              registry=r)
        self.itl = TokenHistogram("pdserve_inter_token_latency_seconds", "between consecutive tokens of a request",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "arrival to last token", buckets=_LAT,
                             registry=r)
        self.phase = Histogram("pdserve_phase_seconds", "per-phase time of a request on its ranks (queue: router "
                               "send to rank arrival; prefill_wait: to its first prefill chunk; prefill: to first "
                               "token; PD only: stage, admission_wait, transfer, first_decode; decode: to finish; "
                               "see phase_durations)", ["phase"], buckets=_LAT, registry=r)
        self.prefill_placement = Counter("pdserve_prefill_placement", "PD requests by where their prompt was "
                                         "prefilled: on their decode rank, or a prefill rank (--disagg)", ["where"],
                                         registry=r)
        self.migrations = Counter("pdserve_migrations", "sub-requests moved from a dead rank to a live one, by the "
                                  "dead rank's role and why it was declared dead (exited, silent, "
                                  "start_timeout)", ["role", "cause"], registry=r)
        self.rank_queue = Gauge("pdserve_rank_queue_depth", "waiting sequences on a rank", ["rank"], registry=r)
        self.rank_running = Gauge("pdserve_rank_running", "running sequences on a rank", ["rank"], registry=r)
        self.rank_pages = Gauge("pdserve_rank_kv_pages_used", "KV pages in use on a rank", ["rank"], registry=r)
        self.rank_pages_total = Gauge("pdserve_rank_kv_pages_total", "KV pages on a rank", ["rank"], registry=r)
        self.rank_inflight = Gauge("pdserve_rank_inflight", "requests the router has on a rank", ["rank"],
                                   registry=r)
        self.rank_up = Gauge("pdserve_rank_up", "1 while a rank is live", ["rank", "role"], registry=r)
        self.rank_host_lookup = Gauge("pdserve_rank_host_cache_lookup_tokens",
                                      "prompt tokens a rank looked up in its host cache, since it started",
                                      ["rank"], registry=r)
        self.rank_host_hits = Gauge("pdserve_rank_host_cache_hit_tokens",
                                    "prompt tokens a rank served from its host cache, since it started",
                                    ["rank"], registry=r)
        self.rank_store_hits = Gauge("pdserve_rank_kv_store_hit_tokens",
                                     "of the host-cache hit tokens, those read from the L3 store (--kv-store), "
                                     "since the rank started", ["rank"], registry=r)
        self.rank_store_bytes = Gauge("pdserve_rank_kv_store_bytes", "bytes a rank read from or wrote to the L3 "
                                      "store, since it started", ["rank", "direction"], registry=r)
        self.rank_store_seconds = Gauge("pdserve_rank_kv_store_seconds", "seconds a rank spent reading from or "
                                        "writing to the L3 store, since it started (over the bytes: its "
                                        "throughput; reads are in a request's time to first token)",
                                        ["rank", "direction"], registry=r)
        self.rank_store_prefetches = Gauge("pdserve_rank_kv_store_prefetches", "requests whose pages past the "
                                           "host-cache hit a rank read ahead from the L3 store before admitting "
                                           "them, since it started: in_time (the read finished), late (the "
                                           "request stopped waiting at its deadline: a slow store), skipped "
                                           "(not read: the store was stuck in an earlier read)",
                                           ["rank", "outcome"], registry=r)
        self.rank_store_prefetch_wait = Gauge("pdserve_rank_kv_store_prefetch_wait_seconds", "seconds requests "
                                              "waited for their L3 read-ahead on a rank, summed, since it started",
                                              ["rank"], registry=r)
        self.handoff_pulled = Counter("pdserve_handoff_pulled_tokens", "prompt tokens whose KV a decode rank "
                                      "read from a prefill rank", ["rank"], registry=r)
        self.handoff_reused = Counter("pdserve_handoff_reused_tokens", "prompt tokens of a handoff whose KV the "
                                      "decode rank's host cache already held (not read)", ["rank"], registry=r)
        self.rank_handoffs = Gauge("pdserve_rank_handoffs", "prefill: handoffs awaiting Pulled; decode: handoffs "
                                   "queued or being pulled", ["rank"], registry=r)
        self.rank_handoff_pages = Gauge("pdserve_rank_handoff_pages_used", "prefill: handoff-pool pages reserved "
                                        "or pinned", ["rank"], registry=r)
        self.rank_transfer_bytes = Gauge("pdserve_rank_transfer_bytes", "decode: KV bytes pulled since it started",
                                         ["rank"], registry=r)
        self.rank_transfer_seconds = Gauge("pdserve_rank_transfer_seconds", "decode: seconds spent in KV pulls "
                                           "since it started", ["rank"], registry=r)

    def observe_kv_reuse(self, rank: str, role: str, last, now) -> None:
        """A rank's L3 store counters and (decode) its handoff totals since its start from its
        RankStats `now` (`last`: the one before) -> the gauges and counters (a restarted rank
        starts again at 0: only growth counts)."""
        self.rank_store_hits.labels(rank).set(now.kv_store_hit_tokens)
        self.rank_store_bytes.labels(rank, "read").set(now.kv_store_read_bytes)
        self.rank_store_bytes.labels(rank, "written").set(now.kv_store_written_bytes)
        self.rank_store_seconds.labels(rank, "read").set(now.kv_store_read_seconds)
        self.rank_store_seconds.labels(rank, "written").set(now.kv_store_write_seconds)
        self.rank_store_prefetches.labels(rank, "in_time").set(now.kv_store_prefetches - now.kv_store_prefetch_late)
        self.rank_store_prefetches.labels(rank, "late").set(now.kv_store_prefetch_late)
        self.rank_store_prefetches.labels(rank, "skipped").set(now.kv_store_prefetch_skipped)
        self.rank_store_prefetch_wait.labels(rank).set(now.kv_store_prefetch_wait_seconds)
        if role != "decode":
            return
        for counter, total, before in ((self.handoff_pulled, now.handoff_pulled_tokens,
                                        last.handoff_pulled_tokens if last else 0),
                                       (self.handoff_reused, now.handoff_reused_tokens,
                                        last.handoff_reused_tokens if last else 0)):
            if total > before:
                counter.labels(rank).inc(total - before)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def phase_durations(sent_at: float, t) -> dict[str, float]:
    """Seconds per phase of one finished request from its PhaseTimes (rank wall clocks).

    Colocated: queue, prefill_wait, prefill, decode. PD adds, between prefill and decode:
    stage (first token sent to Handoff sent: the copy into the handoff pool runs after the
    first token leaves), admission_wait (Handoff sent
    to read start on the decode rank: network plus waiting for room), transfer (the read),
    first_decode (read done to the decode rank's first token); decode then runs from that
    token to the end.
    """
    start = t.prefill_start or t.arrived
    out = {"queue": t.arrived - sent_at, "prefill_wait": start - t.arrived, "prefill": t.first_token - start}
    if t.handoff_sent:
        out.update(stage=t.handoff_sent - t.first_token, admission_wait=t.pull_start - t.handoff_sent,
                   transfer=t.pull_end - t.pull_start, first_decode=t.first_decode - t.pull_end,
                   decode=t.finished - t.first_decode)
    else:
        out["decode"] = t.finished - t.first_token
    return {k: max(0.0, v) for k, v in out.items()}
