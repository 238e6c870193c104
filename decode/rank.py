"""A rank process: one engine, driven by the router over ZeroMQ; colocated or decode-only.

    python -m decode.rank --role colocated|decode --index 0 --router-addr tcp://127.0.0.1:5555 [flags]

Request life cycle on a colocated rank:
  1. The IO thread (rank_link.py) receives Generate and puts it in the inbox.
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
On a decode rank (PD mode) requests arrive as Handoffs from prefill ranks: handoff_receiver.py
queues them, pulls their KV when the engine has room and commits them (its docstring has the
steps); then steps 3-6 apply, the prefill rank's phase times and the pull's carried into the
last event. A Generate (decode_rank -1: the router's --disagg placed the prompt here) runs steps
1-6 as on a colocated rank, its chunks in the same steps as the handed-off decodes.
The prefill role is prefill/rank.py.
The process exits when the router rejects it, asks it to, or goes silent (rank_link.py),
and on SIGTERM/SIGINT: nothing is left behind by a dead router. With --rejoin it drops every
request instead when the router goes away (RouterLost) and joins the next router as a fresh rank.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import time

import msgspec

from decode.config import HandoffConfig, RankConfig
from decode.faults import FAULT_ENV, faults_for
from decode.peer_link import PeerMessage, PeerSockets
from decode.rank_link import RankLink, RouterLost
from decode.rank_setup import load_engine, make_transfer
from pd_server.cli_args import add_dataclass_args, from_args
from pd_server.protocol import PROTOCOL_VERSION
from pd_server.protocol.prefill_decode import PAGES_REGION, STATES_REGION, Handoff, PeerHello
from pd_server.protocol.rank_router import (CacheEvents, CacheUpdate, Hello, PhaseTimes, RankStats, RequestError,
                                            TokenBatch, TokenEvent, TokenLogprob)
from pd_server.protocol.router_rank import Abort, Generate, Peers

log = logging.getLogger("decode.rank")

IDLE_WAIT_S = 0.25  # inbox wait when the engine has nothing to run (why so long: rank_link.Wake)
# After shipping a request's first token, the engine thread sleeps this long before its next step
# when it has one: with every core running this rank's step threads, the token otherwise waits
# for a core to get out (this process's IO thread, then the router's loop). Measured, colocated
# on 2 cores: time to first token of a 670-token prompt 8 ms longer when the request went on
# decoding than when it stopped at that token, the same with this yield.
FIRST_TOKEN_YIELD_S = 0.001
PULL_POLL_S = 0.001  # inbox wait while only transfers are in flight


class RankLoop:
    """The engine thread: admits, steps, reports. Owns the engine; never shares it.

    Roles extend it through `_on_message`, `_progress`, `_wait_s`, `_times` and `_extra_stats`.
    """

    ships_cache_events = True  # the router routes prompts here by what this host cache holds

    def __init__(self, engine) -> None:
        self.engine = engine
        self.board = None  # a decode.core_board.CoreBoard: idle cores of this host's ranks, lent per step
        self._cache = getattr(engine, "hicache", None) if self.ships_cache_events else None
        if self._cache is not None:
            self._cache.record_events = True
        self.link: RankLink | None = None
        self.steps = 0
        self._arrived: dict[str, float] = {}  # request id -> rank wall clock at arrival
        self._first: dict[str, float] = {}  # request id -> first token time
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
                         host_cache_hit_tokens=hc.get("hit_tokens", 0), **self._extra_stats())

    def _extra_stats(self) -> dict:
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
        self._admit(self._wait_s())
        self._progress()
        if not eng.has_unfinished():
            self._stats = self._snapshot()
            return
        if self.board is not None:  # (a step of many rows takes idle peers' cores before they settle)
            rows, b = eng.next_step_rows(), self.board  # (something runs: has_unfinished)
            b.busy(rows <= b.invariant_rows, rows > b.eager_rows)
        try:
            outs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep the rank
            log.exception("engine step failed")
            self._fail_all(f"engine failure on this rank: {type(e).__name__}: {e}")
            return
        self.steps += 1
        self._ship_cache_events()  # before the tokens: a client's next turn finds the index current
        self._on_outputs(outs)
        try:  # running prompts' pages to the host cache, once their tokens have left
            eng.flush_write_through()
        except Exception:  # noqa: BLE001 - the cache misses those pages; the requests go on
            log.exception("host cache write-through failed")
        self._ship_cache_events()
        self._stats = self._snapshot()

    def _wait_s(self) -> float:
        """How long the loop may wait for a message (0: there is work)."""
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def _progress(self) -> None:
        """Role work between steps (transfers, leases, held-back admissions)."""

    def _ship_cache_events(self) -> None:
        if self._cache is not None:
            events = self._cache.drain_events()
            if events:
                self.link.send(CacheEvents([CacheUpdate(e.kind, list(e.keys)) for e in events]))

    def _on_outputs(self, outs) -> None:
        if outs:
            events = [self._event(o) for o in outs]
            self.link.send(TokenBatch(events, time.time()))
            self._yield_after_first(events)

    def _yield_after_first(self, events: list[TokenEvent]) -> None:
        """Let a first token leave before the next step takes the cores (FIRST_TOKEN_YIELD_S)."""
        if self.engine.has_unfinished() and any(e.completion_tokens == len(e.token_ids) for e in events):
            time.sleep(FIRST_TOKEN_YIELD_S)

    def _admit(self, wait_s: float) -> None:
        try:
            msg = self.link.inbox.get(timeout=wait_s) if wait_s > 0 else self.link.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, RouterLost):
                self._drop_all(msg.reason)
            else:
                self._on_message(msg)
            try:
                msg = self.link.inbox.get_nowait()
            except queue.Empty:
                return

    def _on_message(self, msg) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)

    def _abort(self, rid: str) -> None:
        if self.engine.abort(rid) is not None:
            self._forget(rid)

    def _drop_all(self, why: str) -> None:
        """The router is gone (RouterLost): end every request here, telling no one (no router
        awaits them); roles also drop what they hold outside the engine."""
        rids = list(self.engine.seqs)
        for rid in rids:
            self._abort(rid)
        log.warning("dropped %d request(s): %s", len(rids), why)

    def _generate(self, msg: Generate) -> None:
        from engine.sampling_params import SamplingParams

        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
            self.engine.add_request(msg.request_id, msg.prompt_ids, params, output_ids=msg.resume_ids)
        except ValueError as e:
            self.link.send(RequestError(msg.request_id, 400, str(e)))
            return
        self._arrived[msg.request_id] = time.time()

    def _event(self, o) -> TokenEvent:
        rid = o.request_id
        now = time.time()
        times = None
        if o.finished:
            times = self._times(rid, now)
            self._forget(rid)
        else:
            self._first.setdefault(rid, now)
        lps = None
        if o.logprobs is not None:
            lps = [TokenLogprob(lp.token_id, lp.logprob, [(int(i), float(v)) for i, v in lp.top])
                   for lp in o.logprobs]
        return TokenEvent(rid, o.new_token_ids, o.text, o.finish_reason, o.stop_str, o.prompt_tokens,
                          o.completion_tokens, o.cached_tokens, lps, times)

    def _times(self, rid: str, now: float) -> PhaseTimes:
        arrived = self._arrived.get(rid, now)
        return PhaseTimes(arrived, self._first.get(rid, now), now, prefill_start=arrived)

    def _forget(self, rid: str) -> None:
        self._arrived.pop(rid, None)
        self._first.pop(rid, None)

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.seqs):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already failing; free what we can
                log.exception("abort of %s failed", rid)
            self._forget(rid)
            self.link.send(RequestError(rid, 500, message))


class DecodeLoop(RankLoop):
    """Decode rank: requests arrive as Handoffs, their KV pulled by a HandoffReceiver, or as a
    Generate the rank prefills itself (conditional disaggregation, pd_server/disagg.py)."""

    def __init__(self, engine, backend, name: str, wait_s: float, delay_pull_s: float = 0.0) -> None:
        from decode.handoff_receiver import HandoffReceiver

        self.receiver = HandoffReceiver(engine, backend, name, wait_s,
                                        send_peer=lambda dest, msg: self.link.send_peer(dest, msg),
                                        send_router=lambda msg: self.link.send(msg), delay_pull_s=delay_pull_s)
        self._pd: dict = {}  # request id -> handoff_receiver.Committed
        super().__init__(engine)

    def _extra_stats(self) -> dict:
        r = self.receiver
        return {"handoffs": r.num_handoffs, "transfer_bytes": r.transfer_bytes,
                "transfer_seconds": r.transfer_seconds}

    def _wait_s(self) -> float:
        if self.engine.has_unfinished():
            return 0.0
        return PULL_POLL_S if self.receiver.num_handoffs else IDLE_WAIT_S

    def _on_message(self, msg) -> None:
        r = self.receiver
        if isinstance(msg, PeerMessage):
            if isinstance(msg.msg, Handoff):
                r.on_handoff(msg.sender, msg.msg, msg.received)
            elif isinstance(msg.msg, PeerHello):
                r.on_peer_hello(msg.sender, msg.msg)
        elif isinstance(msg, Abort):
            if not r.on_abort(msg.request_id):
                self._abort(msg.request_id)
        elif isinstance(msg, Peers):
            r.on_live_prefill({p.name for p in msg.peers if p.role == "prefill"})
        elif isinstance(msg, Generate):
            if msg.decode_rank >= 0:
                self.link.send(RequestError(msg.request_id, 500, "a decode rank prefills a Generate itself: it "
                                                                 "hands nothing off (decode_rank must be -1)"))
            elif r.holds(msg.request_id):
                self.link.send(RequestError(msg.request_id, 500, "request id already on this decode rank"))
            else:
                self._generate(msg)

    def _drop_all(self, why: str) -> None:
        self.receiver.drop_all(why)
        super()._drop_all(why)

    def _progress(self) -> None:
        for c in self.receiver.progress():
            self._pd[c.request_id] = c

    def _times(self, rid: str, now: float) -> PhaseTimes:
        c = self._pd.get(rid)
        if c is None:
            return super()._times(rid, now)
        p = c.prefill
        return PhaseTimes(p.arrived, p.first_token, now, p.prefill_start, p.handoff_sent, c.pull_start,
                          c.pull_end, self._first.get(rid, now))

    def _forget(self, rid: str) -> None:
        super()._forget(rid)
        self._pd.pop(rid, None)


def hello_for(cfg: RankConfig, engine_cfg, engine, peer_addr: str = "") -> Hello:
    from engine.model_cache import served_name

    hc = engine.hicache  # a decode rank's holds the prompts it prefilled itself (--disagg)
    return Hello(PROTOCOL_VERSION, cfg.role, cfg.index, os.getpid(), served_name(engine_cfg.model),
                 engine.max_model_len, engine.model_cfg.vocab_size, engine_cfg.page_size, engine.pool.num_pages,
                 peer_addr, hc.index.root if hc else b"", hc.has_swa if hc else False, node_name())


def node_name() -> str:
    """This rank's host for /health: $PDSERVE_NODE (set by a Ray actor: host, IP, node id), else the hostname."""
    import socket

    return os.environ.get("PDSERVE_NODE") or socket.gethostname()


