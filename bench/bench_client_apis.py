"""What the client-surface features cost, through a system started as a user starts it (issue 59's
benchmark; not a test).

    .venv/bin/python bench/bench_client_apis.py [--flags "--colocated 2"] [--port 8320]
        [--prompt-tokens 1024] [--repeats 5] [--turns 4]

1. Prompt logprobs: completions of `--prompt-tokens` random token ids, max_tokens 1, one at a time,
   plain and with echo + logprobs 1 (lm-evaluation-harness's log-likelihood body) in turn; every
   prompt is new (no prefix-cache hit for either). Prefill tok/s = prompt tokens / request
   latency, medians of --repeats, and the ratio.
2. Stored Responses: a --turns conversation chained by previous_response_id against the same
   conversation sent whole each turn (its input items), each in its own cache_salt namespace;
   TTFT (streamed, to the first output_text delta) per turn, medians over --repeats conversations.
Prints markdown tables with the CPU named; starts and stops `scripts/pd_start.sh FLAGS`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import httpx

from bench.bench_structured import cpu_name

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Name a river in Europe.", "How long is it?", "Which cities does it pass?", "Name another one.",
             "Which of the two is longer?", "Thanks. Summarise our talk."]


def logprob_table(url: str, n_tokens: int, repeats: int) -> str:
    rng = random.Random(7)
    times: dict[bool, list[float]] = {False: [], True: []}
    with httpx.Client(timeout=600) as c:
        for r in range(repeats + 1):  # the first round warms up
            for with_lp in ((False, True) if r % 2 == 0 else (True, False)):
                body = {"model": MODEL, "prompt": [rng.randrange(100, 40000) for _ in range(n_tokens)],
                        "max_tokens": 1, "temperature": 0}
                if with_lp:
                    body.update(echo=True, logprobs=1, seed=1234)
                t0 = time.perf_counter()
                resp = c.post(url + "/v1/completions", json=body)
                dt = time.perf_counter() - t0
                resp.raise_for_status()
                if with_lp:
                    assert len(resp.json()["choices"][0]["logprobs"]["token_logprobs"]) == n_tokens + 1
                if r:
                    times[with_lp].append(dt)
    plain, lp = statistics.median(times[False]), statistics.median(times[True])
    return "\n".join([
        "| request | latency p50 ms | prefill tok/s | ratio |", "|---|---:|---:|---:|",
        f"| plain, max_tokens 1 | {plain * 1e3:.0f} | {n_tokens / plain:.0f} | 1.00 |",
        f"| echo + logprobs 1 (lm-eval) | {lp * 1e3:.0f} | {n_tokens / lp:.0f} | {plain / lp:.2f} |"])


def _ttft(c: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    """Seconds to the first output_text delta, and the completed response."""
    t0, first, done = time.perf_counter(), None, None
    with c.stream("POST", url + "/v1/responses", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("type") == "response.output_text.delta":
                first = time.perf_counter() - t0
            if ev.get("type") in ("response.completed", "response.incomplete"):
                done = ev["response"]
    return (first if first is not None else time.perf_counter() - t0), done


def responses_table(url: str, turns: int, repeats: int) -> str:
    chained: list[list[float]] = [[] for _ in range(turns)]
    whole: list[list[float]] = [[] for _ in range(turns)]
    kw = {"model": MODEL, "max_output_tokens": 48, "temperature": 0, "instructions": "You are a geography tutor."}
    with httpx.Client(timeout=600) as c:
        for r in range(repeats + 1):  # the first conversation warms up
            salt_a, salt_b = uuid.uuid4().hex, uuid.uuid4().hex
            prev, items = None, []
            for t in range(turns):
                q = f"({r}) {QUESTIONS[t % len(QUESTIONS)]}"
                body = {**kw, "input": q, "cache_salt": salt_a}
                if prev is not None:
                    body["previous_response_id"] = prev
                s_chain, resp = _ttft(c, url, body)
                prev = resp["id"]
                items.append({"role": "user", "content": q})
                s_whole, resp_w = _ttft(c, url, {**kw, "input": items, "cache_salt": salt_b, "store": False})
                items.append({"role": "assistant", "content": resp_w["output"][0]["content"][0]["text"]})
                if r:
                    chained[t].append(s_chain)
                    whole[t].append(s_whole)
    rows = ["| turn | chained TTFT p50 ms | sent whole TTFT p50 ms | ratio |", "|---:|---:|---:|---:|"]
    for t in range(turns):
        a, b = statistics.median(chained[t]) * 1e3, statistics.median(whole[t]) * 1e3
        rows.append(f"| {t + 1} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", default="--colocated 2", help="scripts/pd_start.sh flags")
    ap.add_argument("--port", type=int, default=8320)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    port = str(args.port)
    subprocess.run([str(ROOT / "scripts" / "pd_start.sh"), *args.flags.split(), "--port", port], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"### Client APIs on `scripts/pd_start.sh {args.flags}`, {cpu_name()} "
              f"({len(os.sched_getaffinity(0))} cores)\n")
        print(f"Prompt logprobs ({args.prompt_tokens}-token prompts, one at a time, medians of {args.repeats}):\n")
        print(logprob_table(url, args.prompt_tokens, args.repeats))
        print(f"\nStored Responses ({args.turns} turns, 48 tokens an answer, medians of {args.repeats} "
              f"conversations):\n")
        print(responses_table(url, args.turns, args.repeats))
    finally:
        subprocess.run([str(ROOT / "scripts" / "pd_start.sh"), "stop", "--port", port], cwd=ROOT,
                       stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
