"""bench/mission: configuration names -> start flags, the run schedule, the report's medians,
sums and ratios on canned run dicts, and that a signal mid-run ends the client's process group
(no servers, no aiperf)."""
from __future__ import annotations

import signal
import time

import pytest

from bench.agentx import aiperf_client, process_group, server_metrics
from bench.mission import table
from bench.mission.cli import _stop_on_signal, parse_args, schedule
from bench.mission.configs import Config, baseline_configs, builtin, parse_configs
from bench.mission.servers import ROOT, Peer, make, peer_missing


def _load(load: str, tok_s: float, ttft50: float, itl50: float, hit: float | None = None,
          requests: int = 10, errors: int = 0) -> dict:
    return {"load": load, "ok": True, "error": None,
            "client": {"output_tok_s": tok_s, "ttft_ms": {"p50": ttft50, "p99": ttft50 * 3},
                       "itl_ms": {"p50": itl50, "p99": itl50 * 2}, "requests": requests, "errors": errors},
            "server": None if hit is None else {"prefix_hit_rate": hit}}


def _run(config: str, rep: int, startup: float | None, loads: list[dict], error: str | None = None) -> dict:
    return {"config": config, "repeat": rep, "startup_s": startup, "error": error, "loads": loads}


RUNS = [
    _run("colocated-2", 0, 20.0, [_load("c8", 100.0, 1000.0, 20.0, 0.0), _load("agentx", 60.0, 400.0, 24.0, 0.8)]),
    _run("2P2D", 0, 30.0, [_load("c8", 150.0, 800.0, 15.0, 0.0), _load("agentx", 66.0, 500.0, 20.0, 0.7)]),
    _run("vllm", 0, 120.0, [_load("c8", 50.0, 2000.0, 40.0), _load("agentx", 30.0, 900.0, 50.0)]),
    _run("2P2D", 1, 34.0, [_load("agentx", 60.0, 700.0, 22.0, 0.75, errors=1),
                           _load("c8", 120.0, 1000.0, 17.0, 0.0)]),
    _run("colocated-2", 1, 22.0, [_load("c8", 110.0, 1200.0, 22.0, 0.0), _load("agentx", 64.0, 420.0, 26.0, 0.8)]),
    _run("2P2D", 2, 32.0, [_load("c8", 135.0, 900.0, 16.0, 0.0)]),  # its replay failed: no agentx entry
    _run("colocated-2", 2, None, [], error="RuntimeError: pd_start.sh exited with 1"),
]


def test_builtin_names_map_to_pd_start_flags():
    assert builtin("2P2D").flags == ("--prefill", "2", "--decode", "2")
    assert builtin("1p1d").flags == ("--prefill", "1", "--decode", "1")
    assert builtin("colocated-2").flags == ("--colocated", "2")
    assert builtin("2P2D-nolend").flags == ("--prefill", "2", "--decode", "2", "--no-lend-cores")
    assert builtin("colocated-2-nolend-shm").flags == ("--colocated", "2", "--no-lend-cores", "--transfer", "shm")
    assert builtin("vllm") == Config("vllm", peer="vllm")
    assert builtin("llamacpp") == Config("llamacpp", peer="llamacpp")
    for bad in ("3X1", "2P2D-fast", "colocated", "0P2D", "vllm-nolend", "llamacpp-shm"):
        with pytest.raises(ValueError):
            builtin(bad)


def test_peers_start_from_their_scripts_and_say_what_is_missing(tmp_path, monkeypatch):
    p = make(builtin("llamacpp"), 8123, "smollm2-135m-instruct", tmp_path)
    assert isinstance(p, Peer) and p.command == [str(ROOT / "scripts" / "peer_llamacpp.sh"), "serve", "--port",
                                                 "8123", "--model", "smollm2-135m-instruct"]
    monkeypatch.setattr("bench.mission.servers.LLAMACPP_BIN", tmp_path / "nothing")
    assert "peer_llamacpp.sh setup" in peer_missing("llamacpp")
    assert peer_missing("2P2D") == ""


