"""A short soak (bench/soak.py's loop, bench/soaklib) against real systems: about a minute of
mixed chat/completions, streaming or not, with client disconnects, aborts and invalid
requests at low concurrency. Asserts what the long soak judges: no unexpected outcome,
every request sent was answered (the router's request counter moved by exactly as many),
every rank idle afterwards (device pages back to 0; the host prefix cache may keep pages)
and alive under the same pid, no runaway memory.

The colocated soak runs on the shared `colocated_system` and leaves it idle; the PD soak
starts its own 1 prefill + 1 decode system (shm transfer). A quick one on the shared
`fake_system` (stand-in ranks with room for 2 requests each) adds backpressure: its n=3
requests can never fit, so 429s must come back as clean refusals, not errors. A made-up
run checks that each of the verdict's checks can fail.
"""
from __future__ import annotations

import asyncio

import pytest

from bench.soaklib import SoakConfig, SoakResult, soak
from bench.soaklib.client import Outcome
from bench.soaklib.mix import Spec
from bench.soaklib.run import Sample, Tally
from bench.soaklib.system import Memory
from tests.e2e.conftest import MODEL, start_system, stop_system

# Fault fractions above the script's defaults, so a one-minute run surely injects each kind.
SHORT = dict(concurrency=3, seed=1, max_tokens=24, disconnect_frac=0.15, abort_frac=0.1, invalid_frac=0.15,
             sample_s=3.0, request_timeout_s=90.0, quiet_timeout_s=30.0, rss_growth_mb=512.0)


def check(res: SoakResult) -> None:
    t = res.tally
    assert not t.unexpected, f"unexpected outcomes {dict(t.unexpected)}: {t.details}"
    assert t.started == t.finished == res.router_counted, (t.started, t.finished, res.router_counted)
    assert t.outcomes["ok"] > 0 and t.tokens > 0
    assert t.outcomes["disconnected"] > 0 and t.outcomes["expected_4xx"] > 0 and t.faults["abort"] > 0
    assert sum(t.outcomes.values()) == t.finished
    assert res.quiet_s is not None and not res.busy, f"ranks still busy after the soak: {res.busy}"
    watched = [r for name, r in res.samples[-1].ranks.items() if name in res.pids]  # live at the start
    assert watched and all(r["pages_used"] == 0 and r["inflight"] == 0 for r in watched)
    assert not res.failures, res.failures


def test_verdict_fails_on_each_kind_of_leak():
    """The judge itself, on a made-up run: every check must be able to fail."""
    tally = Tally()
    spec = Spec("chat", "POST", "/v1/chat/completions", b"{}")
    for out in (Outcome("ok", tokens=5), Outcome("http_500", True, detail="boom")):
        tally.started += 1
        tally.record(spec, out)
    rank = {"name": "colocated-0", "pid": 11, "state": "ready", "inflight": 0, "pages_used": 0}
    samples = [Sample(0.0, {"router": Memory(300, 0), "colocated-0": Memory(900, 50)}, {"colocated-0": rank}),
               Sample(30.0, {"router": Memory(310, 0), "colocated-0": Memory(950, 100)}, {"colocated-0": rank}),
               Sample(60.0, {"router": Memory(900, 0), "colocated-0": Memory(1000, 150)},
                      {"colocated-0": {**rank, "pid": 12, "pages_used": 3}})]
    cfg = SoakConfig(minutes=1, warmup_s=20, rss_growth_mb=100)
    res = SoakResult(cfg, "http://x", {"router": 1, "colocated-0": 11}, tally, samples, 60.0, None,
                     {"colocated-0": {"pages_used": 3}}, router_counted=1)
    assert res.rss_growth() == {"router": 590, "colocated-0": 0}  # shared memory does not count
    text = "\n".join(res.failures)
    for what in ("1 unexpected outcome(s): {'http_500': 1}", "the router answered 1 API requests, the client sent 2",
                 "ranks not idle", "colocated-0 (pid 11) is gone or restarted", "router private RSS grew 590 MiB"):
        assert what in text
    assert len(res.failures) == 5


def test_soak_fake_ranks_backpressure(fake_system):
    # Stand-in ranks ignore stop strings: none in this mix.
    cfg = SoakConfig(minutes=0.25, **{**SHORT, "concurrency": 4, "sample_s": 1.0, "stop_frac": 0.0})
    res = asyncio.run(soak(fake_system.url, cfg, fake_system.proc.pid))
    check(res)
    assert res.tally.outcomes["backpressure_429"] > 0


@pytest.mark.slow
def test_soak_colocated(colocated_system):
    res = asyncio.run(soak(colocated_system.url, SoakConfig(minutes=1.25, **SHORT), colocated_system.proc.pid))
    check(res)
    # Earlier tests may have killed a rank of this shared system: the soak watches the live ones.
    assert "router" in res.pids and set(res.pids) - {"router"} <= {"colocated-0", "colocated-1"}
    assert len(res.pids) >= 2
    assert len(res.samples) >= 10  # one every 3 s over the load, plus start and end


@pytest.mark.slow
def test_soak_pd(tmp_path):
    system = start_system(tmp_path / "pd", ["--prefill", "1", "--decode", "1", "--transfer", "shm", "--model", MODEL,
                                            "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "16",
                                            "--handoff-pool-gb", "0.1"], timeout=420)
    try:
        res = asyncio.run(soak(system.url, SoakConfig(minutes=1.0, **SHORT), system.proc.pid))
    finally:
        stop_system(system)
    check(res)
    assert set(res.pids) == {"router", "prefill-0", "decode-0"}
    assert all(r["handoffs"] == 0 and r["handoff_pages_used"] == 0 for r in res.samples[-1].ranks.values())
