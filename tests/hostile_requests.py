"""A deterministic corpus of malformed and hostile OpenAI requests, each one the router must refuse.

`corpus(spec, count, seed)` returns a fixed catalogue (whole-body attacks: non-JSON, invalid
UTF-8, deep nesting, huge literals; every field of both endpoints with wrong types, out-of-range,
NaN/Infinity and oversized values; unknown model; broken tools; prompts beyond the context;
every configurable limit just past its bound) followed by seeded mutations of valid requests:
each mutation applies one to three values drawn from the per-field tables of values that are
invalid *whatever the rest of the request holds*, so every request is refused, however the
mutations combine. Used by tests/unit/pd_server/test_router_limits_fuzz.py (in process) and
tests/e2e/test_e2e_fuzz.py (a real system).
"""
from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
NAN, INF = float("nan"), float("inf")
NOT_A_NUMBER = ["abc", [1], {"v": 1}, NAN, INF, -INF]
NOT_A_BOOL = ["maybe", 2, -1, 0.5, [True], {"v": True}]
NOT_A_STRING = [5, 1.5, [], ["a"], {"v": "a"}, True]


@dataclass(frozen=True)
class Limits:
    """What the target server enforces: its RouterConfig limits and its model's context."""

    model: str
    context: int
    vocab: int
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 512
    max_messages: int = 2048
    max_tokens_limit: int = 32768
    max_tools: int = 128
    max_tool_schema_bytes: int = 32768
    max_prompts: int = 128


@dataclass
class Hostile:
    name: str
    path: str
    body: bytes
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    status: int | None = None  # the exact status when one is certain; any 4xx when None
    param: str | None = None  # the error's param, when certain


def valid_chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": "Name one colour."}],
            "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "stop": ["\n\n"], "n": 1, "seed": 7,
            "tools": [weather_tool()], "tool_choice": "auto"}


def valid_completion(model: str) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.5, "n": 1,
            "stop": ["\n"], "seed": 7}


