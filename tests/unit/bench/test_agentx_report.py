"""bench/agentx: /metrics deltas (prefix hit rate, phase means, dominant phase), the configs of a
rank budget, and the markdown report built from a summary."""
from __future__ import annotations

import pytest

from bench.agentx import report, server_metrics
from bench.agentx.compare import configs_for

BEFORE = """
# HELP pdserve_prompt_tokens_total prompt tokens
pdserve_prompt_tokens_total 1000.0
pdserve_cached_prompt_tokens_total 500.0
pdserve_completion_tokens_total 100.0
pdserve_phase_seconds_count{phase="queue"} 10.0
pdserve_phase_seconds_sum{phase="queue"} 1.0
pdserve_phase_seconds_count{phase="prefill"} 10.0
pdserve_phase_seconds_sum{phase="prefill"} 2.0
pdserve_phase_seconds_count{phase="decode"} 10.0
pdserve_phase_seconds_sum{phase="decode"} 5.0
pdserve_phase_seconds_bucket{phase="decode",le="0.5"} 3.0
"""
AFTER = """
pdserve_prompt_tokens_total 5000.0
pdserve_cached_prompt_tokens_total 3700.0
pdserve_completion_tokens_total 420.0
pdserve_phase_seconds_count{phase="queue"} 30.0
pdserve_phase_seconds_sum{phase="queue"} 1.2
pdserve_phase_seconds_count{phase="prefill"} 30.0
pdserve_phase_seconds_sum{phase="prefill"} 8.0
pdserve_phase_seconds_count{phase="transfer"} 20.0
pdserve_phase_seconds_sum{phase="transfer"} 0.4
pdserve_phase_seconds_count{phase="decode"} 30.0
pdserve_phase_seconds_sum{phase="decode"} 21.0
pdserve_phase_seconds_bucket{phase="decode",le="0.5"} 9.0
pdserve_rank_host_cache_lookup_tokens{rank="prefill-0"} 3000.0
pdserve_rank_host_cache_lookup_tokens{rank="decode-0"} 1000.0
pdserve_rank_host_cache_hit_tokens{rank="prefill-0"} 2400.0
pdserve_rank_host_cache_hit_tokens{rank="decode-0"} 800.0
pdserve_rank_kv_store_hit_tokens{rank="prefill-0"} 400.0
pdserve_rank_transfer_bytes{rank="decode-0"} 41943040.0
"""


def test_diff_gives_hit_rate_phase_means_and_dominant_phases():
    d = server_metrics.diff(server_metrics.parse(BEFORE), server_metrics.parse(AFTER))
    assert d.prefix_hit_rate == pytest.approx(3200 / 4000)
    assert d.phase_mean_s == pytest.approx({"queue": 0.01, "prefill": 0.3, "transfer": 0.02, "decode": 0.8})
    assert d.mean_output_tokens == pytest.approx(16.0)  # 320 tokens over 20 finished requests
    assert d.dominant(server_metrics.TTFT_PHASES) == ("prefill", pytest.approx(0.3 / 0.31))
    assert d.itl_share_ms() == pytest.approx({"transfer": 20 / 15, "decode": 800 / 15})
    j = d.to_json()
    assert j["itl_dominant_phase"] == "decode" and j["ttft_dominant_phase"] == "prefill"
    # prefix hit by tier (the ranks' counters, summed over ranks) and KV pulled per request
    assert j["host_hit_rate"] == pytest.approx(2800 / 4000) and j["l3_hit_rate"] == pytest.approx(400 / 4000)
    assert j["kv_mib_per_request"] == pytest.approx(40 / 20)


def test_diff_without_traffic_has_no_rate_or_phase():
    s = server_metrics.parse(BEFORE)
    d = server_metrics.diff(s, s)
    assert d.prefix_hit_rate is None and d.phase_mean_s == {} and d.dominant(server_metrics.ITL_PHASES) is None


