"""Rank -> router messages (each rank's DEALER socket to the router's ROUTER).

  1. Hello once the model is loaded and warmed up (and again every few seconds until
     the router answers). protocol_version stays its first field: see PROTOCOL_VERSION.
  2. TokenBatch: everything one engine step produced, one TokenEvent per request that got
     a token (or finished) in that step. The hot path: array_like.
  3. RankStats every heartbeat interval: load for routing, gauges for /metrics, and the
     router's proof that the rank lives.
  4. CacheEvents after an engine step that stored or evicted host-cache pages (ranks that
     prefill, with a host cache): the router's per-rank prefix index (pd_server/cache_index.py)
     follows them for `cache-aware` routing. In order, per rank; never before Welcome.
  5. RequestError: a request the rank refused (400: invalid for the engine) or lost
     (500: the engine failed). The request is over on the rank.
  6. Goodbye just before a clean exit.
"""
from __future__ import annotations

from typing import Literal

import msgspec


class Hello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    protocol_version: int  # NOTE: always the first field (the router probes it)
    role: str  # one of protocol.ROLES
    index: int  # rank index within its role
    pid: int
    model: str  # served name (engine.model_cache.served_name), must match the router's
    max_model_len: int  # prompt + output tokens the rank accepts
    vocab_size: int
    page_size: int
    pages_total: int
    peer_addr: str = ""  # decode ranks: where prefill ranks connect (prefill_decode.py); else ""
    # Ranks that prefill with a host cache: the root of its page-key chain (hicache.index.namespace_key,
    # 16 bytes; pages are `page_size` tokens), so the router computes the keys CacheEvents name. b"": none.
    cache_root: bytes = b""
    cache_needs_state: bool = False  # hybrid (SWA) model: a hit must end at a page holding a state
    node: str = ""  # the host the rank runs on, for /health ($PDSERVE_NODE under Ray, else the hostname)
    # Ranks with one host cache between them (hicache/shared_index.py) send the same non-empty
    # group: the router keeps one picture of it, fed by all their CacheEvents.
    cache_group: str = ""


class CacheUpdate(msgspec.Struct, frozen=True, array_like=True):
    """One host-cache change (hicache.cache.CacheEvent): a state's key is its page's key."""

    kind: Literal["page_stored", "page_evicted", "state_stored", "state_evicted"]
    keys: list[bytes]  # page keys, each 16 bytes (hicache.index.page_keys)


class CacheEvents(msgspec.Struct, frozen=True, array_like=True, tag="cache"):
    updates: list[CacheUpdate]  # in the order the rank's cache made them


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), best first


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities of a prompt's tokens 1 .. n-1 (engine.outputs.PromptLogprobs): entry j is
    token j+1's given tokens 0 .. j, its rank in the vocabulary, and the k most likely tokens there."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PhaseTimes(msgspec.Struct, frozen=True, array_like=True):
    """Rank wall clocks (time.time()) at each phase boundary of one request.

    The first four come from the rank that prefilled (colocated or prefill rank), the PD
    fields from the decode rank (0.0 in colocated mode).
    """

    arrived: float  # Generate received by the rank
    first_token: float  # first output token sampled (end of prefill)
    finished: float
    prefill_start: float = 0.0  # first prefill chunk scheduled (0.0: unknown)
    handoff_sent: float = 0.0  # PD: KV staged in the prefill rank's handoff pool, Handoff sent
    pull_start: float = 0.0  # PD: decode rank had room and started the read
    pull_end: float = 0.0  # PD: read done, sequence committed to the decode engine
    first_decode: float = 0.0  # PD: the decode rank's first token (its first decode step)


class TokenEvent(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_ids: list[int]  # new tokens, usually one
    text: str  # new text since the last event (the detokenizer never splits a character)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    stop_str: str | None = None  # the stop string that ended the output, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    times: PhaseTimes | None = None  # on the last event only
    # Sampling.prompt_logprobs: with the first token, in a TokenBatch of its own (they can be large)
    prompt_logprobs: PromptLogprobs | None = None


class TokenBatch(msgspec.Struct, frozen=True, array_like=True, tag="tokens"):
    events: list[TokenEvent]
    sent_at: float  # rank wall clock


class RankStats(msgspec.Struct, frozen=True, array_like=True, tag="stats"):
    running: int
    waiting: int  # queue depth
    pages_used: int
    pages_total: int
    swa_slots_free: int
    steps: int  # engine steps so far
    host_cache_lookup_tokens: int = 0  # prompt tokens looked up in the host cache, since start
    host_cache_hit_tokens: int = 0  # of those, tokens served from it
    handoff_pages_used: int = 0  # prefill: handoff-pool pages reserved or pinned (0 when idle)
    handoffs: int = 0  # prefill: handoffs awaiting Pulled; decode: handoffs queued or being pulled
    transfer_bytes: int = 0  # decode: bytes pulled from prefill ranks, since start
    transfer_seconds: float = 0.0  # decode: wall time of those pulls (read start to done), since start
    kv_store_hit_tokens: int = 0  # of host_cache_hit_tokens, those read from the L3 store (--kv-store)
    kv_store_read_bytes: int = 0  # bytes read from the L3 store, since start
    kv_store_written_bytes: int = 0  # bytes written to it, since start
    handoff_pulled_tokens: int = 0  # decode: prompt tokens whose KV was read from a prefill rank, since start
    handoff_reused_tokens: int = 0  # decode: prompt tokens whose KV its own host cache held (not read)
    kv_store_read_seconds: float = 0.0  # time in L3 store reads (lookups that read), since start
    kv_store_write_seconds: float = 0.0  # time in L3 store writes (the writer thread), since start
    kv_store_prefetches: int = 0  # requests whose pages past the host hit were read ahead from L3, since start
    kv_store_prefetch_late: int = 0  # of those, requests that stopped waiting at their deadline (a slow store)
    kv_store_prefetch_wait_seconds: float = 0.0  # time those requests waited for the read-ahead, summed
    kv_store_prefetch_skipped: int = 0  # requests that did not wait: the store was stuck in an earlier read


class RequestError(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    request_id: str
    status: int  # HTTP status the router should answer with: 400 invalid, 500 engine failure
    message: str


class Goodbye(msgspec.Struct, frozen=True, array_like=True, tag="goodbye"):
    reason: str


RankToRouter = Hello | TokenBatch | RankStats | CacheEvents | RequestError | Goodbye
