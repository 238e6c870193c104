"""The batched SSE fan-out (pd_server/fanout.py, csrc/fanout/sse_fanout.c): the frames on the wire, short
writes and failures handed back, and a real uvicorn server streaming through it in order."""
from __future__ import annotations

import asyncio
import errno
import json
import socket

import pytest
import uvicorn
from test_router_stream import MODEL, TRICKY, Recorder, ev

from pd_server import fanout, sse
from pd_server.app import build_app
from pd_server.config import RouterConfig
from pd_server.http_protocol import header_timeout_protocol
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.serving import ServerContext
from test_router_prompts import CHATML, StubTokenizer
from tests.fakes import InlineExecutor

fanout.load()  # (the router does it as it starts)
SENDERS = [pytest.param(fanout._send_chunks_py, id="python")]
if fanout.send_chunks is not fanout._send_chunks_py:
    SENDERS.insert(0, pytest.param(fanout.send_chunks, id="native"))


def test_the_native_module_is_built():
    assert fanout.send_chunks is not fanout._send_chunks_py  # a compiler is part of this project's set-up


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += s.recv(n - len(out))
    return out


@pytest.mark.parametrize("send_chunks", SENDERS)
def test_each_socket_gets_its_chunk_framed_as_uvicorn_does(send_chunks):
    pairs = [socket.socketpair() for _ in range(5)]
    bodies = [b"", b"x", b"data: {}\n\n", "ü🙂".encode() * 40, bytes(range(256)) * 20]
    try:
        for a, _ in pairs:
            a.setblocking(False)
        assert send_chunks([a.fileno() for a, _ in pairs], bodies) == []
        for (_, b), body in zip(pairs, bodies):
            want = b"%x\r\n" % len(body) + body + b"\r\n"
            assert recv_exactly(b, len(want)) == want
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.parametrize("send_chunks", SENDERS)
def test_short_writes_and_failures_are_handed_back_and_the_others_still_sent(send_chunks):
    full_a, full_b = socket.socketpair()
    ok_a, ok_b = socket.socketpair()
    dead_a, dead_b = socket.socketpair()
    socks = (full_a, full_b, ok_a, ok_b, dead_a, dead_b)
    try:
        for s in (full_a, ok_a, dead_a):
            s.setblocking(False)
        full_a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        while True:  # fill it: its reader reads nothing
            try:
                full_a.send(b"f" * 4096)
            except BlockingIOError:
                break
        dead_b.close()
        big = b"y" * (1 << 20)
        short = dict(send_chunks([full_a.fileno(), ok_a.fileno(), dead_a.fileno()], [big, b"ok", b"z"]))
        assert set(short) == {0, 2}
        assert short[0] == -errno.EAGAIN or 0 < short[0] < len(big)
        assert short[2] in (-errno.EPIPE, -errno.ECONNRESET)
        assert recv_exactly(ok_b, 7) == b"2\r\nok\r\n"
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(fanout.NATIVE is None, reason="the native module is not built")
def test_posted_pieces_are_sent_once_each_and_collect_reports_short_ones_by_posting_order():
    pairs = [socket.socketpair() for _ in range(40)]
    full_a, full_b = socket.socketpair()
    try:
        for a, _ in pairs:
            a.setblocking(False)
        full_a.setblocking(False)
        full_a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        while True:
            try:
                full_a.send(b"f" * 4096)
            except BlockingIOError:
                break
        for rnd in range(3):  # rounds reuse the queue
            bodies = [b"r%d-%d " % (rnd, i) * (i + 1) for i in range(len(pairs))]
            fds = [a.fileno() for a, _ in pairs]
            fanout.NATIVE.post(fds[:7], bodies[:7])
            fanout.NATIVE.post([full_a.fileno()], [b"never fits" * 10000])  # index 7
            fanout.NATIVE.post(fds[7:], bodies[7:], rnd != 2)  # the last round: no wake-up, collect sends
            short = fanout.NATIVE.collect()
            assert [i for i, _ in short] == [7] and (short[0][1] == -errno.EAGAIN or short[0][1] > 0)
            assert fanout.NATIVE.collect() == []  # nothing left over
            for (_, b), body in zip(pairs, bodies):
                want = b"%x\r\n" % len(body) + body + b"\r\n"
                assert recv_exactly(b, len(want)) == want
            for _, b in pairs:  # nothing was sent twice
                b.setblocking(False)
                with pytest.raises(BlockingIOError):
                    b.recv(1)
                b.setblocking(True)
            while True:  # empty the full socket again for the next round
                try:
                    full_b.setblocking(False)
                    full_b.recv(1 << 20)
                except BlockingIOError:
                    break
            while True:
                try:
                    full_a.send(b"f" * 4096)
                except BlockingIOError:
                    break
    finally:
        for a, b in pairs + [(full_a, full_b)]:
            a.close()
            b.close()


