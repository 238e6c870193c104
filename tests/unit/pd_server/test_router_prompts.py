"""Chat rendering: messages, tools (template-aware or Hermes prompt), hints, fallback template.

A stub tokenizer renders with jinja2 and maps characters to ids, so the tests read the
prompt text back exactly and run without model files.
"""
from __future__ import annotations

from types import SimpleNamespace

import jinja2
import pytest

from pd_server.api_models import ChatCompletionRequest
from pd_server.errors import APIError
from pd_server.prompts import FALLBACK_STOP, ChatRenderer

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL_AWARE = ("{% if tools %}TOOLS={{ tools | length }}\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
              "{{ m['content'] }}{% if m.tool_calls %}CALLS={{ m.tool_calls[0].function.name }}"
              "({{ m.tool_calls[0].function.arguments.city }}){% endif %}\n{% endfor %}<|assistant|>")
STRICT = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('no leading assistant') }}{% endif %}x"
BOS = 1


class StubTokenizer:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template
        self._env = jinja2.Environment()

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        self._env.globals["raise_exception"] = raise_exception

    def apply_chat_template(self, messages, *, add_generation_prompt, tokenize, chat_template=None, tools=None):
        assert not tokenize
        return self._env.from_string(chat_template or self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return SimpleNamespace(input_ids=([BOS] if add_special_tokens else []) + [ord(c) for c in text])

    def get_vocab(self) -> dict[str, int]:  # a token per character
        return {chr(i): i for i in range(32, 127)}


def text_of(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != BOS)


def render(template, **req):
    return ChatRenderer(StubTokenizer(template)).render(ChatCompletionRequest(**req))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_plain_chat_parts_and_developer_role():
    out = render(CHATML, messages=[{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}])
    assert text_of(out.prompt_ids) == "<|system|>be brief\n<|user|>a\nb\n<|assistant|>"
    assert out.prompt_ids[0] != BOS  # the template wrote any special tokens itself
    assert out.tool_names is None and out.forced_prefix == "" and out.extra_stop == ()


def test_tools_without_template_support_use_the_hermes_prompt():
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = render(CHATML, messages=messages, tools=[WEATHER])
    text = text_of(out.prompt_ids)
    assert text.startswith("<|system|>sys\n\n# Tools") and '"name": "get_weather"' in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|user|><tool_response>\nsunny\n</tool_response>" in text
    assert out.tool_names == ["get_weather"]


def test_tools_with_template_support_go_through_the_template():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    text = text_of(render(TOOL_AWARE, messages=messages, tools=[WEATHER]).prompt_ids)
    assert text.startswith("TOOLS=1\n") and "CALLS=get_weather(Oslo)" in text and "<|tool|>rain" in text
    assert "# Tools" not in text


def test_tool_choice_none_hides_tools_and_named_forces_the_call():
    msgs = [{"role": "user", "content": "hi"}]
    out = render(CHATML, messages=msgs, tools=[WEATHER], tool_choice="none")
    assert "# Tools" not in text_of(out.prompt_ids) and out.tool_names is None
    out = render(CHATML, messages=msgs, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = text_of(out.prompt_ids)
    assert "You must call the function get_weather." in text
    assert text.endswith('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": ')
    assert out.forced_prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert out.extra_stop == ("</tool_call>",)
    out = render(CHATML, messages=msgs, tools=[WEATHER], tool_choice="required")
    assert out.forced_prefix == "<tool_call>\n" and out.extra_stop == ()


def test_response_format_hint_joins_the_system_message():
    out = render(CHATML, messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    assert text_of(out.prompt_ids).startswith("<|system|>Respond with a single valid JSON object")
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    out = render(CHATML, messages=[{"role": "user", "content": "hi"}], response_format=schema)
    assert '{"type": "object"}' in text_of(out.prompt_ids)


def test_base_model_uses_the_fallback_template_with_bos_and_a_stop():
    out = render(None, messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert out.prompt_ids[0] == BOS
    assert text_of(out.prompt_ids) == "S\n\nUser: hi\nAssistant:"
    assert out.extra_stop == FALLBACK_STOP


def test_template_errors_are_400():
    with pytest.raises(APIError) as e:
        render(STRICT, messages=[{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and "no leading assistant" in e.value.message
