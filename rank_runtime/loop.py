"""The engine thread every rank runs (RankLoop), and what a colocated rank does with it.

Request life cycle on a colocated rank:
  1. The IO thread (router_link.py) receives Generate and puts it in the inbox.
  2. The engine thread admits it: SamplingParams from the message, engine.add_request().
     Invalid input (ValueError) goes back at once as RequestError(400); nothing is queued.
  3. engine.step() runs the running batch (chunked prefill, continuous batching); every
     output of the step becomes one TokenEvent, and the step's events one TokenBatch. Host
     cache pages stored or evicted go to the router as CacheEvents (cache-aware routing):
     finished requests' before the batch, running ones' (written through after it) after.
  4. The last event of a request carries finish_reason, usage and PhaseTimes; the engine
     has freed the request's pages and SWA slot by then.
  5. Abort (client gone) calls engine.abort(): idempotent, frees pages at once, sends nothing.
  6. An engine exception fails every request on the rank with RequestError(500), aborts
     them (pages freed) and the rank keeps serving.
The roles build on it through its hooks (RankLoop's docstring): decode/rank.py (DecodeLoop,
requests handed off by prefill ranks too), prefill/rank.py (PrefillLoop).
"""
from __future__ import annotations

import logging
import queue
import time

import msgspec

from cluster.protocol.rank_router import (CacheEvents, CacheUpdate, PhaseTimes, PromptLogprobs, RankStats,
                                            RequestError, TokenBatch, TokenEvent, TokenLogprob)
from cluster.protocol.router_rank import Abort, Generate
from rank_runtime.router_link import RankLink, RouterLost

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.25  # inbox wait when the engine has nothing to run (why so long: rank_link.Wake)
# After shipping a request's first token, the engine thread sleeps this long before its next step
# when it has one: with every core running this rank's step threads, the token otherwise waits
# for a core to get out (this process's IO thread, then the router's loop). Measured, colocated
# on 2 cores: time to first token of a 670-token prompt 8 ms longer when the request went on
# decoding than when it stopped at that token, the same with this yield.
FIRST_TOKEN_YIELD_S = 0.001


