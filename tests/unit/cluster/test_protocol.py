"""Router <-> rank messages: round trips through the typed codec, direction checks, version refusal."""
from __future__ import annotations

import msgspec
import pytest

from cluster.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from cluster.protocol.codec import Codec
from cluster.protocol.prefill_decode import (Handoff, PeerHello, PeerReject, PeerWelcome, PrefillTimes, Pulled,
                                               PullFailed)
from cluster.protocol.rank_router import (CacheEvents, CacheUpdate, Goodbye, Hello, PhaseTimes, RankStats,
                                            RequestError, TokenBatch, TokenEvent, TokenLogprob)
from cluster.protocol.router_rank import (Abort, Generate, PeerInfo, Peers, Ping, Reject, Sampling, Shutdown,
                                            Welcome)
from pd_server.ranks import RankRegistry

HELLO = Hello(PROTOCOL_VERSION, "colocated", 0, 1234, "smollm2-135m-instruct", 8192, 49152, 16, 728)

TO_RANK = [
    Welcome(PROTOCOL_VERSION, "colocated-0", 0.5),
    Reject("nope"),
    Generate("r-0", [1, 2, 3], Sampling(max_tokens=5, temperature=0.0, stop=("\n",), seed=7, logprobs=2), 1.5),
    Generate("r-1", [9], Sampling(max_tokens=1), 2.0, decode_rank=3),
    Abort("r-0"),
    Peers([PeerInfo("prefill-0", "prefill", ""), PeerInfo("decode-0", "decode", "tcp://127.0.0.3:4000")]),
    Ping(3.0),
    Shutdown("bye"),
]
TO_ROUTER = [
    HELLO,
    TokenBatch([TokenEvent("r-0", [5], "hi"),
                TokenEvent("r-1", [6, 7], "é", "stop", "\n", 3, 2, 1, [TokenLogprob(6, -0.5, [(6, -0.5), (8, -1.0)])],
                           PhaseTimes(1.0, 2.0, 3.0)),
                TokenEvent("r-2", [1], "x", "length", times=PhaseTimes(1.0, 2.0, 9.0, 1.5, 2.1, 2.2, 2.3, 2.4))], 4.0),
    RankStats(running=1, waiting=2, pages_used=3, pages_total=4, swa_slots_free=0, steps=9,
              host_cache_lookup_tokens=64, host_cache_hit_tokens=32, handoff_pages_used=5, handoffs=1,
              transfer_bytes=1 << 20, transfer_seconds=0.5),
    Hello(PROTOCOL_VERSION, "decode", 1, 99, "m", 8192, 49152, 16, 100, "tcp://127.0.0.3:4000"),
    Hello(PROTOCOL_VERSION, "prefill", 0, 98, "m", 8192, 49152, 16, 100, "", b"\x01" * 16, True),
    CacheEvents([CacheUpdate("page_stored", [b"a" * 16, b"\x00" * 16]), CacheUpdate("state_evicted", [b"b" * 16])]),
    RequestError("r-0", 400, "bad"),
    Goodbye("closing"),
]


TO_DECODE = [
    PeerHello(PROTOCOL_VERSION, "prefill-0", 42, "nixl", b"\x00agent metadata\xff"),
    Handoff("r-0", [1, 2, 3], 7, Sampling(max_tokens=5, temperature=0.0, seed=3), 0, [4, 9], -1, 10.0,
            PrefillTimes(1.0, 1.1, 1.2, 1.3)),
]
TO_PREFILL = [PeerWelcome("decode-0"), PeerReject("decode-0", "no"), Pulled("r-0"), PullFailed("r-0", "aborted")]


@pytest.mark.parametrize("msg", TO_DECODE, ids=lambda m: type(m).__name__)
def test_prefill_to_decode_round_trip(msg):
    c = Codec()
    assert c.decode_from_prefill(c.encode(msg)) == msg


@pytest.mark.parametrize("msg", TO_PREFILL, ids=lambda m: type(m).__name__)
def test_decode_to_prefill_round_trip(msg):
    c = Codec()
    assert c.decode_from_decode(c.encode(msg)) == msg


def test_peer_links_accept_only_their_direction_and_probe_the_peer_hello_version():
    c = Codec()
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_prefill(c.encode(Pulled("x")))
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_decode(c.encode(TO_DECODE[1]))
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_rank(c.encode(TO_DECODE[0]))

    class NewerPeerHello(msgspec.Struct, array_like=True, tag="peer_hello"):
        protocol_version: int
        something_else: float

    frame = c.encode(NewerPeerHello(PROTOCOL_VERSION + 1, 1.5))
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_prefill(frame)
    assert c.probe_peer_hello_version(frame) == PROTOCOL_VERSION + 1
    assert c.probe_peer_hello_version(c.encode(Pulled("x"))) is None


