"""OpenAI response bodies and stream chunks as msgspec Structs (encoded straight to JSON).

Field names and nesting follow OpenAI's API reference. Fields carry null as OpenAI does,
except those defaulting to UNSET, which appear only when set (`usage` on the last chunk,
vLLM's `token_ids` / `prompt_token_ids` extension when asked for), and the delta structs
(omit_defaults: a delta carries only what it has).
"""
from __future__ import annotations

import msgspec

to_json = msgspec.json.Encoder().encode


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


# ---- logprobs -----------------------------------------------------------------------------------
class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[LogprobEntry]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's prompt_logprobs entry: {token id: this} per position (None at the first)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


# ---- chat ----------------------------------------------------------------------------------------
class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # vLLM's, when asked for


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | msgspec.UnsetType = msgspec.UNSET


# ---- completions -----------------------------------------------------------------------------------
class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # vLLM's, when asked for


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | msgspec.UnsetType = msgspec.UNSET


# ---- models ----------------------------------------------------------------------------------------
class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "pdserve"
    root: str = ""


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
