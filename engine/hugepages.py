"""2 MB (transparent huge) pages for the buffers every decode step streams: weights and KV pool.

A decode step reads every weight once (269 MB for SmolLM2 with the linear kernel's packed
copies) and every running sequence's K/V pages. On 4 KB pages that is a TLB miss each 4 KB,
and the L2 prefetchers stop at each 4 KB boundary. Linux backs a 2 MB-aligned range of a
mapping with huge pages where the process asks for it: MADV_HUGEPAGE for anonymous memory
(THP "madvise" mode, many distributions' default) and MADV_COLLAPSE (Linux 6.1+) for a tmpfs
file that is already written, which it rebuilds in huge pages even where tmpfs huge pages are
off (shmem_enabled "never"; not "deny").

    zeros(shape, dtype)   a zeroed CPU tensor on huge pages (the KV pool), faulted in now
    empty_like_all(ts)    tensors like ts side by side in one huge-page buffer (private packed weights)
    map_readonly(fd, n)   a read-only shared mapping of a file's first n bytes, 2 MB-aligned
                          and collapsed (the shared weights); None where it cannot be made
    populate_write(t)     fault in the pages under a mapped tensor in one call (the host cache)

All three return memory whose mapping lives as long as the last tensor viewing it (a ctypes
array over the mapping, unmapped by a weakref finalizer; not at exit). Best effort: elsewhere
(not Linux, no libc mmap) zeros() is torch.zeros, empty_like_all() and map_readonly() return
None, and where a madvise is refused the kernel's 4 KB pages are what the buffers get.
`huge_bytes(t)` says how much of a tensor's
range the kernel maps with huge pages (from /proc/self/smaps), for tests and logs;
`release_freed_memory()` returns a load's freed heap to the system. docs/kernels.md has what
it measured.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
import weakref

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20
_PROT_NONE, _PROT_READ, _PROT_RW = 0, 1, 3
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MADV_HUGEPAGE, _MADV_COLLAPSE, _MADV_POPULATE_WRITE = 14, 25, 23
_FAILED = ctypes.c_void_p(-1).value


def enabled() -> bool:
    return sys.platform == "linux" and _libc() is not None


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def populate_write(t: torch.Tensor) -> bool:
    """Fault in every page of the mapping under `t` (contiguous, page-aligned start) writable, in
    one madvise(MADV_POPULATE_WRITE) (Linux 5.14+) instead of a write to each page; False where
    it cannot (not Linux, an older kernel, an unaligned start): the caller touches the pages."""
    libc = _libc() if sys.platform == "linux" else None
    a, n = t.data_ptr(), t.numel() * t.element_size()
    if libc is None or n == 0 or a % mmap.PAGESIZE:
        return False
    if libc.madvise(a, n, _MADV_POPULATE_WRITE) != 0:
        log.debug("MADV_POPULATE_WRITE refused (errno %d)", ctypes.get_errno())
        return False
    return True


def _round_up(n: int) -> int:
    return -(-n // HUGE) * HUGE


def _aligned_range(size: int) -> int | None:
    """A 2 MB-aligned address range of `size` bytes (a multiple of HUGE), reserved (PROT_NONE)."""
    libc = _libc()
    p = libc.mmap(None, size + HUGE, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if p in (None, _FAILED):
        return None
    a = _round_up(p)
    if a > p:
        libc.munmap(p, a - p)  # the unaligned head
    if p + size + HUGE > a + size:
        libc.munmap(a + size, p + size + HUGE - (a + size))  # and the tail past `size`
    return a


def _wrap(addr: int, nbytes: int, mapped: int) -> ctypes.Array:
    """A buffer over [addr, addr + nbytes) that unmaps `mapped` bytes at addr when it is freed."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    # Not at exit: a thread still reading the memory then (a daemon thread copying pages)
    # would fault; the process's end unmaps it anyway.
    weakref.finalize(buf, _libc().munmap, addr, mapped).atexit = False
    return buf


def zeros(shape, dtype: torch.dtype, prefault: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in anonymous memory advised to huge pages and,
    with `prefault`, written once now (so serving never faults it in; without, each page is
    faulted in, zeroed, by its first access)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE or not enabled():
        return torch.zeros(shape, dtype=dtype)
    libc = _libc()
    size = _round_up(nbytes)
    a = _aligned_range(size)
    if a is None or libc.mmap(a, size, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED, -1, 0) != a:
        if a is not None:
            libc.munmap(a, size)
        return torch.zeros(shape, dtype=dtype)
    if libc.madvise(a, size, _MADV_HUGEPAGE) != 0:
        log.debug("MADV_HUGEPAGE refused (errno %d): 4 KB pages", ctypes.get_errno())
    t = torch.frombuffer(_wrap(a, nbytes, size), dtype=dtype, count=numel).view(shape)
    if prefault:
        t.zero_()  # (a fresh anonymous mapping reads as zeros anyway)
    return t


def empty_like_all(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Zeroed contiguous tensors shaped like `tensors`, side by side (each on a 4 KB boundary) in
    one buffer on huge pages, not faulted in: copying into them one by one and dropping each
    original at once keeps the peak at the originals plus one piece (layers' weights of 1-2 MB
    each would waste most of a 2 MB page apiece alone). None where huge pages would gain nothing
    (under 2 MB in all, or off)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // 4096) * 4096
    if pos < HUGE or not enabled():
        return None
    buf = zeros((pos,), torch.uint8, prefault=False)
    return [buf[off:off + n].view(t.dtype).view(t.shape) for t, off, n in zip(tensors, offsets, sizes)]


def map_readonly(fd: int, nbytes: int) -> ctypes.Array | None:
    """The first `nbytes` of the file `fd` mapped shared and read-only at a 2 MB-aligned address,
    collapsed to huge pages where the kernel does it; None where the mapping cannot be made this
    way (then map it as usual). A write through it faults."""
    if not enabled() or nbytes <= 0:
        return None
    libc = _libc()
    size = _round_up(nbytes)
    a = _aligned_range(size)
    if a is None:
        return None
    if libc.mmap(a, nbytes, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0) != a:
        libc.munmap(a, size)
        return None
    mapped = _round_page(nbytes)
    if size > mapped:
        libc.munmap(a + mapped, size - mapped)  # the reserved tail past the file's last page
    if nbytes >= HUGE and libc.madvise(a, mapped, _MADV_COLLAPSE) != 0:
        log.debug("MADV_COLLAPSE refused (errno %d): 4 KB pages", ctypes.get_errno())
    return _wrap(a, nbytes, mapped)


def _round_page(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-n // page) * page


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system after a load drops its private copies (glibc's
    malloc_trim): glibc keeps freed blocks below its (load-raised) mmap threshold in the heap,
    ~200 MB of SmolLM2's 513 MB here. Nothing where the C library has no malloc_trim."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except (AttributeError, TypeError):  # not glibc
        pass


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s mapping that the kernel maps with huge pages (AnonHugePages plus
    ShmemPmdMapped of the /proc/self/smaps entry holding t's first byte); 0 where unknown."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            total = 0
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    if inside:
                        break
                    inside = lo <= addr < hi
                elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    total += int(line.split()[1]) * 1024
            return total
    except OSError:
        return 0
