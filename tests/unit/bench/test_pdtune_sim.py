"""bench/pdtune: the simulator against hand-computed timelines, goodput, split enumeration,
cost-curve interpolation, and weka-trace loading.

Every cost below is a dyadic fraction, so the sums are exact in binary floating point and the
expected times compare with ==.
"""
import json
from dataclasses import dataclass

import pytest

from bench.pdtune.costs import CostCurves, Curve1, Grid2
from bench.pdtune.report import RequestResult, goodput, percentile, recommend, summarize
from bench.pdtune.sim import Simulator, simulate
from bench.pdtune.split import Limits, Split, splits
from bench.pdtune.workload import Call, Fork, Session, load_trace_dir, synthetic


@dataclass
class Fixed:
    """prefill: 1 s per 64 new tokens + 1 s per 256 cached; decode step: 0.5 s + 0.25 s per
    row; stage 0.125 s and transfer 0.25 s per request whatever its size."""

    kv_bytes_per_token: float = 1.0

    def prefill_s(self, new: int, cached: int) -> float:
        return new / 64 + cached / 256

    def decode_s(self, batch: int, ctx: float) -> float:
        return 0.5 + 0.25 * batch

    def stage_s(self, nbytes: float) -> float:
        return 0.125

    def transfer_s(self, nbytes: float) -> float:
        return 0.25


def timeline(results):
    return sorted((r.start_s, r.ttft_s, r.e2e_s) for r in results)


def test_colocated_two_requests_share_prefill_and_decode_steps():
    # t=0 one step prefills both 128-token prompts: 2 + 2 = 4 s -> both first tokens at 4.
    # Then decode steps of 2 rows, 0.5 + 0.5 = 1 s: token 2 at 5, token 3 at 6 (done).
    res = simulate(Split(colocated=1), Fixed(), synthetic(128, 3, 2), concurrency=2)
    assert timeline(res) == [(0.0, 4.0, 6.0), (0.0, 4.0, 6.0)]
    assert [r.itl_s for r in res] == [1.0, 1.0]  # (6 - 4) / 2


def test_chunked_prefill_stalls_decode_on_a_colocated_rank():
    # Budget 192 tokens a step. A (128 in, 5 out) at t=0; B (128 in, 2 out) arrives at t=3.
    # 0 -> 2      A's prompt (2 s): A token 1 at 2 (TTFT 2)
    # 2 -> 2.75   A decodes alone (0.75): token 2
    # 2.75 -> 3.5 A token 3 (B arrived at 3, waits for the step to end)
    # 3.5 -> 6.25 A's decode row + B's whole prompt in one step (0.75 + 2): A token 4, B token 1
    # 6.25 -> 7.25 two rows (1 s): A token 5 (done), B token 2 (done)
    sessions = [Session("a", (Call(128, 5),)), Session("b", (Call(128, 2, delay_s=3.0),))]
    res = simulate(Split(colocated=1), Fixed(), sessions, concurrency=2, limits=Limits(max_num_batched_tokens=192))
    a, b = sorted(res, key=lambda r: r.start_s)
    assert (a.start_s, a.ttft_s, a.e2e_s, a.itl_s) == (0.0, 2.0, 7.25, 1.3125)  # (7.25 - 2) / 4
    assert (b.start_s, b.ttft_s, b.e2e_s, b.itl_s) == (3.0, 3.25, 4.25, 1.0)
    assert b.phases["prefill_wait"] == 0.5  # arrived at 3, admitted at the step starting at 3.5
    assert (a.phases["prefill_stall"], a.phases["decode"]) == (2.0, 3.25)  # B's chunk; 0.75 + 0.75 + 0.75 + 1


def test_long_prompt_is_chunked_over_steps():
    # 300 tokens, budget 128: chunks 128, 128, 44 -> 2 + (2 + 128/256) + (44/64 + 256/256)
    # (each chunk after the first pays for the tokens already in KV as "cached").
    res = simulate(Split(colocated=1), Fixed(), synthetic(300, 1, 1), concurrency=1,
                   limits=Limits(max_num_batched_tokens=128))
    assert res[0].ttft_s == 2 + 2.5 + (44 / 64 + 1.0)
    assert res[0].e2e_s == res[0].ttft_s and res[0].itl_s is None


