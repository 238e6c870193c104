"""The Responses API's stream (openai_responses.py step 3): typed events, `event: <type>` framing.

  response.created, response.in_progress       (head: the response, status in_progress)
  per text: response.output_item.added (message) + response.content_part.added on the first
            text, then response.output_text.delta per token
  per tool call (once the parser has it whole, as chat streams them): the open message closes
            (response.output_text.done, response.content_part.done, response.output_item.done),
            then response.output_item.added (function_call, arguments ""),
            response.function_call_arguments.delta / .done, response.output_item.done
  response.completed or response.incomplete    (tail: the whole response with usage)
  an error after the start: an `error` event. No [DONE]: the last event ends the stream.
Every event carries a sequence_number, counting from 0.
"""
from __future__ import annotations

import time

import msgspec

from cluster.protocol.rank_router import TokenEvent
from pd_server.errors import APIError
from pd_server.openai_responses import (ResponsesRequest, call_item, message_item, new_id, response_object,
                                        usage_of)
from pd_server.prompts import RenderedChat
from pd_server.serving import ServerContext
from pd_server.tool_parser import ParsedToolCall, ToolCallParser

_encode = msgspec.json.Encoder().encode


class ResponsesStream:
    done = b""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, chat: RenderedChat, rid: str,
                 keep=None) -> None:
        self.req, self.rid, self.model = req, rid, ctx.model_name
        self.keep = keep  # called with the finished response (the store)
        self.created = time.time()
        self.parser = ToolCallParser(chat.tool_names, chat.forced_prefix) if chat.tool_names is not None else None
        self.choice = ctx.new_choice()
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.msg_id: str | None = None  # the open message item
        self.text: list[str] = []
        self.calls = 0

    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def head(self) -> bytes:
        r = response_object(self.rid, self.created, self.model, self.req, [], "in_progress")
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def fast(self, idx: int, ev: TokenEvent) -> bytes | None:
        return None

    def render(self, batch: list[tuple[int, TokenEvent]]) -> bytes:
        out = []
        for _, ev in batch:
            self.choice.add(ev)
            text, calls = ev.text, []
            if self.parser is not None:
                text, calls = self.parser.feed_event(ev.text, ev.finish_reason is not None)
            if text:
                out.append(self._text(text))
            if calls or ev.finish_reason is not None:
                out.append(self._close_message())
            for call in calls:
                out.append(self._call(call))
        return b"".join(out)

    def _text(self, text: str) -> bytes:
        head = b""
        if self.msg_id is None:
            self.msg_id = new_id("msg")
            idx = len(self.output)
            head = (self._event("response.output_item.added", output_index=idx,
                                item=message_item(self.msg_id, "", "in_progress"))
                    + self._event("response.content_part.added", item_id=self.msg_id, output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text.append(text)
        return head + self._event("response.output_text.delta", item_id=self.msg_id, output_index=len(self.output),
                                  content_index=0, delta=text, logprobs=[])

    def _close_message(self) -> bytes:
        if self.msg_id is None:
            return b""
        idx, text, item = len(self.output), "".join(self.text), message_item(self.msg_id, "".join(self.text))
        out = (self._event("response.output_text.done", item_id=self.msg_id, output_index=idx, content_index=0,
                           text=text, logprobs=[])
               + self._event("response.content_part.done", item_id=self.msg_id, output_index=idx, content_index=0,
                             part=item["content"][0])
               + self._event("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        self.msg_id, self.text = None, []
        return out

    def _call(self, call: ParsedToolCall) -> bytes:
        idx, item = len(self.output), call_item(call)
        self.calls += 1
        out = (self._event("response.output_item.added", output_index=idx,
                           item=call_item(call, "in_progress", arguments=""))
               + self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                             delta=call.arguments)
               + self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             name=call.name, arguments=call.arguments)
               + self._event("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        return out

    def tail(self) -> bytes:
        c = self.choice
        status = "incomplete" if c.finish_reason == "length" and not self.calls else "completed"
        r = response_object(self.rid, self.created, self.model, self.req, self.output, status, usage_of(c))
        if self.keep is not None:
            self.keep(r)
        return self._event(f"response.{status}", response=r)

    def error(self, err: APIError) -> bytes:
        return self._event("error", code=str(err.status), message=err.message, param=err.param)
