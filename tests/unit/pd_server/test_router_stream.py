"""The streaming path in-process (app -> SSEStream -> renderers), fed token events by hand: the
bytes on the wire, the per-token fast path against the struct encoder, usage, tool-call deltas,
error events, [DONE], and a client disconnect aborting on the rank."""
from __future__ import annotations

import asyncio
import json

import pytest
from test_router_prompts import CHATML, StubTokenizer, WEATHER

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello, RequestError, TokenEvent
from cluster.protocol.router_rank import Abort, Generate
from pd_server import sse
from pd_server.app import build_app
from pd_server.config import RouterConfig
from pd_server.dispatcher import Dispatcher
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.ranks import RankRegistry
from pd_server.responses import ChatChunk, ChatChunkChoice, Completion, CompletionChoice, Delta
from pd_server.routing import make_policy
from pd_server.serving import ServerContext
from tests.fakes import InlineExecutor

MODEL = "tiny"
TRICKY = ["plain", "", " ", 'quote " and \\ backslash', "new\nline\r\n", "tab\t\x00\x1f", "ü🙂中", "</script>",
          "\x00pdserve-text\x00", "\u2028\u2029"]


class Recorder(Dispatcher):
    """A dispatcher whose rank sends are recorded instead of going to a socket."""

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg, RankRegistry(MODEL), make_policy("least-loaded"), RouterMetrics())
        self.sent: list[object] = []
        self.registry.on_hello(b"r0", Hello(PROTOCOL_VERSION, "colocated", 0, 1, MODEL, 4096, 200000, 16, 64), 0.0, 0.5)

    def _send(self, rank, msg) -> None:
        self.sent.append(msg)

    def generates(self) -> list[Generate]:
        return [m for m in self.sent if isinstance(m, Generate)]


@pytest.fixture
def app():
    cfg = RouterConfig()
    disp = Recorder(cfg)
    tok = StubTokenizer(CHATML)
    ctx = ServerContext(cfg, MODEL, frozenset({MODEL}), tok, ChatRenderer(tok), disp.registry, disp, RouterMetrics(),
                        work=InlineExecutor())
    yield build_app(ctx), disp
    disp._sock.close(linger=0)
    disp._ctx.term()


class Exchange:
    """One HTTP request driven straight through the ASGI app on this event loop."""

    def __init__(self, app, path: str, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.inbound: asyncio.Queue = asyncio.Queue()
        self.inbound.put_nowait({"type": "http.request", "body": raw, "more_body": False})
        self.messages: list[dict] = []
        self.gate = asyncio.Event()  # cleared: body sends wait (a client that stopped reading)
        self.gate.set()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        self.task = asyncio.ensure_future(app(scope, self.inbound.get, self._send))

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            await self.gate.wait()
        self.messages.append(message)

    @property
    def start(self) -> dict:
        return self.messages[0]

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def events(self) -> list:
        return [e if e == b"[DONE]" else json.loads(e) for e in sse.iter_events([self.body()])]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def ev(sid: str, n: int, text: str, finish: str | None = None) -> TokenEvent:
    return TokenEvent(sid, [100 + n], text, finish, None, 3, n, 1)


def test_completion_stream_bytes_usage_and_done(app):
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9, "stream": True,
                                            "stream_options": {"include_usage": True}})
        await settle()
        [gen] = disp.generates()
        for i, t in enumerate(TRICKY[:-1]):
            disp._on_tokens([ev(gen.request_id, i + 1, t)])
            await settle()
        disp._on_tokens([ev(gen.request_id, len(TRICKY), TRICKY[-1], "length")])
        await asyncio.wait_for(x.task, 5)
        return x

    x = asyncio.run(run())
    headers = dict(x.start["headers"])
    assert x.start["status"] == 200 and headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-pdserve-rank"] == b"colocated-0"
    rid, created = x.events()[0]["id"], x.events()[0]["created"]
    # Byte for byte what the structs encode (the fast path must not change the format).
    want = b"".join(sse.event(Completion(rid, created, MODEL, [CompletionChoice(0, t, None)])) for t in TRICKY)
    want += sse.event(Completion(rid, created, MODEL, [CompletionChoice(0, "", "length")]))
    usage = x.events()[-2]["usage"]
    assert x.body().startswith(want) and x.body().endswith(sse.DONE)
    assert usage == {"prompt_tokens": 3, "completion_tokens": len(TRICKY), "total_tokens": 3 + len(TRICKY),
                     "prompt_tokens_details": {"cached_tokens": 1}}
    assert [m["more_body"] for m in x.messages[1:]] == [True] * (len(TRICKY) - 1) + [False]  # a send a wake-up


