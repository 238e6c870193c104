"""The Responses API's translation to a chat request (pd_server/openai_responses.py), no model."""
from __future__ import annotations

import pytest

from pd_server.api_models import NamedToolChoice
from pd_server.errors import APIError
from pd_server.openai_responses import ResponsesRequest, response_object, to_chat

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _chat(**kw):
    return to_chat(ResponsesRequest(**kw))


def test_string_input_and_instructions():
    c = _chat(input="hi", instructions="be brief", max_output_tokens=7, temperature=0)
    assert [(m.role, m.text) for m in c.messages] == [("system", "be brief"), ("user", "hi")]
    assert c.max_tokens == 7 and c.temperature == 0 and c.n == 1


def test_items_calls_and_outputs():
    c = _chat(input=[{"role": "developer", "content": "rules"},
                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                    {"type": "input_text", "text": "b"}]},
                     {"type": "reasoning", "summary": []},
                     {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                     {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
                     {"type": "function_call_output", "call_id": "c1", "output": "one"},
                     {"type": "function_call_output", "call_id": "c2", "output": "two"}],
              tools=[TOOL], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
              text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}})
    roles = [m.role for m in c.messages]
    assert roles == ["developer", "user", "assistant", "tool", "tool"]
    assert c.messages[1].text == "a\nb"
    assert [(k.id, k.function.arguments) for k in c.messages[2].tool_calls] == [("c1", "{}"), ("c2", '{"x": 1}')]
    assert (c.messages[3].tool_call_id, c.messages[3].text) == ("c1", "one")
    assert isinstance(c.tool_choice, NamedToolChoice) and c.tool_choice.function.name == "f"
    assert c.tools[0].function.name == "f" and c.parallel_tool_calls is False
    assert c.response_format.type == "json_schema" and c.response_format.json_schema["schema"] == {"type": "object"}


@pytest.mark.parametrize("kw, match", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input_file"),
    ({"input": "x", "previous_response_id": "r"}, "stores no responses"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "z", "output": "o"}]}, "answers no earlier"),
    ({"input": [{"type": "computer_call"}]}, "computer_call items"),
    ({"input": [{"type": "message", "content": "x"}]}, "needs a role"),
    ({"input": [{"role": "system", "content": "x"}]}, "no message"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "only function tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "web_search"}}, "not supported"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "not in tools"),
])
def test_unsupported_input_is_400(kw, match):
    with pytest.raises(APIError, match=match) as e:
        _chat(**kw)
    assert e.value.status == 400


def test_response_object_shape():
    req = ResponsesRequest(input="x", tools=[TOOL], tool_choice="required")
    r = response_object("resp_1", 1.0, "m", req, [], "incomplete", None)
    assert r["incomplete_details"] == {"reason": "max_output_tokens"} and r["tool_choice"] == "required"
    assert r["tools"] == [TOOL] and r["text"] == {"format": {"type": "text"}} and r["parallel_tool_calls"]