def test_configs_for_a_rank_budget():
    assert [c.name for c in configs_for(2)] == ["colocated-2", "1P1D"]
    assert [c.launch_args() for c in configs_for(4)] == [
        ["--colocated", "4"], ["--prefill", "1", "--decode", "3"], ["--prefill", "2", "--decode", "2"],
        ["--prefill", "3", "--decode", "1"]]
    assert [c.name for c in configs_for(3, "1p2d,colocated")] == ["1P2D", "colocated-3"]
    with pytest.raises(ValueError, match="unknown config"):
        configs_for(2, "2P2D")


def test_markdown_has_a_row_per_config_and_names_dominant_phases():
    server = server_metrics.diff(server_metrics.parse(BEFORE), server_metrics.parse(AFTER)).to_json()
    client = {"ttft_ms": {"p50": 120.0, "p90": 300.0, "p99": 900.0}, "itl_ms": {"p50": 40.0, "p90": 60.0, "p99": 90.0},
              "e2e_ms": {"p50": 2000.0, "p90": 4000.0, "p99": 6000.0}, "output_tok_s": 55.5, "input_tok_s": 2100.0,
              "request_throughput": 0.9, "requests": 42, "errors": 0, "duration_s": 60.0}
    summary = {"model": "m", "ranks": 2, "trace_dir": "t", "concurrency": 4, "duration_s": 60.0, "cpus": 2,
               "created": "now",
               "configs": [{"name": "colocated-2", "ok": True, "error": None, "client": client, "server": server},
                           {"name": "1P1D", "ok": False, "error": "boom", "client": None, "server": None}]}
    md = report.markdown(summary)
    assert "| colocated-2 | 120 | 300 | 900 | 40 | 60 | 90 | 2000 | 4000 | 6000 | 55.5 | 2100 | 0.900 | 80.0% | 42 | 0 |" in md
    assert "| 1P1D | - |" in md and "**1P1D failed**: boom" in md
    assert "prefill (97%)" in md and "decode (98%, 53.3 ms/token)" in md


def _rec(start_s: float, end_s: float, out: int, inp: int, error: bool = False, phase: str = "profiling") -> dict:
    rec = {"metadata": {"benchmark_phase": phase, "request_start_ns": int(start_s * 1e9),
                        "request_end_ns": int(end_s * 1e9)},
           "metrics": {} if error else {"output_sequence_length": {"value": out},
                                        "input_sequence_length": {"value": inp}}}
    if error:
        rec["error"] = {"code": 500}
    return rec


def test_load_result_takes_throughputs_over_the_profiled_span(tmp_path):
    """aiperf's own throughputs divide by its phase window (here 40 s: a grace period at the
    end); the report's are the successful requests' tokens over their span, 10 s -> 20 s."""
    import json

    from bench.agentx import aiperf_client
    recs = [_rec(5.0, 6.0, 1, 1, phase="warmup"), _rec(10.0, 12.0, 30, 300), _rec(11.0, 20.0, 50, 500),
            _rec(15.0, 16.0, 0, 0, error=True)]
    (tmp_path / aiperf_client.RECORDS).write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    summary = {"output_token_throughput": {"avg": 2.0}, "input_token_throughput": {"avg": 20.0},
               "request_throughput": {"avg": 0.05}, "benchmark_duration": {"avg": 40.0},
               "request_count": {"avg": 3}, "time_to_first_token": {"p50": 1.0, "avg": 1.0}}
    (tmp_path / aiperf_client.SUMMARY).write_text(json.dumps(summary))
    r = aiperf_client.load_result(tmp_path)
    assert r.duration_s == pytest.approx(10.0)
    assert r.output_tps == pytest.approx(8.0) and r.input_tps == pytest.approx(80.0)
    assert r.request_throughput == pytest.approx(0.2)
    assert r.requests == 3 and r.errors == 1
    # records without timestamps: aiperf's numbers
    (tmp_path / aiperf_client.RECORDS).write_text(json.dumps({"metadata": {"benchmark_phase": "profiling"},
                                                              "metrics": {}}) + "\n")
    r = aiperf_client.load_result(tmp_path)
    assert (r.output_tps, r.input_tps, r.request_throughput, r.duration_s) == (2.0, 20.0, 0.05, 40.0)
