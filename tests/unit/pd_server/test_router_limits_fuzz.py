"""The hostile-request corpus (tests/hostile_requests.py) against the router in process, with
the real tokenizer and chat template of the embedded model and no rank: every request is a
4xx in OpenAI's error shape and none reaches dispatch. The same corpus runs against a real
system in tests/e2e/test_e2e_fuzz.py; this one finds a 500 in seconds."""
from __future__ import annotations

import collections

import pytest
from starlette.testclient import TestClient

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
from tests.hostile_requests import Limits, corpus

MODEL = "smollm2-135m-instruct"
CONTEXT, VOCAB = 2048, 49152


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.model_cache import cached_model_dir

    return AutoTokenizer.from_pretrained(str(cached_model_dir(MODEL)))


def test_every_hostile_request_is_a_4xx_and_none_reaches_a_rank(tokenizer, monkeypatch):
    cfg = RouterConfig()
    registry, metrics = RankRegistry(MODEL), RouterMetrics()
    ctx = ServerContext(cfg, MODEL, frozenset({MODEL}), tokenizer, ChatRenderer(tokenizer), registry,
                        Dispatcher(cfg, registry, make_policy(cfg.routing_policy), metrics), metrics)
    dispatched = []
    monkeypatch.setattr(ctx.dispatcher, "submit", lambda rid, work, *a: dispatched.append(work) or 1 / 0)
    registry.on_hello(b"r0", Hello(PROTOCOL_VERSION, "colocated", 0, 1, MODEL, CONTEXT, VOCAB, 16, 8), 0.0, 0.5)
    cases = corpus(Limits(MODEL, CONTEXT, VOCAB), 1000)
    failures, statuses = [], collections.Counter()
    try:
        with TestClient(build_app(ctx), raise_server_exceptions=False) as client:
            for case in cases:
                resp = client.request(case.method, case.path, content=case.body, headers=case.headers)
                statuses[resp.status_code] += 1
                err = resp.json().get("error", {}) if resp.headers.get("content-type") == "application/json" else {}
                if not (400 <= resp.status_code < 500 and set(err) == {"message", "type", "param", "code"}) \
                        or case.status not in (None, resp.status_code) or case.param not in (None, err["param"]):
                    failures.append(f"{case.name}: {resp.status_code} {resp.text[:200]}")
    finally:
        ctx.dispatcher._sock.close(linger=0)
    assert len(cases) >= 1000
    assert not failures, "\n".join(failures[:20])
    assert not dispatched
    assert statuses[400] > 900 and statuses[404] >= 2, statuses