def test_chat_stream_n2_role_first_then_fast_path_same_bytes(app):
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "n": 2, "max_tokens": 5, "stream": True})
        await settle()
        s0, s1 = (g.request_id for g in disp.generates())
        disp._on_tokens([ev(s0, 1, "a"), ev(s1, 1, "b")])  # both in one batch: one send, two events each
        await settle()
        disp._on_tokens([ev(s0, 2, 'q"\n'), ev(s1, 2, "🙂", "stop")])
        await settle()
        disp._on_tokens([ev(s0, 3, "", "length")])
        await asyncio.wait_for(x.task, 5)
        return x

    x = asyncio.run(run())
    rid, created = x.events()[0]["id"], x.events()[0]["created"]

    def chunk(i, delta, reason=None):
        return sse.event(ChatChunk(rid, created, MODEL, [ChatChunkChoice(i, delta, reason)]))

    assert x.body() == (chunk(0, Delta("assistant", "a")) + chunk(1, Delta("assistant", "b"))
                        + chunk(0, Delta(content='q"\n')) + chunk(1, Delta(content="🙂")) + chunk(1, Delta(), "stop")
                        + chunk(0, Delta(content="")) + chunk(0, Delta(), "length") + sse.DONE)
    assert len(x.messages) == 1 + 3


def test_chat_tool_call_deltas(app):
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [WEATHER], "max_tokens": 50, "stream": True})
        await settle()
        [gen] = disp.generates()
        parts = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
        for i, t in enumerate(parts):
            disp._on_tokens([ev(gen.request_id, i + 1, t, "stop" if i == len(parts) - 1 else None)])
            await settle()
        await asyncio.wait_for(x.task, 5)
        return x

    events = asyncio.run(run()).events()
    calls = [tc for e in events[:-1] for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == b"[DONE]"
    assert "<tool_call>" not in "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])


async def streaming_after_one_token(app) -> tuple[Exchange, str]:
    """A streamed completion that has sent its first token ("x"); (exchange, sub-request id)."""
    a, disp = app
    x = Exchange(a, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9, "stream": True})
    await settle()
    [gen] = disp.generates()
    disp._on_tokens([ev(gen.request_id, 1, "x")])
    await settle()
    return x, gen.request_id


def test_failure_after_start_is_an_error_event_then_done(app):
    async def run():
        x, sid = await streaming_after_one_token(app)
        disp = app[1]
        disp._on_frame(b"r0", disp._codec.encode(RequestError(sid, 500, "engine failed")))
        await asyncio.wait_for(x.task, 5)
        return x

    events = asyncio.run(run()).events()
    assert events[0]["choices"][0]["text"] == "x"
    assert events[1] == {"error": {"message": "engine failed", "type": "internal_server_error", "param": None,
                                   "code": 500}}
    assert events[2] == b"[DONE]" and len(events) == 3


def test_client_disconnect_aborts_on_the_rank_and_sends_nothing_more(app):
    async def run():
        x, sid = await streaming_after_one_token(app)
        disp = app[1]
        sent = len(x.messages)
        x.inbound.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(x.task, 5)
        assert len(x.messages) == sent  # no [DONE] to a gone client
        assert Abort(sid) in disp.sent and not disp.pending
        assert not disp.registry.ranks["colocated-0"].inflight

    asyncio.run(run())


def test_non_streaming_disconnect_aborts_too(app):
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9})
        await settle()
        [gen] = disp.generates()
        x.inbound.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(x.task, 5)
        assert Abort(gen.request_id) in disp.sent and not disp.pending

    asyncio.run(run())


def test_a_send_that_waits_keeps_the_order_of_later_tokens(app):
    async def run():
        x, sid = await streaming_after_one_token(app)
        disp = app[1]
        x.gate.clear()
        disp._on_tokens([ev(sid, 2, "b")])  # written at the round's end: its send now waits
        await settle()
        disp._on_tokens([ev(sid, 3, "c")])  # must wait behind it
        await settle()
        disp._on_tokens([ev(sid, 4, "d", "length")])
        await settle()
        assert not x.task.done() and len(x.messages) == 2
        x.gate.set()
        await asyncio.wait_for(x.task, 5)
        return x

    events = asyncio.run(run()).events()
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "b", "c", "d", ""]
    assert events[-1] == b"[DONE]"


def test_tokens_of_one_round_share_one_send(app):
    async def run():
        x, sid = await streaming_after_one_token(app)
        disp = app[1]
        disp._on_tokens([ev(sid, 2, "b")])
        disp._on_tokens([ev(sid, 3, "c")])  # the same receive round: nothing ran in between
        await settle()
        return x

    x = asyncio.run(run())
    assert x.messages[-1]["body"].count(b"data: ") == 2 and len(x.messages) == 3


@pytest.mark.parametrize("text", TRICKY)
def test_event_template_equals_the_encoder(text):
    def payload(t: str) -> Completion:
        return Completion("id-1", 7, 'm"x', [CompletionChoice(3, t, None)])

    pre, suf = sse.event_template(payload("\x00m\x00"), "\x00m\x00")
    assert pre + sse.json_string(text) + suf == sse.event(payload(text))


def test_event_template_needs_exactly_one_marker():
    with pytest.raises(ValueError):
        sse.event_template(Completion("mk", 1, "mk", [CompletionChoice(0, "mk", None)]), "mk")
