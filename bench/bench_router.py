"""Router overhead: streamed tokens/s and added per-token latency, with stand-in ranks.

    .venv/bin/python bench/bench_router.py [--streams 1 64 256] [--tokens 20000] [--step-ms 25]

The router runs for real (launcher.launch) with rank_runtime/fake_rank.py behind it: no model,
tokens as fast as the fake can make them. Each fake token's text is its send time, so the
client measures what the router adds to each token (rank socket -> decode -> SSE -> HTTP).
  * throughput: fake steps back to back (the router is the bottleneck); tokens/s the
    clients receive over all streams;
  * latency: fake paced at --step-ms per step (every stream gets one token a step), added
    latency per token p50/p99.
Same-run reference: the fake rank read directly over ZeroMQ by this script (no router, no
HTTP), the ceiling the rank side sets. "added" = router minus direct at the same percentile
(p50, p99): the fake rank's own pacing and batching jitter is in both and cancels out.
"cpu us/tok" (paced runs): the router process's CPU seconds per token streamed, from /proc
(request handling and the router's idle work included, which dominates at 1 stream); unlike
the latencies it hardly moves when other processes load the machine.
The HTTP client (--client): `c` (default) is bench/stream_client.cpp (built once with c++ into
the pdserve cache): one epoll loop, a recv() per readable socket and a scan for the stamps, so
reading 256 sockets a step costs it little; `c-spin` is the same client polling epoll without
sleeping, so the router's writes never pay for waking it (on loopback a send() runs the
receiver's TCP stack and its wake-up in the sender's syscall, which a remote client would not
cost the router); it takes a core of its own. `epoll` is the Python selector client (~10 us a
socket of its own: at 256 streams the client, not the router, ended the latency it measured),
`asyncio` the first one (a task and StreamReader per stream). On a 2-core machine the router
still shares the CPU with the client and the fake rank. Not a test: prints a table.
"""
from __future__ import annotations

