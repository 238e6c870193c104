"""A stand-in rank: speaks the real router link, runs no model, emits tokens as fast as it can.

    python -m rank_runtime.fake_rank --router-addr tcp://127.0.0.1:P [--index i] [--step-ms 0] [--model NAME]

For bench/bench_router.py (router overhead without engine time) and router tests that need
no model. Each step gives every active request one token (id 100 + step % 100); a token's
text is the rank's wall clock when it was sent ("1712345678.123456 "), so a client can
measure the latency the router adds to each token. A request finishes with "length" at
max_tokens; an abort drops it. Stats report one KV page per active request.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import time
from dataclasses import dataclass

from cluster.cli_args import add_dataclass_args, from_args, opt
from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello, PhaseTimes, RankStats, TokenBatch, TokenEvent
from cluster.protocol.router_rank import Abort, Generate
from rank_runtime.config import RankConfig
from rank_runtime.router_link import RankLink
from rank_runtime.serve import serve

log = logging.getLogger("rank_runtime.fake_rank")


@dataclass(frozen=True)
class FakeConfig:
    model: str = opt("smollm2-135m-instruct", "served model name to report in Hello")
    step_ms: float = opt(0.0, "pause between steps (0: as fast as possible)")
    max_model_len: int = opt(0, "context to report (0: 8192)")
    vocab_size: int = opt(49152, "vocabulary size to report")
    pages_total: int = opt(4096, "KV pages to report")


@dataclass
class _Active:
    max_tokens: int
    prompt_tokens: int
    arrived: float
    produced: int = 0
    first: float = 0.0


class FakeLoop:
    def __init__(self, cfg: FakeConfig) -> None:
        self.cfg = cfg
        self.active: dict[str, _Active] = {}
        self.steps = 0
        self._stats = self._snapshot()

    def stats(self) -> RankStats:
        return self._stats

    def _snapshot(self) -> RankStats:
        n = len(self.active)
        return RankStats(running=n, waiting=0, pages_used=n, pages_total=self.cfg.pages_total, swa_slots_free=0,
                         steps=self.steps)

    def run(self, link: RankLink) -> None:
        while not link.stopped.is_set():
            self._admit(link, block=not self.active)
            if self.active:
                self._step(link)
                if self.cfg.step_ms:
                    time.sleep(self.cfg.step_ms / 1000)
            self._stats = self._snapshot()

    def _admit(self, link: RankLink, block: bool) -> None:
        while True:
            try:
                msg = link.inbox.get(timeout=0.05) if block else link.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(msg, Generate):
                a = self.active[msg.request_id] = _Active(msg.sampling.max_tokens, len(msg.prompt_ids), time.time())
                a.produced = len(msg.resume_ids)  # a request moved here goes on counting
            elif isinstance(msg, Abort):
                self.active.pop(msg.request_id, None)

    def _step(self, link: RankLink) -> None:
        self.steps += 1
        now = time.time()
        text, tok = f"{now:.6f} ", 100 + self.steps % 100
        events = []
        for rid, a in list(self.active.items()):
            a.produced += 1
            a.first = a.first or now
            done = a.produced >= a.max_tokens
            events.append(TokenEvent(rid, [tok], text, "length" if done else None, None, a.prompt_tokens,
                                     a.produced, 0, None, PhaseTimes(a.arrived, a.first, now) if done else None))
            if done:
                del self.active[rid]
        link.send(TokenBatch(events, now))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(ap, RankConfig)
    add_dataclass_args(ap, FakeConfig)
    args, _ = ap.parse_known_args(argv)  # engine flags from the launcher do not apply here
    cfg, fake = from_args(args, RankConfig), from_args(args, FakeConfig)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s fake-{cfg.name} %(levelname)s: %(message)s")
    hello = Hello(PROTOCOL_VERSION, cfg.role, cfg.index, os.getpid(), fake.model, fake.max_model_len or 8192,
                  fake.vocab_size, 16, fake.pages_total)
    loop = FakeLoop(fake)
    return serve(cfg, None, loop, RankLink(cfg, hello, loop.stats))


if __name__ == "__main__":
    sys.exit(main())
