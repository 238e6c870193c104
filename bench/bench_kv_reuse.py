"""Multi-turn agent sessions whose working set is many times the host caches: where KV is
computed again, and what each cache tier saves (issue: KV computed once per cluster).

    .venv/bin/python -m bench.bench_kv_reuse --configs 2P2D,colocated-2 \
        [--config NAME='pd_start flags' ...] [--sessions 96] [--alive 48] [--concurrency 8] [--duration-s 300] \
        [--turns 12] [--system-tokens 1024] [--turn-tokens 320] [--output-tokens 32] [--think-s 2] [--max-prompt 7000] \
        [--repeats 1] [--seed 0] [--port 8000] [--out runs/kv-reuse-<time>]

Each configuration is started as a user starts it (scripts/pd_start.sh, bench/mission/servers.py),
then replays the same sessions (same seed), one after another:
  - a session is an agent's conversation: one of 4 shared system prompts (an agent type),
    then turns; turn t's prompt is turn t-1's prompt plus that turn's answer (the trace's, as
    aiperf replays a trace: synthetic tokens, not the model's) plus a new tool result; every
    request asks for --output-tokens greedy tokens (ignore_eos). --alive sessions are open at
    once, each thinking --think-s (exponential) between its turns, at most --concurrency
    requests in flight (the rest queue in the client); a finished or context-full session is
    replaced by the next of --sessions (then they start over, as new plays with a new task),
    and the run ends at --duration-s (the turns in flight finish). With many sessions alive the
    prefixes the turns reuse are many times what the host caches hold.
  - prompts are token ids (/v1/completions), so the reuse ceiling is exact: for each request,
    the longest prefix of whole pages (16 tokens) that some earlier request's prompt shared,
    over all prompt tokens sent (what a cache of unbounded size with no eviction would hit).
  - reported per configuration (median over --repeats): output tok/s, TTFT p50/p99, the prompt
    tokens the ranks served from cache (usage cached_tokens) against the ceiling, the hit by
    tier (host caches, the L3 store: the ranks' counters in /metrics), and the KV bytes a
    decode rank pulled per request (PD).
The working set (sessions x their last prompt) is printed against the host caches' total.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.mission import servers
from bench.mission.configs import baseline_configs, parse_configs

PAGE = 16
AGENT_TYPES = 4
VOCAB_LO, VOCAB_HI = 1000, 40000  # ordinary word-piece ids of SmolLM2's vocabulary


@dataclass(frozen=True)
class Workload:
    sessions: int = 96
    alive: int = 48
    concurrency: int = 8
    duration_s: float = 300.0
    turns: int = 12
    system_tokens: int = 1024
    turn_tokens: int = 320
    output_tokens: int = 32
    think_s: float = 2.0
    max_prompt: int = 7000  # below SmolLM2's 8192 context, with room for the answer
    seed: int = 0

    def session_prompts(self, i: int, play: int = 0) -> list[list[int]]:
        """Session i's prompts, turn by turn (the same for every configuration); a later play
        of it has the same agent prompt and a new task."""
        rng = random.Random((self.seed * 1_000_003 + i) * 1009 + play)
        agent = random.Random(self.seed * 7919 + i % AGENT_TYPES)
        prompt = [agent.randrange(VOCAB_LO, VOCAB_HI) for _ in range(self.system_tokens)]
        prompt += [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(self.turn_tokens)]  # the task
        out = []
        for _ in range(self.turns):
            if len(prompt) > self.max_prompt:
                break
            out.append(list(prompt))
            answer = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(self.output_tokens)]
            result = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(self.turn_tokens // 2,
                                                                                  self.turn_tokens * 3 // 2))]
            prompt = prompt + answer + result
        return out


@dataclass
class Sent:
    session: int
    turn: int
    prompt_tokens: int
    ceiling_tokens: int  # page-aligned prefix an earlier request's prompt shared
    cached_tokens: int = 0
    ttft_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


# The turns in flight at --duration-s get this long to finish; past it the replay ends and counts
# them as errors (a rank that died at start, or a stuck request, cannot hold the run forever).
END_GRACE_S = 300.0


class Ceiling:
    """Which page prefixes were sent before (chain of page hashes)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, prompt: list[int]) -> int:
        hit, h, still = 0, 0, True
        for p in range(len(prompt) // PAGE):
            h = hash((h, tuple(prompt[p * PAGE:(p + 1) * PAGE])))
            if still and h in self.seen:
                hit = (p + 1) * PAGE
            else:
                still = False
            self.seen.add(h)
        return min(hit, (len(prompt) - 1) // PAGE * PAGE)  # a cache leaves one token to compute


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], w: Workload, rec: Sent) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": w.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") and not rec.ttft_s:
                    rec.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage["completion_tokens"]
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:  # (replay's end: END_GRACE_S)
        rec.error = f"unfinished {END_GRACE_S:.0f} s after the run's end"
        raise


async def replay(url: str, model: str, w: Workload, transport=None) -> tuple[list[Sent], float]:
    ceiling = Ceiling()
    sent: list[Sent] = []
    deadline = time.monotonic() + w.duration_s
    next_session = 0
    lock = asyncio.Lock()
    limits = httpx.Limits(max_connections=w.concurrency * 2)
    in_flight = asyncio.Semaphore(w.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=w.duration_s + END_GRACE_S, limits=limits,
                                 transport=transport) as http:

        async def session_slot(slot: int) -> None:
            nonlocal next_session
            rng = random.Random(w.seed * 31 + slot)
            await asyncio.sleep(rng.uniform(0, w.think_s))  # (the sessions do not all start at once)
            while time.monotonic() < deadline:
                async with lock:
                    i, next_session = next_session, next_session + 1
                for t, prompt in enumerate(w.session_prompts(i % w.sessions, play=i // w.sessions)):
                    if time.monotonic() >= deadline:
                        return
                    async with in_flight:
                        rec = Sent(i, t, len(prompt), ceiling.add(prompt))
                        sent.append(rec)
                        await one_request(http, model, prompt, w, rec)
                    await asyncio.sleep(rng.expovariate(1 / w.think_s) if w.think_s else 0)

        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*(session_slot(s) for s in range(w.alive))),
                                   w.duration_s + END_GRACE_S)
        except asyncio.TimeoutError:
            pass  # (one_request marked what was cut)
        return sent, time.monotonic() - start


