"""Encoding and typed decoding for the router <-> rank and prefill <-> decode links (msgpack via msgspec).

A frame is one msgpack-encoded tagged array_like Struct: [tag, field, ...]. Decoders accept only the union of their
direction and raise msgspec.DecodeError / ValidationError on anything else: nothing is
ever unpickled or dispatched by name.
"""
from __future__ import annotations

import msgspec

from cluster.protocol.prefill_decode import DecodeToPrefill, PrefillToDecode
from cluster.protocol.rank_router import RankToRouter
from cluster.protocol.router_rank import RouterToRank


class HelloProbe(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    """The part of any version's Hello this version can always read (see PROTOCOL_VERSION)."""

    protocol_version: int


class PeerHelloProbe(msgspec.Struct, frozen=True, array_like=True, tag="peer_hello"):
    """The part of any version's PeerHello this version can always read."""

    protocol_version: int


class Codec:
    """One per thread that uses it (msgspec encoders/decoders are not shared across threads)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._from_rank = msgspec.msgpack.Decoder(RankToRouter)
        self._from_router = msgspec.msgpack.Decoder(RouterToRank)
        self._probe = msgspec.msgpack.Decoder(HelloProbe)
        self._from_prefill = msgspec.msgpack.Decoder(PrefillToDecode)
        self._from_decode = msgspec.msgpack.Decoder(DecodeToPrefill)
        self._peer_probe = msgspec.msgpack.Decoder(PeerHelloProbe)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._enc.encode(msg)

    def decode_from_rank(self, frame: bytes) -> RankToRouter:
        return self._from_rank.decode(frame)

    def decode_from_router(self, frame: bytes) -> RouterToRank:
        return self._from_router.decode(frame)

    def decode_from_prefill(self, frame: bytes) -> PrefillToDecode:
        return self._from_prefill.decode(frame)

    def decode_from_decode(self, frame: bytes) -> DecodeToPrefill:
        return self._from_decode.decode(frame)

    def probe_peer_hello_version(self, frame: bytes) -> int | None:
        """protocol_version of a PeerHello this version cannot fully decode; None if not one."""
        try:
            return self._peer_probe.decode(frame).protocol_version
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def probe_hello_version(self, frame: bytes) -> int | None:
        """protocol_version of a Hello this version cannot fully decode; None if not a Hello."""
        try:
            return self._probe.decode(frame).protocol_version
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
