"""One host cache per host: the prefix index, pins and free lists of a HostPool, in shared memory.

The ranks of one host (PD and colocated, started by the launcher or by Ray on a node) map the
same pool file (hicache/pool.py) and this index beside it (`<pool>.idx`, same directory), so a
prefix any rank stored is a hit on every rank, and a decode rank finds the pages a prefill rank
of its host just wrote through without a transfer. `attach_or_create` is the entry point.

Tables (numpy views of the .idx file; every change under one flock on it, plus a thread lock):
    page  [num_pages]  status (FREE, WRITING, VALID), owner (client of a WRITING page), key
                        (two u64), depth, state slot (-1: none), last use (a shared tick)
    state [num_states] status, owner, the page it hangs off, last use
    pins  [clients, num_pages] per-client pin counts, and their sum per page
    hash  [capacity]   open addressing on a key's first u64: page + 1, 0 empty, -1 deleted
    client[clients]    pid and start time of each attached index

A page's life: `alloc_pages` hands out FREE pages (evicting the least recently used unpinned
VALID pages when short) as WRITING, owned by the caller, who copies its bytes in and then
`insert`s it: only then is it VALID, in the hash, and visible to lookups. So a rank killed
mid-copy leaves a WRITING page, never a readable one. Readers pin (`match_and_pin`,
`lookup_and_pin` pin in the same critical section that finds the pages) and copy outside
the lock; pinned pages are never evicted. VALID pages are immutable.

LRU: `touch` gives a root-first path ticks that decrease with depth, so a parent is always
newer than its descendants and the oldest unpinned page is a chain's tail.

Crash safety. The flock goes with its process. A client that died (pid gone, or reused by
a process with another start time) is swept when a client attaches, when an allocation
comes up short, and every few seconds: its pins are dropped, its WRITING pages and states
freed, and the hash rebuilt from the page table (it may have died inside an update). A
dangling hash slot never misleads: a hit also checks the page's key and status.
The pool outlives any rank: the last client to close unlinks both files (the launcher
also removes them when it stops).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hicache.index import Node, page_keys
from hicache.pool import HostPool, HostPoolLayout
from hicache.shared_tables import (FREE, H_TICK, H_TOMBS, HEADER, MAGIC, MAX_CLIENTS, SWEEP_S, VALID, VERSION,
                                   WRITING, Lock, Tables, capacity, join_key, leave, split_key, start_time)

def index_path(layout: HostPoolLayout) -> Path:
    return layout.path.with_name(layout.name + ".idx")


def attach_or_create(layout: HostPoolLayout, root: bytes, page_size: int,
                     pin_cuda: bool = False) -> tuple[HostPool, "SharedIndex"]:
    """Map the host's shared pool and index named by `layout`, creating both if this is the first
    rank. Raises ValueError when one exists with another layout (another model, size or dtype
    under the same name) and OSError when /dev/shm cannot hold it."""
    path = index_path(layout)
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # unlinked by a last client meanwhile
                raise FileNotFoundError
        except FileNotFoundError:
            os.close(fd)
            continue
        break
    try:
        cap = capacity(layout.num_pages)
        nbytes = Tables(None, layout.num_pages, layout.num_states, cap, offset_only=True).nbytes
        want = [MAGIC, VERSION, layout.num_pages, layout.num_states, layout.page_bytes, layout.state_bytes, cap]
        size = os.fstat(fd).st_size
        fresh = size == 0
        if not fresh:
            head = np.frombuffer(os.pread(fd, 8 * len(want), 0), np.int64).tolist() if size >= HEADER else []
            if head[:2] != want[:2]:  # a creator died before writing its header: start over
                fresh = True
            elif head != want or bytes(os.pread(fd, 16, HEADER - 16)) != root:
                raise ValueError(f"{path} is another host cache (pages, states, bytes {head[2:]}, "
                                 f"this rank wants {want[2:]}, or another model): give each run its own name")
        if fresh:
            layout.path.unlink(missing_ok=True)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, nbytes)
            pool = HostPool.create(layout, pin_cuda=pin_cuda, owner=False, populate="background")
            buf = mmap.mmap(fd, nbytes)
            t = Tables(buf, layout.num_pages, layout.num_states, cap)
            t.state[:] = -1
            t.header[HEADER // 8 - 2:] = np.frombuffer(root, np.int64)
            t.header[:len(want)] = want  # magic last of all: a header is whole or absent
        else:
            pool = HostPool.attach(layout, pin_cuda=pin_cuda)
            buf = mmap.mmap(fd, nbytes)
        index = SharedIndex(path, fd, buf, layout, root, page_size)
    except BaseException:
        os.close(fd)
        raise
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
    return pool, index


class SharedIndex:
    """The PrefixIndex interface HostCache uses, over the host's shared tables, plus the pool's
    allocation (`alloc_pages`, `free_page`, `alloc_state`, `free_state`). Nodes it returns are
    snapshots (key, page, depth, state), valid while pinned. Thread-safe."""

    shared = True

    def __init__(self, path: Path, fd: int, buf, layout: HostPoolLayout, root: bytes, page_size: int) -> None:
        self.path, self.layout = path, layout
        self.root, self.page_size = root, page_size
        self._fd, self._buf = fd, buf
        self._t = Tables(buf, layout.num_pages, layout.num_states, capacity(layout.num_pages))
        self._mask = capacity(layout.num_pages) - 1
        self._tlock = threading.Lock()
        self._next_sweep = 0.0
        with self._locked():
            self._sweep()
            free = np.flatnonzero(self._t.client_pid == 0)
            if not len(free):
                raise RuntimeError(f"{path}: {MAX_CLIENTS} processes already use this host cache")
            self.me = int(free[0])
            self._t.client_pid[self.me], self._t.client_start[self.me] = os.getpid(), start_time(os.getpid())
        self._finalizer = weakref.finalize(self, leave, path, layout.path, fd, self._t, self.me, self._tlock)

    # ---- locking -------------------------------------------------------------------------
    def _locked(self):
        return Lock(self._fd, self._tlock)

    def close(self) -> None:
        """Leave: drop this client's pins and unfinished pages; the last client unlinks both files."""
        self._finalizer()

    # ---- hash table (under the lock) -------------------------------------------------------
    def _find(self, k0: int, k1: int) -> int:
        t, mask = self._t, self._mask
        i = k0 & mask
        while True:
            v = int(t.hash[i])
            if v == 0:
                return -1
            if v > 0:
                p = v - 1
                if int(t.k0[p]) == k0 and int(t.k1[p]) == k1 and t.status[p] == VALID:
                    return p
            i = (i + 1) & mask

    def _hash_add(self, page: int) -> None:
        t, mask = self._t, self._mask
        i = int(t.k0[page]) & mask
        while t.hash[i] > 0:
            i = (i + 1) & mask
        if t.hash[i] < 0:
            t.header[H_TOMBS] -= 1
        t.hash[i] = page + 1

    def _hash_remove(self, page: int) -> None:
        t, mask = self._t, self._mask
        i = int(t.k0[page]) & mask
        while t.hash[i] != 0:
            if t.hash[i] == page + 1:
                t.hash[i] = -1
                t.header[H_TOMBS] += 1
                break
            i = (i + 1) & mask
        if t.header[H_TOMBS] > len(t.hash) // 4:
            self._rebuild()

    def _rebuild(self) -> None:
        t = self._t
        t.hash[:] = 0
        t.header[H_TOMBS] = 0
        for p in np.flatnonzero(t.status == VALID).tolist():
            self._hash_add(p)

    def _tick(self, n: int = 1) -> int:
        t = self._t.header[H_TICK] + n
        self._t.header[H_TICK] = t
        return int(t)

    def _node(self, p: int) -> Node:
        t = self._t
        s = int(t.state[p])
        return Node(join_key(t.k0[p], t.k1[p]), None, int(t.depth[p]), p, state=s if s >= 0 else None)

    # ---- dead clients ------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Free what clients that died left behind (see the module's crash safety)."""
        t = self._t
        self._next_sweep = time.monotonic() + SWEEP_S
        dead = [c for c in np.flatnonzero(t.client_pid).tolist()
                if start_time(int(t.client_pid[c])) != int(t.client_start[c])]
        for c in dead:
            t.pins[c] = 0
            t.status[(t.status == WRITING) & (t.owner == c)] = FREE
            t.s_status[(t.s_status == WRITING) & (t.s_owner == c)] = FREE
            t.client_pid[c] = t.client_start[c] = 0
        if dead:
            t.pin_total[:] = t.pins.sum(axis=0)
            self._rebuild()

    # ---- lookup ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(np.count_nonzero(self._t.status == VALID))

    @property
    def num_states(self) -> int:
        """States stored (PrefixIndex's name)."""
        return int(np.count_nonzero(self._t.s_status == VALID))

    def _match(self, keys) -> list[int]:
        pages = []
        for key in keys:
            p = self._find(*split_key(key))
            if p < 0:
                break
            pages.append(p)
        return pages

    def match_keys(self, keys) -> list[Node]:
        with self._locked():
            return [self._node(p) for p in self._match(keys)]

    def match_and_pin(self, keys) -> list[Node]:
        """The stored path for the longest prefix of a root-first key chain, pinned."""
        with self._locked():
            pages = self._match(keys)
            self._pin(pages)
            return [self._node(p) for p in pages]

    def lookup_and_pin(self, tokens: Sequence[int], need_state: bool, root: bytes | None = None) -> list[Node]:
        """PrefixIndex.lookup, pinned in the same critical section."""
        keys = page_keys(tokens, self.page_size, root or self.root, max(len(tokens) - 1, 0) // self.page_size)
        with self._locked():
            pages = self._match(keys)
            if need_state:
                while pages and self._t.state[pages[-1]] < 0:
                    pages.pop()
            self._pin(pages)
            return [self._node(p) for p in pages]

    # ---- pins and use ------------------------------------------------------------------------
    def _pin(self, pages: list[int], delta: int = 1) -> None:
        if pages:
            t = self._t
            t.pins[self.me, pages] += delta
            t.pin_total[pages] += delta

    def pin(self, path: list[Node]) -> None:
        with self._locked():
            self._pin([n.page for n in path])

    def unpin(self, path: list[Node]) -> None:
        pages = [n.page for n in path]
        with self._locked():
            if pages and (self._t.pins[self.me, pages] <= 0).any():
                raise RuntimeError("unpin of an unpinned page")
            self._pin(pages, -1)

    def touch(self, path: list[Node]) -> None:
        """Mark a root-first path (and its deepest state) most recently used; deeper pages older."""
        if not path:
            return
        with self._locked():
            t = self._tick(len(path))
            self._t.last[[n.page for n in path]] = t - np.arange(len(path))
            s = self._t.state[path[-1].page]
            if s >= 0:
                self._t.s_last[s] = t

    # ---- allocation and publication ------------------------------------------------------------
    def alloc_pages(self, n: int) -> tuple[list[int], list[tuple[bytes, bool]]]:
        """Up to `n` pages for this client to write (WRITING, invisible), evicting the least
        recently used unpinned pages when free ones are short. Returns (pages, evicted), evicted
        as (key, whether a state went with it)."""
        evicted: list[tuple[bytes, bool]] = []
        with self._locked():
            t = self._t
            if time.monotonic() >= self._next_sweep:
                self._sweep()
            pages: list[int] = []

            def take(got) -> None:
                t.status[got], t.owner[got] = WRITING, self.me
                pages.extend(got)

            take(np.flatnonzero(t.status == FREE)[:n].tolist())
            for attempt in range(2):
                need = n - len(pages)
                if need <= 0:
                    break
                cand = np.flatnonzero((t.status == VALID) & (t.pin_total == 0))
                if len(cand) > need:
                    cand = cand[np.argpartition(t.last[cand], need - 1)[:need]]
                for p in cand.tolist():
                    s = int(t.state[p])
                    if s >= 0:
                        t.s_status[s] = FREE
                    evicted.append((join_key(t.k0[p], t.k1[p]), s >= 0))
                    t.state[p], t.status[p] = -1, FREE
                    self._hash_remove(p)
                take(cand.tolist())
                if len(pages) < n and attempt == 0:
                    self._sweep()  # a dead client's pins or unfinished pages may be what is short
                    take(np.flatnonzero(t.status == FREE)[:n - len(pages)].tolist())
        return pages, evicted

    def free_page(self, page: int) -> None:
        """Give back a page from alloc_pages that was never inserted."""
        with self._locked():
            if self._t.status[page] == WRITING and self._t.owner[page] == self.me:
                self._t.status[page] = FREE

    def insert(self, parent: Node | None, key: bytes, page: int) -> Node:
        """Publish a written page under `key` (child of `parent`). When another rank published the
        same key first, returns that node instead: the caller frees `page`."""
        k0, k1 = split_key(key)
        with self._locked():
            t = self._t
            found = self._find(k0, k1)
            if found >= 0:
                return self._node(found)
            if t.status[page] != WRITING or t.owner[page] != self.me:
                raise RuntimeError(f"page {page} is not being written by this client")
            t.k0[page], t.k1[page] = k0, k1
            t.depth[page], t.state[page] = (parent.depth + 1 if parent else 1), -1
            t.last[page] = self._tick()
            t.status[page] = VALID
            self._hash_add(page)
            return self._node(page)

    def alloc_state(self) -> tuple[int | None, bytes | None]:
        """A state slot to write (WRITING), evicting the least recently used state whose page is
        unpinned when none is free. Returns (slot or None, the key of the page that lost its state)."""
        with self._locked():
            t = self._t
            free = np.flatnonzero(t.s_status == FREE)
            lost = None
            if len(free):
                s = int(free[0])
            else:
                cand = np.flatnonzero((t.s_status == VALID) & (t.pin_total[np.maximum(t.s_page, 0)] == 0))
                if not len(cand):
                    return None, None
                s = int(cand[np.argmin(t.s_last[cand])])
                p = int(t.s_page[s])
                t.state[p] = -1
                lost = join_key(t.k0[p], t.k1[p])
            t.s_status[s], t.s_owner[s] = WRITING, self.me
            return s, lost

    def free_state(self, slot: int) -> None:
        with self._locked():
            if self._t.s_status[slot] == WRITING and self._t.s_owner[slot] == self.me:
                self._t.s_status[slot] = FREE

    def set_state(self, node: Node, slot: int) -> bool:
        """Hang a written state slot off `node`'s page; False (slot freed) when the page already
        has one or is gone."""
        k0, k1 = split_key(node.key)
        with self._locked():
            t, p = self._t, node.page
            if (t.status[p] != VALID or int(t.k0[p]) != k0 or int(t.k1[p]) != k1 or t.state[p] >= 0
                    or t.s_status[slot] != WRITING or t.s_owner[slot] != self.me):
                if t.s_status[slot] == WRITING and t.s_owner[slot] == self.me:
                    t.s_status[slot] = FREE
                return False
            t.state[p], t.s_page[slot], t.s_last[slot] = slot, p, self._tick()
            t.s_status[slot] = VALID
            node.state = slot
            return True

    def clients(self) -> int:
        """Attached processes (live or not yet swept)."""
        return int(np.count_nonzero(self._t.client_pid))
