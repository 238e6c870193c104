"""The soak's request mix: one seeded random stream of request specs.

Normal requests: chat or completions, streaming or not, max_tokens in [1, max_tokens], stop
strings in a fraction of them, n = 2 or 3 sometimes, greedy or seeded sampling, prompts that
share a system prompt or a prefix (so the host prefix cache gets hits) with a varying tail. Faults,
each a fraction of all requests:
  * disconnect: a long stream (ignore_eos) the client closes after k events;
  * abort: a long request the client closes after a random delay, whatever it has received
    (a non-streaming one usually has nothing yet);
  * invalid: one of invalid_requests() (or a GET of an unknown route), which the server
    must answer with a 4xx OpenAI error.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SYSTEMS = ["You are a helpful assistant.", "You answer in one short sentence.",
           "You are a terse assistant that lists facts."]
TOPICS = ["the moon", "bread", "rivers", "the number seven", "winter", "owls", "copper", "tea", "maps",
          "volcanoes", "chess", "clouds", "bicycles", "salt", "lighthouses", "bees"]
ASKS = ["Tell me about {}.", "Write a short poem about {}.", "List three facts about {}.",
        "Why do people like {}?", "Describe {} to a child."]
PREFIXES = ["Once upon a time, in a village by the sea,", "The following is a list of facts about",
            "Q: What is the capital of France?\nA:", "def fibonacci(n):"]
STOPS = [".", "\n", " the", ",", "!"]


@dataclass(frozen=True)
class Spec:
    """One request to send, and what the client does with it."""
    kind: str  # "chat", "completions", "disconnect", "abort" or "invalid:<name>"
    method: str
    path: str
    body: bytes | None
    stream: bool = False
    n: int = 1
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    close_after_events: int | None = None  # disconnect: close the stream after this many events
    close_after_s: float | None = None  # abort: close the connection after this many seconds

    @property
    def invalid(self) -> bool:
        return self.kind.startswith("invalid:")

    @property
    def fault(self) -> bool:
        return self.invalid or self.kind in ("disconnect", "abort")


def _post(kind: str, path: str, body: dict | bytes, **kw) -> Spec:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Spec(kind, "POST", path, raw, **kw)


def invalid_requests(model: str, max_model_len: int) -> dict[str, tuple[str, dict | bytes]]:
    """name -> (path, body) of requests a correct server refuses with a 4xx."""
    msgs = [{"role": "user", "content": "hi"}]
    return {
        "negative_max_tokens": (CHAT, {"model": model, "messages": msgs, "max_tokens": -5}),
        "n_zero": (CHAT, {"model": model, "messages": msgs, "n": 0}),
        "n_huge": (COMPLETIONS, {"model": model, "prompt": "hi", "n": 10_000}),
        "empty_messages": (CHAT, {"model": model, "messages": []}),
        "missing_messages": (CHAT, {"model": model}),
        "bad_role": (CHAT, {"model": model, "messages": [{"role": "robot", "content": "hi"}]}),
        "wrong_type": (CHAT, {"model": model, "messages": msgs, "temperature": "hot"}),
        "not_json": (CHAT, b"{not json"),
        "invalid_utf8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'),
        "empty_prompt": (COMPLETIONS, {"model": model, "prompt": []}),
        "token_outside_vocab": (COMPLETIONS, {"model": model, "prompt": [10**9], "max_tokens": 1}),
        "prompt_beyond_context": (COMPLETIONS, {"model": model, "prompt": [100] * (max_model_len + 8),
                                                "max_tokens": 1}),
        "max_tokens_beyond_context": (COMPLETIONS, {"model": model, "prompt": "hi", "max_tokens": 10**9}),
        "unknown_model": (CHAT, {"model": "no-such-model", "messages": msgs}),
        "empty_stop": (CHAT, {"model": model, "messages": msgs, "stop": [""]}),
        "logit_bias": (COMPLETIONS, {"model": model, "prompt": "hi", "logit_bias": {"one": 5}}),
        "top_logprobs_alone": (CHAT, {"model": model, "messages": msgs, "top_logprobs": 3}),
    }


class RequestMix:
    """Seeded: the same (seed, fractions) give the same sequence of specs."""

    def __init__(self, rng: random.Random, model: str, max_model_len: int, max_tokens: int = 48,
                 stop_frac: float = 0.25, disconnect_frac: float = 0.08, abort_frac: float = 0.05,
                 invalid_frac: float = 0.07) -> None:
        if disconnect_frac + abort_frac + invalid_frac > 1:
            raise ValueError("fault fractions add up to more than 1")
        self.rng, self.model, self.max_tokens, self.stop_frac = rng, model, max_tokens, stop_frac
        self.fracs = (disconnect_frac, abort_frac, invalid_frac)
        self.invalid = invalid_requests(model, max_model_len)

    def next(self) -> Spec:
        rng, (disc, abort, bad) = self.rng, self.fracs
        x = rng.random()
        if x < bad:
            name = rng.choice(sorted(self.invalid))
            path, body = self.invalid[name]
            if rng.random() < 0.1:
                return Spec("invalid:unknown_route", "GET", "/v1/no-such-route", None)
            return _post(f"invalid:{name}", path, body)
        if x < bad + disc:
            return self._normal("disconnect", stream=True, long=True, close_after_events=rng.randint(1, 8))
        if x < bad + disc + abort:
            return self._normal("abort", stream=rng.random() < 0.3, long=True,
                                close_after_s=round(rng.uniform(0.1, 2.0), 2))
        return self._normal(rng.choice(["chat", "completions"]), stream=rng.random() < 0.5)

    def _normal(self, kind: str, stream: bool, long: bool = False, **client) -> Spec:
        rng = self.rng
        chat = kind == "chat" if kind in ("chat", "completions") else rng.random() < 0.5
        n = 1 if long or rng.random() < 0.85 else rng.choice([2, 3])
        max_tokens = rng.randint(64, 256) if long else rng.randint(1, self.max_tokens)
        with_stop = not long and rng.random() < self.stop_frac
        stop = tuple(rng.sample(STOPS, rng.randint(1, 2))) if with_stop else ()
        body: dict = {"model": self.model, "max_tokens": max_tokens, "n": n, "stream": stream}
        if long:
            body["ignore_eos"] = True
        if stop:
            body["stop"] = list(stop)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, seed=rng.randrange(2**31))
        ask = rng.choice(ASKS).format(rng.choice(TOPICS))
        if chat:
            body["messages"] = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": ask}]
        else:
            body["prompt"] = f"{rng.choice(PREFIXES)} {ask}"
        return _post(kind, CHAT if chat else COMPLETIONS, body, stream=stream, n=n, max_tokens=max_tokens,
                     stop=stop, **client)
