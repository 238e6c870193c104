"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Anything the router refuses raises APIError with the HTTP status it deserves; the app's
exception handlers (app.py) turn it, pydantic's validation errors (400, not FastAPI's 422)
and unexpected exceptions (500) into that shape.
"""
from __future__ import annotations

import msgspec

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


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
