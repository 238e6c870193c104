"""Shared fakes for the handoff state machines (tests/unit/decode/test_handoff_*.py, tests/unit/prefill/).

FakeBackend: a TransferBackend look-alike whose peers live in the same process (a shared
`FakeWorld` maps owner names to registered tensors). Reads copy real bytes, either at once
(`auto=True`) or when the test calls `complete()`, so a test decides when a pull ends and
whether it fails. It records every read, so tests can check exactly which pages moved.
FakeEngine: the part of LLMEngine a HandoffReceiver drives (reserve/release/commit), with a
page and sequence budget the test sets.
FakeClock: monotonic time the test advances.
InlineExecutor: an Executor that runs each call at once on the caller's thread, for router tests
that step the event loop by hand (ServerContext.offload then finishes within a few loop turns).
"""
from __future__ import annotations

import itertools
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from engine.outputs import KVReservation
from kv_transfer.base import TransferHandle


class InlineExecutor(Executor):
    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            f.set_exception(e)
        return f


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FakeWorld:
    regions: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (owner, region) -> pages


@dataclass
class Read:
    peer: str
    remote_region: str
    remote_pages: list[int]
    local_region: str
    local_pages: list[int]
    handle: TransferHandle
    state: str = "pending"


class FakeBackend:
    def __init__(self, name: str, world: FakeWorld, auto: bool = True, kind: str = "shm") -> None:
        self.name, self.world, self.auto, self.kind = name, world, auto, kind
        self.peers: dict[str, str] = {}  # peer id -> owner name
        self.reads: list[Read] = []
        self.removed: list[str] = []
        self.refuse = ""  # set: add_peer raises ValueError with it
        self._ids = itertools.count()

    def register(self, name: str, tensor: torch.Tensor, page_bytes: int) -> None:
        self.world.regions[(self.name, name)] = tensor

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, peer_id: str, metadata: bytes) -> None:
        if self.refuse:
            raise ValueError(self.refuse)
        self.peers[peer_id] = metadata.decode()

    def remove_peer(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)
        self.removed.append(peer_id)
        for r in self.reads:
            if r.peer == peer_id and r.state == "pending":
                r.state = "failed"

    def read(self, peer_id, remote_region, remote_pages, local_region, local_pages) -> TransferHandle:
        if peer_id not in self.peers:
            raise KeyError(f"unknown peer {peer_id!r}")
        src = self.world.regions[(self.peers[peer_id], remote_region)]
        handle = TransferHandle(next(self._ids), peer_id, len(remote_pages),
                                len(remote_pages) * src[0].numel() * src.element_size())
        r = Read(peer_id, remote_region, list(remote_pages), local_region, list(local_pages), handle)
        self.reads.append(r)
        if self.auto:
            self._copy(r)
        return handle

    def _copy(self, r: Read) -> None:
        src = self.world.regions[(self.peers[r.peer], r.remote_region)]
        dst = self.world.regions[(self.name, r.local_region)]
        dst[torch.tensor(r.local_pages)] = src[torch.tensor(r.remote_pages)]
        r.state = "done"

    def complete(self, ok: bool = True) -> None:
        """Finish every pending read (copying its bytes), or fail them."""
        for r in self.reads:
            if r.state == "pending":
                if ok:
                    self._copy(r)
                else:
                    r.state = "failed"

    def poll(self, handle: TransferHandle) -> str:
        return next(r.state for r in self.reads if r.handle.id == handle.id)

    def release(self, handle: TransferHandle) -> None:
        pass

    def close(self) -> None:
        pass


class FakeEngine:
    """Reservations and commits only; `room` pages and `seq_room` sequence places."""

    def __init__(self, room: int = 64, page_size: int = 16, swa: bool = False, seq_room: int = 8) -> None:
        self.room, self.seq_room = room, seq_room
        self.pool = SimpleNamespace(pages_for=lambda n: -(-n // page_size), swa_layers=(1,) if swa else (),
                                    page_size=page_size)
        self.seqs: dict[str, object] = {}
        self.reserved: list[KVReservation] = []
        self.committed: list[tuple] = []
        self._next_page = 0

    def reserve_kv(self, num_tokens: int) -> KVReservation | None:
        n = self.pool.pages_for(num_tokens)
        if n > self.room or self.seq_room == 0:
            return None
        self.room -= n
        self.seq_room -= 1
        pages = list(range(self._next_page, self._next_page + n))
        self._next_page += n
        res = KVReservation(num_tokens, pages, 0 if self.pool.swa_layers else None)
        self.reserved.append(res)
        return res

    def release_kv(self, res: KVReservation) -> None:
        self.reserved.remove(res)
        self.room += len(res.pages)
        self.seq_room += 1

    def add_prefilled(self, rid, prompt_ids, output_ids, params, res, cached_tokens=0) -> None:
        self.reserved.remove(res)
        self.seqs[rid] = res
        self.committed.append((rid, list(prompt_ids), list(output_ids), params, res, cached_tokens))
