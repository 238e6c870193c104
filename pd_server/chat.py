"""POST /v1/chat/completions: render, validate, submit, then stream chunks or build one response.

  1. check the model (404), render the conversation (prompts.py), check the prompt and fit
     max_tokens to the context (400), compile the grammar of response_format / a forced
     tool_choice (structured.py; 400 when invalid or too slow), build one Sampling per choice (n).
  2. submit all choices to one rank (dispatcher.py): 503 none live, 429 all full.
  3. streaming: one chunk per token event, each choice's first chunk carries the role;
     tool calls (when tools are in play) come out as tool-call deltas once a call is
     complete; a last chunk per choice carries finish_reason; include_usage adds a usage
     chunk; then [DONE]. A failure after the start is an error event.
  4. non-streaming: collect every choice, parse tool calls, answer with usage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from cluster.protocol.rank_router import TokenEvent
from pd_server import sse
from pd_server.api_models import ChatCompletionRequest
from pd_server.errors import APIError, error_body
from pd_server.prompt_logprobs import check_size, vllm_prompt_logprobs
from pd_server.prompts import RenderedChat
from pd_server.request_state import Handle
from pd_server.responses import (ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatMessageOut, Delta,
                                 FunctionDelta, FunctionOut, ToolCallDelta, ToolCallOut, to_json)
from pd_server.routing import RouteRequest
from pd_server.sampling import check_prompt, fit_max_tokens, make_sampling
from pd_server.serving import Choice, ServerContext, chat_logprobs, collect, new_request_id, route_headers, usage
from pd_server.sse_response import SSEStream
from pd_server.structured import grammar_for
from pd_server.tool_parser import ParsedToolCall, ToolCallParser, parse_tool_calls

JSON = "application/json"


@dataclass
class Submitted:
    """A chat request rendered, checked and submitted: what a handler renders the answer from."""

    chat: RenderedChat
    handle: Handle
    rid: str
    headers: dict[str, str]


async def submit_chat(req: ChatCompletionRequest, ctx: ServerContext, prefix: str = "chatcmpl") -> Submitted:
    """Steps 1-2 for any API that speaks chat (this one, Responses, Messages): raises APIError."""
    arrival = time.perf_counter()
    ctx.check_model(req.model)
    max_len, vocab = ctx.limits()
    chat = await ctx.offload(ctx.renderer.render, req, True,
                             lambda text: ctx.check_prompt_chars(text, max_len, "messages"))
    check_prompt(chat.prompt_ids, max_len, vocab, "messages")
    max_tokens = fit_max_tokens(req.requested_max_tokens, len(chat.prompt_ids), max_len, "max_tokens",
                                ctx.cfg.max_tokens_limit)
    spec = grammar_for(req)
    if spec is not None:
        await ctx.grammar_gate.compile(ctx.grammar_compiler(vocab), spec, ctx.cfg.grammar_timeout_s)
    grammar = spec.as_wire() if spec is not None else None
    check_size(len(chat.prompt_ids), req.prompt_logprobs, "prompt_logprobs")
    # (the answer has one prompt_logprobs: choice 0 computes it)
    work = [(chat.prompt_ids, make_sampling(req, max_tokens, req.num_logprobs, i, vocab, chat.extra_stop, grammar,
                                            req.prompt_logprobs if i == 0 else None))
            for i in range(req.n)]
    first_user = next((m.text for m in req.messages if m.role == "user"), "")
    rid = new_request_id(prefix)
    handle = ctx.dispatcher.submit(rid, work, RouteRequest(chat.prompt_ids, req.n, first_user, req.cache_salt or ""), arrival)
    return Submitted(chat, handle, rid, route_headers(handle, rid, ctx.cfg.cache_usage_details))


async def create_chat_completion(req: ChatCompletionRequest, request: Request, ctx: ServerContext) -> Response:
    sub = await submit_chat(req, ctx)
    chat, handle, rid = sub.chat, sub.handle, sub.rid
    if req.stream:
        return SSEStream(handle, _ChatStream(ctx, req, chat, handle, rid), sub.headers)
    choices = await collect(handle, request.receive, not ctx.cfg.cache_usage_details)

    def build() -> bytes:  # n x max_tokens x top_logprobs entries: request-sized work
        body = ChatCompletion(rid, int(time.time()), ctx.model_name,
                              [_choice(ctx, req, chat, i, c) for i, c in enumerate(choices)], usage(choices))
        if req.return_token_ids:
            body.prompt_token_ids = chat.prompt_ids
        if req.prompt_logprobs is not None:
            body.prompt_logprobs = vllm_prompt_logprobs(ctx.token_text, chat.prompt_ids, choices[0].prompt_logprobs,
                                                        req.prompt_logprobs)
        return to_json(body)

    return Response(await ctx.offload(build), media_type=JSON, headers=sub.headers)


def _choice(ctx: ServerContext, req: ChatCompletionRequest, chat: RenderedChat, i: int, c: Choice) -> ChatChoice:
    text = "".join(c.text)
    reason = c.finish_reason
    msg = ChatMessageOut(text)
    if chat.tool_names is not None:
        content, calls = parse_tool_calls(text, chat.tool_names, chat.forced_prefix)
        if calls:
            msg = ChatMessageOut(content, tool_calls=[ToolCallOut(k.id, FunctionOut(k.name, k.arguments))
                                                      for k in calls])
            reason = "tool_calls"  # as OpenAI and vLLM report it, whatever ended the text
    out = ChatChoice(i, msg, reason, chat_logprobs(ctx, c.logprobs) if req.logprobs else None)
    if req.return_token_ids:
        out.token_ids = c.token_ids
    return out


def _call_deltas(calls: list[ParsedToolCall], first_index: int) -> list[ToolCallDelta]:
    return [ToolCallDelta(first_index + j, k.id, "function", FunctionDelta(k.name, k.arguments))
            for j, k in enumerate(calls)]


class _ChatStream:
    """Renders one chat request's events as SSE chunks (sse_response.StreamRenderer)."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, chat: RenderedChat, handle, rid: str) -> None:
        self.ctx, self.req, self.rid = ctx, req, rid
        self.created, self.model = int(time.time()), ctx.model_name
        n = len(handle.sub_ids)
        self.started = [False] * n
        self.parsers = ([ToolCallParser(chat.tool_names, chat.forced_prefix) for _ in range(n)]
                        if chat.tool_names is not None else None)
        self.choices = [ctx.new_choice() for _ in range(n)]
        # Fast path (content only: no tools, logprobs or token ids): a template per choice index.
        self.plain = self.parsers is None and not req.logprobs and not req.return_token_ids
        self.text_events = sse.TextEvents(
            lambda idx, text: ChatChunk(rid, self.created, self.model, [ChatChunkChoice(idx, Delta(content=text))]))

    def head(self) -> bytes:
        return b""

    def fast(self, idx: int, ev: TokenEvent) -> bytes | None:
        """The event of a content-only token from its template; None off the fast path."""
        if not self.plain or not self.started[idx]:
            return None
        self.choices[idx].count(ev)
        return self.text_events.event(idx, ev.text)

    def render(self, batch) -> bytes:
        out = []
        for idx, ev in batch:
            chunk = self.fast(idx, ev)
            if chunk is None:
                self.choices[idx].count(ev)
                chunk = self._chunk(idx, ev)
            out.append(chunk)
            if ev.finish_reason is not None:
                reason = ev.finish_reason
                if self.parsers is not None and self.parsers[idx].num_calls:
                    reason = "tool_calls"
                out.append(sse.event(ChatChunk(self.rid, self.created, self.model,
                                               [ChatChunkChoice(idx, Delta(), reason)])))
        return b"".join(out)

    def _chunk(self, idx: int, ev: TokenEvent) -> bytes:
        delta = Delta(content=ev.text)
        if not self.started[idx]:
            self.started[idx] = True
            delta.role = "assistant"
        if self.parsers is not None:
            p = self.parsers[idx]
            before = p.num_calls
            text, calls = p.feed_event(ev.text, ev.finish_reason is not None)
            delta.content = text
            if calls:
                delta.tool_calls = _call_deltas(calls, before)
        lp = chat_logprobs(self.ctx, ev.logprobs) if self.req.logprobs and ev.logprobs else None
        choice = ChatChunkChoice(idx, delta, None, lp)
        if self.req.return_token_ids:
            choice.token_ids = ev.token_ids
        return sse.event(ChatChunk(self.rid, self.created, self.model, [choice]))

    def tail(self) -> bytes:
        if not self.req.include_usage:
            return b""
        return sse.event(ChatChunk(self.rid, self.created, self.model, [], usage=usage(self.choices)))

    def error(self, err: APIError) -> bytes:
        return sse.event(error_body(err))
