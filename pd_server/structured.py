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

The router compiles each grammar against its tokenizer (xgrammar caches it by spec, up to
engine.grammar.GRAMMAR_CACHE_BYTES) on one of CompileGate's two threads, within
--grammar-timeout-s: an invalid or unsupported schema, or one too slow to compile, is a 400
naming it before the request is routed, and the gate remembers it (the same spec again is that
400 at once: a slow schema sent over and over cannot keep the threads busy, and no rank ever
compiles a spec the router could not compile in time). xgrammar cannot be interrupted: a
compilation past its timeout runs on to its end on its thread; while every thread holds one, a
new grammar is a 503 (retry later). Ranks compile the same spec again (their own cache) when the
request arrives.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, schema_ebnf, to_grammar
from pd_server.api_models import ChatCompletionRequest, NamedToolChoice
from pd_server.errors import APIError, bad_request

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


class CompileGate:
    """The router's grammar compilations (see the module docstring): `workers` threads, and the
    specs that failed or ran past their timeout (the last `remember` of them). Used from the
    event loop only."""

    def __init__(self, workers: int = 2, remember: int = 4096) -> None:
        self.workers, self.remember = workers, remember
        self._pool: ThreadPoolExecutor | None = None  # started by the first compilation
        self.overdue = 0  # compilations still running past their request's timeout
        self._refused: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    async def compile(self, compiler: GrammarCompiler, spec: GrammarSpec, timeout_s: float) -> None:
        """Compile `spec`; a 400 when it is invalid or takes over timeout_s (or did before), a 503
        while every thread runs a compilation past its timeout."""
        key = (spec.kind, hashlib.sha256(spec.text.encode()).digest())
        param = "response_format" if spec.kind.startswith("json") else "tools"
        if key in self._refused:
            self._refused.move_to_end(key)
            raise bad_request(self._refused[key], param)
        if self.overdue >= self.workers:
            raise APIError(503, "every grammar compiler thread is busy with a schema that ran past "
                                "--grammar-timeout-s; retry later", code="grammar_compiler_busy")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="grammar-compile")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, compiler.compile, spec)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except GrammarError as e:
            raise bad_request(self._refuse(key, str(e)), param) from None
        except TimeoutError:
            self.overdue += 1
            fut.add_done_callback(self._overdue_done)
            raise bad_request(self._refuse(key, f"the {spec.kind} grammar did not compile within {timeout_s:g}s "
                                                "(--grammar-timeout-s); simplify the schema"), param) from None

    def _refuse(self, key: tuple[str, bytes], message: str) -> str:
        self._refused[key] = message
        while len(self._refused) > self.remember:
            self._refused.popitem(last=False)
        return message

    def _overdue_done(self, fut) -> None:
        self.overdue -= 1
        if not fut.cancelled():
            fut.exception()  # (retrieved: a late GrammarError is not "never retrieved")
