"""The launcher's side of one host cache per host (shared_index.py): its name, its size, its removal.

The launcher names one pool for all its ranks (`pdserve-hostcache-<launcher pid>-<random>`; the
index beside it adds `.idx`), sizes it once for the host, and removes both when it stops; ranks
started by Ray on other nodes create their node's own under the same name (its last rank removes
it). A launcher that was killed leaves its files: the next launcher on the host removes them.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hicache.pool import SHM_DIR

PREFIX = "pdserve-hostcache-"
MAX_DEFAULT_GB = 8.0
RAM_SHARE, RAM_CAP_SHARE = 0.10, 0.25


def host_cache_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def available_gib() -> float:
    """MemAvailable (GiB), or total RAM where /proc/meminfo is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def default_host_cache_gb(per_rank_gb: float, num_ranks: int, shm_dir: Path = SHM_DIR) -> float:
    """The host cache's default size: what the ranks' private caches added up to, or a tenth of
    the available RAM where that is more, at most a quarter of it, half of /dev/shm's free
    space and MAX_DEFAULT_GB (24 GiB here with ~22.6 available: 2.26 GiB)."""
    avail = available_gib()
    try:
        st = os.statvfs(shm_dir)
        shm_free = st.f_bavail * st.f_frsize / 2**30
    except OSError:
        shm_free = avail
    want = max(per_rank_gb * max(num_ranks, 1), RAM_SHARE * avail)
    return round(max(0.05, min(want, RAM_CAP_SHARE * avail, 0.5 * shm_free, MAX_DEFAULT_GB)), 3)


def plan_host_cache(engine_cfg, num_ranks: int, given: Callable[[str], bool]):
    """The ranks' engine config with scope "host": a name of this launcher's unless one was given;
    unless given on the command line (`given(flag)`), the default size above (the config's
    hicache_size_gb being the per-rank default in this dtype) and the ranks' SWA state slots
    added up (hybrid models: as many conversations' states as private caches held). Other
    scopes, or no cache, pass through."""
    if engine_cfg.hicache_scope != "host" or engine_cfg.hicache_size_gb <= 0:
        return engine_cfg
    remove_stale_host_caches()
    size = engine_cfg.hicache_size_gb
    if not given("--hicache-size-gb"):
        size = default_host_cache_gb(size, num_ranks)
    slots = engine_cfg.hicache_state_slots
    if not given("--hicache-state-slots"):
        slots *= max(num_ranks, 1)
    return replace(engine_cfg, hicache_size_gb=size, hicache_state_slots=slots,
                   hicache_shm_name=engine_cfg.hicache_shm_name or host_cache_name())


def remove_host_cache(name: str, shm_dir: Path = SHM_DIR) -> None:
    """Remove this launcher's host cache files (a name another process made stays)."""
    if name.startswith(f"{PREFIX}{os.getpid()}-"):
        for p in (shm_dir / name, shm_dir / (name + ".idx")):
            p.unlink(missing_ok=True)


def remove_stale_host_caches(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove host caches whose launcher no longer runs on this host; returns them."""
    removed = []
    for p in shm_dir.glob(PREFIX + "*"):
        pid = p.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            removed.append(p)
        except PermissionError:  # another user's live launcher
            pass
    return removed
