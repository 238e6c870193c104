"""Colocated against every prefill/decode split of a rank budget, on the same AgentX replay.

    .venv-bench/bin/python -m bench.agentx.compare [--ranks 2] [--configs colocated,1P1D]
        [--trace-dir bench/traces/agentx_default] [--concurrency 4] [--duration 120]
        [--model smollm2-135m-instruct] [--out runs/agentx-<time>]
    (scripts/agentx_compare.sh sets up the client venv and runs this.)

For each configuration in turn (one system at a time: the ranks share the machine's cores):
  1. start it with `python -m launcher.launch` (the project venv): `--colocated R`, or
     `--prefill x --decode y` with x + y = R; the same model, --kv-cache-gb, --hicache-size-gb
     and threads per rank (--threads-per-rank, 0: the launcher's cores // R) for all;
  2. wait for /health 200, scrape /metrics;
  3. run aiperf's AgentX replay (bench/agentx/aiperf_client.py `agentx_cmd`: same traces,
     concurrency, duration and seed everywhere), scrape /metrics again;
  4. stop the system (SIGTERM to its process group, SIGKILL after --stop-timeout), and check
     that no process of the group is left.
Then write the report directory (bench/agentx/report.py): report.md, summary.json, plots.

summary.json (schema 1), what pd_tune.py and other tools read:
    {"schema": 1, "created": ISO time, "command": [argv], "model": str, "ranks": R,
     "trace_dir": str, "concurrency": int, "duration_s": float, "cpus": int,
     "configs": [{
        "name": "colocated-2" | "1P1D" | ..., "mode": "colocated" | "pd",
        "colocated": int, "prefill": int, "decode": int,
        "ok": bool, "error": str | null,
        "artifact_dir": absolute path of aiperf's artifacts,
        "records": absolute path of its profile_export.jsonl (per request; profiled requests
                   have metadata.benchmark_phase == "profiling"),
        "client": {  # aiperf, profiled phase only
            "ttft_ms": {"p50", "p90", "p99", "avg"}, "itl_ms": {...}, "e2e_ms": {...},
            "output_tok_s": float, "input_tok_s": float, "request_throughput": float (req/s),
            "requests": int, "errors": int, "duration_s": float} | null,
        "server": {  # router /metrics, after minus before (warm-up requests included)
            "prompt_tokens", "cached_prompt_tokens", "completion_tokens": float,
            "prefix_hit_rate": float | null,
            "phase_mean_ms": {phase: ms per request},
            "itl_phase_ms_per_token": {phase: ms of the mean ITL},
            "ttft_dominant_phase": str | null, "ttft_dominant_share": float | null,
            "itl_dominant_phase": str | null, "itl_dominant_share": float | null} | null}]}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.agentx import aiperf_client, measure, process_group, report

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = ROOT / "bench" / "traces" / "agentx_default"
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class SystemConfig:
    name: str
    colocated: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "pd"

    def launch_args(self) -> list[str]:
        if self.colocated:
            return ["--colocated", str(self.colocated)]
        return ["--prefill", str(self.prefill), "--decode", str(self.decode)]


def configs_for(ranks: int, names: str = "all") -> list[SystemConfig]:
    """Colocated R and every xPyD with x + y = R, or the named subset ("colocated", "1P1D", ...)."""
    if ranks < 2:
        raise ValueError("--ranks must be >= 2 (a PD split needs a prefill and a decode rank)")
    every = [SystemConfig(f"colocated-{ranks}", colocated=ranks)]
    every += [SystemConfig(f"{x}P{ranks - x}D", prefill=x, decode=ranks - x) for x in range(1, ranks)]
    if names == "all":
        return every
    by_name = {c.name.lower(): c for c in every} | {"colocated": every[0]}
    out = []
    for name in names.split(","):
        if name.strip().lower() not in by_name:
            raise ValueError(f"unknown config {name!r} for --ranks {ranks}; choose from "
                             f"{', '.join(c.name for c in every)}")
        out.append(by_name[name.strip().lower()])
    return out


def tokenizer_dir(server_python: str, model: str) -> Path:
    """The served model's local checkpoint dir (engine/model_cache.py), tokenizer files included."""
    out = subprocess.run([server_python, "-m", "engine.model_cache", model], cwd=ROOT, check=True,
                         text=True, stdout=subprocess.PIPE).stdout
    return Path(out.strip().splitlines()[-1].split(": ", 1)[1])


