"""Per-request size limits from RouterConfig, checked after parsing and before any work.

api_models.py declares what a field may be; this module bounds how much of it one request
may ask for (--max-n, --max-stop, --max-messages, --max-tools, ...), so the limits stay
flags rather than constants. Each breach is a 400 naming the field (`param`), raised before
rendering or tokenizing anything. Body size and body time are the ASGI layer's (security.py).
"""
from __future__ import annotations

import msgspec

from pd_server.api_models import ChatCompletionRequest, CompletionRequest, SamplingRequest
from pd_server.config import RouterConfig
from pd_server.errors import bad_request


def _at_most(value: int, limit: int, what: str, param: str) -> None:
    if value > limit:
        raise bad_request(f"{param}: {what} is {value}; at most {limit} allowed", param)


def _check_max_tokens(value: int | None, cfg: RouterConfig, param: str) -> None:
    if value is not None:
        _at_most(value, cfg.max_tokens_limit, param, param)


def check_sampling(req: SamplingRequest, cfg: RouterConfig) -> None:
    """Limits chat and completions share: n, stop strings and stop token ids, max_tokens."""
    _at_most(req.n, cfg.max_n, "n", "n")
    stops = req.stop_list
    _at_most(len(stops), cfg.max_stop, "the number of stop strings", "stop")
    _at_most(max(map(len, stops), default=0), cfg.max_stop_chars, "the longest stop string's length", "stop")
    _at_most(len(req.stop_token_ids or ()), cfg.max_stop, "the number of stop token ids", "stop_token_ids")
    _check_max_tokens(req.max_tokens, cfg, "max_tokens")


def check_chat(req: ChatCompletionRequest, cfg: RouterConfig) -> None:
    """Raises a 400 for the first limit `req` breaks."""
    check_sampling(req, cfg)
    _check_max_tokens(req.max_completion_tokens, cfg, "max_completion_tokens")
    _at_most(len(req.messages), cfg.max_messages, "the number of messages", "messages")
    tools = req.tools or ()
    _at_most(len(tools), cfg.max_tools, "the number of tools", "tools")
    for i, tool in enumerate(tools):
        param = f"tools.{i}.function"
        try:
            size = len(msgspec.json.encode(tool.function.model_dump(exclude_none=True)))
        except RecursionError:  # NOTE: parsing allows deeper nesting than encoding from a deeper stack
            raise bad_request(f"{param}: the schema is nested too deeply", param) from None
        _at_most(size, cfg.max_tool_schema_bytes, "the definition's JSON size in bytes", param)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None:
        try:
            size = len(msgspec.json.encode(fmt.json_schema))
        except RecursionError:
            raise bad_request("response_format.json_schema: the schema is nested too deeply",
                              "response_format") from None
        _at_most(size, cfg.max_tool_schema_bytes, "the schema's JSON size in bytes", "response_format")


def check_completion(req: CompletionRequest, cfg: RouterConfig) -> None:
    """Raises a 400 for the first limit `req` breaks."""
    check_sampling(req, cfg)
    _at_most(len(req.prompts), cfg.max_prompts, "the number of prompts", "prompt")
