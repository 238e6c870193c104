"""Shared-memory transfer backend: for one host without NIXL. The reader maps the owner's pool
file and copies pages itself.

How a read travels:
  1. `register` finds the file under /dev/shm that maps the region (from /proc/self/maps), so
     any shared-memory pool works: `shm_tensor` below, `multiprocessing.shared_memory`, an mmap.
     A region in private memory still registers (it can be a read's destination) but peers
     cannot read it.
  2. `metadata()` names each region's file, offset and layout, plus this boot's id.
  3. `add_peer` maps the peer's files (refused on another host: the boot ids differ).
  4. `read` copies with `native.page_copy.copy_pages` from the mapping into the local region
     on the read thread, so the caller's loop keeps running (the kernel releases the GIL), or
     inline when the read is small (see `TransferBackend`).

NOTE: a thread hand-off costs up to the interpreter's switch interval (5 ms) twice when the
caller's thread spins in Python code: the read thread needs the GIL to start and to finish.
A rank loop that runs torch ops between polls releases the GIL often and barely sees it.

The peer's files are mapped read-write: torch warns about tensors over read-only memory. This
backend never writes to them.
"""
from __future__ import annotations

import functools
import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from kv_transfer.base import (
    METADATA_VERSION,
    Region,
    RegionDesc,
    ShmMetadata,
    TransferBackend,
    TransferHandle,
    decode_metadata,
    encode_metadata,
)

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def shm_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool = True) -> torch.Tensor:
    """A tensor over the shared file /dev/shm/<name> (MAP_SHARED: every process that maps it
    sees the same bytes). `create` makes a new zero-filled file and fails if it exists (names
    come from config with a per-run suffix); otherwise the file must exist and be big enough.
    The file outlives the tensor: `unlink_shm(name)` when done."""
    path = _shm_path(name)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    elif path.stat().st_size < nbytes:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, {shape} {dtype} needs {nbytes}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


def unlink_shm(name: str) -> None:
    """Remove /dev/shm/<name>; existing mappings stay valid. No-op if it is gone."""
    _shm_path(name).unlink(missing_ok=True)


def _shm_path(name: str) -> Path:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad shared-memory name {name!r}")
    return SHM_DIR / name


