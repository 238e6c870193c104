"""Discrete-event simulation of one serving configuration on a workload (DistServe-style).

Deterministic: events at equal times run in the order they were scheduled. Time is seconds.
A request's life, mirroring the router and ranks:
  1. Its session sends it (closed loop: `concurrency` sessions at once, each chain's calls one
     after another with the recorded idle gaps, subagent forks side by side; workload.py).
  2. Router: colocated -> a colocated rank; PD -> a prefill rank and a decode rank at once.
     Ranks that prefill are chosen cache-aware (pd_server/routing.py CacheAware: the largest
     hit_tokens - load_tokens * in-flight, ties to the least loaded, then the lowest index);
     decode ranks by fewest in flight (the router's --decode-pack 0: its fill-one-rank-first
     rule pays where ranks time-share cores, which this simulation, a rank per core share,
     does not model). A prefill rank stops counting a PD request at its
     first token, a decode or colocated rank at its end.
  3. Rank that prefills: continuous batching like engine/scheduler.py: each step, running
     sequences (oldest first) get their next tokens (1 when decoding, a chunk of the prompt
     otherwise) within `max_num_batched_tokens`, then waiting ones are admitted FCFS while
     budget and `max_num_seqs` last. Admission looks the prompt up in the rank's host cache
     (blocks of the trace's hash_ids; at least one token left to compute, page-aligned); the
     prompt's full blocks are stored when its prefill ends. A step with prompt chunks costs
     the sum of their prefill_s(new, cached) plus decode_s(batch, mean context) of its
     one-token rows: a chunk stalls every decode in the step, as on a colocated rank (phase
     `prefill_stall`: a request's decode time spent in other prompts' chunks).
  4. The step that completes a prompt samples the first token (TTFT at the step's end). PD:
     that step also pays stage_s(KV bytes) per completed prompt (the copy into the handoff
     pool), and the request leaves the prefill rank (a one-token request ends there).
  5. Decode rank: handoffs queue FIFO; one read at a time (transfer_s(bytes)) while the rank
     has a sequence place; the pulled request joins the next decode step. Steps batch every
     running sequence (decode_s(batch, mean context)), one token each.
  6. xPyD+cond (conditional disaggregation, the router's --disagg auto): at step 2 the
     router's rule (pd_server/disagg.py DisaggPolicy, on these costs) decides from the prompt,
     both ranks' expected hits and both ranks' queued prefill (the estimated
     prefill seconds of requests sent there without a first token yet) whether the decode
     rank prefills the request itself (the decode rank's own host cache, which holds what
     it prefilled, priced in); it then runs there as on a colocated rank (3-4, its chunks
     stalling that rank's decodes).
Not modelled: KV memory limits and preemption, handoff-pool backpressure, network and
HTTP latency, host-cache eviction (unbounded), the max-in-flight 429s.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from bench.pdtune.costs import StepCosts
from bench.pdtune.report import RequestResult
from bench.pdtune.sim_state import Rank, Req
from bench.pdtune.split import Limits, Split
from bench.pdtune.workload import Call, Fork, Session, entered_at
from pd_server.disagg import DisaggPolicy, PlacementInput


class Simulator:
    def __init__(self, split: Split, costs: StepCosts, sessions: list[Session], concurrency: int,
                 limits: Limits = Limits(), duration_s: float | None = None,
                 trajectory_start: tuple[float, float] | None = None, seed: int = 42,
                 cpu_cores: float | None = None) -> None:
        """`concurrency` sessions run at once. Without `duration_s` every session runs once;
        with it, sessions repeat in order (new instances: no cache carry-over) and no call
        is sent at or after duration_s past the first reported call (those in flight finish).
        `trajectory_start` (lo, hi): each of the first `concurrency` session instances draws t*
        uniformly in [lo, hi] x its recorded duration (random.Random(seed)) and is entered there
        (`entered_at`: one unreported warm-up call, then the calls from t*); later instances
        start at their first call (aiperf recycles a finished lane into a fresh session from
        turn 0: 113 simulated against 141 measured requests in 120 s before); the first
        `concurrency` sessions' reported calls wait until all of them are past their
        warm-up (aiperf aligns them at t*), and the duration counts from then.
        `cpu_cores`: the ranks share that many cores: while n ranks of `costs.threads` threads
        each run a step, every step runs at min(1, cpu_cores / (n * threads)) of full speed
        (processor sharing; `costs` then carries no static slowdown). None: full speed."""
        if concurrency < 1 or not sessions:
            raise ValueError("need concurrency >= 1 and at least one session")
        self.split, self.costs, self.limits = split, costs, limits
        self.sessions, self.concurrency, self.duration = sessions, concurrency, duration_s
        self.trajectory_start, self._rng = trajectory_start, random.Random(seed)
        self._profile_start: float | None = None  # when reported calls may go (end of warm-up)
        # AgentX warm-up barrier: the first `concurrency` sessions all get past their warm-up
        # call before any goes on (aiperf aligns them at t*); their chains wait here.
        self._barrier = min(concurrency, len(sessions)) if trajectory_start else 0
        self._reached: set[int] = set()
        self._parked: list = []
        self.cpu_cores = cpu_cores
        self._computing: list[Rank] = []  # ranks inside a step (CPU sharing)
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._next_session = 0
        self._instances = itertools.count()
        self.results: list[RequestResult] = []
        if split.colocated:
            self.prefillers = [Rank(f"colocated-{i}", "colocated", i) for i in range(split.colocated)]
            self.decoders: list[Rank] = []
        else:
            self.prefillers = [Rank(f"prefill-{i}", "prefill", i) for i in range(split.prefill)]
            self.decoders = [Rank(f"decode-{i}", "decode", i) for i in range(split.decode)]
        self.disagg = DisaggPolicy("auto", costs) if split.cond else None
        self.placed_local = 0  # +cond: requests the decode rank prefilled

    # ---- event loop -------------------------------------------------------------------
    def _at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> list[RequestResult]:
        for _ in range(self.concurrency):
            self._start_session()
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        return self.results

    # ---- sessions (the client) ----------------------------------------------------------
    def _past_duration(self) -> bool:
        return (self.duration is not None and self._profile_start is not None
                and self.now >= self._profile_start + self.duration)

    def _start_session(self) -> None:
        i = self._next_session
        if (self.duration is None and i >= len(self.sessions)) or self._past_duration():
            return
        self._next_session += 1
        s = self.sessions[i % len(self.sessions)]
        items = s.items
        if self.trajectory_start is not None and i < self.concurrency:  # a recycled lane starts at turn 0
            items = entered_at(items, self._rng.uniform(*self.trajectory_start) * s.recorded_end())
        self._run_chain((next(self._instances), 0.0), items, 0, self._start_session)

    def _park(self, inst: tuple[int, float], items, idx: int, on_done: Callable[[], None]) -> None:
        """Hold an initial session past its warm-up until all of them are (aiperf's t*)."""
        self._parked.append((inst, items, idx, on_done))
        self._reached.add(inst[0])
        if len(self._reached) == self._barrier:
            self._barrier, parked, self._parked = 0, self._parked, []
            self._profile_start = self.now
            for args in parked:
                self._run_chain(*args)

    def _run_chain(self, inst: tuple[int, float], items, idx: int, on_done: Callable[[], None]) -> None:
        if idx == len(items):
            on_done()
            return
        item = items[idx]
        if self._barrier and inst[0] < self._barrier and not (isinstance(item, Call) and item.warmup):
            self._park(inst, items, idx, on_done)
            return

        def then() -> None:
            self._run_chain(inst, items, idx + 1, on_done)
        if isinstance(item, Call):
            self._at(self.now + item.delay_s, self._submit, inst, item, then)
        else:
            self._at(self.now + item.delay_s, self._fork, inst, item, then)

    def _fork(self, inst: tuple[int, float], fork: Fork, then: Callable[[], None]) -> None:
        left = [len(fork.chains)]

        def joined() -> None:
            left[0] -= 1
            if left[0] == 0:
                then()
        if not fork.chains:
            then()
        for chain in fork.chains:
            self._run_chain(inst, chain, 0, joined)

    # ---- the router ---------------------------------------------------------------------
    def _submit(self, inst: tuple[int, float], call: Call, then: Callable[[], None]) -> None:
        if self._past_duration():
            then()  # the chain ends: nothing is sent after the benchmark duration
            return
        warmup = call.warmup
        if not warmup and self._profile_start is None:
            self._profile_start = self.now
        req = Req(call, tuple((inst[0], h) for h in call.hash_ids), self.now, then, warmup=warmup)
        rank = max(self.prefillers, key=lambda r: (self._hit(r, req) - self.limits.load_tokens * r.inflight,
                                                   -r.inflight, -r.routed, -r.index))
        if self.decoders:
            d = min(self.decoders, key=lambda r: (r.inflight, r.routed, r.index))
            local = self.disagg is not None and self._place_local(req, rank, d)
            d.inflight += 1
            d.routed += 1
            if local:  # prefilled and decoded there, as on a colocated rank
                self.placed_local += 1
                d.waiting.append(req)
                self._kick(d)
                return
            req.decode_rank = d
        rank.inflight += 1
        rank.routed += 1
        rank.waiting.append(req)
        self._kick(rank)

    def _place_local(self, req: Req, prefill: Rank, d: Rank) -> bool:
        """The router's --disagg auto rule (pd_server/disagg.py) for `req`; sets its estimate."""
        pol, n = self.disagg, req.call.input_tokens
        hit, local_hit = self._hit(prefill, req), self._hit(d, req)
        ctx = [r.call.input_tokens + r.generated for r in d.running]
        x = PlacementInput(((n, hit, local_hit),), self._queued_prefill_s(prefill), self._queued_prefill_s(d),
                           max(1, d.inflight), sum(ctx) / len(ctx) if ctx else float(n))
        local = pol.decide(x).local
        req.prefill_est = pol.prefill_s(n, local_hit if local else hit)
        return local

    @staticmethod
    def _queued_prefill_s(rank: Rank) -> float:
        """What the router counts as queued prefill on `rank`: requests without a first token."""
        return sum(r.prefill_est for r in itertools.chain(rank.waiting, rank.running) if r.prefilling)

    def _hit(self, rank: Rank, req: Req) -> int:
        """Prompt tokens the rank's host cache serves: the leading stored blocks, leaving at
        least one token to compute, in whole pages."""
        n = 0
        for k in req.keys:
            if k not in rank.cache:
                break
            n += 1
        page = self.limits.page_size
        cap = (req.call.input_tokens - 1) // page * page
        return min(n * req.call.block_size, cap)

    # ---- ranks ----------------------------------------------------------------------------
    def _kick(self, rank: Rank) -> None:
        if not rank.busy and (rank.waiting or rank.running):
            rank.busy = True
            self._at(self.now, self._step, rank)

    def _schedule(self, rank: Rank) -> list[tuple[Req, int]]:
        lim = self.limits
        budget = lim.max_num_batched_tokens
        batch = []
        for r in rank.running:
            if budget == 0:
                break
            n = min(r.call.input_tokens - r.computed if r.prefilling else 1, budget)
            batch.append((r, n))
            budget -= n
        while rank.waiting and budget > 0 and len(rank.running) < lim.max_num_seqs:
            r = rank.waiting.popleft()
            r.cached = r.computed = self._hit(rank, r)
            r.t_admit = self.now
            n = min(r.call.input_tokens - r.computed, budget)
            rank.running.append(r)
            batch.append((r, n))
            budget -= n
        return batch

    def _step(self, rank: Rank) -> None:
        batch = self._schedule(rank)
        if not batch:
            rank.busy = False
            return
        c = self.costs
        dur = 0.0
        decode_ctx = []
        for r, n in batch:
            if r.prefilling:
                dur += c.prefill_s(n, r.computed)
                if rank.role == "prefill" and r.computed + n == r.call.input_tokens and r.call.output_tokens > 1:
                    dur += c.stage_s(r.call.input_tokens * c.kv_bytes_per_token)
            else:
                decode_ctx.append(r.call.input_tokens + r.generated)
        if decode_ctx:
            for r, n in batch:
                if not r.prefilling:
                    r.stall += dur  # the step's prompt chunks, paid by each of its decode rows
            dur += c.decode_s(len(decode_ctx), sum(decode_ctx) / len(decode_ctx))
        if self.cpu_cores is None:
            self._at(self.now + dur, self._step_end, rank, batch, rank.version)
            return
        rank.work, rank.since, rank.batch = dur, self.now, batch
        self._computing.append(rank)
        self._reshare()

    def _reshare(self) -> None:
        """Bring every computing rank's work up to date, set the speed the current number of
        computing ranks gets, and (re)schedule their step ends (older end events go stale)."""
        threads = getattr(self.costs, "threads", 1)
        speed = min(1.0, self.cpu_cores / (threads * len(self._computing))) if self._computing else 1.0
        for r in self._computing:
            r.work = max(0.0, r.work - (self.now - r.since) * r.speed)
            r.since, r.speed = self.now, speed
            r.version += 1
            self._at(self.now + r.work / speed, self._step_end, r, r.batch, r.version)

    def _step_end(self, rank: Rank, batch: list[tuple[Req, int]], version: int) -> None:
        if version != rank.version:
            return  # rescheduled by a reshare
        if self.cpu_cores is not None:
            self._computing.remove(rank)
            self._reshare()
        for r, n in batch:
            if r.prefilling:
                r.computed += n
                if r.prefilling:
                    continue
                r.generated, r.t_first = 1, self.now
                full = r.call.input_tokens // r.call.block_size
                rank.cache.update(r.keys[:full])
                if rank.role == "prefill" and r.call.output_tokens > 1:
                    rank.running.remove(r)
                    rank.inflight -= 1
                    self._handoff(r)
                elif r.call.output_tokens == 1:
                    self._finish(rank, r)
            else:
                r.generated += 1
                if r.generated == 2:
                    r.t_first_decode = self.now
                if r.generated == r.call.output_tokens:
                    self._finish(rank, r)
        rank.busy = False
        self._kick(rank)

    def _handoff(self, r: Req) -> None:
        d = r.decode_rank
        d.handoffs.append(r)
        self._pump(d)

    def _pump(self, d: Rank) -> None:
        """Start the next read when none runs and the rank has a sequence place."""
        if d.pulling or not d.handoffs or len(d.running) >= self.limits.max_num_seqs:
            return
        r = d.handoffs.popleft()
        d.pulling = True
        r.t_pull_start = self.now
        self._at(self.now + self.costs.transfer_s(r.call.input_tokens * self.costs.kv_bytes_per_token),
                 self._pulled, d, r)

    def _pulled(self, d: Rank, r: Req) -> None:
        d.pulling = False
        r.t_pull_end = self.now
        d.running.append(r)
        self._kick(d)
        self._pump(d)

    def _finish(self, rank: Rank, r: Req) -> None:
        rank.running.remove(r)
        rank.inflight -= 1
        if rank.role == "decode":
            self._pump(rank)
        if r.decode_rank is not None and rank.role != "decode":  # ended at its first token on a prefill rank
            r.decode_rank.inflight -= 1
        c = r.call
        if r.decode_rank is not None and rank.role == "decode":
            phases = {"prefill_wait": r.t_admit - r.arrival, "prefill": r.t_first - r.t_admit,
                      "admission_wait": r.t_pull_start - r.t_first, "transfer": r.t_pull_end - r.t_pull_start,
                      "first_decode": r.t_first_decode - r.t_pull_end, "decode": self.now - r.t_first_decode}
        else:
            phases = {"prefill_wait": r.t_admit - r.arrival, "prefill": r.t_first - r.t_admit,
                      "decode": self.now - r.t_first - r.stall, "prefill_stall": r.stall}
        if not r.warmup:
            self.results.append(RequestResult(r.arrival, r.t_first - r.arrival, self.now - r.arrival,
                                              c.input_tokens, c.output_tokens, r.cached, phases))
        r.on_done()


def simulate(split: Split, costs: StepCosts, sessions: list[Session], concurrency: int,
             limits: Limits = Limits(), duration_s: float | None = None,
             trajectory_start: tuple[float, float] | None = None, seed: int = 42,
             cpu_cores: float | None = None) -> list[RequestResult]:
    """Per-request results of `sessions` served by `split` (see the module docstring and
    Simulator)."""
    return Simulator(split, costs, sessions, concurrency, limits, duration_s, trajectory_start, seed,
                     cpu_cores).run()
