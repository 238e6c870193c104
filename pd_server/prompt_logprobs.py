"""Prompt logprobs as the APIs return them: completions' `echo` + `logprobs` (OpenAI's legacy
shape, the prompt's first token with a null logprob; what lm-evaluation-harness reads for every
log-likelihood task) and vLLM's `prompt_logprobs` (chat and completions).

The rank computes them during prefill (engine.model_runner.fill_prompt_logprobs: the model's raw
log-softmax, the whole prompt computed, no prefix-cache hit) and sends them with the first token
(TokenEvent.prompt_logprobs); here they become JSON.
"""
from __future__ import annotations

from cluster.protocol import MAX_PROMPT_LOGPROB_ENTRIES
from cluster.protocol.rank_router import PromptLogprobs
from pd_server.errors import bad_request
from pd_server.responses import CompletionLogprobs, PromptLogprob, PromptLogprobsOut


def check_size(prompt_len: int, k: int | None, param: str) -> None:
    """A 400 for prompt logprobs too large to send ((prompt_len - 1) x (k + 1) entries)."""
    if k is not None and (prompt_len - 1) * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(f"{param}: a prompt of {prompt_len} tokens with {k} alternatives each is more than "
                          f"{MAX_PROMPT_LOGPROB_ENTRIES} logprob entries; ask for fewer alternatives", param)


def echo_logprobs(token_text, prompt_ids: list[int], plp: PromptLogprobs | None, k: int) -> CompletionLogprobs:
    """The echoed prompt's part of the legacy logprobs: every prompt token, the first with null
    logprob and top_logprobs, offsets from the prompt's start. `token_text`: id -> text."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    n = len(prompt_ids) - 1
    lps: list[float | None] = [None] * len(prompt_ids)
    tops: list[dict[str, float] | None] = [None] * len(prompt_ids)
    if plp is not None:
        lps[1:] = plp.logprobs[:n]
        tops[1:] = [{token_text(i): v for i, v in zip(ids[:k], vals[:k])}
                    for ids, vals in zip(plp.top_ids[:n], plp.top_logprobs[:n])]
    return CompletionLogprobs(tokens, lps, tops, offsets)


def joined(a: CompletionLogprobs, b: CompletionLogprobs | None) -> CompletionLogprobs:
    if b is None:
        return a
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                              a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


def vllm_prompt_logprobs(token_text, prompt_ids: list[int], plp: PromptLogprobs | None, k: int) -> PromptLogprobsOut:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the k most likely there (k + 1 entries, or k when it is one)."""
    out: PromptLogprobsOut = [None]
    if plp is None:
        return out + [None] * (len(prompt_ids) - 1)
    for j, tok in enumerate(prompt_ids[1:]):
        entry = {str(tok): PromptLogprob(plp.logprobs[j], plp.ranks[j], token_text(tok))}
        for r, (i, v) in enumerate(zip(plp.top_ids[j][:k], plp.top_logprobs[j][:k])):
            entry.setdefault(str(i), PromptLogprob(v, r + 1, token_text(i)))
        out.append(entry)
    return out
