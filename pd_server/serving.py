"""What the chat and completions handlers share: the server context, result collection with
client-disconnect aborts, logprobs and usage (the streaming response: sse_response.py).

ServerContext is the one object handlers reach everything through (app.state.ctx); there
are no module-level globals.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.protocol.rank_router import PromptLogprobs, TokenEvent, TokenLogprob
from pd_server.config import RouterConfig
from pd_server.dispatcher import Dispatcher
from pd_server.errors import APIError
from pd_server.metrics import RouterMetrics
from pd_server.prompts import ChatRenderer
from pd_server.ranks import RankRegistry
from pd_server.request_state import ClientGone, Handle
from pd_server.security import tenant
from pd_server.structured import CompileGate
from pd_server.responses import (ChatLogprobs, CompletionLogprobs, LogprobEntry, TopLogprob, Usage,
                                 make_usage)
from pd_server.sse_response import watch_disconnect


@dataclass
class ServerContext:
    cfg: RouterConfig
    model_name: str  # the served id
    model_aliases: frozenset[str]  # ids a request may name: the served id and the --model argument
    tokenizer: object
    renderer: ChatRenderer
    registry: RankRegistry
    dispatcher: Dispatcher
    metrics: RouterMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)
    _grammars: object = None  # engine.grammar.GrammarCompiler, made on the first structured request
    grammar_gate: CompileGate = field(default_factory=CompileGate)  # the router's compilations (structured.py)
    responses: object = None  # response_store.ResponseStore (build_app makes it from cfg)
    # Request-sized work (rendering, tokenizing, large response bodies) runs here, never on the
    # event loop: the loop also carries every stream's tokens and the ranks' heartbeats, and a
    # rank whose router is silent for 5 s exits. Bounded: at most this many run at once.
    work: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="request-work"))

    @property
    def tok(self):
        """This thread's tokenizer (ChatRenderer.tokenizer): use it, never `tokenizer`, which
        is the original the copies are made from."""
        return self.renderer.tokenizer

    async def offload(self, fn, *args):
        """fn(*args) on the request-work pool, awaited; its exceptions (APIError) propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters any one token spells (a byte-level token's length is its bytes,
        at least its characters): a text of more than max_model_len times this cannot fit."""
        return max((len(t) for t in self.tok.get_vocab()), default=1) or 1

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Characters past which a prompt is refused before it is tokenized (it has at least
        max_model_len tokens then); while no rank has said its context, that of a 128k one."""
        return (max_model_len or 131072) * self.longest_token_chars

    def check_prompt_chars(self, text: str, max_model_len: int, param: str) -> None:
        """A 400, before any tokenizing, for a text too long to fit the context."""
        cap = self.max_prompt_chars(max_model_len)
        max_model_len = max_model_len or 131072
        if len(text) > cap:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(text)} characters, more than that many tokens spell (at most {cap})",
                           param=param)

    def tenant_salt(self, request, salt: str | None) -> str | None:
        """A request's cache_salt; with --cache-salt-from-key, its tenant (API key) folded in, so
        one key's prompts are never a prefix-cache hit for another's."""
        who = tenant(request) if self.cfg.cache_salt_from_key else ""
        if not who:
            return salt
        return hashlib.sha256(f"{who}\0{salt or ''}".encode()).hexdigest()

    def new_choice(self) -> Choice:
        """A Choice to accumulate into; --no-cache-usage-details keeps cached_tokens at 0."""
        return Choice(hide_cached=not self.cfg.cache_usage_details)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def limits(self) -> tuple[int, int]:
        """(max_model_len, vocab_size) the live ranks accept; 503 while none lives."""
        live = [r.hello for r in self.registry.live() if r.hello]
        if not live:
            status = self.registry.status
            raise APIError(503, "the model is still loading; retry shortly" if status == "loading"
                           else "no live rank can serve this model")
        return min(h.max_model_len for h in live), min(h.vocab_size for h in live)

    def grammar_compiler(self, vocab_size: int):
        """The router's grammar compiler (structured.py) for the ranks' vocabulary size."""
        from engine.grammar import GrammarCompiler

        g = self._grammars
        if g is None or g.vocab_size != vocab_size:
            eos = getattr(self.tok, "eos_token_id", None)
            # (called on the compiling worker thread: its own copy)
            g = self._grammars = GrammarCompiler(lambda: self.tok, vocab_size, [] if eos is None else [eos])
        return g

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return t


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One choice, accumulated from its TokenEvents."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_str: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked for
    hide_cached: bool = False  # --no-cache-usage-details: cached_tokens stays 0

    def add(self, ev: TokenEvent) -> None:
        if ev.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = ev.prompt_logprobs
        self.token_ids += ev.token_ids
        if ev.text:
            self.text.append(ev.text)
        if ev.logprobs:
            self.logprobs += ev.logprobs
        self.completion_tokens = ev.completion_tokens
        self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, 0 if self.hide_cached else ev.cached_tokens
        if ev.finish_reason is not None:
            self.finish_reason, self.stop_str = ev.finish_reason, ev.stop_str

    def count(self, ev: TokenEvent) -> None:
        """Only what usage() reads (a stream renders the rest as it goes); idempotent."""
        self.completion_tokens = ev.completion_tokens
        self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, 0 if self.hide_cached else ev.cached_tokens


