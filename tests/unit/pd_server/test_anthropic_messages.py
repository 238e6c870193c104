"""Anthropic's Messages API in process, no model: the translation to a chat request (system,
content blocks, tool_use/tool_result pairing, tool_choice, stop_sequences), stop_reason, the
stream's events and framing (typed `event:` lines, no [DONE], the fast path's bytes), the
non-streaming answer, count_tokens, and errors in Anthropic's shape (validation, model, pairing,
limits, the API key sent as x-api-key)."""
from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError
from test_router_limits import KEY, SMALL, make_client
from test_router_prompts import CHATML, StubTokenizer
from test_router_stream import Exchange, Recorder, settle

from cluster.protocol.rank_router import RequestError, TokenEvent
from pd_server import sse
from pd_server.anthropic_messages import to_chat
from pd_server.anthropic_models import (ContentBlockDelta, CountTokensRequest, MessagesRequest, TextDelta,
                                        stop_reason, tool_use)
from pd_server.api_models import NamedToolChoice
from pd_server.app import build_app
from pd_server.config import RouterConfig
from pd_server.errors import APIError, anthropic_error_body, error_json
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.serving import ServerContext
from pd_server.tool_parser import ParsedToolCall
from tests.fakes import InlineExecutor

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
HI = [{"role": "user", "content": "hi"}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": [{"type": "text", "text": "18C"}]},
                                 {"type": "text", "text": "And tomorrow?"}]},
]


def req(**kw) -> MessagesRequest:
    return MessagesRequest(**{"model": MODEL, "max_tokens": 8, "messages": HI, **kw})


# ---- translation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("system", ["be brief", [{"type": "text", "text": "be"}, {"type": "text", "text": "brief",
                                                                                   "cache_control": {"type": "x"}}]])
def test_system_becomes_the_first_message(system):
    chat = to_chat(req(system=system))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].text == ("be brief" if isinstance(system, str) else "be\nbrief")
    assert [m.role for m in to_chat(req()).messages] == ["user"]


def test_tool_use_and_tool_result_blocks_pair_up_in_order():
    chat = to_chat(req(messages=TOOL_TURNS, tools=[WEATHER]))
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "user"]
    asst, result, user = chat.messages[1:]
    assert asst.text == "Let me look." and len(asst.tool_calls) == 1
    call = asst.tool_calls[0]
    assert call.id == "toolu_1" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert result.tool_call_id == "toolu_1" and result.text == "18C" and user.text == "And tomorrow?"
    [tool] = chat.tools
    assert tool.function.name == "get_weather" and tool.function.parameters == WEATHER["input_schema"]
    assert tool.function.description == "Weather in a city"


def test_text_before_a_tool_result_keeps_its_place_and_thinking_blocks_are_dropped():
    turns = [HI[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                      {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t"},
                                          {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]
    chat = to_chat(req(messages=turns))
    assert [(m.role, m.text) for m in chat.messages] == [("user", "hi"), ("assistant", ""), ("user", "a"),
                                                         ("tool", ""), ("user", "b\nc")]


@pytest.mark.parametrize("turns", [
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}],
    [TOOL_TURNS[0], {"role": "assistant", "content": "no call"},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
])
def test_a_tool_result_without_its_tool_use_is_400(turns):
    with pytest.raises(APIError) as e:
        to_chat(req(messages=turns))
    assert e.value.status == 400 and "matches no tool_use" in e.value.message
    assert e.value.param == f"messages.{len(turns) - 1}.content.0.tool_use_id"


@pytest.mark.parametrize("choice,want", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                         ({"type": "none"}, "none")])
def test_tool_choice_maps_to_openai(choice, want):
    chat = to_chat(req(tools=[WEATHER], tool_choice=choice))
    assert chat.tool_choice == want and chat.parallel_tool_calls is None


def test_named_tool_choice_and_no_parallel_calls():
    chat = to_chat(req(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True}))
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"
    assert chat.parallel_tool_calls is False


def test_sampling_fields_and_count_tokens_has_none():
    chat = to_chat(req(stop_sequences=["\n\n", "END"], temperature=0.0, top_p=0.5, top_k=4, stream=True,
                       metadata={"user_id": "u"}))
    assert chat.stop_list == ["\n\n", "END"] and chat.max_tokens == 8 and chat.stream
    assert (chat.temperature, chat.top_p, chat.top_k, chat.n) == (0.0, 0.5, 4, 1)
    counted = to_chat(CountTokensRequest(model=MODEL, messages=HI))
    assert counted.max_tokens is None and counted.stop is None


@pytest.mark.parametrize("fields,match", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]}, "'image' blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "'tool_use' blocks"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "'tool_result' blocks"),
    ({"messages": []}, "at least 1"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "name goes with"),
    ({"stop_sequences": [""]}, "non-empty"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"max_tokens": None}, "valid integer"),
])
def test_invalid_requests_fail_validation(fields, match):
    with pytest.raises(ValidationError, match=match):
        req(**fields)


