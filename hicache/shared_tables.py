"""The shared host cache's memory (shared_index.py): the `.idx` file's tables, its lock, and a
client's leaving. Definitions and the two bits of locking and clean-up; the protocol is in
shared_index.py's docstring.
"""
from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import numpy as np

FREE, WRITING, VALID = 0, 1, 2
MAX_CLIENTS = 64
MAGIC, VERSION = 0x70647368_63616368, 1  # "pdshcach"
SWEEP_S = 5.0
# header int64 slots
H_MAGIC, H_VERSION, H_PAGES, H_STATES, H_PAGE_BYTES, H_STATE_BYTES, H_CAP, H_TICK, H_TOMBS = range(9)
HEADER = 4096


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); -1: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return -1
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def split_key(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")


def join_key(k0: int, k1: int) -> bytes:
    return int(k0).to_bytes(8, "little") + int(k1).to_bytes(8, "little")


class Tables:
    """The .idx file's arrays, laid out one after another (64-byte aligned) after the header."""

    def __init__(self, buf, num_pages: int, num_states: int, cap: int, offset_only: bool = False) -> None:
        specs = [("client_pid", np.int64, (MAX_CLIENTS,)), ("client_start", np.int64, (MAX_CLIENTS,)),
                 ("pins", np.int32, (MAX_CLIENTS, num_pages)), ("pin_total", np.int32, (num_pages,)),
                 ("status", np.uint8, (num_pages,)), ("owner", np.int16, (num_pages,)),
                 ("k0", np.uint64, (num_pages,)), ("k1", np.uint64, (num_pages,)),
                 ("depth", np.int32, (num_pages,)), ("state", np.int32, (num_pages,)),
                 ("last", np.int64, (num_pages,)),
                 ("s_status", np.uint8, (num_states,)), ("s_owner", np.int16, (num_states,)),
                 ("s_page", np.int32, (num_states,)), ("s_last", np.int64, (num_states,)),
                 ("hash", np.int32, (cap,))]
        off = HEADER
        for name, dt, shape in specs:
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            if not offset_only:
                setattr(self, name, np.ndarray(shape, dt, buffer=buf, offset=off))
            off += -(-n // 64) * 64
        self.nbytes = off
        if not offset_only:
            self.header = np.ndarray((HEADER // 8,), np.int64, buffer=buf, offset=0)


def capacity(num_pages: int) -> int:
    cap = 16
    while cap < 2 * num_pages:
        cap *= 2
    return cap


class Lock:
    __slots__ = ("fd", "tlock")

    def __init__(self, fd: int, tlock: threading.Lock) -> None:
        self.fd, self.tlock = fd, tlock

    def __enter__(self) -> None:
        self.tlock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.tlock.release()
            raise

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.tlock.release()


def leave(path: Path, pool_path: Path, fd: int, t: Tables, me: int, tlock: threading.Lock) -> None:
    with Lock(fd, tlock):
        t.pin_total[:] -= t.pins[me]
        t.pins[me] = 0
        t.status[(t.status == WRITING) & (t.owner == me)] = FREE
        t.s_status[(t.s_status == WRITING) & (t.s_owner == me)] = FREE
        t.client_pid[me] = t.client_start[me] = 0
        others = [c for c in np.flatnonzero(t.client_pid).tolist()
                  if start_time(int(t.client_pid[c])) == int(t.client_start[c])]
        if not others:
            pool_path.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
    os.close(fd)
