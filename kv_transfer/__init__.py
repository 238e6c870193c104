"""KV transfer data plane: READ whole pages out of a peer process's registered page pools.

`base.py` is the interface and its metadata wire format; `nixl_backend.py` moves pages with
NIXL (UCX), `shm_backend.py` through shared memory on one host. `make_backend` picks one.
"""
from __future__ import annotations

import logging
from typing import Literal

from kv_transfer.base import TransferBackend, TransferHandle, TransferStatus

__all__ = ["TransferBackend", "TransferHandle", "TransferStatus", "TransferKind", "make_backend"]

logger = logging.getLogger(__name__)

TransferKind = Literal["auto", "nixl", "shm"]


def make_backend(kind: TransferKind, agent_name: str, *, serves_peers: bool = True) -> TransferBackend:
    """The transfer backend for `--transfer kind`, logging the choice.

    "auto" takes NIXL when it imports and its agent starts with UCX, else shared memory.
    `agent_name` names this process's NIXL agent and must be unique among all peers
    (role, rank index and the run's suffix). `serves_peers`: whether peers read from this
    process (a prefill rank: True; a decode rank only reads: False, see
    `NixlBackend(progress_thread=...)`). "nixl" raises ImportError / RuntimeError when NIXL
    cannot start.
    """
    if kind not in ("auto", "nixl", "shm"):
        raise ValueError(f"unknown transfer backend {kind!r} (auto, nixl or shm)")
    if kind != "shm":
        from kv_transfer.nixl_backend import NixlBackend

        try:
            backend: TransferBackend = NixlBackend(agent_name, progress_thread=serves_peers)
        except (ImportError, RuntimeError) as e:
            if kind == "nixl":
                raise
            logger.warning("transfer: NIXL unavailable (%s); using shared memory", e)
        else:
            logger.info("transfer: NIXL (UCX) agent %s", agent_name)
            return backend
    from kv_transfer.shm_backend import ShmBackend

    logger.info("transfer: shared memory (%s)", "chosen" if kind == "shm" else "fallback")
    return ShmBackend()
