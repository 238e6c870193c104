"""The cluster secret on real ZeroMQ sockets (loopback): who gets a frame through, what a refused
peer is told, the frame-size bound; the same on the PD peer sockets."""
from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from cluster.auth import (derive_keys, handshake_failure, secure_client, secure_server,
                                    start_authenticator)
from cluster.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from cluster.protocol.prefill_decode import PeerHello
from cluster.protocol.router_rank import PeerInfo, Peers
from rank_runtime.peer_link import PeerSockets


def test_keys_are_derived_per_secret_and_side():
    a, b = derive_keys("s3cret", "server"), derive_keys("s3cret", "client")
    assert a == derive_keys("s3cret", "server") and a != b and a != derive_keys("other", "server")
    assert len(a.public) == len(a.secret) == 40 and zmq.curve_public(a.secret) == a.public
    with pytest.raises(ValueError):
        derive_keys("", "server")


class Pair:
    """A ROUTER bound with `server_secret`, DEALERs connected with given secrets."""

    def __init__(self, server_secret: str) -> None:
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, server_secret)
        self.server = self.ctx.socket(zmq.ROUTER)
        secure_server(self.server, server_secret)
        self.server.linger = 0
        self.port = self.server.bind_to_random_port("tcp://127.0.0.1")
        self.clients: list[zmq.Socket] = []

    def client(self, secret: str, keys=None) -> tuple[zmq.Socket, zmq.Socket]:
        c = self.ctx.socket(zmq.DEALER)
        c.linger = 0
        secure_client(c, secret)
        if keys is not None:  # a client that knows the server key but not the secret
            c.curve_publickey, c.curve_secretkey = keys
        mon = c.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        c.connect(f"tcp://127.0.0.1:{self.port}")
        self.clients += [c, mon]
        return c, mon

    def received(self, timeout_ms: int = 1500) -> list[bytes] | None:
        return self.server.recv_multipart() if self.server.poll(timeout_ms) else None

    def close(self) -> None:
        for s in self.clients:
            s.close(linger=0)
        self.server.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def try_send(c: zmq.Socket, frame: bytes) -> None:
    """Send without blocking: a DEALER whose handshake already failed has no pipe to queue on
    (a blocking send then waits forever)."""
    try:
        c.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def first_event(mon: zmq.Socket) -> int:
    assert mon.poll(3000), "no handshake event"
    return parse_monitor_message(mon.recv_multipart())["event"]


@pytest.fixture
def pair():
    p = Pair("s3cret")
    yield p
    p.close()


def test_a_client_with_the_secret_gets_through(pair):
    c, mon = pair.client("s3cret")
    c.send(b"hello")
    assert first_event(mon) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert pair.received()[-1] == b"hello"


@pytest.mark.parametrize("secret", ["wrong", ""])
def test_a_client_without_the_secret_is_refused_and_told(pair, secret):
    c, mon = pair.client(secret)
    try_send(c, b"inject")
    event = first_event(mon)
    reason = handshake_failure(event, "client")
    assert reason is not None and "cluster secret" in reason
    assert pair.received(500) is None  # nothing it sent reached the application


def test_the_server_key_alone_does_not_let_a_client_in(pair):
    stranger = zmq.curve_keypair()  # knows the server's public key (leaked), not the secret
    c, mon = pair.client("s3cret", keys=stranger)
    try_send(c, b"inject")
    assert first_event(mon) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert pair.received(500) is None


def test_an_oversized_frame_drops_the_connection_not_the_server():
    p = Pair("")
    try:
        c, _ = p.client("")
        c.send(b"x" * (MAX_FRAME_BYTES + 1))
        assert p.received(1000) is None
        c2, _ = p.client("")
        c2.send(b"ok")
        assert p.received()[-1] == b"ok"
    finally:
        p.close()


def _peer_hello() -> PeerHello:
    return PeerHello(PROTOCOL_VERSION, "prefill-0", 1, "shm", b"meta")


@pytest.mark.parametrize("prefill_secret,arrives", [("s3cret", True), ("wrong", False), ("", False)])
def test_peer_sockets_admit_only_prefill_ranks_with_the_secret(prefill_secret, arrives):
    decode = PeerSockets("decode", "decode-0", "127.0.0.1", secret="s3cret")
    prefill = PeerSockets("prefill", "prefill-0", "127.0.0.1", _peer_hello(), secret=prefill_secret)
    try:
        prefill.on_peers(Peers([PeerInfo("decode-0", "decode", decode.addr)]))
        [sock] = decode.sockets
        got = []
        deadline = time.monotonic() + (5 if arrives else 1.5)
        while not got and time.monotonic() < deadline:
            if sock.poll(100):
                got = decode.recv(sock)
        assert bool(got) == arrives
        if arrives:
            assert got[0].msg == _peer_hello()
    finally:
        prefill.close()
        decode.close()
