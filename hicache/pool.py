"""The host page pool: KV pages and SWA state slots in one POSIX shared-memory file.

One file under /dev/shm holds two page-major regions, each element laid out like
the engine's device pool (engine/kv_cache.py) so one host page is one contiguous
region (one descriptor for a transfer engine) and `copy_pages` moves pages both ways:

    pages [num_pages,  num_full_layers, 2, page_size, num_kv_heads, head_dim]
    states[num_states, num_swa_layers,  2, window,    num_kv_heads, head_dim]

The states region starts at a 4 KiB-aligned offset after the pages. Another process
on the host maps the same bytes with `HostPool.attach(layout)`; `HostPoolLayout` is
everything it needs. The creating process owns the free lists and unlinks the file
on `close()` (or at garbage collection); mappings stay valid until their tensors die.
When the engine runs on CUDA the owner registers the mapping with the driver
(pinned + mapped) so copies run at DMA speed and the CUDA kernel can reach it. The owner
allocates and touches every page when it creates the pool (start-up time, not store time).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from engine import hugepages

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_ALIGN = 4096
# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context, and
# addressable from kernels (native/page_copy's CUDA kernel needs the mapping).
_CUDA_REGISTER_FLAGS = 1 | 2


def default_shm_name() -> str:
    """A name no other run on this host uses: pdserve-hicache-<pid>-<random>."""
    return f"pdserve-hicache-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class HostPoolLayout:
    """Shape of a host pool; enough for another process to map it by name."""

    name: str  # file name under SHM_DIR
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    num_pages: int
    page_shape: tuple[int, ...]  # [num_full_layers, 2, page_size, kvh, hd]
    num_states: int
    state_shape: tuple[int, ...]  # [num_swa_layers, 2, window, kvh, hd]

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"shared-memory name must be a plain file name, got {self.name!r}")
        if self.num_pages < 0 or self.num_states < 0:
            raise ValueError("num_pages and num_states must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def page_bytes(self) -> int:
        return prod(self.page_shape) * self.element_size

    @property
    def state_bytes(self) -> int:
        return prod(self.state_shape) * self.element_size

    @property
    def states_offset(self) -> int:
        return -(-self.num_pages * self.page_bytes // _ALIGN) * _ALIGN

    @property
    def total_bytes(self) -> int:
        return max(self.states_offset + self.num_states * self.state_bytes, 1)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name


def _unlink(path: Path | None, raw: torch.Tensor, registered_ptr: int | None) -> None:
    # `raw` rides along so the mapping outlives the unregister.
    if registered_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(registered_ptr)
    if path is not None:
        path.unlink(missing_ok=True)


def _register_cuda(raw: torch.Tensor) -> int:
    ptr = raw.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, raw.numel(), _CUDA_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {raw.numel()}-byte host cache failed: {err}")
    return ptr


def _allocate_in_background(path: Path, nbytes: int) -> None:
    """posix_fallocate of a shared pool's file in a daemon thread: the tmpfs pages exist (zeroed)
    without a start-up wait, and stores and loads may run meanwhile (it leaves written bytes be).

    NOTE: not MADV_POPULATE_WRITE in a thread: UCX (under NIXL) patches libc's madvise in place
    when its first agent starts, and a rank whose thread was inside madvise then died of SIGSEGV
    (2P2D with a 2.3 GB host cache). Each process's first touch of a page is a minor fault."""

    import ctypes

    def run() -> None:
        # fallocate(2) itself: glibc's posix_fallocate emulates it where unsupported by writing
        # zero bytes, which would race with stores.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            if libc.fallocate(fd, 0, 0, nbytes) != 0:  # (free space was checked at create)
                log.warning("host cache %s: cannot allocate its %d bytes (errno %d); pages are allocated as used",
                            path, nbytes, ctypes.get_errno())
        finally:
            os.close(fd)

    threading.Thread(target=run, name="hicache-allocate", daemon=True).start()