@pytest.mark.skipif(fanout.NATIVE is None, reason="the native module is not built")
def test_post_checks_its_arguments_before_queueing_anything():
    a, b = socket.socketpair()
    try:
        with pytest.raises(TypeError):
            fanout.NATIVE.post([a.fileno(), a.fileno()], [b"ok", "not bytes"])
        with pytest.raises(ValueError):
            fanout.NATIVE.post([a.fileno()], [])
        assert fanout.NATIVE.collect() == []
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
    finally:
        a.close()
        b.close()


def test_batch_posts_a_piece_at_a_time_and_collects_at_the_round_end(monkeypatch):
    monkeypatch.setattr(fanout, "PIECE", 3)
    log = []

    class Sender:
        def post(self, fds, bodies, wake=True):
            log.append(("post", list(fds), wake))

        def collect(self):
            log.append(("collect",))
            return [(4, -errno.EPIPE)]  # the fifth body posted failed

    batch = fanout.Batch(Sender())
    targets = [StubTarget(20 + i) for i in range(7)]
    batch.begin(fanout.PIPELINE_STREAMS)
    for i, t in enumerate(targets):
        batch.add(t, b"b%d" % i)
    assert log == [("post", [20, 21, 22], True), ("post", [23, 24, 25], True)]
    batch.send()
    assert log[2:] == [("post", [26], False), ("collect",)]  # the rest: sent by collect's caller
    assert targets[4].transport.written == [b"2\r\nb4\r\n"]  # handed to its transport, whole
    assert all(t.transport.written == [] for i, t in enumerate(targets) if i != 4)
    assert batch.fds == [] and batch._posted == 0
    del log[:]
    batch.begin(fanout.PIPELINE_STREAMS - 1)  # a small round: everything at its end, no wake-up
    for t in targets:
        batch.add(t, b"x")
    batch.send()
    assert log == [("post", [t.fd for t in targets], False), ("collect",)]


class StubTransport:
    def __init__(self, closing: bool = False) -> None:
        self.written: list[bytes] = []
        self.closing = closing

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


class StubTarget:
    def __init__(self, fd: int) -> None:
        self.fd, self.transport = fd, StubTransport()


def test_batch_hands_rests_to_each_transport(monkeypatch):
    calls = []

    def fake_send(fds, bodies):
        calls.append((list(fds), list(bodies)))
        return [(0, 3), (1, -errno.EAGAIN)]  # the first took 3 bytes, the second none

    monkeypatch.setattr(fanout, "send_chunks", fake_send)
    a, b = StubTarget(10), StubTarget(11)
    batch = fanout.Batch(fanout.Inline())
    batch.add(a, b"one+more")
    batch.add(b, b"two")
    batch.send()
    batch.send()  # nothing left: no call
    assert calls == [([10, 11], [b"one+more", b"two"])]
    assert a.transport.written == [(b"8\r\none+more\r\n")[3:]] and b.transport.written == [b"3\r\ntwo\r\n"]


class StubCycle:
    def __init__(self) -> None:
        self.disconnected = self.response_complete = False
        self.flow = type("Flow", (), {"write_paused": False})()


class BufferedTransport(StubTransport):
    def __init__(self) -> None:
        super().__init__()
        self.buffered = 0

    def get_write_buffer_size(self) -> int:
        return self.buffered


def test_a_closing_or_busy_connection_is_not_ready_so_gets_no_body_in_the_batch():
    """Direct.ready is the gate before Batch.add: a closing connection (its fd may soon be
    another's), buffered bytes, a paused or finished response never take the direct path."""
    cycle, transport = StubCycle(), BufferedTransport()
    d = fanout.Direct(cycle, transport, 9)
    assert d.ready()
    for obj, attr, spoiled in ((transport, "closing", True), (transport, "buffered", 5),
                               (cycle.flow, "write_paused", True), (cycle, "disconnected", True),
                               (cycle, "response_complete", True)):
        good = getattr(obj, attr)
        setattr(obj, attr, spoiled)
        assert not d.ready(), attr
        setattr(obj, attr, good)
        assert d.ready()


