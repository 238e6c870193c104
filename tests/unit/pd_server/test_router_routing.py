"""Routing choices and the rank registry's life cycle (no sockets)."""
from __future__ import annotations

import msgspec
import pytest

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import CacheUpdate, Hello, RankStats
from cluster.protocol.router_rank import Reject, Welcome
from hicache.index import namespace_key, page_keys
from pd_server.errors import APIError
from pd_server.ranks import DEAD, LOADING, READY, RankRegistry
from pd_server.routing import (Affinity, CacheAware, LeastLoaded, RoundRobin, RouteRequest, expected_hit_tokens,
                               make_policy, pick_rank)

MODEL = "m"
REQ = RouteRequest([1, 2, 3], 1)


ROOT = namespace_key(MODEL, "bfloat16", 16)


def hello(index: int, role: str = "colocated", model: str = MODEL, cache_root: bytes = b"",
          needs_state: bool = False) -> Hello:
    return Hello(PROTOCOL_VERSION, role, index, 100 + index, model, 4096, 1000, 16, 64, "", cache_root, needs_state)


def registry(n: int, cache_root: bytes = b"", role: str = "colocated") -> RankRegistry:
    reg = RankRegistry(MODEL)
    for i in range(n):
        assert isinstance(reg.on_hello(b"r%d" % i, hello(i, role, cache_root=cache_root), 0.0, 0.5), Welcome)
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
    assert rank.state == DEAD and rank.inflight == set() and reg.status == "degraded"
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


