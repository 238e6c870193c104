"""Faults on a supervised PD system of real ranks (1 prefill + 2 decode, every KV read delayed
3 s): kill -9 of either rank inside the KV-transfer window, SIGSTOP of a decode rank while it
decodes and of the prefill rank with a request queued on it. Each request moves to the other decode rank (pd_server/migration.py) and ends with the
text of an uninterrupted run; the supervisor restarts the dead rank, which serves again, and
every pin and page returns. Helpers and bounds: test_e2e_faults.py.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.conftest import start_system, stop_system
from tests.e2e.test_e2e_faults import FAST_S, REAL, complete, idle, pid_gone, shm_of, sse_text, stream_until_end

pytestmark = pytest.mark.slow


# ---- PD, real ranks, supervised ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd_sup(tmp_path_factory):
    # Every KV read waits 3 s (the handoff stays pinned in the prefill rank's pool meanwhile). The
    # cluster secret puts both rank links on CURVE (restarted ranks get it from the launcher too).
    os.environ["PDSERVE_FAULT"] = "decode-0:delay_pull:3,decode-1:delay_pull:3"
    os.environ["PDSERVE_CLUSTER_SECRET"] = "pd-sup-secret"
    try:
        system = start_system(tmp_path_factory.mktemp("pd-sup"),
                              [*REAL, "--prefill", "1", "--decode", "2", "--transfer", "shm", "--hicache-size-gb", "0",
                               "--kv-cache-gb", "0.1", "--handoff-pool-gb", "0.05", "--supervise", "--disagg", "always",
                               "--max-restarts", "3", "--restart-backoff-s", "0.5"], timeout=420)
    finally:
        del os.environ["PDSERVE_FAULT"], os.environ["PDSERVE_CLUSTER_SECRET"]
    try:
        yield system
    finally:
        stop_system(system)


def _restarted(system, name: str, old_pid: int) -> bool:
    r = system.ranks()[name]
    return r["state"] == "ready" and r["pid"] != old_pid


BODY = {"prompt": "Once upon a time " * 20, "max_tokens": 16}


def _kill_in_transfer_window(system, target_role: str) -> tuple[str, str, int, float]:
    """A request whose first token is out and whose KV waits to be pulled; kill -9 the rank of
    `target_role` holding it. Returns (SSE text, killed rank name, its pid, seconds to the end)."""
    killed = {}

    def kill(headers):
        name = headers["x-pdserve-rank"] if target_role == "prefill" else headers["x-pdserve-decode-rank"]
        system.wait_until(lambda: system.ranks()["prefill-0"]["handoffs"] > 0, 5, "the handoff pinned")
        pid = system.ranks()[name]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.update(name=name, pid=pid, t=time.monotonic())

    text, _ = stream_until_end(system, BODY, on_first=kill)
    return text, killed["name"], killed["pid"], time.monotonic() - killed["t"]


def test_decode_rank_killed_during_kv_transfer_then_restarted_serves(pd_sup):
    """The request moves to the other decode rank, which prefills it with its first token and
    decodes on: the same text as an uninterrupted run."""
    text, name, pid, took = _kill_in_transfer_window(pd_sup, "decode")
    assert sse_text(text)[0] == complete(pd_sup, BODY).json()["choices"][0]["text"] and took < FAST_S
    pd_sup.wait_until(lambda: _restarted(pd_sup, name, pid), 120, f"{name} restarted")
    assert not shm_of(pid)
    pd_sup.wait_until(lambda: idle(pd_sup), FAST_S, "prefill pins released")
    seen = set()
    for _ in range(2):  # the restarted rank has routed 0: it is picked first; Peers re-introduced it
        r = complete(pd_sup, {"prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        seen.add(r.headers["x-pdserve-decode-rank"])
    assert name in seen


def test_prefill_rank_killed_during_kv_transfer_then_restarted_serves(pd_sup):
    text, name, pid, took = _kill_in_transfer_window(pd_sup, "prefill")
    # The decode rank cannot pull the dead rank's KV: the request moves to the other decode rank.
    moved = sse_text(text)[0]
    assert took < FAST_S
    pd_sup.wait_until(lambda: _restarted(pd_sup, name, pid), 120, f"{name} restarted")
    assert moved == complete(pd_sup, BODY).json()["choices"][0]["text"]  # (--disagg always: after the restart)
    assert not shm_of(pid)  # its handoff pool, removed by the supervisor
    r = complete(pd_sup, {"prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    pd_sup.wait_until(lambda: idle(pd_sup), FAST_S, "every rank idle")


def test_hung_decode_rank_is_killed_and_replaced_by_the_supervisor(pd_sup):
    stopped = {}

    def stop_it(headers):
        name = headers["x-pdserve-decode-rank"]
        pd_sup.wait_until(lambda: pd_sup.ranks()[name]["running"] > 0, 20, "decoding started")
        stopped.update(name=name, pid=pd_sup.ranks()[name]["pid"], t=time.monotonic())
        os.kill(stopped["pid"], signal.SIGSTOP)

    # Long enough to outlast a few stats heartbeats: 60 tokens (~0.5 s on a fast core) could end
    # between two, and "decoding started" was then never seen.
    story = {"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True}
    text, _ = stream_until_end(pd_sup, story, on_first=stop_it)
    assert sse_text(text)[0] == complete(pd_sup, story).json()["choices"][0]["text"]  # moved, not failed
    pd_sup.wait_until(lambda: pid_gone(stopped["pid"]), FAST_S, "the hung rank killed")
    pd_sup.wait_until(lambda: _restarted(pd_sup, stopped["name"], stopped["pid"]), 120, "the hung rank replaced")
    pd_sup.wait_until(lambda: idle(pd_sup), FAST_S, "every rank idle")
    r = complete(pd_sup, {"prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_hung_prefill_rank_moves_the_request_queued_on_it_to_a_decode_rank(pd_sup):
    """SIGSTOP of the only prefill rank, then a request: it is sent there (the rank still looks
    alive) and waits, unprefilled, in a stopped process. The router marks the rank dead after
    --rank-timeout-s and moves the request to a decode rank, which prefills it itself: the text of
    an uninterrupted run, no error. The supervisor kills and replaces the hung rank."""
    uninterrupted = complete(pd_sup, BODY).json()["choices"][0]["text"]
    pid = pd_sup.ranks()["prefill-0"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        r = complete(pd_sup, BODY, timeout=60)
    finally:
        if not pid_gone(pid):
            pd_sup.wait_until(lambda: pid_gone(pid), FAST_S, "the hung prefill rank killed")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == uninterrupted, r.text
    pd_sup.wait_until(lambda: _restarted(pd_sup, "prefill-0", pid), 120, "the hung rank replaced")
    pd_sup.wait_until(lambda: idle(pd_sup), FAST_S, "every rank idle")
    r = complete(pd_sup, {"prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
