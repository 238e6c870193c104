"""PD (1 prefill + 1 decode) against colocated (1 rank) at low load: TTFT and where it goes.

    .venv/bin/python bench/bench_pd.py [--lens 512 2048 8192] [--transfer nixl shm] [--repeats 7]
                                       [--max-tokens 16] [--model smollm2-135m-instruct] [--compare-root DIR]

Starts every system at once with launcher.launch (colocated: the same-run reference, then
one 1P1D system per transfer backend; 1 torch thread per rank, so a PD pair and the
colocated rank compute at the same speed), then sends one streamed request at a time,
interleaved: each round draws one random prompt (no prefix reuse) and sends it to every
system in turn, the order rotating from round to round. Load from elsewhere on the machine
then falls on every system alike, and PD - colocated is taken per round (paired) before the
median, which a prefill time that varies by tens of ms from run to run would otherwise hide.
Reported per length (medians over the rounds):
  * TTFT as the client sees it, and the ITL (mean gap between later tokens);
  * the router's per-request phase breakdown (`--log-requests` lines, rank wall clocks):
    queue, prefill (the engine steps up to the first token: the same work in both modes),
    then PD only: stage (first token sent -> Handoff sent: copying the KV into the handoff
    pool), admission_wait (Handoff sent -> read start), transfer (the read), first_decode
    (read done -> first decode token);
  * paired PD - colocated: TTFT, prefill, and TTFT beyond prefill (what PD adds outside the
    prefill steps, free of their noise). Goal: PD adds at most transfer + 5 ms; the first
    token leaves the prefill rank before the staging copy and the transfer, so PD should add
    neither.
Not a test: prints a table. Idle systems cost little (their loops wait on sockets).
"""
from __future__ import annotations

import argparse
import itertools
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


def start(args, ranks: list[str], run_dir: Path, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.launch", *ranks, "--port", str(port), "--run-dir", str(run_dir),
           "--model", args.model, "--num-threads", "1", "--kv-cache-gb", "0.5", "--handoff-pool-gb", "0.5",
           "--log-requests"]
    with open(run_dir / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"id": rid, "ttft": stamps[0], "itl": statistics.mean(gaps) if gaps else 0.0}


def phases_from_log(run_dir: Path) -> dict[str, dict[str, float]]:
    out = {}
    for line in (run_dir / "router.log").read_text(errors="replace").splitlines():
        m = _PHASE_LINE.search(line)
        if m:
            out[m.group(1)] = {k: float(v.removesuffix("ms")) for k, v in
                               (kv.split("=") for kv in m.group(2).split())}
    return out


class System:
    def __init__(self, name: str, ranks: list[str], root: Path = ROOT) -> None:
        self.name, self.ranks, self.root = name, ranks, root
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.runs: dict[int, list[dict]] = {}  # prompt length -> one result per round
        self.phases: dict[str, dict[str, float]] = {}


def run_rounds(args, systems: list[System], vocab: int) -> None:
    rng = random.Random(1234)
    for s in systems:
        one_request(s.url, args.model, [rng.randrange(100, vocab) for _ in range(32)], 4)  # warm the path
    k = 0
    for n in args.lens:
        for _ in range(args.repeats):
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            order = systems[k % len(systems):] + systems[:k % len(systems)]
            k += 1
            for s in order:
                res = one_request(s.url, args.model, prompt, args.max_tokens)
                s.runs.setdefault(n, []).append(res)
                print(f"[{s.name}] {n} tokens: TTFT {res['ttft'] * 1000:.0f} ms", file=sys.stderr)


def table_of(s: System) -> dict[int, dict]:
    """Per prompt length: medians, and the per-round values that the paired deltas need."""
    table = {}
    for n, runs in s.runs.items():
        row = {"ttft": statistics.median(r["ttft"] for r in runs) * 1000,
               "itl": statistics.median(r["itl"] for r in runs) * 1000,
               "rounds": [(r["ttft"] * 1000, s.phases.get(r["id"], {}).get("prefill")) for r in runs]}
        for ph in PHASES:
            vals = [s.phases[r["id"]][ph] for r in runs if r["id"] in s.phases and ph in s.phases[r["id"]]]
            row[ph] = statistics.median(vals) if vals else None
        table[n] = row
    return table


def paired(rows: list, base: list) -> tuple[float | None, float | None, float | None]:
    """Medians over rounds of PD - colocated: TTFT, prefill, TTFT - prefill."""
    d_ttft = [a[0] - b[0] for a, b in zip(rows, base)]
    both = [(a, b) for a, b in zip(rows, base) if a[1] is not None and b[1] is not None]
    d_pre = [a[1] - b[1] for a, b in both]
    d_rest = [(a[0] - a[1]) - (b[0] - b[1]) for a, b in both]
    med = (lambda v: statistics.median(v) if v else None)
    return med(d_ttft), med(d_pre), med(d_rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--transfer", nargs="+", default=["nixl", "shm"], choices=["nixl", "shm"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--compare-root", type=Path, default=None,
                    help="also run each 1P1D system from this checkout (e.g. `git worktree add DIR HEAD~1`), "
                         "interleaved with the others: an A/B of a change (rows named 1P1D-<kind>@cmp)")
    args = ap.parse_args()
    vocab = 49152 if args.model.startswith("smollm2") else 32000
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    systems = [System("colocated", ["--colocated", "1"])]
    for k in args.transfer:
        pd = ["--prefill", "1", "--decode", "1", "--transfer", k]
        systems.append(System(f"1P1D-{k}", [*pd, "--disagg", "always"]))  # every prompt handed off
        if args.compare_root is not None:
            systems.append(System(f"1P1D-{k}@cmp", pd, args.compare_root.resolve()))
    try:
        for s in systems:  # one at a time: model loads on a small machine
            print(f"[{s.name}] starting ({' '.join(s.ranks)})", file=sys.stderr)
            s.proc, s.url = start(args, s.ranks, tmp / s.name, s.root)
        run_rounds(args, systems, vocab)
        time.sleep(0.5)
        for s in systems:
            s.phases = phases_from_log(tmp / s.name)
    finally:
        for s in systems:
            if s.proc is not None:
                stop(s.proc)
    tables = {s.name: table_of(s) for s in systems}

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"\nmodel {args.model}, {args.max_tokens} output tokens, 1 torch thread per rank, {args.repeats} "
          "interleaved rounds; ms, medians. ttft-prefill: what the client waits beyond the rank's prefill steps "
          "(HTTP, queue, PD: nothing else, the first token leaves before staging and transfer). "
          "d*: PD - colocated per round, then the median")
    cols = ("ttft", "prefill", "ttft-prefill", "itl", "queue", "stage", "admission_wait", "transfer", "first_decode")
    dcols = ("dTTFT", "dprefill", "dTTFT-prefill")
    print(f"{'prompt':>6}  {'system':<12}" + "".join(f"{c:>15}" for c in cols + dcols))
    for n in args.lens:
        base = tables["colocated"][n]
        for name, table in tables.items():
            row = dict(table[n])
            row["ttft-prefill"] = row["ttft"] - row["prefill"] if row["prefill"] is not None else None
            deltas = ("", "", "") if name == "colocated" else \
                tuple(f"{v:+.1f}" if v is not None else "-" for v in paired(row["rounds"], base["rounds"]))
            print(f"{n:>6}  {name:<12}" + "".join(f"{ms(row.get(c)):>15}" for c in cols)
                  + "".join(f"{d:>15}" for d in deltas))
    print(f"\nlogs: {tmp}")


if __name__ == "__main__":
    main()
