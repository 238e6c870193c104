"""--disagg: the placement rule on pure inputs (disagg.py) and the router's reader of the cost
curves (disagg_costs.py) against bench/pdtune's.

Costs below are dyadic fractions so the sums compare exactly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from bench.pdtune.costs import CostCurves
from pd_server.config import RouterConfig
from pd_server.disagg import DisaggPolicy, PlacementInput
from pd_server.disagg_costs import CURVES_DIR, find_costs


@dataclass
class Fixed:
    """prefill: 1/64 s per new token + 1/1024 s per cached; decode step 1/16 s + 1/64 s per row;
    handoff (stage + transfer) 1/32 s a request."""

    kv_bytes_per_token: float = 1.0

    def prefill_s(self, new: int, cached: int) -> float:
        return new / 64 + cached / 1024

    def decode_s(self, batch: int, ctx: float) -> float:
        return 1 / 16 + batch / 64

    def stage_s(self, nbytes: float) -> float:
        return 1 / 64

    def transfer_s(self, nbytes: float) -> float:
        return 1 / 64


AUTO = DisaggPolicy("auto", Fixed())


def one(tokens: int, hit: int = 0, local_hit: int = 0, **kw) -> PlacementInput:
    return PlacementInput(((tokens, hit, local_hit),), **kw)


def test_short_suffix_is_prefilled_on_the_decode_rank():
    # Budget: 2 decode steps of 1 row = 2 * (1/16 + 1/64) = 10/64 s -> up to 10 tokens.
    p = AUTO.decide(one(10))
    assert (p.local, p.reason, p.where, p.stall_budget_s, p.local_s) == (True, "short", "decode", 10 / 64, 10 / 64)
    assert AUTO.decide(one(11)).reason == "long"
    # A bigger batch decoding there buys a bigger budget: 2 * (1/16 + 8/64) = 24/64 s.
    assert AUTO.decide(one(24, decode_batch=8)).reason == "short"
    assert AUTO.decide(one(25, decode_batch=8)).reason == "long"


def test_long_prompt_goes_to_an_idle_prefill_rank():
    p = AUTO.decide(one(640))
    assert (p.local, p.reason, p.where) == (False, "long", "prefill")
    assert p.local_s == 10 and p.remote_s == 10 + 1 / 32


def test_long_prompt_goes_local_when_the_prefill_queue_holds_more_than_it_costs():
    # local 10 s; remote 10 + 1/32 s plus the queue. Local once queue + remote - local > local,
    # i.e. queue > 10 - 1/32 s.
    assert not AUTO.decide(one(640, prefill_wait_s=10 - 1 / 32)).local
    p = AUTO.decide(one(640, prefill_wait_s=10))
    assert (p.local, p.reason) == (True, "faster")
    # Prompts already queued for local prefill on the decode rank count against going local.
    assert not AUTO.decide(one(640, prefill_wait_s=10, decode_wait_s=1)).local


def test_a_prefix_hit_on_the_prefill_rank_keeps_a_long_prompt_there():
    # 576 of 640 tokens cached there: remote = 64/64 + 576/1024 + 1/32; local still 10 s.
    p = AUTO.decide(one(640, hit=576, prefill_wait_s=8))
    assert not p.local and p.remote_s == 1 + 576 / 1024 + 1 / 32
    assert AUTO.decide(one(640, prefill_wait_s=10)).local  # without the hit: faster locally


def test_a_hit_on_the_decode_rank_keeps_the_conversation_there():
    # 640 tokens, 632 of them in the decode rank's host cache (it prefilled the last turn):
    # local 8/64 + 632/1024 s, over the 10/64 s budget, but 10 + 1/32 s on an idle prefill rank.
    p = AUTO.decide(one(640, local_hit=632))
    assert (p.local, p.reason, p.local_s) == (True, "faster", 8 / 64 + 632 / 1024)
    assert AUTO.decide(one(64, local_hit=60)).reason == "short"  # 4/64 + 60/1024 <= 10/64
    assert not AUTO.decide(one(640, hit=632, local_hit=632)).local  # hit on both: stay disaggregated


def test_n_sequences_count_n_times():
    seqs = ((6, 0, 0),) * 2  # 12/64 s of prefill > the 10/64 s budget
    assert AUTO.decide(PlacementInput(seqs)).reason == "long"
    assert AUTO.decide(one(6)).reason == "short"


def test_never_always_and_no_prefill_rank():
    assert DisaggPolicy("never").decide(one(100_000)).where == "decode"
    assert DisaggPolicy("always").decide(one(1)).where == "prefill"
    p = AUTO.decide(one(100_000, prefill_available=False))
    assert (p.where, p.reason) == ("decode", "no prefill rank")
    assert DisaggPolicy("always").prefill_s(100, 0) == 0.0  # no curves outside auto
    with pytest.raises(ValueError):
        DisaggPolicy("auto")
    with pytest.raises(ValueError):
        DisaggPolicy("sometimes", Fixed())
    with pytest.raises(ValueError):
        RouterConfig(disagg="sometimes")


def test_describe_names_the_reason_and_the_numbers():
    assert AUTO.decide(one(640)).describe().startswith("prefill (long: local 10000.0 ms")
    assert DisaggPolicy("never").decide(one(1)).describe() == "decode (never)"


def test_cost_reader_matches_bench_pdtune_on_the_repo_curves():
    path = CURVES_DIR / "smollm2-135m-instruct-cpu2.json"
    f = find_costs("smollm2-135m-instruct")
    assert f.source == str(path)
    ref = CostCurves.load(path)
    for threads in (1, 2):
        mine, theirs = f.at(threads), ref.for_ranks(1, cores=threads)
        assert mine.threads == theirs.threads == threads
        for new, cached in ((1, 0), (32, 0), (100, 500), (700, 0), (2000, 5000)):
            assert mine.prefill_s(new, cached) == theirs.prefill_s(new, cached)
        for batch, ctx in ((1, 10), (5, 700), (40, 5000)):
            assert mine.decode_s(batch, ctx) == theirs.decode_s(batch, ctx)
        for nbytes in (1e3, 1e7, 1e9):
            assert mine.stage_s(nbytes) == theirs.stage_s(nbytes)
            assert mine.transfer_s(nbytes) == theirs.transfer_s(nbytes)
    assert f.at(64).threads == 2 and f.at(0).threads == 1  # nearest measured at or below, else the least


def test_cost_reader_falls_back_to_builtin_and_reads_an_explicit_path(tmp_path):
    f = find_costs("some-other-model")
    assert f.source == "builtin" and f.at(4).prefill_s(256, 0) == pytest.approx(0.3023)
    d = json.loads((CURVES_DIR / "smollm2-135m-instruct-cpu2.json").read_text())
    d["model"] = "mine"
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert find_costs("other", str(tmp_path / "c.json")).model == "mine"
    assert find_costs("mine", curves_dir=tmp_path).source == str(tmp_path / "c.json")
    d["format"] = 99
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError):
        find_costs("mine", str(tmp_path / "bad.json"))
    with pytest.raises(OSError):
        find_costs("mine", str(tmp_path / "missing.json"))


def test_cost_files_measured_in_the_ranks_dtype_come_first(tmp_path):
    """A CPU without native bf16 computes in float32 (prefills 2-3x their bf16 time): the router
    prices placements with curves measured in that dtype where the repository has them."""
    d = json.loads((CURVES_DIR / "smollm2-135m-instruct-cpu2.json").read_text())
    d["model"] = "m"
    del d["meta"]["dtype"]  # written before files named their dtype: bf16
    (tmp_path / "a.json").write_text(json.dumps(d))
    d["meta"]["dtype"] = "float32"
    (tmp_path / "b.json").write_text(json.dumps(d))
    assert find_costs("m", curves_dir=tmp_path).source == str(tmp_path / "a.json")
    assert find_costs("m", curves_dir=tmp_path, dtype="bfloat16").dtype == "bfloat16"
    assert find_costs("m", curves_dir=tmp_path, dtype="float32").source == str(tmp_path / "b.json")
    assert find_costs("m", curves_dir=tmp_path, dtype="float16").source == str(tmp_path / "a.json")  # none: any

    from engine.config import EngineConfig
    from pd_server.config import RouterConfig
    from launcher.launch import LaunchConfig, disagg_costs_for_dtype

    pd, fp32 = LaunchConfig(prefill=1, decode=1), EngineConfig(model="smollm2-135m-instruct", dtype="float32")
    picked = disagg_costs_for_dtype(RouterConfig(), pd, fp32).disagg_costs
    assert picked == str(CURVES_DIR / "smollm2-135m-instruct-cpu2-float32.json")
    assert find_costs("smollm2-135m-instruct", picked).dtype == "float32"
    bf16 = EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16")
    assert disagg_costs_for_dtype(RouterConfig(), pd, bf16).disagg_costs == str(CURVES_DIR / "smollm2-135m-instruct-cpu2.json")
    given = RouterConfig(disagg_costs="/x.json")
    assert disagg_costs_for_dtype(given, pd, fp32) is given  # --disagg-costs wins
    assert disagg_costs_for_dtype(RouterConfig(), LaunchConfig(colocated=2), fp32).disagg_costs == ""
