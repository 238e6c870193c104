"""Requests waiting outside the scheduler's queue while the host cache reads their pages ahead
from a slower tier (an L3 store: hicache/prefetch.py), for LLMEngine.

A new request's job starts at arrival (`start`); the request joins the queue once the job is
done or its deadline has passed (`poll`), the pages read by then adopted as host pages. The
deadline is PREFETCH_WAIT_SHARE of what computing those pages would take, from the engine's
measured prefill seconds a token (`observe`; a rank's warmup measures one before its first
request, rank_runtime/loading.py; DEFAULT_S_PER_TOKEN before any is measured): a slow
or hung store costs at most ~that share of a request's time to first token, and a healthy one
(a page reads in well under a millisecond, computes in tens of them on a CPU) is always waited for.
"""
from __future__ import annotations

import logging
import time

from engine.host_cache import HostCacheLike
from engine.sequence import Sequence

log = logging.getLogger(__name__)

PREFETCH_WAIT_SHARE = 0.1
DEFAULT_S_PER_TOKEN = 1e-3
PREFETCH_POLL_S = 0.002  # how long a rank with only read-aheads in flight waits between looks


class ReadAheads:
    def __init__(self, cache: HostCacheLike | None, page_size: int) -> None:
        self.cache, self.page_size = cache, page_size
        self.pending: dict[str, tuple[Sequence, object]] = {}  # request id -> (seq, job), arrival order
        self.s_per_token: float | None = None  # prefill seconds a prompt token (moving average)

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, seq: Sequence) -> bool:
        """Start `seq`'s read-ahead; False when there is nothing to read (queue it now): no host
        cache, a request that skips the prefix cache or wants its prompt's logprobs, or no page
        past the host hit that the tier may hold."""
        if self.cache is None or not seq.params.prefix_cache or seq.prompt_lp is not None:
            return False
        per_page = PREFETCH_WAIT_SHARE * (self.s_per_token or DEFAULT_S_PER_TOKEN) * self.page_size
        job = self.cache.prefetch(seq.token_ids, seq.params.cache_salt, per_page)
        if job is not None:
            self.pending[seq.request_id] = (seq, job)
        return job is not None

    def poll(self, wait: bool) -> list[Sequence]:
        """The requests whose read-ahead is done or past its deadline, their pages adopted; with
        `wait` and none yet, waits up to PREFETCH_POLL_S for one first."""
        ready = self._adopt_ready()
        if wait and not ready and self.pending:
            self.cache.wait_prefetch(PREFETCH_POLL_S)
            ready = self._adopt_ready()
        return ready

    def _adopt_ready(self) -> list[Sequence]:
        now, out = time.monotonic(), []
        for rid, (seq, job) in list(self.pending.items()):
            if self.cache.prefetch_ready(job, now):
                del self.pending[rid]
                try:
                    self.cache.adopt(job)
                except Exception:  # noqa: BLE001 - the request computes those pages
                    log.exception("adopting the L3 pages of %s failed", rid)
                out.append(seq)
        return out

    def cancel(self, rid: str) -> None:
        """Drop the read-ahead of a request that went away (if it has one)."""
        pending = self.pending.pop(rid, None)
        if pending is not None:
            self.cache.cancel(pending[1])

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        """A step's time and prompt tokens: the prefill rate the deadlines are weighed against."""
        if prompt_tokens >= 64:
            x = seconds / prompt_tokens
            self.s_per_token = x if self.s_per_token is None else 0.8 * self.s_per_token + 0.2 * x
