"""Structured outputs on the router (pd_server/structured.py): which grammar a chat request gets,
that it takes the text the tool parser reads back, and the compile time limit."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.grammar import GrammarSpec
from pd_server.api_models import ChatCompletionRequest
from pd_server.errors import APIError
from pd_server.structured import CompileGate, grammar_for
from pd_server.tool_parser import parse_tool_calls

xgr = pytest.importorskip("xgrammar")
ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "noop"}}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


def _accepts(spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar matches `text` whole (a byte-level matcher, no tokenizer)."""
    from engine.grammar import to_grammar

    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(to_grammar(spec)))
    return m.accept_string(text) and m.is_completed()


def test_free_text_has_no_grammar():
    assert grammar_for(_req()) is None
    assert grammar_for(_req(response_format={"type": "text"})) is None
    assert grammar_for(_req(tools=TOOLS, tool_choice="auto")) is None


def test_response_formats():
    assert grammar_for(_req(response_format={"type": "json_object"})) == GrammarSpec("json_object")
    spec = grammar_for(_req(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ARGS}}))
    assert spec.kind == "json_schema" and json.loads(spec.text) == ARGS
    assert _accepts(spec, '{"city": "Paris"}') and not _accepts(spec, '{"town": "Paris"}')


def test_named_tool_choice_completes_the_forced_prefix():
    req = _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = grammar_for(req)
    body = '{"city": "Paris"}}\n</tool_call>'
    assert _accepts(spec, body) and not _accepts(spec, '{"city": 3}}\n</tool_call>')
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    _, calls = parse_tool_calls(body, ["get_weather", "noop"], prefix)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_required_tool_choice_one_or_more_calls():
    one = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    spec = grammar_for(_req(tools=TOOLS, tool_choice="required"))
    assert _accepts(spec, one) and _accepts(spec, two)
    assert not _accepts(spec, '{"name": "other", "arguments": {}}\n</tool_call>')
    single = grammar_for(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert _accepts(single, one) and not _accepts(single, two)
    _, calls = parse_tool_calls(two, ["get_weather", "noop"], "<tool_call>\n")
    assert [c.name for c in calls] == ["get_weather", "noop"]


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_schemas_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        grammar_for(_req(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_compile_time_limit_and_the_gate():
    """Past the timeout: a 400, and the same spec again is that 400 at once (nothing compiles);
    while every thread runs a compilation past its timeout, a new grammar is a 503; once they end,
    compilations go on."""
    import threading

    release = threading.Event()
    calls = []

    class Slow:
        def compile(self, spec):
            calls.append(spec.text)
            if spec.text.startswith("slow"):
                release.wait(5)

    async def run():
        gate = CompileGate(workers=2)
        for text in ("slow-1", "slow-2"):
            with pytest.raises(APIError, match="did not compile within 0.05s") as e:
                await gate.compile(Slow(), GrammarSpec("json_schema", text), 0.05)
            assert e.value.status == 400 and e.value.param == "response_format"
        assert gate.overdue == 2
        with pytest.raises(APIError, match="did not compile within"):
            await gate.compile(Slow(), GrammarSpec("json_schema", "slow-1"), 5)  # remembered
        with pytest.raises(APIError) as e:
            await gate.compile(Slow(), GrammarSpec("json_schema", "fast"), 5)
        assert e.value.status == 503
        release.set()
        for _ in range(100):
            if not gate.overdue:
                break
            await asyncio.sleep(0.02)
        await gate.compile(Slow(), GrammarSpec("json_schema", "fast"), 5)
        return calls

    assert asyncio.run(run()) == ["slow-1", "slow-2", "fast"]
