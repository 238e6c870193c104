"""The FastAPI app: routes, errors in each API's shape, request counting.

    POST /v1/chat/completions   chat.py
    POST /v1/completions        completions.py
    POST /v1/messages           anthropic_messages.py (Anthropic's Messages API, served as chat);
         /v1/messages/count_tokens  its prompt's length (the router's tokenizer, no rank)
    POST /v1/responses          openai_responses.py (the Responses API, served as a chat completion)
    GET  /v1/models             the served model
    GET  /v1/models/{id}        that model's card (404 for another id)
    POST /tokenize, /detokenize tokenize.py (vLLM's shapes; the router's tokenizer, no rank)
    GET  /health                every rank with role, index, pid, state, load; status ok, or
                                degraded (200, the ranks down listed) while a rank is dead or
                                restarting; 503 while loading or when no rank can serve
    GET  /metrics               Prometheus text (metrics.py)
Every error is {"error": {"message", "type", "param", "code"}} (on /v1/messages... Anthropic's
{"type": "error", "error": {"type", "message"}}: errors.error_json): APIError as raised,
validation failures as 400 (never FastAPI's 422), unknown routes 404, anything else 500.
Middleware, outermost first: RequestCounter (metrics), RequestGuard (security.py: API key,
body size and body deadline); the routes then check per-request limits (limits.py). Streams
(sse_response.py) send their body past the middleware, straight to the server.
"""
from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from pd_server import anthropic_messages
from pd_server.anthropic_models import CountTokensRequest, MessagesRequest
from pd_server.api_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pd_server.chat import create_chat_completion
from pd_server.completions import create_completion
from pd_server.errors import APIError, error_json
from pd_server.limits import check_chat, check_completion
from pd_server.openai_responses import ResponsesRequest, create_response, to_chat, with_previous
from pd_server.response_store import ResponseStore
from pd_server.ranks import READY
from pd_server.responses import ModelCard, ModelList, to_json
from pd_server.security import RequestGuard, api_key, api_keys, key_matches, tenant
from pd_server.serving import ServerContext
from pd_server.sse_response import with_server_send
from pd_server.tokenize import detokenize, tokenize

log = logging.getLogger("pd_server.app")
JSON = "application/json"
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics"})
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "literal", "TextPart",
                        "NamedToolChoice"})


def _error(err: APIError, path: str) -> Response:
    """`err` in the shape of the API of the route at `path`."""
    return Response(error_json(err, path), status_code=err.status, media_type=JSON)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":  # loc is ("body", character offset): not a field
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', 'decode error')} " \
               f"(at character {e['loc'][-1]})", None
    if e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",):
        return "the request body is empty; expected a JSON object", None
    # Union members add their type to the path ("str", "list[int]", "function-after[...]"): drop it.
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and str(x) not in _TYPE_TAGS and "[" not in str(x)]
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


class RequestCounter:
    """Pure ASGI middleware: counts responses by endpoint and status (streams included)."""

    def __init__(self, app, ctx: ServerContext) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope["path"]
            path = path if path in ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
            self.ctx.metrics.requests.labels(path, str(status[0])).inc()


def build_app(ctx: ServerContext):
    """The ASGI app: the FastAPI app below, wrapped so that streams reach the server's send
    directly (sse_response.with_server_send)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    if ctx.responses is None:
        c = ctx.cfg
        ctx.responses = ResponseStore(c.responses_max_count, int(c.responses_max_mb * 2**20), c.responses_ttl_s)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status >= 500:
            log.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return _error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _error(APIError(400, msg, param=param), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return _error(APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)  # the text stays in the log, not the reply
        return _error(APIError(500, "internal error (logged on the server)"), request.url.path)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_chat(req, ctx.cfg)
        req.cache_salt = ctx.tenant_salt(request, req.cache_salt)
        return await create_chat_completion(req, request, ctx)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        req, items = with_previous(req, ctx.responses, tenant(request))
        chat_req = to_chat(req)
        check_chat(chat_req, ctx.cfg)
        chat_req.cache_salt = ctx.tenant_salt(request, chat_req.cache_salt)
        return await create_response(req, chat_req, request, ctx, items)

    def stored(rid: str, request: Request):
        s = ctx.responses.get(rid, tenant(request))
        if s is None:
            raise APIError(404, f"Response with id {rid!r} not found.", param="response_id")
        return s

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        return Response(to_json(stored(rid, request).response), media_type=JSON)

    @app.get("/v1/responses/{rid}/input_items")
    async def response_input_items(rid: str, request: Request):
        items = stored(rid, request).input_items
        return Response(to_json({"object": "list", "data": items, "has_more": False,
                                 "first_id": items[0].get("id") if items else None,
                                 "last_id": items[-1].get("id") if items else None}), media_type=JSON)

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request):
        stored(rid, request)
        ctx.responses.delete(rid)
        return Response(to_json({"id": rid, "object": "response", "deleted": True}), media_type=JSON)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_completion(req, ctx.cfg)
        req.cache_salt = ctx.tenant_salt(request, req.cache_salt)
        return await create_completion(req, request, ctx)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        chat_req = anthropic_messages.to_chat(req)
        check_chat(chat_req, ctx.cfg)
        chat_req.cache_salt = ctx.tenant_salt(request, chat_req.cache_salt)
        return await anthropic_messages.create_message(req, chat_req, request, ctx)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest):
        return Response(to_json(await ctx.offload(anthropic_messages.count_tokens, req, ctx)), media_type=JSON)

    def card() -> ModelCard:
        return ModelCard(ctx.model_name, ctx.created, ctx.registry.max_model_len, root=ctx.model_name)

    @app.get("/v1/models")
    async def models():
        return Response(to_json(ModelList([card()])), media_type=JSON)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        ctx.check_model(model_id)
        return Response(to_json(card()), media_type=JSON)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return Response(to_json(await ctx.offload(tokenize, req, ctx)), media_type=JSON)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return Response(to_json(await ctx.offload(detokenize, req, ctx)), media_type=JSON)

    keys = api_keys(api_key(ctx.cfg))

    @app.get("/health")
    async def health(request: Request):
        reg, now = ctx.registry, time.monotonic()
        status = reg.status
        body = {"status": status, "model": ctx.model_name, "max_model_len": reg.max_model_len,
                "rank_addr": ctx.dispatcher.address, "ranks": [r.describe(now) for r in reg.ranks.values()],
                "down": [r.name for r in reg.ranks.values() if r.state != READY and status == "degraded"]}
        auth = request.headers.get("authorization", "").encode() or None
        if keys and not any(key_matches(auth, k) for k in keys):
            # Open for probes, but where a key guards the API the cluster's addresses and pids need it too.
            body.pop("rank_addr")
            for r in body["ranks"]:
                for k in ("pid", "node", "error"):
                    r.pop(k, None)
        return Response(to_json(body), status_code=200 if status in ("ok", "degraded") else 503, media_type=JSON)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_middleware(RequestGuard, cfg=ctx.cfg, key=api_key(ctx.cfg))
    app.add_middleware(RequestCounter, ctx=ctx)  # added last: outermost, so it counts the guard's refusals
    return with_server_send(app)
