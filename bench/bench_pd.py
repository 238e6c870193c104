"""PD (1 prefill + 1 decode) against colocated (1 rank) at low load: TTFT and where it goes.

    .venv/bin/python bench/bench_pd.py [--lens 512 2048 8192] [--transfer nixl shm] [--repeats 2]
                                       [--max-tokens 16] [--model smollm2-135m-instruct]

For each system in turn (colocated first: the same-run reference; then one 1P1D system per
transfer backend), start it with pd_server.launch (1 torch thread per rank, so a PD pair
and the colocated rank compute at the same speed), send one streamed request at a time with
a random prompt of each length (no prefix reuse), and report per length:
  * TTFT p50 as the client sees it, and the ITL (mean gap between later tokens);
  * the router's per-request phase breakdown (`--log-requests` lines, rank wall clocks):
    queue, prefill (PD: includes copying the KV into the handoff pool), then PD only: stage
    (first token sent -> Handoff sent), admission_wait (Handoff sent -> read start), transfer
    (the read), first_decode (read done -> first decode token);
  * PD - colocated TTFT next to the transfer-side phases (goal: at most those plus 5 ms).
Not a test: prints a table. Each system is stopped before the next starts (2-core machine).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("queue", "prefill_wait", "prefill", "stage", "admission_wait", "transfer", "first_decode")
_PHASE_LINE = re.compile(r"(\S+)-0 phases: (.*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, ranks: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pd_server.launch", *ranks, "--port", str(port), "--run-dir", str(run_dir),
           "--model", args.model, "--num-threads", "1", "--kv-cache-gb", "0.5", "--handoff-pool-gb", "0.5",
           "--log-requests"]
    with open(run_dir / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited; see {run_dir}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"not healthy within 600 s; see {run_dir}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; TTFT and token arrival times from the client's clock."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps, rid = [], ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter() - t0)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"id": rid, "ttft": stamps[0], "itl": statistics.mean(gaps) if gaps else 0.0}


def phases_from_log(run_dir: Path) -> dict[str, dict[str, float]]:
    out = {}
    for line in (run_dir / "router.log").read_text(errors="replace").splitlines():
        m = _PHASE_LINE.search(line)
        if m:
            out[m.group(1)] = {k: float(v.removesuffix("ms")) for k, v in
                               (kv.split("=") for kv in m.group(2).split())}
    return out


def run_system(args, name: str, ranks: list[str], tmp: Path, vocab: int) -> dict[int, dict]:
    run_dir = tmp / name
    print(f"[{name}] starting ({' '.join(ranks)})", file=sys.stderr)
    proc, url = start(args, ranks, run_dir)
    rng = random.Random(1234)
    results: dict[int, list[dict]] = {}
    try:
        one_request(url, args.model, [rng.randrange(100, vocab) for _ in range(32)], 4)  # warm the path
        for n in args.lens:
            for _ in range(args.repeats):
                prompt = [rng.randrange(100, vocab) for _ in range(n)]
                res = one_request(url, args.model, prompt, args.max_tokens)
                results.setdefault(n, []).append(res)
                print(f"[{name}] {n} tokens: TTFT {res['ttft'] * 1000:.0f} ms", file=sys.stderr)
        time.sleep(0.5)
        phases = phases_from_log(run_dir)
    finally:
        stop(proc)
    table = {}
    for n, runs in results.items():
        row = {"ttft": statistics.median(r["ttft"] for r in runs) * 1000,
               "itl": statistics.median(r["itl"] for r in runs) * 1000}
        for ph in PHASES:
            vals = [phases[r["id"]][ph] for r in runs if r["id"] in phases and ph in phases[r["id"]]]
            row[ph] = statistics.median(vals) if vals else None
        table[n] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--transfer", nargs="+", default=["nixl", "shm"], choices=["nixl", "shm"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    vocab = 49152 if args.model.startswith("smollm2") else 32000
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    systems = {"colocated": run_system(args, "colocated", ["--colocated", "1"], tmp, vocab)}
    for kind in args.transfer:
        systems[f"1P1D-{kind}"] = run_system(args, f"pd-{kind}", ["--prefill", "1", "--decode", "1",
                                                                  "--transfer", kind], tmp, vocab)

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"\nmodel {args.model}, {args.max_tokens} output tokens, 1 torch thread per rank, "
          f"median of {args.repeats}; ms. ttft-prefill: what the client waits beyond the rank's prefill "
          "(HTTP, queue, staging); PD sends the first token before the transfer starts")
    cols = ("ttft", "prefill", "ttft-prefill", "itl", "queue", "stage", "admission_wait", "transfer", "first_decode")
    print(f"{'prompt':>6}  {'system':<12}" + "".join(f"{c:>15}" for c in cols) + f"{'PD-colo TTFT':>15}")
    for n in args.lens:
        base = systems["colocated"][n]["ttft"]
        for name, table in systems.items():
            row = dict(table[n])
            row["ttft-prefill"] = row["ttft"] - row["prefill"] if row["prefill"] is not None else None
            delta = "" if name == "colocated" else f"{row['ttft'] - base:+.1f}"
            print(f"{n:>6}  {name:<12}" + "".join(f"{ms(row.get(c)):>15}" for c in cols) + f"{delta:>15}")
    print(f"\nlogs: {tmp}")


if __name__ == "__main__":
    main()
