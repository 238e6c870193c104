"""Tool-call parsing on crafted model outputs; streaming (any split) agrees with whole-text parsing."""
from __future__ import annotations

import json
import random
import zlib

import pytest

from pd_server.tool_parser import ToolCallParser, parse_tool_calls

TOOLS = ["get_weather", "search"]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_single_call_with_content_before():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


def test_hermes_several_calls_and_parameters_key_and_string_arguments():
    text = ('<tool_call>{"name": "search", "parameters": {"q": "a"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    content, calls = parse_tool_calls(text, TOOLS)
    assert content is None
    assert _calls(calls) == [("search", {"q": "a"}), ("get_weather", {"city": "Oslo"})]


def test_unterminated_call_at_the_end_still_parses():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}', TOOLS)
    assert content is None and _calls(calls) == [("search", {"q": "x"})]


def test_missing_closing_brace_is_repaired():
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}\n</tool_call>'
    assert _calls(parse_tool_calls(text, TOOLS)[1]) == [("search", {"q": "x"})]


def test_broken_block_is_content():
    text = "before <tool_call>{not json}</tool_call> after"
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_bare_json_call_object_list_and_fenced():
    assert _calls(parse_tool_calls('{"name": "search", "arguments": {"q": "y"}}', TOOLS)[1]) == [("search", {"q": "y"})]
    text = '[{"name": "search", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert [n for n, _ in _calls(parse_tool_calls(text, TOOLS)[1])] == ["search", "get_weather"]
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n```'
    assert _calls(parse_tool_calls(fenced, TOOLS)[1]) == [("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("text", [
    '{"name": "unknown_tool", "arguments": {}}',  # bare JSON must name a real tool
    '{"answer": 42}',
    "Just text, no calls. a < b and x<tool",
    "",
    "   ",
])
def test_not_calls_stays_content_exactly(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_forced_prefix_is_parsed_first():
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    content, calls = parse_tool_calls('{"city": "Paris"}}\n</tool_call>', TOOLS, prefix)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    'Sure! <tool_call>{"name": "search", "arguments": {"q": "z"}}</tool_call> and <tool_call>{"name": "get_weather",'
    ' "arguments": {"city": "Nice"}}</tool_call>',
    '  {"name": "search", "arguments": {"q": "bare"}}',
    "plain text with a < sign and <tool_ half tag",
    "<tool_call>{broken}</tool_call>tail",
])
def test_streaming_any_split_equals_whole(text):
    whole_content, whole_calls = parse_tool_calls(text, TOOLS)
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(20):
        p = ToolCallParser(TOOLS)
        content, calls, i = "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            c, k = p.feed(text[i:j])
            content, calls, i = content + c, calls + k, j
        c, k = p.finish()
        content, calls = content + c, calls + k
        assert _calls(calls) == _calls(whole_calls)
        assert content == (whole_content or "")


def test_streaming_holds_only_a_possible_tag_and_whitespace():
    p = ToolCallParser(TOOLS)
    assert p.feed("Hello <to") == ("Hello", [])
    assert p.feed("day ") == (" <today", [])
    assert p.finish() == (" ", [])


def test_whitespace_around_calls_is_dropped():
    text = 'Sure! \n<tool_call>{"name": "search", "arguments": {}}</tool_call>\n and then\n'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Sure!and then" and len(calls) == 1
