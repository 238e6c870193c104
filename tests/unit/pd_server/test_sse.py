"""SSE framing: one event per chunk, never a raw newline inside, and a reader that survives any split."""
from __future__ import annotations

import json
import random

from pd_server import sse
from pd_server.errors import APIError, error_body
from pd_server.responses import ChatChunk, ChatChunkChoice, Delta


def _chunk(text: str) -> ChatChunk:
    return ChatChunk("id", 1, "m", [ChatChunkChoice(0, Delta(content=text))])


def test_event_is_one_data_line():
    ev = sse.event(_chunk("line one\nline two\r\n\n"))
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert ev.count(b"\n") == 2  # the payload's newlines are escaped
    payload = json.loads(ev[6:-2])
    assert payload["choices"][0]["delta"] == {"content": "line one\nline two\r\n\n"}
    assert payload["object"] == "chat.completion.chunk" and "usage" not in payload


def test_reader_reassembles_any_split():
    texts = ["a", "b\n\nc", "", "ü🙂", "data: x"]
    stream = b"".join(sse.event(_chunk(t)) for t in texts) + sse.DONE
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), 8))
        parts = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)])]
        events = list(sse.iter_events(parts))
        assert events[-1] == b"[DONE]"
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == texts


def test_reader_skips_comments_and_handles_crlf():
    got = list(sse.iter_events([b": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\n", b"data: [DONE]\n\n"]))
    assert got == [b'{"a":1}', b"[DONE]"]


def test_error_event_has_openai_shape():
    ev = sse.event(error_body(APIError(500, "rank colocated-1 died")))
    err = json.loads(ev[6:-2])["error"]
    assert err == {"message": "rank colocated-1 died", "type": "internal_server_error", "param": None, "code": 500}
