"""POST /v1/responses: the OpenAI Responses API, served as a chat completion underneath.

  1. The request (input items, instructions, tools, tool_choice, text.format,
     max_output_tokens) becomes a ChatCompletionRequest (`to_chat`): instructions and
     system/developer items -> system messages; message items -> messages (input_text /
     output_text parts joined); a function_call item -> an assistant message's tool call
     (consecutive calls join one message); a function_call_output item -> a tool message,
     which must answer an earlier call; reasoning items are skipped. Images, files and hosted
     tools (web_search, ...) are 400s naming the item. With previous_response_id the stored
     chain's input and output items come first (`with_previous`, response_store.py; an unknown
     or expired id is a 404).
  2. chat.submit_chat renders, checks, compiles any grammar (text.format json_schema /
     json_object, tool_choice required or named: structured.py) and submits it: the same
     routing, limits, API key and metrics as chat completions, in PD and colocated mode.
  3. The output: a message item with one output_text part (when there is text) and a
     function_call item per tool call (tool_parser.py reads them from the text, as chat does);
     status "incomplete" with reason max_output_tokens when the length ran out. Streaming
     (openai_responses_stream.py) sends response.created ... response.output_text.delta ...
     response.completed, with the same items. With `store` (default true) the finished
     response is kept (response_store.py) for GET /v1/responses/{id} and later turns.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec
from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from engine.sampling_params import MAX_CACHE_SALT
from pd_server.api_models import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, NamedToolChoice,
                                  ResponseFormat, Tool, ToolCall, ToolChoiceFunction, _Model)
from pd_server.chat import submit_chat
from pd_server.errors import APIError, bad_request
from pd_server.security import tenant
from pd_server.serving import Choice, ServerContext, collect
from pd_server.sse_response import SSEStream
from pd_server.tool_parser import ParsedToolCall, parse_tool_calls

JSON = "application/json"


# ---- request -----------------------------------------------------------------------------------
class ContentPart(_Model):
    type: str  # input_text / output_text / text; anything else is refused in to_chat
    text: str | None = None


class InputItem(_Model):
    """One input item: a message ({role, content}, type "message" or none), a function_call,
    a function_call_output or a reasoning item. Checked per type in to_chat."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class ResponsesTool(_Model):
    type: str
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(_Model):
    type: str
    name: str | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)  # (vLLM's extension)
    user: str | None = None


def _part_text(parts: str | list[ContentPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    out = []
    for j, p in enumerate(parts):
        if p.type not in ("input_text", "output_text", "text") or p.text is None:
            raise bad_request(f"{where}.content[{j}]: {p.type} parts are not supported (text only)", "input")
        out.append(p.text)
    return "\n".join(out)


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function" or not t.name:
            raise bad_request(f"tools[{i}]: only function tools (with a name) are supported, got {t.type!r}", "tools")
        out.append(Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                              parameters=t.parameters, strict=t.strict)))
    return out


def own_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as stored items."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [it.model_dump(exclude_none=True) for it in req.input]


