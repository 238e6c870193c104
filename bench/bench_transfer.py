"""KV transfer throughput between two processes: NIXL and shm next to memcpy, same run.

    .venv/bin/python bench/bench_transfer.py [--pages 1 4 16 64 256 512] [--page-bytes 65536 368640]
                                             [--pattern rand seq] [--reps 7] [--threads 1]

An owner process (the prefill rank's role) puts a 512-page pool per page size in shared
memory and registers it with both backends; this process (the decode rank's role) READs n
pages into its own pool and waits for it (`wait`: no spinning poll loop to steal a core from
the copy). Each time covers read() to completion: reads up to 4 MiB run inline, bigger ones
on the backend's read thread (hand-off included). The reader's NIXL agent runs without a
progress thread, as a decode rank's should (see NixlBackend).
Patterns: `rand` = random distinct pages on both sides (a real host pool), `seq` = pages
0..n-1 on both sides (one run: NIXL merges it into one descriptor).
memcpy = `dst[:n].copy_(src[:n])` of the same bytes inside this process. Medians of --reps
after one warm-up. Page sizes: 64 KiB and SmolLM2-135M's page (30 layers * 2 * 16 tokens *
3 kv heads * 64 dims * 2 bytes = 368,640 B). Small sizes sit in the CPU caches for every
column alike. --threads sets torch's threads (memcpy) and the shm copy threads; NIXL's
CMA copy is one kernel thread. UCX_* environment variables (UCX_TLS, ...) pass through to both
processes. NOTE: on a small shared machine keep --threads 1: a 2-thread OpenMP copy whose
second thread finds its core busy waits a scheduler slice (~16 ms) and the table shows noise.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch

from hicache.transfer.base import TransferBackend
from hicache.transfer.nixl_backend import NixlBackend
from hicache.transfer.shm_backend import ShmBackend, shm_tensor, unlink_shm

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
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    for b in backends:
        b.close()


def median_s(fn: Callable[[], None], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    ap.add_argument("--reps", type=int, default=7)
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

        kinds = [k for k in ("nixl", "shm") if k in readers]
        rng = np.random.default_rng(0)
        header = "| page B | pages | MiB | pattern | memcpy GB/s | " \
            + " | ".join(f"{k} GB/s (x memcpy)" for k in kinds) + " |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for pb in args.page_bytes:
            for n in args.pages:
                nbytes = n * pb
                t_mem = median_s(lambda: pools[pb][:n].copy_(src_ref[pb][:n]), args.reps)
                mem = nbytes / t_mem / 1e9
                for pattern in args.pattern:
                    if pattern == "seq":
                        src = dst = list(range(n))
                    else:
                        src = rng.choice(POOL_PAGES, n, replace=False).tolist()
                        dst = rng.choice(POOL_PAGES, n, replace=False).tolist()
                    cells = []
                    for k in kinds:
                        gbs = nbytes / median_s(read_fn(readers[k], f"pool{pb}", src, dst), args.reps) / 1e9
                        cells.append(f"{gbs:.2f} ({gbs / mem:.2f})")
                    row = f"| {pb} | {n} | {nbytes / 2**20:.2f} | {pattern} | {mem:.2f} | "
                    print(row + " | ".join(cells) + " |", flush=True)
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
