"""The prefill rank's handoff pool: where a prompt's KV waits, pinned, until a decode rank pulls it.

One HostPool (hicache/pool.py, a file under /dev/shm) of the rank's own, laid out like the
device pool and registered with the transfer backend (regions PAGES_REGION, STATES_REGION).
It is not the prefix cache: a handoff needs every page of the prompt, the partial last one
included, and the SWA rings as of the prompt's end, not of a page boundary.

A request's pages here go through, exactly once each:
  1. reserve()     at admission, before the engine prefills (so staging never runs out;
                   a full pool holds the prompt back in the rank's queue);
  2. take()        the engine's export_kv hook, once the first token is sampled: the
                   sequence's device pages and SWA slot move into the request's entry (the
                   engine then frees none of them), so the step copies nothing and the first
                   token leaves the rank without waiting for the staging copy;
     stage()       right after the first token is sent: the device pages (the partial last
                   one too) and the SWA slot are copied into the reserved ones, then go back
                   to the device pool;
  3. hand_off()    the Handoff is sent: the lease starts;
     renew()       a Renew from that decode rank (it still holds the handoff, queued for room
                   or reading): the lease runs lease_s from now again;
  4. release()     on Pulled or PullFailed, on lease expiry (`expired`), when the decode peer
                   goes away (`handed_to`), or when the request ends before a handoff (abort,
                   finished at its first token). A second release of the same request is a
                   no-op that returns False: Pulled can race the lease, abort can race Pulled.

NOTE: between take() and stage() a request's device pages belong to no sequence: this sender
alone frees them (stage(), or release() of a taken request, which skips the copy). The rank
loop stages or releases every taken request before the engine's next step, also after a step
that failed halfway (`taken()`), so the device pool never runs short because of them.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.protocol.prefill_decode import PAGES_REGION, STATES_REGION
from engine.kv_cache import KVPool
from engine.sequence import Sequence
from hicache.pool import HostPool, HostPoolLayout
from native.page_copy import copy_pages

log = logging.getLogger(__name__)

RESERVED, HANDED_OFF = "reserved", "handed_off"


@dataclass
class Staged:
    """What RequestOutput.kv_export holds on a prefill rank: where the prompt's KV now is."""

    num_tokens: int
    pages: list[int]  # handoff-pool page ids, in prompt order
    state: int  # handoff-pool state slot; -1 without sliding layers


@dataclass
class _Taken:
    """Device KV that take() moved out of a sequence, waiting for stage()."""

    kv: KVPool
    pages: list[int]  # every device page the sequence held, in prompt order
    slot: int | None  # its SWA slot


@dataclass
class _Entry:
    pages: list[int]
    state: int
    status: str = RESERVED
    peer: bytes = b""  # the decode rank it was handed to
    deadline: float = 0.0  # monotonic; lease end once handed off
    taken: _Taken | None = None  # between take() and stage()


