"""KV transfer throughput between two processes: NIXL and shm next to memcpy, same run.

    .venv/bin/python bench/bench_transfer.py [--pages 1 4 16 64 256 512] [--page-bytes 65536 368640]
                                             [--pattern rand seq] [--reps 31] [--threads 1]

An owner process (the prefill rank's role) puts a 512-page pool per page size in shared
memory and registers it with both backends; this process (the decode rank's role) READs n
pages into its own pool and waits for it (`wait`: no spinning poll loop to steal a core from
the copy). Each time covers read() to completion: reads up to 4 MiB run inline, bigger ones
on the backend's read thread (hand-off included). The reader's NIXL agent runs without a
progress thread, as a decode rank's should (see NixlBackend).
Patterns: `rand` = random distinct pages on both sides (a real host pool), `seq` = pages
0..n-1 on both sides (one run: NIXL merges it into one descriptor).
The columns of a row are timed interleaved, one repetition of each in turn, and the medians
of --reps taken after one warm-up: load from elsewhere on the machine falls on every column
alike, so the ratios hold on a busy machine too.
References, both printed, every ratio against each:
  * memcpy = `dst[:n].copy_(src[:n])` of the same bytes inside this process (the goal's
    reference: NIXL at >= 0.5x memcpy from 1 MiB up).
  * cma = one process_vm_readv(2) of the same pages (one iovec per page) out of the owner
    process into the same destination pages. On one host NIXL's UCX copies with exactly this
    call (CMA), one call per descriptor; unlike memcpy the kernel pins each 4 KiB page of the
    owner's memory for the copy. So cma is the copy itself, what any cross-process read
    without a shared mapping pays here, and `x cma` well under 1 shows time spent in NIXL and
    UCX (requests, one call per descriptor) or in the Python around them rather than copying.
    (From ~20 MiB up NIXL can beat it: one call with hundreds of iovecs is not faster.)
Page sizes: 64 KiB and SmolLM2-135M's page (30 layers * 2 * 16 tokens * 3 kv heads * 64
dims * 2 bytes = 368,640 B). Small sizes sit in the CPU caches for every column alike.
--threads sets torch's threads (memcpy) and the shm copy threads; NIXL's CMA copy is one
kernel thread. UCX_* environment variables (UCX_TLS, ...) pass through to both processes.
NOTE: on a small shared machine keep --threads 1: a 2-thread OpenMP copy whose second thread
finds its core busy waits a scheduler slice (~16 ms) and the table shows noise.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch

from kv_transfer.base import TransferBackend
from kv_transfer.nixl_backend import NixlBackend
from kv_transfer.shm_backend import ShmBackend, shm_tensor, unlink_shm

POOL_PAGES = 512
SMOLLM2_PAGE = 30 * 2 * 16 * 3 * 64 * 2


def _owner(conn: Connection, page_sizes: list[int], prefix: str) -> None:
    backends: list[TransferBackend] = [ShmBackend()]
    try:
        backends.append(NixlBackend(f"bench-owner-{os.getpid()}"))
    except (ImportError, RuntimeError) as e:
        print(f"owner: NIXL unavailable: {e}")
    pools = []
    for pb in page_sizes:
        pool = shm_tensor(f"{prefix}-{pb}", (POOL_PAGES, pb), torch.uint8)
        pool.random_(0, 256)  # touch every page
        pools.append(pool)
        for b in backends:
            b.register(f"pool{pb}", pool, pb)
    for b in backends:
        conn.send_bytes(b.kind.encode())
        conn.send_bytes(b.metadata())
    conn.send_bytes(b"")  # end of metadata
    conn.send_bytes(json.dumps([p.data_ptr() for p in pools]).encode())  # for the cma reference
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    for b in backends:
        b.close()


def interleaved_s(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn (one repetition of each per round, the
    order rotating) after one warm-up round."""
    names = list(fns)
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(reps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t


def cma_fn(pid: int, remote: int, local: torch.Tensor, page_bytes: int, src: list[int],
           dst: list[int]) -> Callable[[], None]:
    """One process_vm_readv of pages `src` of the owner's pool at `remote` into `local[dst]`."""
    n = len(src)
    liov = (_Iovec * n)(*[_Iovec(local[d].data_ptr(), page_bytes) for d in dst])
    riov = (_Iovec * n)(*[_Iovec(remote + s * page_bytes, page_bytes) for s in src])

    def run() -> None:
        got = _LIBC.process_vm_readv(pid, liov, n, riov, n, 0)
        if got != n * page_bytes:
            raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {n * page_bytes} bytes")
    return run


def read_fn(backend: TransferBackend, region: str, src: list[int], dst: list[int]) -> Callable[[], None]:
    def run() -> None:
        h = backend.read("owner", region, src, region, dst)
        status = backend.wait(h)
        backend.release(h)
        assert status == "done", status
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    ap.add_argument("--page-bytes", type=int, nargs="+", default=[64 * 1024, SMOLLM2_PAGE])
    ap.add_argument("--pattern", nargs="+", choices=["rand", "seq"], default=["rand", "seq"])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (memcpy) and shm copy threads")
    args = ap.parse_args()
    assert max(args.pages) <= POOL_PAGES
    torch.set_num_threads(args.threads)

    prefix = f"pdserve-bench-{os.getpid()}"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, args.page_bytes, prefix), daemon=True)
    owner.start()
    child.close()
    try:
        readers: dict[str, TransferBackend] = {"shm": ShmBackend(copy_threads=args.threads)}
        t0 = time.perf_counter()
        try:
            readers["nixl"] = NixlBackend(f"bench-reader-{os.getpid()}", progress_thread=False)
            print(f"NIXL agent start: {1e3 * (time.perf_counter() - t0):.0f} ms")
        except (ImportError, RuntimeError) as e:
            print(f"NIXL unavailable: {e}")
        src_ref, pools = {}, {}
        for pb in args.page_bytes:
            pools[pb] = torch.zeros(POOL_PAGES, pb, dtype=torch.uint8)
            src_ref[pb] = torch.randint(0, 256, (POOL_PAGES, pb), dtype=torch.uint8)
            for r in readers.values():
                r.register(f"pool{pb}", pools[pb], pb)
        while kind := conn.recv_bytes().decode():
            md = conn.recv_bytes()
            if kind in readers:
                t0 = time.perf_counter()
                readers[kind].add_peer("owner", md)
                print(f"{kind} add_peer: {1e3 * (time.perf_counter() - t0):.1f} ms")
        if "nixl" in readers:
            t0 = time.perf_counter()
            read_fn(readers["nixl"], f"pool{args.page_bytes[0]}", [0], [0])()
            print(f"first NIXL read (1 page): {1e3 * (time.perf_counter() - t0):.2f} ms")
        print(f"threads {args.threads}, UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}\n")

        addrs = dict(zip(args.page_bytes, json.loads(conn.recv_bytes())))
        refs = ["memcpy"]
        try:
            cma_fn(owner.pid, addrs[args.page_bytes[0]], pools[args.page_bytes[0]], args.page_bytes[0], [0], [0])()
            refs.append("cma")
        except OSError as e:  # e.g. ptrace_scope forbids it: NIXL then cannot use CMA either
            print(f"cma reference unavailable: {e}")

        kinds = [k for k in ("nixl", "shm") if k in readers]
        rng = np.random.default_rng(0)
        header = "| page B | pages | MiB | pattern | " + " | ".join(f"{r} GB/s" for r in refs) + " | " \
            + " | ".join(f"{k} GB/s (x {' / x '.join(refs)})" for k in kinds) + " |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for pb in args.page_bytes:
            for n in args.pages:
                nbytes = n * pb
                for pattern in args.pattern:
                    if pattern == "seq":
                        src = dst = list(range(n))
                    else:
                        src = rng.choice(POOL_PAGES, n, replace=False).tolist()
                        dst = rng.choice(POOL_PAGES, n, replace=False).tolist()
                    fns = {"memcpy": functools.partial(pools[pb][:n].copy_, src_ref[pb][:n])}
                    if "cma" in refs:
                        fns["cma"] = cma_fn(owner.pid, addrs[pb], pools[pb], pb, src, dst)
                    fns.update({k: read_fn(readers[k], f"pool{pb}", src, dst) for k in kinds})
                    gbs = {k: nbytes / t / 1e9 for k, t in interleaved_s(fns, args.reps).items()}
                    cells = [f"{gbs[r]:.2f}" for r in refs]
                    cells += [f"{gbs[k]:.2f} ({' / '.join(f'{gbs[k] / gbs[r]:.2f}' for r in refs)})" for k in kinds]
                    print(f"| {pb} | {n} | {nbytes / 2**20:.2f} | {pattern} | " + " | ".join(cells) + " |", flush=True)
        for r in readers.values():
            r.close()
    finally:
        try:
            conn.send_bytes(b"stop")
        except OSError:
            pass
        owner.join(10)
        if owner.is_alive():
            owner.kill()
        for pb in args.page_bytes:
            unlink_shm(f"{prefix}-{pb}")


if __name__ == "__main__":
    main()
