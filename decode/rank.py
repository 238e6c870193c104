"""A rank process: one engine, driven by the router over ZeroMQ.

    python -m decode.rank --role colocated --index 0 --router-addr tcp://127.0.0.1:5555 [engine flags]

Request life cycle on a colocated rank:
  1. The IO thread (rank_link.py) receives Generate and puts it in the inbox.
  2. The engine thread admits it: SamplingParams from the message, engine.add_request().
     Invalid input (ValueError) goes back at once as RequestError(400); nothing is queued.
  3. engine.step() runs the running batch (chunked prefill, continuous batching); every
     output of the step becomes one TokenEvent, and the step's events one TokenBatch.
  4. The last event of a request carries finish_reason, usage and PhaseTimes; the engine
     has freed the request's pages and SWA slot by then.
  5. Abort (client gone) calls engine.abort(): idempotent, frees pages at once, sends nothing.
  6. An engine exception fails every request on the rank with RequestError(500), aborts
     them (pages freed) and the rank keeps serving.
The process exits when the router rejects it, asks it to, or goes silent (rank_link.py),
and on SIGTERM/SIGINT: nothing is left behind by a dead router.
Prefill-only and decode-only roles (KV handoff) arrive with the prefill/decode issue; the
role is carried in Hello already.
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

from decode.config import RankConfig
from decode.rank_link import RankLink
from pd_server.cli_args import add_dataclass_args, from_args
from pd_server.protocol import PROTOCOL_VERSION
from pd_server.protocol.rank_router import (Hello, PhaseTimes, RankStats, RequestError, TokenBatch,
                                            TokenEvent, TokenLogprob)
from pd_server.protocol.router_rank import Abort, Generate

log = logging.getLogger("decode.rank")

IDLE_WAIT_S = 0.05  # inbox wait when the engine has nothing to run


class RankLoop:
    """The engine thread: admits, steps, reports. Owns the engine; never shares it."""

    def __init__(self, engine) -> None:
        self.engine = engine
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
                         host_cache_hit_tokens=hc.get("hit_tokens", 0))

    def run(self, link: RankLink) -> None:
        """Serve until link.stopped is set."""
        self.link = link
        eng = self.engine
        while not link.stopped.is_set():
            self._admit(block=not eng.has_unfinished())
            if not eng.has_unfinished():
                self._stats = self._snapshot()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the rank
                log.exception("engine step failed")
                self._fail_all(f"engine failure on this rank: {type(e).__name__}: {e}")
                continue
            self.steps += 1
            if outs:
                link.send(TokenBatch([self._event(o) for o in outs], time.time()))
            self._stats = self._snapshot()

    def _admit(self, block: bool) -> None:
        try:
            msg = self.link.inbox.get(timeout=IDLE_WAIT_S) if block else self.link.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, Generate):
                self._generate(msg)
            elif isinstance(msg, Abort):
                if self.engine.abort(msg.request_id) is not None:
                    self._forget(msg.request_id)
            try:
                msg = self.link.inbox.get_nowait()
            except queue.Empty:
                return

    def _generate(self, msg: Generate) -> None:
        from engine.sampling_params import SamplingParams

        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
            self.engine.add_request(msg.request_id, msg.prompt_ids, params)
        except ValueError as e:
            self.link.send(RequestError(msg.request_id, 400, str(e)))
            return
        self._arrived[msg.request_id] = time.time()

    def _event(self, o) -> TokenEvent:
        rid = o.request_id
        now = time.time()
        first = self._first.setdefault(rid, now)
        times = None
        if o.finished:
            times = PhaseTimes(self._arrived.get(rid, now), first, now)
            self._forget(rid)
        lps = None
        if o.logprobs is not None:
            lps = [TokenLogprob(lp.token_id, lp.logprob, [(int(i), float(v)) for i, v in lp.top])
                   for lp in o.logprobs]
        return TokenEvent(rid, o.new_token_ids, o.text, o.finish_reason, o.stop_str, o.prompt_tokens,
                          o.completion_tokens, o.cached_tokens, lps, times)

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


def load_engine(engine_cfg, warmup: bool):
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_cfg)
    if warmup:
        # First steps pay one-off costs (kernel JIT, allocator growth): pay them before Hello.
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    return engine


def main(argv: list[str] | None = None) -> int:
    from engine.config import EngineConfig, add_cli_args, from_cli_args
    from engine.model_cache import served_name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, RankConfig)
    add_cli_args(ap, EngineConfig)
    args = ap.parse_args(argv)
    cfg = from_args(args, RankConfig)
    engine_cfg = from_cli_args(args, EngineConfig)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {cfg.name} %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    engine = load_engine(engine_cfg, cfg.warmup)
    log.info("engine ready in %.1fs (model %s, max_model_len %d, %d KV pages)", time.monotonic() - t0,
             engine_cfg.model, engine.max_model_len, engine.pool.num_pages)
    hello = Hello(PROTOCOL_VERSION, cfg.role, cfg.index, os.getpid(), served_name(engine_cfg.model),
                  engine.max_model_len, engine.model_cfg.vocab_size, engine_cfg.page_size, engine.pool.num_pages)
    loop = RankLoop(engine)
    link = RankLink(cfg, hello, loop.stats)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: link.stop(f"signal {signal.Signals(signum).name}"))
    link.start()
    try:
        loop.run(link)
    finally:
        link.close()
        close = getattr(engine, "close", None)  # releases the host cache's shared memory
        if close is not None:
            close()
        log.info("exiting: %s", link.stop_reason)
    return link.exit_code


if __name__ == "__main__":
    sys.exit(main())
