"""The router's front door, as pure ASGI middleware (BaseHTTPMiddleware would buffer streams).

Every HTTP request passes these steps before any route sees it:
  1. Key: with API keys set (--api-key, else $PDSERVE_API_KEY: one, or several separated by commas,
     one per tenant), /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`
     (Anthropic's routes, /v1/messages...: or `x-api-key: <key>`, as Anthropic's clients send it),
     compared in constant time; the request's tenant (a hash of its key, `tenant(request)`) scopes
     its stored Responses and, with --cache-salt-from-key, its prefix-cache hits; otherwise 401
     (code "invalid_api_key"). /health and /metrics stay open for probes and scrapers; a body
     sent to any path that needs no key is then a 413 before a byte of it is read (no one
     without the key makes the router buffer anything).
  2. Declared size: a Content-Length over --max-body-bytes is a 413 before a byte of the
     body is read.
  3. Body: read here, whole, under one deadline of --body-timeout-s from the headers. A
     chunked body is counted as it arrives (413 the moment it passes the limit); one that
     trickles or stops (slowloris) is a 408 at the deadline. So no handler ever waits on
     the client's receive() for its body.
  4. The route gets the buffered body from its first receive(), then the real receive()
     (which is how handlers notice a client that goes away).
Refusals are errors in the route's API shape (errors.error_json: OpenAI's, Anthropic's on its
routes) sent with `connection: close`: whatever body remains is never read, so the connection
cannot be reused.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Mapping

from cluster import settings
from pd_server.config import RouterConfig
from pd_server.errors import APIError, error_json, speaks_anthropic

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})  # vLLM's, outside /v1: keyed as well


def protected(path: str) -> bool:
    """Whether `path` needs the API key (when one is set)."""
    return path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS


def api_key(cfg: RouterConfig, environ: Mapping[str, str] | None = None) -> str:
    """The key requests must carry: --api-key, else $PDSERVE_API_KEY; "" for none."""
    return cfg.api_key or settings.api_key(environ)


def api_keys(raw: str) -> list[bytes]:
    """The keys in an --api-key value: comma-separated, blanks dropped."""
    return [k.strip().encode() for k in raw.split(",") if k.strip()]


def tenant_id(key: bytes) -> str:
    """A key's tenant: a hash that names it without revealing it ("" for no key)."""
    return hashlib.sha256(b"pdserve-tenant\0" + key).hexdigest()[:32] if key else ""


def tenant(request) -> str:
    """The tenant RequestGuard found for a request (its key's tenant_id; "" where no key is set)."""
    return request.scope.get("state", {}).get("tenant", "")


def key_matches(authorization: bytes | None, key: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <key>` (scheme case-insensitive, as
    RFC 9110 says). The key comparison takes the same time wherever the first mismatch is."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def x_api_key_matches(value: bytes | None, key: bytes) -> bool:
    """Whether an x-api-key header value is the key (Anthropic's clients), in constant time."""
    return value is not None and hmac.compare_digest(value.strip(), key)


async def send_error(send, err: APIError, headers: tuple[tuple[bytes, bytes], ...] = (), path: str = "") -> None:
    body = error_json(err, path)
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class _ClientGone(Exception):
    pass


class RequestGuard:
    """ASGI middleware for steps 1-4 above; `cfg` gives the limits, `key` the API key or keys
    (comma-separated; "": open)."""

    def __init__(self, app, cfg: RouterConfig, key: str) -> None:
        self.app, self.cfg = app, cfg
        self.keys = api_keys(key)
        self.key = bool(self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # ASGI: lower-cased names; a repeated header keeps its last value
        path = scope["path"]
        if self.key and protected(path):
            who = self._key_of(headers, path)
            if who is None:
                msg = ("incorrect API key provided" if b"authorization" in headers or b"x-api-key" in headers
                       else "missing API key: send 'Authorization: Bearer <key>'"
                       + (" or 'x-api-key: <key>'" if speaks_anthropic(path) else ""))
                return await send_error(send, APIError(401, msg, code="invalid_api_key"),
                                        ((b"www-authenticate", b"Bearer"),), path)
            scope.setdefault("state", {})["tenant"] = tenant_id(who)
        limit = self.cfg.max_body_bytes
        declared = headers.get(b"content-length")
        if self.key and not protected(path) and (declared not in (None, b"0") or b"transfer-encoding" in headers):
            return await send_error(send, APIError(413, f"{path} takes no request body", code="body_not_allowed"),
                                    path=path)
        if declared is not None:
            if not declared.isdigit():
                return await send_error(send, APIError(400, "invalid Content-Length header"), path=path)
            if int(declared) > limit:
                return await send_error(send, _too_large(limit), path=path)
        try:
            body = await asyncio.wait_for(self._read_body(receive, limit), self.cfg.body_timeout_s)
        except TimeoutError:
            return await send_error(send, APIError(
                408, f"the request body did not arrive within {self.cfg.body_timeout_s:g} s", code="timeout"),
                path=path)
        except _ClientGone:
            return None
        if body is None:
            return await send_error(send, _too_large(limit), path=path)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _key_of(self, headers: dict[bytes, bytes], path: str) -> bytes | None:
        """The key the request carries, if it is one of ours (every key compared, each in
        constant time)."""
        auth, xkey = headers.get(b"authorization"), headers.get(b"x-api-key") if speaks_anthropic(path) else None
        found = None
        for key in self.keys:
            if key_matches(auth, key) or x_api_key_matches(xkey, key):
                found = key
        return found

    @staticmethod
    async def _read_body(receive, limit: int) -> bytes | None:
        """The whole body, or None once it passes `limit` bytes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
