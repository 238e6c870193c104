"""Where the CPU goes: each process's CPU seconds and context switches while one synthetic level runs.

    .venv/bin/python bench/bench_cpu_split.py [--configs "2P2D=--prefill 2 --decode 2" "colocated-2=--colocated 2"]
        [--concurrency 8] [--requests 16] [--port 8400]

Starts each configuration in turn as a user does (`scripts/pd_start.sh`), reads utime + stime and
the voluntary / involuntary context switches of every thread of every process in its group from
/proc, runs `scripts/bench_serve.sh` at one concurrency, reads them again, stops the system, and
prints the level's table and a row per process (router, each rank). Linux only. The client
(aiperf) runs on the same cores and is not counted.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"prefill.rank": "prefill", "decode.rank": "decode", "rank_runtime.colocated": "colocated",
         "rank_runtime.fake_rank": "fake"}


def _switches(task_dir: Path) -> tuple[int, int]:
    vol = inv = 0
    for t in task_dir.iterdir():
        s = (t / "status").read_text()
        vol += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", s, re.M).group(1))
        inv += int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", s, re.M).group(1))
    return vol, inv


def group_usage(pgid: int) -> dict[int, tuple[str, float, int, int]]:
    """pid -> (name, CPU seconds, voluntary switches, involuntary switches) of the group's processes."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:
                continue
            cmd = (p / "cmdline").read_text().replace("\0", " ")
            role = next((r for m, r in ROLES.items() if m in cmd), "router")
            idx = re.search(r"--index (\d+)", cmd)
            name = role if role == "router" or not idx else f"{role}-{idx.group(1)}"
            out[int(p.name)] = (name, (int(fields[11]) + int(fields[12])) / tick, *_switches(p / "task"))
        except (OSError, ValueError, AttributeError):
            continue  # exited meanwhile
    return out


def run(label: str, flags: str, args) -> None:
    subprocess.run(f"scripts/pd_start.sh {flags} --port {args.port}", shell=True, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pgid = int((ROOT / "runs" / str(args.port) / "pd_start.pid").read_text().split()[0])
        before, t = group_usage(pgid), time.time()
        res = subprocess.run(f"scripts/bench_serve.sh http://127.0.0.1:{args.port} --concurrency {args.concurrency} "
                             f"--requests-per-level {args.requests} --out runs/cpu-split-{label}",
                             shell=True, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall, after = time.time() - t, group_usage(pgid)
    finally:
        subprocess.run(f"scripts/pd_start.sh stop --port {args.port}", shell=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"### {label} (`{flags}`): {wall:.1f} s wall\n")
    print("\n".join(ln for ln in res.stdout.splitlines() if ln.startswith("|")), "\n")
    print("| process | CPU s | voluntary switches | involuntary switches |\n|---|---:|---:|---:|")
    total = 0.0
    for pid, (name, cpu, vol, inv) in sorted(after.items(), key=lambda kv: kv[1][0]):
        if pid in before:
            _, cpu0, vol0, inv0 = before[pid]
            total += cpu - cpu0
            print(f"| {name} | {cpu - cpu0:.1f} | {vol - vol0} | {inv - inv0} |")
    print(f"| all | {total:.1f} | | |\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["2P2D=--prefill 2 --decode 2", "colocated-2=--colocated 2"],
                    help="NAME=pd_start.sh flags, run in this order")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--port", type=int, default=8400)
    args = ap.parse_args()
    for c in args.configs:
        label, _, flags = c.partition("=")
        run(label, flags, args)


if __name__ == "__main__":
    main()
