"""What the engine asks of a host KV cache, so that engine/ needs no import of hicache/.

LLMEngine takes a HostCacheFactory (hicache.cache.HostCache.for_engine is one) and calls it
once its model and KV pool are known, when hicache_size_gb > 0. The engine then calls only
these methods; whoever built the engine may use more of the object it got (lookups, events).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from engine.sequence import Sequence


class HostCacheLike(Protocol):
    def admit(self, seq: Sequence, kv: KVPool) -> bool:
        """The scheduler's on_admit for a fresh (or preempted) sequence: load its stored prefix
        into `kv`, set what to write through. False (taking nothing) when `kv` lacks pages yet."""
        ...

    def write_through(self, scheduled: list[tuple[Sequence, int]], kv: KVPool) -> None:
        """After a step: store the prompts of `scheduled` that reached a store point."""
        ...

    def prefetch(self, tokens: list[int], salt: str = "", wait_s_per_page: float = 0.0) -> object | None:
        """Start reading ahead, off the engine thread, the prompt's pages a slower tier holds past
        the host hit; None when there is nothing to read. The request waits outside the queue
        until `prefetch_ready`, then the engine `adopt`s the job (or `cancel`s it), once."""
        ...

    def prefetch_ready(self, job: object, now: float) -> bool:
        """The job is done or past its deadline (`now`: time.monotonic())."""
        ...

    def wait_prefetch(self, timeout_s: float) -> None:
        """Block up to `timeout_s` or until some job is done."""
        ...

    def adopt(self, job: object) -> int:
        """Index what the job read as host pages (admission then finds them); returns how many."""
        ...

    def cancel(self, job: object) -> None:
        """Drop the job of a request that went away."""
        ...

    def stats(self) -> dict:
        """Counters for LLMEngine.stats()["hicache"]."""
        ...

    def close(self) -> None:
        """Release its host memory (LLMEngine.close)."""
        ...


# (cfg, model_cfg, max_model_len) -> the engine's host cache, sized by cfg.hicache_size_gb.
HostCacheFactory = Callable[[EngineConfig, ModelConfig, int], HostCacheLike]