def test_pd_one_prefill_one_decode_by_hand():
    # Prefill rank, one step: both prompts (2 + 2) + staging both (2 * 0.125) = 4.25 -> TTFT 4.25.
    # Reads one at a time: r1 4.25 -> 4.5, r2 4.5 -> 4.75.
    # Decode rank: r1 alone 4.5 -> 5.25 (token 2); r1 + r2 5.25 -> 6.25 (r1 token 3: done;
    # r2 token 2); r2 alone 6.25 -> 7.0 (token 3: done).
    res = simulate(Split(prefill=1, decode=1), Fixed(), synthetic(128, 3, 2), concurrency=2)
    first, second = sorted(res, key=lambda r: r.e2e_s)
    assert (first.ttft_s, first.e2e_s, first.itl_s) == (4.25, 6.25, 1.0)
    assert (second.ttft_s, second.e2e_s, second.itl_s) == (4.25, 7.0, 1.375)
    assert first.phases == {"prefill_wait": 0.0, "prefill": 4.25, "admission_wait": 0.0, "transfer": 0.25,
                            "first_decode": 0.75, "decode": 1.0}
    assert second.phases == {"prefill_wait": 0.0, "prefill": 4.25, "admission_wait": 0.25, "transfer": 0.25,
                             "first_decode": 1.5, "decode": 0.75}


def test_pd_one_token_request_ends_on_the_prefill_rank():
    # No handoff: no staging, no transfer, no decode step.
    res = simulate(Split(prefill=1, decode=1), Fixed(), synthetic(64, 1, 1), concurrency=1)
    assert (res[0].ttft_s, res[0].e2e_s) == (1.0, 1.0)


def test_prefix_hit_from_the_conversations_previous_turn():
    # Turn 1: 128 tokens (blocks 1, 2 of 64), 1 s of prefill per 64 -> done at 2; stores both.
    # Turn 2 after a 0.5 s gap (t=2.5): 192 tokens, blocks 1, 2 hit (128 tokens), 64 new:
    # 64/64 + 128/256 = 1.5 s -> TTFT 1.5.
    s = Session("conv", (Call(128, 1, (1, 2), 64), Call(192, 1, (1, 2, 3), 64, delay_s=0.5)))
    t1, t2 = sorted(simulate(Split(colocated=1), Fixed(), [s], concurrency=1), key=lambda r: r.start_s)
    assert (t1.start_s, t1.ttft_s, t1.cached_tokens) == (0.0, 2.0, 0)
    assert (t2.start_s, t2.ttft_s, t2.cached_tokens) == (2.5, 1.5, 128)


def test_a_full_prefix_hit_still_computes_the_last_page():
    # 128 tokens repeated: the hit is capped at (128 - 1) // 16 * 16 = 112 tokens.
    s = Session("rep", (Call(128, 1, (1, 2), 64), Call(128, 1, (1, 2), 64)))
    res = sorted(simulate(Split(colocated=1), Fixed(), [s], concurrency=1), key=lambda r: r.start_s)
    assert res[1].cached_tokens == 112
    assert res[1].ttft_s == 16 / 64 + 112 / 256


def test_cache_aware_routing_keeps_conversations_on_their_rank():
    # Two conversations on two colocated ranks: the first turns spread (least loaded), each
    # second turn returns to the rank holding its prefix (both hit 128 tokens).
    conv = [Session(n, (Call(128, 1, (1, 2), 64), Call(192, 1, (1, 2, 3), 64, delay_s=0.5))) for n in "ab"]
    res = simulate(Split(colocated=2), Fixed(), conv, concurrency=2)
    assert sorted(r.cached_tokens for r in res) == [0, 0, 128, 128]


def test_forked_subagents_run_side_by_side_and_join():
    # Parent call (64 in: 1 s), then two subagent chains of one 64-token call each (batched in
    # one 2 s step), then the parent's last call starts when both are done (t=3).
    s = Session("p", (Call(64, 1), Fork(((Call(64, 1),), (Call(64, 1),))), Call(64, 1)))
    res = simulate(Split(colocated=1), Fixed(), [s], concurrency=1)
    assert sorted(r.start_s for r in res) == [0.0, 1.0, 1.0, 3.0]
    assert max(r.end_s for r in res) == 4.0


