"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, served as chat.

  1. translate (to_chat): `system` becomes the first message; a user turn's text blocks a user
     message and each tool_result block a `tool` message (its tool_use_id must name a tool_use
     block of an earlier assistant turn: 400 otherwise); an assistant turn's text one message
     with its tool_use blocks as tool_calls; tools and tool_choice map to OpenAI's
     (auto -> "auto", any -> "required", tool -> named, none -> "none",
     disable_parallel_tool_use -> parallel_tool_calls false); stop_sequences -> stop;
     max_tokens, temperature, top_p and top_k as they are. app.py then checks chat's limits.
  2. submit as a chat completion (chat.submit_chat: model 404, render, context 400, the
     grammar of a forced tool choice, dispatch 503/429).
  3. streaming: anthropic_stream.py (message_start ... message_stop).
  4. non-streaming: collect the one choice, parse tool calls as chat does, answer a Message:
     a text block (when there is text) then one tool_use block per call.
stop_reason: "tool_use" when the answer holds calls, "max_tokens" at the length limit,
"stop_sequence" (with the string) when one of the request's stop_sequences ended it, else
"end_turn" (eos, or a stop string of the template's own). usage: Anthropic counts
input_tokens apart from cache_read_input_tokens (the prompt tokens the ranks served from a
prefix cache), so the prompt is their sum. Errors come in Anthropic's shape (errors.py,
app.py). The id is "msg_<hex>" for the request id "msg-<hex>" (the x-request-id header).
"""
from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pd_server.anthropic_models import (CountTokens, CountTokensRequest, Message, MessagesRequest, TextBlock,
                                        TextContent, ToolResultBlock, ToolUseBlock, message_id, stop_reason,
                                        tool_use, usage_of)
from pd_server.anthropic_stream import MessagesStream
from pd_server.api_models import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, NamedToolChoice,
                                  TextPart, Tool, ToolCall, ToolChoiceFunction)
from pd_server.chat import submit_chat
from pd_server.errors import bad_request
from pd_server.limits import check_chat
from pd_server.responses import to_json
from pd_server.serving import ServerContext, collect
from pd_server.sse_response import SSEStream
from pd_server.tool_parser import parse_tool_calls

JSON = "application/json"
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """Step 1. Raises a 400 naming the block for a tool_result without its tool_use."""
    messages = [ChatMessage(role="system", content=req.system_text)] if req.system else []
    tool_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
        elif m.role == "assistant":
            text = [TextPart(type="text", text=b.text) for b in m.content if isinstance(b, TextBlock)]
            calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in m.content if isinstance(b, ToolUseBlock)]
            tool_ids.update(c.id for c in calls)
            messages.append(ChatMessage(role="assistant", content=text or None, tool_calls=calls or None))
        else:
            messages += _user_turn(m.content, tool_ids, f"messages.{i}.content")
    fields: dict = {"model": req.model, "messages": messages}
    if req.tools:
        fields["tools"] = [Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                                      parameters=t.input_schema))
                           for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        fields["tool_choice"] = (NamedToolChoice(type="function", function=ToolChoiceFunction(name=c.name))
                                 if c.type == "tool" else _CHOICES[c.type])
        if c.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, cache_salt=req.cache_salt)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:  # NOTE: the checks above leave none expected; a 400 all the same
        raise bad_request(f"the request does not translate to a chat request: {e.errors()[0]['msg']}") from None


def _user_turn(blocks: list, tool_ids: set[str], where: str) -> list[ChatMessage]:
    """A user turn's blocks in order: each run of text blocks one user message, each tool_result a tool message."""
    out: list[ChatMessage] = []
    text: list[TextPart] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(TextPart(type="text", text=b.text))
            continue
        assert isinstance(b, ToolResultBlock)  # InputMessage allows no other block in a user turn
        if b.tool_use_id not in tool_ids:
            raise bad_request(f"{where}.{j}: tool_result block with tool_use_id {b.tool_use_id!r} matches no "
                              "tool_use block of an earlier assistant turn", f"{where}.{j}.tool_use_id")
        if text:
            out.append(ChatMessage(role="user", content=text))
            text = []
        out.append(ChatMessage(role="tool", content=b.text, tool_call_id=b.tool_use_id))
    if text or not out:
        out.append(ChatMessage(role="user", content=text))
    return out


async def create_message(req: MessagesRequest, chat_req: ChatCompletionRequest, request: Request,
                         ctx: ServerContext) -> Response:
    """Steps 2-4 for a request translated (to_chat) and checked (limits.check_chat)."""
    sub = await submit_chat(chat_req, ctx, prefix="msg")
    if req.stream:
        return SSEStream(sub.handle, MessagesStream(ctx, req, sub.chat, sub.rid), sub.headers)
    c = (await collect(sub.handle, request.receive, not ctx.cfg.cache_usage_details))[0]
    text, calls = "".join(c.text), []
    if sub.chat.tool_names is not None:
        content, calls = parse_tool_calls(text, sub.chat.tool_names, sub.chat.forced_prefix)
        text = content or ""
    blocks = ([TextContent(text)] if text else []) + [tool_use(k) for k in calls]
    reason, seq = stop_reason(c.finish_reason, c.stop_str, req.stop_sequences, bool(calls))
    body = Message(message_id(sub.rid), "assistant", ctx.model_name, blocks, reason, seq, usage_of(c))
    return Response(to_json(body), media_type=JSON, headers=sub.headers)


def count_tokens(req: CountTokensRequest, ctx: ServerContext) -> CountTokens:
    """The prompt a Messages request of this conversation would prefill, counted on the router's
    tokenizer (no rank). Raises APIError (404 model, 400 limits or template)."""
    ctx.check_model(req.model)
    chat_req = to_chat(req)
    check_chat(chat_req, ctx.cfg)
    max_len = ctx.registry.max_model_len
    return CountTokens(len(ctx.renderer.render(
        chat_req, True, lambda text: ctx.check_prompt_chars(text, max_len, "messages")).prompt_ids))
