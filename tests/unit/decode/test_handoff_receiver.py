"""The decode rank's handoff state machine (decode/handoff_receiver.py) driven by fakes.

Every test checks the invariant that matters to the prefill rank: each Handoff it sent gets
exactly one answer (Pulled or PullFailed), and that reservations never leak.
"""
from __future__ import annotations

import pytest

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.prefill_decode import (PAGES_REGION, STATES_REGION, Handoff, PeerHello, PeerReject,
                                               PeerWelcome, PrefillTimes, Pulled, PullFailed, Renew)
from cluster.protocol.rank_router import RequestError
from cluster.protocol.router_rank import Sampling
from decode.handoff_receiver import HandoffReceiver
from tests.fakes import FakeBackend, FakeClock, FakeEngine, FakeWorld

PEER = b"prefill-0-123"
WAIT_S = 5.0  # --handoff-wait-s
LEASE_S = 10.0  # the handoffs' lease


class Rig:
    def __init__(self, room: int = 64, swa: bool = False, auto: bool = False, kind: str = "shm",
                 wait_s: float = WAIT_S) -> None:
        import torch

        self.world = FakeWorld()
        self.prefill = FakeBackend("prefill-agent", self.world, kind=kind)
        self.prefill.register(PAGES_REGION, torch.arange(32 * 4, dtype=torch.float32).view(32, 4), 16)
        self.prefill.register(STATES_REGION, torch.arange(2 * 8, dtype=torch.float32).view(2, 8), 32)
        self.backend = FakeBackend("decode-agent", self.world, auto=auto)
        self.backend.register(PAGES_REGION, torch.zeros(64, 4), 16)
        self.backend.register(STATES_REGION, torch.zeros(2, 8), 32)
        self.engine = FakeEngine(room=room, swa=swa)
        self.clock = FakeClock()
        self.to_peer: list[tuple[bytes, object]] = []
        self.to_router: list[object] = []
        self.rx = HandoffReceiver(self.engine, self.backend, "decode-0", wait_s,
                                  send_peer=lambda d, m: self.to_peer.append((d, m)),
                                  send_router=self.to_router.append, clock=self.clock, wall=self.clock)

    def hello(self, sender: bytes = PEER, name: str = "prefill-0", version: int = PROTOCOL_VERSION,
              kind: str = "shm") -> None:
        self.rx.on_peer_hello(sender, PeerHello(version, name, 123, kind, self.prefill.metadata()))

    def answers(self, rid: str) -> list:
        return [m for _, m in self.to_peer if isinstance(m, (Pulled, PullFailed)) and m.request_id == rid]

    def errors(self) -> list[RequestError]:
        return [m for m in self.to_router if isinstance(m, RequestError)]


def handoff(rid: str = "r1", n_tokens: int = 40, pages=(5, 9, 2), state: int = -1) -> Handoff:
    return Handoff(rid, list(range(1, n_tokens + 1)), 77, Sampling(max_tokens=8, temperature=0.0), 16,
                   list(pages), state, LEASE_S, PrefillTimes(1.0, 1.1, 1.2, 1.3))


def test_pull_reads_exactly_the_handed_pages_then_commits_and_answers_pulled():
    rig = Rig(swa=True)
    rig.hello()
    assert rig.to_peer == [(PEER, PeerWelcome("decode-0"))]
    rig.rx.on_handoff(PEER, handoff(state=1))
    assert rig.rx.progress() == [] and rig.rx.num_handoffs == 1
    pages, states = rig.backend.reads
    assert (pages.peer, pages.remote_region, pages.remote_pages) == ("prefill-0", PAGES_REGION, [5, 9, 2])
    assert pages.local_pages == rig.engine.reserved[0].pages and len(pages.local_pages) == 3
    # SWA: one slot (the window) from the handed state slot into the reserved one; never more.
    assert (states.remote_region, states.remote_pages, states.local_pages) == (STATES_REGION, [1], [0])
    rig.clock.advance(0.25)
    rig.backend.complete()
    done = rig.rx.progress()
    assert [c.request_id for c in done] == ["r1"] and done[0].pull_end - done[0].pull_start == 0.25
    rid, prompt, out, params, res, cached = rig.engine.committed[0]
    assert (rid, prompt, out, cached) == ("r1", list(range(1, 41)), [77], 16) and params.max_tokens == 8
    assert rig.answers("r1") == [Pulled("r1")] and rig.errors() == [] and rig.rx.num_handoffs == 0
    src, dst = rig.world.regions[("prefill-agent", PAGES_REGION)], rig.world.regions[("decode-agent", PAGES_REGION)]
    assert dst[res.pages].equal(src[[5, 9, 2]])
    assert rig.rx.transfer_bytes == 3 * 16 + 32


