"""The launcher's watch over the rank processes it starts: start, clean up, restart, reap.

Life of a launcher-started rank:
  1. `start(role, index)`: Popen the rank's command (its log in --run-dir), register it with
     the registry as `loading` with a Hello deadline of now + start_timeout_s (0: none).
  2. The dispatcher's heartbeat declares it dead (process exited, silent past the rank
     timeout, or no Hello by its deadline) and fails its requests; `check()` then sees it:
       - a dead rank whose process still runs (hung: SIGSTOP, a deadlock, stuck loading) is
         SIGKILLed only when supervising (without --supervise it is left alone; if it wakes
         up the router answers its frames with Shutdown and its Hello with Reject);
       - an exited process's shared-memory files are removed (a killed rank cannot);
       - supervising, with restarts left for that name: a new process under the same
         role/index after a backoff (backoff_s * 2**restarts so far). It says Hello as a new
         identity and is a fresh rank; PD ranks learn of it from the router's Peers.
  3. `reap()` on shutdown: wait, SIGTERM, SIGKILL, remove shared memory of every process.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pd_server.ranks import DEAD, RankRegistry

log = logging.getLogger("launcher.supervisor")

CHECK_INTERVAL_S = 0.5


def remove_rank_shm(pids: list[int], shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink the files a rank names with its pid (handoff pools `pdserve-handoff-<rank>-<pid>-*`,
    default host caches `pdserve-hicache-<pid>-*`) for ranks that exited. Returns what it removed."""
    removed = []
    for pid in pids:
        for pattern in (f"pdserve-handoff-*-{pid}-*", f"pdserve-hicache-{pid}-*"):
            for f in shm_dir.glob(pattern):
                f.unlink(missing_ok=True)
                removed.append(f)
    if removed:
        log.info("removed %d shared-memory file(s) left by exited ranks", len(removed))
    return removed


def remove_dead_ranks_shm(shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink every rank file (as remove_rank_shm names them) whose pid no longer runs on this
    host: what ranks killed with their parent (a Ray actor) left behind. Returns what it removed."""
    dead = set()
    for f in [*shm_dir.glob("pdserve-handoff-*"), *shm_dir.glob("pdserve-hicache-*")]:
        pid = f.name.rsplit("-", 2)[-2] if f.name.count("-") >= 3 else ""
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            dead.add(int(pid))
    return remove_rank_shm(sorted(dead), shm_dir)


class Supervisor:
    """`command(role, index)` is the rank's argv; `log_dir` ("" : inherit stderr) gets one log per
    rank name, appended to across restarts. Runs on the launcher's event loop (`run`)."""

    def __init__(self, registry: RankRegistry, command: Callable[[str, int], list[str]], log_dir: str = "",
                 max_restarts: int = 0, backoff_s: float = 1.0, start_timeout_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.command, self.log_dir = registry, command, log_dir
        self.max_restarts, self.backoff_s, self.start_timeout_s = max_restarts, backoff_s, start_timeout_s
        self.clock = clock
        self.procs: list[subprocess.Popen] = []  # every process ever started, for reap()
        self._handled: set[int] = set()  # pids whose death check() has dealt with
        self._due: dict[tuple[str, int], float] = {}  # (role, index) -> when to restart it

    @property
    def supervising(self) -> bool:
        return self.max_restarts > 0

    def start(self, role: str, index: int) -> subprocess.Popen:
        log_file = None
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            log_file = open(Path(self.log_dir) / f"rank-{role}-{index}.log", "ab")  # noqa: SIM115 - child owns it
        proc = subprocess.Popen(self.command(role, index), stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT if log_file else None)
        if log_file:
            log_file.close()
        ready_by = self.clock() + self.start_timeout_s if self.start_timeout_s else 0.0
        rank = self.registry.expect(role, index, proc, ready_by)
        self.procs.append(proc)
        log.info("started %s (pid %d)%s", rank.name, proc.pid, f", restart {rank.restarts}" if rank.restarts else "")
        return proc

    def check(self) -> None:
        """Deal with ranks the dispatcher declared dead; start the restarts that are due."""
        now = self.clock()
        for rank in list(self.registry.ranks.values()):
            proc = rank.process
            if rank.state != DEAD or proc is None or proc.pid in self._handled:
                continue
            if proc.poll() is None:
                if not self.supervising:
                    continue  # hung: left alone (it is refused if it speaks again)
                log.warning("killing %s (pid %d): %s", rank.name, proc.pid, rank.dead_reason)
                proc.kill()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) did not die on SIGKILL", rank.name, proc.pid)
                    continue
            self._handled.add(proc.pid)
            remove_rank_shm([proc.pid])
            if rank.restarts < self.max_restarts:
                delay = self.backoff_s * 2 ** rank.restarts
                self._due[(rank.role, rank.index)] = now + delay
                log.info("restarting %s in %.1fs (restart %d of %d)", rank.name, delay, rank.restarts + 1,
                         self.max_restarts)
            elif self.supervising:
                log.error("%s is dead and has used its %d restart(s); not restarting", rank.name, self.max_restarts)
        for key, when in list(self._due.items()):
            if when <= now:
                del self._due[key]
                self.start(*key)

    async def run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad check
                log.exception("supervisor check failed")
            await asyncio.sleep(CHECK_INTERVAL_S)

    def stopping(self) -> None:
        """The launcher is about to stop the ranks (nothing to prepare for child processes)."""

    def reap(self, grace_s: float) -> None:
        """Wait for ranks to exit; SIGTERM then SIGKILL the ones that do not; then remove the
        shared-memory files of ranks that could not (killed ranks leave them behind)."""
        procs = self.procs
        for sig, wait in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                if sig is not None:
                    if sig == signal.SIGTERM:
                        p.send_signal(signal.SIGCONT)  # a stopped rank handles SIGTERM only once continued
                    p.send_signal(sig)
            for p in alive:
                try:
                    p.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        remove_rank_shm([p.pid for p in procs if p.poll() is not None])
