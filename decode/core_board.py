"""Idle cores lent between the ranks of one host.

Each rank gets `cores / ranks` torch threads, so with one request in flight (a lone prompt, or
a decode rank waiting while its prefill rank works) the other ranks' cores sit idle. The
launcher creates a small shared-memory board, one 8-byte slot per rank: 0.0 while the rank has
work, else the CLOCK_MONOTONIC time (system-wide on Linux) it went idle. Before each engine step
a rank marks itself busy and runs the step on its own threads plus those of every rank idle
for at least `settle_s`; when it runs out of work it marks itself idle and drops back to its
own threads.

The cost of a wrong guess is bounded by one layer: a peer that gets work marks itself busy
before its first step, and the borrower, which rechecks the board between layers, drops back
at its next layer boundary. The recheck also takes the threads of a peer that went idle (and
settled) during the step: a prompt that reaches one rank just as the other finishes its last
request (one client sending requests back to back, alternately routed) would otherwise
prefill on the rank's own threads alone (measured: time to first token 0.64 s instead of
0.38 s for 512 tokens on 2 cores). `settle_s` keeps the short gaps of a busy rank (a request
finishing just before the next arrives) from being lent, except to a step of more than
`eager_rows` rows (a prompt's prefill), which takes any idle peer's threads at once: one client
sending requests back to back to alternate ranks (`bench_serve.sh` at concurrency 1) has the
next prompt arrive a few ms after the peer went idle, and waiting for it to settle would run up
to the first 20 ms of that prefill on half the cores. A rank marks itself idle before it waits
for work (decode/rank.py), not after the wait (up to IDLE_WAIT_S).
Numerics: by default only steps of at most `invariant_rows` rows borrow (every step with the
packed AVX512-BF16 linear kernel, 1024 rows with its AMX GEMM, 32 with PDSERVE_CHUNK_GEMM=0:
engine/layers/linear.py). Their ops
give a row the same bits at any thread count (small_linear and its AMX GEMM, prefill and paged attention, RMSNorm,
act_and_mul, rotary, race_sample, elementwise torch ops; paged attention's split-K is planned
for the rank's own thread count, `set_split_threads`), so outputs do not depend on timing.
Larger steps borrow only with `lend_all` (the launcher's `--lend-idle-cores`): they use
oneDNN's bf16 GEMM, which does not give the same bits at every thread count (measured:
[530, 576] x [576, 960] rounds differently on 1 and 2 threads), so their greedy outputs can
differ from unlent ones (and PD from colocated).

Slots start at 0.0, busy: a rank still loading its model lends nothing, and neither does one
that stopped or died (the safe side).
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

SLOT = struct.Struct("d")


BOARD_PREFIX = "pdserve-cores-"  # + the launcher's pid


def board_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{BOARD_PREFIX}{pid}"


def create_board(path: str | Path, ranks: int) -> Path:
    """The launcher's side: a zeroed board of `ranks` slots (every rank busy until it says otherwise).
    Boards in the same directory whose launcher is gone (killed before it could unlink its
    own) are removed first."""
    path = Path(path)
    remove_stale_boards(path.parent)
    path.write_bytes(bytes(SLOT.size * ranks))
    return path


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
    """One rank's view of the board: `busy()` before a step, `idle()` when out of work."""

    def __init__(self, path: str | Path, slot: int, own_threads: int, max_threads: int | None = None,
                 settle_s: float = 0.02, lend_all: bool = False, bf16: bool = True, eager_rows: int = 128) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < SLOT.size * (slot + 1) or size % SLOT.size:
                raise ValueError(f"core board {path} has {size} bytes: no slot {slot}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slots = size // SLOT.size
        self.slot = slot
        self.own = max(1, own_threads)
        self.max = max(self.own, max_threads or os.cpu_count() or 1)
        self.settle_s = settle_s
        self.eager_rows = eager_rows  # busy(eager=True) for steps of more rows: see the module's doc
        self._settle = settle_s  # the running step's (0 for an eager one)
        self.lend_all = lend_all
        self.threads = self.own
        self._lendable = False  # the running step may borrow (busy() said so)
        self._idle_since: float | None = None
        self._write(0.0)
        from engine.layers.linear import invariant_rows
        from engine.layers.paged_attention_op import set_split_threads

        # Steps up to the Linear kernel's row limit may borrow: every op of theirs then gives a row
        # the same bits at any thread count (paged attention once split-K is pinned here).
        self.invariant_rows = invariant_rows() if bf16 else 0
        set_split_threads(self.own)

    def _write(self, value: float) -> None:
        SLOT.pack_into(self._mm, self.slot * SLOT.size, value)

    def idle_peers(self, now: float | None = None, settle_s: float | None = None) -> int:
        """Peers idle for at least `settle_s` (default: the board's) at `now` (default: the clock's now)."""
        now = time.monotonic() if now is None else now
        settle = self.settle_s if settle_s is None else settle_s
        n = 0
        for i in range(self.slots):
            if i != self.slot:
                since = SLOT.unpack_from(self._mm, i * SLOT.size)[0]
                n += since > 0.0 and now - since >= settle
        return n

    def busy(self, invariant: bool = True, eager: bool = False) -> int:
        """Mark this rank busy and set torch's threads for the next step; returns them. Steps
        whose bits would depend on the thread count (not `invariant`) borrow only with lend_all;
        an `eager` step (more than eager_rows rows) does not wait for idle peers to settle."""
        if self._idle_since is not None:
            self._idle_since = None
            self._write(0.0)
        self._lendable = invariant or self.lend_all
        self._settle = 0.0 if eager else self.settle_s
        self._set(self._lending() if self._lendable else self.own)
        return self.threads

    def recheck(self) -> None:
        """Between layers of a step that may borrow: hand lent threads back once their owner has
        work (it marks itself busy before its step), so two ranks share a core for at most one
        layer, and take those of peers that have gone idle since the step began."""
        if self._lendable:
            self._set(self._lending())

    def _lending(self) -> int:
        return min(self.max, self.own * (1 + self.idle_peers(settle_s=self._settle)))

    def idle(self) -> None:
        """Mark this rank idle (from now) and drop back to its own threads."""
        if self._idle_since is None:
            self._idle_since = time.monotonic()
            self._write(self._idle_since)
        self._lendable = False
        self._set(self.own)

    def _set(self, n: int) -> None:
        if n != self.threads:
            import torch

            torch.set_num_threads(n)
            self.threads = n

    def close(self) -> None:
        try:
            self._write(0.0)  # a stopped rank lends nothing it no longer has
            self._mm.close()
        except (ValueError, OSError):
            pass
