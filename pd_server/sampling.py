"""OpenAI sampling fields -> the wire Sampling of each sub-request, checked against the model.

Everything a rank would refuse is refused here first, as a 400, so a streaming response
never starts for a request that cannot run: prompt length vs context, max_tokens that
cannot fit, token ids outside the vocabulary, and every SamplingParams range (the engine's
own validator runs here on the router).
"""
from __future__ import annotations

import msgspec

from cluster.protocol.router_rank import Sampling
from engine.sampling_params import SamplingParams
from pd_server.api_models import SamplingRequest
from pd_server.errors import bad_request


def check_prompt(prompt_ids: list[int], max_model_len: int, vocab_size: int, param: str) -> None:
    if not prompt_ids:
        raise bad_request("prompt is empty", param)
    if len(prompt_ids) >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{len(prompt_ids)} tokens (the context must also hold at least one new token)", param)
    if vocab_size and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size):
        raise bad_request(f"prompt token ids must be in [0, {vocab_size})", param)


def fit_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str,
                   cap: int | None = None) -> int:
    """max_tokens for one prompt: as requested if prompt + it fits the context, the rest of
    the context (at most `cap`, the router's --max-tokens-limit) when not given; 400 when it
    cannot fit."""
    room = max_model_len - prompt_len
    if requested is None:
        return room if cap is None else min(room, cap)
    if requested > room:
        raise bad_request(f"max_tokens is {requested}, but the prompt has {prompt_len} tokens and this model's "
                          f"maximum context length is {max_model_len}: at most {room} tokens fit", param)
    return requested


def make_sampling(req: SamplingRequest, max_tokens: int, logprobs: int | None, seed_offset: int, vocab_size: int,
                  extra_stop: tuple[str, ...] = (), grammar: tuple[str, str] | None = None,
                  prompt_logprobs: int | None = None) -> Sampling:
    """The Sampling of choice `seed_offset` (n > 1 with a seed: seed + i, so choices differ
    yet the request as a whole reproduces). Raises a 400 naming the field on bad values, and
    on any token id outside [0, vocab_size) (SamplingParams.token_ids: the ranks check again)."""
    seed = None if req.seed is None else (req.seed + seed_offset) % 2**63
    bias = logit_bias(req.logit_bias)
    s = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=seed,
        stop=tuple(req.stop_list) + tuple(s for s in extra_stop if s not in req.stop_list),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        min_tokens=req.min_tokens,
        grammar=grammar,
        cache_salt=req.cache_salt or "",
        logit_bias=bias,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        params = SamplingParams(**msgspec.structs.asdict(s))
    except ValueError as e:
        raise bad_request(str(e)) from None
    try:
        params.check_vocab(vocab_size)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":")[0]) from None
    return s


def logit_bias(given: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a 400 naming logit_bias for a key that is
    not an integer or a bias outside [-100, 100] (ids are checked against the vocabulary later)."""
    out = []
    for key, bias in (given or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        if not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}",
                              "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)
