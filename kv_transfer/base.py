"""The KV transfer interface: one process READs pages out of another process's registered pools.

Life cycle (a decode rank pulling a prompt's pages from a prefill rank's host pool):
  1. At start-up each process builds one backend and `register`s its page-major pools as named
     regions (prefill: the host pool; decode: its KV pool), before publishing anything.
  2. `metadata()` is sent to the peer in the control-plane handshake (opaque bytes); the reader
     calls `add_peer(peer_id, metadata)`.
  3. Per request the reader calls `read(peer_id, remote_region, remote_pages, local_region,
     local_pages)`, which starts the copy (on the backend's read thread) and returns a
     `TransferHandle`.
  4. The reader's loop calls `poll(handle)` until it says "done" or "failed", then `release(handle)`.
  5. `remove_peer` when the peer leaves (its unfinished reads then poll "failed"); `close` at exit.

The owner of the remote pages is never told about a read: the control plane must keep those pages
pinned until the reader reports the outcome (the decode rank's "pulled"/"failed" message).

Backends: `nixl_backend.NixlBackend` (NIXL over UCX; across hosts, and between processes on one
host) and `shm_backend.ShmBackend` (same host only: maps the peer's shared-memory pool and copies).
`kv_transfer.make_backend` picks one.

Metadata wire format: the structs at the end of this module, msgpack-encoded with msgspec.
"""
from __future__ import annotations

import itertools
import logging
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

import msgspec
import numpy as np
import torch

logger = logging.getLogger(__name__)

TransferStatus = Literal["pending", "done", "failed"]


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """One started read; opaque to callers apart from the sizes (for logs and metrics)."""

    id: int
    peer_id: str
    num_pages: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Region:
    """A registered local page-major tensor: page i is `page_bytes` contiguous bytes at
    `addr + i * stride_bytes`."""

    name: str
    tensor: torch.Tensor  # [num_pages, ...]; kept here so the memory outlives the registration
    page_bytes: int
    stride_bytes: int
    num_pages: int

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def span_bytes(self) -> int:
        """Bytes from the first page's start to the last page's end."""
        return (self.num_pages - 1) * self.stride_bytes + self.page_bytes if self.num_pages else 0

    def as_bytes(self) -> torch.Tensor:
        """The same memory as `[num_pages, page_bytes]` uint8 (a view)."""
        return self.tensor.view(self.num_pages, -1).view(torch.uint8)


def make_region(name: str, tensor: torch.Tensor, page_bytes: int) -> Region:
    """Validate a page-major tensor for registration (see `TransferBackend.register`)."""
    if not name:
        raise ValueError("region name must be non-empty")
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise ValueError(f"region {name!r}: need a page-major tensor [num_pages, ...], "
                         f"got {tuple(tensor.shape)}")
    page = tensor[0]
    if not page.is_contiguous():
        raise ValueError(f"region {name!r}: each page must be contiguous (strides {tensor.stride()})")
    actual = page.numel() * tensor.element_size()
    if page_bytes != actual:
        raise ValueError(f"region {name!r}: page_bytes={page_bytes} but one page of "
                         f"{tuple(tensor.shape)} {tensor.dtype} holds {actual} bytes")
    stride = tensor.stride(0) * tensor.element_size()
    if tensor.shape[0] > 1 and stride < page_bytes:
        raise ValueError(f"region {name!r}: pages overlap (stride {stride} B < page {page_bytes} B)")
    return Region(name, tensor, page_bytes, stride, tensor.shape[0])


def check_pages(pages: Sequence[int] | np.ndarray | torch.Tensor, num_pages: int, what: str,
                unique: bool = False) -> list[int]:
    """Page ids as a new list of ints; ValueError if any is not an integer, is outside
    [0, num_pages) (or, with `unique`, repeats).

    NOTE: plain Python on purpose, no numpy call for a list: this runs once per read, right
    after the previous read's copy swept the CPU caches, where each numpy call's dispatch
    (a few us warm) costs 5-10x more; numpy checks made a 1 MiB NIXL read 1.8x slower.
    """
    if isinstance(pages, (np.ndarray, torch.Tensor)):
        if pages.ndim != 1 or (len(pages) and not _is_integer_dtype(pages.dtype)):
            raise ValueError(f"{what}: page ids must be a flat list of integers")
        ids = pages.tolist()
    else:
        ids = list(pages)  # a copy: the read may run after the caller changed its list
        if not all(type(p) is int for p in ids):
            try:  # numpy ints; never floats, strings or bools
                if any(isinstance(p, bool) for p in ids):
                    raise TypeError
                ids = [operator.index(p) for p in ids]
            except TypeError:
                raise ValueError(f"{what}: page ids must be a flat list of integers") from None
    if ids and (min(ids) < 0 or max(ids) >= num_pages):
        bad = next(p for p in ids if p < 0 or p >= num_pages)
        raise ValueError(f"{what}: page {bad} out of range [0, {num_pages})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{what}: a destination page repeats")
    return ids