def parse_rank_args(argv, description: str, default_role: str):
    """(RankConfig, HandoffConfig, EngineConfig) from the command line; sets up logging."""
    from engine.config import EngineConfig, add_cli_args, from_cli_args

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, RankConfig)
    add_dataclass_args(ap, HandoffConfig)
    add_cli_args(ap, EngineConfig)
    ap.set_defaults(role=default_role)
    args = ap.parse_args(argv)
    cfg = from_args(args, RankConfig)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {cfg.name} %(levelname)s %(name)s: %(message)s")
    return cfg, from_args(args, HandoffConfig), from_cli_args(args, EngineConfig)


def serve(cfg: RankConfig, engine, loop: RankLoop, link: RankLink, closers=()) -> int:
    """Run `loop` on this thread with `link` on its IO thread until the rank must exit."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: link.stop(f"signal {signal.Signals(signum).name}"))
    if faults_for(cfg.name).hang_before_hello:
        log.warning("fault injected (%s): never saying Hello", FAULT_ENV)
        while not link.stopped.wait(0.2):
            pass
    from decode.core_board import host_cpus, pin_threads

    host = host_cpus()  # the launcher's cpuset, before this rank narrows to its own cores
    if cfg.cpu_list:
        pin_threads(cfg.cpu_list)
        log.info("pinned to cpu(s) %s of %s", cfg.cpus, ",".join(map(str, host)))
    if cfg.core_board:
        import torch

        from decode.core_board import CoreBoard

        # Only the bf16 kernels are thread-count invariant: an fp32 model lends nothing by default.
        loop.board = CoreBoard(cfg.core_board, cfg.core_slot, torch.get_num_threads(), lend_all=cfg.lend_all,
                               bf16=engine is None or engine.cfg.dtype == "bfloat16", home=cfg.cpu_list,
                               host=host)
        if engine is not None:
            engine.runner.model.between_layers = loop.board.recheck
        closers = (*closers, loop.board.close)
        log.info("core board %s slot %d: %d own thread(s), up to %d on cores no other rank holds, for %s",
                 cfg.core_board, cfg.core_slot, loop.board.own, loop.board.max,
                 "every step" if cfg.lend_all or loop.board.invariant_rows == sys.maxsize
                 else f"steps of at most {loop.board.invariant_rows} rows")
    link.start()
    try:
        loop.run(link)
    finally:
        link.close()
        for close in (*closers, getattr(engine, "close", None)):  # engine: the host cache's shm
            if close is not None:
                close()
        log.info("exiting: %s", link.stop_reason)
    return link.exit_code


def main(argv: list[str] | None = None) -> int:
    cfg, handoff, engine_cfg = parse_rank_args(argv, __doc__, "colocated")
    if cfg.role == "prefill":
        from prefill.rank import main as prefill_main

        return prefill_main(argv)
    t0 = time.monotonic()
    engine = load_engine(engine_cfg, cfg.warmup)
    log.info("engine ready in %.1fs (model %s, max_model_len %d, %d KV pages)", time.monotonic() - t0,
             engine_cfg.model, engine.max_model_len, engine.pool.num_pages)
    if cfg.role == "colocated":
        loop = RankLoop(engine)
        return serve(cfg, engine, loop, RankLink(cfg, hello_for(cfg, engine_cfg, engine), loop.stats))
    backend = make_transfer(handoff, cfg)
    pool = engine.pool
    backend.register(PAGES_REGION, pool.full, pool.full[0].numel() * pool.full.element_size())
    if pool.num_slots:
        backend.register(STATES_REGION, pool.swa, pool.swa[0].numel() * pool.swa.element_size())
    peers = PeerSockets("decode", cfg.name, cfg.host, secret=cfg.secret)
    loop = DecodeLoop(engine, backend, cfg.name, handoff.handoff_wait_s, faults_for(cfg.name).delay_pull_s)
    link = RankLink(cfg, hello_for(cfg, engine_cfg, engine, peers.addr), loop.stats, peers)
    log.info("decode rank: peer socket %s, transfer %s", peers.addr, backend.kind)
    return serve(cfg, engine, loop, link, closers=(backend.close,))


if __name__ == "__main__":
    sys.exit(main())