def test_config_specs_define_and_override_names():
    got = parse_configs("2P2D,mine", ["mine=--prefill 1 --decode 1 --max-num-seqs 64", "extra=--colocated 1"])
    assert [(c.name, c.flags) for c in got] == [
        ("2P2D", ("--prefill", "2", "--decode", "2")),
        ("mine", ("--prefill", "1", "--decode", "1", "--max-num-seqs", "64")),
        ("extra", ("--colocated", "1"))]  # defined but not listed: run after the list
    assert parse_configs("2P2D", ["2P2D=--prefill 2 --decode 2 --no-lend-cores"])[0].flags[-1] == "--no-lend-cores"
    slow = parse_configs("", ["slow=PDSERVE_FAULT=prefill-0:slow_kv_store:0.1 A=b --colocated 1"])[0]
    assert slow.env == (("PDSERVE_FAULT", "prefill-0:slow_kv_store:0.1"), ("A", "b")) and slow.flags == ("--colocated", "1")
    base = baseline_configs(f"{ROOT}:2P2D,colocated-2")
    assert [(c.name, c.root) for c in base] == [("2P2D@base", str(ROOT)), ("colocated-2@base", str(ROOT))]
    assert base[0].flags == ("--prefill", "2", "--decode", "2")
    with pytest.raises(ValueError, match="pd_start.sh"):
        baseline_configs("/nonexistent:2P2D")
    for names, specs in (("2P2D,2p2d", []), ("x", ["x=--colocated 1", "x=--colocated 2"]), ("", ["x"]),
                         ("", ["x=--colocated 1 --port 9000"]), ("", ["x="]), ("", ["x=A=b"])):
        with pytest.raises(ValueError):
            parse_configs(names, specs)


def test_schedule_interleaves_and_rotates_per_repeat():
    a, b, c = (Config(n) for n in "abc")
    assert [(r, x.name) for r, x in schedule([a, b, c], 2)] == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]
    assert schedule([], 3) == []


def test_args_parse_levels_and_refuse_an_empty_mission():
    a = parse_args(["--configs", "colocated-1", "--levels", "1,8", "--no-agentx", "--out", "/tmp/x"])
    assert a.level_list == [1, 8] and [c.name for c in a.config_list] == ["colocated-1"]
    assert a.model == "smollm2-135m-instruct" and a.model_flag == ""
    with pytest.raises(SystemExit):
        parse_args(["--no-agentx", "--no-synthetic"])


def test_aggregate_takes_medians_sums_and_counts_runs():
    rows = {(r.config, r.load): r for r in table.aggregate(RUNS, ["2P2D", "colocated-2", "vllm"])}
    assert list(rows) == [("2P2D", "c8"), ("2P2D", "agentx"), ("colocated-2", "c8"), ("colocated-2", "agentx"),
                          ("vllm", "c8"), ("vllm", "agentx")]
    pd8 = rows[("2P2D", "c8")]
    assert pd8.medians["out_tok_s"] == 135.0 and pd8.medians["ttft_p50"] == 900.0
    assert pd8.medians["ttft_p99"] == 2700.0 and pd8.medians["itl_p99"] == 32.0
    assert (pd8.runs, pd8.tries, pd8.requests, pd8.startup_s) == (3, 3, 30, 32.0)
    pdx = rows[("2P2D", "agentx")]
    assert pdx.medians["out_tok_s"] == 63.0 and pdx.medians["prefix_hit"] == pytest.approx(0.725)
    assert (pdx.runs, pdx.tries, pdx.errors) == (2, 3, 1)
    co = rows[("colocated-2", "c8")]
    assert co.startup_s == 21.0 and (co.runs, co.tries) == (2, 3)  # the failed start has no time
    assert rows[("vllm", "c8")].medians["prefix_hit"] is None


def test_ratios_divide_by_the_reference_at_the_same_load():
    rows = {(r.config, r.load): r for r in table.aggregate(RUNS)}
    pd8, co8, v8 = rows[("2P2D", "c8")], rows[("colocated-2", "c8")], rows[("vllm", "c8")]
    assert table.ratio(pd8, co8, "out_tok_s") == pytest.approx(135 / 105)
    assert table.ratio(pd8, co8, "ttft_p50") == pytest.approx(900 / 1100)
    assert table.ratio(pd8, v8, "itl_p50") == pytest.approx(16 / 40)
    assert table.ratio(co8, co8, "out_tok_s") is None and table.ratio(pd8, None, "out_tok_s") is None


