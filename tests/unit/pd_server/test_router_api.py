"""The HTTP surface in-process, with no rank behind it: status codes and OpenAI error shapes
for everything refused before a request reaches a rank (validation, model, context, loading)."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_router_prompts import CHATML, StubTokenizer

from cluster.protocol import PROTOCOL_VERSION
from cluster.protocol.rank_router import Hello
from pd_server.app import build_app
from pd_server.config import RouterConfig
from pd_server.dispatcher import Dispatcher
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.ranks import RankRegistry
from pd_server.routing import make_policy
from pd_server.serving import ServerContext

MODEL = "tiny"
CONTEXT = 64


@pytest.fixture
def ctx():
    cfg = RouterConfig()
    registry, metrics = RankRegistry(MODEL), RouterMetrics()
    tok = StubTokenizer(CHATML)
    c = ServerContext(cfg, MODEL, frozenset({MODEL, "/models/tiny"}), tok, ChatRenderer(tok), registry,
                      Dispatcher(cfg, registry, make_policy(cfg.routing_policy), metrics), metrics)
    yield c
    c.dispatcher._sock.close(linger=0)


@pytest.fixture
def client(ctx):
    with TestClient(build_app(ctx), raise_server_exceptions=False) as c:
        yield c


def ready(ctx) -> None:
    ctx.registry.on_hello(b"r0", Hello(PROTOCOL_VERSION, "colocated", 0, 1, MODEL, CONTEXT, 200, 16, 8), 0.0, 0.5)


def chat(client, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return client.post("/v1/chat/completions", json=body)


def error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_loading_is_503_and_health_lists_the_rank(ctx, client):
    ctx.registry.expect("colocated", 0)
    err = error(chat(client), 503)
    assert "loading" in err["message"] and err["type"] == "service_unavailable"
    resp = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["ranks"] == [{**resp.json()["ranks"][0], "name": "colocated-0", "state": "loading"}]
    ready(ctx)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("n", 17, "n"),
    ("max_tokens", 0, "max_tokens"),
    ("messages", [{"role": "robot", "content": "x"}], "messages.0.role"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None),
    ("stop", [""], None),
    ("logit_bias", {"x": 1.0}, "logit_bias"),
    ("logit_bias", {"5": 100.5}, "logit_bias"),
    ("logit_bias", {"99999999": 1.0}, "logit_bias"),
    ("tool_choice", "required", None),
    ("stream_options", {"include_usage": "maybe"}, "stream_options.include_usage"),
])
def test_invalid_fields_are_400_not_422(ctx, client, field, value, param):
    ready(ctx)
    err = error(chat(client, **{field: value}), 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_unknown_model_is_404_and_aliases_are_accepted(ctx, client):
    err = error(chat(client, model="gpt-4"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    ready(ctx)
    resp = chat(client, model="/models/tiny", max_tokens=10**6)  # passes the model check, fails later
    assert "max_tokens" in error(resp, 400)["message"]


def test_context_limits_are_400(ctx, client):
    ready(ctx)
    err = error(chat(client, messages=[{"role": "user", "content": "x" * CONTEXT}]), 400)
    assert "maximum context length is 64" in err["message"]
    err = error(client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 500]}), 400)
    assert "[0, 200)" in err["message"]
    err = error(client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 61}), 400)
    assert "at most 60 tokens fit" in err["message"]
    err = error(chat(client, min_tokens=5, max_tokens=2), 400)
    assert "min_tokens" in err["message"]


def test_bad_json_unknown_route_and_method(client):
    resp = client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    error(resp, 400)
    error(client.get("/v1/nope"), 404)
    error(client.get("/v1/chat/completions"), 405)


def test_models_and_metrics(ctx, client):
    ready(ctx)
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL and body["data"][0]["max_model_len"] == CONTEXT
    chat(client, model="nope")
    text = client.get("/metrics").text
    assert 'pdserve_requests_total{endpoint="/v1/chat/completions",status="404"} 1.0' in text
