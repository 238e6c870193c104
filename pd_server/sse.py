"""Server-sent events framing for streamed completions, and the matching reader.

Each chunk is one event: `data: <json>\\n\\n` (event(), or event_template() on the per-token
fast path: the same bytes); the stream ends with `data: [DONE]\\n\\n`. JSON from msgspec
never holds a raw newline (strings escape it), so one line is one event. An error after the
stream started is an event whose JSON is {"error": {...}} (the OpenAI client raises on it),
followed by [DONE]. APIs with typed events (Anthropic's Messages) put an `event: <type>` line
before the data (named_event()) and end without [DONE].
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import msgspec

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode = msgspec.json.Encoder().encode


def event(payload: msgspec.Struct) -> bytes:
    """One SSE event holding payload as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


def named_event(name: str, payload: msgspec.Struct) -> bytes:
    """One SSE event with an `event: <name>` line before its JSON data."""
    return b"event: " + name.encode() + b"\n" + event(payload)


def event_template(payload: msgspec.Struct, marker: str, name: str | None = None) -> tuple[bytes, bytes]:
    """(prefix, suffix) around one string field: `payload` holds `marker` in that field, and
    prefix + json_string(s) + suffix == event(payload with s in place of marker) for any s
    (named_event(name, ...) with a name). The per-token fast path: two concatenations instead
    of building and encoding structs. Raises ValueError unless the marker occurs exactly once
    in the encoded event."""
    whole = event(payload) if name is None else named_event(name, payload)
    prefix, sep, suffix = whole.partition(_encode(marker))
    if not sep or _encode(marker) in suffix:
        raise ValueError(f"marker {marker!r} must occur exactly once in the event")
    return prefix, suffix


json_string = _encode  # str -> its JSON string literal (bytes), as inside event()


class TextEvents:
    """The per-token fast path of one streamed request: a token's event from a cached
    (prefix, suffix) template per choice index. `build(idx, text)` returns that choice's
    event payload with `text` in its text field; it is called once per index. `name`: the
    events' `event:` line, if any (named_event)."""

    _MARK = "\x00pdserve-text\x00"  # stands in for the text while the template is made

    def __init__(self, build: Callable[[int, str], msgspec.Struct], name: str | None = None) -> None:
        self._build, self._name = build, name
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def event(self, idx: int, text: str) -> bytes:
        t = self._templates.get(idx)
        if t is None:
            t = self._templates[idx] = event_template(self._build(idx, self._MARK), self._MARK, self._name)
        return t[0] + json_string(text) + t[1]


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