# ---- cache-aware and affinity ---------------------------------------------------------------------
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full pages of 16, all 6 hittable ((100 - 1) // 16)


def stored(tokens, pages: int) -> CacheUpdate:
    return CacheUpdate("page_stored", page_keys(tokens, 16, ROOT, pages))


def test_index_follows_store_and_evict_events_with_the_longest_prefix_per_rank():
    reg = registry(2, ROOT)
    r0, r1 = reg.live()
    r0.cache.apply([stored(PROMPT, 4)])
    r1.cache.apply([stored(PROMPT, 2), stored(PROMPT[:16] + [7] * 80, 6)])  # shares page 1 only
    assert [expected_hit_tokens(r, PROMPT) for r in (r0, r1)] == [64, 32]
    tail = page_keys(PROMPT, 16, ROOT, 4)[2:]
    r0.cache.apply([CacheUpdate("page_evicted", tail[::-1])])  # the rank evicts chain tails first
    assert expected_hit_tokens(r0, PROMPT) == 32
    r0.cache.apply([stored(PROMPT, 6)])
    assert expected_hit_tokens(r0, PROMPT) == 96
    assert expected_hit_tokens(r0, PROMPT[:96]) == 80  # a lookup always leaves one token to compute
    r0.cache.apply([CacheUpdate("page_evicted", page_keys(PROMPT, 16, ROOT, 1))])  # a hole: nothing matches
    assert expected_hit_tokens(r0, PROMPT) == 0


def test_other_namespace_never_hits_and_hybrid_hits_end_at_a_state():
    reg = registry(1, namespace_key(MODEL, "float32", 16))
    reg.live()[0].cache.apply([stored(PROMPT, 6)])  # keys under the bfloat16 namespace
    assert expected_hit_tokens(reg.live()[0], PROMPT) == 0
    reg = RankRegistry(MODEL)
    reg.on_hello(b"h", hello(0, cache_root=ROOT, needs_state=True), 0.0, 0.5)
    rank = reg.live()[0]
    keys = page_keys(PROMPT, 16, ROOT, 6)
    rank.cache.apply([stored(PROMPT, 6)])
    assert expected_hit_tokens(rank, PROMPT) == 0
    rank.cache.apply([CacheUpdate("state_stored", [keys[2]]), CacheUpdate("state_stored", [keys[4]])])
    assert expected_hit_tokens(rank, PROMPT) == 80
    rank.cache.apply([CacheUpdate("state_evicted", [keys[4]])])
    assert expected_hit_tokens(rank, PROMPT) == 48


def test_a_salted_request_expects_only_its_salts_pages_and_ranks_of_one_host_cache_share_a_picture():
    from hicache.index import salted_root

    reg = RankRegistry(MODEL)
    for i in range(2):  # two ranks of one host cache: one picture, fed by either
        h = msgspec.structs.replace(hello(i, cache_root=ROOT), cache_group="host|pdserve-hostcache-1-ab")
        assert isinstance(reg.on_hello(b"g%d" % i, h, 0.0, 0.5), Welcome)
    r0, r1 = reg.live()
    assert r0.cache is r1.cache
    r0.cache.apply([CacheUpdate("page_stored", page_keys(PROMPT, 16, salted_root(ROOT, "a"), 6))])
    assert [expected_hit_tokens(r1, PROMPT, s) for s in ("", "a", "b")] == [0, 96, 0]
    assert pick_rank(reg, CacheAware(), RouteRequest(PROMPT, 1, cache_salt="a"), "colocated", 8) in (r0, r1)
    reg.mark_dead(r0, "gone")
    assert expected_hit_tokens(r1, PROMPT, "a") == 96, "the other rank's picture stays"


@pytest.mark.parametrize("field,value", [("page_size", 0), ("page_size", 24), ("max_model_len", 0),
                                         ("vocab_size", 0), ("pages_total", -1), ("role", "admin"),
                                         ("index", -1), ("cache_root", b"x")])
def test_a_hello_with_a_field_the_router_divides_or_indexes_by_out_of_range_is_refused(field, value):
    reg = RankRegistry(MODEL)
    got = reg.on_hello(b"x", msgspec.structs.replace(hello(0, cache_root=ROOT), **{field: value}), 0.0, 0.5)
    assert isinstance(got, Reject) and "malformed Hello" in got.reason and not reg.ranks


def test_dead_rank_drops_its_index_and_decode_ranks_get_one():
    reg = registry(2, ROOT)
    r0 = reg.ranks["colocated-0"]
    r0.cache.apply([stored(PROMPT, 6)])
    reg.on_hello(b"r0", hello(0, cache_root=ROOT), 1.0, 0.5)  # a repeated Hello keeps the index
    assert expected_hit_tokens(r0, PROMPT) == 96
    reg.mark_dead(r0, "gone")
    assert r0.cache is None and expected_hit_tokens(r0, PROMPT) == 0
    assert pick_rank(reg, CacheAware(), RouteRequest(PROMPT, 1), "colocated", 8).name == "colocated-1"
    assert registry(1, ROOT, role="decode").live()[0].cache is not None  # it prefills too (--disagg)
    assert registry(1).live()[0].cache is None  # no host cache on the rank


def test_cache_aware_prefers_the_rank_holding_the_prefix_unless_its_queue_is_much_longer():
    reg = registry(3, ROOT)
    r0, r1, r2 = reg.live()
    r1.cache.apply([stored(PROMPT, 6)])  # 96 tokens
    policy = CacheAware(load_tokens=32)
    req = RouteRequest(PROMPT, 1)
    assert policy.choose(reg.live(), req) is r1
    r1.inflight = {"a", "b"}  # 96 - 2 * 32 = 32 > 0: still worth the wait
    assert policy.choose(reg.live(), req) is r1
    r1.inflight = {"a", "b", "c", "d"}  # 96 - 128 < 0: the idle ranks win, least loaded among them
    r0.inflight = {"x"}
    assert policy.choose(reg.live(), req) is r2
    assert policy.choose(reg.live(), RouteRequest([5] * 100, 1)) is r2  # no hit anywhere: least loaded
    assert CacheAware().choose([r0, r1], req) is r0  # default: a request in flight costs 256 tokens


def test_cache_aware_without_host_caches_is_least_loaded():
    reg = registry(2)
    policy = CacheAware()
    picks = []
    for _ in range(4):
        rank = pick_rank(reg, policy, RouteRequest(PROMPT, 1), "colocated", 8)
        rank.routed += 1
        picks.append(rank.index)
    assert picks == [0, 1, 0, 1]


def test_affinity_is_stable_per_conversation_and_spreads_them():
    reg = registry(4)
    policy = Affinity()
    first = {k: policy.choose(reg.live(), RouteRequest([1], 1, k)).index for k in map(str, range(40))}
    assert first == {k: Affinity().choose(reg.live()[::-1], RouteRequest([2, 3], 1, k)).index for k in first}
    assert len(set(first.values())) == 4
    reg.live()[1].inflight = {"x"}
    assert policy.choose(reg.live(), RouteRequest([1], 1)).index == 0  # no user message: least loaded


def test_default_policy_is_cache_aware():
    from pd_server.config import RouterConfig

    assert make_policy(RouterConfig().routing_policy).name == "cache-aware"
    assert {make_policy(n).name for n in ("affinity", "least-loaded")} == {"affinity", "least-loaded"}
