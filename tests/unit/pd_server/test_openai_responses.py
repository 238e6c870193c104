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


def test_previous_response_id_continues_the_stored_chain_and_an_unknown_one_is_404():
    from pd_server.openai_responses import with_previous
    from pd_server.response_store import ResponseStore

    store = ResponseStore(8, 2**20, 60.0)
    first = ResponsesRequest(input="Call f.", instructions="Be brief.")
    _, items = with_previous(first, store)
    out = [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
            "status": "completed"}]
    assert store.put("resp_a", {"id": "resp_a", "output": out}, items)
    nxt = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "call_1", "output": "42"}],
                           previous_response_id="resp_a", tools=[TOOL])
    req, items2 = with_previous(nxt, store)
    assert [it["type"] for it in items2] == ["message", "function_call", "function_call_output"]
    c = to_chat(req)
    assert [m.role for m in c.messages] == ["user", "assistant", "tool"]  # the first turn's instructions stay behind
    assert c.messages[1].tool_calls[0].id == "call_1" and c.messages[2].text == "42"
    with pytest.raises(APIError, match="not found") as e:
        with_previous(ResponsesRequest(input="x", previous_response_id="resp_zzz"), store)
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    # Another tenant's response is not found either; its own tenant's is.
    assert store.put("resp_t", {"id": "resp_t", "output": []}, items, owner="tenant-1")
    assert store.get("resp_t") is None and store.get("resp_t", "tenant-2") is None
    assert store.get("resp_t", "tenant-1") is not None
    with pytest.raises(APIError, match="not found"):
        with_previous(ResponsesRequest(input="x", previous_response_id="resp_t"), store, "tenant-2")


def test_the_store_is_bounded_by_count_bytes_and_time(monkeypatch):
    import time

    from pd_server.response_store import ResponseStore

    store = ResponseStore(2, 10**6, 60.0)
    for rid in ("a", "b", "c"):
        assert store.put(rid, {"id": rid}, [])
    assert store.get("a") is None and store.get("b") is not None  # count: least recently used out
    store = ResponseStore(10, 100, 60.0)
    assert store.put("x", {"t": "x" * 45}, []) and store.put("y", {"t": "y" * 45}, [])
    assert store.get("x") is None and store.get("y") is not None  # bytes
    assert not store.put("huge", {"t": "z" * 200}, [])  # alone over the bound: not kept
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 61)
    assert store.get("y") is None and len(store) == 0 and store.nbytes == 0  # expired


def test_response_object_shape():
    req = ResponsesRequest(input="x", tools=[TOOL], tool_choice="required")
    r = response_object("resp_1", 1.0, "m", req, [], "incomplete", None)
    assert r["incomplete_details"] == {"reason": "max_output_tokens"} and r["tool_choice"] == "required"
    assert r["tools"] == [TOOL] and r["text"] == {"format": {"type": "text"}} and r["parallel_tool_calls"]