def find_shm_file(addr: int, nbytes: int) -> tuple[str, int] | None:
    """(file under /dev/shm, byte offset in it) that maps [addr, addr + nbytes) in this
    process, or None when that range is not one shared file mapping."""
    prefix = str(SHM_DIR) + "/"
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= addr < hi:
                continue
            path = parts[5].rstrip("\n") if len(parts) == 6 else ""
            # NOTE: a region split over two adjacent mappings of one file is not handled: pools
            # are mapped in one piece.
            if parts[1][3] != "s" or not path.startswith(prefix) or path.endswith(" (deleted)") \
                    or addr + nbytes > hi:
                return None
            return path, int(parts[2], 16) + addr - lo
    return None


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _copy(src: torch.Tensor, dst: torch.Tensor, src_idx: list[int], dst_idx: list[int],
          use_kernel: bool, threads: int) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] over `[pages, page_bytes]` uint8 views."""
    s, d = torch.tensor(src_idx, dtype=torch.int64), torch.tensor(dst_idx, dtype=torch.int64)
    if use_kernel and dst.device.type == "cpu":
        from native.page_copy import copy_pages

        copy_pages(src, dst, s, d, num_threads=threads)
    else:  # no compiler for the kernel, or a CUDA destination (the mapping is not pinned)
        dst[d.to(dst.device)] = src[s].to(dst.device)


@dataclass
class _Peer:
    regions: dict[str, RegionDesc]
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # [num_pages, page_bytes] uint8


class ShmBackend(TransferBackend):
    """Same-host transfers through shared memory (see the module docstring).

    `copy_threads`: threads the page-copy kernel uses per read. One by default: a copy runs
    beside the rank's compute, whose torch threads already fill the cores (and an OpenMP
    region whose second thread finds its core busy stalls for a scheduler slice, ~16 ms).
    `sync_bytes`: reads up to this size are copied inside `read` when the read thread is
    idle (-1: none).
    """

    kind: ClassVar[str] = "shm"

    def __init__(self, *, copy_threads: int = 1, sync_bytes: int = 4 << 20) -> None:
        super().__init__(sync_bytes=sync_bytes)
        self._threads = copy_threads
        self._exports: dict[str, tuple[str, int] | None] = {}
        self._peers: dict[str, _Peer] = {}
        self._use_kernel = _kernel_works()

    def _register(self, region: Region) -> None:
        found = find_shm_file(region.addr, region.span_bytes) if region.tensor.device.type == "cpu" else None
        if found is None:
            logger.info("shm: region %s is not in shared memory; peers cannot read it", region.name)
        self._exports[region.name] = found

    def metadata(self) -> bytes:
        regions = []
        for r in self._regions.values():
            found = self._exports[r.name]
            path, offset = found if found else (None, 0)
            regions.append(RegionDesc(r.name, offset, r.page_bytes, r.stride_bytes, r.num_pages, path=path))
        return encode_metadata(ShmMetadata(METADATA_VERSION, _boot_id(), os.getpid(), regions))

    def add_peer(self, peer_id: str, metadata: bytes) -> None:
        md = decode_metadata(metadata, ShmMetadata)
        if peer_id in self._peers:
            raise ValueError(f"peer {peer_id!r} is already added (remove_peer first)")
        if md.boot_id != _boot_id():
            raise ValueError(f"peer {peer_id!r} (pid {md.pid}) runs on another host or boot: "
                             "the shm transfer backend works within one host only")
        peer = _Peer({r.name: r for r in md.regions})
        for r in md.regions:
            if r.path is not None:
                peer.views[r.name] = _map_region(peer_id, r)
        self._peers[peer_id] = peer
        logger.info("shm: added peer %s (pid %d, %d regions)", peer_id, md.pid, len(md.regions))

    def _has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def _drop_peer(self, peer_id: str) -> None:
        del self._peers[peer_id]  # its mappings go away with the last view

    def _remote_region(self, peer_id: str, name: str) -> RegionDesc:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise KeyError(f"unknown peer {peer_id!r}")
        region = peer.regions.get(name)
        if region is None:
            raise KeyError(f"peer {peer_id!r} has no region {name!r} (has {sorted(peer.regions)})")
        if name not in peer.views:
            raise ValueError(f"peer {peer_id!r} region {name!r} is not in shared memory: "
                             "the shm backend reads only shared pools")
        return region

    def _prepare_read(self, handle: TransferHandle, remote: RegionDesc, src: list[int],
                      local: Region, dst: list[int]) -> Callable[[], None]:
        view = self._peers[handle.peer_id].views[remote.name]
        return functools.partial(_copy, view, local.as_bytes(), src, dst, self._use_kernel, self._threads)

    def _close(self) -> None:
        self._peers.clear()


def _map_region(peer_id: str, r: RegionDesc) -> torch.Tensor:
    """The peer's region as `[num_pages, page_bytes]` uint8 over a fresh mapping of its file."""
    assert r.path is not None
    span = (r.num_pages - 1) * r.stride_bytes + r.page_bytes
    start = r.addr - r.addr % mmap.ALLOCATIONGRANULARITY  # mmap offsets must be aligned
    try:
        fd = os.open(r.path, os.O_RDWR)
    except OSError as e:
        raise ValueError(f"peer {peer_id!r} region {r.name!r}: cannot open {r.path}: {e}") from None
    try:
        size = os.fstat(fd).st_size
        if size < r.addr + span:
            raise ValueError(f"peer {peer_id!r} region {r.name!r}: {r.path} holds {size} bytes, "
                             f"the region ends at {r.addr + span}")
        mapping = mmap.mmap(fd, r.addr + span - start, offset=start)
    finally:
        os.close(fd)
    # NOTE: the tensor holds the mmap object; the memory is unmapped when the last view dies.
    # Never mapping.close() here: torch.frombuffer does not pin the buffer export.
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return flat.as_strided((r.num_pages, r.page_bytes), (r.stride_bytes, 1), r.addr - start)


def _kernel_works() -> bool:
    """Whether native.page_copy's kernel loads here (it JIT-builds once per source hash);
    built now so the first read does not pay for the compiler."""
    try:
        from native.page_copy import copy_pages

        a, b = torch.zeros(1, 8, dtype=torch.uint8), torch.ones(1, 8, dtype=torch.uint8)
        copy_pages(a, b, [0], [0])
        return True
    except (RuntimeError, OSError, ImportError) as e:
        logger.warning("shm: page-copy kernel unavailable (%s); copying with torch indexing", e)
        return False
