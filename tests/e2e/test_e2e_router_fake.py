"""The real router with 2 stand-in ranks (rank_runtime/fake_rank.py, no model, one token per 20 ms,
room for 2 requests each): handshake refusal, 429, abort on disconnect, a rank dying mid-stream.
"""
from __future__ import annotations

import os
import signal
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from cluster.auth import secure_client
from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.codec import Codec
from cluster.protocol.rank_router import Hello
from cluster.protocol.router_rank import Reject
from conftest import FAKE_SECRET

MODEL = "smollm2-135m-instruct"


def _hello_reply(addr: str, hello) -> object:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock, FAKE_SECRET)  # the rank socket runs CURVE (the fixture's secret)
    try:
        sock.connect(addr)
        sock.send(msgspec.msgpack.encode(hello))
        assert sock.poll(5000), "no answer from the router"
        return Codec().decode_from_router(sock.recv())
    finally:
        sock.close(linger=0)
        ctx.term()


def test_handshake_refuses_mismatched_version_and_model(fake_system):
    addr = fake_system.health()[1]["rank_addr"]

    class FutureHello(msgspec.Struct, array_like=True, tag="hello"):
        protocol_version: int
        something_new: str

    reply = _hello_reply(addr, FutureHello(PROTOCOL_VERSION + 1, "x"))
    assert isinstance(reply, Reject) and "protocol version mismatch" in reply.reason
    assert f"rank speaks {PROTOCOL_VERSION + 1}" in reply.reason
    reply = _hello_reply(addr, Hello(PROTOCOL_VERSION, "colocated", 7, os.getpid(), "other-model", 100, 10, 16, 1))
    assert isinstance(reply, Reject) and "other-model" in reply.reason
    assert set(fake_system.ranks()) == {"colocated-0", "colocated-1"}  # nothing joined


def _stream(system, max_tokens: int = 5000):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    return httpx.stream("POST", system.url + "/v1/completions", json=body, timeout=30)


def _quiet(system) -> bool:
    return all(r["inflight"] == 0 and r["pages_used"] == 0 for r in system.ranks().values()
               if r["state"] == "ready")


def test_queue_full_is_429_and_disconnects_free_the_rank(fake_system):
    streams = [_stream(fake_system) for _ in range(4)]  # 2 ranks x 2 slots
    readers = []  # NOTE: keep each line iterator alive: a collected one closes its connection
    try:
        for s in streams:
            r = s.__enter__()
            assert r.status_code == 200
            readers.append(r.iter_lines())
            next(readers[-1])
        assert sorted(r["inflight"] for r in fake_system.ranks().values()) == [2, 2]
        with openai.OpenAI(base_url=fake_system.url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
        assert e.value.response.json()["error"]["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    fake_system.wait_until(lambda: _quiet(fake_system), 10, "aborts to free the fake ranks")


def test_rank_death_moves_its_stream_and_routing_skips_it(fake_system):
    with _stream(fake_system, max_tokens=150) as r:
        rank = r.headers["x-pdserve-rank"]
        lines = r.iter_lines()
        next(lines)
        os.kill(fake_system.ranks()[rank]["pid"], signal.SIGKILL)
        rest = "\n".join(lines)  # the other rank goes on from the tokens streamed (migration.py)
    assert '"error"' not in rest and '"finish_reason":"length"' in rest and rest.rstrip().endswith("data: [DONE]")
    status, body = fake_system.health()
    dead = {r["name"]: r for r in body["ranks"]}[rank]
    assert dead["state"] == "dead" and "exited" in dead["error"]
    assert status == 200 and body["status"] == "degraded"  # the other rank lives
    t0 = time.monotonic()
    for _ in range(3):
        resp = httpx.post(fake_system.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200 and resp.headers["x-pdserve-rank"] != rank
    assert time.monotonic() - t0 < 10