class HandoffSender:
    """Owns the handoff pool's free lists and every request's entry. Not thread-safe: the
    rank's engine thread owns it. `clock` is monotonic seconds (tests pass a fake)."""

    def __init__(self, pool: HostPool, page_size: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.page_size = page_size
        self.lease_s = lease_s
        self.clock = clock
        self.entries: dict[str, _Entry] = {}
        self.released = 0  # releases ever (tests, stats)

    @classmethod
    def for_engine(cls, engine, pool_gb: float, lease_s: float, name: str) -> HandoffSender:
        """A pool of `pool_gb` GiB shaped like `engine`'s KV pool. Raises ValueError when it
        cannot hold one SWA state plus one page."""
        mc, ecfg, kv = engine.model_cfg, engine.cfg, engine.pool
        page_bytes = KVPool.bytes_per_page(mc, ecfg.page_size, ecfg.torch_dtype)
        state_bytes = KVPool.bytes_per_slot(mc, ecfg.torch_dtype)
        budget = int(pool_gb * 2**30)
        num_states = 0
        if mc.swa_layers:  # half the budget at most for states, one per running sequence at most
            num_states = max(1, min(ecfg.max_num_seqs, budget // 2 // state_bytes))
        num_pages = (budget - num_states * state_bytes) // page_bytes if page_bytes else 0
        if num_pages < 1:
            raise ValueError(f"handoff_pool_gb={pool_gb} cannot hold {num_states} SWA state(s) of "
                             f"{state_bytes / 2**20:.1f} MiB plus one page of {page_bytes} bytes")
        layout = HostPoolLayout(
            name=f"pdserve-handoff-{name}-{os.getpid()}-{secrets.token_hex(4)}",
            dtype=str(ecfg.torch_dtype).removeprefix("torch."), num_pages=num_pages,
            page_shape=tuple(kv.full.shape[1:]), num_states=num_states, state_shape=tuple(kv.swa.shape[1:]))
        pool = HostPool.create(layout, pin_cuda=ecfg.torch_device.type == "cuda")
        log.info("handoff pool /dev/shm/%s: %d pages, %d SWA states, %.0f MiB", layout.name, num_pages,
                 num_states, layout.total_bytes / 2**20)
        return cls(pool, ecfg.page_size, lease_s)

    def register(self, backend) -> None:
        """Make the pool readable by decode ranks (before the backend's metadata is sent)."""
        lay = self.pool.layout
        backend.register(PAGES_REGION, self.pool.pages, lay.page_bytes)
        if lay.num_states:
            backend.register(STATES_REGION, self.pool.states, lay.state_bytes)

    def close(self) -> None:
        self.pool.close()

    # ---- life cycle ---------------------------------------------------------------------
    def fits_ever(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.page_size) <= self.pool.num_pages

    def reserve(self, rid: str, num_tokens: int, needs_state: bool) -> bool:
        """Take pages (and a state slot) for a prompt of `num_tokens`; False (taking nothing)
        when the pool is short right now. Raises ValueError for a request id in use."""
        if rid in self.entries:
            raise ValueError(f"request id {rid!r} already holds handoff pages")
        n = -(-num_tokens // self.page_size)
        pool = self.pool
        if n > pool.free_pages or (needs_state and pool.free_states == 0):
            return False
        pages = [pool.alloc_page() for _ in range(n)]
        state = pool.alloc_state() if needs_state else -1
        self.entries[rid] = _Entry(pages, -1 if state is None else state)
        return True

    def take(self, seq: Sequence, kv: KVPool) -> Staged:
        """engine.export_kv: move the sequence's device pages and SWA slot into the request's
        entry, copying nothing (stage() copies them after the first token is sent). Mutates
        `seq` (pages [], swa_slot None): the engine frees neither when it finishes it.
        Precondition: reserve() for this request id succeeded, and its KV is not taken yet."""
        e = self.entries[seq.request_id]
        assert e.taken is None, f"{seq.request_id}: device KV already taken"
        e.taken = _Taken(kv, seq.pages, seq.swa_slot)
        seq.pages, seq.swa_slot = [], None
        return Staged(len(seq.prompt_ids), e.pages, e.state)

    def stage(self, rid: str) -> None:
        """Copy the request's taken device pages (all of the prompt's, the partial last one
        too) and SWA slot into its reserved pages, then free them in the device pool. No-op
        when nothing is taken (staged already, or released)."""
        e = self.entries.get(rid)
        if e is None or e.taken is None:
            return
        t, e.taken = e.taken, None
        try:
            copy_pages(t.kv.full, self.pool.pages, t.pages[:len(e.pages)], e.pages)
            if e.state >= 0:
                copy_pages(t.kv.swa, self.pool.states, [t.slot], [e.state])
            if t.kv.full.is_cuda:
                torch.cuda.synchronize(t.kv.full.device)
        finally:
            _give_back(t)

    def taken(self) -> list[str]:
        """Requests whose device KV is taken and not staged yet (the rank stages or releases
        each before the engine's next step)."""
        return [rid for rid, e in self.entries.items() if e.taken is not None]

    def hand_off(self, rid: str, peer: bytes) -> None:
        """The Handoff went to `peer`: the lease starts now."""
        e = self.entries[rid]
        e.status, e.peer, e.deadline = HANDED_OFF, peer, self.clock() + self.lease_s

    def renew(self, rids: list[str], peer: bytes) -> int:
        """Extend the leases of `rids` handed off to `peer` (others, and released ones, are
        skipped: a Renew can cross a release). Returns how many were extended."""
        until, n = self.clock() + self.lease_s, 0
        for rid in rids:
            e = self.entries.get(rid)
            if e is not None and e.status == HANDED_OFF and e.peer == peer:
                e.deadline = until
                n += 1
        return n

    def release(self, rid: str, why: str) -> bool:
        """Free the request's pages and state slot; False if already released (or unknown)."""
        e = self.entries.pop(rid, None)
        if e is None:
            log.debug("release of %s (%s): already released", rid, why)
            return False
        if e.taken is not None:  # never staged: its device pages go back uncopied
            _give_back(e.taken)
        for p in reversed(e.pages):  # the next reserve() pops them in ascending runs again:
            self.pool.free_page(p)  # a decode rank's pages also come in runs, one NIXL descriptor a run
        if e.state >= 0:
            self.pool.free_state(e.state)
        self.released += 1
        log.debug("released %s (%d pages): %s", rid, len(e.pages), why)
        return True

    def is_handed_off(self, rid: str) -> bool:
        e = self.entries.get(rid)
        return e is not None and e.status == HANDED_OFF

    def expired(self) -> list[str]:
        """Handed-off requests whose lease ran out (not released: the caller does, and fails them)."""
        now = self.clock()
        return [rid for rid, e in self.entries.items() if e.status == HANDED_OFF and e.deadline <= now]

    def handed_to(self, peer: bytes) -> list[str]:
        return [rid for rid, e in self.entries.items() if e.status == HANDED_OFF and e.peer == peer]

    @property
    def pages_used(self) -> int:
        return self.pool.num_pages - self.pool.free_pages

    @property
    def num_handed_off(self) -> int:
        return sum(e.status == HANDED_OFF for e in self.entries.values())


def _give_back(t: _Taken) -> None:
    t.kv.free(t.pages)
    t.kv.free_slot(t.slot)
