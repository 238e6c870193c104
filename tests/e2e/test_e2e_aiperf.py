"""aiperf, the real benchmark client, against a started system (colocated 1, the embedded model).

scripts/setup_aiperf.sh makes `.venv-bench` on first use (a few minutes once, then a stamp
check). A tiny generated trace set must pass aiperf's own `WekaTrace` schema and replay with
the AgentX scenario: every profiled request completes without error, with the trace's output
length (ignore_eos) and about its input length (the chat template adds a few tokens).
scripts/bench_serve.sh then runs two tiny synthetic levels against the same system.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agentx import aiperf_client
from tests.e2e.conftest import ROOT, start_system, stop_system

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
# Small prompts and outputs so the replay is seconds on one thread; subagent_prob 1: every
# middle turn spawns one (aiperf's spawn/join path runs).
GEN_FLAGS = ["--traces", "2", "--seed", "1", "--max-context", "900", "--turns", "3-3", "--out-tokens", "4-8",
             "--tool-tokens-min", "16", "--tool-tokens-max", "48", "--system-tokens", "64",
             "--tool-def-tokens", "64", "--first-user-tokens", "32-64", "--think-time", "0.1-0.3",
             "--subagent-prob", "1", "--subagent-turns", "2-2", "--min-reuse", "0.5"]


@pytest.fixture(scope="module")
def aiperf() -> Path:
    out = subprocess.run([str(ROOT / "scripts" / "setup_aiperf.sh")], check=True, text=True,
                         stdout=subprocess.PIPE, timeout=1200).stdout
    path = Path(out.strip().splitlines()[-1])
    assert path.name == "aiperf" and path.exists()
    return path


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = start_system(tmp_path_factory.mktemp("aiperf-sys"),
                     ["--colocated", "1", "--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1"],
                     timeout=420)
    try:
        yield s
    finally:
        stop_system(s)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("traces")
    subprocess.run([sys.executable, "-m", "bench.agentx.gen_traces", "--out", str(d), *GEN_FLAGS],
                   cwd=ROOT, check=True)
    return d


def test_generated_traces_pass_aiperfs_schema(aiperf, traces):
    check = ("import sys, pathlib\n"
             "from aiperf.dataset.loader.weka_trace_models import WekaTrace\n"
             "for p in sorted(pathlib.Path(sys.argv[1]).glob('trace_*.json')):\n"
             "    t = WekaTrace.model_validate_json(p.read_text())\n"
             "    print(t.id, len(t.requests))\n")
    out = subprocess.run([str(aiperf.parent / "python"), "-c", check, str(traces)], check=True, text=True,
                         stdout=subprocess.PIPE).stdout.split()
    assert out[0::2] == ["agentx-s1-000", "agentx-s1-001"]
    assert all(int(n) == 4 for n in out[1::2])  # 3 requests + 1 subagent entry


def test_agentx_replay_completes_every_request(aiperf, system, traces, tmp_path):
    tokenizer = Path.home() / ".cache" / "pdserve" / "models" / MODEL
    cmd = aiperf_client.agentx_cmd(system.url, MODEL, tokenizer, traces, tmp_path, concurrency=2, duration_s=8)
    assert cmd[0] == str(aiperf)
    rc = aiperf_client.run(cmd, tmp_path, timeout_s=600)
    assert rc == 0, (tmp_path / "aiperf.log").read_text()[-4000:]

    result = aiperf_client.load_result(tmp_path)
    assert result.errors == 0 and result.requests >= 1
    assert result.ttft["p50"] > 0 and result.output_tps > 0
    by_trace = {json.loads(p.read_text())["id"]: json.loads(p.read_text()) for p in traces.glob("trace_*.json")}
    profiled = list(aiperf_client.load_records(tmp_path))
    assert len(profiled) == result.requests
    checked = 0
    for rec in profiled:
        meta, m = rec["metadata"], rec["metrics"]
        assert not rec.get("error")
        assert meta["source_trace_id"] in by_trace  # aiperf replayed our traces, not something else
        if meta["source_kind"] == "weka_main":
            req = by_trace[meta["source_trace_id"]]["requests"][meta["source_outer_idx"]]
            assert m["output_sequence_length"]["value"] == req["out"]  # max_tokens from the trace, ignore_eos
            # aiperf sends text it decoded from trace-sized token blocks; the server re-tokenizes it
            # inside the chat template (+ the [rid:...] marker): about the trace's size, a bit more
            # (3-5% on the default set). Every turn, not only the first: with blocks of another
            # size than aiperf's (AIPERF_WEKA_BLOCK) later prompts stopped growing.
            assert 0.95 * req["in"] <= m["input_sequence_length"]["value"] <= 1.15 * req["in"] + 32
            checked += 1
    assert checked >= 1
    warmup = list(aiperf_client.load_records(tmp_path, phase="warmup"))
    assert all(r["metrics"]["output_sequence_length"]["value"] == 1 for r in warmup)


def test_bench_serve_prints_one_row_per_level(aiperf, system, tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "bench_serve.sh"), system.url, "--concurrency", "1 2",
                           "--requests-per-level", "2", "--isl", "64", "--osl", "8", "--out", str(tmp_path)],
                          cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| concurrency | output tok/s |" in proc.stdout
    levels = json.loads((tmp_path / "summary.json").read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["rc"] == 0 and lv["requests"] == 2 and lv["errors"] == 0
        assert lv["output_tok_s"] > 0 and lv["ttft_ms"]["p50"] > 0
        osl = aiperf_client.record_values(Path(lv["artifact_dir"]), "output_sequence_length")
        assert osl == [8.0, 8.0]  # ignore_eos: exactly --osl tokens