def test_closed_loop_concurrency_and_duration_cutoff():
    # Concurrency 1: each request (64 in, 1 out: 1 s) starts when the previous ends.
    res = simulate(Split(colocated=1), Fixed(), synthetic(64, 1, 3), concurrency=1)
    assert [r.start_s for r in res] == [0.0, 1.0, 2.0]
    # With a duration the sessions repeat until it; nothing starts at or after 2.5 s.
    res = simulate(Split(colocated=1), Fixed(), synthetic(64, 1, 1), concurrency=1, duration_s=2.5)
    assert [r.start_s for r in res] == [0.0, 1.0, 2.0]


def test_agentx_session_entered_at_t_star_after_one_warmup_call():
    # Recorded starts 0, 10, 20, 30 s; t* = 0.5 x 30 = 15. Warm-up: the last call before t*
    # (128 tokens, blocks 0-1) with 1 output token, 0 -> 2 s, unreported. Then the call at 20
    # after its gap past t* (5 s): 192 tokens, 128 cached: 1 + 0.5 s (7 -> 8.5); the call at 30
    # right after: 256 tokens, 192 cached: 1 + 0.75 s. The call at 0 is never sent.
    calls = tuple(Call(64 * (k + 1), 4, tuple(range(k + 1)), 64, 0.0, 10.0 * k) for k in range(4))
    res = simulate(Split(colocated=1), Fixed(), [Session("t", calls)], concurrency=1,
                   trajectory_start=(0.5, 0.5))
    assert [(r.start_s, r.ttft_s, r.cached_tokens) for r in res] == [(7.0, 1.5, 128), (8.5 + 3 * 0.75, 1.75, 192)]
    # The duration counts from the end of the warm-up (2 s): 6.5 s stops before the last call.
    cut = simulate(Split(colocated=1), Fixed(), [Session("t", calls)], concurrency=1, duration_s=6.5,
                   trajectory_start=(0.5, 0.5))
    assert [r.start_s for r in cut] == [7.0]


def test_agentx_warmup_barrier_aligns_sessions_at_t_star():
    # t* = half of each session's span: A (t 0, 10): t* 5, warm-up a0; B (t 0..30): t* 15,
    # warm-up b1. Both warm-ups in one step (0 -> 2); then each waits its gap past t*
    # (a1: 10 - 5, b2: 20 - 15): both at 7 in one step (-> 9), then b3 (9 -> 10).
    a = Session("a", tuple(Call(64, 1, t=10.0 * k) for k in range(2)))
    b = Session("b", tuple(Call(64, 1, t=10.0 * k) for k in range(4)))
    res = simulate(Split(colocated=1), Fixed(), [a, b], concurrency=2, trajectory_start=(0.5, 0.5))
    assert sorted((r.start_s, r.ttft_s) for r in res) == [(7.0, 2.0), (7.0, 2.0), (9.0, 1.0)]


def test_ranks_computing_at_once_share_the_cores():
    # 2 colocated ranks, 1 core for both: two 128-token prompts (2 s each at full speed) run
    # side by side at half speed -> both first tokens at 4. One 64-token prompt alone: 1 s.
    res = simulate(Split(colocated=2), Fixed(), synthetic(128, 1, 2), concurrency=2, cpu_cores=1.0)
    assert [r.ttft_s for r in res] == [4.0, 4.0]
    # Staggered: A (128: 2 s of work) at 0, B (64: 1 s) at 1. 0 -> 1 A alone (1 s of work
    # done); 1 -> 3 both at half speed (A's last second, B's whole second): both end at 3.
    sessions = [Session("a", (Call(128, 1),)), Session("b", (Call(64, 1, delay_s=1.0),))]
    res = simulate(Split(colocated=2), Fixed(), sessions, concurrency=2, cpu_cores=1.0)
    assert sorted((r.start_s, r.e2e_s) for r in res) == [(0.0, 3.0), (1.0, 2.0)]
    # 2 cores for 2 ranks: no slowdown.
    res = simulate(Split(colocated=2), Fixed(), synthetic(128, 1, 2), concurrency=2, cpu_cores=2.0)
    assert [r.ttft_s for r in res] == [2.0, 2.0]


