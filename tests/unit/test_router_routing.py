"""Routing choices and the rank registry's life cycle (no sockets)."""
from __future__ import annotations

import pytest

from pd_server.errors import APIError
from pd_server.protocol import PROTOCOL_VERSION
from pd_server.protocol.rank_router import Hello, RankStats
from pd_server.protocol.router_rank import Reject, Welcome
from pd_server.ranks import DEAD, LOADING, READY, RankRegistry
from pd_server.routing import LeastLoaded, RoundRobin, RouteRequest, make_policy, pick_rank

MODEL = "m"
REQ = RouteRequest([1, 2, 3], 1)


def hello(index: int, role: str = "colocated", model: str = MODEL) -> Hello:
    return Hello(PROTOCOL_VERSION, role, index, 100 + index, model, 4096, 1000, 16, 64)


def registry(n: int) -> RankRegistry:
    reg = RankRegistry(MODEL)
    for i in range(n):
        assert isinstance(reg.on_hello(b"r%d" % i, hello(i), 0.0, 0.5), Welcome)
    return reg


def stats(waiting=0, pages=0) -> RankStats:
    return RankStats(running=0, waiting=waiting, pages_used=pages, pages_total=64, swa_slots_free=0, steps=0)


def test_least_loaded_prefers_fewest_inflight_then_queue_then_pages():
    reg = registry(3)
    r0, r1, r2 = reg.live()
    r0.inflight, r1.inflight, r2.inflight = {"a", "b"}, {"c"}, {"d"}
    r1.stats, r2.stats = stats(waiting=3), stats(waiting=1)
    assert LeastLoaded().choose(reg.live(), REQ) is r2
    r2.stats = stats(waiting=3, pages=10)
    r1.stats = stats(waiting=3, pages=2)
    assert LeastLoaded().choose(reg.live(), REQ) is r1


def test_least_loaded_alternates_between_idle_ranks():
    reg = registry(2)
    policy = LeastLoaded()
    picks = []
    for _ in range(4):
        rank = pick_rank(reg, policy, REQ, "colocated", 8)
        rank.routed += 1
        picks.append(rank.name)
    assert picks == ["colocated-0", "colocated-1", "colocated-0", "colocated-1"]


def test_round_robin_cycles_and_skips_the_dead():
    reg = registry(3)
    policy = RoundRobin()
    assert [pick_rank(reg, policy, REQ, "colocated", 8).index for _ in range(4)] == [0, 1, 2, 0]
    reg.mark_dead(reg.ranks["colocated-1"], "gone")
    assert {pick_rank(reg, policy, REQ, "colocated", 8).index for _ in range(4)} == {0, 2}


def test_full_ranks_are_429_and_no_live_rank_is_503():
    reg = registry(2)
    for r in reg.live():
        r.inflight = {"x", "y"}
    with pytest.raises(APIError) as e:
        pick_rank(reg, LeastLoaded(), REQ, "colocated", 2)
    assert e.value.status == 429
    reg.live()[0].inflight = {"x"}
    assert pick_rank(reg, LeastLoaded(), REQ, "colocated", 2).index == 0
    with pytest.raises(APIError) as e:  # n=2 does not fit in the one free slot
        pick_rank(reg, LeastLoaded(), RouteRequest([1], 2), "colocated", 2)
    assert e.value.status == 429
    with pytest.raises(APIError) as e:
        pick_rank(reg, LeastLoaded(), REQ, "decode", 2)
    assert e.value.status == 503


def test_loading_then_ready_then_dead():
    reg = RankRegistry(MODEL)
    reg.expect("colocated", 0)
    reg.expect("colocated", 1)
    assert reg.status == "loading"
    with pytest.raises(APIError) as e:
        pick_rank(reg, LeastLoaded(), REQ, "colocated", 2)
    assert e.value.status == 503 and "loading" in e.value.message
    reg.on_hello(b"a", hello(0), 1.0, 0.5)
    assert reg.status == "loading" and [r.state for r in reg.ranks.values()] == [READY, LOADING]
    reg.on_hello(b"b", hello(1), 1.0, 0.5)
    assert reg.status == "ok" and reg.max_model_len == 4096
    rank = reg.ranks["colocated-0"]
    rank.inflight = {"q1", "q2"}
    assert reg.mark_dead(rank, "boom") == {"q1", "q2"}
    assert rank.state == DEAD and rank.inflight == set() and reg.status == "ok"
    reg.mark_dead(reg.ranks["colocated-1"], "boom")
    assert reg.status == "unavailable"


def test_silent_and_exited_ranks_are_found_dead():
    class FakeProc:
        pid, code = 42, None

        def poll(self):
            return self.code

    proc = FakeProc()
    reg = RankRegistry(MODEL)
    reg.expect("colocated", 0, proc)
    reg.on_hello(b"a", hello(0), 10.0, 0.5)
    reg.on_hello(b"b", hello(1), 10.0, 0.5)
    assert reg.find_dead(12.0, 3.0) == []
    reg.ranks["colocated-0"].last_seen = 13.0
    found = reg.find_dead(13.5, 3.0)
    assert [(r.name, "silent" in why) for r, why in found] == [("colocated-1", True)]
    proc.code = -9
    found = dict((r.name, why) for r, why in reg.find_dead(13.5, 3.0))
    assert "exited with code -9" in found["colocated-0"]


def test_hello_refusals():
    reg = registry(1)
    assert "serves model" in reg.on_hello(b"z", hello(5, model="other"), 0.0, 0.5).reason
    dup = reg.on_hello(b"other-identity", hello(0), 0.0, 0.5)
    assert isinstance(dup, Reject) and "already serves" in dup.reason
    assert isinstance(reg.on_hello(b"r0", hello(0), 0.0, 0.5), Welcome)  # a repeated Hello is welcome
    reg.mark_dead(reg.ranks["colocated-0"], "gone")
    assert "declared dead" in reg.on_hello(b"r0", hello(0), 0.0, 0.5).reason


def test_make_policy():
    assert make_policy("round-robin").name == "round-robin"
    with pytest.raises(ValueError):
        make_policy("random")