class RankLoop:
    """The engine thread: admits, steps, reports. Owns the engine; never shares it. It is the
    colocated role as it stands; the PD roles (decode.rank.DecodeLoop, prefill.rank.PrefillLoop)
    subclass it and override only these hooks, each called on the engine thread:

      on_message(msg)          one inbox message (Generate, Abort, Peers, a PeerMessage, ...)
      between_steps()          role work before each step: transfers, leases, held-back prompts
      wait_s() -> float        how long run_once may wait for a message (0: there is work)
      on_outputs(outs)         a step's RequestOutputs: ship them (TokenBatch), hand off, ...
      phase_times(rid, now)    the PhaseTimes the request's last event carries
      extra_stats() -> dict    role fields of RankStats (handoff and transfer counters)
      drop_all(why)            the router is gone: end everything, telling no one
      fail_all(message)        an engine step raised: fail every request (RequestError 500)
      forget(rid)              the request left this rank: drop what the loop kept for it

    and may call: admit_generate(msg), abort(rid), token_event(output), yield_after_first(events);
    `arrived` / `first_token_at` map request ids to wall-clock times; `link` is the RankLink.
    """

    ships_cache_events = True  # the router routes prompts here by what this host cache holds

    def __init__(self, engine) -> None:
        self.engine = engine
        self.board = None  # a rank_runtime.core_board.CoreBoard: idle cores of this host's ranks, lent per step
        self.step_log = None  # a rank_runtime.step_log.StepLog ($PDSERVE_STEP_LOG), set by serve()
        self._cache = getattr(engine, "hicache", None) if self.ships_cache_events else None
        if self._cache is not None:
            self._cache.record_events = True
        self.link: RankLink | None = None
        # Messages taken off the inbox within a step and left for the step's end, in order
        # (a decode rank takes Handoffs mid-step: decode/rank.py).
        self.deferred: list = []
        self.steps = 0
        self.arrived: dict[str, float] = {}  # request id -> rank wall clock at arrival
        self.first_token_at: dict[str, float] = {}  # request id -> first token time
        self._stats = self._snapshot()

    def stats(self) -> RankStats:
        """Called from the IO thread: returns the last snapshot, never touches the engine."""
        return self._stats

    def _snapshot(self) -> RankStats:
        s = self.engine.stats()
        hc = s.get("hicache") or {}
        return RankStats(running=s["running"], waiting=s["waiting"], pages_used=s["pages_used"],
                         pages_total=s["pages_total"], swa_slots_free=s["swa_slots_free"], steps=self.steps,
                         host_cache_lookup_tokens=hc.get("lookup_tokens", 0),
                         host_cache_hit_tokens=hc.get("hit_tokens", 0),
                         kv_store_hit_tokens=hc.get("l3_hit_tokens", 0), kv_store_read_bytes=hc.get("bytes_l3_read", 0),
                         kv_store_written_bytes=hc.get("bytes_l3_written", 0),
                         kv_store_read_seconds=hc.get("seconds_l3_read", 0.0),
                         kv_store_write_seconds=hc.get("seconds_l3_written", 0.0),
                         kv_store_prefetches=hc.get("l3_prefetches", 0), kv_store_prefetch_late=hc.get("l3_prefetch_late", 0),
                         kv_store_prefetch_wait_seconds=hc.get("seconds_l3_prefetch_wait", 0.0),
                         kv_store_prefetch_skipped=hc.get("l3_prefetch_skipped", 0), **self.extra_stats())

    def extra_stats(self) -> dict:
        return {}

    def run(self, link: RankLink) -> None:
        """Serve until link.stopped is set."""
        self.link = link
        while not link.stopped.is_set():
            self.run_once()

    def run_once(self) -> None:
        """One turn: take messages (waiting only when idle), role work, one engine step."""
        eng = self.engine
        if self.board is not None and not eng.has_unfinished():
            self.board.idle()  # before the wait: a peer's step may take this rank's cores from now on
        self._admit(self.wait_s())
        self.between_steps()
        if not eng.poll_prefetch(wait=True):  # nothing to run (or only L3 read-aheads in flight)
            self._stats = self._snapshot()
            return
        if self.board is not None:  # (a step of many rows takes idle peers' cores before they settle)
            rows, b = eng.next_step_rows(), self.board  # (something runs: has_unfinished)
            b.busy(eng.next_step_invariant(rows), rows > b.eager_rows)
        if self.step_log is not None:
            self.step_log.begin(self.board.threads if self.board is not None else 0)
        try:
            outs = eng.step()
        except Exception:  # noqa: BLE001 - fail the requests, keep the rank
            # The exception's text goes to this rank's log, never to a client (it can name
            # internals, another request's values, paths).
            log.exception("engine step failed; failing request(s) %s", ", ".join(map(str, self.engine.seqs)))
            self.fail_all("engine failure on this rank (logged on the rank)")
            return
        self.steps += 1
        if self.step_log is not None:
            self.step_log.end(*eng.last_step)
        self._ship_cache_events()  # before the tokens: a client's next turn finds the index current
        self.on_outputs(outs)
        try:  # running prompts' pages to the host cache, once their tokens have left
            eng.flush_write_through()
        except Exception:  # noqa: BLE001 - the cache misses those pages; the requests go on
            log.exception("host cache write-through failed")
        self._ship_cache_events()
        self._stats = self._snapshot()

    def wait_s(self) -> float:
        """How long the loop may wait for a message (0: there is work)."""
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def between_steps(self) -> None:
        """Role work between steps (transfers, leases, held-back admissions)."""

    def between_layers(self) -> None:
        """Within a step, between its layers (the model's hook, rank_runtime/serve.py): lent cores
        go back or are taken (core_board.py); a decode rank renews its handoffs' leases."""
        if self.board is not None:
            self.board.recheck()

    def _ship_cache_events(self) -> None:
        if self._cache is not None:
            events = self._cache.drain_events()
            if events:
                self.link.send(CacheEvents([CacheUpdate(e.kind, list(e.keys)) for e in events]))

    def on_outputs(self, outs) -> None:
        if outs:
            events = [self.token_event(o) for o in outs]
            self.send_events(events, time.time())
            self.yield_after_first(events)

    def yield_after_first(self, events: list[TokenEvent]) -> None:
        """Let a first token leave before the next step takes the cores (FIRST_TOKEN_YIELD_S)."""
        if self.engine.has_unfinished() and any(e.completion_tokens == len(e.token_ids) for e in events):
            time.sleep(FIRST_TOKEN_YIELD_S)

    def _admit(self, wait_s: float) -> None:
        if self.deferred:
            deferred, self.deferred = self.deferred, []
            for msg in deferred:
                self._take(msg)
            wait_s = 0.0
        try:
            msg = self.link.inbox.get(timeout=wait_s) if wait_s > 0 else self.link.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._take(msg)
            try:
                msg = self.link.inbox.get_nowait()
            except queue.Empty:
                return

    def _take(self, msg) -> None:
        if isinstance(msg, RouterLost):
            self.drop_all(msg.reason)
        else:
            self.on_message(msg)

    def on_message(self, msg) -> None:
        if isinstance(msg, Generate):
            self.admit_generate(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)

    def abort(self, rid: str) -> None:
        if self.engine.abort(rid) is not None:
            self.forget(rid)

    def drop_all(self, why: str) -> None:
        """The router is gone (RouterLost): end every request here, telling no one (no router
        awaits them); roles also drop what they hold outside the engine."""
        rids = list(self.engine.seqs)
        for rid in rids:
            self.abort(rid)
        log.warning("dropped %d request(s): %s", len(rids), why)

    def admit_generate(self, msg: Generate) -> None:
        from engine.sampling_params import SamplingParams

        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
            self.engine.add_request(msg.request_id, msg.prompt_ids, params, output_ids=msg.resume_ids)
        except ValueError as e:
            self.link.send(RequestError(msg.request_id, 400, str(e)))
            return
        self.arrived[msg.request_id] = time.time()

    def token_event(self, o) -> TokenEvent:
        rid = o.request_id
        now = time.time()
        times = None
        if o.finished:
            times = self.phase_times(rid, now)
            self.forget(rid)
        else:
            self.first_token_at.setdefault(rid, now)
        lps = plp = None
        if o.logprobs is not None:
            lps = [TokenLogprob(lp.token_id, lp.logprob, [(int(i), float(v)) for i, v in lp.top])
                   for lp in o.logprobs]
        if o.prompt_logprobs is not None:
            p = o.prompt_logprobs
            plp = PromptLogprobs(p.logprobs, p.ranks, p.top_ids, p.top_logprobs)
        return TokenEvent(rid, o.new_token_ids, o.text, o.finish_reason, o.stop_str, o.prompt_tokens,
                          o.completion_tokens, o.cached_tokens, lps, times, plp)

    def send_events(self, events: list[TokenEvent], now: float) -> None:
        """The step's events as one TokenBatch, but each that carries prompt logprobs (up to
        protocol.MAX_PROMPT_LOGPROB_ENTRIES entries) in a frame of its own: several of those in one
        frame could pass the frame limit."""
        big = [e for e in events if e.prompt_logprobs is not None]
        rest = [e for e in events if e.prompt_logprobs is None] if big else events
        for e in big:
            self.link.send(TokenBatch([e], now))
        if rest:
            self.link.send(TokenBatch(rest, now))

    def phase_times(self, rid: str, now: float) -> PhaseTimes:
        arrived = self.arrived.get(rid, now)
        return PhaseTimes(arrived, self.first_token_at.get(rid, now), now, prefill_start=arrived)

    def forget(self, rid: str) -> None:
        self.arrived.pop(rid, None)
        self.first_token_at.pop(rid, None)

    def fail_all(self, message: str) -> None:
        for rid in list(self.engine.seqs):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already failing; free what we can
                log.exception("abort of %s failed", rid)
            self.forget(rid)
            self.link.send(RequestError(rid, 500, message))