def test_splits_and_names():
    assert [s.name for s in splits(1)] == ["colocated-1"]
    assert [s.name for s in splits(4)] == ["colocated-4", "1P3D", "2P2D", "3P1D"]
    assert [s.name for s in splits(3, cond=True)] == ["colocated-3", "1P2D", "1P2D+cond", "2P1D", "2P1D+cond"]
    assert all(s.ranks == 4 for s in splits(4))
    assert Split.parse("2p1d") == Split(prefill=2, decode=1)
    assert Split.parse("2P2D+cond") == Split(prefill=2, decode=2, cond=True)
    assert Split.parse("colocated-3") == Split(colocated=3)
    with pytest.raises(ValueError):
        Split(prefill=1)
    with pytest.raises(ValueError):
        Split(colocated=1, decode=1)
    with pytest.raises(ValueError):
        Split(colocated=2, cond=True)
    with pytest.raises(ValueError):
        Split.parse("1P1D+maybe")


# Conditional disaggregation (xPyD+cond) with Fixed: the rule's stall budget next to an idle
# decode rank is 2 decode steps of 1 row, 2 x 0.75 = 1.5 s of prefill: up to 96 tokens.
COND = Split(prefill=1, decode=1, cond=True)


def test_cond_short_prompt_is_prefilled_on_the_decode_rank():
    # 64 tokens (1 s <= 1.5): the decode rank prefills (TTFT 1, no staging or transfer), then
    # decodes alone, 0.75 s a token. Plain 1P1D: 1 + 0.125 stage, 0.25 read, 0.75 a token.
    sim = Simulator(COND, Fixed(), synthetic(64, 3, 1), concurrency=1)
    [r] = sim.run()
    assert (r.ttft_s, r.e2e_s, sim.placed_local) == (1.0, 2.5, 1)
    assert r.phases == {"prefill_wait": 0.0, "prefill": 1.0, "decode": 1.5, "prefill_stall": 0.0}
    [pd] = simulate(Split(prefill=1, decode=1), Fixed(), synthetic(64, 3, 1), concurrency=1)
    assert (pd.ttft_s, pd.e2e_s) == (1.125, 2.875)


def test_cond_long_prompt_goes_to_the_idle_prefill_rank():
    # 128 tokens: 2 s > 1.5, and the idle prefill rank saves nothing: the plain PD timeline.
    sim = Simulator(COND, Fixed(), synthetic(128, 3, 1), concurrency=1)
    res = sim.run()
    assert sim.placed_local == 0
    assert timeline(res) == timeline(simulate(Split(prefill=1, decode=1), Fixed(), synthetic(128, 3, 1), 1))


def test_cond_second_long_prompt_goes_local_behind_a_queued_one():
    # Two 128-token prompts at t=0. r1 -> the prefill rank (idle). r2 finds r1's 2 s queued there:
    # (2 + 2 + 0.375) - 2 = 2.375 s saved > its 2 s local prefill -> the decode rank prefills it.
    # Prefill rank: r1 2 + 0.125 stage -> TTFT 2.125, read -> 2.375. Decode rank: r2 0 -> 2
    # (TTFT 2), r2 alone 2 -> 2.75, r1 + r2 2.75 -> 3.75 (r2 done), r1 alone -> 4.5 (done).
    sim = Simulator(COND, Fixed(), synthetic(128, 3, 2), concurrency=2)
    res = sim.run()
    assert sim.placed_local == 1
    assert sorted((r.ttft_s, r.e2e_s) for r in res) == [(2.0, 3.75), (2.125, 4.5)]
    # Plain 1P1D: both prompts in one prefill step, 4 + 2 x 0.125: TTFT 4.25 for both.
    assert [r.ttft_s for r in simulate(Split(prefill=1, decode=1), Fixed(), synthetic(128, 3, 2), 2)] == [4.25] * 2


