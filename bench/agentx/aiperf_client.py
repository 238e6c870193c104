"""Running aiperf (the benchmark client, `.venv-bench` from scripts/setup_aiperf.sh) and reading
what it exports.

Two workloads:
  * `agentx_cmd`: the AgentX replay (`--scenario inferencex-agentx-mvp` over a `weka_trace`
    directory): ignore_eos, max_tokens from the trace, recorded think-time gaps, subagents,
    a `[rid:...]` cache-bust marker per trajectory, a warm-up phase (max_tokens=1) that primes
    each trajectory's prefix before the profiled phase;
  * `synthetic_cmd`: random prompts of a fixed length (`--isl/--osl`, ignore_eos).
Both run offline: a local tokenizer directory, no GPU telemetry, no UI, 127.0.0.1 only.

An artifact directory holds `profile_export_aiperf.json` (summary: each metric a dict with
`unit`, `avg` and, for per-request metrics, `p50`/`p90`/`p99`/...) and `profile_export.jsonl`
(one record per request: `metadata.benchmark_phase` is "warmup" or "profiling",
`metrics.<name>.value`, and `error` on failed requests).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster import settings

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"
PERCENTILES = ("p50", "p90", "p99")


def aiperf_path() -> Path:
    """The aiperf executable, set up on first use by scripts/setup_aiperf.sh (minutes, once)."""
    beside = Path(sys.executable).parent / "aiperf"
    if beside.exists():
        return beside
    out = subprocess.run([str(ROOT / "scripts" / "setup_aiperf.sh")], check=True, text=True,
                         stdout=subprocess.PIPE).stdout
    return Path(out.strip().splitlines()[-1])


def _common(url: str, model: str, tokenizer: Path, artifact_dir: Path, concurrency: int,
            seed: int = 42) -> list[str]:
    return ["--model", model, "--url", url, "--tokenizer", str(tokenizer),
            "--endpoint", "/v1/chat/completions", "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--random-seed", str(seed), "--artifact-dir", str(artifact_dir),
            "--no-gpu-telemetry", "--ui", "none", *_server_metrics()]


def _server_metrics() -> list[str]:
    """aiperf's own scraper of the server's /metrics stays off unless PDSERVE_AIPERF_SERVER_METRICS=1:
    nothing here reads its export (compare.py scrapes the router itself, before and after), and
    on a 2-core machine it costs the server under test (measured in a c1 run of bench_serve: ~3
    scrapes a second, 0.86 s of aiperf CPU and ~0.2 s of the router's in ~25 s, ~4% of a core
    taken from the prefill that is the TTFT)."""
    return [] if settings.aiperf_server_metrics() else ["--no-server-metrics"]


# aiperf 0.13's weka_trace loader reads every hash_id as a block of this many tokens, whatever
# `block_size` a trace declares (its plugin default is passed where a user override goes, and
# --isl-block-size is refused for weka datasets). A 32-token trace replayed that way sent
# prompts that stopped growing after the first turn (a session's 825 -> 3417-token context
# as 854 -> 1133 tokens, no assistant turns), so the traces here use 64 and agentx_cmd refuses
# others.
AIPERF_WEKA_BLOCK = 64


def trace_block_size(trace_dir: Path) -> int:
    """The `block_size` every trace_*.json in `trace_dir` declares (ValueError if they differ or
    there are none)."""
    sizes = {int(json.loads(p.read_text())["block_size"]) for p in sorted(Path(trace_dir).glob("trace_*.json"))}
    if len(sizes) != 1:
        raise ValueError(f"{trace_dir}: the traces declare block sizes {sorted(sizes)}, need exactly one")
    return sizes.pop()


def agentx_cmd(url: str, model: str, tokenizer: Path, trace_dir: Path, artifact_dir: Path,
               concurrency: int, duration_s: float, seed: int = 42) -> list[str]:
    """`aiperf profile` for the AgentX replay of `trace_dir` for `duration_s` (profiled phase;
    `seed`: aiperf's --random-seed). ValueError for traces whose block size aiperf would
    misread (AIPERF_WEKA_BLOCK)."""
    bs = trace_block_size(trace_dir)
    if bs != AIPERF_WEKA_BLOCK:
        raise ValueError(f"{trace_dir}: block_size {bs}; aiperf's weka_trace loader reads hash_ids as "
                         f"{AIPERF_WEKA_BLOCK}-token blocks (regenerate with gen_traces --block-size "
                         f"{AIPERF_WEKA_BLOCK})")
    return [str(aiperf_path()), "profile", *_common(url, model, tokenizer, artifact_dir, concurrency, seed),
            "--scenario", "inferencex-agentx-mvp", "--unsafe-override", "--use-server-token-count",
            "--custom-dataset-type", "weka_trace", "--input-file", str(trace_dir),
            "--benchmark-duration", str(duration_s)]


def synthetic_cmd(url: str, model: str, tokenizer: Path, artifact_dir: Path, concurrency: int,
                  requests: int, isl: int = 512, osl: int = 128, tick_rate: float = 50.0,
                  seed: int = 42) -> list[str]:
    """`aiperf profile` sending `requests` random `isl`-token prompts for exactly `osl` tokens
    (after one warm-up request).

    NOTE: with --concurrency alone, aiperf 0.13's timing manager re-checks for a free slot in
    a loop that only yields to its event loop: one core at 100% for the whole run (measured:
    93% in `top`, py-spy: RequestRateStrategy.execute_phase), half of this 2-core machine taken
    from the server under test. `tick_rate` > 0 adds `--request-rate tick_rate` (constant
    arrivals) under the same concurrency cap: a freed slot is refilled at the next tick
    (<= 1/tick_rate s later) and the loop sleeps between ticks. 0 keeps aiperf's burst mode.
    The same `seed` gives the same prompts: runs that must not hit a server's prefix cache
    with an earlier run's prompts need different seeds. Within a run every request, the
    warm-up included, gets its own prompt: aiperf makes as many conversations as requests and
    takes them in order, so with only `requests` of them the last request repeated the first
    prompt (the warm-up's) and hit a prefix cache (seen as 528 cached tokens in a c1 run).
    """
    pacing = ["--request-rate", str(tick_rate), "--arrival-pattern", "constant"] if tick_rate > 0 else []
    return [str(aiperf_path()), "profile", *_common(url, model, tokenizer, artifact_dir, concurrency, seed),
            "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--request-count", str(requests), "--warmup-request-count", "1",
            "--conversation-num", str(requests + 1), *pacing]


def run(cmd: list[str], artifact_dir: Path, timeout_s: float) -> int:
    """Run aiperf with its console output in `artifact_dir`/aiperf.log; returns its exit code
    (124 when it ran past `timeout_s` and was killed). aiperf runs in its own process group
    (a terminal's Ctrl-C does not reach it), so an exception here (KeyboardInterrupt, the
    SystemExit of a SIGTERM handler) kills that group before it propagates."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    with open(artifact_dir / "aiperf.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return 124
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class Result:
    """One aiperf run's numbers (latencies in ms, throughputs per second)."""

    ttft: dict[str, float]  # p50/p90/p99/avg
    itl: dict[str, float]
    e2e: dict[str, float]
    output_tps: float
    input_tps: float
    request_throughput: float
    requests: int  # profiled requests that completed (success + error)
    errors: int
    duration_s: float

    def to_json(self) -> dict:
        return {"ttft_ms": self.ttft, "itl_ms": self.itl, "e2e_ms": self.e2e,
                "output_tok_s": self.output_tps, "input_tok_s": self.input_tps,
                "request_throughput": self.request_throughput, "requests": self.requests,
                "errors": self.errors, "duration_s": self.duration_s}


def _pcts(metric: dict | None) -> dict[str, float]:
    metric = metric or {}
    return {k: float(metric[k]) for k in (*PERCENTILES, "avg") if k in metric}


def _avg(summary: dict, name: str) -> float:
    return float((summary.get(name) or {}).get("avg", 0.0))


def _value(rec: dict, metric: str) -> float:
    return float((rec.get("metrics", {}).get(metric) or {}).get("value", 0.0))


def span_rates(records: list[dict]) -> tuple[float, float, float, float] | None:
    """(output tok/s, input tok/s, requests/s, span s) of the successful records over their span,
    the first request's start to the last response (aiperf's "benchmark duration"); None without
    timestamps.

    aiperf's own throughputs divide by its phase's observation window instead, which for the
    AgentX replay ends either when the last subagent session is cut off or after the 30 s grace
    period for one still pending: the same 167 requests and 9,050 output tokens read 60.3 tok/s
    in one run (150 s window) and 74.5 in another (121.5 s), while their spans were 119.7 and
    121.2 s. Over the span the runs compare (75.6 and 74.7 tok/s); for the synthetic workload the
    two agree within 0.2%."""
    ok = [r for r in records if not r.get("error")]
    starts = [r.get("metadata", {}).get("request_start_ns") for r in ok]
    ends = [r.get("metadata", {}).get("request_end_ns") for r in ok]
    if not ok or None in starts or None in ends:
        return None
    span = (max(ends) - min(starts)) / 1e9
    if span <= 0:
        return None
    out = sum(_value(r, "output_sequence_length") for r in ok)
    inp = sum(_value(r, "input_sequence_length") for r in ok)
    return out / span, inp / span, len(ok) / span, span


def load_result(artifact_dir: Path) -> Result:
    """Read a finished run's summary. Raises FileNotFoundError when aiperf wrote none.
    Throughputs are over the profiled requests' span (span_rates), aiperf's where the records
    carry no timestamps."""
    summary = json.loads((artifact_dir / SUMMARY).read_text())
    records = list(load_records(artifact_dir))
    errors = max(sum(1 for r in records if r.get("error")),
                 sum(int(e.get("count", 1)) for e in summary.get("error_summary") or []))
    completed = int(_avg(summary, "completed_request_count") or _avg(summary, "request_count"))
    rates = span_rates(records) or (_avg(summary, "output_token_throughput"), _avg(summary, "input_token_throughput"),
                                     _avg(summary, "request_throughput"), _avg(summary, "benchmark_duration"))
    return Result(ttft=_pcts(summary.get("time_to_first_token")), itl=_pcts(summary.get("inter_token_latency")),
                  e2e=_pcts(summary.get("request_latency")), output_tps=rates[0], input_tps=rates[1],
                  request_throughput=rates[2], requests=max(completed, len(records)), errors=errors,
                  duration_s=rates[3])


def load_records(artifact_dir: Path, phase: str = "profiling"):
    """Per-request records of `phase` ("profiling" or "warmup") from profile_export.jsonl."""
    path = artifact_dir / RECORDS
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if rec.get("metadata", {}).get("benchmark_phase", phase) == phase:
                    yield rec


def record_values(artifact_dir: Path, metric: str) -> list[float]:
    """One metric's per-request values (profiled, successful requests) for distributions."""
    out = []
    for rec in load_records(artifact_dir):
        m = rec.get("metrics", {}).get(metric)
        if m is not None and not rec.get("error"):
            out.append(float(m["value"]))
    return out
