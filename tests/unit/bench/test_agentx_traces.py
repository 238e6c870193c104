"""bench/agentx/gen_traces.py: size flags, determinism, prefix reuse, the weka_trace fields aiperf
reads, and the committed default set (aiperf's own schema check runs in tests/e2e/test_e2e_aiperf.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.agentx.gen_traces import MANIFEST, GenConfig, agent_chains, generate, main, reuse_ratios, write

ROOT = Path(__file__).resolve().parents[3]
TRACE_KEYS = {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens", "requests", "totals"}
REQUEST_KEYS = {"t", "type", "model", "in", "out", "hash_ids", "stop", "api_time", "think_time"}
SUBAGENT_KEYS = {"t", "type", "agent_id", "subagent_type", "duration_ms", "total_tokens", "tool_use_count",
                 "status", "requests", "models", "tool_tokens", "system_tokens"}


def all_requests(trace: dict) -> list[dict]:
    return [r for chain in agent_chains(trace) for r in chain]


@pytest.mark.parametrize("max_context", [1400, 2048, 3584, 6000])
def test_every_request_fits_max_context(max_context):
    cfg = GenConfig(traces=5, seed=7, max_context=max_context, turns=(30, 40), subagent_prob=0.3)
    traces = generate(cfg)
    peaks = [r["in"] + r["out"] for t in traces for r in all_requests(t)]
    assert max(peaks) <= max_context
    # The cap, not the turn count, ends these long traces: they get close to it.
    assert max(peaks) > 0.8 * max_context


def test_counts_and_ranges_follow_the_flags(tmp_path):
    cfg = GenConfig(traces=4, seed=3, max_context=8000, turns=(3, 5), out_tokens=(10, 20),
                    tool_tokens_min=30, tool_tokens_max=60, subagent_prob=0.0, min_reuse=0.5)
    paths = write(cfg, tmp_path)
    assert [p.name for p in paths] == [f"trace_{i:03d}.json" for i in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, *(p.name for p in paths)]
    for p in paths:
        trace = json.loads(p.read_text())
        reqs = trace["requests"]
        assert 3 <= len(reqs) <= 5 and all(r["type"] == "n" for r in reqs)
        assert all(10 <= r["out"] <= 20 for r in reqs)
        for prev, cur in zip(reqs, reqs[1:]):
            tool = cur["in"] - prev["in"] - prev["out"]  # what the turn appended besides the answer
            assert 30 <= tool <= 60
        assert [r["stop"] for r in reqs] == ["tool_use"] * (len(reqs) - 1) + ["end_turn"]


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    main(["--out", str(a), "--traces", "3", "--seed", "11"])
    main(["--out", str(b), "--traces", "3", "--seed", "11"])
    main(["--out", str(c), "--traces", "3", "--seed", "12"])
    read = lambda d: [p.read_bytes() for p in sorted(d.glob("trace_*.json"))]  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_rewriting_a_directory_drops_old_traces(tmp_path):
    write(GenConfig(traces=5), tmp_path)
    write(GenConfig(traces=2), tmp_path)
    assert len(list(tmp_path.glob("trace_*.json"))) == 2


def test_prefix_reuse_is_in_the_agentx_range():
    traces = generate(replace(GenConfig(), traces=8, seed=5, subagent_prob=0.3))
    ratios = [r for t in traces for r in reuse_ratios(t)]
    assert len(ratios) > 40
    assert min(ratios) >= 0.85
    assert 0.85 <= sum(ratios) / len(ratios) <= 0.97


def test_hash_ids_tile_full_blocks_and_extend_the_previous_prompt():
    for trace in generate(GenConfig(traces=4, seed=9, subagent_prob=0.5)):
        bs = trace["block_size"]
        prefix_blocks = -(-(trace["tool_tokens"] + trace["system_tokens"]) // bs)
        seen: set[int] = set()
        for chain in agent_chains(trace):
            assert len(chain[0]["hash_ids"]) >= prefix_blocks  # aiperf needs the system prefix's blocks
            assert not seen & set(chain[0]["hash_ids"])  # a subagent starts from its own blocks
            for prev, cur in zip(chain, chain[1:]):
                assert cur["hash_ids"][:len(prev["hash_ids"])] == prev["hash_ids"]
                assert cur["t"] >= prev["t"] + prev["api_time"]  # sequential: after the previous response
            for r in chain:
                assert len(r["hash_ids"]) == r["in"] // bs
            seen |= {h for r in chain for h in r["hash_ids"]}


def test_weka_trace_fields_and_subagent_timeline():
    traces = generate(GenConfig(traces=6, seed=1, subagent_prob=0.6))
    subagents = 0
    for trace in traces:
        assert set(trace) == TRACE_KEYS and trace["hash_id_scope"] == "local"
        entries = trace["requests"]
        assert entries[0]["type"] == "n"  # aiperf drops a subagent with no parent request before it
        for i, e in enumerate(entries):
            if e["type"] != "subagent":
                assert set(e) == REQUEST_KEYS
                continue
            subagents += 1
            assert set(e) == SUBAGENT_KEYS and e["status"] == "completed" and e["requests"]
            assert all(set(r) == REQUEST_KEYS and r["t"] >= e["t"] for r in e["requests"])
            end = e["t"] + e["duration_ms"] / 1000
            last = e["requests"][-1]
            assert last["t"] + last["api_time"] <= end + 1e-3
            assert entries[i + 1]["type"] == "n" and entries[i + 1]["t"] >= end  # the parent waits for it
        ids = [e["agent_id"] for e in entries if e["type"] == "subagent"]
        assert len(ids) == len(set(ids))
    assert subagents > 0


def test_too_small_context_is_rejected():
    with pytest.raises(ValueError, match="max-context"):
        GenConfig(max_context=512)


def test_committed_default_set_is_what_the_generator_writes(tmp_path):
    """bench/traces/agentx_default is `gen_traces --out DIR --traces 6 --seed 42` (its README)."""
    committed = ROOT / "bench" / "traces" / "agentx_default"
    main(["--out", str(tmp_path), "--traces", "6", "--seed", "42"])
    names = sorted(p.name for p in committed.glob("trace_*.json"))
    assert names == sorted(p.name for p in tmp_path.glob("trace_*.json")) and len(names) == 6
    for name in names:
        assert (committed / name).read_bytes() == (tmp_path / name).read_bytes()


def test_agentx_cmd_takes_only_the_block_size_aiperf_reads(tmp_path):
    """aiperf 0.13 reads weka hash_ids as 64-token blocks whatever the trace says: the default
    set is written at that size, and a replay of any other is refused before aiperf starts."""
    from bench.agentx import aiperf_client
    committed = ROOT / "bench" / "traces" / "agentx_default"
    assert aiperf_client.trace_block_size(committed) == aiperf_client.AIPERF_WEKA_BLOCK == GenConfig().block_size
    main(["--out", str(tmp_path), "--traces", "1", "--seed", "3", "--block-size", "32"])
    with pytest.raises(ValueError, match="64-token blocks"):
        aiperf_client.agentx_cmd("http://127.0.0.1:1", "m", tmp_path, tmp_path, tmp_path / "a", 1, 1.0)