def weather_tool(name: str = "get_weather", parameters: object = None) -> dict:
    params = {"type": "object", "properties": {"city": {"type": "string"}}} if parameters is None else parameters
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _floats(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> list:
    out = [lo - 0.5, hi + 0.5, 1e308, -1e308, *NOT_A_NUMBER]
    return out + [lo] * lo_open + [hi] * hi_open


def _ints(lo: int, hi: int | None) -> list:
    out = [lo - 1, 10**30 if hi is None else -(10**30), "abc", 1.5, [1], {"v": 1}, NAN, INF]
    return out + ([hi + 1, 10**30, 1e300] if hi is not None else [])


def field_table(lim: Limits, path: str) -> dict[str, list]:
    """Field -> values that make a request to `path` invalid, whatever its other fields hold."""
    ctx_words = "word " * (lim.context + 8)
    shared = {
        "model": [*NOT_A_STRING, "no-such-model", ""],
        "n": _ints(1, lim.max_n),
        "temperature": _floats(0.0, 2.0),
        "top_p": _floats(0.0, 1.0, lo_open=True),
        "min_p": _floats(0.0, 1.0),
        "presence_penalty": _floats(-2.0, 2.0),
        "frequency_penalty": _floats(-2.0, 2.0),
        "repetition_penalty": _floats(0.0, 10.0, lo_open=True),
        "top_k": ["abc", 1.5, [1], {"v": 1}, -2, NAN, 10**30],
        "seed": _ints(0, 2**63 - 1),
        "max_tokens": _ints(1, lim.max_tokens_limit),
        "min_tokens": [-1, "abc", 1.5, [1], 10**30, NAN],
        "stop": [5, [5], [""], "", {"v": "x"}, [["x"]], [None], ["s"] * (lim.max_stop + 1),
                 "y" * (lim.max_stop_chars + 1)],
        "stop_token_ids": ["a", ["a"], [1.5], 5, [10**30], [-(10**30)], [lim.vocab], [-1], [1, lim.vocab + 7], [1] * (lim.max_stop + 1), {"v": 1}],
        "stream": NOT_A_BOOL,
        "ignore_eos": NOT_A_BOOL,
        "return_token_ids": NOT_A_BOOL,
        "stream_options": [5, "x", [], {"include_usage": "maybe"}, {"include_usage": 5}],
        "logit_bias": [{"x": 1.0}, {"5": 101}, {"5": -1e9}, {"99999999": 1.0}, {"-1": 1.0}, "x", 5, {"5": "a"}],
        "prompt_logprobs": [21, -1, "abc", 1.5, [1]],
        "user": NOT_A_STRING,
    }
    if path == CHAT:
        msg = {"role": "user", "content": "hi"}
        return {**shared,
                "messages": [
                    [], "hi", 5, None, [5], ["hi"], [{}], [{"role": "robot", "content": "x"}], [{"content": "x"}],
                    [{"role": "user", "content": 5}], [{"role": "user", "content": {"text": "x"}}],
                    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                    [{"role": "user", "content": [{"type": "text"}]}],
                    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                    [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
                    [{"role": "assistant", "tool_calls": "x"}], [{"role": "user", "content": "x", "name": 5}],
                    [msg] * (lim.max_messages + 1), [{"role": "user", "content": ctx_words}]],
                "max_completion_tokens": _ints(1, lim.max_tokens_limit),
                "logprobs": NOT_A_BOOL,
                "top_logprobs": [21, -1, "abc", 1.5],
                "tools": ["x", 5, [5], [{}], [{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}],
                          [weather_tool("")], [weather_tool("f" * 65)], [weather_tool(parameters="notadict")],
                          [weather_tool(parameters=[1, 2])], [weather_tool(5)],
                          [weather_tool(f"f{i}") for i in range(lim.max_tools + 1)],
                          [weather_tool(parameters={"description": "z" * lim.max_tool_schema_bytes})]],
                "tool_choice": ["sometimes", 5, [], {"type": "function"},
                                {"type": "function", "function": {"name": "nope"}}],
                "response_format": [{"type": "xml"}, "json", 5, {}, {"type": "json_schema", "json_schema": 5}],
                "parallel_tool_calls": NOT_A_BOOL}
    return {**shared,
            "prompt": [None, 5, {}, [], [[]], [-1], [lim.vocab + 10], [1.5], [[1, "a"]], ["a", 5], [["x"]],
                       ctx_words, list(range(10, 10 + lim.context + 1)), ["hi"] * (lim.max_prompts + 1)],
            "logprobs": [21, -1, "abc", 1.5, [1]],
            "echo": NOT_A_BOOL,
            "suffix": ["x", 5],
            "best_of": [3, "abc"]}


def _request(path: str, body: object, name: str, **kw) -> Hostile:
    return Hostile(name, path, json.dumps(body).encode(), **kw)


def catalogue(lim: Limits) -> list[Hostile]:
    """Fixed cases: whole-body attacks, then every entry of both field tables, each once."""
    raw = [b"", b"{", b"not json", b"[]", b"null", b"42", b'"text"', b"\xff\xfe\xfd\x00",
           b'{"model": "m", "prompt": "\xff\xfe"}',
           b'{"model": "m", "messages": [{"role": "user", "content": "\xc3"}]}',
           b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
           b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
           b'{"prompt": "a", "n": 1, "n": 1000}', b'{"prompt": "a"} trailing', b"{'prompt': 'single quotes'}",
           b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 1, "bad": }']
    out = [Hostile(f"raw {i} to {path}", path, body) for path in (CHAT, COMPLETIONS) for i, body in enumerate(raw)]
    too_many = lim.max_messages + 1
    out += [
        Hostile("json as text/plain", COMPLETIONS, json.dumps(valid_completion(lim.model) | {"n": 0}).encode(),
                headers={"content-type": "text/plain"}),
        Hostile("GET on a POST route", CHAT, b"", method="GET", status=405),
        Hostile("unknown route", "/v1/nothing-here", b"{}", status=404),
        _request(CHAT, {**valid_chat(lim.model), "model": "no-such-model"}, "unknown model (chat)", status=404,
                 param="model"),
        _request(COMPLETIONS, {**valid_completion(lim.model), "model": "no-such-model"}, "unknown model", status=404,
                 param="model"),
        _request(CHAT, {k: v for k, v in valid_chat(lim.model).items() if k != "messages"}, "no messages", status=400,
                 param="messages"),
        _request(COMPLETIONS, {k: v for k, v in valid_completion(lim.model).items() if k != "prompt"}, "no prompt",
                 status=400, param="prompt"),
        _request(CHAT, {**valid_chat(lim.model), "messages": [{"role": "user", "content": "\ud800"}]},
                 "lone surrogate in chat"),
        _request(COMPLETIONS, {**valid_completion(lim.model), "prompt": "a\udfff"}, "lone surrogate in prompt"),
        *[Hostile(f"tool schema nested {2 * d} deep", CHAT, _nested_tool(lim, d)) for d in (240, 480, 5000)],
        _request(COMPLETIONS, {**valid_completion(lim.model), "n": lim.max_n + 1}, "n past --max-n", status=400,
                 param="n"),
        _request(COMPLETIONS, {**valid_completion(lim.model), "max_tokens": lim.max_tokens_limit + 1},
                 "max_tokens past its limit", status=400, param="max_tokens"),
        _request(CHAT, {**valid_chat(lim.model), "messages": [{"role": "user", "content": "x"}] * too_many},
                 "messages past --max-messages", status=400, param="messages"),
        _request(COMPLETIONS, {**valid_completion(lim.model), "prompt": ["a"] * (lim.max_prompts + 1)},
                 "prompts past --max-prompts", status=400, param="prompt"),
    ]
    for path, base in ((CHAT, valid_chat(lim.model)), (COMPLETIONS, valid_completion(lim.model))):
        for name, values in field_table(lim, path).items():
            out += [_request(path, {**base, name: v}, f"{path} {name}={_short(v)}") for v in values]
    return out


def mutations(lim: Limits, count: int, seed: int) -> list[Hostile]:
    """`count` seeded mutations of the valid requests: 1-3 invalid field values (a field may
    also be dropped when required, or nested into a message), streaming on or off at random."""
    rng = random.Random(seed)
    tables = {path: field_table(lim, path) for path in (CHAT, COMPLETIONS)}
    out = []
    for i in range(count):
        path = rng.choice((CHAT, COMPLETIONS))
        body = copy.deepcopy(valid_chat(lim.model) if path == CHAT else valid_completion(lim.model))
        body["stream"] = rng.random() < 0.5
        table = tables[path]
        names = rng.sample(sorted(table), rng.randint(1, 3))
        for name in names:
            body[name] = copy.deepcopy(rng.choice(table[name]))
        if path == CHAT and rng.random() < 0.2 and isinstance(body["messages"], list):
            body["messages"] = [*valid_chat(lim.model)["messages"], *(body["messages"] or [])][:40]
            if not any(isinstance(m, dict) and m.get("role") == "robot" for m in body["messages"]):
                body["messages"].append({"role": rng.choice(["robot", 5, None]), "content": "x"})
        out.append(_request(path, body, f"mutation {i}: {', '.join(names)}"))
    return out


def corpus(lim: Limits, count: int, seed: int = 1234) -> list[Hostile]:
    """The catalogue, then mutations up to `count` requests in all (at least the catalogue)."""
    fixed = catalogue(lim)
    return fixed + mutations(lim, max(0, count - len(fixed)), seed)


def _nested_tool(lim: Limits, depth: int) -> bytes:
    """A chat request whose one tool's schema nests 2 * depth objects (json.dumps would recurse)
    and whose prompt is past the context, so it is refused even when the schema is accepted."""
    schema = '{"type": "object", "properties": {"x": ' * depth + '{"type": "string"}' + "}}" * depth
    long = [{"role": "user", "content": "word " * (lim.context + 8)}]
    head = json.dumps({**valid_chat(lim.model), "messages": long, "tools": "@"})
    tool = '[{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]"
    return head.replace('"@"', tool).encode()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"