def with_previous(req: ResponsesRequest, store, owner: str = "") -> tuple[ResponsesRequest, list[dict]]:
    """(the request with the conversation so far in its input, that conversation's items): with
    previous_response_id, the stored chain's input items and the previous response's output items
    before the request's own (its instructions are not carried, as OpenAI defines). Raises a 404
    for an id the store does not hold for `owner` (unknown, another tenant's, deleted, evicted or
    expired)."""
    items = own_items(req)
    if req.previous_response_id is None:
        return req, items
    prev = store.get(req.previous_response_id, owner)
    if prev is None:
        raise APIError(404, f"Previous response with id {req.previous_response_id!r} not found.",
                       param="previous_response_id")
    items = [*prev.input_items, *prev.response["output"], *items]
    return req.model_copy(update={"input": [InputItem.model_validate(it) for it in items]}), items


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `req` stands for (step 1). Raises a 400 naming what is unsupported."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    calls: set[str] = set()
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if it.type == "message":
            if it.role is None:
                raise bad_request(f"{where}: a message needs a role", "input")
            messages.append(ChatMessage(role=it.role, content=_part_text(it.content, where)))
        elif it.type == "function_call":
            if not (it.call_id and it.name and it.arguments is not None):
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments", "input")
            call = ToolCall(id=it.call_id, function=FunctionCall(name=it.name, arguments=it.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            calls.add(it.call_id)
        elif it.type == "function_call_output":
            if it.call_id not in calls:
                raise bad_request(f"{where}: function_call_output {it.call_id!r} answers no earlier function_call",
                                  "input")
            messages.append(ChatMessage(role="tool", tool_call_id=it.call_id, content=_part_text(it.output, where)))
        elif it.type != "reasoning":
            raise bad_request(f"{where}: {it.type} items are not supported", "input")
    if not any(m.role != "system" for m in messages):
        raise bad_request("input holds no message", "input")
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        if choice.type != "function" or not choice.name:
            raise bad_request(f"tool_choice {choice.type!r} is not supported (auto, none, required, or a "
                              "function by name)", "tool_choice")
        choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
    fmt = req.text.format if req.text and req.text.format else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        response_format = ResponseFormat(type=fmt.type, json_schema=schema if fmt.type == "json_schema" else None)
    try:
        return ChatCompletionRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                     temperature=req.temperature, top_p=req.top_p, tools=_tools(req),
                                     tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
                                     response_format=response_format, stream=req.stream,
                                     cache_salt=req.cache_salt)
    except ValidationError as e:  # the chat model's own checks (a named tool that is not in tools, ...)
        raise bad_request(e.errors()[0]["msg"].removeprefix("Value error, "), "tool_choice") from None


# ---- response ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def call_item(call: ParsedToolCall, status: str = "completed", arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


def usage_of(c: Choice) -> dict:
    return {"input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def response_object(rid: str, created: float, model: str, req: ResponsesRequest, output: list[dict],
                    status: str = "completed", usage: dict | None = None) -> dict:
    """The Response object (status in_progress / completed / incomplete)."""
    fmt = req.text.format if req.text and req.text.format else TextFormat()
    choice = req.tool_choice.model_dump(exclude_none=True) if isinstance(req.tool_choice, FunctionChoice) \
        else (req.tool_choice or "auto")
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True)},
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "truncation": "disabled",
            "metadata": req.metadata or {}, "usage": usage}


async def create_response(req: ResponsesRequest, chat_req: ChatCompletionRequest, request: Request,
                          ctx: ServerContext, items: list[dict]) -> Response:
    """Steps 2-3 for `req`, whose to_chat() is `chat_req` (checked against the limits by the app);
    `items`: the conversation's input items (with_previous), stored with the response."""
    from pd_server.openai_responses_stream import ResponsesStream  # (it imports this module)

    sub = await submit_chat(chat_req, ctx, prefix="resp")
    rid = sub.rid.replace("resp-", "resp_", 1)

    def keep(body: dict) -> None:
        if req.store is not False:
            ctx.responses.put(rid, body, items, tenant(request))

    if req.stream:
        return SSEStream(sub.handle, ResponsesStream(ctx, req, sub.chat, rid, keep), sub.headers)
    created = time.time()
    c = (await collect(sub.handle, request.receive, not ctx.cfg.cache_usage_details))[0]
    text = "".join(c.text)
    calls: list[ParsedToolCall] = []
    if sub.chat.tool_names is not None:
        content, calls = parse_tool_calls(text, sub.chat.tool_names, sub.chat.forced_prefix)
        text = content or ""
    output = ([message_item(new_id("msg"), text)] if text else []) + [call_item(k) for k in calls]
    status = "incomplete" if c.finish_reason == "length" and not calls else "completed"
    body = response_object(rid, created, ctx.model_name, req, output, status, usage_of(c))
    keep(body)
    return Response(msgspec.json.encode(body), media_type=JSON, headers=sub.headers)
