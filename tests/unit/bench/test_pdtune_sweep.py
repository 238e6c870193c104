"""bench/pdtune/sweep.py: aiperf per-request records (profile_export.jsonl) and a compare run's
summary.json, read back into goodput per split. The fixture records are synthetic, in the
shape aiperf 0.13 writes (MetricRecordInfo: metadata, metrics {tag: {value, unit}}, error)."""
import json

import pytest

from bench.pdtune.sweep import parse_profile_export, read_run, split_name


def record(start_s, ttft_ms, latency_ms, osl, itl_ms=None, phase="profiling", error=None, isl=1000, cached=800):
    metrics = {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
               "request_latency": {"value": latency_ms, "unit": "ms"},
               "input_sequence_length": {"value": isl, "unit": "tokens"},
               "output_sequence_length": {"value": osl, "unit": "tokens"},
               "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"}}
    if itl_ms is not None:
        metrics["inter_token_latency"] = {"value": itl_ms, "unit": "ms"}
    if error:
        metrics = {"request_latency": {"value": latency_ms, "unit": "ms"}}
    return {"metadata": {"session_num": 0, "x_correlation_id": "c0", "conversation_id": "agentx-s42-000",
                         "turn_index": 0, "request_start_ns": int(start_s * 1e9),
                         "request_end_ns": int((start_s + latency_ms / 1e3) * 1e9), "worker_id": "w0",
                         "record_processor_id": "r0", "benchmark_phase": phase},
            "metrics": metrics, "error": error}


ROWS = [record(0.0, 100.0, 1000.0, 10, itl_ms=100.0),   # meets 500 ms / 120 ms
        record(0.5, 900.0, 2000.0, 12, itl_ms=100.0),   # TTFT misses
        record(1.0, 200.0, 3000.0, 5, itl_ms=700.0),    # ITL misses
        record(2.0, 300.0, 2000.0, 11, itl_ms=None),    # no ITL in the record: (2000 - 300) / 10 = 170: misses
        record(3.0, 50.0, 1000.0, 3, itl_ms=40.0),      # meets; ends at 4.0 s
        record(9.0, 50.0, 100.0, 3, phase="warmup"),    # skipped
        record(1.5, 0.0, 10.0, 0, error={"code": 500, "message": "boom"})]  # an error


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_parse_profile_export(tmp_path):
    p = tmp_path / "profile_export.jsonl"
    write_jsonl(p, ROWS)
    results, errors = parse_profile_export(p)
    assert errors == 1
    assert [r.start_s for r in results] == [0.0, 0.5, 1.0, 2.0, 3.0]
    first = results[0]
    assert (first.ttft_s, first.e2e_s, first.itl_s) == pytest.approx((0.1, 1.0, 0.1))
    assert (first.input_tokens, first.output_tokens, first.cached_tokens) == (1000, 10, 800)
    assert results[3].itl_s == pytest.approx(0.17)
    assert [r.meets(500, 120) for r in results] == [True, False, False, False, True]


def test_read_run_goodput_and_phases(tmp_path):
    for name in ("colocated", "pd"):
        write_jsonl(tmp_path / f"{name}.jsonl", ROWS)
    # summary.json schema 1 (bench/agentx/compare.py), abridged to what pd_tune reads.
    summary = {"schema": 1, "configs": [
        {"name": "colocated-2", "ok": True, "records": str(tmp_path / "colocated.jsonl"),
         "server": {"phase_mean_ms": {"queue": 1.0, "prefill": 90.0, "decode": 500.0}}},
        {"name": "1P1D", "ok": True, "records": str(tmp_path / "pd.jsonl"),
         "server": {"phase_mean_ms": {"prefill": 80.0, "transfer": 3.0, "admission_wait": 400.0, "decode": 300.0}}},
        {"name": "2P0D", "ok": False, "error": "did not start", "records": None, "server": None}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    rows = read_run(tmp_path, 500, 120)
    assert set(rows) == {"colocated-2", "1P1D"}
    s = rows["1P1D"]
    # 2 of 5 profiling requests met both SLOs over the span 0 .. 4 s (first start, last end).
    assert (s["requests"], s["errors"], s["slo_met"]) == (5, 1, 2)
    assert s["goodput_rps"] == pytest.approx(2 / 4.0)
    assert s["phases_ms"]["admission_wait"] == 400.0
    assert rows["colocated-2"]["phases_ms"] == {"queue": 1.0, "prefill": 90.0, "decode": 500.0}


@pytest.mark.parametrize("raw,name", [("colocated-2", "colocated-2"), ("colocated2", "colocated-2"),
                                      ("colo4", "colocated-4"), ("1P1D", "1P1D"), ("pd-2p1d", "2P1D")])
def test_split_names_from_compare_runs(raw, name):
    assert split_name(raw) == name


def test_from_run_without_duration_simulates_the_runs_duration(tmp_path):
    """--compare-sim replays what the run profiled: its duration_s when --duration is not given
    (every session once would be another workload); an explicit --duration stays."""
    from argparse import Namespace

    from bench.pdtune.sweep import run_sweep
    write_jsonl(tmp_path / "c.jsonl", ROWS)
    (tmp_path / "summary.json").write_text(json.dumps(
        {"schema": 1, "duration_s": 120.0, "configs": [{"name": "colocated-2", "ok": True,
                                                         "records": str(tmp_path / "c.jsonl"), "server": {}}]}))
    args = Namespace(from_run=[str(tmp_path)], ttft_ms=500, itl_ms=120, duration=None)
    assert set(run_sweep(args)) == {"colocated-2"} and args.duration == 120.0
    args.duration = 30.0
    run_sweep(args)
    assert args.duration == 30.0
