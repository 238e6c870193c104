"""The agent-facing OpenAI APIs through a started system, with the official openai client, colocated
and PD (every prompt through a prefill rank: its first token is sampled under the grammar there,
the decode rank rebuilds the matcher):
  * structured outputs on chat completions: response_format json_schema / json_object and
    tool_choice required / named, streaming and not, greedy PD output equal to colocated's, 16
    concurrent constrained requests, bad schemas as 400s;
  * the Responses API (/v1/responses): text, instructions, function calls and their outputs,
    text.format json_schema, streaming events, usage, unsupported input as 400s;
  * what eval harnesses send: completions echo + logprobs (lm-evaluation-harness's recorded
    log-likelihood body), max_tokens 0, vLLM's prompt_logprobs, against transformers."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest


pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 30},
                                           "sights": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                      "maxItems": 3}},
          "required": ["city", "days", "sights"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(params=["colocated", "pd"])
def system(request):
    return request.getfixturevalue("colocated_system" if request.param == "colocated" else "pd_handoff_system")


_CLIENTS: dict[str, openai.OpenAI] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients():
    yield
    for c in _CLIENTS.values():
        c.close()
    _CLIENTS.clear()


def _client(system) -> openai.OpenAI:
    """One client per system for the module (closed at its end)."""
    if system.url not in _CLIENTS:
        _CLIENTS[system.url] = openai.OpenAI(base_url=system.url + "/v1", api_key="unused", max_retries=0,
                                             timeout=300)
    return _CLIENTS[system.url]


def _validate(obj, schema):
    """The schemas above, checked by hand (types, required, enum, bounds, no extra keys)."""
    t = schema["type"]
    if t == "object":
        assert isinstance(obj, dict) and set(schema["required"]) <= set(obj) <= set(schema["properties"]), obj
        for k, v in obj.items():
            _validate(v, schema["properties"][k])
    elif t == "array":
        assert isinstance(obj, list) and len(obj) <= schema.get("maxItems", 10**9)
        for v in obj:
            _validate(v, schema["items"])
    elif t == "string":
        assert isinstance(obj, str) and len(obj) <= schema.get("maxLength", 10**9)
        assert "enum" not in schema or obj in schema["enum"]
    elif t == "integer":
        assert isinstance(obj, int) and schema.get("minimum", obj) <= obj <= schema.get("maximum", obj)


def _schema_request(i: int = 0, **kw):
    return dict(model=MODEL, max_tokens=120, temperature=0,
                messages=[{"role": "user", "content": f"Plan trip number {i} to a European city, as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}, **kw)


def test_json_schema_and_object(system):
    c = _client(system)
    r = c.chat.completions.create(**_schema_request())
    assert r.choices[0].finish_reason == "stop"
    _validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                  max_tokens=80, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"  # (a sampled number can run past max_tokens: "length")
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # Streaming gives the same text, chunk by chunk.
    chunks = c.chat.completions.create(**_schema_request(), stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.chat.completions.create(**_schema_request()).choices[0].message.content


def test_pd_equals_colocated_under_a_grammar(colocated_system, pd_handoff_system):
    for body in (_schema_request(3), dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False)):
        a = _client(colocated_system).chat.completions.create(**body).choices[0].message
        b = _client(pd_handoff_system).chat.completions.create(**body).choices[0].message
        assert a.content == b.content
        assert [(k.function.name, k.function.arguments) for k in a.tool_calls or ()] == \
               [(k.function.name, k.function.arguments) for k in b.tool_calls or ()]


def test_logit_bias_is_the_same_in_pd_and_colocated_and_a_bad_id_is_400(colocated_system, pd_handoff_system):
    """+100 on one token makes it every greedy token, the first (sampled on the prefill rank) and
    the rest (on the decode rank); -100 on it in a second request bans it."""
    body = dict(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logit_bias={"1000": 100},
                extra_body={"return_token_ids": True})
    for system in (colocated_system, pd_handoff_system):
        assert _client(system).chat.completions.create(**body).choices[0].token_ids == [1000] * 4
    plain = _client(colocated_system).chat.completions.create(**{**body, "logit_bias": None})
    first = plain.choices[0].token_ids[0]
    for system in (colocated_system, pd_handoff_system):
        got = _client(system).chat.completions.create(**{**body, "logit_bias": {str(first): -100}})
        assert got.choices[0].token_ids[0] != first
        with pytest.raises(openai.BadRequestError) as e:
            _client(system).chat.completions.create(**{**body, "logit_bias": {"49152": 1}})
        assert e.value.body["param"] == "logit_bias"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls(system, choice):
    c = _client(system)
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                  tool_choice=tool_choice, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    assert len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    assert call.function.name == "get_time" if choice == "named" else call.function.name in schemas
    _validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Streamed, the tool-call deltas assemble to the same call.
    stream = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                       tool_choice=tool_choice, parallel_tool_calls=False, stream=True)
    name, args, reasons = "", "", []
    for chunk in stream:
        for d in chunk.choices:
            for k in d.delta.tool_calls or ():
                name += k.function.name or ""
                args += k.function.arguments or ""
            reasons.append(d.finish_reason)
    assert (name, args) == (call.function.name, call.function.arguments) and reasons[-1] == "tool_calls"


def test_sixteen_concurrent_constrained_requests(colocated_system):
    """16 at once, mixed with free-text ones, sampled: every constrained output validates."""
    c = _client(colocated_system)

    def one(i):
        if i % 4 == 3:
            return None, c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                   max_tokens=20)
        return i, c.chat.completions.create(**{**_schema_request(i), "temperature": 0.8, "seed": i})

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    for i, r in results:
        if i is not None:
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            _validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("body, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
])
def test_bad_schemas_are_400(colocated_system, body, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        _client(colocated_system).chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **body)
    assert e.value.body["type"] == "invalid_request_error"


# ---- the Responses API ---------------------------------------------------------------------------
FLAT_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
               "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_text_stream_and_usage(system):
    c = _client(system)
    kw = dict(model=MODEL, input="Name three colours.", instructions="You are terse.", max_output_tokens=60,
              temperature=0)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    chat = c.chat.completions.create(model=MODEL, max_tokens=60, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}])
    assert r.output_text == chat.choices[0].message.content  # the same request underneath
    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response." + r.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_responses_function_call_round_trip(system):
    c = _client(system)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = c.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    _validate(json.loads(calls[0].arguments), {"get_weather": WEATHER, "get_time": TIME}[calls[0].name])
    streamed = [e for e in c.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_output_tokens=80, temperature=0,
                                              stream=True)
                if e.type == "response.output_item.done"]
    assert [(i.item.name, i.item.arguments) for i in streamed] == [(calls[0].name, calls[0].arguments)]
    follow = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                     "arguments": calls[0].arguments},
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}]
    r2 = c.responses.create(model=MODEL, input=follow, tools=FLAT_TOOLS, max_output_tokens=40, temperature=0)
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens
    r3 = c.responses.create(model=MODEL, input="Plan a trip to Rome as JSON.", max_output_tokens=120, temperature=0,
                            text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}})
    _validate(json.loads(r3.output_text), SCHEMA)


def test_previous_response_id_continues_a_stored_conversation(system):
    """The second turn sees the first (its prompt holds the history, which the host cache serves),
    streamed or not; GET returns the stored response, DELETE removes it, a gone id is a 404."""
    c = _client(system)
    kw = dict(model=MODEL, max_output_tokens=12, temperature=0)
    r1 = c.responses.create(input="My name is Ada. Remember it.", instructions="You are terse.", **kw)
    assert r1.store is True
    r2 = c.responses.create(input="What is my name?", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id
    chat = c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Remember it."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert r2.output_text == chat.choices[0].message.content  # the same conversation underneath
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    events = list(c.responses.create(input="What is my name?", previous_response_id=r1.id, stream=True, **kw))
    assert events[-1].response.output_text == r2.output_text
    r3 = c.responses.create(input="And again?", previous_response_id=events[-1].response.id, **kw)
    assert r3.usage.input_tokens > r2.usage.input_tokens
    whole = c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Remember it."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "And again?"}])
    assert r3.output_text == whole.choices[0].message.content  # the third turn: the whole conversation's
    if any(r["host_cache_pages"] is not None for r in system.ranks().values()):  # (pd_handoff_system has none)
        # The chain's prompt so far was stored by the host cache: its whole pages are a hit.
        assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens // 16 * 16 - 16
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
    items = c.responses.input_items.list(r3.id).data
    assert len(items) == 5 and items[0].type == "message"  # 3 user turns, 2 answers (the stream's)
    c.responses.delete(r1.id)
    for call in (lambda: c.responses.retrieve(r1.id),
                 lambda: c.responses.create(input="x", previous_response_id=r1.id, **kw)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = c.responses.create(input="hi", store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, match", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input_image parts are not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "answers no earlier"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "hi", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not in tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
     "Unsupported type"),
])
def test_responses_bad_input_is_400(colocated_system, body, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _client(colocated_system).responses.create(model=MODEL, max_output_tokens=5, **body)


# lm-evaluation-harness's local-completions body for two log-likelihood requests (context
# "Question: What is the capital of France?\nAnswer:", continuations " Paris" and " London"),
# as its _create_payload writes it: token ids, echo, one top logprob, one new token.
CTX = [17872, 42, 1812, 314, 260, 3575, 282, 4649, 47, 198, 21350, 42]
LM_EVAL_BODY = {"model": MODEL, "prompt": [CTX + [7042], CTX + [4528]], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": True}


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 log-softmax at every position of each lm-eval prompt, and the tolerance
    the served dtype allows (float32 here; bf16 where the CPU has it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import resolve_dtype
    from engine.model_cache import cached_model_dir

    hf = AutoModelForCausalLM.from_pretrained(cached_model_dir(MODEL), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in LM_EVAL_BODY["prompt"]]
    return out, (2e-3 if resolve_dtype("auto", "cpu") == "float32" else 0.15)


def test_lm_eval_loglikelihood_body_equals_transformers(system, reference):
    """The harness's request, parsed as the harness parses it (token_logprobs[ctxlen:-1], greedy
    when each equals its top_logprobs' best), gives transformers' values; the prompt's first token
    has null, and the cached prefix (the same prompt again) changes nothing."""
    ref, tol = reference
    for _ in range(2):
        r = httpx.post(system.url + "/v1/completions", json=LM_EVAL_BODY, timeout=300)
        assert r.status_code == 200, r.text
        for choice, prompt, lsm in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), LM_EVAL_BODY["prompt"],
                                       ref):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
            assert lp["top_logprobs"][0] is None
            for j, tok in enumerate(prompt[1:], start=1):
                assert lp["token_logprobs"][j] == pytest.approx(float(lsm[j - 1, tok]), abs=tol)
                assert max(lp["top_logprobs"][j].values()) == pytest.approx(float(lsm[j - 1].max()), abs=tol)
            cont = lp["token_logprobs"][len(CTX):-1]
            assert len(cont) == 1 and cont[0] == pytest.approx(float(lsm[len(CTX) - 1, prompt[-1]]), abs=tol)


def test_echo_max_tokens_0_and_prompt_logprobs(system, reference):
    """max_tokens 0 with echo: the prompt and its logprobs, no new token (streamed: the same echo
    chunk); vLLM's prompt_logprobs on completions and chat; a stream asking for those is a 400."""
    ref, tol = reference
    c, prompt = _client(system), LM_EVAL_BODY["prompt"][0]
    text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True).choices[0].text
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == len(prompt) and text.startswith(r.choices[0].text)
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text == r.choices[0].text and first.logprobs.token_logprobs == r.choices[0].logprobs.token_logprobs
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # two prompts x n=2, streamed: each choice's echo carries its own prompt's logprobs
    two = [prompt, LM_EVAL_BODY["prompt"][1][-5:]]
    chunks = list(c.completions.create(model=MODEL, prompt=two, max_tokens=0, echo=True, logprobs=1, n=2, stream=True))
    echo = {ch.choices[0].index: ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs}
    assert {i: len(lp.tokens) for i, lp in echo.items()} == {0: len(prompt), 1: len(prompt), 2: 5, 3: 5}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    got = httpx.post(system.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["prompt_logprobs"]
    chat = httpx.post(system.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "max_tokens": 2, "prompt_logprobs": 0, "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert got[0] is None and len(got) == len(prompt)
    for j, tok in enumerate(prompt[1:], start=1):
        entry = got[j][str(tok)]
        assert entry["logprob"] == pytest.approx(float(ref[0][j - 1, tok]), abs=tol)
        assert 3 <= len(got[j]) <= 4 and min(e["rank"] for e in got[j].values()) == 1
    for bad in ({**body, "stream": True}, {**body, "max_tokens": 0}, {**body, "prompt_logprobs": 21}):
        r = httpx.post(system.url + "/v1/completions", json=bad, timeout=60)
        assert r.status_code == 400, r.text