# ---- the answer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("finish,stop_str,calls,want", [
    ("stop", None, False, ("end_turn", None)),  # eos
    ("length", None, False, ("max_tokens", None)),
    ("stop", "END", False, ("stop_sequence", "END")),
    ("stop", "\nUser:", False, ("end_turn", None)),  # the template's own stop string, not the request's
    ("stop", "</tool_call>", True, ("tool_use", None)),
    ("length", None, True, ("tool_use", None)),
])
def test_stop_reason(finish, stop_str, calls, want):
    assert stop_reason(finish, stop_str, ["END"], calls) == want


def test_tool_use_block_from_a_parsed_call():
    block = tool_use(ParsedToolCall("get_weather", '{"city": "Paris"}', "call_abc"))
    assert (block.id, block.name, block.input) == ("toolu_abc", "get_weather", {"city": "Paris"})
    assert tool_use(ParsedToolCall("f", "[1, 2]", "call_x")).input == {"arguments": [1, 2]}


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                         (404, "not_found_error"), (413, "request_too_large"),
                                         (429, "rate_limit_error"), (500, "api_error"),
                                         (503, "overloaded_error"), (499, "api_error")])
def test_error_types_follow_anthropics_table(status, kind):
    assert json.loads(error_json(APIError(status, "m"), "/v1/messages")) == {
        "type": "error", "error": {"type": kind, "message": "m"}}
    assert json.loads(error_json(APIError(status, "m"), "/v1/messages/count_tokens"))["type"] == "error"
    assert set(json.loads(error_json(APIError(status, "m"), "/v1/messagesx"))) == {"error"}  # OpenAI's


# ---- over HTTP, no rank (dispatch stubbed to a 429) ---------------------------------------------
@pytest.fixture
def client(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with make_client(monkeypatch, **SMALL) as c:
        yield c
    c.ctx.dispatcher._sock.close(linger=0)


def anthropic_error(resp, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def post(client, path="/v1/messages", headers=None, **kw):
    return client.post(path, json={"model": MODEL, "max_tokens": 4, "messages": HI, **kw}, headers=headers)


def test_http_errors_are_anthropic_shaped(client):
    assert "max_tokens" in anthropic_error(client.post("/v1/messages", json={"model": MODEL, "messages": HI}),
                                           400, "invalid_request_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]
    assert "'image' blocks" in anthropic_error(post(client, messages=image), 400, "invalid_request_error")
    assert "messages" in anthropic_error(post(client, messages=[]), 400, "invalid_request_error")
    assert "claude-x" in anthropic_error(post(client, model="claude-x"), 404, "not_found_error")
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]
    assert "toolu_9" in anthropic_error(post(client, messages=orphan), 400, "invalid_request_error")
    bad_json = client.post("/v1/messages", content=b"{oops", headers={"content-type": "application/json"})
    assert "not valid JSON" in anthropic_error(bad_json, 400, "invalid_request_error")
    assert "at most" in anthropic_error(post(client, stop_sequences=["a", "b", "c"]), 400, "invalid_request_error")
    anthropic_error(post(client), 429, "rate_limit_error")  # passed every check: the stubbed dispatch
    anthropic_error(client.get("/v1/messages/batches"), 404, "not_found_error")
    assert set(client.get("/v1/nope").json()) == {"error"}  # other routes keep OpenAI's shape
    assert set(client.post("/v1/chat/completions", json={"model": MODEL}).json()) == {"error"}


def test_count_tokens_renders_as_the_message_would(client):
    resp = post(client, "/v1/messages/count_tokens", system="sys")
    # CHATML stub: one token per character of "<|system|>sys\n<|user|>hi\n<|assistant|>"
    assert resp.status_code == 200 and resp.json() == {"input_tokens": len("<|system|>sys\n<|user|>hi\n<|assistant|>")}
    anthropic_error(post(client, "/v1/messages/count_tokens", model="claude-x"), 404, "not_found_error")


def test_x_api_key_is_accepted_on_the_messages_routes_only(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with make_client(monkeypatch, api_key=KEY) as c:
        for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": KEY + "x"}, {"authorization": "Bearer wrong"}):
            msg = anthropic_error(post(c, headers=headers), 401, "authentication_error")
            assert KEY not in msg
        assert "x-api-key" in anthropic_error(post(c), 401, "authentication_error")
        anthropic_error(post(c, headers={"x-api-key": KEY}), 429, "rate_limit_error")
        anthropic_error(post(c, headers={"authorization": f"Bearer {KEY}"}), 429, "rate_limit_error")
        assert post(c, "/v1/messages/count_tokens", headers={"x-api-key": KEY}).status_code == 200
        chat = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers={"x-api-key": KEY})
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
    c.ctx.dispatcher._sock.close(linger=0)


# ---- through the dispatcher: the stream and the whole answer ---------------------------------------
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


def tok(sid: str, n: int, text: str, finish: str | None = None, stop_str: str | None = None) -> TokenEvent:
    return TokenEvent(sid, [100 + n], text, finish, stop_str, 20, n, 6)


def exchange(app, body: dict, events) -> Exchange:
    """Run one /v1/messages request; `events(sid)` gives the batches the rank sends."""
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/messages", {"model": MODEL, "max_tokens": 50, "messages": HI, **body})
        await settle()
        gen = disp.generates()[-1]
        for batch in events(gen.request_id):
            disp._on_tokens(batch)
            await settle()
        await asyncio.wait_for(x.task, 5)
        return x

    return asyncio.run(run())


def framed(body: bytes) -> list[tuple[str, dict]]:
    """Every event as (event line, data), checking the framing: `event: T\\ndata: {"type": T...}`."""
    assert body.endswith(b"\n\n") and b"[DONE]" not in body
    out = []
    for raw in body[:-2].split(b"\n\n"):
        name, data = raw.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), raw
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:].decode()
        out.append((payload["type"], payload))
    return out


