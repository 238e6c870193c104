"""The launcher's supervisor and the registry's restart/start-timeout rules, with real (tiny)
child processes and a fake clock; and the fault-injection spec."""
from __future__ import annotations

import sys

import pytest

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello
from cluster.protocol.router_rank import Reject, Welcome
from pd_server.ranks import DEAD, LOADING, READY, RankRegistry
from launcher.supervisor import Supervisor, remove_dead_ranks_shm, remove_rank_shm
from rank_runtime.faults import Faults, parse_faults

MODEL = "m"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def hello(pid: int) -> Hello:
    return Hello(PROTOCOL_VERSION, "colocated", 0, pid, MODEL, 4096, 1000, 16, 64)


@pytest.fixture
def sup():
    clock = Clock()
    s = Supervisor(RankRegistry(MODEL), lambda role, i: SLEEPER, max_restarts=1, backoff_s=2.0,
                   start_timeout_s=30.0, clock=clock)
    yield s
    s.reap(0.1)
    assert all(p.poll() is not None for p in s.procs)


def test_a_rank_without_hello_by_its_start_timeout_is_found_dead(sup):
    sup.start("colocated", 0)
    reg, rank = sup.registry, sup.registry.ranks["colocated-0"]
    assert rank.state == LOADING and reg.status == "loading" and reg.find_dead(129.0, 3.0) == []
    [(found, why)] = reg.find_dead(131.0, 3.0)
    assert found is rank and "did not become ready" in why


def test_a_hung_rank_is_killed_and_restarted_after_its_backoff_then_left_dead(sup):
    first = sup.start("colocated", 0)
    reg = sup.registry
    assert isinstance(reg.on_hello(b"old", hello(first.pid), 100.0, 0.5), Welcome)
    reg.mark_dead(reg.ranks["colocated-0"], "silent for 3.0s")
    sup.check()
    assert first.poll() is not None  # SIGKILLed: it was alive (hung)
    assert len(sup.procs) == 1  # the restart waits for its backoff
    sup.clock.t += 2.0
    sup.check()
    second = sup.procs[-1]
    rank = reg.ranks["colocated-0"]
    assert second is not first and rank.process is second and rank.state == LOADING and rank.restarts == 1
    assert reg.status == "loading"  # the only rank: nothing serves yet
    # The old process wakes up and says Hello under the same name: refused, it must exit.
    stale = reg.on_hello(b"old", hello(first.pid), 103.0, 0.5)
    assert isinstance(stale, Reject) and "declared dead" in stale.reason
    assert isinstance(reg.on_hello(b"new", hello(second.pid), 103.0, 0.5), Welcome)
    assert rank.state == READY and reg.by_identity(b"old").state == DEAD
    reg.mark_dead(rank, "exited")
    second.kill()
    second.wait()
    sup.clock.t += 100
    sup.check()
    sup.check()
    assert len(sup.procs) == 2 and rank.state == DEAD  # one restart allowed, used up


def test_without_supervise_a_hung_rank_is_left_alone(sup):
    sup.max_restarts = 0
    proc = sup.start("colocated", 0)
    sup.registry.mark_dead(sup.registry.ranks["colocated-0"], "silent")
    sup.check()
    assert proc.poll() is None and len(sup.procs) == 1


def test_a_restarting_rank_does_not_hold_health_in_loading_while_another_serves(sup):
    reg = sup.registry
    sup.start("colocated", 0)
    sup.start("colocated", 1)
    for i, p in enumerate(sup.procs):
        reg.on_hello(b"r%d" % i, Hello(PROTOCOL_VERSION, "colocated", i, p.pid, MODEL, 4096, 1000, 16, 64), 100, 0.5)
    assert reg.status == "ok"
    reg.mark_dead(reg.ranks["colocated-0"], "exited")
    sup.start("colocated", 0)
    assert reg.ranks["colocated-0"].state == LOADING and reg.status == "degraded"


def test_shm_of_exited_ranks_is_removed(tmp_path):
    mine = [tmp_path / "pdserve-handoff-prefill-0-4242-ab12", tmp_path / "pdserve-hicache-4242-x"]
    other = tmp_path / "pdserve-hicache-4243-x"
    for f in (*mine, other):
        f.write_bytes(b"")
    assert sorted(remove_rank_shm([4242], tmp_path)) == sorted(mine) and other.exists()


def test_fault_spec():
    spec = "decode-0:delay_pull:2.5,prefill-1:hang_before_hello,prefill-0:slow_kv_store:0.5"
    assert parse_faults(spec, "decode-0") == Faults(delay_pull_s=2.5)
    assert parse_faults(spec, "prefill-0") == Faults(slow_kv_store_s=0.5)
    assert parse_faults(spec, "prefill-1") == Faults(hang_before_hello=True)
    assert parse_faults(spec, "decode-1") == Faults() == parse_faults("", "decode-0")
    for bad in ("decode-0:delay_pul:1", "decode-0", "a:b:c:d"):
        with pytest.raises(ValueError):
            parse_faults(bad, "decode-0")


def test_a_dead_rank_started_by_hand_may_come_back_under_a_new_identity_only():
    reg = RankRegistry(MODEL)
    assert isinstance(reg.on_hello(b"colocated-0-7", hello(7), 0.0, 0.5), Welcome)
    reg.mark_dead(reg.ranks["colocated-0"], "silent")
    assert isinstance(reg.on_hello(b"colocated-0-7", hello(7), 1.0, 0.5), Reject)  # the stale socket
    assert isinstance(reg.on_hello(b"colocated-0-7-1", hello(7), 1.0, 0.5), Welcome)  # rejoined (--rejoin)
    fresh = reg.ranks["colocated-0"]
    assert fresh.state == READY and fresh.restarts == 1 and fresh.inflight == set()


def test_remove_dead_ranks_shm_takes_only_files_of_pids_that_are_gone(tmp_path):
    import os
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer runs (reaped)
    gone, live = p.pid, os.getpid()
    files = {n: tmp_path / n for n in (f"pdserve-hicache-{gone}-ab12", f"pdserve-handoff-decode-1-{gone}-cd34",
                                       f"pdserve-hicache-{live}-ef56", f"pdserve-handoff-prefill-0-{live}-0a0b",
                                       "pdserve-weights-77", "pdserve-board-1")}
    for f in files.values():
        f.write_bytes(b"x")
    removed = {f.name for f in remove_dead_ranks_shm(tmp_path)}
    assert removed == {f"pdserve-hicache-{gone}-ab12", f"pdserve-handoff-decode-1-{gone}-cd34"}
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(set(files) - removed)
