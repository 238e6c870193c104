"""One native call per dispatcher round writes every stream's tokens (csrc/sse_fanout.c).

A plain streamed token used to cost, per stream, uvicorn's send coroutine, the asyncio
transport's write and a socket.send call, on the router's one thread, 256 times a step at 256
streams before the last stream's token left (router CPU 23.3 us a token there; 19.6 us with
this, and 0.79x the p99 added latency: docs/results/bench-router.md). Here a stream
that takes the eager path (sse_response.SSEStream._eager) only adds (fd, body) to the round's
`Batch`; the dispatcher's end of round (`Dispatcher._flush_held`, the only caller of the eager
writers) sends them all with one call of `send_chunks`, each as the HTTP/1.1 chunk uvicorn would
have written. So a body never waits in the batch while anything else could write to its
connection, and each connection has at most one body there (its inbox is flushed once a round).

Only where that is exactly what uvicorn would do (`Direct.of`): a plain-TCP asyncio transport
of uvicorn's httptools protocol whose response is chunked, and, each round (`Direct.ready`),
nothing buffered in the transport, no flow-control pause, the response neither complete nor
disconnected. A socket that takes only part of its frame (or fails) gets the rest through the
transport's own write, which buffers it (the stream then goes back to uvicorn's send until the
buffer drains) or fails the connection as before.

The module is built once per source version with the C compiler into the pdserve cache
(`$PDSERVE_CACHE_DIR/ext`); without a compiler the same sends run from Python (os.writev).
`PDSERVE_NATIVE_FANOUT=0` turns the batching off (every token goes through uvicorn's send).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

log = logging.getLogger("pd_server.fanout")

_SRC = Path(__file__).resolve().parents[1] / "csrc" / "sse_fanout.c"
_MODULE = "pdserve_sse_fanout"
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


def _build() -> object | None:
    """The compiled module, built into the cache if needed; None where it cannot be had."""
    from engine.model_cache import cache_root

    digest = hashlib.sha256(_SRC.read_bytes() + sys.version.encode()).hexdigest()[:12]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = cache_root() / "ext" / f"{_MODULE}-{digest}{suffix}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        cmd = [*cc.split(), "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", str(tmp),
               str(_SRC)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            tmp.unlink(missing_ok=True)
            detail = getattr(e, "stderr", b"") or b""
            log.warning("native SSE fan-out not built (%s %s); using the Python one", e, detail.decode()[-300:])
            return None
        tmp.replace(path)
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load():
    try:
        module = _build()
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python sends, which are correct
        log.warning("native SSE fan-out unavailable (%s); using the Python one", e)
        module = None
    return module.send_chunks if module is not None else _send_chunks_py


ENABLED = os.environ.get("PDSERVE_NATIVE_FANOUT", "1") != "0"
send_chunks = _load() if ENABLED else _send_chunks_py


class Direct:
    """A streamed response's connection, written directly while uvicorn would write at once."""

    __slots__ = ("cycle", "flow", "transport", "fd")

    def __init__(self, cycle, transport, fd: int) -> None:
        self.cycle, self.flow, self.transport, self.fd = cycle, cycle.flow, transport, fd

    @classmethod
    def of(cls, send) -> Direct | None:
        """For the server's send callable after http.response.start went through it: a Direct
        when it is uvicorn's (httptools) response cycle on plain TCP with a chunked body."""
        if not ENABLED:
            return None
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
    """The bodies of one dispatcher round, one per connection, sent by one send_chunks call."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.bodies: list[bytes] = []
        self.targets: list[Direct] = []

    def add(self, target: Direct, body: bytes) -> None:
        self.fds.append(target.fd)
        self.bodies.append(body)
        self.targets.append(target)

    def send(self) -> None:
        if not self.fds:
            return
        fds, bodies, targets = self.fds, self.bodies, self.targets
        self.fds, self.bodies, self.targets = [], [], []
        if any(t.transport.is_closing() for t in targets):  # closed since (its fd may soon be another connection's): its body is dropped
            keep = [i for i, t in enumerate(targets) if not t.transport.is_closing()]
            fds, bodies, targets = [fds[i] for i in keep], [bodies[i] for i in keep], [targets[i] for i in keep]
        for i, sent in send_chunks(fds, bodies):
            body = bodies[i]
            frame = b"%x\r\n" % len(body) + body + b"\r\n"
            # The rest (or, after a failure, the whole frame: the transport's own send then
            # fails and closes the connection, as uvicorn's write would have).
            targets[i].transport.write(frame[max(sent, 0):])


BATCH = Batch()
