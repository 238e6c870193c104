"""Cores lent between the ranks of one host, counted so that they are never oversubscribed.

The launcher gives each rank `own` torch threads (its cpuset's cores / ranks, at least 1), so
with one request in flight (a lone prompt, or a decode rank waiting while its prefill rank
works) the other ranks' cores sit idle. It creates a small shared-memory board: a header with
the host's core count C (the launcher's cpuset), then one slot per rank holding when the rank
went idle (0.0 while it has work) and the threads it holds: the threads it runs with while
busy, its own threads while idle (what it takes back when work arrives).

The invariant: **a rank runs more than its own threads only on cores no other rank holds.**
Before a step (`busy()`) and between its layers (`recheck()`), a rank that may borrow computes,
under an flock on the board,

    free = C - sum(threads of busy peers) - sum(own threads of peers idle for less than settle_s)
    threads = max(own, min(max_threads, free))

and writes it to its slot. Peers idle for `settle_s` or longer hold nothing. So the threads of
busy ranks sum to at most C whenever any rank holds more than its own, and with more ranks than
cores (2 prefill + 2 decode ranks on 2 cores) nobody borrows while all are busy: every rank runs
one thread and the OS time-shares them. Counting threads instead (each rank taking the threads
of every idle peer, as this board did before) let both decode ranks of such a host take the two
idle prefill ranks' cores at once: 4 spinning OpenMP threads on 2 cores, streams stalled for up
to a second, a third of the throughput (issue 36).

A borrower gives back at its next layer boundary: a peer that gets work marks itself busy with
its own threads (no lock: taking back what is yours is always allowed) before its first step,
the borrower's recheck then sees less free and drops to what is left. Two ranks share a core
for at most one layer. Shrinking never needs the lock; growing does (two borrowers could
otherwise both count the same free core). A recheck that would not change anything reads the
board without the lock (C + N floats, ~1 us), so the 30 layers of a step cost ~30 us.

`settle_s` keeps the short gaps of a busy rank (a request finishing just before the next
arrives) from being lent, except to a step of more than `eager_rows` rows (a prompt's
prefill), which takes the cores of any idle peer at once: one client sending requests back to
back to alternate ranks has the next prompt arrive a few ms after the peer went idle. A rank
marks itself idle before it waits for work (rank_runtime/loop.py), not after the wait.

Pinning: where the ranks' own threads fit the cores (ranks x threads <= C) the launcher gives
each rank disjoint home cores (`--cpus`) and the rank pins every thread of its process there;
while it borrows it widens its threads' affinity to the host's cpuset, and narrows it again
when it drops back. With more ranks than cores nothing is pinned (the OS balances one thread a
rank better than a fixed sharing would).

Numerics: by default only steps whose bits do not depend on the thread count borrow
(`LLMEngine.next_step_invariant`). In bf16, steps of at most `invariant_rows` rows (every step
with the packed AVX512-BF16 linear kernel, 1024 rows with its AMX GEMM: native/linear.py): their
ops give a row the same bits at any thread count (small_linear and its AMX GEMM, prefill and
paged attention, RMSNorm, act_and_mul, rotary, race_sample, elementwise torch ops; paged
attention's split-K is planned for the rank's own thread count, `set_split_threads`). In
float32 on AVX2 CPUs, steps of decode rows only, at most 16 (the quant-copy linear kernel,
native/quant_linear.py, with the same paged attention, RMSNorm and elementwise ops); prompt
chunks there take torch's attention and GEMM and run on the rank's own threads. So outputs do
not depend on timing. Other steps borrow only with `lend_all` (the launcher's
`--lend-idle-cores`): they use oneDNN's GEMM, whose bits depend on the thread count.

Slots start busy holding the launcher's threads per rank: a rank still loading its model lends
nothing, and neither does one that stopped or died (the safe side).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path

HEADER = struct.Struct("<qq")  # MAGIC, cores
SLOT = struct.Struct("<dq")  # idle since (CLOCK_MONOTONIC s; 0.0: busy), threads held
MAGIC = 0x3242434450  # "PDCB2"

BOARD_PREFIX = "pdserve-cores-"  # + the launcher's pid


def board_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{BOARD_PREFIX}{pid}"


def host_cpus() -> list[int]:
    """The cpus this process may run on (its cpuset; all cores where affinity is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def create_board(path: str | Path, ranks: int, threads: int = 1, cores: int | None = None) -> Path:
    """The launcher's side: a board for `ranks` ranks of `threads` threads each on `cores` cores
    (default: this process's cpuset), every rank busy until it says otherwise. Boards in the
    same directory whose launcher is gone (killed before it could unlink its own) are removed
    first."""
    path = Path(path)
    remove_stale_boards(path.parent)
    cores = cores or len(host_cpus())
    path.write_bytes(HEADER.pack(MAGIC, cores) + SLOT.pack(0.0, max(1, threads)) * ranks)
    return path


def home_cpus(slot: int, threads: int, cpus: list[int], ranks: int) -> list[int]:
    """The disjoint cores the launcher pins rank `slot` to, or [] when the ranks' threads do
    not fit the cores (then nothing is pinned)."""
    if ranks * threads > len(cpus):
        return []
    return cpus[slot * threads:(slot + 1) * threads]


def _thread_ids() -> list[int]:
    """This process's threads (0: the calling thread, where /proc is not there to list them)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def renice_threads(by: int) -> int:
    """Raise the niceness of every thread of this process by `by` (Linux keeps it per thread;
    threads created later inherit their creator's). Returns how many threads took it."""
    done = 0
    for tid in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
            done += 1
        except OSError:  # a thread that just exited
            pass
    return done


def pin_threads(cpus: Iterable[int]) -> None:
    """Every thread of this process (and those it creates later) on `cpus`."""
    cpus = set(cpus)
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that just exited
            pass


def remove_stale_boards(directory: str | Path) -> list[Path]:
    """Unlink the boards in `directory` whose launcher pid no longer runs; returns them."""
    return remove_stale_launcher_paths(directory, BOARD_PREFIX)


def remove_stale_launcher_paths(directory: str | Path, prefix: str) -> list[Path]:
    """Remove the files or directories `<prefix><launcher pid>` in `directory` whose launcher no
    longer runs (killed before it could remove its own); returns them."""
    import shutil

    removed = []
    for p in Path(directory).glob(prefix + "*"):
        pid = p.name[len(prefix):]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        except PermissionError:  # another user's live launcher
            pass
    return removed


class CoreBoard:
    """One rank's view of the board: `busy()` before a step, `recheck()` between its layers,
    `idle()` when out of work. Sets torch's thread count (and, pinned, the affinity) itself."""

    def __init__(self, path: str | Path, slot: int, own_threads: int, max_threads: int | None = None,
                 settle_s: float = 0.02, lend_all: bool = False, invariant_rows: int | None = None,
                 eager_rows: int = 128,
                 home: Iterable[int] = (), host: Iterable[int] = ()) -> None:
        self._fd = os.open(path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        if size < HEADER.size or (size - HEADER.size) % SLOT.size:
            os.close(self._fd)
            raise ValueError(f"core board {path} has {size} bytes: not a board")
        self._mm = mmap.mmap(self._fd, size)
        magic, self.cores = HEADER.unpack_from(self._mm, 0)
        self.slots = (size - HEADER.size) // SLOT.size
        if magic != MAGIC or slot >= self.slots:
            self.close()
            raise ValueError(f"core board {path}: no slot {slot}" if magic == MAGIC else f"{path} is not a board")
        self.slot = slot
        self.own = max(1, own_threads)
        self.max = max(self.own, min(max_threads or self.cores, self.cores))
        self.settle_s = settle_s
        self.eager_rows = eager_rows  # busy(eager=True) for steps of more rows: see the module's doc
        self._settle = settle_s  # the running step's (0 for an eager one)
        self.lend_all = lend_all
        self.home, self.host = frozenset(home), frozenset(host)
        self._pinned_wide = False
        self.threads = self.own
        self._lendable = False  # the running step may borrow (busy() said so)
        self._idle_since: float | None = None
        self._write(0.0, self.own)
        from native.paged_attention import set_split_threads

        # Steps up to the engine's invariant_rows may borrow (default: the bf16 Linear kernel's
        # limit): every op of theirs then gives a row the same bits at any thread count (paged
        # attention once split-K is pinned here).
        if invariant_rows is None:
            from native.linear import invariant_rows as kernel_rows
            invariant_rows = kernel_rows()
        self.invariant_rows = invariant_rows
        set_split_threads(self.own)

    def _offset(self, i: int) -> int:
        return HEADER.size + i * SLOT.size

    def _write(self, since: float, threads: int) -> None:
        SLOT.pack_into(self._mm, self._offset(self.slot), since, threads)

    def held_by_peers(self, now: float | None = None, settle_s: float | None = None) -> int:
        """Threads the other ranks hold at `now`: busy ones their current threads, those idle for
        less than `settle_s` (default: the board's) their own."""
        now = time.monotonic() if now is None else now
        settle = self.settle_s if settle_s is None else settle_s
        held = 0
        for i in range(self.slots):
            if i != self.slot:
                since, threads = SLOT.unpack_from(self._mm, self._offset(i))
                if since <= 0.0 or now - since < settle:
                    held += threads
        return held

    def idle_peers(self, now: float | None = None, settle_s: float | None = None) -> int:
        """Peers idle for at least `settle_s` (default: the board's) at `now`."""
        now = time.monotonic() if now is None else now
        settle = self.settle_s if settle_s is None else settle_s
        n = 0
        for i in range(self.slots):
            if i != self.slot:
                since = SLOT.unpack_from(self._mm, self._offset(i))[0]
                n += since > 0.0 and now - since >= settle
        return n

    def busy(self, invariant: bool = True, eager: bool = False) -> int:
        """Mark this rank busy and set torch's threads for the next step; returns them. Steps
        whose bits would depend on the thread count (not `invariant`) borrow only with lend_all;
        an `eager` step (more than eager_rows rows) does not wait for idle peers to settle."""
        if self._idle_since is not None:
            self._idle_since = None
            self._write(0.0, self.own)  # back to its own cores (a borrower drops at its next layer)
            self._set(self.own)
        self._lendable = invariant or self.lend_all
        self._settle = 0.0 if eager else self.settle_s
        self._update()
        return self.threads

    def recheck(self) -> None:
        """Between layers of a step that may borrow: hand lent threads back once their owner has
        work, and take the cores of peers that have gone idle since the step began."""
        self._update()

    def _want(self) -> int:
        if not self._lendable:
            return self.own
        free = self.cores - self.held_by_peers(settle_s=self._settle)
        return max(self.own, min(self.max, free))

    def _update(self) -> None:
        want = self._want()
        if want == self.threads:
            return
        if want < self.threads:  # giving back: always allowed, no lock
            self._write(0.0, want)
            self._set(want)
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # growing: count the free cores with no one else counting
        try:
            want = self._want()
            self._write(0.0, want)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._set(want)

    def idle(self) -> None:
        """Mark this rank idle (from now) and drop back to its own threads."""
        if self._idle_since is None:
            self._idle_since = time.monotonic()
            self._set(self.own)
            self._write(self._idle_since, self.own)
        self._lendable = False

    def _set(self, n: int) -> None:
        if n != self.threads:
            import torch

            wide = n > self.own and bool(self.home) and bool(self.host)
            if wide and not self._pinned_wide:
                pin_threads(self.host)  # before the team grows: new threads inherit the mask
                self._pinned_wide = True
            torch.set_num_threads(n)
            self.threads = n
            if not wide and self._pinned_wide:
                pin_threads(self.home)
                self._pinned_wide = False

    def close(self) -> None:
        try:
            self._write(0.0, self.own)  # a stopped rank lends nothing it no longer has
            self._mm.close()
        except (ValueError, OSError, AttributeError):
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass
