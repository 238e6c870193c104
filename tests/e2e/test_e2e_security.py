"""Access control and request limits on a real router (2 stand-in ranks, no model): --api-key
and $PDSERVE_API_KEY through the official openai client (and as x-api-key through the anthropic
one), two keys as two tenants (one never reads the other's stored Responses), --no-cache-usage-details,
/health and /metrics open, the key in no log, and every request limit flag answered 400 (413 for
the body) naming its field."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from conftest import MODEL, start_system, stop_system

KEY = "sk-e2e-4f1c9a7d2b"
KEY2 = "sk-e2e-second-tenant-77"
ENV_KEY = "sk-e2e-from-the-environment"
FAKE = ["--fake-ranks", "--fake-step-ms", "5", "--colocated", "2", "--model", MODEL]
LIMITS = ["--max-body-bytes", "8192", "--max-n", "2", "--max-messages", "3", "--max-tokens-limit", "50",
          "--max-stop", "2", "--max-stop-chars", "8", "--max-tools", "1", "--max-tool-schema-bytes", "300",
          "--max-prompts", "2"]


@pytest.fixture(scope="module")
def keyed_system(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.delenv("PDSERVE_API_KEY", raising=False)
    system = start_system(tmp_path_factory.mktemp("keyed"), [*FAKE, "--api-key", f"{KEY},{KEY2}", "--no-cache-usage-details", *LIMITS], timeout=120)
    try:
        yield system
    finally:
        stop_system(system)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def client(system, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.url + "/v1", api_key=key, max_retries=0, timeout=30)


def check_key(system, key: str) -> None:
    """401 without the key and with a wrong one (openai client and raw), 200 with it, probes open."""
    for wrong in ("wrong", key + "x", key[:-1]):
        with client(system, wrong) as c, pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        err = e.value.response.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
        assert set(err) == {"message", "type", "param", "code"}
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/chat/completions", "/v1/completions", "/tokenize",
                 "/detokenize"):
        resp = httpx.request("GET" if path.startswith("/v1/models") else "POST", system.url + path, json={},
                             timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
    with client(system, key) as c:
        out = c.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].finish_reason == "length"
        assert [m.id for m in c.models.list().data] == [MODEL]
    auth = {"authorization": f"Bearer {key}"}
    tok = httpx.post(system.url + "/tokenize", json={"prompt": "hi"}, headers=auth, timeout=10)
    assert tok.status_code == 200 and tok.json()["count"] >= 1, tok.text
    assert httpx.get(system.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(system.url + "/metrics", timeout=10).text
    assert 'endpoint="/v1/completions",status="401"' in metrics
    logs = "\n".join(f.read_text(errors="replace") for f in system.log_dir.glob("*.log"))
    assert key not in logs


def test_api_key_flag(keyed_system):
    check_key(keyed_system, KEY)
    check_key(keyed_system, KEY2)


def test_each_key_is_a_tenant_of_its_own_stored_responses(keyed_system):
    """A response stored under one key is a 404 for the other (GET, input_items, DELETE and
    previous_response_id) and there for its own; --no-cache-usage-details leaves out the rank
    headers and reports no cached tokens."""
    with client(keyed_system, KEY) as a, client(keyed_system, KEY2) as b:
        r1 = a.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        assert a.responses.retrieve(r1.id).id == r1.id
        for call in (lambda: b.responses.retrieve(r1.id), lambda: b.responses.input_items.list(r1.id),
                     lambda: b.responses.delete(r1.id),
                     lambda: b.responses.create(model=MODEL, input="x", previous_response_id=r1.id,
                                                max_output_tokens=3)):
            with pytest.raises(openai.NotFoundError):
                call()
        r2 = a.responses.create(model=MODEL, input="again", previous_response_id=r1.id, max_output_tokens=3)
        assert r2.previous_response_id == r1.id
        raw = a.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=2)
        assert "x-pdserve-rank" not in raw.headers and raw.headers["x-request-id"]
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_api_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", ENV_KEY)  # the launcher inherits it; no --api-key
    system = start_system(tmp_path, FAKE, timeout=120)
    try:
        check_key(system, ENV_KEY)
    finally:
        stop_system(system)


MSG = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"n": 3}, "n"),
    ("/v1/completions", {"max_tokens": 51}, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("/v1/completions", {"stop": ["a", "b", "c"]}, "stop"),
    ("/v1/completions", {"stop": "123456789"}, "stop"),
    ("/v1/chat/completions", {"max_completion_tokens": 51}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [MSG] * 4}, "messages"),
    ("/v1/chat/completions", {"tools": [TOOL, TOOL]}, "tools"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "function": {"name": "f", "description": "d" * 300}}]},
     "tools.0.function"),
])
def test_each_limit_is_400_naming_its_field(keyed_system, path, fields, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": [MSG]} if "chat" in path else {"prompt": "hi"}), **fields}
    resp = httpx.post(keyed_system.url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "at most" in err["message"]


def test_body_over_the_limit_is_413_and_under_it_serves(keyed_system):
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = keyed_system.url + "/v1/completions"
    big = b'{"model": "%s", "prompt": "%s", "max_tokens": 2}' % (MODEL.encode(), b"x" * 9000)
    resp = httpx.post(url, content=big, headers=headers, timeout=10)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    resp = httpx.post(url, content=iter([big[:5000], big[5000:]]), headers=headers, timeout=10)  # chunked
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    ok = b'{"model": "%s", "prompt": "%s", "max_tokens": 2}' % (MODEL.encode(), b"x " * 3000)
    resp = httpx.post(url, content=iter([ok[:4000], ok[4000:]]), headers=headers, timeout=10)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def test_with_a_key_a_path_that_needs_none_takes_no_body(keyed_system):
    for path in ("/health", "/metrics", "/nothing-here"):
        resp = httpx.post(keyed_system.url + path, content=b"x" * 5000, timeout=10)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_not_allowed", (path, resp.text)
        resp = httpx.post(keyed_system.url + path, content=iter([b"x" * 100]), timeout=10)  # chunked
        assert resp.status_code == 413, path
    assert httpx.get(keyed_system.url + "/health", timeout=10).status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key(keyed_system):
    for wrong in ("wrong", KEY + "x"):
        with anthropic.Anthropic(base_url=keyed_system.url, api_key=wrong, max_retries=0, timeout=30) as c, \
                pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model=MODEL, max_tokens=2, messages=[MSG])
        assert e.value.type == "authentication_error" and e.value.body["type"] == "error"
    with anthropic.Anthropic(base_url=keyed_system.url, api_key=KEY, max_retries=0, timeout=30) as c:
        m = c.messages.create(model=MODEL, max_tokens=2, messages=[MSG])
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
        assert c.messages.count_tokens(model=MODEL, messages=[MSG]).input_tokens > 0
    resp = httpx.post(keyed_system.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      headers={"x-api-key": KEY}, timeout=10)
    assert resp.status_code == 401  # x-api-key is for Anthropic's routes only


def test_health_stays_open_but_shows_addresses_and_pids_only_with_the_key(keyed_system):
    open_ = httpx.get(keyed_system.url + "/health", timeout=10).json()
    assert open_["status"] == "ok" and "rank_addr" not in open_
    assert all("pid" not in r and r["state"] == "ready" for r in open_["ranks"])
    full = httpx.get(keyed_system.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert full["rank_addr"].startswith("tcp://127.0.0.1:") and all(r["pid"] > 0 for r in full["ranks"])
