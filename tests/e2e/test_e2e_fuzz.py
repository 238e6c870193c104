"""Hostile input against real systems: every request refused with a 4xx in OpenAI's error shape,
never a 5xx or a hang, and the server unharmed.

1. The real model (the session's colocated system): 1,000+ requests from tests/hostile_requests.py
   (a fixed catalogue plus seeded mutations of valid requests); every 50 of them a greedy chat
   or completion must give exactly the text it gave before the first. At the end /health is
   200, the ranks ready at the start still are, and they hold no request and no KV page.
2. Stand-in ranks behind a router with small body limits (--max-body-bytes 16384,
   --body-timeout-s 1): bodies over the limit, declared or chunked, are 413; bodies that stall
   or trickle (slowloris), several at once, are 408 within a few seconds, while a valid request
   in the middle of them is served.
"""
from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
from conftest import MODEL, start_system, stop_system

from tests.hostile_requests import Hostile, Limits, corpus

pytestmark = pytest.mark.slow

VOCAB = 49152  # smollm2-135m-instruct's vocabulary
REFERENCE_EVERY = 50
GREEDY = [("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}],
                                    "temperature": 0, "max_tokens": 10}),
          ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "temperature": 0,
                               "max_tokens": 10})]
CLIENT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # a hang fails the test instead of blocking it


def refusal_problem(case: Hostile, resp: httpx.Response) -> str | None:
    """What is wrong with the answer to a hostile request, or None."""
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    if not 400 <= resp.status_code < 500 or not isinstance(err, dict) \
            or set(err) != {"message", "type", "param", "code"}:
        return f"{case.name}: {resp.status_code} {resp.text[:200]}"
    if case.status not in (None, resp.status_code) or case.param not in (None, err["param"]):
        return f"{case.name}: expected {case.status} / param {case.param}, got {resp.status_code} {resp.text[:200]}"
    return None


def greedy_text(http: httpx.Client, path: str, body: dict) -> str:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def idle(system) -> bool:
    return all(r["inflight"] == 0 and r["pages_used"] == 0 and r["running"] == 0 and r["waiting"] == 0
               for r in system.ranks().values() if r["state"] == "ready")