def test_markdown_has_one_table_with_ratio_columns_and_notes():
    summary = {"model": "m", "created": "t", "cpus": 2, "configs": ["2P2D", "colocated-2", "vllm", "1P1D"],
               "ratio_to": ["colocated-2", "vllm", "absent"], "runs": RUNS,
               "skipped": {"vllm-2": "no venv"}, "settings": {"repeats": 3, "levels": "8"}}
    text = table.markdown(summary)
    tables = [b.splitlines() for b in text.split("\n\n") if b.startswith("|")]
    lines = tables[0]  # the results table; the goals table follows it
    assert tables[1][0] == "| goal | target | measured | per repeat | met |"
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["config", "load", "start s"]
    assert head[-6:] == ["tok/s / colocated-2", "TTFT p50 / colocated-2", "ITL p50 / colocated-2",
                         "tok/s / vllm", "TTFT p50 / vllm", "ITL p50 / vllm"]  # no columns for "absent"
    assert len(lines) == 2 + 6 and all(ln.count("|") == lines[0].count("|") for ln in lines)
    pd8 = [c.strip() for c in lines[2].strip("|").split("|")]
    assert pd8[:4] == ["2P2D", "c8", "32.0", "135.0"] and pd8[-6:] == ["1.29x", "0.82x", "0.76x", "2.70x", "0.45x",
                                                                      "0.40x"]
    assert pd8[head.index("prefix hit")] == "0.0%" and pd8[head.index("runs")] == "3/3"
    co8 = [c.strip() for c in lines[4].strip("|").split("|")]
    assert co8[-6:-3] == ["-"] * 3 and co8[-3:] == ["2.10x", "0.55x", "0.53x"]
    vx = [c.strip() for c in lines[7].strip("|").split("|")]
    assert vx[head.index("prefix hit")] == "-" and vx[-3:] == ["-"] * 3
    assert "**colocated-2 repeat 2**: RuntimeError: pd_start.sh exited with 1" in text
    assert "vllm-2 skipped: no venv" in text


def test_goals_check_the_default_2p2d_by_ratios_of_medians_with_paired_repeats():
    got = {g.what: g for g in table.goals(RUNS)}
    assert list(got) == ["AgentX tok/s / colocated-2", "AgentX TTFT p50 / colocated-2", "AgentX ITL p99 / colocated-2",
                         "c8 tok/s / colocated-2", "AgentX tok/s / vllm", "AgentX TTFT p99 / vllm",
                         "AgentX ITL p99 / vllm", "AgentX errors", "warm start s (starts after the first)"]  # no c32 rows
    tok = got["AgentX tok/s / colocated-2"]
    assert tok.value == pytest.approx(63 / 62) and tok.met and tok.target == ">= 1.00x"
    assert tok.per_repeat == pytest.approx([66 / 60, 60 / 64])  # each repeat against its own repeat
    assert got["AgentX TTFT p50 / colocated-2"].met is False  # 600 / 410
    assert got["AgentX ITL p99 / colocated-2"].value == pytest.approx(42 / 50) and not got["AgentX ITL p99 / colocated-2"].met
    c8 = got["c8 tok/s / colocated-2"]
    assert c8.value == pytest.approx(135 / 105) and c8.per_repeat == pytest.approx([1.5, 120 / 110])  # repeat 2: no ref
    assert got["AgentX TTFT p99 / vllm"].value == pytest.approx(1800 / 2700) and got["AgentX TTFT p99 / vllm"].met
    assert got["AgentX ITL p99 / vllm"].met is False
    assert got["AgentX errors"].value == 1 and got["AgentX errors"].met is False
    warm = got["warm start s (starts after the first)"]
    assert warm.value == 33.0 and warm.met is False and warm.target == "<= 20 s"  # median of 34, 32
    nolend = RUNS + [_run("2P2D-nolend", 0, 30.0, [_load("c8", 140.0, 800.0, 15.0)])]
    assert table.goals(nolend)[-3].what == "c8 tok/s / 2P2D-nolend"
    assert table.goals([r for r in RUNS if r["config"] != "2P2D"]) == []
    one = table.goals([r for r in RUNS if r["config"] != "2P2D" or r["repeat"] == 0])[-1]
    assert (one.what, one.value) == ("start s (one start, maybe cold)", 30.0)
    text = table.markdown({"runs": RUNS, "configs": ["2P2D", "colocated-2", "vllm"], "ratio_to": ["colocated-2"]})
    assert "| AgentX ITL p99 / colocated-2 | <= 0.50x | 0.84x | 0.83x, 0.85x | **no** |" in text


