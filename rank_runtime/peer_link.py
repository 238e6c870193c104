"""Rank-to-rank sockets of a PD rank (prefill <-> decode), owned by the rank's IO thread.

    decode rank:  one ROUTER bound at tcp://<--host>:<free port> (Hello.peer_addr)
    prefill rank: one DEALER per live decode rank, connected from <--host> (so the traffic
                  leaves from this rank's own address, as across hosts), identity
                  "<name>-<pid>", PeerHello sent first on each

The router's `Peers` message drives the prefill side's connections (`on_peers`). The IO
thread (rank_link.py) polls `sockets`, turns each received frame into a `PeerMessage` for the
engine thread's inbox, and sends what the engine thread addresses to a peer. Frames are the
typed messages of cluster/protocol/prefill_decode.py; nothing here decides what they mean.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from cluster.auth import secure_client, secure_server, start_authenticator
from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.codec import Codec
from cluster.protocol.prefill_decode import DecodeToPrefill, PeerHello, PeerReject, PrefillToDecode
from cluster.protocol.router_rank import Peers

log = logging.getLogger(__name__)

# Frames queued per peer before a send drops (the lease then fails the request): a decode rank
# that stopped reading is noticed by the router within seconds anyway.
PEER_SNDHWM = 10_000


@dataclass(frozen=True)
class PeerMessage:
    """A message from another rank, as the engine thread sees it (in-process only)."""

    sender: bytes  # decode rank: the prefill DEALER's identity; prefill rank: the decode rank's name
    msg: PrefillToDecode | DecodeToPrefill
    received: float = field(default_factory=time.monotonic)  # when the IO thread took it off the socket


class PeerSockets:
    """Not thread-safe: built by the main thread, then used by the IO thread only."""

    def __init__(self, role: str, name: str, host: str, hello: PeerHello | None = None, secret: str = "") -> None:
        """`secret`: the cluster secret (cluster_auth.py); with one, the decode side's socket
        admits only prefill ranks holding it and every frame is encrypted."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"peer sockets are for PD ranks, not {role!r}")
        if role == "prefill" and hello is None:
            raise ValueError("a prefill rank's peer sockets need its PeerHello")
        self.role, self.name, self.host, self.secret = role, name, host, secret
        self._codec = Codec()
        self._hello = self._codec.encode(hello) if hello is not None else b""
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, secret) if role == "decode" else None
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, tuple[str, zmq.Socket]] = {}  # decode name -> (addr, DEALER)
        self.addr = ""
        if role == "decode":
            s = self._router = self._ctx.socket(zmq.ROUTER)
            secure_server(s, secret)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(f"tcp://{host}:*")
            self.addr = s.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self._router] if self._router is not None else [d for _, d in self._dealers.values()]

    def on_peers(self, peers: Peers) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
        """Prefill: connect to new decode ranks, drop vanished ones. Returns (added, removed)
        sockets for the caller's poller."""
        if self.role != "prefill":
            return [], []
        want = {p.name: p.addr for p in peers.peers if p.role == "decode" and p.addr}
        added, removed = [], []
        for name, (addr, sock) in list(self._dealers.items()):
            if want.get(name) != addr:
                del self._dealers[name]
                sock.close(linger=0)
                removed.append(sock)
                log.info("disconnected from %s (%s)", name, addr)
        for name, addr in want.items():
            if name in self._dealers:
                continue
            sock = self._ctx.socket(zmq.DEALER)
            secure_client(sock, self.secret)
            sock.setsockopt(zmq.IDENTITY, f"{self.name}-{os.getpid()}".encode())
            sock.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            # "tcp://SOURCE:0;DEST:PORT": leave from this rank's own address.
            sock.connect(f"tcp://{self.host}:0;{addr.removeprefix('tcp://')}")
            sock.send(self._hello, zmq.DONTWAIT)  # queued until connected; first on the wire
            self._dealers[name] = (addr, sock)
            added.append(sock)
            log.info("connecting to %s at %s", name, addr)
        return added, removed

    def recv(self, sock: zmq.Socket) -> list[PeerMessage]:
        """Everything readable on `sock`, decoded. Undecodable frames are logged and dropped;
        a PeerHello of another protocol version is answered with PeerReject here."""
        out = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.DONTWAIT)
            except zmq.Again:
                return out
            if len(frames) != (2 if self.role == "decode" else 1):
                log.error("dropping a %d-part message from a peer", len(frames))
                continue
            if self.role == "decode":
                sender, frame = frames[0], frames[-1]
            else:
                sender = next((n.encode() for n, (_, s) in self._dealers.items() if s is sock), b"?")
                frame = frames[-1]
            msg = self._decode(sender, frame)
            if msg is not None:
                out.append(PeerMessage(sender, msg))

    def _decode(self, sender: bytes, frame: bytes):
        try:
            if self.role == "decode":
                return self._codec.decode_from_prefill(frame)
            return self._codec.decode_from_decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            version = self._codec.probe_peer_hello_version(frame) if self.role == "decode" else None
            if version is not None:
                reason = (f"protocol version mismatch: prefill rank speaks {version}, decode rank "
                          f"{self.name} speaks {PROTOCOL_VERSION}; start every rank from the same checkout")
                log.error("refusing peer %r: %s", sender, reason)
                self.send(sender, self._codec.encode(PeerReject(self.name, reason)))
            else:
                log.error("dropping undecodable frame from peer %r: %s", sender, e)
            return None

    def send(self, dest: bytes, frame: bytes) -> bool:
        """Send one frame to a peer; False (logged) when it is gone or its queue is full."""
        try:
            if self._router is not None:
                self._router.send_multipart([dest, frame], zmq.DONTWAIT)
                return True
            entry = self._dealers.get(dest.decode())
            if entry is None:
                log.warning("no connection to %s; dropping a message", dest.decode())
                return False
            entry[1].send(frame, zmq.DONTWAIT)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone), EAGAIN (queue full)
            log.warning("send to peer %r failed: %s", dest, e)
            return False

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
        self._dealers.clear()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
