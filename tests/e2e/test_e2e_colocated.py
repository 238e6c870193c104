"""A real router with 2 colocated ranks on the embedded model, driven by the official openai client.

Greedy outputs are compared token for token with the engine run directly in this process
(same model, dtype and thread count; requests are sent one at a time so the rank runs the
same batch of one). The last test kills a rank.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(colocated_system):
    with openai.OpenAI(base_url=colocated_system.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, kv_cache_gb=0.25, num_threads=1, max_num_seqs=16))


def greedy(engine, prompt_ids: list[int], max_tokens: int = MAX_TOKENS):
    from engine.sampling_params import SamplingParams

    return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]


def chat_prompt_ids(engine, messages) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def test_health_and_models(colocated_system, client):
    status, body = colocated_system.health()
    assert status == 200 and body["status"] == "ok"
    ranks = body["ranks"]
    assert [(r["role"], r["index"], r["state"]) for r in ranks] == [("colocated", 0, "ready"),
                                                                    ("colocated", 1, "ready")]
    assert all(isinstance(r["pid"], int) and r["pages_total"] > 0 for r in ranks)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_greedy_stream_equals_nonstream_equals_engine(client, engine):
    ref = greedy(engine, chat_prompt_ids(engine, MESSAGES))
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.model_extra["prompt_token_ids"] == chat_prompt_ids(engine, MESSAGES)
    assert choice.model_extra["token_ids"] == ref.new_token_ids
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c for c in chunks if c.choices]
    token_chunks = [c for c in deltas if c.choices[0].model_extra.get("token_ids")]
    assert len(token_chunks) == len(ref.new_token_ids)  # one chunk per token
    assert [t for c in token_chunks for t in c.choices[0].model_extra["token_ids"]] == ref.new_token_ids
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.text
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason == ref.finish_reason
    usage = chunks[-1].usage  # the second run may hit the host cache the first one filled
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)
    assert full.usage.prompt_tokens == len(chat_prompt_ids(engine, MESSAGES))
    assert full.usage.completion_tokens == len(ref.new_token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_prompt_forms(client, engine):
    text = "The capital of France is"
    ids = engine.tokenizer(text).input_ids
    ref = greedy(engine, ids, 8)
    one = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    assert one.choices[0].text == ref.text
    streamed = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == ref.text
    many = client.completions.create(model=MODEL, prompt=[text, "Hello, my name is"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == greedy(engine, ids, 4).text
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(many_ids.choices) == 2 and many_ids.usage.prompt_tokens == len(ids) + 3


def test_n_and_seed_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              max_tokens=8, temperature=1.2, n=3, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # seed + i per choice: choices differ, the request reproduces
    assert 0 < a.usage.completion_tokens <= 3 * 8
    streamed = client.chat.completions.create(**kw, stream=True)
    got = ["", "", ""]
    for c in streamed:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
    assert got == texts


def test_stop_string_cuts_exactly(client, engine):
    ref = greedy(engine, chat_prompt_ids(engine, MESSAGES))
    words = ref.text.split()
    assert len(words) >= 3, ref.text
    stop = " " + words[2]
    expected = ref.text[: ref.text.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text


def test_tools_named_choice_parsed(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=tools,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name == "get_weather" and calls[0].type == "function"
    json.loads(calls[0].function.arguments)
    streamed_calls, reasons = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed_calls += ch.delta.tool_calls or []
            reasons.append(ch.finish_reason)
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert reasons[-1] == "tool_calls"


def _bad(client, status: int, **kw):
    base = dict(model=MODEL, messages=MESSAGES, max_tokens=4)
    base.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**base)
    assert e.value.status_code == status, e.value.body
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors(colocated_system, client):
    assert _bad(client, 404, model="no-such-model")["param"] == "model"
    assert _bad(client, 400, temperature=5)["param"] == "temperature"
    assert _bad(client, 400, n=0)["param"] == "n"
    assert _bad(client, 400, messages=[])["param"] == "messages"
    _bad(client, 400, messages=[{"role": "wizard", "content": "hi"}])
    assert _bad(client, 400, max_tokens=10**6)["param"] == "max_tokens"
    _bad(client, 400, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):  # prompt longer than the context
        client.completions.create(model=MODEL, prompt=[5] * 9000, max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # token id outside the vocabulary
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=1)
    r = httpx.post(colocated_system.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(colocated_system.url + "/v1/nothing").status_code == 404


def test_tokenize_detokenize_and_the_model_card(colocated_system, client, engine):
    """vLLM's /tokenize and /detokenize on the router's tokenizer; GET /v1/models/{id}."""
    url, tok = colocated_system.url, engine.tokenizer
    text = "What is the capital of France? Ünïcödé 漢字"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    body = r.json()
    ids = tok(text).input_ids
    assert r.status_code == 200 and body["tokens"] == ids and body["count"] == len(ids), r.text
    assert body["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"] > 0
    assert body["token_strs"] == tok.convert_ids_to_tokens(ids)
    # a conversation: the ids a chat completion of it prefills (its usage counts them)
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == chat_prompt_ids(engine, MESSAGES) and "token_strs" in chat
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    bare = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True,
                                                     return_dict=False)
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(ids)}
    # bad input: each API's error shape, the field named
    for path, bad, status, param in (("/detokenize", {"tokens": [10**6]}, 400, "tokens.0"),
                                     ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
                                     ("/tokenize", {}, 400, None),
                                     ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
                                     ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model")):
        r = httpx.post(url + path, json=bad)
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, r.text
        assert err["param"] == param, r.text
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    metrics = httpx.get(url + "/metrics").text
    assert 'endpoint="/tokenize",status="200"' in metrics and 'endpoint="/v1/models/{id}",status="404"' in metrics


def _idle(system) -> bool:
    return all(r["running"] == 0 and r["waiting"] == 0 and r["pages_used"] == 0 and r["inflight"] == 0
               for r in system.ranks().values())


def test_keep_alive_outlives_an_agents_think_time(colocated_system):
    """One connection reused after idle gaps around uvicorn's old 5 s keep-alive (and well past
    it): still open (--keep-alive-s 75), no 'closing transport' failure."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=colocated_system.url, timeout=60, limits=httpx.Limits(keepalive_expiry=120)) as c:
        peers = []
        for gap in (0.0, 4.9, 5.2, 8.0):
            time.sleep(gap)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200
            peers.append(r.extensions["network_stream"].get_extra_info("client_addr"))
    assert len(set(peers)) == 1, peers  # the same local address: one connection throughout