def _is_integer_dtype(dtype: np.dtype | torch.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return dtype.kind in "iu"


@dataclass
class _Read:
    peer_id: str
    future: Future[None] | None = None  # None: finished inside read()
    failed: bool = False


class TransferBackend(ABC):
    """Moves whole pages from a peer process's registered regions into local ones (READ).

    A read runs on the backend's one read thread (FIFO), where the copy runs without the GIL
    so the caller's loop keeps going; a read of at most `sync_bytes` runs inside `read`
    itself when that thread is idle (a hand-off costs 0.1-0.3 ms, about a 1-4 MiB copy).
    Not thread-safe otherwise: call every method from one thread (the rank's event loop).
    """

    kind: ClassVar[str]

    def __init__(self, *, sync_bytes: int) -> None:
        self._regions: dict[str, Region] = {}
        self._ids = itertools.count()
        self._sync_bytes = sync_bytes
        self._reads: dict[int, _Read] = {}
        self._thread: ThreadPoolExecutor | None = None  # started by the first threaded read
        self._last: Future[None] | None = None  # the job submitted last
        self._closed = False

    def register(self, name: str, tensor: torch.Tensor, page_bytes: int) -> None:
        """Make a local page-major tensor readable by peers and writable by local reads.

        `tensor` is `[num_pages, ...]` (any dtype, CPU; NIXL also takes CUDA): each page is one
        contiguous block of `page_bytes` bytes, pages `tensor.stride(0) * element_size` bytes
        apart (a contiguous pool or a dim-0 slice of one). The caller keeps the memory alive
        and at a fixed address until `close`. Register every region before sending
        `metadata()`: peers see only the regions registered by then.
        Raises ValueError on a bad layout or a repeated name.
        """
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered")
        region = make_region(name, tensor, page_bytes)
        self._register(region)
        self._regions[name] = region

    @abstractmethod
    def _register(self, region: Region) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer's `add_peer` needs to read this process's regions (msgpack bytes)."""

    @abstractmethod
    def add_peer(self, peer_id: str, metadata: bytes) -> None:
        """Connect to a peer from its `metadata()`. ValueError if the bytes are not this
        backend's metadata (another backend kind, version or host) or `peer_id` is taken."""

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer. Its queued reads are dropped and poll "failed"; one already copying
        is waited for (a copy cannot be interrupted), then polls "failed" too. No-op if unknown."""
        if not self._has_peer(peer_id):
            return
        for r in self._reads.values():
            if r.peer_id == peer_id and r.future is not None and not r.future.done():
                _wait(r)
                r.failed = True
        self._drop_peer(peer_id)

    @abstractmethod
    def _has_peer(self, peer_id: str) -> bool: ...

    @abstractmethod
    def _drop_peer(self, peer_id: str) -> None:
        """Free the peer's resources; none of its reads is in flight any more."""

    def read(self, peer_id: str, remote_region: str, remote_pages: Sequence[int] | np.ndarray,
             local_region: str, local_pages: Sequence[int] | np.ndarray) -> TransferHandle:
        """Start copying `remote[remote_pages[i]] -> local[local_pages[i]]` for every i.

        Mutates the local region's pages (once `poll` says "done"; until then their contents
        are undefined). Page ids are ints (lists, numpy or CPU tensors); local pages must not
        repeat. The remote pages must stay unchanged until the read is over.
        Raises KeyError for an unknown peer or region, ValueError when the page sizes of the
        two regions differ, a page id is out of range, a local page repeats, or the two lists
        differ in length. A transport failure is not raised: the read polls "failed".
        """
        if self._closed:
            raise RuntimeError("transfer backend is closed")
        local = self._regions.get(local_region)
        if local is None:
            raise KeyError(f"no local region {local_region!r} (have {sorted(self._regions)})")
        remote = self._remote_region(peer_id, remote_region)
        if remote.page_bytes != local.page_bytes:
            raise ValueError(f"page size mismatch: {peer_id}:{remote_region} pages are "
                             f"{remote.page_bytes} B, local {local_region} pages {local.page_bytes} B")
        src = check_pages(remote_pages, remote.num_pages, f"{peer_id}:{remote_region}")
        dst = check_pages(local_pages, local.num_pages, f"local {local_region}", unique=True)
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} remote pages but {len(dst)} local pages")
        handle = TransferHandle(next(self._ids), peer_id, len(src), len(src) * local.page_bytes)
        r = self._reads[handle.id] = _Read(peer_id)
        if not src:
            return handle
        job = self._prepare_read(handle, remote, src, local, dst)
        # FIFO thread: the last job done means the thread is idle
        idle = self._last is None or self._last.done()
        if handle.nbytes <= self._sync_bytes and idle:
            try:
                job()
            except Exception as e:
                logger.warning("%s: read of %d pages from %s failed: %s", self.kind, handle.num_pages,
                               peer_id, e)
                r.failed = True
            return handle
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.kind}-read")
        r.future = self._last = self._thread.submit(job)
        return handle

    @abstractmethod
    def _remote_region(self, peer_id: str, name: str) -> RegionDesc:
        """The peer's region `name`; KeyError for an unknown peer or region."""

    @abstractmethod
    def _prepare_read(self, handle: TransferHandle, remote: RegionDesc, src: list[int],
                      local: Region, dst: list[int]) -> Callable[[], None]:
        """A job that copies the pages (`src`, `dst`: checked page ids, the job's own lists)
        and returns when they are in place (raises on failure).
        It runs on the read thread or inline: it must not touch state the caller's thread
        mutates (take what it needs now)."""

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """"pending", "done" or "failed"; never blocks. KeyError once released."""
        r = self._reads[handle.id]
        if r.failed:
            return "failed"
        if r.future is None:
            return "done"
        if not r.future.done():
            return "pending"
        if r.future.cancelled() or (e := r.future.exception()) is not None:
            if not r.future.cancelled():
                logger.warning("%s: read of %d pages from %s failed: %s", self.kind, handle.num_pages,
                               handle.peer_id, e)
            r.failed = True
            return "failed"
        return "done"

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferStatus:
        """Block until the read is over (or `timeout` seconds pass), then `poll` it. For
        tests, benchmarks and shutdown; a rank's loop polls instead."""
        r = self._reads[handle.id]
        if r.future is not None:
            futures.wait([r.future], timeout)
        return self.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        """Forget a read. Idempotent. A queued read is dropped; one copying is waited for."""
        r = self._reads.pop(handle.id, None)
        if r is not None:
            _wait(r)

    def close(self) -> None:
        """Finish or drop every read, forget every peer, deregister the regions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()
        self._close()
        self._regions.clear()

    @abstractmethod
    def _close(self) -> None:
        """Free peers and registrations; no read is in flight any more."""

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(r: _Read) -> None:
    if r.future is not None and not r.future.cancel():
        r.future.exception()  # blocks until the copy ends; poll reports its error


# ---- metadata wire format (the bytes of `metadata()`) -------------------------------------
# Bump METADATA_VERSION when a field below changes meaning, is added or removed; a peer with
# another version is refused in add_peer.
METADATA_VERSION = 1


class RegionDesc(msgspec.Struct, frozen=True, array_like=True):
    name: str
    addr: int  # NIXL: virtual address of page 0 in the owner; shm: byte offset of page 0 in the file
    page_bytes: int
    stride_bytes: int  # page i starts at addr + i * stride_bytes
    num_pages: int
    device: int = -1  # -1: host memory; else the CUDA device index (NIXL only)
    path: str | None = None  # shm: the file under /dev/shm that maps the region (None: not shared)


class NixlMetadata(msgspec.Struct, frozen=True, array_like=True, tag="nixl"):
    version: int
    agent_name: str
    agent_metadata: bytes  # nixlAgent.getLocalMD(): UCX worker address, memory keys
    regions: list[RegionDesc]


class ShmMetadata(msgspec.Struct, frozen=True, array_like=True, tag="shm"):
    version: int
    boot_id: str  # /proc/sys/kernel/random/boot_id: shm names mean nothing on another host
    pid: int
    regions: list[RegionDesc]


PeerMetadata = NixlMetadata | ShmMetadata
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PeerMetadata)


def encode_metadata(md: PeerMetadata) -> bytes:
    return _ENCODER.encode(md)


MetadataT = TypeVar("MetadataT", NixlMetadata, ShmMetadata)


def decode_metadata(data: bytes, expect: type[MetadataT]) -> MetadataT:
    """Decode a peer's metadata; ValueError if malformed, of another kind or version."""
    try:
        md = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"peer transfer metadata is not valid: {e}") from None
    if not isinstance(md, expect):
        raise ValueError(f"peer uses the {type(md).__name__} transfer backend, this process "
                         f"{expect.__name__} (start both with the same --transfer)")
    if md.version != METADATA_VERSION:
        raise ValueError(f"peer transfer metadata version {md.version}, this process {METADATA_VERSION}")
    return md
