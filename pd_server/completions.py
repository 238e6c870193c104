"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of token ids.

Each prompt gets n choices, indexed prompt-major (prompt i, choice j -> index i * n + j),
all submitted to one rank. Text prompts are tokenized with the tokenizer's special tokens
(a BOS where the model wants one); token-id prompts go as given. Streaming sends one chunk
per token event and a last chunk per choice with its finish_reason.
"""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from cluster.protocol.rank_router import TokenEvent
from pd_server import sse
from pd_server.api_models import CompletionRequest
from pd_server.errors import APIError, error_body
from pd_server.prompt_logprobs import check_size, echo_logprobs, joined, vllm_prompt_logprobs
from pd_server.responses import Completion, CompletionChoice, to_json
from pd_server.routing import RouteRequest
from pd_server.sampling import check_prompt, fit_max_tokens, make_sampling
from pd_server.serving import ServerContext, collect, completion_logprobs, new_request_id, route_headers, usage
from pd_server.sse_response import SSEStream


async def create_completion(req: CompletionRequest, request: Request, ctx: ServerContext) -> Response:
    arrival = time.perf_counter()
    ctx.check_model(req.model)
    max_len, vocab = ctx.limits()

    def tokenize() -> list[list[int]]:  # request-sized work: off the event loop
        prompts = []
        for p in req.prompts:
            if isinstance(p, str):
                ctx.check_prompt_chars(p, max_len, "prompt")
                p = list(ctx.tok(p).input_ids)
            check_prompt(p, max_len, vocab, "prompt")
            prompts.append(p)
        return prompts

    prompts = await ctx.offload(tokenize)
    work = []
    k = req.num_prompt_logprobs
    for ids in prompts:
        max_tokens = fit_max_tokens(req.requested_max_tokens, len(ids), max_len, "max_tokens",
                                ctx.cfg.max_tokens_limit)
        check_size(len(ids), k, "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")
        work += [(ids, make_sampling(req, max_tokens, req.logprobs, j, vocab, prompt_logprobs=k)) for j in range(req.n)]
    rid = new_request_id("cmpl")
    handle = ctx.dispatcher.submit(rid, work, RouteRequest(prompts[0], len(work), cache_salt=req.cache_salt or ""), arrival)
    headers = route_headers(handle, rid, ctx.cfg.cache_usage_details)
    echoes = [_echo(ctx, req, p) for p in req.prompts] if req.echo else None
    if req.stream:
        return SSEStream(handle, _CompletionStream(ctx, req, handle, rid, echoes, prompts), headers)
    choices = await collect(handle, request.receive, not ctx.cfg.cache_usage_details)

    def build() -> bytes:  # prompts x n x max_tokens x logprobs entries: request-sized work
        out = []
        for i, c in enumerate(choices):
            if req.prompt_only:  # the rank's one token is not part of the answer
                c.token_ids, c.text, c.logprobs, c.completion_tokens, c.finish_reason = [], [], [], 0, "length"
            prefix = echoes[i // req.n] if echoes else ""
            lp = completion_logprobs(ctx, c.logprobs, len(prefix)) if req.logprobs is not None else None
            if lp is not None and req.echo:
                lp = joined(echo_logprobs(ctx.token_text, work[i][0], c.prompt_logprobs, req.logprobs), lp)
            choice = CompletionChoice(i, prefix + "".join(c.text), c.finish_reason, lp)
            if req.return_token_ids:
                choice.token_ids, choice.prompt_token_ids = c.token_ids, work[i][0]
            if req.prompt_logprobs is not None:
                choice.prompt_logprobs = vllm_prompt_logprobs(ctx.token_text, work[i][0], c.prompt_logprobs,
                                                              req.prompt_logprobs)
            out.append(choice)
        return to_json(Completion(rid, int(time.time()), ctx.model_name, out, usage=usage(choices, len(prompts))))

    return Response(await ctx.offload(build), media_type="application/json", headers=headers)


def _echo(ctx: ServerContext, req: CompletionRequest, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else ctx.tok.decode(prompt, skip_special_tokens=False)


class _CompletionStream:
    """Renders one completions request's events as SSE chunks (sse_response.StreamRenderer).

    An echo is each choice's first chunk: at once, or, with logprobs, beside the first token
    (whose event brings the prompt's logprobs). With max_tokens 0 the token itself is left out."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, handle, rid: str, echoes: list[str] | None,
                 prompt_ids: list[list[int]]) -> None:  # (prompt_ids: one per prompt, as echoes)
        self.ctx, self.req, self.rid, self.echoes, self.prompt_ids = ctx, req, rid, echoes, prompt_ids
        self.created, self.model = int(time.time()), ctx.model_name
        n = len(handle.sub_ids)
        self.choices = [ctx.new_choice() for _ in range(n)]
        self.offsets = [len(echoes[i // req.n]) if echoes else 0 for i in range(n)]
        self.echo_later = bool(echoes) and req.logprobs is not None  # the echo waits for its logprobs
        self.echoed = [not self.echo_later] * n
        # the template fast path
        self.plain = req.logprobs is None and not req.return_token_ids and not req.prompt_only
        self.text_events = sse.TextEvents(
            lambda idx, text: Completion(rid, self.created, self.model, [CompletionChoice(idx, text, None)]))

    def _event(self, choices: list[CompletionChoice], **kw) -> bytes:
        return sse.event(Completion(self.rid, self.created, self.model, choices, **kw))

    def head(self) -> bytes:
        if not self.echoes or self.echo_later:
            return b""
        return b"".join(self._event([CompletionChoice(i, self.echoes[i // self.req.n], None)])
                        for i in range(len(self.choices)))

    def fast(self, idx: int, ev: TokenEvent) -> bytes | None:
        """The event of a text-only token from its template; None off the fast path."""
        if not self.plain:
            return None
        self.choices[idx].count(ev)
        return self.text_events.event(idx, ev.text)

    def render(self, batch) -> bytes:
        out = []
        for idx, ev in batch:
            chunk = self.fast(idx, ev)
            if chunk is None:
                self.choices[idx].count(ev)
                if not self.echoed[idx]:
                    self.echoed[idx] = True
                    out.append(self._echo(idx, ev))
                chunk = b"" if self.req.prompt_only else self._token(idx, ev)
            out.append(chunk)
            if ev.finish_reason is not None:
                reason = "length" if self.req.prompt_only else ev.finish_reason
                out.append(self._event([CompletionChoice(idx, "", reason)]))
        return b"".join(out)

    def _echo(self, idx: int, ev: TokenEvent) -> bytes:
        lp = echo_logprobs(self.ctx.token_text, self.prompt_ids[idx // self.req.n], ev.prompt_logprobs,
                           self.req.logprobs)
        return self._event([CompletionChoice(idx, self.echoes[idx // self.req.n], None, lp)])

    def _token(self, idx: int, ev: TokenEvent) -> bytes:
        lp = None
        if self.req.logprobs is not None and ev.logprobs:
            lp = completion_logprobs(self.ctx, ev.logprobs, self.offsets[idx])
        self.offsets[idx] += len(ev.text)
        choice = CompletionChoice(idx, ev.text, None, lp)
        if self.req.return_token_ids:
            choice.token_ids = ev.token_ids
        return self._event([choice])

    def tail(self) -> bytes:
        if not self.req.include_usage:
            return b""
        if self.req.prompt_only:
            for c in self.choices:
                c.completion_tokens = 0
        return self._event([], usage=usage(self.choices, len(self.choices) // self.req.n))

    def error(self, err: APIError) -> bytes:
        return sse.event(error_body(err))
