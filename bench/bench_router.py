"""Router overhead: streamed tokens/s and added per-token latency, with stand-in ranks.

    .venv/bin/python bench/bench_router.py [--streams 1 64 256] [--tokens 20000] [--step-ms 25]

The router runs for real (pd_server.launch) with decode/fake_rank.py behind it: no model,
tokens as fast as the fake can make them. Each fake token's text is its send time, so the
client measures what the router adds to each token (rank socket -> decode -> SSE -> HTTP).
  * throughput: fake steps back to back (the router is the bottleneck); tokens/s the
    clients receive over all streams;
  * latency: fake paced at --step-ms per step (every stream gets one token a step), added
    latency per token p50/p99.
Same-run reference: the fake rank read directly over ZeroMQ by this script (no router, no
HTTP), the ceiling the rank side sets. Clients are raw asyncio sockets that only scan bytes,
so the client costs little; on a 2-core machine the router still shares the CPU with them.
Not a test: prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TS = re.compile(rb'"text":"(\d+\.\d+) "')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(port: int, step_ms: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pd_server.launch", "--fake-ranks", "--colocated", "1", "--port", str(port),
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


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def one_stream(port: int, max_tokens: int, lat: list[float], steady: float) -> int:
    """Stream one completion; append each token's latency (receive - rank send) once the run
    is in steady state (wall clock past `steady`: every stream has started)."""
    body = json.dumps({"prompt": "hi", "max_tokens": max_tokens, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    buf, n = b"", 0
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        now = time.time()
        buf += data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            continue
        for m in _TS.finditer(buf, 0, cut):
            if now > steady:
                lat.append(now - float(m.group(1)))
            n += 1
        buf = buf[cut:]
    writer.close()
    return n


async def run_streams(port: int, streams: int, max_tokens: int, warmup_s: float = 0.0):
    """(tokens received, seconds, steady-state latencies)."""
    lat: list[float] = []
    t0 = time.perf_counter()
    steady = time.time() + warmup_s
    counts = await asyncio.gather(*(one_stream(port, max_tokens, lat, steady) for _ in range(streams)))
    return sum(counts), time.perf_counter() - t0, lat


def direct_reference(streams: int, max_tokens: int, step_ms: float = 0.0, warmup_s: float = 0.0):
    """(tokens/s, steady-state per-token latencies) of the fake rank read by a bare ZeroMQ
    reader: this process plays the router, with no HTTP."""
    import zmq

    from pd_server.protocol.codec import Codec
    from pd_server.protocol.rank_router import Hello, TokenBatch
    from pd_server.protocol.router_rank import Generate, Sampling, Shutdown, Welcome

    ctx, codec = zmq.Context(), Codec()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = subprocess.Popen([sys.executable, "-m", "decode.fake_rank", "--router-addr", addr,
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
        while left:
            msg = codec.decode_from_rank(sock.recv_multipart()[1])
            if isinstance(msg, TokenBatch):
                now = time.time()
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
    args = ap.parse_args()

    def per_stream(streams: int) -> int:
        return max(1, min(8000, args.tokens // streams))  # within the fake rank's 8192 context

    paced_tokens = max(2, int((args.latency_s + 1) * 1000 / args.step_ms))
    rows = []
    for s in args.streams:
        tok_s, _ = direct_reference(s, per_stream(s))
        _, lat = direct_reference(s, paced_tokens, args.step_ms, warmup_s=1.0)
        rows.append({"streams": s, "direct": tok_s, "direct_p50": pct(lat, 0.5) * 1e3,
                     "direct_p99": pct(lat, 0.99) * 1e3})
    port = free_port()
    proc = start_router(port, 0.0)
    try:
        for row in rows:
            asyncio.run(run_streams(port, row["streams"], 10))  # warm the connection path
            n, dt, _ = asyncio.run(run_streams(port, row["streams"], per_stream(row["streams"])))
            row["tok_s"] = n / dt
    finally:
        stop(proc)
    port = free_port()
    proc = start_router(port, args.step_ms)
    try:
        for row in rows:
            n, dt, lat = asyncio.run(run_streams(port, row["streams"], paced_tokens, warmup_s=1.0))
            row["paced_tok_s"] = n / dt
            row["p50_ms"], row["p99_ms"] = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
    finally:
        stop(proc)

    print(f"\nrouter overhead (fake ranks; {os.cpu_count()} cores shared by router, fake rank and clients)")
    print(f"{'':>8} {'max tok/s':^27} | {'paced: one token per stream every %g ms' % args.step_ms:^52}")
    print(f"{'streams':>8} {'direct':>13} {'router':>13} | {'tok/s':>8} {'direct p50':>10} {'p99':>7} "
          f"{'router p50':>11} {'p99':>7} {'(ms)':>5}")
    for r in rows:
        print(f"{r['streams']:>8} {r['direct']:>13,.0f} {r['tok_s']:>13,.0f} | {r['paced_tok_s']:>8,.0f} "
              f"{r['direct_p50']:>10.2f} {r['direct_p99']:>7.2f} {r['p50_ms']:>11.2f} {r['p99_ms']:>7.2f}")
    print("direct (same-run reference): the fake rank read over ZeroMQ by this script, no router, no HTTP.\n"
          "router: through pd_server (rank socket -> SSE -> HTTP); its latency minus direct's is what the router "
          "adds.\ngoal: >= 10,000 tok/s at 256 streams; < 2 ms p99 added per token")


if __name__ == "__main__":
    main()
