"""Router -> rank messages (the router's ROUTER socket to each rank's DEALER).

Life of the link:
  1. The rank says Hello (rank_router.py); the router answers Welcome, or Reject and the
     rank exits with the reason. PD ranks then get Peers, and again whenever a prefill or
     decode rank joins or dies (prefill ranks connect to the decode ranks listed).
  2. Generate starts a request on the rank; Abort ends it early (client gone, n>1 sibling
     failed). Abort is idempotent: it may cross the request's last TokenEvent. In PD mode
     Abort goes to the prefill and the decode rank of the request, whatever its phase.
  3. Ping every heartbeat interval; a rank that hears nothing for its router timeout
     assumes the router died and exits. Shutdown asks it to exit now.
"""
from __future__ import annotations

import msgspec


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag="welcome"):
    protocol_version: int
    rank_name: str  # how the router names this rank in logs, headers and /health, e.g. "colocated-0"
    heartbeat_interval_s: float  # the rank sends RankStats this often


class Reject(msgspec.Struct, frozen=True, array_like=True, tag="reject"):
    reason: str  # human-readable; the rank logs it and exits non-zero


class PeerInfo(msgspec.Struct, frozen=True, array_like=True):
    name: str  # e.g. "decode-1"
    role: str
    addr: str  # decode ranks: ZeroMQ address of their peer socket; prefill ranks: ""


class Peers(msgspec.Struct, frozen=True, array_like=True, tag="peers"):
    """Every live prefill and decode rank (the whole list each time, not a diff)."""

    peers: list[PeerInfo]


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """engine.sampling_params.SamplingParams as it crosses the wire (same names, same meaning)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus k alternatives
    min_tokens: int = 0
    prefix_cache: bool = True
    include_stop_str_in_output: bool = False
    grammar: tuple[str, str] | None = None  # (kind, text): engine.grammar.GrammarSpec
    cache_salt: str = ""  # the prefix cache's tenant salt ("": none)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob plus k alternatives


class Generate(msgspec.Struct, frozen=True, array_like=True, tag="generate"):
    request_id: str  # unique per router; an n>1 request sends n of these with suffixed ids
    prompt_ids: list[int]
    sampling: Sampling
    sent_at: float  # router wall clock (time.time()), for the queue-phase histogram
    # PD mode: the prefill rank that receives this sends the KV to this decode rank index.
    # -1: the receiving rank decodes itself (a colocated rank, or a decode rank that prefills it).
    decode_rank: int = -1
    # Tokens this request already generated on a rank that died (the router moves it here, to a
    # colocated or decode rank with decode_rank -1): recomputed with the prompt, then decoding goes on.
    resume_ids: list[int] = []


class Abort(msgspec.Struct, frozen=True, array_like=True, tag="abort"):
    request_id: str


class Ping(msgspec.Struct, frozen=True, array_like=True, tag="ping"):
    sent_at: float


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    reason: str


RouterToRank = Welcome | Reject | Peers | Generate | Abort | Ping | Shutdown