def test_handoff_carries_page_ids_not_tensors():
    frame = Codec().encode(TO_DECODE[1])
    assert len(frame) < 160  # ids and scalars only: the KV moves through the transfer backend


@pytest.mark.parametrize("msg", TO_RANK, ids=lambda m: type(m).__name__)
def test_router_to_rank_round_trip(msg):
    c = Codec()
    assert c.decode_from_router(c.encode(msg)) == msg


@pytest.mark.parametrize("msg", TO_ROUTER, ids=lambda m: type(m).__name__)
def test_rank_to_router_round_trip(msg):
    c = Codec()
    assert c.decode_from_rank(c.encode(msg)) == msg


def test_decoders_accept_only_their_direction():
    c = Codec()
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_rank(c.encode(Abort("x")))
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_router(c.encode(HELLO))
    with pytest.raises(msgspec.DecodeError):
        c.decode_from_rank(b"\xc1 not msgpack")


def test_hot_path_is_compact():
    # array_like: field names never cross the wire
    frame = Codec().encode(TokenBatch([TokenEvent("r-0", [5], "hi")], 1.0))
    assert b"token_ids" not in frame and b"request_id" not in frame and len(frame) < 40


def test_hello_version_is_probed_from_a_newer_hello():
    class NewerHello(msgspec.Struct, array_like=True, tag="hello"):
        protocol_version: int
        role: str
        brand_new: list[int]

    c = Codec()
    frame = c.encode(NewerHello(PROTOCOL_VERSION + 1, "decode", [1]))
    with pytest.raises(msgspec.ValidationError):
        c.decode_from_rank(frame)
    assert c.probe_hello_version(frame) == PROTOCOL_VERSION + 1
    assert c.probe_hello_version(c.encode(RankStats(0, 0, 0, 0, 0, 0))) is None


def test_registry_refuses_a_mismatched_version_with_both_versions_named():
    reg = RankRegistry("smollm2-135m-instruct")
    old = msgspec.structs.replace(HELLO, protocol_version=PROTOCOL_VERSION - 1)
    reply = reg.on_hello(b"id", old, 0.0, 0.5)
    assert isinstance(reply, Reject)
    assert f"rank speaks {PROTOCOL_VERSION - 1}" in reply.reason and f"router speaks {PROTOCOL_VERSION}" in reply.reason
    assert reg.live() == []
    assert isinstance(reg.on_hello(b"id", HELLO, 0.0, 0.5), Welcome)


def test_sampling_mirrors_engine_sampling_params():
    from dataclasses import fields

    from engine.sampling_params import SamplingParams

    wire = set(Sampling.__struct_fields__)
    engine = {f.name for f in fields(SamplingParams)} - {"extra"}
    assert wire == engine, "Sampling and SamplingParams drifted apart (and bump PROTOCOL_VERSION)"


def test_cache_update_kind_is_checked():
    frame = msgspec.msgpack.encode(["cache", [["page_touched", [b"k" * 16]]]])
    with pytest.raises(msgspec.ValidationError):
        Codec().decode_from_rank(frame)


def test_the_largest_legitimate_frames_fit_the_frame_bound():
    """MAX_FRAME_BYTES (ZMQ_MAXMSGSIZE on rank sockets) is sized from these; a frame past it drops
    the connection, so none of them may reach it."""
    codec, ids, vocab_max = Codec(), 2**20, 2**31 - 1  # a 1M-token prompt of the largest token ids
    sampling = Sampling(max_tokens=1, stop=tuple("s" * 64 for _ in range(16)))
    times = PrefillTimes(1.0, 1.0, 1.0, 1.0)
    top = [(vocab_max, -1.5)] * 20
    frames = [
        Generate("r" * 64, [vocab_max] * ids, sampling, 1.0, 0),
        Handoff("r" * 64, [vocab_max] * ids, 1, sampling, 0, list(range(ids // 16)), 0, 10.0, times),
        CacheEvents([CacheUpdate("page_evicted", [b"k" * 16] * 2**20)]),
        TokenBatch([TokenEvent("r" * 64, [vocab_max], "x" * 16, logprobs=[TokenLogprob(vocab_max, -1.0, top)])]
                   * 1024, 1.0),
    ]
    sizes = [len(codec.encode(f)) for f in frames]
    assert max(sizes) < MAX_FRAME_BYTES, sizes