def test_goodput_and_summary():
    # Span: first start 0 to last end 4 s. SLO 500 ms TTFT, 100 ms ITL.
    rs = [RequestResult(0.0, 0.2, 1.0, 10, 10),   # ITL (1.0 - 0.2) / 9 = 89 ms: meets
          RequestResult(1.0, 0.6, 2.0, 10, 10),   # TTFT 600 ms: misses
          RequestResult(2.0, 0.3, 2.0, 10, 2),    # ITL 1.7 s: misses
          RequestResult(3.0, 0.4, 0.4, 10, 1)]    # one token: no ITL, TTFT meets
    assert goodput(rs, 500, 100) == 2 / 4.0
    s = summarize(rs, 500, 100)
    assert (s["requests"], s["slo_met"], s["span_s"]) == (4, 2, 4.0)
    assert s["ttft_ms_p50"] == pytest.approx(350.0)
    assert s["output_tps"] == 23 / 4.0
    assert s["itl_ms_p50"] == pytest.approx(1000 * 1.4 / 9)  # 88.9, 155.6, 1700
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    rows = {"colocated-2": dict(s, goodput_rps=0.5), "1P1D": dict(s, goodput_rps=0.75)}
    assert recommend(rows) == "1P1D"


def test_cost_curves_interpolate_and_pick_threads(tmp_path):
    g = Grid2([0.0, 100.0], [0.0, 1000.0], [[0.0, 1.0], [2.0, 3.0]])
    assert g(50, 500) == 1.5
    assert g(200, 0) == 4.0  # linear extrapolation along new tokens
    curves = CostCurves("m", 2, 10.0, {1: g, 2: Grid2([0.0, 100.0], [0.0], [[0.0], [1.0]])},
                        {1: Grid2([1.0, 2.0], [0.0], [[0.5], [0.75]]), 2: Grid2([1.0], [0.0], [[0.25]])},
                        Curve1([0.0, 100.0], [0.0, 1.0]), Curve1([0.0], [0.0]))
    path = tmp_path / "costs.json"
    curves.save(path)
    back = CostCurves.load(path)
    two = back.for_ranks(1)  # 2 cores, 1 rank: 2 threads
    assert (two.threads, two.slowdown, two.decode_s(1, 0)) == (2, 1.0, 0.25)
    four = back.for_ranks(4)  # 4 ranks on 2 cores: 1 thread each, twice as slow
    assert (four.threads, four.slowdown, four.decode_s(2, 0)) == (1, 2.0, 1.5)
    assert back.for_ranks(4, cores=8).slowdown == 1.0  # planning past this machine: 2 threads each
    assert back.for_ranks(4, shared=True).slowdown == 1.0  # the simulator shares the cores itself


def test_weka_trace_directory_loads_gaps_and_subagents(tmp_path):
    trace = {"id": "t0", "models": ["m"], "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0,
             "system_tokens": 0, "requests": [
                 {"t": 0.0, "type": "n", "model": "m", "in": 100, "out": 5, "hash_ids": [1, 2], "api_time": 1.0},
                 {"t": 3.0, "type": "subagent", "agent_id": "a1", "subagent_type": "Explore", "status": "completed",
                  "duration_ms": 2000, "models": ["m"], "requests": [
                      {"t": 0.5, "type": "n", "model": "m", "in": 50, "out": 2, "hash_ids": [9], "api_time": 0.5}]},
                 {"t": 6.0, "type": "s", "model": "m", "in": 200, "out": 0, "hash_ids": [1, 2, 3, 4]}]}
    (tmp_path / "trace_000.json").write_text(json.dumps(trace))
    [s] = load_trace_dir(tmp_path)
    first, fork, last = s.items
    assert (first.input_tokens, first.output_tokens, first.hash_ids, first.delay_s) == (100, 5, (1, 2), 0.0)
    assert fork.delay_s == 2.0  # 3.0 - (0.0 + 1.0)
    assert fork.chains[0][0].delay_s == 0.5  # relative child t: spawned at 3.0, sent at 3.5
    assert (last.output_tokens, last.delay_s) == (1, 1.0)  # out 0 -> 1; 6.0 - (3.0 + 2.0)
    assert s.num_calls() == 3


def test_a_recycled_lane_starts_its_session_at_turn_0():
    # aiperf recycles a finished lane into a fresh session from turn 0: only the first instance
    # is entered at t* (warm-up, then the calls of 192 and 256 tokens); the next one sends
    # every call from the first (64, 128, ...), with no warm-up call.
    calls = tuple(Call(64 * (k + 1), 4, tuple(range(k + 1)), 64, 0.0, 10.0 * k) for k in range(4))
    res = simulate(Split(colocated=1), Fixed(), [Session("t", calls)], concurrency=1, duration_s=40.0,
                   trajectory_start=(0.5, 0.5))
    assert [r.input_tokens for r in res][:4] == [192, 256, 64, 128]
