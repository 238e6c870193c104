"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, and in
Anthropic's on its routes (/v1/messages...): {"type": "error", "error": {"type", "message"}}.

Anything the router refuses raises APIError with the HTTP status it deserves; the app's
exception handlers (app.py) and the front door (security.py) turn it, pydantic's validation
errors (400, not FastAPI's 422) and unexpected exceptions (500) into the shape of the route's
API (error_json). Anthropic's types follow its status table; its overloaded_error (529 there)
keeps our 503 status.
"""
from __future__ import annotations

import msgspec

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_ROUTE = "/v1/messages"  # and everything under it
_encode = msgspec.json.Encoder().encode


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


def error_body(err: APIError) -> ErrorResponse:
    return ErrorResponse(ErrorBody(err.message, err.type, err.param, err.code if err.code else err.status))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error body; also the data of a stream's `error` event."""

    error: AnthropicErrorBody


def anthropic_error_body(err: APIError) -> AnthropicError:
    return AnthropicError(AnthropicErrorBody(_ANTHROPIC_TYPES.get(err.status, "api_error"), err.message))


def speaks_anthropic(path: str) -> bool:
    """Whether the route at `path` answers in Anthropic's shapes."""
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def error_json(err: APIError, path: str) -> bytes:
    """The JSON body of `err` in the shape of the API the route at `path` speaks."""
    return _encode(anthropic_error_body(err) if speaks_anthropic(path) else error_body(err))
