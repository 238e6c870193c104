"""Chat messages (+ tools, response_format) -> prompt token ids, through the model's own template.

  1. Messages become the plain dicts chat templates expect: text parts joined, the
     assistant's earlier tool calls and the tool results kept.
  2. With tools in play (tool_choice is not "none"): a template that knows tools gets
     `tools=`; one that does not (SmolLM2's) gets the Hermes tool prompt in the system
     message, earlier calls as `<tool_call>` text and results as `<tool_response>` user
     turns, the form tool_parser.py reads back.
  3. Prompt-level hints: response_format json_object/json_schema, tool_choice required or
     named. A forced tool choice also starts the assistant turn with the call's opening
     (`<tool_call>\\n{"name": "f", "arguments": `), which even a small model then completes;
     the parser is fed that prefix first. A named choice stops at `</tool_call>`.
  4. apply_chat_template(add_generation_prompt=True, tokenize=False), then tokenize without
     adding special tokens (the template wrote them). A model without a template (Gemma 3
     270M is a base model) uses FALLBACK_TEMPLATE, tokenized with its BOS, and stops at the
     next "\\nUser:".
"""
from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass

from pd_server.api_models import ChatCompletionRequest, NamedToolChoice
from pd_server.errors import bad_request

FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP = ("\nUser:",)

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class RenderedChat:
    prompt_ids: list[int]
    tool_names: list[str] | None  # parse tool calls from the output when not None
    forced_prefix: str  # text the prompt put at the start of the assistant turn
    extra_stop: tuple[str, ...]


class ChatRenderer:
    def __init__(self, tokenizer) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self.template = getattr(tokenizer, "chat_template", None)
        self.fallback = not self.template
        self.knows_tools = bool(self.template) and "tools" in self.template

    @property
    def tokenizer(self):
        """This thread's copy of the tokenizer. A Hugging Face fast tokenizer is one PyO3 object
        whose encode takes a mutable borrow: two threads using one at once raise "Already
        borrowed" (vLLM #40949). The event loop and each request-work thread keep their own
        (a deep copy made on the thread's first use; the original is only ever copied)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._base)
        return tok

    def render(self, req: ChatCompletionRequest, add_generation_prompt: bool = True,
               check_text=None) -> RenderedChat:
        """Raises a 400 when the template rejects the conversation. `add_generation_prompt`
        False (/tokenize) ends the text after the last message. `check_text(text)`, when given,
        sees the rendered text before it is tokenized (and raises to refuse it). Request-sized
        work: run it off the event loop (ServerContext.offload)."""
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = list(req.tools or ()) if use_tools else []
        choice = req.tool_choice
        hints, prefix, stop = [], "", ()
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            hints.append(f"You must call the function {name}.")
            prefix = '<tool_call>\n{"name": "' + name + '", "arguments": '
            stop = ("</tool_call>",)  # one call is what was asked for: stop right after it
        elif use_tools and choice == "required":
            hints.append("You must call at least one of the functions.")
            prefix = "<tool_call>\n"
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            hints.append("Respond with a single valid JSON object and nothing else.")
        elif fmt is not None and fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema", fmt.json_schema)
            hints.append("Respond with a single valid JSON object that conforms to this JSON schema, and "
                         f"nothing else:\n{json.dumps(schema)}")
        messages = self._messages(req, tools, hints)
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools and self.knows_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                **({"chat_template": FALLBACK_TEMPLATE} if self.fallback else {}), **kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja2 errors, raise_exception)
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        text += prefix
        if check_text is not None:
            check_text(text)
        ids = self.tokenizer(text, add_special_tokens=self.fallback).input_ids
        return RenderedChat(list(ids), [t.function.name for t in tools] if tools else None, prefix,
                            stop + (FALLBACK_STOP if self.fallback else ()))

    def _messages(self, req: ChatCompletionRequest, tools, hints: list[str]) -> list[dict]:
        native = self.knows_tools
        out: list[dict] = []
        for m in req.messages:
            role = "system" if m.role == "developer" else m.role
            d: dict = {"role": role, "content": m.text}
            if m.role == "assistant" and m.tool_calls:
                calls = [{"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}
                         for c in m.tool_calls]
                if native:
                    d["tool_calls"] = [{"type": "function", "id": c.id, "function": f}
                                       for c, f in zip(m.tool_calls, calls)]
                else:
                    d["content"] = (m.text + "\n" if m.text else "") + "\n".join(
                        f"<tool_call>\n{json.dumps(f, ensure_ascii=False)}\n</tool_call>" for f in calls)
            elif m.role == "tool":
                if native:
                    d["tool_call_id"] = m.tool_call_id
                else:
                    d = {"role": "user", "content": f"<tool_response>\n{m.text}\n</tool_response>"}
            if m.name and m.role != "tool":
                d["name"] = m.name
            out.append(d)
        system = []
        if tools and not native:
            system.append(HERMES_TOOLS_PROMPT.format(
                tools="\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)))
        system += hints
        if system:
            extra = "\n\n".join(system)
            if out and out[0]["role"] == "system":
                out[0]["content"] = (out[0]["content"] + "\n\n" + extra) if out[0]["content"] else extra
            else:
                out.insert(0, {"role": "system", "content": extra})
        return out


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
