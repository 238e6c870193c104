"""POST /tokenize and /detokenize (vLLM's shapes), on the router's own tokenizer: no rank is
involved, so they answer while ranks load or are busy.

    /tokenize    {"prompt": text, "add_special_tokens": true} or {"messages": [...], "tools": [...],
                 "add_generation_prompt": true}, "return_token_strs": false
                 -> {"count", "max_model_len", "tokens", "token_strs"}
                 A conversation is rendered exactly as /v1/chat/completions renders it
                 (prompts.py: the model's template, or the fallback), so `tokens` are the
                 ids a chat completion of the same messages would prefill.
    /detokenize  {"tokens": [ids]} -> {"prompt": text}; an id outside the vocabulary is a 400.
Both check `model` like the completions routes (404 for another model) and count the
conversation's size against the same limits as chat completions (limits.py).
"""
from __future__ import annotations

import msgspec

from pd_server.api_models import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from pd_server.errors import bad_request
from pd_server.limits import check_chat
from pd_server.serving import ServerContext


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def tokenize(req: TokenizeRequest, ctx: ServerContext) -> TokenizeResponse:
    """Request-sized work: the app runs it off the event loop (ServerContext.offload). A text
    that could never fit the context is refused before it is tokenized."""
    ctx.check_model(req.model)
    tok = ctx.tok
    max_len = ctx.registry.max_model_len
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools)
        check_chat(chat, ctx.cfg)
        ids = ctx.renderer.render(chat, req.add_generation_prompt,
                                  lambda text: ctx.check_prompt_chars(text, max_len, "messages")).prompt_ids
    else:
        ctx.check_prompt_chars(req.prompt, max_len, "prompt")
        ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
    strs = list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return TokenizeResponse(len(ids), ctx.registry.max_model_len, ids, strs)


def detokenize(req: DetokenizeRequest, ctx: ServerContext) -> DetokenizeResponse:
    ctx.check_model(req.model)
    vocab = len(ctx.tok)
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"tokens.{bad}: {req.tokens[bad]} is not a token id (the vocabulary has {vocab})",
                          f"tokens.{bad}")
    return DetokenizeResponse(ctx.tok.decode(req.tokens))
