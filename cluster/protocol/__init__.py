"""Every message that crosses a process boundary in pdserve, one module per link.

    router_rank.py     router -> rank   (Welcome, Reject, Peers, Generate, Abort, Ping, Shutdown)
    rank_router.py     rank -> router   (Hello, TokenBatch of TokenEvent, RankStats, CacheEvents, RequestError,
                                      Goodbye)
    prefill_decode.py  prefill <-> decode (PeerHello, Handoff; PeerWelcome, PeerReject, Renew, Pulled,
                                      PullFailed)
    codec.py           msgpack encoder and the typed decoder for each direction

Definitions only (plus the codec); the logic lives with the router (pd_server/) and the
ranks (decode/, prefill/).
"""
from __future__ import annotations

from typing import Literal

# Bump PROTOCOL_VERSION whenever a rank built from one commit could misread a message
# from a router built from another:
#   - a field added, removed, renamed, retyped or reordered in any Struct of this package
#     (array_like structs are positional, so order matters there);
#   - a tag changed or a message type added or removed;
#   - a change of meaning (units, a sentinel such as decode_rank=-1, what a status means).
# PeerHello (prefill_decode.py) follows the same rule as Hello for its first two slots.
# Hello's first two array slots (the tag "hello", then protocol_version) never change: the
# router reads them from any Hello, even one it cannot otherwise decode, and refuses the
# rank with a message naming both versions.
# History: 2 added Hello.peer_addr, Peers, the PD PhaseTimes fields, RankStats handoff/transfer
# counters and the prefill_decode.py link. 3 added Hello.cache_root/cache_needs_state and the
# CacheEvents message (host-cache store/evict events for cache-aware routing). 4: a decode rank
# serves a Generate (decode_rank -1) by prefilling it itself (conditional disaggregation, --disagg),
# and its Hello names its host cache (cache_root) and it sends CacheEvents like a prefill rank.
# 5: Sampling.grammar (a constrained request's (kind, text); also in Handoff.sampling), and
# Generate.resume_ids (a request moved from a dead rank). 6: Renew (decode -> prefill: renewable
# handoff leases). 7: Hello.node (the rank's host, for /health). 8: RankStats' L3 counters
# (kv_store_hit_tokens, kv_store_read_bytes, kv_store_written_bytes) and handoff counters
# (handoff_pulled_tokens, handoff_reused_tokens: a decode rank reads only what it lacks).
# 9 added Hello.cache_group (ranks sharing one host cache), Sampling.cache_salt and Sampling.logit_bias.
# 10: Sampling.prompt_logprobs, TokenEvent.prompt_logprobs, RankStats' L3 seconds.
# 11: RankStats' L3 read-ahead counters (kv_store_prefetches, _prefetch_late, _prefetch_wait_seconds,
# _prefetch_skipped).
PROTOCOL_VERSION = 11

# ZMQ_MAXMSGSIZE of every socket that takes frames from another process (cluster/auth.py).
# The largest legitimate frames: a Generate or Handoff of a 1M-token prompt (<= 5 bytes per id in
# msgpack: ~5 MiB), a CacheEvents evicting 1M host pages in one step (17 bytes per key: ~17 MiB),
# a TokenBatch of 1k sequences with 20 top logprobs (~1 MiB). A bigger frame is a bug or an
# attack: ZeroMQ drops the connection it came on rather than buffering it.
MAX_FRAME_BYTES = 64 * 2**20
# A request's prompt logprobs ((prompt tokens - 1) x (k + 1) entries; about 15 bytes each in
# msgpack) travel in a frame of their own: the router refuses more than this (~30 MiB).
MAX_PROMPT_LOGPROB_ENTRIES = 2_000_000

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")
