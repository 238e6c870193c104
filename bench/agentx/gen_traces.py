"""Synthetic AgentX traces in aiperf's `weka_trace` format, scaled to a small model and a CPU.

    python -m bench.agentx.gen_traces --out DIR [--traces 6] [--seed 42] [--max-context 3584]
        [--turns 6-14] [--tool-tokens-min 48] [--tool-tokens-max 640] [--out-tokens 16-96]
        [--subagent-prob 0.15] [--think-time 0.5-3] [--min-reuse 0.85] [--block-size 64]

Writes DIR/trace_000.json ... (one trace a file, what `aiperf profile --custom-dataset-type
weka_trace --input-file DIR` reads: every *.json there must be a trace) and DIR/manifest.jsonl
(one JSON line: the flags and per-trace stats).

The public AgentX corpora (SemiAnalysis cc-traces-weka: Claude Code sessions) are not
reachable here; their published shape is what these traces follow, scaled down:
  * one agent session per trace: a system + tools prefix (`system_tokens`, `tool_tokens`),
    a first user message, then turns that each append the previous answer and one tool
    result, so the context grows every turn and each prompt's head is the previous prompt
    (the reused prefix: >= --min-reuse of every prompt after the first; 85-97% in the corpus);
  * tool results of --tool-tokens-min..max tokens (log-uniform: mostly hundreds, a tail of
    large ones), capped so the reuse floor and --max-context hold;
  * short outputs (--out-tokens), `stop: "tool_use"` on every turn but the last (`end_turn`);
  * think-time gaps between a response and the next request (--think-time, seconds: tool
    execution on the client), and an `api_time` per request estimated for this CPU;
  * some turns (--subagent-prob) spawn a subagent (a `type: "subagent"` entry): its own
    smaller prefix and task prompt, a few turns of its own, and its result becomes the
    parent's next tool result; the parent's next request starts after the subagent ends.

Format (aiperf `dataset/loader/weka_trace_models.py`, `weka_synth_buf.py`): `hash_ids` lists
the ids of the prompt's full `block_size`-token blocks (floor(in / block_size) of them); the
same id is the same content anywhere in the trace (`hash_id_scope: "local"`: ids are scoped
to one trace, aiperf derives each block's tokens from the id and the trace id). The first
ceil((tool_tokens + system_tokens) / block_size) blocks of the first request are the system
message; a request extending the previous one keeps its whole `hash_ids` list as a prefix
(aiperf's chain detection links requests by that common prefix) and adds ids for the
answer and the tool result. Subagent requests take fresh ids (their own prefix) and carry
absolute timestamps (>= the entry's `t`). Timestamps: `t[k] = t[k-1] + api_time[k-1] +
think_time[k]`, which aiperf turns back into an end-to-start delay of `think_time`.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.agentx.aiperf_client import AIPERF_WEKA_BLOCK

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST = "manifest.jsonl"  # not *.json: aiperf reads every *.json in the directory as a trace
_TOOL_RESULT_FLOOR = 16  # a tool result is never smaller than this ("ok", an exit code)


@dataclass(frozen=True)
class GenConfig:
    traces: int = 6
    seed: int = 42
    max_context: int = 3584  # in + out of every request stays within this (tokens)
    turns: tuple[int, int] = (6, 14)  # main-agent requests per trace, before the context cap
    tool_tokens_min: int = 48  # tool result size range (tokens), log-uniform
    tool_tokens_max: int = 640
    out_tokens: tuple[int, int] = (16, 96)  # output tokens per request
    first_user_tokens: tuple[int, int] = (32, 192)
    system_tokens: int = 256  # the main agent's system prompt
    tool_def_tokens: int = 512  # its tool definitions (trace field `tool_tokens`)
    subagent_prob: float = 0.15  # per main turn (not the first or last)
    subagent_turns: tuple[int, int] = (2, 4)
    think_time: tuple[float, float] = (0.5, 3.0)  # seconds
    min_reuse: float = 0.85  # reused-prefix share floor of every prompt after a trace's first
    block_size: int = AIPERF_WEKA_BLOCK  # what aiperf reads a weka hash_id as, whatever a trace declares
    model: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        if self.traces < 1:
            raise ValueError("--traces must be >= 1")
        if not 1 <= self.turns[0] <= self.turns[1]:
            raise ValueError(f"--turns range {self.turns} must be 1 <= lo <= hi")
        if not 1 <= self.tool_tokens_min <= self.tool_tokens_max:
            raise ValueError("need 1 <= --tool-tokens-min <= --tool-tokens-max")
        if not 1 <= self.out_tokens[0] <= self.out_tokens[1]:
            raise ValueError(f"--out-tokens range {self.out_tokens} must be 1 <= lo <= hi")
        if not 0.0 <= self.subagent_prob <= 1.0:
            raise ValueError("--subagent-prob must be in [0, 1]")
        if not 0.0 <= self.min_reuse < 1.0:
            raise ValueError("--min-reuse must be in [0, 1)")
        if self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        first_peak = self.system_tokens + self.tool_def_tokens + self.first_user_tokens[1] + self.out_tokens[1]
        if first_peak > self.max_context:
            raise ValueError(f"--max-context {self.max_context} cannot hold a first request "
                             f"(prefix + first user message + output = up to {first_peak} tokens)")


class _Session:
    """One agent's growing context: token count, block ids, the clock."""

    def __init__(self, gen: "_TraceGen", prefix_tokens: int, user_tokens: int, t: float) -> None:
        self.gen = gen
        self.in_tokens = prefix_tokens + user_tokens
        self.hash_ids = gen.new_blocks(self.in_tokens // gen.cfg.block_size)
        self.t = t
        self.requests: list[dict] = []

    def request(self, out: int, stop: str, think: float | None) -> dict:
        cfg = self.gen.cfg
        prev_in = self.requests[-1]["in"] if self.requests else 0
        api = round(0.15 + 0.04 * out + 0.0004 * (self.in_tokens - prev_in), 3)  # seconds, this CPU
        req = {"t": round(self.t, 3), "type": "n", "model": cfg.model, "in": self.in_tokens, "out": out,
               "hash_ids": list(self.hash_ids), "stop": stop, "api_time": api, "think_time": think}
        self.requests.append(req)
        return req

    def room_for(self, out_prev: int) -> int:
        """Largest tool result the next request may append (reuse floor and context cap)."""
        cfg = self.gen.cfg
        reused = (self.in_tokens // cfg.block_size) * cfg.block_size
        by_reuse = math.floor(reused / cfg.min_reuse) if cfg.min_reuse > 0 else cfg.max_context
        by_context = cfg.max_context - cfg.out_tokens[1]
        return min(by_reuse, by_context) - self.in_tokens - out_prev

    def extend(self, out_prev: int, tool: int, t: float) -> None:
        """Next request's context (this prompt + the answer + a tool result), sent at `t`."""
        self.t = t
        self.in_tokens += out_prev + tool
        self.hash_ids += self.gen.new_blocks(self.in_tokens // self.gen.cfg.block_size - len(self.hash_ids))


class _TraceGen:
    def __init__(self, cfg: GenConfig, index: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(f"{cfg.seed}:{index}")
        self.next_block = 1  # hash ids are local to the trace
        self.trace_id = f"agentx-s{cfg.seed}-{index:03d}"
        self.subagents = 0

    def new_blocks(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def tool_result(self, room: int) -> int:
        lo, hi = self.cfg.tool_tokens_min, self.cfg.tool_tokens_max
        size = round(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        return max(_TOOL_RESULT_FLOOR, min(size, room))

    def run_agent(self, s: _Session, turns: int, main: bool) -> list[dict]:
        """`s`'s requests for up to `turns` turns (fewer when the context cap is reached), with
        subagent entries between them when `main`. Returns the entries in trace order."""
        cfg, rng = self.cfg, self.rng
        entries: list[dict] = []
        think: float | None = None
        for k in range(turns):
            out = rng.randint(*cfg.out_tokens)
            req = s.request(out, "tool_use", think)
            entries.append(req)
            room = s.room_for(out)
            if k == turns - 1 or room < _TOOL_RESULT_FLOOR:
                req["stop"] = "end_turn"
                break
            think = round(rng.uniform(*cfg.think_time), 3)
            resume = req["t"] + req["api_time"]
            if main and k > 0 and rng.random() < cfg.subagent_prob:
                # The agent waits for the subagent; its result is the next tool result.
                sub = self.subagent(spawn_t=resume)
                entries.append(sub)
                resume = sub["t"] + sub["duration_ms"] / 1000
            s.extend(out, self.tool_result(room), resume + think)
        return entries

    def trace(self) -> dict:
        cfg = self.cfg
        main = _Session(self, cfg.system_tokens + cfg.tool_def_tokens,
                        self.rng.randint(*cfg.first_user_tokens), 0.0)
        entries = self.run_agent(main, self.rng.randint(*cfg.turns), main=True)
        return {"id": self.trace_id, "models": [cfg.model], "block_size": cfg.block_size,
                "hash_id_scope": "local", "tool_tokens": cfg.tool_def_tokens,
                "system_tokens": cfg.system_tokens, "requests": entries, "totals": _totals(entries)}

    def subagent(self, spawn_t: float) -> dict:
        """A `type: "subagent"` entry: its own prefix (the main agent's sizes, fresh blocks: another
        system prompt and tool set), a task prompt, its turns."""
        cfg = self.cfg
        system, tools = cfg.system_tokens, cfg.tool_def_tokens
        s = _Session(self, system + tools, self.rng.randint(32, 128), spawn_t + 0.05)
        reqs = self.run_agent(s, self.rng.randint(*cfg.subagent_turns), main=False)
        end = reqs[-1]["t"] + reqs[-1]["api_time"]
        self.subagents += 1
        return {"t": round(spawn_t, 3), "type": "subagent", "agent_id": f"agent_{self.subagents:03d}",
                "subagent_type": "Explore", "duration_ms": int(math.ceil((end - spawn_t) * 1000)),
                "total_tokens": sum(r["in"] + r["out"] for r in reqs),
                "tool_use_count": sum(r["stop"] == "tool_use" for r in reqs), "status": "completed",
                "requests": reqs, "models": [cfg.model], "tool_tokens": tools, "system_tokens": system}


def _totals(entries: list[dict]) -> dict:
    reqs = [r for e in entries for r in (e["requests"] if e["type"] == "subagent" else [e])]
    return {"requests": len(reqs), "subagents": sum(e["type"] == "subagent" for e in entries),
            "input_tokens": sum(r["in"] for r in reqs), "output_tokens": sum(r["out"] for r in reqs),
            "peak_context": max(r["in"] + r["out"] for r in reqs)}


def agent_chains(trace: dict) -> list[list[dict]]:
    """The trace's request chains: the main agent's, then each subagent's."""
    main = [e for e in trace["requests"] if e["type"] != "subagent"]
    return [main] + [e["requests"] for e in trace["requests"] if e["type"] == "subagent"]


def reuse_ratios(trace: dict) -> list[float]:
    """Per request after each chain's first: share of the prompt that is the previous prompt's
    full blocks (what a prefix cache with this block size can serve)."""
    bs = trace["block_size"]
    out = []
    for chain in agent_chains(trace):
        for prev, cur in zip(chain, chain[1:]):
            common = 0
            for a, b in zip(prev["hash_ids"], cur["hash_ids"]):
                if a != b:
                    break
                common += 1
            out.append(common * bs / cur["in"])
    return out


def generate(cfg: GenConfig) -> list[dict]:
    """The traces for `cfg`; the same config gives the same traces."""
    return [_TraceGen(cfg, i).trace() for i in range(cfg.traces)]


def write(cfg: GenConfig, out_dir: Path) -> list[Path]:
    """Write trace_NNN.json (replacing any there) and manifest.jsonl into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("trace_*.json"):
        old.unlink()
    traces = generate(cfg)
    paths = []
    for i, trace in enumerate(traces):
        path = out_dir / f"trace_{i:03d}.json"
        path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
        paths.append(path)
    ratios = [r for t in traces for r in reuse_ratios(t)]
    manifest = {"config": asdict(cfg),
                "traces": {t["id"]: t["totals"] for t in traces},
                "mean_reuse": round(sum(ratios) / max(1, len(ratios)), 4),
                "min_reuse": round(min(ratios, default=0.0), 4)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest) + "\n")
    return paths


def _int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _float_range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> None:
    d = GenConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for trace_*.json")
    ap.add_argument("--traces", type=int, default=d.traces)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--max-context", type=int, default=d.max_context, help="tokens, in + out of any request")
    ap.add_argument("--turns", type=_int_range, default=d.turns, help="main-agent requests per trace, LO-HI")
    ap.add_argument("--tool-tokens-min", type=int, default=d.tool_tokens_min)
    ap.add_argument("--tool-tokens-max", type=int, default=d.tool_tokens_max)
    ap.add_argument("--out-tokens", type=_int_range, default=d.out_tokens, help="LO-HI")
    ap.add_argument("--first-user-tokens", type=_int_range, default=d.first_user_tokens, help="LO-HI")
    ap.add_argument("--system-tokens", type=int, default=d.system_tokens)
    ap.add_argument("--tool-def-tokens", type=int, default=d.tool_def_tokens, help="the trace's tool_tokens")
    ap.add_argument("--subagent-prob", type=float, default=d.subagent_prob)
    ap.add_argument("--subagent-turns", type=_int_range, default=d.subagent_turns, help="LO-HI")
    ap.add_argument("--think-time", type=_float_range, default=d.think_time, help="seconds, LO-HI")
    ap.add_argument("--min-reuse", type=float, default=d.min_reuse)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--model", default=d.model, help="model name recorded in the traces")
    a = vars(ap.parse_args(argv))
    out_dir = a.pop("out")
    cfg = GenConfig(**a)
    if cfg.block_size != AIPERF_WEKA_BLOCK:
        print(f"warning: --block-size {cfg.block_size}: aiperf's weka_trace loader reads hash_ids as "
              f"{AIPERF_WEKA_BLOCK}-token blocks, so it will not replay these prompts at their sizes "
              "(agentx_compare.sh refuses them)", file=sys.stderr)
    paths = write(cfg, out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text())
    n_req = sum(t["requests"] for t in manifest["traces"].values())
    n_sub = sum(t["subagents"] for t in manifest["traces"].values())
    print(f"wrote {len(paths)} traces to {out_dir}: {n_req} requests, {n_sub} subagents, "
          f"mean prefix reuse {manifest['mean_reuse']:.3f} (min {manifest['min_reuse']:.3f})")


if __name__ == "__main__":
    main()
