"""Workloads the simulator replays: aiperf `weka_trace` directories, or synthetic isl/osl.

A workload is a list of sessions; a session is a chain of items run one after another:
a `Call` (one chat completion: prompt and output tokens, the prompt's KV block hashes) after
an idle `delay_s`, or a `Fork` (subagents: child chains that run concurrently; the parent
goes on when all of them are done). This is how aiperf replays a weka trace (its loader,
aiperf/dataset/loader/weka_trace.py):
  * each trace file is one session; its requests go in order, each after the previous
    one completed plus the recorded idle gap, end to start: t_k - (t_{k-1} + api_time_{k-1}),
    at least 0 (think_time is not used by default, nor is any idle-gap cap applied here);
  * a `type: "subagent"` entry spawns its inner requests as a child chain at its `t`;
    consecutive entries run side by side; the parent's next request waits for all of them
    (its gap then counts from the subagents' recorded end, t + duration_ms);
  * hash_ids name the prompt's blocks of `block_size` tokens, scoped to the trace
    (hash_id_scope "local"): equal ids within a trace are a shared prefix, never across
    traces (aiperf also puts a per-session `[rid:...]` marker at the start of the prompt).
AgentX's trajectory start (aiperf --scenario inferencex-agentx-mvp: each of the first
trajectories entered at a random t* in [0, 1] of its recorded duration; the last call before
t* is sent with one output token as an unprofiled warm-up, earlier ones not at all; a
finished lane recycles into a fresh session from turn 0) is the simulator's
`trajectory_start` (`entered_at` below), from each Call's `t`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Call:
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    block_size: int = 16
    delay_s: float = 0.0  # idle time before it is sent, after what precedes it in its chain
    t: float = 0.0  # recorded start in the trace (s): where AgentX enters a session (entered_at below)
    warmup: bool = False  # sent unreported, to warm the cache (entered_at below)


@dataclass(frozen=True)
class Fork:
    chains: tuple[tuple["Call | Fork", ...], ...]
    delay_s: float = 0.0  # before the children start


Item = Call | Fork


@dataclass(frozen=True)
class Session:
    id: str
    items: tuple[Item, ...]

    def num_calls(self) -> int:
        return _count(self.items)

    def recorded_end(self) -> float:
        """The latest recorded start of any of its calls (s)."""
        return _last_t(self.items)


def _last_t(items) -> float:
    return max([i.t if isinstance(i, Call) else max([_last_t(c) for c in i.chains] or [0.0]) for i in items] or [0.0])


def _count(items) -> int:
    return sum(1 if isinstance(i, Call) else sum(_count(c) for c in i.chains) for i in items)


def synthetic(isl: int, osl: int, num_requests: int) -> list[Session]:
    """`num_requests` one-call sessions of isl prompt / osl output tokens, no shared prefix."""
    if isl < 1 or osl < 1 or num_requests < 1:
        raise ValueError("isl, osl and num_requests must be >= 1")
    return [Session(f"synthetic-{i}", (Call(isl, osl),)) for i in range(num_requests)]


def _gap(t: float, prev_end: float | None) -> float:
    return 0.0 if prev_end is None else max(0.0, t - prev_end)


def _end(req: dict) -> float:
    return float(req["t"]) + max(0.0, float(req.get("api_time") or 0.0))


def _chain(reqs: list[dict], block_size: int, prev_end: float | None) -> tuple[list[Item], float | None]:
    """Items of one request list, and the recorded end of its last item."""
    items: list[Item] = []
    i = 0
    while i < len(reqs):
        r = reqs[i]
        if r["type"] != "subagent":
            items.append(Call(int(r["in"]), max(1, int(r["out"])), tuple(int(h) for h in r.get("hash_ids", ())),
                              block_size, _gap(float(r["t"]), prev_end), float(r["t"])))
            prev_end = _end(r)
            i += 1
            continue
        group = []
        while i < len(reqs) and reqs[i]["type"] == "subagent":
            group.append(reqs[i])
            i += 1
        spawn = min(float(g["t"]) for g in group)
        chains, ends = [], []
        for g in group:
            inner = [dict(c, t=float(c["t"]) + float(g["t"]) if float(c["t"]) < float(g["t"]) else float(c["t"]))
                     for c in g["requests"]]  # relative child timestamps -> trace time (as aiperf does)
            child, child_end = _chain(inner, block_size, float(g["t"]))
            chains.append(tuple(child))
            dur = g.get("duration_ms")
            ends.append(float(g["t"]) + dur / 1000.0 if dur is not None else (child_end or float(g["t"])))
        items.append(Fork(tuple(chains), _gap(spawn, prev_end)))
        prev_end = max(ends)
    return items, prev_end


def load_trace_file(path: str | Path) -> Session | None:
    """The file's session; None for a JSON file that is not a trace (a manifest)."""
    d = json.loads(Path(path).read_text())
    if not isinstance(d, dict) or "requests" not in d:
        return None
    if d.get("hash_id_scope", "local") != "local":
        raise ValueError(f"{path}: only hash_id_scope 'local' is supported")
    items, _ = _chain(d["requests"], int(d["block_size"]), None)
    return Session(str(d["id"]), tuple(items))


def load_trace_dir(path: str | Path) -> list[Session]:
    """Every trace `*.json` in the directory (a single file also works), sorted by name;
    other JSON files (a manifest) are skipped."""
    p = Path(path)
    sessions = [s for f in (sorted(p.glob("*.json")) if p.is_dir() else [p]) if (s := load_trace_file(f))]
    if not sessions:
        raise ValueError(f"no weka trace files (*.json with 'requests') in {p}")
    return sessions


def entered_at(items: tuple[Item, ...], t_star: float) -> tuple[Item, ...]:
    """A session entered at t* as aiperf's AgentX replay does it: one warm-up call (the last
    top-level call recorded before t*, 1 output token: it puts the conversation's prefix in
    the cache; unreported), then the items from the first recorded at or after t* (its idle
    gap counted from t*). Items before it are not sent."""
    def start(item: Item) -> float:
        return item.t if isinstance(item, Call) else min((c[0].t for c in item.chains if c), default=0.0)
    k = next((i for i, it in enumerate(items) if start(it) >= t_star), len(items))
    if k == 0:
        return items
    warm = [it for it in items[:k] if isinstance(it, Call)]
    out: list[Item] = [replace(warm[-1], output_tokens=1, delay_s=0.0, warmup=True)] if warm else []
    if k < len(items):
        out.append(replace(items[k], delay_s=max(0.0, start(items[k]) - t_star)))
    return tuple(out) + items[k + 1:]