def scrape(url: str) -> dict[str, float]:
    """Summed rank counters from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("pdserve_rank_host_cache_lookup_tokens", "pdserve_rank_host_cache_hit_tokens",
                 "pdserve_rank_kv_store_hit_tokens", "pdserve_rank_transfer_bytes"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M))
    return out


@dataclass
class Result:
    config: str
    requests: int
    errors: int
    out_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ceiling: float  # reuse ceiling: share of prompt tokens an unbounded cache could serve
    cached: float  # share the ranks served from cache
    host_hit: float  # of prompt tokens, served by host caches (from the ranks' counters)
    l3_hit: float  # of prompt tokens, read from the L3 store
    kv_mb_per_request: float  # PD: bytes decode ranks pulled per request
    wall_s: float
    extra: dict = field(default_factory=dict)


def summarize(name: str, sent: list[Sent], wall: float, before: dict, after: dict) -> Result:
    ok = [s for s in sent if not s.error and s.ttft_s]
    prompt = sum(s.prompt_tokens for s in ok) or 1
    ttft = sorted(s.ttft_s for s in ok) or [0.0]
    d = {k: after[k] - before[k] for k in after}
    lookups = d["pdserve_rank_host_cache_lookup_tokens"] or 1
    return Result(
        name, len(sent), len(sent) - len(ok), sum(s.output_tokens for s in ok) / wall,
        statistics.median(ttft) * 1e3, ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
        sum(s.ceiling_tokens for s in ok) / prompt, sum(s.cached_tokens for s in ok) / prompt,
        (d["pdserve_rank_host_cache_hit_tokens"] - d["pdserve_rank_kv_store_hit_tokens"]) / lookups,
        d["pdserve_rank_kv_store_hit_tokens"] / lookups,
        d["pdserve_rank_transfer_bytes"] / max(len(ok), 1) / 2**20, wall)


def measure(url: str, model: str, w: Workload) -> dict:
    """One replay against a running server, as a mission-report load (bench/mission/table.py):
    client numbers, the cached share as its prefix hit, and this benchmark's own result."""
    before = scrape(url)
    sent, wall = asyncio.run(replay(url, model, w))
    r = summarize("", sent, wall, before, scrape(url))
    return {"client": {"output_tok_s": r.out_tok_s, "ttft_ms": {"p50": r.ttft_p50_ms, "p99": r.ttft_p99_ms},
                       "requests": r.requests, "errors": r.errors},
            "server": {"prefix_hit_rate": r.cached}, "kv_reuse": asdict(r)}


def table(rows: list[Result]) -> str:
    head = ("| config | requests (errors) | out tok/s | TTFT p50 ms | TTFT p99 ms | reuse ceiling | cached "
            "| host hit | L3 hit | KV MiB pulled / request |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.config} | {r.requests} ({r.errors}) | {r.out_tok_s:.1f} | {r.ttft_p50_ms:.0f} | "
                     f"{r.ttft_p99_ms:.0f} | {r.ceiling:.1%} | {r.cached:.1%} | {r.host_hit:.1%} | {r.l3_hit:.1%} | "
                     f"{r.kv_mb_per_request:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="2P2D,colocated-2")
    ap.add_argument("--config", action="append", default=[], metavar="NAME='FLAGS'")
    for f in Workload.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=f.default)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--baseline", default="", metavar="DIR:NAME,NAME",
                    help="also run these configs from another checkout (a `git worktree` of an earlier "
                         "commit whose .venv links to this one's), named NAME@base: a before/after in one run")
    a = ap.parse_args(argv)
    w = Workload(**{k: getattr(a, k) for k in Workload.__dataclass_fields__})
    configs = parse_configs(a.configs, a.config) + (baseline_configs(a.baseline) if a.baseline else [])
    out = Path(a.out or f"runs/kv-reuse-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    last = [w.session_prompts(i)[-1] for i in range(w.sessions)]
    print(f"workload: {asdict(w)}; working set {sum(map(len, last))} tokens "
          f"({sum(map(len, last)) / w.sessions:.0f} a session at its last turn)", flush=True)
    results: dict[str, list[Result]] = {c.name: [] for c in configs}
    for rep in range(a.repeats):
        for cfg in configs:
            server = servers.make(cfg, a.port, a.model, out / f"{cfg.name}-{rep}")
            try:
                startup = server.start(900)
                model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
                before = scrape(server.url)
                sent, wall = asyncio.run(replay(server.url, model, w))
                res = summarize(cfg.name, sent, wall, before, scrape(server.url))
                res.extra = {"startup_s": startup}
                results[cfg.name].append(res)
                (out / f"{cfg.name}-{rep}.json").write_text(json.dumps(
                    {"result": asdict(res), "requests": [asdict(s) for s in sent]}))
                print(table([res]).splitlines()[-1], flush=True)
            finally:
                server.stop()
    med = []
    for name, rs in results.items():
        if not rs:
            continue
        pick = sorted(rs, key=lambda r: r.out_tok_s)[len(rs) // 2]
        med.append(pick)
    report = table(med)
    print("\nmedians over repeats (by out tok/s):\n" + report)
    (out / "report.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
