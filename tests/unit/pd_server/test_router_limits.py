"""Access control and request limits in process, no rank behind the router: the API key
(security.py), body size and body deadline (the ASGI guard), and each per-request limit
(limits.py) answered 400/401/408/413 in OpenAI's error shape, naming the field; a request
at every limit passes them all (it reaches dispatch, stubbed to a 429 here)."""
from __future__ import annotations

import asyncio
import time

import pytest
from starlette.testclient import TestClient
from test_router_api import MODEL, chat, error
from test_router_prompts import CHATML, StubTokenizer

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello
from pd_server.app import build_app
from pd_server.config import RouterConfig
from pd_server.dispatcher import Dispatcher
from pd_server.errors import APIError
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.ranks import RankRegistry
from pd_server.routing import make_policy
from pd_server.security import RequestGuard, api_key, key_matches
from pd_server.serving import ServerContext
from tests.hostile_requests import weather_tool

KEY = "sk-test-0123456789"
CONTEXT = 4096  # the stub tokenizer makes one token per character
SMALL = dict(max_body_bytes=4096, max_messages=3, max_tokens_limit=20, max_n=2, max_stop=2, max_stop_chars=5,
             max_tools=2, max_tool_schema_bytes=200, max_prompts=2)


def make_client(monkeypatch, **cfg_kw) -> TestClient:
    cfg = RouterConfig(**cfg_kw)
    registry, metrics = RankRegistry(MODEL), RouterMetrics()
    tok = StubTokenizer(CHATML)
    ctx = ServerContext(cfg, MODEL, frozenset({MODEL}), tok, ChatRenderer(tok), registry,
                        Dispatcher(cfg, registry, make_policy(cfg.routing_policy), metrics), metrics)

    def submit(*args, **kwargs):
        raise APIError(429, "stub: reached dispatch")

    monkeypatch.setattr(ctx.dispatcher, "submit", submit)
    registry.on_hello(b"r0", Hello(PROTOCOL_VERSION, "colocated", 0, 1, MODEL, CONTEXT, 200, 16, 8), 0.0, 0.5)
    client = TestClient(build_app(ctx), raise_server_exceptions=False)
    client.ctx = ctx
    return client


@pytest.fixture
def small(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with make_client(monkeypatch, **SMALL) as c:
        yield c
    c.ctx.dispatcher._sock.close(linger=0)


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with make_client(monkeypatch, api_key=KEY) as c:
        yield c
    c.ctx.dispatcher._sock.close(linger=0)


def passes_limits(resp) -> None:
    assert resp.status_code == 429 and "reached dispatch" in resp.text, resp.text


def complete(client, **kw):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw})


MSG = {"role": "user", "content": "hi"}


