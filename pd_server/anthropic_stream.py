"""The Messages API's stream (anthropic_messages.py step 3): Anthropic's events, each framed
`event: <type>\\ndata: <json>\\n\\n` (sse.named_event), no [DONE].

  message_start                  (head: the message, no content, usage.input_tokens the prompt's length)
  per run of text: content_block_start (text ""), one content_block_delta (text_delta) per
                   token, content_block_stop when a tool call or the end closes it
  per tool call (once the parser has it whole, as chat streams calls): content_block_start
                   (tool_use, input {}), one content_block_delta (input_json_delta: the whole
                   input), content_block_stop
  message_delta                  (stop_reason, stop_sequence, usage: the totals, cached tokens
                                  apart, replacing message_start's)
  message_stop
  an error after the start: an `error` event ({"type": "error", "error": {...}}), the last.
Blocks are numbered from 0 in order; a text block opens at the first non-empty text, so an
answer that is only a call has no text block, as in the non-streaming answer. Without tools
a token's delta comes from a template (the per-token fast path, sse_response.py).
"""
from __future__ import annotations

import json

from cluster.protocol.rank_router import TokenEvent
from pd_server import sse
from pd_server.anthropic_models import (ContentBlockDelta, ContentBlockStart, ContentBlockStop, InputJsonDelta,
                                        Message, MessageDelta, MessagesRequest, MessageStart, MessageStop, StopDelta,
                                        TextContent, TextDelta, Usage, message_id, stop_reason, tool_use, usage_of)
from pd_server.errors import APIError, anthropic_error_body
from pd_server.prompts import RenderedChat
from pd_server.serving import ServerContext
from pd_server.tool_parser import ParsedToolCall, ToolCallParser


def _event(payload) -> bytes:
    return sse.named_event(payload.__struct_config__.tag, payload)


class MessagesStream:
    """Renders one Messages request's events (sse_response.StreamRenderer; n is always 1)."""

    done = b""  # message_stop (or error) ends the stream

    def __init__(self, ctx: ServerContext, req: MessagesRequest, chat: RenderedChat, rid: str) -> None:
        self.id, self.model, self.stops = message_id(rid), ctx.model_name, req.stop_sequences
        self.prompt_tokens = len(chat.prompt_ids)
        self.parser = ToolCallParser(chat.tool_names, chat.forced_prefix) if chat.tool_names is not None else None
        self.choice = ctx.new_choice()
        self.blocks = 0  # blocks started so far; the last one is open while text_open
        self.text_open = False
        self.text_events = sse.TextEvents(lambda idx, text: ContentBlockDelta(idx, TextDelta(text)),
                                          "content_block_delta")

    def head(self) -> bytes:
        msg = Message(self.id, "assistant", self.model, [], None, None, Usage(self.prompt_tokens, 0))
        return _event(MessageStart(msg))

    def fast(self, idx: int, ev: TokenEvent) -> bytes | None:
        """A token's text_delta from the template, once the (only) text block is open and no
        tool parser is in play; None otherwise."""
        if self.parser is not None or not self.text_open:
            return None
        self.choice.count(ev)
        return self.text_events.event(self.blocks - 1, ev.text)

    def render(self, batch: list[tuple[int, TokenEvent]]) -> bytes:
        out = []
        for idx, ev in batch:
            chunk = self.fast(idx, ev)
            if chunk is None:
                self.choice.count(ev)
                chunk = self._blocks(ev)
            out.append(chunk)
            if ev.finish_reason is not None:
                out.append(self._finish(ev))
        return b"".join(out)

    def _blocks(self, ev: TokenEvent) -> bytes:
        text, calls = ev.text, []
        if self.parser is not None:
            text, calls = self.parser.feed_event(ev.text, ev.finish_reason is not None)
        out = []
        if text:
            if not self.text_open:
                out.append(self._start(TextContent("")))
                self.text_open = True
            out.append(self.text_events.event(self.blocks - 1, text))
        for call in calls:
            out.append(self._close())
            out.append(self._tool_use(call))
        return b"".join(out)

    def _start(self, block) -> bytes:
        self.blocks += 1
        return _event(ContentBlockStart(self.blocks - 1, block))

    def _close(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        return _event(ContentBlockStop(self.blocks - 1))

    def _tool_use(self, call: ParsedToolCall) -> bytes:
        block = tool_use(call)
        start = self._start(type(block)(block.id, block.name, {}))
        delta = ContentBlockDelta(self.blocks - 1, InputJsonDelta(json.dumps(block.input, ensure_ascii=False)))
        return start + _event(delta) + _event(ContentBlockStop(self.blocks - 1))

    def _finish(self, ev: TokenEvent) -> bytes:
        has_calls = self.parser is not None and self.parser.num_calls > 0
        reason, seq = stop_reason(ev.finish_reason, ev.stop_str, self.stops, has_calls)
        return (self._close() + _event(MessageDelta(StopDelta(reason, seq), usage_of(self.choice)))
                + _event(MessageStop()))

    def tail(self) -> bytes:
        return b""

    def error(self, err: APIError) -> bytes:
        return _event(anthropic_error_body(err))
