"""The mission benchmark's driver: every configuration, started as a user starts it, under the
same loads, repeated and interleaved, then one table.

    .venv/bin/python -m bench.mission [--configs 2P2D,1P1D,colocated-2,vllm,llamacpp] [--config NAME='FLAGS']
        [--levels "1 8 32"] [--agentx-duration 120] [--agentx-concurrency 4] [--no-agentx]
        [--kv-reuse-duration 0] [--no-synthetic] [--repeats 1] [--port 0] [--seed 42] [--out runs/mission-<time>]
    (scripts/mission_bench.sh checks both venvs first and runs this.)

For each repeat r, for each configuration (the list rotated by r, so none is always first
on a cold machine):
  1. start it (bench/mission/servers.py): pd_start.sh FLAGS --port P, or peer_vllm.sh / peer_llamacpp.sh serve;
     the start-up time is the wall time until /health is ready;
  2. the synthetic levels in order (bench/agentx/serve_bench.py `Synthetic`: the workload of
     scripts/bench_serve.sh, level i seeded --seed + i), then the AgentX replay
     (aiperf_client.agentx_cmd), each with the server's /metrics around it (measure.py), then,
     with --kv-reuse-duration, bench/bench_kv_reuse.py's multi-turn sessions (load "kv-reuse");
  3. stop it (in a finally; also on SIGTERM / Ctrl-C), keep its logs in the run directory.
Every run writes OUT/<config>/r<r>/run.json (and aiperf's artifacts beside it); after each
run OUT/summary.json and OUT/report.md (bench/mission/table.py) are rewritten, so an
interrupted mission keeps what it measured. Every wait is bounded: start-up --start-timeout,
each level --timeout, the replay 2 x --agentx-duration + --agentx-grace.

summary.json: {"schema": 1, "created", "command", "model", "cpus", "settings": {...},
"configs": [names], "ratio_to": [names], "skipped": {name: why}, "runs": [run dicts, as
bench/mission/table.py describes, plus "flags", "command", "port", "stop_clean"]}.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench import bench_kv_reuse as kv_reuse
from bench.agentx import aiperf_client, measure, process_group, serve_bench
from bench.mission import servers, table
from bench.mission.configs import LLAMACPP, VLLM, Config, baseline_configs, parse_configs

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = ROOT / "bench" / "traces" / "agentx_default"
DEFAULT_MODEL = "smollm2-135m-instruct"


def log(msg: str) -> None:
    print(f"[mission] {msg}", file=sys.stderr, flush=True)


def schedule(configs: list[Config], repeats: int) -> list[tuple[int, Config]]:
    """(repeat, config) in run order: every configuration once per repeat, the order rotated
    by one each repeat."""
    n = len(configs)
    return [(r, configs[(r + i) % n]) for r in range(repeats) for i in range(n)] if n else []


def run_one(cfg: Config, rep: int, args: argparse.Namespace, tokenizer: Path, out: Path,
            runs: list[dict]) -> None:
    """Start `cfg`, run the loads against it, stop it. Appends its run dict to `runs` at the
    start (so an interrupted run is kept, partly filled) and writes it as run.json."""
    run_dir = out / cfg.name / f"r{rep}"
    port = args.port or process_group.free_port()
    server = servers.make(cfg, port, args.model_flag, run_dir, args.stop_timeout)
    run = {"config": cfg.name, "repeat": rep, "flags": list(cfg.flags), "peer": cfg.peer, "port": port,
           "command": server.command, "startup_s": None, "error": None, "stop_clean": None, "loads": []}
    runs.append(run)
    log(f"repeat {rep}, {cfg.name}: {' '.join(server.command)}")
    try:
        run["startup_s"] = server.start(args.start_timeout)
        log(f"{cfg.name}: ready in {run['startup_s']:.1f} s")
        model = serve_bench.served_model(server.url)
        work = serve_bench.Synthetic.from_args(args)
        for i, level in enumerate(args.level_list):
            log(f"{cfg.name}: synthetic c{level}, {work.requests(level)} requests")
            m = work.run_level(server.url, model, tokenizer, run_dir / f"c{level}", level, i)
            run["loads"].append({"load": f"c{level}", "kind": "synthetic", "concurrency": level, **m.to_json()})
        if not args.no_agentx:
            art = run_dir / "agentx"
            cmd = aiperf_client.agentx_cmd(server.url, model, tokenizer, args.trace_dir, art,
                                           args.agentx_concurrency, args.agentx_duration, seed=args.seed)
            log(f"{cfg.name}: AgentX replay for {args.agentx_duration:.0f} s")
            m = measure.run(server.url, cmd, art, timeout_s=args.agentx_duration * 2 + args.agentx_grace)
            run["loads"].append({"load": "agentx", "kind": "agentx", "concurrency": args.agentx_concurrency,
                                 **m.to_json()})
        if args.kv_reuse_duration > 0:
            log(f"{cfg.name}: multi-turn sessions (kv-reuse) for {args.kv_reuse_duration:.0f} s")
            w = kv_reuse.Workload(duration_s=args.kv_reuse_duration, seed=args.seed)
            run["loads"].append({"load": "kv-reuse", "kind": "kv-reuse", "concurrency": w.concurrency,
                                 **kv_reuse.measure(server.url, model, w)})
    except Exception as e:  # noqa: BLE001 - one failed start must not lose the other runs
        run["error"] = f"{type(e).__name__}: {e}"
        log(f"{cfg.name}: FAILED: {run['error']}")
    finally:
        try:
            run["stop_clean"] = server.stop()
        finally:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    log(f"{cfg.name}: stopped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.mission", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default=f"2P2D,1P1D,colocated-2,{VLLM},{LLAMACPP}",
                    help="comma list: xPyD, colocated-N (suffixes -nolend, -shm, -nixl), vllm (only "
                         "where .venv-vllm exists), llamacpp (only where scripts/peer_llamacpp.sh setup "
                         "built it), or names defined with --config")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                    help="define NAME as scripts/pd_start.sh FLAGS (repeatable), e.g. "
                         "--config \"2P2D-64=--prefill 2 --decode 2 --max-num-seqs 64\"")
    ap.add_argument("--baseline", default="", metavar="DIR:NAME,NAME",
                    help="also run these configs from another checkout (a `git worktree` of an earlier commit "
                         "whose .venv links to this one's), named NAME@base: a before/after in one run")
    ap.add_argument("--levels", default="1 8 32", help="synthetic concurrency levels")
    ap.add_argument("--agentx-duration", type=float, default=120.0, help="profiled seconds of the replay")
    ap.add_argument("--agentx-concurrency", type=int, default=4, help="trajectories in flight")
    ap.add_argument("--agentx-grace", type=float, default=600.0,
                    help="seconds the replay may run past 2 x --agentx-duration before aiperf is killed")
    ap.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACES, help="weka_trace files (trace_*.json)")
    ap.add_argument("--no-agentx", action="store_true", help="synthetic levels only")
    ap.add_argument("--kv-reuse-duration", type=float, default=0.0,
                    help="seconds of bench/bench_kv_reuse.py's multi-turn sessions after the other loads (its "
                         "default workload: 24 sessions alive, 8 requests in flight); 0: not run")
    ap.add_argument("--no-synthetic", action="store_true", help="AgentX replay only")
    ap.add_argument("--repeats", type=int, default=1, help="starts of each configuration (medians reported)")
    ap.add_argument("--port", type=int, default=0, help="port of every start (0: a free one each start)")
    ap.add_argument("--model", default="", help=f"every server's model (empty: the scripts' default, {DEFAULT_MODEL})")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="aiperf's tokenizer dir (None: the engine's cached dir for the model)")
    ap.add_argument("--ratio-to", default=f"colocated-2,{VLLM},{LLAMACPP}", help="reference configurations of the ratio columns")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a start may take to /health ready")
    ap.add_argument("--stop-timeout", type=float, default=30.0, help="vLLM: seconds after SIGTERM before SIGKILL")
    ap.add_argument("--out", type=Path, default=None, help="output dir (None: runs/mission-<time>)")
    serve_bench.add_workload_args(ap)  # --requests-per-level, --isl, --osl, --tick-rate, --seed, --timeout
    args = ap.parse_args(argv)
    try:
        args.config_list = parse_configs(args.configs, args.config)
        if args.baseline:
            args.config_list += baseline_configs(args.baseline)
        args.level_list = [] if args.no_synthetic else serve_bench.parse_levels(args.levels)
    except ValueError as e:
        ap.error(str(e))
    if args.no_agentx and not args.level_list:
        ap.error("nothing to run: --no-agentx with --no-synthetic (or no --levels)")
    if not args.no_agentx and not sorted(args.trace_dir.glob("trace_*.json")):
        ap.error(f"--trace-dir {args.trace_dir} has no trace_*.json")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    args.model_flag = args.model
    args.model = args.model or DEFAULT_MODEL
    args.out = args.out or ROOT / "runs" / f"mission-{datetime.now():%Y%m%d-%H%M%S}"
    return args


def _stop_on_signal(signum, _frame) -> None:
    # Raise in the main thread so every finally (servers, aiperf) runs; ignore repeats of the
    # signal while that cleanup is under way.
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    skipped = {}
    configs = []
    for c in args.config_list:
        if c.peer and (why := servers.peer_missing(c.peer)):
            skipped[c.name] = why
        else:
            configs.append(c)
    for name, why in skipped.items():
        log(f"{name} skipped: {why}")
    tokenizer = args.tokenizer or serve_bench.resolve_tokenizer(args.model, str(ROOT / ".venv" / "bin" / "python"))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"schema": 1, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])], "model": args.model,
               "cpus": os.cpu_count(),
               "settings": {"repeats": args.repeats, "levels": " ".join(map(str, args.level_list)) or "-",
                            "isl": args.isl, "osl": args.osl, "requests_per_level": args.requests_per_level,
                            "seed": args.seed, "agentx": not args.no_agentx,
                            "trace_dir": str(args.trace_dir.resolve()) if not args.no_agentx else "-",
                            "agentx_concurrency": args.agentx_concurrency if not args.no_agentx else "-",
                            "agentx_duration_s": args.agentx_duration if not args.no_agentx else "-"},
               "configs": [c.name for c in configs],
               "ratio_to": [n.strip() for n in args.ratio_to.split(",") if n.strip()],
               "skipped": skipped, "runs": []}
    plan = schedule(configs, args.repeats)
    log(f"{len(plan)} starts: {', '.join(f'{c.name}#{r}' for r, c in plan)}; output in {args.out}")
    try:
        for rep, cfg in plan:
            run_one(cfg, rep, args, tokenizer, args.out, summary["runs"])
            write(args.out, summary)
    finally:
        write(args.out, summary)
    print((args.out / "report.md").read_text())
    log(f"report: {args.out / 'report.md'}")
    ok = all(not r["error"] and all(ld["ok"] for ld in r["loads"]) for r in summary["runs"])
    return 0 if ok and summary["runs"] else 1


def write(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "report.md").write_text(table.markdown(summary))
