"""A rank's per-step log ($PDSERVE_STEP_LOG): where a served number's time went, step by step.

With PDSERVE_STEP_LOG=DIR every rank appends one line per engine step to
DIR/<role>-<index>-<pid>.steps (the launcher passes its environment to the ranks):

    start  decode_rows  prompt_tokens  wall_ms  thread_ms  process_ms  threads

start: wall clock (time.time()) when the step began; decode_rows / prompt_tokens: what the
scheduler ran (prompt tokens computed, prefix hits excluded); wall_ms: the step's wall time;
thread_ms: the engine thread's CPU time in it (with one torch thread the step's compute runs
there, so thread_ms / wall_ms is the share of a core it got); process_ms: every thread of the
rank (borrowed OpenMP threads, the IO thread, a transfer's); threads: what the core board let the
step start with (core_board.py; 0 without a board). One line is ~60 bytes, written through an
unbuffered-by-line file: measurable only against ~10 ms steps, so leave it unset outside a
diagnosis. bench/step_log.py reads a directory of them (every rank of one run) and prints
per-rank tables: prompt steps by thread count, decode steps' tails by how many prompt steps ran
beside them.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

SUFFIX = ".steps"
FIELDS = ("start", "decode_rows", "prompt_tokens", "wall_ms", "thread_ms", "process_ms", "threads")


class StepLog:
    """One rank's log file. begin(threads) before a step (the threads it starts with), end() after
    it, both on the engine thread."""

    def __init__(self, directory: str | Path, role: str, index: int) -> None:
        path = Path(directory) / f"{role}-{index}-{os.getpid()}{SUFFIX}"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._t = (0.0, 0.0, 0.0, 0)

    def begin(self, threads: int) -> None:
        self._t = (time.time(), time.thread_time(), time.process_time(), threads)

    def end(self, decode_rows: int, prompt_tokens: int) -> None:
        w0, t0, p0, threads = self._t
        wall, thr, proc = time.time() - w0, time.thread_time() - t0, time.process_time() - p0
        self._f.write(f"{w0:.4f} {decode_rows} {prompt_tokens} {wall * 1e3:.2f} {thr * 1e3:.2f} "
                      f"{proc * 1e3:.2f} {threads}\n")

    def close(self) -> None:
        self._f.close()
