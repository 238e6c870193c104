"""The router's streamed tokens of one dispatcher round go out together (native/sse_fanout.py).

A plain streamed token used to cost, per stream, uvicorn's send coroutine, the asyncio
transport's write and a socket.send call, on the router's one thread, 256 times a step at 256
streams before the last stream's token left. Here a stream that takes the eager path
(sse_response.SSEStream._eager) only adds (fd, body) to the round's `Batch`. In a round of at
least PIPELINE_STREAMS streams, every PIECE bodies go to the native sender, whose helper thread
sends them (one sendmsg each, each as the HTTP/1.1 chunk uvicorn would have written) while the
loop renders the next streams' tokens; the dispatcher's end of round (`Dispatcher._flush_held`,
the only caller of the eager writers) sends the rest and waits for all of them (`Batch.send`).
A smaller round never wakes the helper: all its bodies go out at its end from the loop thread.
So a body is never in flight while anything else could write to its connection or close it
(the loop thread is inside the round until every body of it is sent), and each connection has
at most one body in a round (its inbox is flushed once a round). docs/results/bench-router.md
has what each step measured.

Only where that is exactly what uvicorn would do (`Direct.of`): a plain-TCP asyncio transport
of uvicorn's httptools protocol whose response is chunked, and, each round (`Direct.ready`),
nothing buffered in the transport, no flow-control pause, the response neither complete nor
disconnected. A socket that takes only part of its frame (or fails) gets the rest through the
transport's own write, which buffers it (the stream then goes back to uvicorn's send until the
buffer drains) or fails the connection as before.

The native module is built once per source version into the pdserve cache when the router
starts (`load()`); without a compiler the same sends run from Python (os.writev) at the round's
end (`Inline`).
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("pd_server.fanout")

_TCP_TRANSPORTS = ("_SelectorSocketTransport", "TCPTransport")  # asyncio's, uvloop's


def _send_chunks_py(fds: list[int], bodies: list[bytes]) -> list[tuple[int, int]]:
    """send_chunks without the C module (same contract)."""
    short = []
    for i, (fd, body) in enumerate(zip(fds, bodies)):
        head = b"%x\r\n" % len(body)
        try:
            n = os.writev(fd, [head, body, b"\r\n"])
        except OSError as e:
            short.append((i, -e.errno))
            continue
        if n != len(head) + len(body) + 2:
            short.append((i, n))
    return short


def load() -> bool:
    """Build (or find cached) and load the native module, once: the router calls it as it starts
    (nothing is built at import). Until then, and where it cannot be had (no compiler), the
    Python sends run. True when the native module is in use."""
    global NATIVE, send_chunks, _tried
    if not _tried:
        _tried = True
        from native import sse_fanout

        try:
            NATIVE = sse_fanout.load()
            send_chunks = NATIVE.send_chunks
            BATCH.sender = default_sender()  # (made at import, before the module was loaded)
        except Exception as e:  # noqa: BLE001 - any failure leaves the Python sends, which are correct
            log.warning("native SSE fan-out unavailable (%s); using the Python one", e)
    return NATIVE is not None


NATIVE = None  # the loaded native module (native/sse_fanout.py), after load()
send_chunks = _send_chunks_py
_tried = False
PIECE = 8  # bodies a post() hands the helper: it starts on a round's first streams while the rest render
# Rounds of fewer streams send everything at their end on the loop thread: at 64 streams the
# helper lowered no latency and cost 16% more router CPU a token (docs/results/bench-router.md).
PIPELINE_STREAMS = 128


class Inline:
    """A round's sends on the calling thread at its end: one send_chunks call for every body
    posted (without the native module)."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._bodies: list[bytes] = []

    def post(self, fds: list[int], bodies: list[bytes], wake: bool = True) -> None:
        self._fds += fds
        self._bodies += bodies

    def collect(self) -> list[tuple[int, int]]:
        """(index among every body posted since the last collect, sent or -errno) of the short ones."""
        fds, bodies = self._fds, self._bodies
        self._fds, self._bodies = [], []
        return send_chunks(fds, bodies) if fds else []


def default_sender():
    """The native module's pipelined sender (post/collect, a helper thread) where it is built;
    else Inline."""
    return NATIVE if NATIVE is not None else Inline()


class Direct:
    """A streamed response's connection, written directly while uvicorn would write at once."""

    __slots__ = ("cycle", "flow", "transport", "fd")

    def __init__(self, cycle, transport, fd: int) -> None:
        self.cycle, self.flow, self.transport, self.fd = cycle, cycle.flow, transport, fd

    @classmethod
    def of(cls, send) -> Direct | None:
        """For the server's send callable after http.response.start went through it: a Direct
        when it is uvicorn's (httptools) response cycle on plain TCP with a chunked body."""
        cycle = getattr(send, "__self__", None)
        transport = getattr(cycle, "transport", None)
        if (transport is None or getattr(cycle, "chunked_encoding", None) is not True
                or getattr(cycle, "flow", None) is None or cycle.scope.get("method") == "HEAD"
                or type(transport).__name__ not in _TCP_TRANSPORTS
                or transport.get_extra_info("sslcontext") is not None):
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        return cls(cycle, transport, sock.fileno())

    def ready(self) -> bool:
        """Nothing is queued before a write now, and uvicorn's send would write it at once."""
        c, t = self.cycle, self.transport
        return not (c.disconnected or c.response_complete or self.flow.write_paused or t.is_closing()
                    or t.get_write_buffer_size())


class Batch:
    """The bodies of one dispatcher round, one per connection: posted to `sender` a PIECE at a
    time as they are added, all sent once send() returns."""

    def __init__(self, sender=None) -> None:
        self.sender = sender if sender is not None else default_sender()
        self.fds: list[int] = []
        self.bodies: list[bytes] = []
        self.targets: list[Direct] = []
        self._posted = 0  # of the bodies, handed to the sender
        self._piece = PIECE  # bodies a post; sys.maxsize: none before send()

    def begin(self, streams: int) -> None:
        """A round that may add up to `streams` bodies starts: pieces go to the sender as they
        are added only in a round of at least PIPELINE_STREAMS."""
        self._piece = PIECE if streams >= PIPELINE_STREAMS else sys.maxsize

    def add(self, target: Direct, body: bytes) -> None:
        """Precondition: target.ready() in this round (a closing connection's fd may soon be
        another's; nothing in a round closes one, so the check before add() holds until send())."""
        self.fds.append(target.fd)
        self.bodies.append(body)
        self.targets.append(target)
        if len(self.fds) - self._posted >= self._piece:
            k, self._posted = self._posted, len(self.fds)
            self.sender.post(self.fds[k:], self.bodies[k:])

    def send(self) -> None:
        """Send what is not posted yet and wait for every body of the round; hand each short one's
        rest to its transport."""
        if not self.fds:
            return
        fds, bodies, targets, posted = self.fds, self.bodies, self.targets, self._posted
        self.fds, self.bodies, self.targets, self._posted = [], [], [], 0
        try:
            if posted < len(fds):  # no wake-up: this thread sends them in collect() unless a busy helper does
                self.sender.post(fds[posted:], bodies[posted:], False)
        finally:
            short = self.sender.collect()  # what was posted must be sent before the loop goes on
        for i, sent in short:
            body = bodies[i]
            frame = b"%x\r\n" % len(body) + body + b"\r\n"
            # The rest (or, after a failure, the whole frame: the transport's own send then
            # fails and closes the connection, as uvicorn's write would have).
            targets[i].transport.write(frame[max(sent, 0):])


BATCH = Batch()
