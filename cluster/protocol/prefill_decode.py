"""Prefill rank <-> decode rank messages (each prefill rank's DEALER to each decode rank's ROUTER).

The decode rank binds its peer socket at `Hello.peer_addr`; the router passes the addresses
on in `Peers` (router_rank.py), and each prefill rank connects to every live decode rank.
Life of a connection and of one handed-off request:
  1. PeerHello (prefill -> decode), first on every connection: protocol version, the prefill
     rank's name and its transfer backend's metadata (NIXL agent metadata or shm file names of
     its handoff pool). The decode rank adds the peer to its backend and answers PeerWelcome,
     or PeerReject with the reason (the prefill rank then fails its handoffs to that rank).
  2. Handoff (prefill -> decode): a request whose first token is sampled and whose prompt KV
     sits pinned in the prefill rank's handoff pool (page ids + an SWA state slot). Tensors
     never ride here: the decode rank READs those pages through the transfer backend.
  3. Renew (decode -> prefill) every lease_s / 3 while the decode rank holds the handoff
     (queued for room, or being read): the prefill rank extends those requests' leases to
     lease_s from the Renew's arrival. A live decode rank that is full keeps its handoffs; only
     a dead or silent one lets a lease run out.
  4. Pulled (decode -> prefill) once the read is over, or PullFailed (read failed, aborted,
     no room within the decode rank's --handoff-wait-s): the prefill rank releases the pins,
     exactly once. Without either, and without a Renew, for `lease_s`, the prefill rank
     releases them anyway and fails the request at the router; the decode rank never starts a
     read later than lease_s minus a safety margin after it received the handoff or last sent
     a Renew for it.
"""
from __future__ import annotations

import msgspec

from cluster.protocol.router_rank import Sampling

# Transfer regions a prefill rank registers (its handoff pool) and a decode rank reads into
# (its KV pool); the names are part of the contract between the two.
PAGES_REGION = "kv_pages"  # [num_pages, num_full_layers, 2, page_size, kvh, hd]
STATES_REGION = "swa_states"  # [num_slots, num_swa_layers, 2, window, kvh, hd]


class PeerHello(msgspec.Struct, frozen=True, array_like=True, tag="peer_hello"):
    protocol_version: int  # NOTE: always the first field (the decode rank probes it)
    name: str  # the prefill rank's name, e.g. "prefill-0"
    pid: int
    transfer_kind: str  # "nixl" | "shm": both ranks must use the same
    transfer_metadata: bytes  # TransferBackend.metadata() of the prefill rank


class PeerWelcome(msgspec.Struct, frozen=True, array_like=True, tag="peer_welcome"):
    name: str  # the decode rank's name


class PeerReject(msgspec.Struct, frozen=True, array_like=True, tag="peer_reject"):
    name: str  # the decode rank's name
    reason: str


class PrefillTimes(msgspec.Struct, frozen=True, array_like=True):
    """The prefill rank's wall clock (time.time()) at its phase boundaries of one request."""

    arrived: float  # Generate received
    prefill_start: float  # first prefill chunk scheduled
    first_token: float  # first token sampled (end of prefill)
    handoff_sent: float  # KV staged in the handoff pool, Handoff sent


class Handoff(msgspec.Struct, frozen=True, array_like=True, tag="handoff"):
    request_id: str
    prompt_ids: list[int]
    first_token: int  # sampled by the prefill rank (already streamed to the router)
    sampling: Sampling
    cached_tokens: int  # prompt tokens the prefill rank took from its prefix cache (usage)
    pages: list[int]  # handoff-pool page ids holding positions [i*page_size, (i+1)*page_size) of the
    #                   prompt, in order; the last may be partial (len(prompt_ids) tokens in all)
    swa_state: int  # handoff-pool state slot with the SWA rings as of the prompt's end; -1: none
    lease_s: float  # the pins hold this long after times.handoff_sent
    times: PrefillTimes


class Pulled(msgspec.Struct, frozen=True, array_like=True, tag="pulled"):
    request_id: str


class Renew(msgspec.Struct, frozen=True, array_like=True, tag="renew"):
    """The decode rank still holds these handoffs (queued or being read): keep their pins."""

    request_ids: list[str]


class PullFailed(msgspec.Struct, frozen=True, array_like=True, tag="pull_failed"):
    request_id: str
    reason: str  # human-readable, for logs


PrefillToDecode = PeerHello | Handoff
DecodeToPrefill = PeerWelcome | PeerReject | Renew | Pulled | PullFailed
