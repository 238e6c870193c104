"""Anthropic's Messages API shapes: request bodies (pydantic) and response bodies and stream
events (msgspec), field names and nesting as in Anthropic's API reference.

Requests: what a text-and-tools model can serve. Content blocks are text, tool_use (assistant
turns) and tool_result (user turns); thinking blocks an earlier answer may carry are accepted
in assistant turns and dropped (this server never makes them). Any other block (image,
document, ...) and server tools (a `type` other than "custom") are a 400 naming them. The
union fields are Anthropic's own (`system` and `content`: a string or a list of blocks).
Unknown fields (metadata, cache_control, thinking, service_tier, ...) are ignored.
Translation to a chat completion request: anthropic_messages.py.

Responses: a Message (content: text and tool_use blocks) and the stream's events, each a
msgspec Struct tagged with its `type`; the helpers at the end turn a finished choice into
them (stop_reason, tool_use blocks, usage), for both the whole answer and the stream.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import MAX_CACHE_SALT
from pd_server.api_models import check_encodable
from pd_server.serving import Choice
from pd_server.tool_parser import ParsedToolCall

_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests -------------------------------------------------------------------------------------
class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict = Field(default_factory=dict)


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False  # accepted; the model sees the content only

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            _refuse_blocks(data["content"], ("text",), "content")
        return data

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(_Model):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


def _refuse_blocks(blocks: list, allowed: tuple[str, ...], where: str) -> None:
    """A clear 400 for a block this server cannot take (rather than pydantic's union error)."""
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise ValueError(f"{where}.{j}: {kind!r} blocks are not supported here "
                             f"(this server takes {', '.join(allowed)} blocks)")


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, data):
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            _refuse_blocks(data["content"], _BLOCKS.get(data.get("role"), ("text",)), "content")
        return data


class ToolDef(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data):
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"server tools ({data['type']!r}) are not supported; define the tool with an "
                             "input_schema")
        return data


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name goes with type "tool", and only with it')
        return self


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens; also the conversation fields of a MessagesRequest."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data):
        return check_encodable(data)

    @model_validator(mode="after")
    def _check_tools(self):
        choice, names = self.tool_choice, [t.name for t in self.tools or ()]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f'tool_choice {choice.type!r} needs tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return self

    @property
    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, lt=2**31)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)  # (as chat takes it)

    @model_validator(mode="after")
    def _check_stops(self):
        if any(not s for s in self.stop_sequences or ()):
            raise ValueError("stop_sequences must be non-empty strings")
        return self


# ---- responses and stream events ------------------------------------------------------------------
class Usage(msgspec.Struct):
    input_tokens: int  # the prompt tokens not read from a cache (Anthropic's sense)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextContent(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseContent(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict


class Message(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    role: str
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokens(msgspec.Struct):
    input_tokens: int


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: TextContent | ToolUseContent


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: Usage  # totals: they replace message_start's


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


# ---- a finished choice in these shapes ----------------------------------------------------------
def stop_reason(finish_reason: str | None, stop_str: str | None, stop_sequences: list[str] | None,
                has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer that ended with the engine's finish_reason: see
    anthropic_messages.py. Only the request's own stop_sequences make "stop_sequence"."""
    if has_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and stop_str is not None and stop_str in (stop_sequences or ()):
        return "stop_sequence", stop_str
    return "end_turn", None


def message_id(rid: str) -> str:
    return "msg_" + rid.removeprefix("msg-")


def tool_use(call: ParsedToolCall) -> ToolUseContent:
    """A parsed call as a tool_use block: the id "toolu_..." and the arguments as an object
    (a call whose arguments are JSON but not an object gets them as {"arguments": value})."""
    args = json.loads(call.arguments)
    return ToolUseContent("toolu_" + call.id.removeprefix("call_"), call.name,
                          args if isinstance(args, dict) else {"arguments": args})


def usage_of(c: Choice) -> Usage:
    return Usage(c.prompt_tokens - c.cached_tokens, c.completion_tokens, 0, c.cached_tokens)
