"""Failover under load: rank kills with migration on (issue 38's benchmark; not a test).

    .venv/bin/python bench/bench_failover.py [--flags "--colocated 2"] [--seconds 60]
        [--kill-every 15] [--concurrency 4] [--max-tokens 64] [--port 8311]

Starts `scripts/pd_start.sh FLAGS --supervise` as a user would, then runs two phases of
--seconds each with --concurrency closed-loop clients of streamed greedy chat requests:
  1. reference: no faults;
  2. faults: every --kill-every seconds a random ready rank (of --victims' roles, default any)
     gets SIGKILL; the supervisor restarts it.
Per phase: requests, client-visible errors (an HTTP error or an error event), output tok/s,
end-to-end latency p50 / p99, and in the fault phase the latency of the requests that were in
flight at a kill (the ones that moved or failed) against the reference p50; migrations from
/metrics. Stops the system at the end. Prints a markdown table with the CPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def one_request(url: str, i: int, max_tokens: int) -> tuple[float, float, int, bool]:
    """(start, end, content chunks, ok) of one streamed greedy chat request."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}
    t0, n, ok = time.monotonic(), 0, True
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            ok = r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if "error" in d:
                        ok = False
                    elif d.get("choices") and d["choices"][0]["delta"].get("content"):
                        n += 1
    except httpx.HTTPError:
        ok = False
    return t0, time.monotonic(), n, ok


def phase(url: str, seconds: float, concurrency: int, max_tokens: int, kill_every: float = 0.0,
          victims: tuple[str, ...] = ()) -> dict:
    stop_at = time.monotonic() + seconds
    results: list[tuple[float, float, int, bool]] = []
    kills: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        i = c
        while time.monotonic() < stop_at:
            res = one_request(url, i, max_tokens)
            with lock:
                results.append(res)
            i += concurrency

    def killer() -> None:
        while time.monotonic() + kill_every < stop_at:
            time.sleep(kill_every)
            ranks = [r for r in httpx.get(url + "/health", timeout=5).json()["ranks"] if r["state"] == "ready"]
            ranks = [r for r in ranks if not victims or r["role"] in victims]
            if len(ranks) < (2 if not victims or "colocated" in victims else 1):
                continue
            victim = random.choice(ranks)
            try:
                os.kill(victim["pid"], signal.SIGKILL)
                kills.append(time.monotonic())
            except ProcessLookupError:
                pass

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    if kill_every:
        threads.append(threading.Thread(target=killer))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    lat = sorted(e - s for s, e, _, _ in results)
    hit = sorted(e - s for s, e, _, _ in results if any(s <= k <= e for k in kills))
    return {"requests": len(results), "errors": sum(not ok for *_, ok in results), "kills": len(kills),
            "tok_s": sum(n for _, _, n, _ in results) / wall, "p50": statistics.median(lat),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "hit": hit}


def migrations(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=5).text
    return int(sum(float(m) for m in re.findall(r"^pdserve_migrations_total\{[^}]*\} (\S+)", text, re.M)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", default="--colocated 2")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--kill-every", type=float, default=15)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--victims", default="", help="roles to kill, comma-separated (default: any rank)")
    args = ap.parse_args()
    port = str(args.port)
    url = f"http://127.0.0.1:{port}"
    start = [str(ROOT / "scripts" / "pd_start.sh"), *args.flags.split(), "--supervise", "--port", port]
    subprocess.run(start, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    try:
        ref = phase(url, args.seconds, args.concurrency, args.max_tokens)
        before = migrations(url)
        victims = tuple(v for v in args.victims.split(",") if v)
        fault = phase(url, args.seconds, args.concurrency, args.max_tokens, args.kill_every, victims)
        moved = migrations(url) - before
    finally:
        subprocess.run([str(ROOT / "scripts" / "pd_start.sh"), "stop", "--port", port], cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    hit = fault["hit"]
    print(f"### Failover, `pd_start.sh {args.flags} --supervise`, {cpu_name()} ({len(os.sched_getaffinity(0))} "
          f"cores): {args.concurrency} clients, {args.max_tokens}-token greedy streams, {args.seconds:g} s a phase\n")
    print("| phase | kills | requests | client errors | migrations | out tok/s | e2e p50 s | e2e p99 s | "
          "requests hit by a kill | their e2e p50 / max s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| reference | 0 | {ref['requests']} | {ref['errors']} | 0 | {ref['tok_s']:.1f} | {ref['p50']:.2f} | "
          f"{ref['p99']:.2f} | - | - |")
    print(f"| kill {args.victims or 'any'} every {args.kill_every:g} s | {fault['kills']} | {fault['requests']} | {fault['errors']} | {moved} | "
          f"{fault['tok_s']:.1f} | {fault['p50']:.2f} | {fault['p99']:.2f} | {len(hit)} | "
          + (f"{statistics.median(hit):.2f} / {hit[-1]:.2f} |" if hit else "- |"))


if __name__ == "__main__":
    main()
