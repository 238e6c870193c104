"""Anthropic's Messages API through a started system, with the official anthropic client,
colocated and PD (every prompt through a prefill rank): text answers whole and streamed (the
same text at temperature 0), stop_sequences and max_tokens as stop reasons, a forced tool as a
tool_use block valid against its input_schema (streamed: input_json_delta parts that assemble
to the same input), a conversation with tool_use and tool_result blocks, usage against
count_tokens and the prefix cache, greedy PD equal to colocated, and bad requests refused in
Anthropic's error shape."""
from __future__ import annotations

import json

import anthropic
import pytest


pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Current time in a timezone",
          "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}  # this client has no temperature argument; the API takes it (default 1.0)
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


@pytest.fixture(params=["colocated", "pd"])
def system(request):
    return request.getfixturevalue("colocated_system" if request.param == "colocated" else "pd_handoff_system")


_CLIENTS: dict[str, anthropic.Anthropic] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients():
    yield
    for c in _CLIENTS.values():
        c.close()
    _CLIENTS.clear()


def _client(system) -> anthropic.Anthropic:
    """One client per system for the module (closed at its end)."""
    if system.url not in _CLIENTS:
        _CLIENTS[system.url] = anthropic.Anthropic(base_url=system.url, api_key="unused", max_retries=0, timeout=300)
    return _CLIENTS[system.url]


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _validate_weather(value) -> None:
    assert isinstance(value, dict) and set(value) == {"city", "unit"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 24 and value["unit"] in ("celsius", "fahrenheit")


def test_text_whole_and_streamed(system):
    c = _client(system)
    kw = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, system="You are a storyteller.", messages=STORY)
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert [b.type for b in m.content] == ["text"] and _text(m)
    assert m.usage.output_tokens > 0 and m.usage.cache_creation_input_tokens == 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.messages.count_tokens(
        model=MODEL, system="You are a storyteller.", messages=STORY).input_tokens
    with c.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(final) == _text(m)
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_cached_prompt_tokens_are_counted_apart(colocated_system):
    """The same prompt twice (cache-aware routing: the same rank): the second reads its full
    pages from the prefix cache, which Anthropic's usage counts apart from input_tokens."""
    c = _client(colocated_system)
    kw = dict(model=MODEL, max_tokens=4, extra_body=GREEDY, system="You count sheep.", messages=STORY)
    first, again = c.messages.create(**kw), c.messages.create(**kw)
    total = c.messages.count_tokens(model=MODEL, system="You count sheep.", messages=STORY).input_tokens
    assert again.usage.cache_read_input_tokens == (total - 1) // 16 * 16 > 0
    for m in (first, again):
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == total


def test_stop_sequences_and_max_tokens(system):
    c = _client(system)
    full = _text(c.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=STORY))
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    m = c.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=STORY,
                          stop_sequences=[stop, "@@@"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert _text(m) == full[:full.index(stop)]
    with c.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=STORY,
                           stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, _text(m))
    m = c.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=STORY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_forced_tool_whole_and_streamed(system):
    c = _client(system)
    kw = dict(model=MODEL, max_tokens=80, extra_body=GREEDY, messages=ASK, tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"})
    m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    [block] = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    _validate_weather(block.input)
    parts = []
    with c.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                parts.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert json.loads("".join(parts)) == block.input
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input, final.stop_reason) == ("get_weather", block.input, "tool_use")


def test_conversation_with_a_tool_result(system):
    c = _client(system)
    turns = [*ASK,
             {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                               {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                                "input": {"city": "Paris", "unit": "celsius"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                           "content": "18 degrees and sunny"}]}]
    m = c.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=turns, tools=TOOLS)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.messages.count_tokens(
        model=MODEL, messages=turns, tools=TOOLS).input_tokens


def test_pd_equals_colocated(colocated_system, pd_handoff_system):
    for kw in (dict(messages=STORY, max_tokens=24), dict(messages=ASK, max_tokens=80, tools=TOOLS,
                                                         tool_choice={"type": "any"})):
        a = _client(colocated_system).messages.create(model=MODEL, extra_body=GREEDY, **kw)
        b = _client(pd_handoff_system).messages.create(model=MODEL, extra_body=GREEDY, **kw)
        assert [(x.type, x.text if x.type == "text" else (x.name, x.input)) for x in a.content] == \
               [(x.type, x.text if x.type == "text" else (x.name, x.input)) for x in b.content]
        assert (a.stop_reason, a.usage.output_tokens) == (b.stop_reason, b.usage.output_tokens)


@pytest.mark.parametrize("body, error, match", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, anthropic.BadRequestError,
     "'image' blocks"),
    ({"model": "claude-sonnet-4-5"}, anthropic.NotFoundError, "claude-sonnet-4-5"),
    ({"max_tokens": None}, anthropic.BadRequestError, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                 "content": "1"}]}]}, anthropic.BadRequestError, "toolu_x"),
    ({"messages": []}, anthropic.BadRequestError, "messages"),
])
def test_bad_requests_in_anthropics_shape(colocated_system, body, error, match):
    req = {"model": MODEL, "max_tokens": 5, "messages": ASK, **body}
    req = {k: v for k, v in req.items() if v is not None}  # the client itself insists on max_tokens
    with pytest.raises(error, match=match) as e:
        _client(colocated_system).post("/v1/messages", cast_to=object, body=req)
    assert e.value.body["type"] == "error"
    assert e.value.type == ("not_found_error" if error is anthropic.NotFoundError else "invalid_request_error")