def test_phases_table_gives_medians_of_each_phase_and_the_handoffs_share_of_the_itl():
    def with_phases(run: dict, means: dict, per_token: dict) -> dict:
        for ld in run["loads"]:
            ld["server"] = {"prefix_hit_rate": 0.8, "phase_mean_ms": means, "itl_phase_ms_per_token": per_token}
        return run

    pd = {"queue": 6.0, "prefill": 170.0, "stage": 5.0, "admission_wait": 8.0, "transfer": 18.0, "first_decode": 18.0,
          "decode": 800.0}
    runs = [with_phases(_run("2P2D", 0, 8.0, [_load("agentx", 80.0, 150.0, 15.0)]), pd,
                        {"stage": 0.1, "admission_wait": 0.2, "transfer": 0.3, "first_decode": 0.4, "decode": 15.0}),
            with_phases(_run("2P2D", 1, 8.0, [_load("agentx", 80.0, 150.0, 15.0)]), {**pd, "queue": 10.0},
                        {"stage": 0.2, "admission_wait": 0.2, "transfer": 0.4, "first_decode": 0.4, "decode": 17.0}),
            with_phases(_run("colocated-2", 0, 5.0, [_load("agentx", 80.0, 140.0, 15.0)]),
                        {"queue": 9.0, "prefill": 150.0, "decode": 820.0}, {"decode": 16.0}),
            _run("vllm", 0, 70.0, [_load("agentx", 50.0, 230.0, 44.0, 0.77)])]  # no phases: no row
    rows = table.aggregate(runs)
    lines = table.phases_table(rows, runs).splitlines()
    assert lines[0] == ("| config | load | queue | prefill | stage | admission wait | transfer | first decode | "
                        "handoff ms/token | decode ms/token |")
    assert lines[2] == "| 2P2D | agentx | 8.0 | 170.0 | 5.0 | 8.0 | 18.0 | 18.0 | 1.1 | 16.0 |"  # 1.0 and 1.2
    assert lines[3] == "| colocated-2 | agentx | 9.0 | 150.0 | - | - | - | - | - | 16.0 |"
    assert len(lines) == 4
    assert table.phases_table(table.aggregate(RUNS), RUNS) == ""  # servers without phases
    assert lines[2] in table.markdown({"runs": runs, "configs": ["2P2D", "colocated-2", "vllm"]})


def test_vllm_prefix_counters_give_a_hit_rate():
    before = server_metrics.parse('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
                                  'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n')
    after = server_metrics.parse('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1100.0\n'
                                 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 810.0\n')
    assert server_metrics.diff(before, after).prefix_hit_rate == pytest.approx(0.8)
    assert server_metrics.diff({}, server_metrics.parse("other_total 3\n")).prefix_hit_rate is None


def test_a_signal_during_a_client_run_kills_its_process_group(tmp_path):
    # The mission's SIGTERM handler raises SystemExit in the main thread; aiperf_client.run must
    # then kill the client's own process group (started with start_new_session) before it
    # propagates, so nothing outlives the mission. SIGALRM stands in for SIGTERM here.
    pid_file = tmp_path / "pid"
    cmd = ["bash", "-c", f"echo $$ > {pid_file}; sleep 30 & wait"]
    old = signal.signal(signal.SIGALRM, _stop_on_signal)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(SystemExit) as exc:
            aiperf_client.run(cmd, tmp_path, timeout_s=20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert exc.value.code == 128 + signal.SIGALRM
    pgid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while process_group.group_alive(pgid) and time.monotonic() < deadline:  # the orphaned sleep's reaping
        time.sleep(0.05)
    assert not process_group.group_alive(pgid)
