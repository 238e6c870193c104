"""Benchmark native.page_copy.copy_pages against torch indexing and a plain memcpy.

For each (pages, page size) it copies `pages` scattered pages (random ids, no
runs of consecutive ids) between two pools and reports GB/s of page bytes moved
(1 GB = 1e9 bytes), median of --reps interleaved runs, for:
  kernel  copy_pages (threaded memcpy on the CPU; the mapped-pointer kernel on CUDA)
  torch   torch_copy_pages: dst[dst_idx] = src[src_idx]
  index   dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
  memcpy  one contiguous dst_buf.copy_(src_buf) of the same total bytes
and kernel/memcpy, the share of a plain copy's bandwidth the kernel reaches.

  python scripts/bench_page_copy.py                       # host -> host
  python scripts/bench_page_copy.py --direction d2h       # device -> pinned host
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from native.page_copy import copy_pages, torch_copy_pages

KiB = 1024


def pools(direction: str, pages: int, page_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) pools of 2 * pages pages each, touched so page faults stay out of the timing."""
    def make(on_device: bool) -> torch.Tensor:
        t = torch.ones(2 * pages, page_bytes // 2, dtype=torch.bfloat16)  # [pages, page elements]
        if on_device:
            return t.cuda()
        return t.pin_memory() if direction != "h2h" else t

    src_dev = direction in ("d2h", "d2d")
    dst_dev = direction in ("h2d", "d2d")
    return make(src_dev), make(dst_dev)


def median_seconds(cases: dict[str, Callable[[], None]], reps: int, cuda: bool) -> dict[str, float]:
    """Median seconds per case; the cases take turns in each repetition so that
    a burst of load from other processes hits all of them alike."""
    for fn in cases.values():
        fn()  # warm-up: builds the kernel on first use, faults in pages
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_row(direction: str, pages: int, page_bytes: int, reps: int) -> list[str]:
    cuda = direction != "h2h"
    src, dst = pools(direction, pages, page_bytes)
    gen = torch.Generator().manual_seed(pages)
    src_idx = torch.randperm(2 * pages, generator=gen)[:pages]
    dst_idx = torch.randperm(2 * pages, generator=gen)[:pages]
    src_idx_dev = src_idx.to(src.device)
    dst_idx_dev = dst_idx.to(dst.device)
    total = pages * page_bytes
    src_buf = src.view(-1).view(torch.uint8)[:total]
    dst_buf = dst.view(-1).view(torch.uint8)[total:2 * total]

    cases = {
        "kernel": lambda: copy_pages(src, dst, src_idx, dst_idx),
        "torch": lambda: torch_copy_pages(src, dst, src_idx_dev, dst_idx_dev),
        "index": lambda: dst.index_copy_(0, dst_idx_dev, src.index_select(0, src_idx_dev).to(dst.device)),
        "memcpy": lambda: dst_buf.copy_(src_buf, non_blocking=cuda),
    }
    gbps = {name: total / sec / 1e9 for name, sec in median_seconds(cases, reps, cuda).items()}
    return [
        str(pages), str(page_bytes // KiB), f"{total / KiB / KiB:.2f}",
        *(f"{gbps[name]:.1f}" for name in cases), f"{gbps['kernel'] / gbps['memcpy']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256], help="pages per copy")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[16, 64, 1024], help="page sizes in KiB")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per case (median)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads(N) before timing; copy_pages defaults to the same count",
    )
    parser.add_argument(
        "--direction", choices=["h2h", "d2h", "h2d", "d2d"], default="h2h",
        help="h2h: two CPU pools; d2h/h2d/d2d: a CUDA pool and a pinned host pool",
    )
    args = parser.parse_args()
    if args.direction != "h2h" and not torch.cuda.is_available():
        parser.error(f"--direction {args.direction} needs a CUDA device")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    header = ["pages", "page KiB", "MiB", "kernel", "torch", "index", "memcpy", "kernel/memcpy"]
    rows = [
        bench_row(args.direction, pages, kib * KiB, args.reps)
        for kib in args.page_kib for pages in args.pages
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"# {args.direction}, GB/s (1e9 B/s of page bytes), median of {args.reps}; "
          f"torch threads {torch.get_num_threads()}")
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    main()
