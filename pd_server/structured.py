"""Structured outputs: a chat request's response_format and forced tool_choice -> the grammar its
choices decode under (engine/grammar.py), checked and compiled here before any rank sees it.

  * response_format json_object: any JSON object; json_schema: JSON valid against
    `json_schema.schema` (xgrammar's strict mode: properties the schema does not list are not
    generated, so the output validates whether `strict` is set or not).
  * tool_choice named: the prompt ends with `<tool_call>\\n{"name": "f", "arguments": `
    (prompts.py); the grammar takes the arguments (valid against f's parameters) and the
    closing `}\\n</tool_call>`, which is a stop string too.
  * tool_choice "required": the prompt ends with `<tool_call>\\n`; the grammar takes one call
    `{"name": <one of the tools>, "arguments": <valid against its parameters>}` and its
    `\\n</tool_call>`, then (unless parallel_tool_calls is false) more such blocks, then the end.
A forced tool_choice wins over response_format (the output is a call, not a message). The
text the grammar makes is what tool_parser.py reads back, so streaming and non-streaming
responses carry the same calls, with finish_reason "tool_calls".

The router compiles each grammar against its tokenizer (xgrammar caches it by spec) in a worker
thread, within --grammar-timeout-s: an invalid or unsupported schema, or one too slow to
compile, is a 400 naming it before the request is routed. Ranks compile the same spec again
(their own cache) when the request arrives.
"""
from __future__ import annotations

import asyncio
import json

from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, schema_ebnf, to_grammar
from pd_server.api_models import ChatCompletionRequest, NamedToolChoice
from pd_server.errors import bad_request

_ANY_OBJECT = {"type": "object"}
CLOSE = "\\n</tool_call>"  # EBNF string literal text


def grammar_for(req: ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar `req`'s output must follow; None for free text. Raises a 400 naming the
    field whose schema is invalid or unsupported."""
    tools = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools or ()}
    choice = req.tool_choice
    try:
        if isinstance(choice, NamedToolChoice):
            args = schema_ebnf(tools[choice.function.name], "tool_args")
            return GrammarSpec("ebnf", f'{args}\nroot ::= tool_args "}}{CLOSE}"\n')
        if choice == "required" and tools:
            one = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                              "required": ["name", "arguments"], "additionalProperties": False}
                             for name, params in tools.items()]}
            call = schema_ebnf(one, "tool_call_json")
            more = "" if req.parallel_tool_calls is False else f' ("\\n<tool_call>\\n" tool_call_json "{CLOSE}")*'
            return GrammarSpec("ebnf", f'{call}\nroot ::= tool_call_json "{CLOSE}"{more}\n')
    except GrammarError as e:
        raise bad_request(f"tools: {e}", "tools") from None
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    js = fmt.json_schema or {}
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                          "response_format")
    spec = GrammarSpec("json_schema", json.dumps(schema))
    try:
        to_grammar(spec)  # names the problem of an invalid or unsupported schema
    except GrammarError as e:
        raise bad_request(f"response_format: {e}", "response_format") from None
    return spec


async def compile_in_time(compiler: GrammarCompiler, spec: GrammarSpec, timeout_s: float) -> None:
    """Compile `spec` in a worker thread; a 400 when it is invalid or takes over timeout_s (the
    thread runs on to its end: xgrammar cannot be interrupted)."""
    try:
        await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec), timeout_s)
    except GrammarError as e:
        raise bad_request(str(e), "response_format" if spec.kind.startswith("json") else "tools") from None
    except TimeoutError:
        raise bad_request(f"the {spec.kind} grammar did not compile within {timeout_s:g}s "
                          "(--grammar-timeout-s); simplify the schema") from None