# ---- the API key ----------------------------------------------------------------------------------
def test_api_key_guards_every_v1_route_and_leaves_health_open(keyed):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
                    {"authorization": f"Bearer {KEY}x"}, {"authorization": "Bearer"}):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/no-such-route")):
            resp = keyed.request(method, path, json={"model": MODEL, "prompt": "hi"}, headers=headers)
            err = error(resp, 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
            assert KEY not in resp.text
    assert "missing API key" in error(keyed.get("/v1/models"), 401)["message"]
    good = {"authorization": f"Bearer {KEY}"}
    assert keyed.get("/v1/models", headers=good).status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": f"bearer  {KEY} "}).status_code == 200
    passes_limits(keyed.post("/v1/chat/completions", json={"model": MODEL, "messages": [MSG]}, headers=good))
    assert keyed.get("/health").status_code == 200 and keyed.get("/metrics").status_code == 200
    assert 'endpoint="/v1/models",status="401"' in keyed.get("/metrics").text


def test_api_key_comes_from_the_flag_else_the_environment():
    assert api_key(RouterConfig(api_key="flag"), {"PDSERVE_API_KEY": "env"}) == "flag"
    assert api_key(RouterConfig(), {"PDSERVE_API_KEY": "env"}) == "env"
    assert api_key(RouterConfig(), {}) == ""
    assert KEY not in repr(RouterConfig(api_key=KEY))  # config reprs end up in logs


def test_key_matches():
    key = KEY.encode()
    assert key_matches(b"Bearer " + key, key) and key_matches(b"BEARER " + key, key)
    for header in (None, b"", b"Bearer", b"Bearer ", key, b"Token " + key, b"Bearer " + key[:-1],
                   b"Bearer " + key + b"0"):
        assert not key_matches(header, key), header


def test_environment_key_guards_the_app(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    with make_client(monkeypatch) as c:
        error(c.get("/v1/models"), 401)
        assert c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    c.ctx.dispatcher._sock.close(linger=0)


# ---- per-request limits ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw,param", [
    (dict(n=3), "n"),
    (dict(max_tokens=21), "max_tokens"),
    (dict(max_completion_tokens=21), "max_completion_tokens"),
    (dict(stop=["a", "b", "c"]), "stop"),
    (dict(stop="abcdef"), "stop"),
    (dict(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
    (dict(messages=[MSG] * 4), "messages"),
    (dict(tools=[weather_tool("a"), weather_tool("b"), weather_tool("c")]), "tools"),
    (dict(tools=[weather_tool("a"), weather_tool("b", {"description": "x" * 200})]), "tools.1.function"),
])
def test_each_chat_limit_is_400_naming_its_field(small, kw, param):
    err = error(chat(small, **kw), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "at most" in err["message"]


def test_completion_limits_are_400_and_a_request_at_every_limit_passes(small):
    assert error(complete(small, prompt=["a", "b", "c"]), 400)["param"] == "prompt"
    assert error(complete(small, prompt=[[1], [2], [3]]), 400)["param"] == "prompt"
    assert error(complete(small, n=3), 400)["param"] == "n"
    passes_limits(complete(small, prompt=["a", "b"], n=2, max_tokens=20, stop=["abcde", "x"], stop_token_ids=[1, 2]))
    passes_limits(chat(small, messages=[MSG] * 3, n=2, max_completion_tokens=20, stop=["abcde", "x"],
                       tools=[weather_tool("a"), weather_tool("b")]))


def test_field_bounds_that_would_overflow_a_rank_are_400(small):
    assert error(chat(small, top_k=2**31), 400)["param"] == "top_k"
    assert error(chat(small, stop_token_ids=[2**31]), 400)["param"] == "stop_token_ids.0"
    assert error(chat(small, stop_token_ids=[-1]), 400)["param"] == "stop_token_ids.0"


def test_lone_surrogates_are_400_not_a_tokenizer_crash(small):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
    err = error(small.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert "surrogate" in err["message"]


def test_invalid_json_names_the_problem_not_a_param(small):
    err = error(small.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"}), 400)
    assert err["param"] is None and "not valid JSON" in err["message"]
    err = error(small.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)
    assert "empty" in err["message"]


# ---- body size and body deadline ------------------------------------------------------------------
def test_body_over_the_limit_is_413_declared_or_chunked(small):
    big = b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'
    err = error(small.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert "4096 bytes" in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the guard counts as it reads
        yield big[:3000]
        yield big[3000:]

    resp = small.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error(resp, 413)["code"] == "request_too_large"
    assert resp.headers["connection"] == "close"
    ok = b'{"model": "tiny", "prompt": "' + b"x" * 3000 + b'", "max_tokens": 2}'  # under the limit
    for content in (ok, iter([ok[:2000], ok[2000:]])):
        passes_limits(small.post("/v1/completions", content=content, headers={"content-type": "application/json"}))
    assert 'endpoint="/v1/completions",status="413"} 2.0' in small.get("/metrics").text


def _drive(guard: RequestGuard, messages: list[dict], scope_extra: dict | None = None):
    """Run the guard over scripted receive() messages; after them receive() blocks forever
    (a client that stopped sending). Returns (sent messages, what the inner app received)."""
    sent, seen = [], []

    async def inner(scope, receive, send):
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run():
        queue = list(messages)

        async def receive():
            if queue:
                return queue.pop(0)
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [], **(scope_extra or {})}
        await RequestGuard(inner, guard.cfg, "")(scope, receive, send)

    asyncio.run(run())
    return sent, seen


def test_a_body_that_stalls_is_408_at_the_deadline():
    guard = RequestGuard(None, RouterConfig(body_timeout_s=0.3), "")
    start = time.monotonic()
    sent, seen = _drive(guard, [{"type": "http.request", "body": b'{"pro', "more_body": True}])
    assert 0.3 <= time.monotonic() - start < 5
    assert sent[0]["status"] == 408 and seen == []
    assert b'"type":"timeout_error"' in sent[1]["body"]


def test_the_guard_replays_a_whole_body_in_one_message():
    guard = RequestGuard(None, RouterConfig(), "")
    parts = [{"type": "http.request", "body": b'{"a":', "more_body": True},
             {"type": "http.request", "body": b' 1}', "more_body": False}]
    sent, seen = _drive(guard, parts)
    assert sent[0]["status"] == 200
    assert seen == [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}]


def test_declared_size_is_checked_before_reading():
    guard = RequestGuard(None, RouterConfig(max_body_bytes=10), "")
    sent, seen = _drive(guard, [], {"headers": [(b"content-length", b"11")]})  # receive() would block forever
    assert sent[0]["status"] == 413 and seen == []
    sent, _ = _drive(guard, [], {"headers": [(b"content-length", b"-1")]})
    assert sent[0]["status"] == 400


def test_limits_must_be_positive():
    for name in ("max_body_bytes", "max_n", "max_messages", "max_tools", "body_timeout_s"):
        with pytest.raises(ValueError, match=name):
            RouterConfig(**{name: 0})



def test_max_tokens_default_is_capped_by_the_limit():
    from pd_server.sampling import fit_max_tokens
    assert fit_max_tokens(None, 100, 2048, "max_tokens") == 1948
    assert fit_max_tokens(None, 100, 2048, "max_tokens", cap=512) == 512
    assert fit_max_tokens(None, 2000, 2048, "max_tokens", cap=512) == 48
    assert fit_max_tokens(300, 100, 2048, "max_tokens", cap=512) == 300


def test_several_keys_are_several_tenants():
    """--api-key "k1,k2": either key is let in, each as its own tenant (a hash, not the key); a
    key that is neither, or both as one, is a 401; x-api-key counts on Anthropic's routes."""
    tenants = []

    async def inner(scope, receive, send):
        tenants.append(scope["state"]["tenant"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = RequestGuard(inner, RouterConfig(), " k1 , k2,")

    async def status(headers, path="/v1/completions"):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await guard({"type": "http", "path": path, "method": "POST", "headers": headers}, receive, send)
        return sent[0]["status"]

    async def run():
        return [await status([(b"authorization", b"Bearer k1")]), await status([(b"authorization", b"Bearer k2")]),
                await status([(b"x-api-key", b"k2")], "/v1/messages"), await status([(b"authorization", b"Bearer k3")]),
                await status([(b"authorization", b"Bearer k1,k2")]), await status([(b"x-api-key", b"k1")])]

    assert asyncio.run(run()) == [200, 200, 200, 401, 401, 401]
    t1, t2, t2_again = tenants
    assert t1 != t2 == t2_again and len(t1) == 32 and "k1" not in t1


def test_cache_salt_from_key_folds_the_tenant_into_the_salt():
    from types import SimpleNamespace

    from pd_server.serving import ServerContext

    def salt(from_key: bool, tenant: str, given):
        ctx = SimpleNamespace(cfg=RouterConfig(cache_salt_from_key=from_key))
        return ServerContext.tenant_salt(ctx, SimpleNamespace(scope={"state": {"tenant": tenant}}), given)

    assert salt(False, "a", "s") == "s" and salt(True, "", "s") == "s" and salt(True, "", None) is None
    assert salt(True, "a", None) != salt(True, "b", None) != salt(True, "a", "s")
    assert salt(True, "a", "s") == salt(True, "a", "s") and len(salt(True, "a", "x" * 1024)) == 64
