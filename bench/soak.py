"""Bounded soak: N minutes at concurrency C of mixed requests with injected client faults,
then checks that nothing leaked or broke.

    .venv/bin/python bench/soak.py [--mode colocated|pd] [--ranks N] [--minutes 3] [--concurrency 8]
                                   [--out soak.md] [--launch-args "--transfer shm"] [mix/threshold flags]
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 [--router-pid PID] ...

Without --url it starts a system itself (`python -m launcher.launch`, its own process group,
logs in --run-dir) and stops it at the end: --mode colocated --ranks N (default 2) starts N
colocated ranks, --mode pd --ranks N (default 1) N prefill + N decode ranks; each with
--num-threads, --kv-cache-gb, --max-num-seqs and the launcher's host cache. With --url it
soaks a running system, which must carry no other traffic (the router's request counter must
move by exactly what this script sent).

The load (bench/soaklib/mix.py): chat and completions, streaming or not, random max_tokens,
stop strings, n > 1 now and then; faults: streams the client closes after a few events,
requests it closes after a random delay, invalid requests that must get a 4xx. Each request
ends (client timeout). Every --sample-s: RSS of the router and every rank, each rank's
pages_used and in-flight count from /health. At the end it waits for every rank to be idle.

Prints a markdown report (and writes it to --out): requests by outcome, faults injected,
unexpected errors by class, RSS per process at start / after warm-up / end / max, KV pages at
start / max / end, throughput. The same-run reference is the system's own start: pages and
memory at the end are compared with it. Exit code 1 when the verdict is FAIL: any unexpected
error, a request the router did not count, ranks not idle after the load, a rank gone or
restarted, or a process's private RSS grown more than --rss-growth-mb after the warm-up;
2 when the system would not start (or, with --url, is not healthy).
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
from pathlib import Path

from cluster.cli_args import add_dataclass_args, from_args
from soaklib import SoakConfig, launch, render, soak  # bench/ is this script's sys.path[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="soak this running system instead of starting one")
    ap.add_argument("--router-pid", type=int, default=0, help="with --url: the router's pid (default: the parent "
                    "its ranks share)")
    ap.add_argument("--mode", choices=["colocated", "pd"], default="colocated")
    ap.add_argument("--ranks", type=int, default=0, help="colocated: ranks (default 2); pd: prefill ranks and as "
                    "many decode ranks (default 1)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--launch-args", default="", help="more launcher.launch flags, one shell-quoted string")
    ap.add_argument("--run-dir", default="", help="logs of the started system (default: a new temp dir)")
    ap.add_argument("--out", default="", help="also write the markdown report here")
    add_dataclass_args(ap, SoakConfig)
    args = ap.parse_args()
    cfg = from_args(args, SoakConfig)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.url:
        title = f"system at {args.url}"
        try:
            result = asyncio.run(soak(args.url.rstrip("/"), cfg, args.router_pid or None, progress))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        ranks = args.ranks or (2 if args.mode == "colocated" else 1)
        layout = ["--colocated", str(ranks)] if args.mode == "colocated" else \
            ["--prefill", str(ranks), "--decode", str(ranks)]
        launch_args = [*layout, "--model", args.model, "--num-threads", str(args.num_threads),
                       "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(args.max_num_seqs),
                       *shlex.split(args.launch_args)]
        run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-soak-"))
        title = f"{args.mode}, {' '.join(launch_args)}"
        progress(f"starting: launcher.launch {' '.join(launch_args)} (logs in {run_dir})")
        try:
            system = launch(launch_args, run_dir)
        except RuntimeError as e:
            print(f"error: {e}; logs in {run_dir}", file=sys.stderr)
            return 2
        try:
            result = asyncio.run(soak(system.url, cfg, system.proc.pid, progress))
        finally:
            system.stop()
        title += f" (logs in {run_dir})"
    report = render(result, title)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
