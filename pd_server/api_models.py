"""OpenAI request bodies as pydantic models: the one place request fields are declared and range-checked.

A failed check becomes a 400 in OpenAI's error shape (app.py), naming the field. Checks that
need the model (prompt length, context, vocab) happen later, in sampling.py and prompts.py;
how much one request may ask for (n, stop strings, messages, tools, prompts, max_tokens) is
bounded by flags, in limits.py.
Union fields that the OpenAI API itself defines (stop: str | list, prompt: str | list | ids,
content: str | parts) are normalised to one form right here, by the properties below.
Unknown fields are ignored, as OpenAI's own server does for forward compatibility.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import MAX_CACHE_SALT

TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # a rank's token ids are int32


def check_encodable(data):
    """A request body's pre-validation: every string must be encodable as UTF-8 (JSON escapes
    can carry lone surrogates, "\\ud800", which the tokenizer and any UTF-8 writer refuse), and
    nothing nested deeper than an encoder can walk (a tool schema 1,000 objects deep). Returns
    `data`; raises ValueError (a 400)."""
    try:
        msgspec.json.encode(data)
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (no lone surrogates such as \\ud800)") from None
    except RecursionError:
        raise ValueError("the request is nested too deeply") from None
    except (TypeError, OverflowError, msgspec.EncodeError):
        pass  # not ours to judge: the field checks name the field
    return data


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingRequest(_Model):
    """Fields chat and completions share."""

    model: str | None = None
    n: int = Field(1, ge=1)  # upper bound: --max-n (limits.py)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    return_token_ids: bool = False  # vLLM extension: token ids in each choice
    # vLLM extension: each prompt token's logprob and this many alternatives (not when streaming)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM/SGLang: a tenant's salt for the prefix cache (its prompts hit only its own pages)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data):
        return check_encodable(data)

    @model_validator(mode="after")
    def _check_shared(self):
        if any(not s for s in self.stop_list):
            raise ValueError("stop strings must be non-empty")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- chat ------------------------------------------------------------------------------------
class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """Content as one string (text parts joined by newlines; none -> "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ToolChoiceFunction


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """Engine logprobs: None for none, else the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- completions ---------------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: the echoed prompt alone (with its logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens must be 0 when max_tokens is 0")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs) back, no new token."""
        return self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the rank computes: echo + logprobs and prompt_logprobs."""
        asks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asks) if asks else None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            return 1  # the rank makes one token (its first), which the answer leaves out
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


# ---- tokenizer endpoints (vLLM's /tokenize and /detokenize) ----------------------------------
class TokenizeRequest(_Model):
    """POST /tokenize: text (`prompt`) or a conversation (`messages`, rendered as chat
    completions render it, tools included), never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # prompt only (a chat template writes its own)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]
