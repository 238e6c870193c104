"""Server-sent events framing for streamed completions, and the matching reader.

Each chunk is one event: `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. JSON
from msgspec never holds a raw newline (strings escape it), so one line is one event. An
error after the stream started is an event whose JSON is {"error": {...}} (the OpenAI
client raises on it), followed by [DONE].
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator

import msgspec

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode = msgspec.json.Encoder().encode


def event(payload: msgspec.Struct) -> bytes:
    """One SSE event holding payload as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


class SSEReader:
    """Incremental parser: feed() raw bytes as they arrive, get back each complete event's
    data (bytes, without the `data: ` prefix; b"[DONE]" included). Comments and other
    fields are skipped; an event split across reads is held until its blank line."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data.replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for ev in events:
            lines = [ln[5:].lstrip(b" ") for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


def iter_events(chunks: Iterable[bytes]) -> Iterator[bytes]:
    reader = SSEReader()
    for c in chunks:
        yield from reader.feed(c)


async def aiter_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    reader = SSEReader()
    async for c in chunks:
        for ev in reader.feed(c):
            yield ev
