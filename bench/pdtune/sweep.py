"""Measured mode (`pd_tune.py sweep`): every split served for real, replayed with aiperf.

scripts/agentx_compare.sh (bench/agentx/compare.py) starts colocated R and each xPyD split in
turn, replays the same weka traces against each with aiperf, stops it, and writes
RUN/summary.json (schema 1): per configuration (`configs[]`) its `name` (colocated-R, xPyD),
`records` (the path of aiperf's per-request `profile_export.jsonl`) and the router's phase
means (`server.phase_mean_ms`). This module reads those per-request records (one JSON object
a line, aiperf's MetricRecordInfo):

    {"metadata": {"request_start_ns": ..., "request_end_ns": ..., "benchmark_phase": "profiling", ...},
     "metrics": {"time_to_first_token": {"value": 812.5, "unit": "ms"},
                 "inter_token_latency": {"value": 41.0, "unit": "ms"},
                 "request_latency": {...}, "input_sequence_length": {"value": 900, "unit": "tokens"},
                 "output_sequence_length": {...}, "usage_prompt_cache_read_tokens": {...}, ...},
     "error": null | {"code": 500, "message": ...}}

and computes goodput per split from them (report.py), with the phase breakdown from
summary.json. Warm-up records are skipped; failed ones count as errors (never as good).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pdtune.report import RequestResult, summarize

ROOT = Path(__file__).resolve().parents[2]
_TO_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _seconds(metric: dict | None) -> float | None:
    if not metric or metric.get("value") is None:
        return None
    return float(metric["value"]) * _TO_S[metric.get("unit", "ms")]


def _count(metric: dict | None) -> int:
    return int(metric["value"]) if metric and metric.get("value") is not None else 0


def parse_profile_export(path: str | Path) -> tuple[list[RequestResult], int]:
    """(results of the profiling phase's successful requests, number of failed ones)."""
    results, errors = [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        md, m = rec.get("metadata", {}), rec.get("metrics", {})
        if str(md.get("benchmark_phase", "profiling")).lower() != "profiling":
            continue
        ttft = _seconds(m.get("time_to_first_token"))
        if rec.get("error") or md.get("was_cancelled") or ttft is None:
            errors += 1
            continue
        start = md["request_start_ns"] * 1e-9
        e2e = _seconds(m.get("request_latency"))
        if e2e is None:
            e2e = md["request_end_ns"] * 1e-9 - start
        results.append(RequestResult(start, ttft, e2e, _count(m.get("input_sequence_length")),
                                     _count(m.get("output_sequence_length")),
                                     _count(m.get("usage_prompt_cache_read_tokens")),
                                     itl_measured_s=_seconds(m.get("inter_token_latency"))))
    return results, errors


def split_name(name: str) -> str:
    """A configuration's name as compare.py may write it -> pd_tune's (colocated-N, xPyD)."""
    from bench.pdtune.split import Split

    t = name.strip().lower().replace("_", "-")
    for prefix in ("colocated-", "colocated", "colo-", "colo"):
        if t.startswith(prefix) and t[len(prefix):].isdigit():
            return Split(colocated=int(t[len(prefix):])).name
    t = t.removeprefix("pd-")
    return Split.parse(t).name


def _phases_ms(cfg: dict) -> dict[str, float]:
    """Phase means in ms per request from one summary.json configuration: the router's
    (`server.phase_mean_ms`, schema 1), or a plain `phases_ms` mapping."""
    server = cfg.get("server") or {}
    phases = server.get("phase_mean_ms") or cfg.get("phases_ms") or {}
    return {k: float(v) for k, v in phases.items() if v is not None}


def read_run(run_dir: str | Path, ttft_ms: float, itl_ms: float) -> dict[str, dict]:
    """Aggregates per configuration (pd_tune names) of a finished agentx_compare run."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = {}
    for cfg in summary["configs"]:
        name, path = cfg["name"], cfg.get("records")
        if not cfg.get("ok", True) or not path or not Path(path).exists():
            print(f"[sweep] {name}: no per-request records ({cfg.get('error') or 'missing'}); left out",
                  file=sys.stderr)
            continue
        path = Path(path) if Path(path).is_absolute() else run_dir / path
        results, errors = parse_profile_export(path)
        row = summarize(results, ttft_ms, itl_ms, errors)
        row["phases_ms"] = _phases_ms(cfg) or row["phases_ms"]
        rows[split_name(name)] = row
    return rows


def run_sweep(args) -> dict[str, dict]:
    """Run scripts/agentx_compare.sh for every split of args.ranks (unless --from-run names
    finished runs) and return the aggregates per configuration."""
    if args.from_run:
        rows = {}
        for run in args.from_run:
            rows.update(read_run(run, args.ttft_ms, args.itl_ms))
            _take_duration(args, run)
        return rows
    if not args.workload:
        raise SystemExit("sweep replays a weka_trace directory (--workload); agentx_compare has no synthetic mode")
    out = Path(args.out or tempfile.mkdtemp(prefix="pd-tune-sweep-"))
    cmd = [str(ROOT / "scripts" / "agentx_compare.sh"), "--ranks", str(args.ranks), "--out", str(out),
           "--concurrency", str(args.concurrency), "--trace-dir", str(Path(args.workload).resolve())]
    if args.duration:
        cmd += ["--duration", str(args.duration)]
    if args.splits:
        cmd += ["--configs", args.splits]
    cmd += args.compare_args.split()
    print("[sweep] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"[sweep] run directory: {out}", file=sys.stderr)
    _take_duration(args, out)
    return read_run(out, args.ttft_ms, args.itl_ms)


def _take_duration(args, run_dir: str | Path) -> None:
    """Without --duration the simulated comparison (--compare-sim) replays what the run
    profiled: its duration (every session once would compare another workload)."""
    if args.duration is None:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        if summary.get("duration_s"):
            args.duration = float(summary["duration_s"])