def test_full_decode_rank_applies_backpressure_then_pulls_when_room_appears():
    rig = Rig(room=2)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff("big"))  # 3 pages: does not fit
    rig.rx.on_handoff(PEER, handoff("small", n_tokens=10, pages=(1,)))  # FCFS: waits behind it
    for _ in range(3):
        rig.clock.advance(1.0)
        assert rig.rx.progress() == []
    assert rig.backend.reads == [] and rig.to_peer[1:] == [] and rig.rx.num_handoffs == 2
    rig.engine.room = 4
    rig.backend.auto = True
    assert [c.request_id for c in rig.rx.progress()] == ["big", "small"]
    assert rig.answers("big") == [Pulled("big")] and rig.answers("small") == [Pulled("small")]


def test_no_room_within_the_wait_fails_without_reading():
    rig = Rig(room=0)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff())
    rig.clock.advance(WAIT_S + 0.01)
    rig.rx.progress()
    [ans] = rig.answers("r1")
    assert isinstance(ans, PullFailed)
    [err] = rig.errors()
    assert err.status == 503 and "no room" in err.message
    assert rig.backend.reads == [] and rig.rx.num_handoffs == 0


def test_a_full_rank_keeps_its_handoffs_by_renewing_their_leases_then_pulls():
    """A live decode rank that has no room for minutes renews each queued handoff (and each
    read in flight) every third of the lease, one Renew per prefill rank, and fails nothing
    before --handoff-wait-s."""
    rig = Rig(room=0, wait_s=100.0)
    rig.hello()
    t0 = rig.clock()
    rig.rx.on_handoff(PEER, handoff("a"))
    rig.clock.advance(1.0)
    rig.rx.on_handoff(PEER, handoff("b"))
    renewals = []
    for _ in range(60):  # 30 s: three leases
        rig.clock.advance(0.5)
        n = len(rig.to_peer)
        rig.rx.progress()
        renewals += [(rig.clock(), m.request_ids) for _, m in rig.to_peer[n:] if isinstance(m, Renew)]
    assert rig.errors() == [] and rig.backend.reads == [] and rig.rx.num_handoffs == 2
    assert all(dest == PEER for dest, _ in rig.to_peer[1:])
    times = [t for t, _ in renewals]
    assert len(renewals) >= 30 / (LEASE_S / 3) - 1
    assert max(b - a for a, b in zip([t0, *times], times)) <= LEASE_S / 3 + 0.5  # never a lease-long gap
    assert {tuple(ids) for _, ids in renewals} <= {("a",), ("b",), ("a", "b")}
    assert sum("b" in ids for _, ids in renewals) >= 8
    rig.engine.room = 64  # room: both pulled; a read in flight is renewed as well
    rig.rx.progress()
    assert rig.rx.num_handoffs == 2 and len(rig.rx.pulling) == 2
    rig.clock.advance(LEASE_S / 3 + 0.01)
    n = len(rig.to_peer)
    rig.rx.progress()
    assert [m for _, m in rig.to_peer[n:]] == [Renew(["a", "b"])]
    rig.backend.complete()
    assert sorted(c.request_id for c in rig.rx.progress()) == ["a", "b"]
    assert rig.answers("a") == [Pulled("a")] and rig.answers("b") == [Pulled("b")] and rig.errors() == []


