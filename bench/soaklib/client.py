"""Send one Spec and say how it ended, checking what came back.

Outcomes that are not errors: `ok` (a complete, well-formed response), `disconnected` (the
client closed a stream after k events, as the spec asked), `aborted` (the client closed the
connection at its deadline before the response ended), `expected_4xx` (an invalid request
answered with a 4xx in OpenAI's error shape) and `backpressure_429` (the server said it is
full, in that shape). Everything else is unexpected, by class: `http_<status>`,
`error_shape_<status>`, `invalid_accepted`, `stream_error_<code>`, `stream_cut` (no [DONE]),
`bad_response` (a choice missing or unfinished, a bad finish_reason, a stop string in the
text, usage above n * max_tokens), `timeout` (no end within the client timeout),
`transport:<exception>`.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from pd_server.sse import aiter_events

from .mix import Spec

FINISH_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True)
class Outcome:
    label: str
    unexpected: bool = False
    tokens: int = 0  # completion tokens received
    detail: str = ""


async def execute(client: httpx.AsyncClient, base_url: str, spec: Spec, timeout_s: float) -> Outcome:
    """Run spec against base_url; never raises for anything the server or network does, and
    always ends within timeout_s (or spec.close_after_s, for aborts)."""
    limit = spec.close_after_s if spec.close_after_s is not None else timeout_s
    try:
        return await asyncio.wait_for(_send(client, base_url, spec), limit)
    except asyncio.TimeoutError:
        if spec.close_after_s is not None:
            return Outcome("aborted")
        return Outcome("timeout", True, detail=f"{spec.kind} {spec.path}: no end within {timeout_s:.0f}s")
    except httpx.HTTPError as e:
        return Outcome(f"transport:{type(e).__name__}", True, detail=f"{spec.kind} {spec.path}: {e}"[:300])


async def _send(client: httpx.AsyncClient, base_url: str, spec: Spec) -> Outcome:
    headers = {"content-type": "application/json"} if spec.body is not None else {}
    async with client.stream(spec.method, base_url + spec.path, content=spec.body, headers=headers) as r:
        if r.status_code != 200:
            return _refused(spec, r.status_code, await r.aread())
        if spec.invalid:
            return Outcome("invalid_accepted", True, detail=f"{spec.kind}: {(await r.aread())[:200]!r}")
        if spec.stream:
            return await _read_stream(spec, r)
        try:
            body = json.loads(await r.aread())
        except ValueError:
            return Outcome("bad_response", True, detail=f"{spec.kind}: body is not JSON")
        acc = Choices(spec)
        for c in body.get("choices", []):
            acc.add(c.get("index", -1), (c.get("message") or {}).get("content") or c.get("text"),
                    c.get("finish_reason"))
        return acc.finish(body.get("usage"))


def _refused(spec: Spec, status: int, raw: bytes) -> Outcome:
    try:
        err = json.loads(raw)["error"]
        shaped = isinstance(err, dict) and isinstance(err.get("message"), str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if status == 429 and shaped:
        return Outcome("backpressure_429")
    if spec.invalid and 400 <= status < 500:
        return Outcome("expected_4xx") if shaped else Outcome(f"error_shape_{status}", True,
                                                               detail=f"{spec.kind}: {raw[:200]!r}")
    return Outcome(f"http_{status}", True, detail=f"{spec.kind} {spec.path}: {raw[:300]!r}")


async def _read_stream(spec: Spec, r: httpx.Response) -> Outcome:
    acc, events = Choices(spec), 0
    async for data in aiter_events(r.aiter_bytes()):
        if data == b"[DONE]":
            return acc.finish(acc.usage)
        try:
            chunk = json.loads(data)
        except ValueError:
            return Outcome("bad_response", True, detail=f"{spec.kind}: event is not JSON: {data[:100]!r}")
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return Outcome(f"stream_error_{err.get('code')}", True, detail=f"{spec.kind}: {err.get('message')}")
        for c in chunk.get("choices") or []:
            acc.add(c.get("index", -1), (c.get("delta") or {}).get("content") or c.get("text"),
                    c.get("finish_reason"))
        acc.usage = chunk.get("usage") or acc.usage
        events += 1
        if spec.close_after_events is not None and events >= spec.close_after_events:
            return Outcome("disconnected", tokens=acc.pieces)  # leaving the block closes the connection
    return Outcome("stream_cut", True, detail=f"{spec.kind}: stream ended without [DONE] after {events} events")


@dataclass
class Choices:
    """Text and finish reason per choice index, as chunks or a body deliver them."""
    spec: Spec
    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    pieces: int = 0  # non-empty text pieces seen
    usage: dict | None = None

    def add(self, index: int, text: str | None, reason: str | None) -> None:
        if text:
            self.texts[index] = self.texts.get(index, "") + text
            self.pieces += 1
        if reason is not None:
            self.reasons[index] = reason

    def finish(self, usage: dict | None) -> Outcome:
        problem = self._problem(usage)
        if problem:
            return Outcome("bad_response", True, detail=f"{self.spec.kind} {self.spec.path}: {problem}")
        return Outcome("ok", tokens=usage["completion_tokens"])

    def _problem(self, usage: dict | None) -> str:
        spec = self.spec
        if set(self.reasons) != set(range(spec.n)):
            return f"finished choices {sorted(self.reasons)}, expected indices 0..{spec.n - 1}"
        bad = {r for r in self.reasons.values() if r not in FINISH_REASONS}
        if bad:
            return f"finish_reason {sorted(bad)}"
        for i, text in self.texts.items():
            hit = [s for s in spec.stop if s in text]
            if hit:
                return f"choice {i} holds stop string {hit[0]!r}: {text[:80]!r}"
        if usage is None:
            return "no usage (the mix asks for it on every stream)"
        if not 0 <= usage.get("completion_tokens", -1) <= spec.n * spec.max_tokens:
            return f"usage.completion_tokens {usage.get('completion_tokens')} outside [0, {spec.n * spec.max_tokens}]"
        return ""