import argparse
import array
import asyncio
import functools
import hashlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TS = re.compile(rb'"text":"(\d+\.\d+) "')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(port: int, step_ms: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.launch", "--fake-ranks", "--colocated", "1", "--port", str(port),
           "--fake-step-ms", str(step_ms), "--max-inflight-per-rank", "4096"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("router exited during start-up")
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError("router not healthy within 120 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its threads, not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _request(max_tokens: int) -> bytes:
    body = json.dumps({"prompt": "hi", "max_tokens": max_tokens, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))


def _scan(buf: bytes, now: float, steady: float, lat: list[float]) -> tuple[bytes, int]:
    """Count the complete events' tokens in buf (latencies once past `steady`); the rest of buf."""
    cut = buf.rfind(b"\n\n")
    if cut < 0:
        return buf, 0
    n = 0
    for m in _TS.finditer(buf, 0, cut):
        if now > steady:
            lat.append(now - float(m.group(1)))
        n += 1
    return buf[cut:], n


async def one_stream(port: int, max_tokens: int, lat: list[float], steady: float) -> int:
    """Stream one completion; append each token's latency (receive - rank send) once the run
    is in steady state (wall clock past `steady`: every stream has started)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(max_tokens))
    await writer.drain()
    buf, n = b"", 0
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        buf, k = _scan(buf + data, time.time(), steady, lat)
        n += k
    writer.close()
    return n


def run_streams_asyncio(port: int, streams: int, max_tokens: int, warmup_s: float = 0.0):
    """The first client: one asyncio task per stream (StreamReader). (tokens, seconds, latencies)"""
    async def run():
        lat: list[float] = []
        t0 = time.perf_counter()
        steady = time.time() + warmup_s
        counts = await asyncio.gather(*(one_stream(port, max_tokens, lat, steady) for _ in range(streams)))
        return sum(counts), time.perf_counter() - t0, lat

    return asyncio.run(run())


def _drain(sel: selectors.BaseSelector, steady: float, lat: list[float], silent: str) -> int:
    """Read every registered socket (key.data = [unparsed bytes]) until all close; token count."""
    n = 0
    try:
        while sel.get_map():
            ready = sel.select(timeout=60)
            if not ready:
                raise RuntimeError(f"{silent} for 60 s")
            for key, _ in ready:
                data = key.fileobj.recv(1 << 16)
                now = time.time()
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    continue
                key.data[0], k = _scan(key.data[0] + data, now, steady, lat)
                n += k
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return n


def run_streams(port: int, streams: int, max_tokens: int, warmup_s: float = 0.0):
    """(tokens received, seconds, steady-state latencies): every stream on one epoll loop, no
    coroutines (a readable socket costs one recv and a regex scan)."""
    lat: list[float] = []
    t0 = time.perf_counter()
    steady = time.time() + warmup_s
    sel, req = selectors.DefaultSelector(), _request(max_tokens)
    for _ in range(streams):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(req)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, [b""])
    n = _drain(sel, steady, lat, "no data from the router")
    return n, time.perf_counter() - t0, lat


def direct_reference(streams: int, max_tokens: int, step_ms: float = 0.0, warmup_s: float = 0.0):
    """(tokens/s, steady-state per-token latencies) of the fake rank read by a bare ZeroMQ
    reader: this process plays the router, with no HTTP."""
    import zmq

    from cluster.protocol.codec import Codec
    from cluster.protocol.rank_router import Hello, TokenBatch
    from cluster.protocol.router_rank import Generate, Ping, Sampling, Shutdown, Welcome

    ctx, codec = zmq.Context(), Codec()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = subprocess.Popen([sys.executable, "-m", "rank_runtime.fake_rank", "--router-addr", addr,
                             "--step-ms", str(step_ms)], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        ident = None
        while ident is None:
            i, frame = sock.recv_multipart()
            if isinstance(codec.decode_from_rank(frame), Hello):
                ident = i
        sock.send_multipart([ident, codec.encode(Welcome(1, "colocated-0", 0.5))])
        t0 = time.perf_counter()
        for k in range(streams):
            sock.send_multipart([ident, codec.encode(Generate(f"r{k}", [1], Sampling(max_tokens), time.time()))])
        left, n, lat, steady = streams, 0, [], time.time() + warmup_s
        pinged = time.time()
        while left:
            msg = codec.decode_from_rank(sock.recv_multipart()[1])
            if isinstance(msg, TokenBatch):
                now = time.time()
                if now - pinged > 1.0:  # as the router does: a rank quits after 5 s without word
                    sock.send_multipart([ident, codec.encode(Ping(now))])
                    pinged = now
                n += len(msg.events)
                left -= sum(ev.finish_reason is not None for ev in msg.events)
                if now > steady:
                    lat += [now - float(ev.text) for ev in msg.events]
        dt = time.perf_counter() - t0
        sock.send_multipart([ident, codec.encode(Shutdown("done"))])
        return n / dt, lat
    finally:
        proc.wait(timeout=10)
        sock.close(linger=0)
        ctx.term()


_FLOOR_WRITER = r"""
import socket, sys, time
streams, steps, step_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(streams)
print(srv.getsockname()[1], flush=True)
socks = [srv.accept()[0] for _ in range(streams)]
for s in socks:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.recv(65536)  # the client's request, read so that close() sends FIN, not a reset
pad = b"x" * 96  # about one streamed token's SSE chunk, chunked framing included
t_next = time.time()
for _ in range(steps):
    ts = b"%.6f" % time.time()
    body = b'data: {"text":"' + ts + b' ","pad":"' + pad + b'"}\n\n'
    chunk = b"%x\r\n" % len(body) + body + b"\r\n"
    for s in socks:
        s.send(chunk)
    t_next += step_s
    time.sleep(max(0.0, t_next - time.time()))
for s in socks:
    s.close()
"""


def floor_reference(streams_fn, streams: int, steps: int, step_ms: float, warmup_s: float) -> list[float]:
    """Steady-state per-token latencies of the cheapest fan-out Python can do: a process that,
    every step, writes one token-sized chunk (stamped once per step) to each of `streams`
    loopback TCP sockets with plain send() calls, read by the same client as the router (its
    request is sent and ignored). No HTTP, no JSON, no rank: the floor that one thread's
    per-socket syscalls set on this machine."""
    proc = subprocess.Popen([sys.executable, "-c", _FLOOR_WRITER, str(streams), str(steps), str(step_ms / 1000)],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        return streams_fn(port, streams, steps, warmup_s)[2]
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()


def client_binary() -> Path:
    """bench/stream_client.cpp built (once per source version) into the pdserve cache."""
    from engine.model_cache import cache_root

    src = ROOT / "bench" / "stream_client.cpp"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    exe = cache_root() / "bench" / f"stream_client-{digest}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(f".{os.getpid()}")
        cxx = os.environ.get("CXX") or "c++"
        subprocess.run([cxx, "-O2", "-o", str(tmp), str(src)], check=True)
        tmp.replace(exe)
    return exe


def run_streams_c(port: int, streams: int, max_tokens: int, warmup_s: float = 0.0, spin: bool = False):
    """(tokens received, seconds, steady-state latencies) from the C epoll client (`spin`: it polls)."""
    env = {**os.environ, "STREAM_CLIENT_SPIN": "1"} if spin else None
    with tempfile.NamedTemporaryFile(suffix=".lat") as lat_file:
        out = subprocess.run([str(client_binary()), str(port), str(streams), f"{time.time() + warmup_s:.6f}",
                              lat_file.name], input=_request(max_tokens), capture_output=True, check=True, env=env)
        tokens, seconds = out.stdout.split()
        lat = array.array("d", Path(lat_file.name).read_bytes()).tolist()
    return int(tokens), float(seconds), lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--tokens", type=int, default=20000, help="tokens per throughput run, over all streams")
    ap.add_argument("--step-ms", type=float, default=25.0, help="fake rank step period for the latency runs")
    ap.add_argument("--latency-s", type=float, default=4.0, help="steady-state seconds per latency run "
                    "(after 1 s in which every stream starts)")
    ap.add_argument("--client", choices=("c", "c-spin", "epoll", "asyncio"), default="c",
                    help="HTTP client: bench/stream_client.cpp (default), the same polling without sleep, "
                    "one Python epoll loop, or the first one, an asyncio task per stream")
    args = ap.parse_args()
    streams_fn = {"c": run_streams_c, "c-spin": functools.partial(run_streams_c, spin=True), "epoll": run_streams,
                  "asyncio": run_streams_asyncio}[args.client]

    def per_stream(streams: int) -> int:
        return max(1, min(8000, args.tokens // streams))  # within the fake rank's 8192 context

    paced_tokens = max(2, int((args.latency_s + 1) * 1000 / args.step_ms))
    rows = []
    for s in args.streams:
        tok_s, _ = direct_reference(s, per_stream(s))
        _, lat = direct_reference(s, paced_tokens, args.step_ms, warmup_s=1.0)
        floor = floor_reference(streams_fn, s, paced_tokens, args.step_ms, warmup_s=1.0)
        rows.append({"streams": s, "direct": tok_s, "direct_p50": pct(lat, 0.5) * 1e3,
                     "direct_p99": pct(lat, 0.99) * 1e3, "floor_p50": pct(floor, 0.5) * 1e3,
                     "floor_p99": pct(floor, 0.99) * 1e3})
    port = free_port()
    proc = start_router(port, 0.0)
    try:
        for row in rows:
            streams_fn(port, row["streams"], 10)  # warm the connection path
            n, dt, _ = streams_fn(port, row["streams"], per_stream(row["streams"]))
            row["tok_s"] = n / dt
    finally:
        stop(proc)
    port = free_port()
    proc = start_router(port, args.step_ms)
    try:
        for row in rows:
            cpu = cpu_seconds(proc.pid)
            n, dt, lat = streams_fn(port, row["streams"], paced_tokens, warmup_s=1.0)
            row["cpu_us"] = (cpu_seconds(proc.pid) - cpu) / max(1, n) * 1e6
            row["paced_tok_s"] = n / dt
            row["p50_ms"], row["p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
    finally:
        stop(proc)

    print(f"\nrouter overhead (fake ranks; {os.cpu_count()} cores shared by router, fake rank and clients; "
          f"{args.client} client)")
    print(f"{'':>8} {'max tok/s':^27} | {'paced: one token per stream every %g ms (latency in ms)' % args.step_ms:^98}")
    print(f"{'streams':>8} {'direct':>13} {'router':>13} | {'tok/s':>8} {'direct p50':>10} {'p99':>7} "
          f"{'router p50':>11} {'p99':>7} {'added p50':>10} {'p99':>7} {'floor p50':>10} {'p99':>7} {'cpu us/tok':>10}")
    for r in rows:
        print(f"{r['streams']:>8} {r['direct']:>13,.0f} {r['tok_s']:>13,.0f} | {r['paced_tok_s']:>8,.0f} "
              f"{r['direct_p50']:>10.2f} {r['direct_p99']:>7.2f} {r['p50_ms']:>11.2f} {r['p99_ms']:>7.2f} "
              f"{r['p50_ms'] - r['direct_p50']:>10.2f} {r['p99_ms'] - r['direct_p99']:>7.2f} "
              f"{r['floor_p50']:>10.2f} {r['floor_p99']:>7.2f} {r['cpu_us']:>10.1f}")
    print("direct (same-run reference): the fake rank read over ZeroMQ by this script, no router, no HTTP.\n"
          "router: through pd_server (rank socket -> SSE -> HTTP -> client).\n"
          "added: router minus direct at the same percentile (what the router and the HTTP client add).\n"
          "floor: one process send()s a token-sized chunk to every stream's loopback socket each step (no HTTP,\n"
          "  no JSON, no rank), same client: the latency one thread's per-socket syscalls alone set here.\n"
          "cpu us/tok: the router process's CPU time per streamed token, request handling and idle work "
          "(heartbeats,\n  stats: most of it at 1 stream) included; x streams ~ the time one step's fan-out "
          "takes on an idle core.\n"
          "goal: >= 10,000 tok/s at 256 streams; < 2 ms p99 added per token")


if __name__ == "__main__":
    main()