def test_a_rank_that_stalled_past_the_lease_reads_nothing():
    """The prefill rank may have released the pins of a handoff this rank did not renew in
    time (its engine thread stalled): such a handoff fails without a read, whatever the room."""
    rig = Rig(room=64, wait_s=100.0)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff())
    rig.clock.advance(LEASE_S - 0.5)  # no progress() meanwhile: no Renew went out
    rig.rx.progress()
    assert rig.backend.reads == [] and rig.engine.reserved == []
    [ans] = rig.answers("r1")
    assert isinstance(ans, PullFailed)
    [err] = rig.errors()
    assert err.status == 503 and "lease" in err.message
    assert not any(isinstance(m, Renew) for _, m in rig.to_peer)


def test_the_lease_estimate_starts_when_the_handoff_came_off_the_socket():
    """This thread may reach a Handoff long after the IO thread received it (a long step): a
    Renew goes out at once when one is due by then, and past the lease nothing is read."""
    rig = Rig(room=0, wait_s=100.0)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff("late"), received=rig.clock() - 4.0)  # renew due at -0.67 s
    rig.rx.progress()
    assert [m for _, m in rig.to_peer[1:]] == [Renew(["late"])] and rig.errors() == []
    rig.engine.room = 64
    rig.rx.on_handoff(PEER, handoff("stale"), received=rig.clock() - (LEASE_S - 0.5))
    rig.rx.progress()
    [err] = rig.errors()
    assert err.request_id == "stale" and "lease" in err.message
    assert [r.remote_pages for r in rig.backend.reads] == [[5, 9, 2]] and "late" in rig.rx.pulling


def test_abort_while_queued_answers_pull_failed_and_tells_the_router_nothing():
    rig = Rig(room=0)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff())
    assert rig.rx.on_abort("r1")
    assert rig.answers("r1") == [PullFailed("r1", "aborted")] and rig.errors() == []
    rig.engine.room = 64
    rig.rx.progress()
    assert rig.backend.reads == [] and rig.engine.reserved == []


def test_abort_while_pulling_waits_for_the_read_then_frees_pages():
    rig = Rig()
    rig.hello()
    rig.rx.on_handoff(PEER, handoff())
    rig.rx.progress()
    assert rig.rx.on_abort("r1") and rig.engine.reserved  # the read is still running into them
    assert rig.rx.progress() == [] and rig.answers("r1") == []
    rig.backend.complete()
    assert rig.rx.progress() == []
    assert rig.answers("r1") == [Pulled("r1")] and rig.engine.reserved == [] and rig.engine.committed == []
    assert rig.errors() == []


def test_abort_that_overtakes_its_handoff_refuses_it_on_arrival():
    rig = Rig()
    rig.hello()
    assert not rig.rx.on_abort("r1")  # not here yet: remembered
    rig.rx.on_handoff(PEER, handoff())
    [ans] = rig.answers("r1")
    assert isinstance(ans, PullFailed) and "aborted" in ans.reason
    rig.rx.progress()
    assert rig.backend.reads == [] and rig.errors() == []


def test_failed_read_frees_pages_and_fails_the_request_once():
    rig = Rig()
    rig.hello()
    rig.rx.on_handoff(PEER, handoff())
    rig.rx.progress()
    rig.backend.complete(ok=False)
    assert rig.rx.progress() == []
    [ans] = rig.answers("r1")
    assert isinstance(ans, PullFailed)
    [err] = rig.errors()
    assert err.status == 500 and "prefill-0" in err.message
    assert rig.engine.reserved == [] and rig.engine.committed == []


def test_prefill_rank_leaving_fails_its_queued_and_pulling_handoffs():
    rig = Rig(room=3)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff("pulling"))
    rig.rx.progress()
    rig.rx.on_handoff(PEER, handoff("queued"))
    rig.rx.on_live_prefill({"prefill-7"})  # prefill-0 is gone from the router's Peers
    assert rig.backend.removed == ["prefill-0"]
    rig.rx.progress()
    assert sorted(e.request_id for e in rig.errors()) == ["pulling", "queued"]
    assert all(e.status == 500 for e in rig.errors())
    assert rig.engine.reserved == [] and rig.rx.num_handoffs == 0
    rig.rx.on_handoff(PEER, handoff("late"))  # from a peer no longer known
    assert isinstance(rig.answers("late")[0], PullFailed) and rig.errors()[-1].request_id == "late"


