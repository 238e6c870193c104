"""Requests that once took a rank's step or the router's event loop down, against a real PD
system (pd_handoff_system: one prefill and one decode rank, every prompt through the handoff),
with honest greedy streams in flight:

1. A token id outside the vocabulary in an ordinary field (`stop_token_ids` with `min_tokens`,
   which makes it a logits index) is a 400 naming the field, at the router; the streams beside
   it never see a failed step.
2. A 16 MiB /tokenize and a 16 MiB chat body (each just under the body limit) are refused
   before tokenizing (a text that long cannot fit the context); rendering and tokenizing run
   off the event loop, so the streams' largest inter-token gap stays under 2 s, no rank exits
   (ranks leave a router silent for 5 s), and every stream's text is the one it has alone.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152  # smollm2-135m-instruct's vocabulary
STREAMS, TOKENS = 6, 120
BODY_LIMIT = 16 * 2**20


def _streams(system, out: list, started: threading.Event | None = None) -> list[threading.Thread]:
    """STREAMS greedy completions, each in a thread: out[i] = (text, arrival times, status)."""
    out[:] = [None] * STREAMS
    first = threading.Barrier(STREAMS + 1) if started is not None else None

    def run(i: int) -> None:
        times, text, status = [], [], None
        body = {"model": MODEL, "prompt": f"Write a long story, part {i}:", "max_tokens": TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", system.url + "/v1/completions", json=body, timeout=120) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
                        text += [c["text"] for c in json.loads(line[6:]).get("choices", [])]
                        if len(times) == 1 and first is not None:
                            first.wait(60)
        finally:
            out[i] = ("".join(text), times, status)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    if first is not None:
        first.wait(120)  # every stream has its first token
        started.set()
    return threads


def _pids(system) -> dict[str, int]:
    return {name: r["pid"] for name, r in system.ranks().items()}


def test_bad_token_ids_and_huge_bodies_harm_no_stream_and_no_rank(pd_handoff_system):
    system = pd_handoff_system
    pids = _pids(system)
    alone: list = []
    for t in _streams(system, alone):
        t.join(180)
    assert all(s == 200 and len(times) >= TOKENS - 5 for _, times, s in alone), alone

    got: list = []
    started = threading.Event()
    threads = _streams(system, got, started)
    answers = {}
    with httpx.Client(base_url=system.url, timeout=60) as http:
        bad = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [VOCAB]}
        answers["stop_token_ids"] = http.post("/v1/completions", json=bad)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "min_tokens": 1, "stop_token_ids": [VOCAB + 5]}
        answers["chat stop_token_ids"] = http.post("/v1/chat/completions", json=chat)
        text = "the quick brown fox jumps over the lazy dog " * (BODY_LIMIT // 44 - 100)
        answers["/tokenize"] = http.post("/tokenize", json={"model": MODEL, "prompt": text})
        answers["chat"] = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    for t in threads:
        t.join(180)

    for what, r in answers.items():
        assert r.status_code == 400, (what, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert "Error" not in err["message"] and "Traceback" not in err["message"], err
    assert answers["stop_token_ids"].json()["error"]["param"] == "stop_token_ids"
    assert "maximum context length" in answers["/tokenize"].json()["error"]["message"]
    for (text, times, status), (ref, _, _) in zip(got, alone):
        assert status == 200 and text == ref
        later = times[1:]  # (each stream waited for all six first tokens after its own)
        gap = max(b - a for a, b in zip(later, later[1:]))
        assert gap < 2.0, f"a stream waited {gap:.2f} s between two tokens"
    assert _pids(system) == pids  # no rank exited or was replaced
    assert all(r["state"] == "ready" for r in system.ranks().values())
