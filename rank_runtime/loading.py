"""What a rank does before it serves: load (and warm up) its engine, make its transfer backend.
Shared by every role (colocated.py, decode/rank.py, prefill/rank.py)."""
from __future__ import annotations

import gc
import logging
import os
import time

from rank_runtime.config import HandoffConfig, RankConfig

log = logging.getLogger(__name__)

WARMUP_PREFILL_TOKENS = 128  # a prompt long enough that its step time is mostly per-token work


def load_engine(engine_cfg, warmup: bool):
    """The rank's engine, loaded (and warmed up), with its host cache when hicache_size_gb > 0;
    logs the time of each load phase."""
    t = time.perf_counter()
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from hicache.cache import HostCache
    imports = time.perf_counter() - t
    engine = LLMEngine(engine_cfg, host_cache=HostCache.for_engine)
    phases = {"imports": imports, **engine.load_phases}
    if warmup:
        # First steps' one-off costs (kernel JIT, allocator growth; a sampled row) before Hello.
        t = time.perf_counter()
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=1.0, seed=0))
        if getattr(engine.hicache, "l3", None) is not None:
            # The prefill rate L3 read-ahead deadlines are weighed against (engine/read_ahead.py),
            # measured on this machine before the first request rather than assumed: a rank's
            # first read-ahead then waits what its compute would take, not a guess 4x short
            # (a store on another host read 3 of 9 pages by such a deadline). Kept out of the caches.
            engine.generate([[100 + i for i in range(WARMUP_PREFILL_TOKENS)]],
                            SamplingParams(max_tokens=1, temperature=0, prefix_cache=False))
        phases["warmup"] = time.perf_counter() - t
    gc.freeze()  # what is loaded (~350k objects) out of the cyclic GC's passes: a full one took ~100 ms
    log.info("load phases: %s (%.1fs in all, %.1fs since the process started)",
             ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), sum(phases.values()), _process_age_s())
    return engine


def _process_age_s() -> float:
    """Seconds since this process started (from /proc; 0 where that cannot be read)."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rpartition(")")[2].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def make_transfer(handoff: HandoffConfig, cfg: RankConfig):
    """The rank's transfer backend (the choice is logged by make_backend)."""
    from kv_transfer import make_backend

    # Only prefill ranks serve reads. NOTE: a NIXL progress thread on the reading side
    # spins on the UCX lock the copy holds and halves large reads (kv_transfer).
    return make_backend(handoff.transfer, f"{cfg.name}-{os.getpid()}", serves_peers=cfg.role == "prefill")