@pytest.mark.parametrize("case", ["version", "kind", "backend"])
def test_refused_peer_hello_and_handoffs_from_it(case):
    rig = Rig()
    if case == "backend":
        rig.backend.refuse = "not this backend's metadata"
    rig.hello(version=PROTOCOL_VERSION + (case == "version"), kind="nixl" if case == "kind" else "shm")
    [(dest, reject)] = rig.to_peer
    assert dest == PEER and isinstance(reject, PeerReject)
    assert {"version": "version", "kind": "--transfer", "backend": "not this backend"}[case] in reject.reason
    rig.rx.on_handoff(PEER, handoff())
    assert isinstance(rig.answers("r1")[0], PullFailed) and rig.errors()[0].status == 500


def test_handoff_with_the_wrong_page_count_is_refused():
    rig = Rig()
    rig.hello()
    rig.rx.on_handoff(PEER, handoff(pages=(1, 2)))  # 40 tokens need 3 pages of 16
    assert isinstance(rig.answers("r1")[0], PullFailed) and "layout" in rig.errors()[0].message


def test_renewals_within_a_step_skip_a_handoff_whose_lease_is_gone():
    """renew_due (between a step's layers) renews what is due, but not a handoff whose lease
    this rank already counts as run out: the next progress() fails that one unread."""
    rig = Rig(room=0, wait_s=100.0)
    rig.hello()
    rig.rx.on_handoff(PEER, handoff("gone"), received=rig.clock() - LEASE_S)
    rig.rx.on_handoff(PEER, handoff("live"))
    rig.clock.advance(LEASE_S / 3 + 0.01)
    rig.rx.renew_due()
    assert [m for _, m in rig.to_peer[1:]] == [Renew(["live"])]
    rig.engine.room = 64
    rig.rx.progress()
    [err] = rig.errors()
    assert err.request_id == "gone" and "lease" in err.message and "live" in rig.rx.pulling


def test_a_later_turn_reads_only_the_pages_this_rank_does_not_hold():
    """Every handed-off prompt's complete pages go to the rank's host cache at commit; the next
    turn of the conversation (its prompt extends the last) loads those from it and reads only
    the rest from the prefill rank; the counters say which is which."""
    from hicache.cache import HostCache
    from hicache.index import PrefixIndex, namespace_key
    from hicache.pool import HostPool, HostPoolLayout, default_shm_name

    rig = Rig()
    rig.rx.keep_prompts = True  # --decode-keep-prompts
    dev = rig.world.regions[("decode-agent", PAGES_REGION)]  # [64 pages, 4 floats]
    rig.engine.pool.full = dev
    layout = HostPoolLayout(default_shm_name(), "float32", 8, (4,), 0, (0,))
    rig.engine.hicache = HostCache(HostPool.create(layout), PrefixIndex(namespace_key("m", "float32", 16), 16),
                                   has_swa=False)
    try:
        rig.hello()
        rig.rx.on_handoff(PEER, handoff("r1", 40, (5, 9, 2)))
        assert rig.rx.progress() == []
        rig.backend.complete()
        assert [c.request_id for c in rig.rx.progress()] == ["r1"]
        first = rig.engine.committed[0][4].pages
        turn2 = Handoff("r2", list(range(1, 71)), 77, Sampling(max_tokens=8, temperature=0.0), 0,
                        [10, 11, 12, 13, 14], -1, LEASE_S, PrefillTimes(1.0, 1.1, 1.2, 1.3))
        rig.rx.on_handoff(PEER, turn2)
        assert rig.rx.progress() == []
        read = rig.backend.reads[-1]
        res = rig.engine.reserved[0]
        assert read.remote_pages == [12, 13, 14] and read.local_pages == res.pages[2:]
        rig.backend.complete()
        assert [c.request_id for c in rig.rx.progress()] == ["r2"]
        src = rig.world.regions[("prefill-agent", PAGES_REGION)]
        assert dev[res.pages[:2]].equal(src[[5, 9]]) and dev[res.pages[:2]].equal(dev[first[:2]])
        assert dev[res.pages[2:]].equal(src[[12, 13, 14]])
        assert (rig.rx.reused_tokens, rig.rx.pulled_tokens) == (32, 40 + 38)
        assert rig.answers("r2") == [Pulled("r2")] and rig.errors() == []
    finally:
        rig.engine.hicache.close()