def test_hostile_requests_are_refused_and_the_model_keeps_serving(colocated_system):
    system = colocated_system
    status, health = system.health()
    assert status == 200
    ready = {r["name"] for r in health["ranks"] if r["state"] == "ready"}
    cases = corpus(Limits(MODEL, health["max_model_len"], VOCAB), 1000)
    assert len(cases) >= 1000
    problems, mismatches, statuses = [], [], {}
    with httpx.Client(base_url=system.url, timeout=CLIENT_TIMEOUT) as http:
        reference = [greedy_text(http, path, body) for path, body in GREEDY]
        assert all(reference)
        for i, case in enumerate(cases):
            try:
                resp = http.request(case.method, case.path, content=case.body, headers=case.headers)
            except httpx.TimeoutException:
                problems.append(f"{case.name}: no answer within {CLIENT_TIMEOUT.read} s")
                continue
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            if problem := refusal_problem(case, resp):
                problems.append(problem)
            if i % REFERENCE_EVERY == REFERENCE_EVERY - 1:
                path, body = GREEDY[(i // REFERENCE_EVERY) % 2]
                text = greedy_text(http, path, body)
                if text != reference[(i // REFERENCE_EVERY) % 2]:
                    mismatches.append((i, text))
    assert not problems, f"{len(problems)} bad answers:\n" + "\n".join(problems[:20])
    assert not mismatches, f"greedy output changed after hostile requests: {mismatches[:3]} vs {reference}"
    assert 5 not in {s // 100 for s in statuses}, statuses
    status, health = system.health()
    assert status == 200 and {r["name"] for r in health["ranks"] if r["state"] == "ready"} == ready
    system.wait_until(lambda: idle(system), 15, "every rank idle after the fuzz")


# ---- body size and slow bodies, on stand-in ranks ----------------------------------------------------
BODY_LIMIT, BODY_TIMEOUT_S = 16384, 1.0


@pytest.fixture(scope="module")
def strict_system(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("strict"),
                          ["--fake-ranks", "--fake-step-ms", "5", "--colocated", "2", "--model", MODEL,
                           "--max-body-bytes", str(BODY_LIMIT), "--body-timeout-s", str(BODY_TIMEOUT_S),
                           "--header-timeout-s", str(BODY_TIMEOUT_S)],
                          timeout=120)
    try:
        yield system
    finally:
        stop_system(system)


def raw_exchange(port: int, head: bytes, parts: list[bytes], gap_s: float = 0.0,
                 timeout_s: float = 15.0) -> tuple[int, dict, float]:
    """Send `head`, then `parts` `gap_s` apart (stopping as soon as the server answers), then
    read the answer until the server closes. Returns (status, JSON body, seconds taken)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head)
        for part in parts:
            if select.select([s], [], [], gap_s)[0]:
                break  # the server answered (and will close): stop sending
            try:
                s.sendall(part)
            except OSError:
                break
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            # A trickling client's next byte can cross the server's 408 + close: the kernel then
            # answers it with a reset, which may discard the 408 before we read it.
            if not data:
                return RESET, {}, time.monotonic() - start
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    assert head_bytes, "the server closed without an answer"
    return int(head_bytes.split()[1]), json.loads(body), time.monotonic() - start


RESET = 0  # raw_exchange's status when the connection was reset before an answer could be read


def post_head(length: int | None, path: str = "/v1/completions") -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s\r\n\r\n" % (path.encode(), size)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def too_large_cases() -> list[tuple[str, bytes, list[bytes]]]:
    body = json.dumps({"model": MODEL, "prompt": "x" * BODY_LIMIT, "max_tokens": 2}).encode()
    out = [(f"declared {n} bytes", post_head(n), []) for n in (BODY_LIMIT + 1, 10**6, 10**12)]
    out += [("declared and sent", post_head(len(body)), [body])]
    out += [(f"chunked in {k}", post_head(None), [chunk(body[i::k]) for i in range(k)]) for k in (1, 3, 40)]
    out += [("chat, chunked", post_head(None, "/v1/chat/completions"), [chunk(b"[" * (BODY_LIMIT + 1))])]
    return out


def slow_cases() -> list[tuple[str, bytes, list[bytes], float]]:
    return [("stalls after 5 bytes", post_head(200), [b'{"mod'], 0.0),
            ("stalls before any byte", post_head(200), [], 0.0),
            ("trickles a byte every 0.2 s", post_head(200), [b"{"] * 100, 0.2),
            ("chunked, stalls", post_head(None), [chunk(b'{"prompt": ')], 0.0),
            ("chunked, trickles", post_head(None, "/v1/chat/completions"), [chunk(b" ")] * 100, 0.2)]


def test_oversized_bodies_are_413(strict_system):
    for name, head, parts in too_large_cases():
        status, body, _ = raw_exchange(strict_system.port, head, parts)
        assert status == 413 and body["error"]["code"] == "request_too_large", (name, status, body)
    assert strict_system.health()[0] == 200


def test_slow_bodies_are_408_in_bounded_time_while_others_are_served(strict_system):
    results: dict[str, tuple] = {}

    def run(key, head, parts, gap):
        try:
            results[key] = raw_exchange(strict_system.port, head, parts, gap)
        except Exception as e:  # noqa: BLE001 - reported below, with the case's name
            results[key] = (None, repr(e), None)

    threads = [threading.Thread(target=run, args=(f"{name} #{i}", head, parts, gap))
               for i, (name, head, parts, gap) in enumerate(slow_cases() * 2)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=strict_system.url, timeout=CLIENT_TIMEOUT) as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and len(results) == len(threads)
    for name, (status, body, seconds) in results.items():
        if status == RESET and "trickle" in name:  # see raw_exchange: the deadline still held
            assert BODY_TIMEOUT_S * 0.9 <= seconds < 10, (name, seconds)
            continue
        assert status == 408 and body["error"]["type"] == "timeout_error", (name, status, body)
        assert BODY_TIMEOUT_S * 0.9 <= seconds < 10, (name, seconds)
    assert strict_system.health()[0] == 200
    strict_system.wait_until(lambda: idle(strict_system), 10, "stand-in ranks idle")


def test_slow_headers_are_408_and_idle_connections_closed(strict_system):
    """uvicorn alone waits forever for headers; pd_server/http_protocol.py does not."""
    cases = {"half a request line": [b"POST /v1/compl"],
             "headers without their blank line": [b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"],
             "a header byte every 0.2 s": [b"GET /health HTTP/1.1\r\n"] + [b"x"] * 100}
    for name, parts in cases.items():
        status, body, seconds = raw_exchange(strict_system.port, parts[0], parts[1:], gap_s=0.2)
        if status == RESET and "every" in name:  # see raw_exchange
            assert BODY_TIMEOUT_S * 0.9 <= seconds < 10, (name, seconds)
            continue
        assert status == 408 and body["error"]["type"] == "timeout_error", (name, status, body)
        assert BODY_TIMEOUT_S * 0.9 <= seconds < 10, (name, seconds)
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", strict_system.port), timeout=15) as s:
        assert s.recv(100) == b""  # a connection that never sends a byte is closed, without an answer
    assert BODY_TIMEOUT_S * 0.9 <= time.monotonic() - start < 10
    assert strict_system.health()[0] == 200
