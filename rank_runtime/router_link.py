"""A rank's side of the router link: one IO thread owns the DEALER socket.

Threads:
  * the IO thread (this module) owns the DEALER connected to the router and the PULL end of
    an inproc pipe; it says Hello until Welcome, forwards what the engine thread pushes,
    puts Generate/Abort into `inbox`, sends RankStats every heartbeat, and decides when the
    rank must exit (Reject, Shutdown, router silent, no Welcome in time, a failed handshake:
    another cluster secret). With --rejoin, a lost router (connection closed, or silent) makes
    the rank start over instead: a new socket and identity, RouterLost to the engine thread,
    Hello until a router (the restarted one) welcomes it as a fresh rank;
  * the engine thread (the caller) owns the engine and the PUSH end of the pipe: it calls
    `send()` / `send_peer()` and reads `inbox`, and stops when `stopped` is set.
PD ranks also hand the IO thread their rank-to-rank sockets (peer_link.py): it keeps the
prefill side's connections in step with the router's `Peers`, forwards peer messages to
`inbox` as `PeerMessage`s, and sends the engine thread's peer messages (pipe frames are
[destination, payload]; an empty destination is the router).
Heartbeats come from the IO thread, so a long engine step (a big prefill on a busy CPU)
does not make the router think the rank died. torch releases the GIL in its kernels.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from cluster.auth import handshake_failure, secure_client
from cluster.protocol.codec import Codec
from cluster.protocol.rank_router import Goodbye, Hello, RankStats
from cluster.protocol.router_rank import Abort, Generate, Peers, Ping, Reject, Shutdown, Welcome
from rank_runtime.config import RankConfig
from rank_runtime.peer_link import PeerMessage, PeerSockets

log = logging.getLogger(__name__)

EXIT_REJECTED = 3  # the router refused this rank (version or model mismatch, cluster secret)
EXIT_NO_ROUTER = 4  # no Welcome in time, or the router went silent
HANDSHAKE_ATTEMPTS = 3  # failed handshakes in a row (ZeroMQ retries every 100 ms) before giving up
HANDSHAKE_GRACE_S = 3.0  # ... or this long after a failure with no successful handshake


@dataclass(frozen=True)
class RouterLost:
    """In-process only (IO thread -> engine thread): the router is gone and this rank rejoins
    (--rejoin) as a fresh rank: drop every request, free its pages (nobody awaits its tokens)."""

    reason: str


@dataclass(frozen=True)
class Wake:
    """In-process only: put on `inbox` by stop(), so that an engine thread waiting for work sees
    `stopped` at once. An idle engine thread waits for a message up to 0.25 s (IDLE_WAIT_S), and
    this IO thread polls up to IO_POLL_MS, rather than waking every 50 / 100 ms: wake-ups of one
    rank's idle threads take cores from the step of another on the same host (measured: a
    530-token prompt's prefill on 2 cores beside an idle colocated-2 cluster, three alternations,
    medians 80.2-81.8 -> 78.6-80.9 ms; 77.6-78.9 with no cluster running)."""


Inbound = Generate | Abort | Peers | PeerMessage | RouterLost | Wake
IO_POLL_MS = 250  # the IO thread's longest poll (heartbeats, deadlines and messages wake it sooner)


class RankLink:
    def __init__(self, cfg: RankConfig, hello: Hello, stats: Callable[[], RankStats],
                 peers: PeerSockets | None = None) -> None:
        """`stats` is called from the IO thread: it must only read a snapshot (no engine calls).
        `peers` (PD ranks) is owned by the IO thread from `start()` on and closed with the link."""
        self.cfg = cfg
        self.peers = peers
        # SimpleQueue: its put() is reentrant, so stop() may run in a signal handler (Wake)
        self.inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.exit_code = 0
        self.stop_reason = ""
        self._hello = hello
        self._stats = stats
        self._ctx = zmq.Context()
        pipe = f"inproc://rank-out-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)  # IO thread
        self._pull.bind(pipe)
        self._push = self._ctx.socket(zmq.PUSH)  # engine thread
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(pipe)
        self._generation = 0  # sockets opened to the router so far (a rejoin opens a new one)
        self._dealer, self._monitor = self._open_dealer()  # IO thread
        self._enc = msgspec.msgpack.Encoder()  # engine thread
        self._thread = threading.Thread(target=self._run, name="rank-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _open_dealer(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER to the router (identity "<name>-<pid>", then "-<n>" per rejoin) and its monitor."""
        dealer = self._ctx.socket(zmq.DEALER)
        ident = f"{self.cfg.name}-{self._hello.pid}" + (f"-{self._generation}" if self._generation else "")
        self._generation += 1
        dealer.setsockopt(zmq.IDENTITY, ident.encode())
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.LINGER, 500)  # let Goodbye leave on exit
        secure_client(dealer, self.cfg.secret)
        monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED
                                            | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        dealer.connect(self.cfg.router_addr)
        return dealer, monitor

    def _close_dealer(self, linger: int | None = None) -> None:
        self._dealer.disable_monitor()
        self._monitor.close(linger=0)
        self._dealer.close(linger=linger)

    def send(self, msg: msgspec.Struct) -> None:
        """Engine thread only: queue one message for the router."""
        self._push.send_multipart([b"", self._enc.encode(msg)], copy=False)

    def send_peer(self, dest: bytes, msg: msgspec.Struct) -> None:
        """Engine thread only: queue one message for a peer rank (PeerMessage.sender names it).
        Fire and forget: a peer that is gone loses it (leases and Peers updates cover that)."""
        self._push.send_multipart([dest, self._enc.encode(msg)], copy=False)

    def stop(self, reason: str, code: int = 0) -> None:
        if not self.stopped.is_set():
            self.stop_reason, self.exit_code = reason, code
            self.stopped.set()
            self.inbox.put(Wake())

    def close(self) -> None:
        """Engine thread, after it stopped: join the IO thread and close every socket."""
        self.stop("closing")
        self._thread.join(timeout=5)
        self._push.close(linger=0)
        self._ctx.destroy(linger=500)

    # ---- IO thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - any IO failure ends the rank, loudly
            log.exception("rank link failed")
            self.stop(f"rank link failed: {e}", 1)
        try:
            self._dealer.send(Codec().encode(Goodbye(self.stop_reason)), zmq.DONTWAIT)
        except zmq.ZMQError:
            pass
        self._close_dealer()
        self._pull.close(linger=0)
        if self.peers is not None:
            self.peers.close()

    def _loop(self) -> None:
        cfg, codec = self.cfg, Codec()
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        peer_socks = set(self.peers.sockets) if self.peers is not None else set()
        for sock in peer_socks:
            poller.register(sock, zmq.POLLIN)
        started = time.monotonic()
        welcomed, heartbeat, failed_handshakes, handshake_ok = False, 0.5, 0, False
        refused_since, refused_reason = 0.0, ""
        next_hello = next_stats = last_router = started
        last_loop = started
        while not self.stopped.is_set():
            now = time.monotonic()
            due = next_stats if welcomed else next_hello
            events = dict(poller.poll(max(1, min(IO_POLL_MS, int((due - now) * 1000)))))
            # NOTE: this loop wakes at least every IO_POLL_MS. A gap over 1 s means this process did
            # not run (SIGSTOP, a starved machine): the silence was ours, so the router gets a fresh
            # timeout to answer the stats sent below (a router that declared this rank dead
            # answers with Shutdown) before it is presumed gone.
            if time.monotonic() - last_loop > 1.0:
                last_router = time.monotonic()
            last_loop = time.monotonic()
            if self._pull in events:
                while True:
                    try:
                        dest, frame = self._pull.recv_multipart(zmq.DONTWAIT, copy=False)
                    except zmq.Again:
                        break
                    if not dest.bytes:
                        if welcomed:  # NOTE: after a rejoin, frames of dropped requests wait for no one
                            self._dealer.send(frame, copy=False)
                    elif self.peers is not None:
                        self.peers.send(dest.bytes, frame.bytes)
            for sock in peer_socks & events.keys():
                for pm in self.peers.recv(sock):
                    self.inbox.put(pm)
            lost = ""
            if self._monitor in events:
                event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                reason = handshake_failure(event, "client")
                if event == zmq.EVENT_DISCONNECTED and not welcomed and not handshake_ok:
                    # A CURVE router may close a plain client's connection before the client sees a
                    # handshake failure: a close before any handshake succeeded counts as one.
                    reason = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "client")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    handshake_ok, failed_handshakes = True, 0
                elif reason:
                    failed_handshakes += 1
                    refused_reason = reason
                    refused_since = refused_since or time.monotonic()
                if event == zmq.EVENT_DISCONNECTED and welcomed and cfg.rejoin:
                    lost = "the router's connection closed"
            # NOTE: the secret will not change, so a refusal is final; but one failure alone may be a
            # router closing mid-handshake (starting or stopping), and ZeroMQ does not always retry
            # after a failed handshake: give up after a few failures or a grace time with no success.
            if refused_since and not handshake_ok and (
                    failed_handshakes >= HANDSHAKE_ATTEMPTS or time.monotonic() - refused_since > HANDSHAKE_GRACE_S):
                self.stop(f"router at {cfg.router_addr} refused this rank: {refused_reason}", EXIT_REJECTED)
                break
            if self._dealer in events:
                while True:
                    try:
                        frame = self._dealer.recv(zmq.DONTWAIT)
                    except zmq.Again:
                        break
                    last_router = time.monotonic()
                    try:
                        msg = codec.decode_from_router(frame)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        log.error("dropping undecodable frame from the router: %s", e)
                        continue
                    if isinstance(msg, (Generate, Abort)):
                        self.inbox.put(msg)
                    elif isinstance(msg, Peers):
                        if self.peers is not None:
                            added, removed = self.peers.on_peers(msg)
                            for sock in removed:
                                poller.unregister(sock)
                                peer_socks.discard(sock)
                            for sock in added:
                                poller.register(sock, zmq.POLLIN)
                                peer_socks.add(sock)
                        self.inbox.put(msg)
                    elif isinstance(msg, Ping):
                        pass
                    elif isinstance(msg, Welcome):
                        if not welcomed:
                            log.info("router welcomed this rank as %s", msg.rank_name)
                        welcomed, heartbeat = True, msg.heartbeat_interval_s
                    elif isinstance(msg, Reject):
                        self.stop(f"router rejected this rank: {msg.reason}", EXIT_REJECTED)
                    elif isinstance(msg, Shutdown):
                        self.stop(f"router asked to shut down: {msg.reason}")
            now = time.monotonic()
            if not welcomed:
                if now - started > cfg.connect_timeout_s:
                    self.stop(f"no router answered at {cfg.router_addr} within {cfg.connect_timeout_s}s",
                              EXIT_NO_ROUTER)
                elif now >= next_hello:
                    # DONTWAIT: a DEALER with no connection blocks on send, and a refused handshake
                    # may leave it with none for good; the refusal check above must keep running.
                    try:
                        self._dealer.send(codec.encode(self._hello), zmq.DONTWAIT)
                    except zmq.Again:
                        pass
                    next_hello = now + cfg.hello_interval_s
            else:
                if now - last_router > cfg.router_timeout_s:
                    lost = f"router silent for {now - last_router:.1f}s; assuming it is gone"
                    if not cfg.rejoin:
                        self.stop(lost, EXIT_NO_ROUTER)
                if lost and cfg.rejoin:
                    # Start over as a fresh rank: a new socket (frames queued for the old router are
                    # dropped, the new identity is unknown to any router), every request dropped.
                    log.warning("%s: dropping every request and saying Hello again", lost)
                    poller.unregister(self._dealer)
                    poller.unregister(self._monitor)
                    self._close_dealer(linger=0)
                    self._dealer, self._monitor = self._open_dealer()
                    poller.register(self._dealer, zmq.POLLIN)
                    poller.register(self._monitor, zmq.POLLIN)
                    self.inbox.put(RouterLost(lost))
                    welcomed, started, next_hello = False, now, now
                elif now >= next_stats:
                    self._dealer.send(codec.encode(self._stats()))
                    next_stats = now + heartbeat
