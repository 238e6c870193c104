"""The simulator's per-request and per-rank state (bench/pdtune/sim.py drives both)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.pdtune.workload import Call


@dataclass(eq=False)
class Req:
    call: Call
    keys: tuple  # per prompt block: (session instance, hash id)
    arrival: float
    on_done: Callable[[], None]
    cached: int = 0
    computed: int = 0
    generated: int = 0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_pull_start: float = 0.0
    t_pull_end: float = 0.0
    t_first_decode: float = 0.0
    stall: float = 0.0  # decode time spent in steps' prompt chunks (colocated: a chunk stalls decode)
    decode_rank: Rank | None = None  # PD with a handoff
    warmup: bool = False  # an AgentX warm-up call (entered_at): served, not reported
    prefill_est: float = 0.0  # +cond: its estimated prefill seconds where it was placed (the router's queue)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.call.input_tokens


@dataclass(eq=False)
class Rank:
    name: str
    role: str  # colocated | prefill | decode
    index: int
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cache: set = field(default_factory=set)
    busy: bool = False  # a step is scheduled or running
    work: float = 0.0  # CPU sharing: seconds of the running step left at full speed
    speed: float = 1.0
    since: float = 0.0  # when `work` was last brought up to date
    version: int = 0  # the running step's end event carries it; a reshare invalidates older ones
    batch: list = field(default_factory=list)  # the running step's (request, tokens)
    inflight: int = 0
    routed: int = 0
    handoffs: deque = field(default_factory=deque)
    pulling: bool = False