def test_the_round_sends_the_batch_even_when_a_flush_fails(monkeypatch):
    calls = []
    monkeypatch.setattr(fanout, "send_chunks", lambda fds, bodies: calls.append(bodies) or [])
    monkeypatch.setattr(fanout.BATCH, "sender", fanout.Inline())

    class Taken:
        def flush(self):
            fanout.BATCH.add(StubTarget(3), b"x")

    class Broken:
        def flush(self):
            raise RuntimeError("boom")

    disp = Recorder(RouterConfig())
    try:
        disp._held = [Taken(), Broken()]
        with pytest.raises(RuntimeError):
            disp._flush_held()
    finally:
        disp._sock.close(linger=0)
        disp._ctx.term()
    assert calls == [[b"x"]] and fanout.BATCH.fds == []


async def _read_until(reader: asyncio.StreamReader, buf: bytearray, done) -> None:
    while not done(buf):
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        assert chunk, "connection closed early"
        buf += chunk


def _dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    out = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]


class CountingSender:
    """A sender that records how many bodies each post() gave it."""

    def __init__(self, inner) -> None:
        self.inner, self.posts = inner, []

    def post(self, fds, bodies, wake=True):
        self.posts.append(len(fds))
        self.inner.post(fds, bodies, wake)

    def collect(self):
        return self.inner.collect()


PATHS = ["inline", "uvicorn-send"] + (["threaded"] if fanout.NATIVE is not None else [])


@pytest.mark.parametrize("path", PATHS)
def test_streams_through_real_uvicorn_byte_for_byte(monkeypatch, path):
    """Two streams on one uvicorn server: the bodies each client reads are the same with the
    batched writes (at the round's end, or pipelined through the helper thread) as with
    uvicorn's own send, and the batched path is the one taken."""
    native = path != "uvicorn-send"
    if not native:  # every token through uvicorn's own send, as on a connection Direct does not take
        monkeypatch.setattr(fanout.Direct, "of", classmethod(lambda cls, send: None))
    monkeypatch.setattr(fanout, "PIECE", 1)  # the helper gets the first body before the second is rendered
    monkeypatch.setattr(fanout, "PIPELINE_STREAMS", 1)
    counting = CountingSender(fanout.NATIVE if path == "threaded" else fanout.Inline())
    monkeypatch.setattr(fanout.BATCH, "sender", counting)
    cfg = RouterConfig()
    disp = Recorder(cfg)
    tok = StubTokenizer(CHATML)
    ctx = ServerContext(cfg, MODEL, frozenset({MODEL}), tok, ChatRenderer(tok), disp.registry, disp, RouterMetrics(),
                        work=InlineExecutor())

    async def run():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(build_app(ctx), host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, lifespan="off",
                                               http=header_timeout_protocol(cfg.header_timeout_s)))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        clients = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            clients.append((reader, writer, bytearray()))
        while len(disp.generates()) < 2:
            await asyncio.sleep(0.01)
        ids = [g.request_id for g in disp.generates()]
        for reader, _, buf in clients:  # the headers: both streams started
            await _read_until(reader, buf, lambda b: b"\r\n\r\n" in b)
        for i, t in enumerate(TRICKY):
            fin = "length" if i == len(TRICKY) - 1 else None
            disp._on_tokens([ev(ids[0], i + 1, t, fin), ev(ids[1], i + 1, t[::-1], fin)])
            for reader, _, buf in clients:  # each token reaches its client before the next is made
                await _read_until(reader, buf, (lambda b: b.endswith(b"0\r\n\r\n")) if fin else
                                  (lambda b, n=i + 1: b.count(b"\n\n") >= n))
        for _, writer, _ in clients:
            writer.close()
        server.should_exit = True
        await serving
        return [_dechunk(bytes(buf)) for _, _, buf in clients]

    try:
        bodies = asyncio.run(run())
    finally:
        disp._sock.close(linger=0)
        disp._ctx.term()
    for body, texts in zip(bodies, ([t for t in TRICKY], [t[::-1] for t in TRICKY])):
        events = [json.loads(e) for e in sse.iter_events([body]) if e != b"[DONE]"]
        assert [e["choices"][0]["text"] for e in events if e["choices"][0]["finish_reason"] is None] == texts
        assert events[-1]["choices"][0]["finish_reason"] == "length" and body.endswith(sse.DONE)
    if native:
        assert counting.posts and set(counting.posts) == {1}  # each body posted as it was rendered
    else:
        assert counting.posts == []