TEXTS = ["Hel", "lo", 'q"\n', "🙂", " end"]


def test_text_stream_events_and_fast_path_bytes(app):
    x = exchange(app, {"stream": True, "stop_sequences": ["STOP"]},
                 lambda sid: [[tok(sid, i + 1, t)] for i, t in enumerate(TEXTS)] + [[tok(sid, 6, "", "stop", "STOP")]])
    headers = dict(x.start["headers"])
    assert x.start["status"] == 200 and headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    events = framed(x.body())
    assert [k for k, _ in events] == (["message_start", "content_block_start"] + ["content_block_delta"] * 6
                                      + ["content_block_stop", "message_delta", "message_stop"])
    msg = events[0][1]["message"]
    assert msg["id"].startswith("msg_") and msg["content"] == [] and msg["role"] == "assistant"
    assert msg["usage"]["input_tokens"] == len("<|user|>hi\n<|assistant|>") and msg["stop_reason"] is None
    assert headers[b"x-request-id"].decode() == msg["id"].replace("msg_", "msg-")
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta") == "".join(TEXTS)
    # The fast path's template gives the bytes the encoder gives.
    for t in TEXTS:
        assert sse.named_event("content_block_delta", ContentBlockDelta(0, TextDelta(t))) in x.body()
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "stop_sequence", "stop_sequence": "STOP"},
                             "usage": {"input_tokens": 14, "output_tokens": 6, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 6}}


def test_tool_call_stream_is_a_tool_use_block(app):
    parts = ["Sure.", '<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
    x = exchange(app, {"stream": True, "tools": [WEATHER]},
                 lambda sid: [[tok(sid, i + 1, t, "stop" if i == len(parts) - 1 else None)]
                              for i, t in enumerate(parts)])
    events = framed(x.body())
    assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"]
    start, delta, stop = (e for _, e in events[4:7])
    assert start["index"] == delta["index"] == stop["index"] == 1
    block = start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert block["id"].startswith("toolu_")
    assert delta["delta"]["type"] == "input_json_delta" and json.loads(delta["delta"]["partial_json"]) == {
        "city": "Paris"}
    assert events[2][1]["delta"]["text"] == "Sure." and events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_failure_after_start_is_the_last_event(app):
    async def run():
        a, disp = app
        x = Exchange(a, "/v1/messages", {"model": MODEL, "max_tokens": 9, "messages": HI, "stream": True})
        await settle()
        [gen] = disp.generates()
        disp._on_tokens([tok(gen.request_id, 1, "x")])
        await settle()
        disp._on_frame(b"r0", disp._codec.encode(RequestError(gen.request_id, 503, "rank gone")))
        await asyncio.wait_for(x.task, 5)
        return x

    kinds = framed(asyncio.run(run()).body())
    assert [k for k, _ in kinds] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert kinds[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "rank gone"}}


def test_whole_answer_text_and_tool_use(app):
    x = exchange(app, {"stop_sequences": ["STOP"]},
                 lambda sid: [[tok(sid, 1, "Hi"), tok(sid, 2, " there", "stop", "STOP")]])
    body = json.loads(x.body())
    assert body["type"] == "message" and body["id"].startswith("msg_") and body["model"] == MODEL
    assert body["content"] == [{"type": "text", "text": "Hi there"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "STOP")
    assert body["usage"] == {"input_tokens": 14, "output_tokens": 2, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 6}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    x = exchange(app, {"tools": [WEATHER]}, lambda sid: [[tok(sid, 1, call, "stop")]])
    body = json.loads(x.body())
    [block] = body["content"]
    assert block["type"] == "tool_use" and block["input"] == {"city": "Oslo"} and body["stop_reason"] == "tool_use"
    x = exchange(app, {}, lambda sid: [[tok(sid, 1, "a"), tok(sid, 2, "b", "length")]])
    assert json.loads(x.body())["stop_reason"] == "max_tokens"


def test_anthropic_error_body_is_the_stream_error_payload():
    assert sse.named_event("error", anthropic_error_body(APIError(500, "boom"))) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n')