def test_client_disconnect_frees_pages(colocated_system):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", colocated_system.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert not _idle(colocated_system)
    colocated_system.wait_until(lambda: _idle(colocated_system), 15, "pages freed after a stream disconnect")
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(colocated_system.url + "/v1/chat/completions", json=body, timeout=2)
    colocated_system.wait_until(lambda: _idle(colocated_system), 15, "pages freed after a request disconnect")


def test_concurrent_requests_use_both_ranks(colocated_system):
    seen, errors = [], []

    def one():
        try:
            r = httpx.post(colocated_system.url + "/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
            r.raise_for_status()
            seen.append(r.headers["x-pdserve-rank"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(set(seen)) == ["colocated-0", "colocated-1"]


def test_the_next_turn_is_the_hit_cache_aware_routing_expected_on_either_rank(colocated_system, client):
    """The ranks share one host cache (the launcher's default), so either rank holds the first
    turn's pages and the router, knowing it, picks by load. (Affinity to the rank that holds a
    prefix, with private caches: test_router_routing.py.)"""
    notes = " ".join(f"Note {i}: parcel {i * 37 % 101} goes to shelf {i * 11 % 13}." for i in range(12))
    turn1 = [{"role": "user", "content": f"Remember these notes. {notes}"}]  # not sent before
    r1 = client.chat.completions.with_raw_response.create(model=MODEL, messages=turn1, max_tokens=4)
    reply = r1.parse().choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Where does parcel 37 go?"}]
    r2 = client.chat.completions.with_raw_response.create(model=MODEL, messages=turn2, max_tokens=4)
    cached = r2.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= 64
    rid = r2.headers["x-request-id"]
    lines = [ln for ln in (colocated_system.log_dir / "router.log").read_text().splitlines() if f"{rid} -> " in ln]
    assert len(lines) == 1 and "by cache-aware" in lines[0] and f"expected hit {cached} tokens" in lines[0], lines


def test_metrics(colocated_system):
    text = httpx.get(colocated_system.url + "/metrics").text
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_inter_token_latency_seconds_count",
                 "pdserve_e2e_request_latency_seconds_count", 'pdserve_rank_kv_pages_total{rank="colocated-0"}',
                 "pdserve_rank_queue_depth", "pdserve_rank_running", 'pdserve_requests_total{endpoint='):
        assert name in text, name
    ttft = [ln for ln in text.splitlines() if ln.startswith("pdserve_time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) > 0


def test_killed_rank_is_reported_and_the_other_serves(colocated_system, client):
    """Last: kills colocated-1."""
    victim = colocated_system.ranks()["colocated-1"]
    os.kill(victim["pid"], signal.SIGKILL)
    colocated_system.wait_until(lambda: colocated_system.ranks()["colocated-1"]["state"] == "dead", 10,
                                "the killed rank to be reported dead")
    status, body = colocated_system.health()
    assert status == 200 and "exited" in body["ranks"][1]["error"]
    for _ in range(3):
        r = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert r.headers["x-pdserve-rank"] == "colocated-0"
        assert r.parse().choices[0].message.content