class System:
    """One launcher.launch process group on 127.0.0.1."""

    def __init__(self, server_python: str, cfg: SystemConfig, common: list[str], run_dir: Path) -> None:
        self.port = process_group.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [server_python, "-m", "launcher.launch", *cfg.launch_args(), "--port", str(self.port),
               "--run-dir", str(run_dir), *common]
        (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
        with open(run_dir / "router.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        process_group.wait_healthy(self.url, self.proc, timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """SIGTERM the group, SIGKILL what is left after `timeout_s`. True if it went cleanly."""
        return process_group.stop(self.proc, timeout_s)


def run_config(cfg: SystemConfig, args: argparse.Namespace, tokenizer: Path, out: Path) -> dict:
    """Start `cfg`, replay the traces against it, stop it. Returns its summary.json entry."""
    cfg_dir = out / cfg.name
    artifact_dir = cfg_dir / "aiperf"
    entry = {"name": cfg.name, "mode": cfg.mode, "colocated": cfg.colocated, "prefill": cfg.prefill,
             "decode": cfg.decode, "ok": False, "error": None, "artifact_dir": str(artifact_dir.resolve()),
             "records": str((artifact_dir / aiperf_client.RECORDS).resolve()), "client": None, "server": None}
    common = ["--model", args.model, "--kv-cache-gb", str(args.kv_cache_gb),
              "--hicache-size-gb", str(args.hicache_size_gb), "--num-threads", str(args.threads_per_rank),
              *args.server_arg]
    print(f"[agentx] {cfg.name}: starting", file=sys.stderr, flush=True)
    system = System(args.server_python, cfg, common, cfg_dir / "server")
    try:
        system.wait_healthy(args.start_timeout)
        cmd = aiperf_client.agentx_cmd(system.url, args.served_model_name or args.model, tokenizer,
                                       args.trace_dir, artifact_dir, args.concurrency, args.duration)
        print(f"[agentx] {cfg.name}: replaying for {args.duration:.0f} s", file=sys.stderr, flush=True)
        m = measure.run(system.url, cmd, artifact_dir, timeout_s=args.duration * 2 + args.aiperf_grace)
        entry["server"] = m.server.to_json() if m.server else None
        entry["client"] = m.client.to_json() if m.client else None
        entry["error"] = m.error or m.metrics_error
        entry["ok"] = m.ok and m.server is not None
    except Exception as e:  # noqa: BLE001 - one failed config must not lose the others' results
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        if not system.stop(args.stop_timeout):
            print(f"[agentx] {cfg.name}: needed SIGKILL to stop", file=sys.stderr)
    state = "ok" if entry["ok"] else f"FAILED: {entry['error']}"
    print(f"[agentx] {cfg.name}: {state}", file=sys.stderr, flush=True)
    return entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="rank budget R")
    ap.add_argument("--configs", default="all", help="comma list (colocated, 1P1D, ...) or all")
    ap.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACES, help="weka_trace files (trace_*.json)")
    ap.add_argument("--concurrency", type=int, default=4, help="aiperf trajectories in flight")
    ap.add_argument("--duration", type=float, default=120.0, help="profiled seconds per config")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--served-model-name", default="", help="model id in requests (default: --model's)")
    ap.add_argument("--out", type=Path, default=None, help="report dir (default runs/agentx-<time>)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="per rank")
    ap.add_argument("--hicache-size-gb", type=float, default=0.25, help="per rank, every config")
    ap.add_argument("--threads-per-rank", type=int, default=0, help="0: cores // ranks (the launcher's rule)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra launcher.launch argument for every config (repeat; e.g. --server-arg=--transfer=shm)")
    ap.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--stop-timeout", type=float, default=20.0)
    ap.add_argument("--aiperf-grace", type=float, default=600.0,
                    help="seconds aiperf may run past 2x --duration (warm-up, drain) before it is killed")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "runs" / f"agentx-{datetime.now():%Y%m%d-%H%M%S}"
    if not sorted(args.trace_dir.glob("trace_*.json")):
        ap.error(f"--trace-dir {args.trace_dir} has no trace_*.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = configs_for(args.ranks, args.configs)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.served_model_name:
        args.served_model_name = Path(args.model).stem if Path(args.model).suffix == ".gguf" else Path(args.model).name
    tokenizer = tokenizer_dir(args.server_python, args.model)
    entries = [run_config(cfg, args, tokenizer, args.out) for cfg in configs]
    summary = {"schema": 1, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])], "model": args.model,
               "ranks": args.ranks, "trace_dir": str(args.trace_dir.resolve()), "concurrency": args.concurrency,
               "duration_s": args.duration, "cpus": os.cpu_count(), "configs": entries}
    report.write(args.out, summary)
    print((args.out / "report.md").read_text())
    print(f"[agentx] report: {args.out}", file=sys.stderr)
    return 0 if all(e["ok"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
