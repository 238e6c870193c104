"""Copy whole KV pages between two page-major pools in one call.

A pool is a tensor `kv[num_pages, ...]`: dim 0 indexes pages and each page is one
contiguous block of bytes (page_size tokens of K and V for every full-attention
layer). The device KV cache and the host cache pool (maybe shared memory mapped
with `torch.frombuffer` / `torch.from_file`) share that per-page layout, so
offload and reload are `copy_pages(src, dst, src_idx, dst_idx)`.

The kernels are in `csrc/page_copy/page_copy.cpp` (CPU: threaded memcpy) and
`csrc/page_copy/page_copy.cu` (CUDA: a kernel through host-mapped pointers). Both register
`torch.ops.pdserve.copy_pages`; the dispatcher picks the CUDA kernel when either
pool is on a CUDA device. The first call builds the variant this process can
run (CUDA when `torch.cuda.is_available()`; native/loader.py). `torch_copy_pages` is the
plain-torch reference the tests compare with.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from native.loader import load_kernel

_CPU_SOURCES = ("page_copy/page_copy.cpp",)
_CUDA_SOURCES = ("page_copy/page_copy.cpp", "page_copy/page_copy.cu")
_HEADERS = ("include/page_copy.h",)
_CFLAGS = ("-O3", "-fopenmp")  # OpenMP: at::parallel_for runs on torch's intra-op pool
# Beyond this many threads memcpy is bound by memory bandwidth, not cores.
_MAX_DEFAULT_THREADS = 8

Index = torch.Tensor | Sequence[int]


@functools.cache
def _load_ops() -> None:
    """Build (or find cached) and load the kernel library into torch.ops.pdserve."""
    with_cuda = torch.cuda.is_available()
    defines = ["-DPDSERVE_WITH_CUDA"] if with_cuda else []
    load_kernel("native.page_copy", "page_copy_cuda" if with_cuda else "page_copy_cpu",
                _CUDA_SOURCES if with_cuda else _CPU_SOURCES, [*_CFLAGS, *defines],
                headers=_HEADERS, cuda_cflags=["-O3", *defines])


def _as_index(idx: Index) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        return torch.as_tensor(idx, dtype=torch.int64)
    if idx.dtype == torch.int64 and idx.device.type == "cpu":
        return idx  # the common case; .to() alone costs ~2 us
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        return idx  # the kernel rejects it with a message naming the dtype
    # NOTE: a CUDA index tensor is copied to the host, which syncs; the kernels
    # validate page ids on the host before touching memory.
    return idx.to(device="cpu", dtype=torch.int64)


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: Index,
    dst_idx: Index,
    num_threads: int | None = None,
) -> None:
    """Copy pages: `dst[dst_idx[i]] = src[src_idx[i]]` for every i, mutating `dst`.

    `src` and `dst` are page-major pools `[num_pages, ...]` with the same bytes per
    page and the same element size (the per-page shapes and dtypes may differ).
    Each page must be contiguous; pages may sit further apart than their size
    (`pool[2:10]`, `pool[::2]` are fine, `pool[:, layer]` is not). Page ids are
    int64 (lists or integer tensors; CUDA tensors are copied to the host first).
    `dst_idx` must not repeat a page and no dst page may overlap a src page.

    Both pools on the CPU: copies on up to `num_threads` of torch's intra-op
    threads (default `min(torch.get_num_threads(), 8)`) and returns when done;
    the GIL is released meanwhile. Either pool on a
    CUDA device: enqueues a kernel on the current stream and returns; a host pool
    must be pinned (`pin_memory()`) or registered with `cudaHostRegisterMapped`,
    and the caller must keep `src`/`dst` alive and synchronize before reading
    the host side.

    Raises RuntimeError on a bad layout, a page-size or element-size mismatch, an
    out-of-range or repeated page id, devices the kernels do not accept, or when
    no C++ compiler is available to build the kernel.
    """
    if num_threads is None:
        num_threads = min(torch.get_num_threads(), _MAX_DEFAULT_THREADS)
    _load_ops()
    torch.ops.pdserve.copy_pages(src, dst, _as_index(src_idx), _as_index(dst_idx), num_threads)


def torch_copy_pages(
    src: torch.Tensor, dst: torch.Tensor, src_idx: Index, dst_idx: Index
) -> None:
    """Plain-torch reference for `copy_pages` (advanced indexing; same dtypes)."""
    src_idx = torch.as_tensor(src_idx, dtype=torch.int64, device=src.device)
    dst_idx = torch.as_tensor(dst_idx, dtype=torch.int64, device=dst.device)
    dst[dst_idx] = src[src_idx].to(dst.device)
