"""Reading a prompt's L3 pages ahead, on a thread of their own, so that the engine thread never
waits on the store (HiCache's prefetch with a timeout policy is the model):

  1. At arrival (LLMEngine._track -> HostCache.prefetch, engine thread): the prompt's page keys;
     when some lie past the host hit, a PrefetchJob for them, with a deadline, goes to the
     Prefetcher, and the request waits outside the scheduler's queue.
  2. The Prefetcher's thread probes the store (`probe`) and reads the run it holds into staging
     memory of its own, page by page, counting `ready` (at most `max_staging_bytes` staged for
     all jobs at once: a job past it reads fewer pages).
  3. The engine thread adopts a job once it is done or its deadline has passed (HostCache.adopt ->
     l3.adopt): the pages ready by then are copied into host pages and indexed, the job stops,
     and the request joins the queue, whose admission finds them as host hits.
So a store that is slow or hangs costs a request at most its deadline (the engine sets it to a
share of what computing those pages would cost), plus what it then computes; one that is down
answers at once (no pages). A page read by then is a hit even when later ones are not. While the
thread is still stuck in a read for a request that stopped waiting (`stalled`), new requests do
not wait at all: a hung store costs one deadline per stuck read, not one per request.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

import torch

from hicache.store import KVStore, bytes_view

log = logging.getLogger(__name__)


def probe(store: KVStore, rest: list[bytes], need_state: bool) -> tuple[int, int]:
    """(pages of `rest`, from the first, the store holds; the index among them of the deepest
    SWA state, -1 for none). With `need_state` (hybrid models) the run ends at that state,
    without which its pages are no hit: (0, -1) when there is none."""
    n = store.leading([k.hex() + ".kv" for k in rest]) if rest else 0
    if not n or not need_state:
        return n, -1
    # (probed deepest first: one call, usually)
    state_at = next((i for i in reversed(range(n)) if store.leading([rest[i].hex() + ".swa"])), -1)
    return (state_at + 1, state_at) if state_at >= 0 else (0, -1)


class PrefetchJob:
    """One request's read-ahead. The Prefetcher's thread fills it; the engine thread stops it
    (`stop`) and then reads `pages[:ready]` (and `state` when `state_ok`), which the thread no
    longer writes."""

    def __init__(self, keys: list[bytes], first: int, need_state: bool, deadline: float) -> None:
        self.keys = keys  # the prompt's page keys (those lookups may hit: all but the last token's)
        self.first = first  # keys[:first] were on the host at submission; the job reads from there
        self.need_state = need_state
        self.deadline = deadline  # time.monotonic() past which the request stops waiting
        self.submitted = time.monotonic()
        self.pages: torch.Tensor | None = None  # staging, [n, *page_shape]
        self.state: torch.Tensor | None = None
        self.state_at = -1  # index, from `first`, of the page whose SWA state is read
        self.ready = 0  # pages of `pages` read, from the first
        self.state_ok = False
        self.done = False  # the thread is finished with it
        self.staged_bytes = 0  # counted against the Prefetcher's budget until released
        self._stopped = False
        self._lock = threading.Lock()

    def stop(self) -> tuple[int, bool]:
        """No more reads count; returns (ready, state_ok) as of now."""
        with self._lock:
            self._stopped = True
            return self.ready, self.state_ok

    def _advance(self, ready: int = 0, state_ok: bool = False) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self.ready = max(self.ready, ready)
            self.state_ok = self.state_ok or state_ok
            return True

    @property
    def stopped(self) -> bool:
        return self._stopped


class Prefetcher:
    """One thread reading PrefetchJobs from `store` into staging memory shaped like the host
    pool's pages (`page_shape`, `state_shape`, `dtype`)."""

    def __init__(self, store: KVStore, page_shape: tuple[int, ...], state_shape: tuple[int, ...],
                 dtype: torch.dtype, max_staging_bytes: int) -> None:
        self.store = store
        self.page_shape, self.state_shape, self.dtype = page_shape, state_shape, dtype
        elt = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = elt * math.prod(page_shape)
        self.state_bytes = elt * math.prod(state_shape)
        self.max_staging_bytes = max_staging_bytes
        self.staged_bytes = 0
        # Counters (this thread's; HostCache.stats adds them to its own).
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.failures = 0  # objects the store listed but could not give back
        self._current: PrefetchJob | None = None  # the job the thread is reading
        self._queue: deque[PrefetchJob | None] = deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-store-prefetch", daemon=True)
        self._thread.start()

    @property
    def stalled(self) -> bool:
        """The thread is still reading for a request that stopped waiting for it (a store that
        hangs): a job queued now would wait behind it."""
        job = self._current
        return job is not None and job.stopped

    def submit(self, job: PrefetchJob) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()

    def wait_any(self, timeout_s: float) -> None:
        """Block up to `timeout_s`, or until a job finishes."""
        with self._cv:
            self._cv.wait(timeout_s)

    def release(self, job: PrefetchJob) -> None:
        """The engine is done with `job`'s staging (after stop)."""
        with self._cv:
            self.staged_bytes -= job.staged_bytes
            job.staged_bytes = 0
        job.pages = job.state = None

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._queue.clear()
            self._queue.append(None)
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
            if job is None:
                return
            t0 = time.perf_counter()
            self._current = job
            try:
                if not job.stopped:
                    self._read(job)
            except Exception:  # noqa: BLE001 - the request computes what was not read
                log.exception("kv store prefetch failed")
            finally:
                self.read_seconds += time.perf_counter() - t0
                with self._cv:
                    self._current = None
                    job.done = True
                    self._cv.notify_all()

    def _read(self, job: PrefetchJob) -> None:
        rest = job.keys[job.first:]
        n, state_at = probe(self.store, rest, job.need_state)
        if not n or job.stopped:
            return
        want = n * self.page_bytes + (self.state_bytes if state_at >= 0 else 0)
        with self._cv:  # take what the budget has room for
            room = max(self.max_staging_bytes - self.staged_bytes, 0)
            if want > room:
                state_at = -1
                n = min(n, room // self.page_bytes) if self.page_bytes else n
                want = n * self.page_bytes
            self.staged_bytes += want
            job.staged_bytes = want
        if not n:
            return
        pages = job.pages = torch.empty((n, *self.page_shape), dtype=self.dtype)
        for i in range(n):
            if not self.store.read_into(rest[i].hex() + ".kv", bytes_view(pages[i])):
                self.failures += 1
                return
            self.read_bytes += self.page_bytes
            if not job._advance(ready=i + 1):
                return
        if state_at >= 0:
            state = job.state = torch.empty(self.state_shape, dtype=self.dtype)
            job.state_at = state_at
            if not self.store.read_into(rest[state_at].hex() + ".swa", bytes_view(state)):
                self.failures += 1
                return
            self.read_bytes += self.state_bytes
            job._advance(state_ok=True)

