"""The router's PD mode without sockets: decode-rank choice, first token and decode tokens put
in order, abort and failure reaching both ranks, Peers on joins and deaths, phase durations;
requests --disagg places on the decode rank (booked like colocated ones there)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello, PhaseTimes, RankStats, RequestError, TokenBatch, TokenEvent
from cluster.protocol.router_rank import Abort, Generate, Peers, Sampling
from pd_server.config import RouterConfig
from pd_server.dispatcher import Dispatcher
from pd_server.errors import APIError
from pd_server.metrics import RouterMetrics, phase_durations
from pd_server.ranks import RankRegistry
from pd_server.request_state import Failure
from pd_server.routing import RouteRequest, make_policy, pick_decode_rank

MODEL = "m"
REQ = RouteRequest([1, 2, 3], 1)


def hello(role: str, index: int) -> Hello:
    addr = f"tcp://127.0.0.3:{4000 + index}" if role == "decode" else ""
    return Hello(PROTOCOL_VERSION, role, index, 100 + index, MODEL, 4096, 1000, 16, 64, addr)


class Recorder(Dispatcher):
    """A dispatcher whose sends are recorded instead of going to a socket."""

    def __init__(self, disagg: str = "always", max_migrations: int = 2) -> None:
        super().__init__(RouterConfig(disagg=disagg, max_migrations=max_migrations), RankRegistry(MODEL),
                         make_policy("least-loaded"),
                         RouterMetrics())
        self.sent: list[tuple[str, object]] = []

    def _send(self, rank, msg) -> None:
        self.sent.append((rank.name, msg))

    def _reply(self, identity, msg) -> None:
        self.sent.append((identity.decode(), msg))

    def join(self, role: str, index: int) -> None:
        self._on_frame(f"{role}-{index}".encode(), self._codec.encode(hello(role, index)))

    def frame(self, rank: str, msg) -> None:
        self._on_frame(rank.encode(), self._codec.encode(msg))

    def take(self) -> list[tuple[str, object]]:
        out, self.sent = self.sent, []
        return out


def _system(disagg: str, max_migrations: int = 2):
    loop = asyncio.new_event_loop()  # Handle queues are asyncio.Queues
    asyncio.set_event_loop(loop)
    d = Recorder(disagg, max_migrations)
    for role, i in (("prefill", 0), ("decode", 0), ("decode", 1)):
        d.join(role, i)
    yield d
    d._sock.close(linger=0)
    d._ctx.term()
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture
def disp():
    yield from _system("always")


@pytest.fixture
def no_migration():
    yield from _system("always", 0)


@pytest.fixture
def never():
    yield from _system("never")


@pytest.fixture
def auto():
    yield from _system("auto")


def sampling() -> list:
    return [([1, 2, 3], Sampling(max_tokens=4, temperature=0.0))]


def test_peers_go_to_every_pd_rank_on_each_join(disp):
    peers = [(to, m) for to, m in disp.take() if isinstance(m, Peers)]
    last = [m for to, m in peers if to == "prefill-0"][-1]
    assert [(p.name, p.addr) for p in last.peers] == \
        [("prefill-0", ""), ("decode-0", "tcp://127.0.0.3:4000"), ("decode-1", "tcp://127.0.0.3:4001")]
    assert {to for to, _ in peers[-3:]} == {"prefill-0", "decode-0", "decode-1"}


def test_decode_rank_by_inflight_then_pages(disp):
    reg = disp.registry
    d0, d1 = reg.live("decode")
    d0.inflight = {"x"}
    assert pick_decode_rank(reg, REQ, 8) is d1
    d1.inflight = {"y"}
    d0.stats = RankStats(running=1, waiting=0, pages_used=30, pages_total=64, swa_slots_free=0, steps=0)
    d1.stats = RankStats(running=3, waiting=0, pages_used=10, pages_total=64, swa_slots_free=0, steps=0)
    assert pick_decode_rank(reg, REQ, 8) is d1
    d1.inflight = set(range(8))
    assert pick_decode_rank(reg, REQ, 8) is d0
    d0.inflight = set(range(8))
    with pytest.raises(APIError) as e:
        pick_decode_rank(reg, REQ, 8)
    assert e.value.status == 429


def test_decode_pack_fills_one_rank_before_the_next_gets_any(disp):
    """--decode-pack 3: the fullest rank with room under 3 takes each request; an idle rank
    only when none has; past 3 on every rank, the least loaded again."""
    reg = disp.registry
    d0, d1 = reg.live("decode")
    picks = []
    for i in range(8):
        r = pick_decode_rank(reg, REQ, 8, pack=3)
        r.inflight.add(f"r{i}")
        picks.append(r.name)
    assert picks == ["decode-0"] * 3 + ["decode-1"] * 3 + ["decode-0", "decode-1"]
    d0.inflight, d1.inflight = {"a", "b"}, {"c"}
    assert pick_decode_rank(reg, REQ, 8, pack=3) is d0  # the fuller one, though it holds more
    assert pick_decode_rank(reg, RouteRequest([1], 2), 8, pack=3) is d1  # n=2 fits under 3 only there
    d0.inflight = set()
    assert pick_decode_rank(reg, REQ, 8, pack=3) is d1  # not the idle one
    assert pick_decode_rank(reg, REQ, 8, pack=0) is d0  # spread by load


def test_decode_pack_auto_only_where_the_launchers_ranks_share_cores():
    from launcher.launch import DECODE_PACK, LaunchConfig, decode_pack_for_host

    auto = RouterConfig()
    assert auto.decode_pack == -1
    pd22, pd11 = LaunchConfig(prefill=2, decode=2), LaunchConfig(prefill=1, decode=1)
    assert decode_pack_for_host(auto, pd22, 1, 2).decode_pack == DECODE_PACK  # 4 ranks on 2 cores
    assert decode_pack_for_host(auto, pd11, 1, 2).decode_pack == 0  # one core each
    assert decode_pack_for_host(auto, pd11, 2, 2).decode_pack == 0  # shared cores, but one decode rank
    assert decode_pack_for_host(auto, LaunchConfig(prefill=2, decode=1), 1, 2).decode_pack == 0
    assert decode_pack_for_host(auto, pd22, 1, 4).decode_pack == 0
    assert decode_pack_for_host(auto, pd22, 2, 4).decode_pack == DECODE_PACK
    assert decode_pack_for_host(auto, LaunchConfig(colocated=4), 1, 2).decode_pack == 0  # no decode ranks
    assert decode_pack_for_host(RouterConfig(decode_pack=0), pd22, 1, 2).decode_pack == 0  # a set value stays
    assert decode_pack_for_host(RouterConfig(decode_pack=5), pd11, 1, 2).decode_pack == 5
    with pytest.raises(ValueError):
        RouterConfig(decode_pack=-2)


def test_generate_names_the_decode_rank_and_tokens_arrive_in_order(disp):
    disp.take()
    h = disp.submit("req", sampling(), REQ, 0.0)
    [(to, gen)] = disp.take()
    assert to == "prefill-0" and isinstance(gen, Generate) and gen.decode_rank == h.decode.index
    sid = h.sub_ids[0]
    assert sid in h.rank.inflight and sid in h.decode.inflight
    # A rank that does not hold the request cannot speak for it (a forged or confused rank).
    other = next(n for n in ("decode-0", "decode-1") if n != h.decode.name)
    disp.frame(other, TokenBatch([TokenEvent(sid, [99], "forged", "stop", completion_tokens=1)], 0.0))
    assert h.queue.empty() and sid in disp.pending
    # The decode rank's second token overtakes the prefill rank's first.
    disp.frame(h.decode.name, TokenBatch([TokenEvent(sid, [12], "b", completion_tokens=2)], 0.0))
    assert h.queue.empty()
    disp.frame("prefill-0", TokenBatch([TokenEvent(sid, [11], "a", completion_tokens=1)], 0.0))
    got = [h.queue.get_nowait()[1].token_ids for _ in range(2)]
    assert got == [[11], [12]]
    assert sid not in h.rank.inflight and sid in h.decode.inflight  # the prefill rank is done with it
    disp.frame(h.decode.name, TokenBatch([TokenEvent(sid, [13], "c", "length", completion_tokens=3)], 0.0))
    assert h.queue.get_nowait()[1].finish_reason == "length" and not h.decode.inflight


def test_abort_and_failure_reach_both_ranks(disp):
    h = disp.submit("a", sampling(), REQ, 0.0)
    disp.take()
    h.close()
    assert sorted((to, m) for to, m in disp.take()) == \
        sorted([("prefill-0", Abort(h.sub_ids[0])), (h.decode.name, Abort(h.sub_ids[0]))])
    h = disp.submit("b", sampling(), REQ, 0.0)
    disp.take()
    disp.frame("prefill-0", RequestError(h.sub_ids[0], 504, "lease"))
    assert isinstance(h.queue.get_nowait()[1], Failure)
    assert (h.decode.name, Abort(h.sub_ids[0])) in disp.take()


def test_dead_decode_rank_fails_its_requests_without_migration_and_updates_peers(no_migration):
    disp = no_migration
    h = disp.submit("a", sampling(), REQ, 0.0)
    disp.take()
    disp._rank_died(h.decode, "exited")
    _, failure = h.queue.get_nowait()
    assert isinstance(failure, Failure) and failure.status == 500 and h.decode.name in failure.message
    sent = disp.take()
    assert ("prefill-0", Abort(h.sub_ids[0])) in sent
    peers = [m for to, m in sent if to == "prefill-0" and isinstance(m, Peers)]
    assert peers and h.decode.name not in [p.name for p in peers[-1].peers]


def test_dead_decode_rank_moves_its_requests_with_their_tokens(disp):
    """Mid-stream: the other decode rank gets the request with the tokens delivered so far,
    prefills and goes on; its events continue the stream."""
    h = disp.submit("a", sampling(), REQ, 0.0)
    sid, first, dead = h.sub_ids[0], h.decode.name, h.decode
    disp.take()
    disp.frame("prefill-0", TokenBatch([TokenEvent(sid, [7], "x", None, None, 3, 1)], 0.0))
    disp.frame(first, TokenBatch([TokenEvent(sid, [8], "y", None, None, 3, 2)], 0.0))
    disp._rank_died(dead, "decode-x (pid 1) exited with code -9")
    sent = disp.take()
    moved = [(to, m) for to, m in sent if isinstance(m, Generate)]
    assert len(moved) == 1 and moved[0][0] != first
    to, msg = moved[0]
    assert (msg.request_id, msg.prompt_ids, msg.decode_rank, msg.resume_ids) == (sid, [1, 2, 3], -1, [7, 8])
    assert ("prefill-0", Abort(sid)) in sent  # frees a handoff it may still pin
    disp.frame("prefill-0", RequestError(sid, 504, "lease ran out"))  # that handoff's late end: ignored
    disp.frame(to, TokenBatch([TokenEvent(sid, [9], "z", "length", None, 3, 3)], 0.0))
    events = [h.queue.get_nowait()[1] for _ in range(3)]
    assert [e.token_ids for e in events] == [[7], [8], [9]] and events[-1].finish_reason == "length"
    assert 'pdserve_migrations_total{cause="exited",role="decode"} 1.0' in disp.metrics.render().decode()
    assert not any(sid in r.inflight for r in disp.registry.ranks.values())


def test_phase_durations_pd_and_colocated():
    pd = phase_durations(0.5, PhaseTimes(1.0, 2.0, 9.0, 1.5, 2.1, 2.5, 2.6, 2.8))
    assert pd == pytest.approx({"queue": 0.5, "prefill_wait": 0.5, "prefill": 0.5, "stage": 0.1,
                                "admission_wait": 0.4, "transfer": 0.1, "first_decode": 0.2, "decode": 6.2})
    assert phase_durations(0.5, PhaseTimes(1.0, 2.0, 3.0)) == \
        pytest.approx({"queue": 0.5, "prefill_wait": 0.0, "prefill": 1.0, "decode": 1.0})


def placements(d) -> dict[str, float]:
    text = d.metrics.render().decode()
    return {w: float(ln.split()[-1]) for ln in text.splitlines() for w in ("decode", "prefill")
            if ln.startswith(f'pdserve_prefill_placement_total{{where="{w}"}}')}


def test_never_sends_generate_to_the_decode_rank_booked_like_colocated(never):
    never.take()
    h = never.submit("req", [([1, 2, 3], Sampling(max_tokens=3, temperature=0.0))] * 2, RouteRequest([1, 2, 3], 2),
                     0.0)
    sent = never.take()
    assert [to for to, _ in sent] == [h.rank.name] * 2 and h.rank.role == "decode" and h.decode is None
    assert all(isinstance(m, Generate) and m.decode_rank == -1 for _, m in sent)
    assert set(h.sub_ids) == h.rank.inflight and not never.registry.ranks["prefill-0"].inflight
    assert placements(never) == {"decode": 1.0}
    from pd_server.serving import route_headers
    assert route_headers(h, "r")["x-pdserve-decode-rank"] == h.rank.name == route_headers(h, "r")["x-pdserve-rank"]
    a, b = h.sub_ids
    # One stream per sub-request, straight from the decode rank: no reordering wait, usage as sent.
    never.frame(h.rank.name, TokenBatch([TokenEvent(a, [11], "x", None, None, 3, 1, 2),
                                         TokenEvent(b, [12], "y", None, None, 3, 1, 2)], 0.0))
    assert [h.queue.get_nowait()[1].token_ids for _ in range(2)] == [[11], [12]]
    never.frame(h.rank.name, TokenBatch([TokenEvent(a, [13], "z", "length", None, 3, 2, 2)], 0.0))
    assert h.queue.get_nowait()[1].cached_tokens == 2 and h.rank.inflight == {b}
    h.close()  # the client went away: Abort for what is left, to the decode rank only
    assert never.take() == [(h.rank.name, Abort(b))] and not h.rank.inflight


def test_never_needs_no_prefill_rank_and_errors_fail_only_the_decode_rank(never):
    never._rank_died(never.registry.ranks["prefill-0"], "exited")
    h = never.submit("a", sampling(), REQ, 0.0)
    never.take()
    never.frame(h.rank.name, RequestError(h.sub_ids[0], 400, "bad"))
    assert isinstance(h.queue.get_nowait()[1], Failure)
    assert never.take() == [(h.rank.name, Abort(h.sub_ids[0]))] and not h.rank.inflight  # idempotent there


def test_local_request_moves_to_another_decode_rank_when_its_rank_dies_before_a_token(never):
    h = never.submit("a", sampling(), REQ, 0.0)
    never.take()
    dead = h.rank
    never._rank_died(dead, "exited")
    other = next(r for r in never.registry.live("decode"))
    sent = never.take()
    assert (other.name, never.pending[h.sub_ids[0]].msg) in sent and h.sub_ids[0] in other.inflight
    never.frame(other.name, TokenBatch([TokenEvent(h.sub_ids[0], [5], "t", completion_tokens=1)], 0.0))
    never._rank_died(other, "exited")  # after a token: fails (nothing to move to, and output was sent)
    assert isinstance(h.queue.get_nowait()[1], TokenEvent) and isinstance(h.queue.get_nowait()[1], Failure)


def test_auto_places_short_prompts_on_the_decode_rank_and_long_ones_on_an_idle_prefill_rank(auto):
    auto.take()
    short = auto.submit("s", sampling(), REQ, 0.0)
    assert short.rank.role == "decode" and short.decode is None
    long_ids = list(range(1, 1001))
    long = auto.submit("l", [(long_ids, Sampling(max_tokens=4))], RouteRequest(long_ids, 1), 0.0)
    assert long.rank.name == "prefill-0" and long.decode is not None
    assert placements(auto) == {"decode": 1.0, "prefill": 1.0}
    # The long prompt is queued on prefill-0 until its first token: a second one now finds more
    # prefill queued there than prefilling it locally costs, and goes to a decode rank.
    second = auto.submit("l2", [(long_ids, Sampling(max_tokens=4))], RouteRequest(long_ids, 1), 0.0)
    assert second.rank.role == "decode" and auto.placer.queued_prefill_s(auto.registry.ranks["prefill-0"]) > 1.0
    auto.frame("prefill-0", TokenBatch([TokenEvent(long.sub_ids[0], [9], "a", completion_tokens=1)], 0.0))
    assert auto.placer.queued_prefill_s(auto.registry.ranks["prefill-0"]) == 0.0  # first token in: no longer queued
    third = auto.submit("l3", [(long_ids, Sampling(max_tokens=4))], RouteRequest(long_ids, 1), 0.0)
    assert third.rank.name == "prefill-0"


def test_auto_prefills_on_a_decode_rank_when_no_prefill_rank_lives(auto):
    auto._rank_died(auto.registry.ranks["prefill-0"], "exited")
    long_ids = list(range(1, 1001))
    h = auto.submit("l", [(long_ids, Sampling(max_tokens=4))], RouteRequest(long_ids, 1), 0.0)
    assert h.rank.role == "decode"


def test_always_still_needs_a_prefill_rank(disp):
    disp._rank_died(disp.registry.ranks["prefill-0"], "exited")
    with pytest.raises(APIError) as e:
        disp.submit("a", sampling(), REQ, 0.0)
    assert e.value.status == 503