async def collect(handle: Handle, receive, hide_cached: bool = False) -> list[Choice]:
    """Run a non-streaming request to the end. The client going away aborts it on the rank
    (APIError 499); `receive`: the request's ASGI receive; `hide_cached`: see Choice."""
    choices = [Choice(hide_cached=hide_cached) for _ in handle.sub_ids]
    watch = watch_disconnect(receive, handle)
    try:
        async for batch in handle.batches():
            for idx, ev in batch:
                choices[idx].add(ev)
    except ClientGone:
        raise APIError(499, "client disconnected") from None
    finally:
        watch.cancel()
        handle.close()
    return choices


def usage(choices: list[Choice], prompts: int = 1) -> Usage:
    """OpenAI counts each prompt once, however many choices it has (n)."""
    per = max(1, len(choices) // max(1, prompts))
    prompt = sum(c.prompt_tokens for c in choices[::per])
    cached = sum(c.cached_tokens for c in choices[::per])
    return make_usage(prompt, sum(c.completion_tokens for c in choices), cached)


def chat_logprobs(ctx: ServerContext, lps: list[TokenLogprob]) -> ChatLogprobs:
    def entry(lp: TokenLogprob) -> LogprobEntry:
        text = ctx.token_text(lp.token_id)
        top = [TopLogprob(ctx.token_text(i), v, list(ctx.token_text(i).encode())) for i, v in lp.top]
        return LogprobEntry(text, lp.logprob, list(text.encode()), top)

    return ChatLogprobs([entry(lp) for lp in lps])


def completion_logprobs(ctx: ServerContext, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    tokens, offsets = [], []
    for lp in lps:
        t = ctx.token_text(lp.token_id)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
    tops = [{ctx.token_text(i): v for i, v in lp.top} for lp in lps]
    return CompletionLogprobs(tokens, [lp.logprob for lp in lps], tops, offsets)


def route_headers(handle: Handle, request_id: str, details: bool = True) -> dict[str, str]:
    """x-request-id, and (`details`: not with --no-cache-usage-details) the ranks that serve it."""
    if not details:
        return {"x-request-id": request_id}
    headers = {"x-request-id": request_id, "x-pdserve-rank": handle.rank.name}
    if handle.decode is not None:
        headers["x-pdserve-decode-rank"] = handle.decode.name
    elif handle.rank.role == "decode":  # PD, prefilled on the decode rank (--disagg): it decodes too
        headers["x-pdserve-decode-rank"] = handle.rank.name
    return headers