class HostPool:
    """A mapped host pool plus its page and state free lists (a private pool's; a shared pool's
    live in its SharedIndex). Not thread-safe.

    Use `HostPool.create(layout, pin_cuda=...)` in the owning rank and
    `HostPool.attach(layout)` elsewhere. Raises FileExistsError when creating a
    name that exists, FileNotFoundError when attaching one that does not.
    """

    def __init__(self, layout: HostPoolLayout, raw: torch.Tensor, owner: bool, registered_ptr: int | None) -> None:
        self.layout = layout
        self.raw = raw  # [total_bytes] uint8, the whole mapping
        dt = layout.torch_dtype
        pb, sb = layout.num_pages * layout.page_bytes, layout.num_states * layout.state_bytes
        self.pages = raw[:pb].view(dt).view(layout.num_pages, *layout.page_shape)
        off = layout.states_offset
        self.states = raw[off:off + sb].view(dt).view(layout.num_states, *layout.state_shape)
        self.owner = owner
        self._free_pages = list(range(layout.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_states = list(range(layout.num_states - 1, -1, -1))
        self._finalizer = (weakref.finalize(self, _unlink, layout.path if owner else None, raw, registered_ptr)
                           if owner or registered_ptr is not None else None)

    @classmethod
    def create(cls, layout: HostPoolLayout, pin_cuda: bool = False, owner: bool = True,
               populate: str = "now") -> "HostPool":
        """`owner`: this object unlinks the file on close (False: a shared pool, hicache/shared_index.py,
        unlinked by its last client). `populate`: "now" allocates and faults every page in before
        returning; "background" allocates them in a daemon thread (_allocate_in_background)."""
        fd = os.open(layout.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            try:  # the pages exist now: a /dev/shm too small fails here, not with SIGBUS mid-copy
                if populate != "background":
                    os.posix_fallocate(fd, 0, layout.total_bytes)
                elif os.statvfs(layout.path.parent).f_bavail * os.statvfs(layout.path.parent).f_frsize \
                        < layout.total_bytes:  # (a shared pool fills in the background: 2.4 GB took 4 s)
                    raise OSError(28, "No space left on device")
            except OSError as e:
                os.close(fd)
                fd = -1
                layout.path.unlink(missing_ok=True)
                raise OSError(e.errno, f"host cache of {layout.total_bytes} bytes does not fit in "
                                       f"{layout.path.parent}: {e.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            raw = torch.from_file(str(layout.path), shared=True, size=layout.total_bytes, dtype=torch.uint8)
            # Fault every page in: the first write to a page of the mapping faults it in,
            # which made a fresh cache's stores ~16x slower than later ones (a 542-token prompt's
            # 33 pages: 18 ms -> 1.1 ms). One madvise where the kernel has it (fallocate left the
            # pages zero), else a write to each page (0.25 GB took ~0.3 s here at start-up).
            if populate == "background":
                _allocate_in_background(layout.path, layout.total_bytes)
            elif not hugepages.populate_write(raw):
                raw.zero_()
            ptr = _register_cuda(raw) if pin_cuda else None
        except BaseException:
            layout.path.unlink(missing_ok=True)
            raise
        return cls(layout, raw, owner=owner, registered_ptr=ptr)

    @classmethod
    def attach(cls, layout: HostPoolLayout, pin_cuda: bool = False) -> "HostPool":
        """Map an existing pool (same bytes). Only a shared index (hicache/shared_index.py) may
        allocate from it then."""
        size = layout.path.stat().st_size
        if size != layout.total_bytes:
            raise ValueError(f"{layout.path} has {size} bytes, the layout says {layout.total_bytes}")
        raw = torch.from_file(str(layout.path), shared=True, size=layout.total_bytes, dtype=torch.uint8)
        return cls(layout, raw, owner=False, registered_ptr=_register_cuda(raw) if pin_cuda else None)

    def close(self) -> None:
        """Unlink the name (owner) and unregister from CUDA; idempotent. Live tensors stay valid."""
        if self._finalizer is not None:
            self._finalizer()

    # ---- allocation (owner only) ------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def num_states(self) -> int:
        return self.layout.num_states

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_states(self) -> int:
        return len(self._free_states)

    def alloc_page(self) -> int | None:
        return self._free_pages.pop() if self._free_pages else None

    def free_page(self, page: int) -> None:
        self._free_pages.append(page)

    def alloc_state(self) -> int | None:
        return self._free_states.pop() if self._free_states else None

    def free_state(self, slot: int) -> None:
        self._free_states.append(slot)
