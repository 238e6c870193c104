"""Ranks placed on a Ray cluster (`pd_start.sh --ray ADDRESS|auto`): the launcher keeps the
router; every rank runs on the node Ray picks, as the child process of a Ray actor.

Life of a rank under Ray:
  1. `configs_for_ray()`: the launcher joins the cluster (`connect()`; `ray start --head` on
     one host, `ray start --address ...` on the others, started by the user) as a driver; the
     rank socket binds this node's IP instead of loopback, so ranks on other nodes reach it.
  2. `RayRanks.start()` puts every rank in one placement group (one bundle per rank: CPU = its
     torch threads, a GPU on CUDA, and a sliver of the custom resource `pdserve_prefill` /
     `pdserve_decode` when some node offers it, so `ray start --resources
     '{"pdserve_decode": 1}'` says which hosts decode), PACK or SPREAD (--ray-placement), then
     creates a RankHost actor in each bundle. The actor starts the rank's command line (the
     same as a launcher-started rank's) with its node's IP as --host (where a decode rank's
     peer socket binds, where a prefill rank connects from) and $PDSERVE_NODE naming the node
     (the rank's Hello carries it to /health). The rank joins the router like one started by
     hand: over TCP, with the cluster secret, transfers over NIXL between hosts.
  3. A rank that dies takes its actor with it (the actor exits when its child does, the child
     gets SIGTERM when the actor dies: PR_SET_PDEATHSIG); Ray restarts the actor
     (--max-restarts, in its bundle, after --restart-backoff-s) and the new rank rejoins under
     its name. A rank the router declared dead while its process still runs (hung, silent)
     is killed by `check()`, which makes Ray restart it. A node that disappears loses its
     ranks the same way: the router fails them over (migration) and Ray places them again.
  4. `reap()` (Ctrl-C, `pd_start.sh stop`): every actor stops its rank (SIGTERM, then
     SIGKILL) and removes the rank's shared memory on its node; then the actors and the
     placement group are removed. Actors belong to the launcher: if it is killed, Ray kills
     them, and their ranks die with them (Ray kills a dead worker's children, else the
     kernel sends them SIGTERM); files a killed rank left in /dev/shm go when the next rank
     starts on that node (supervisor.remove_dead_ranks_shm).
Every node runs the same checkout at the same path (its .venv, its embedded models): the rank's
command line names this launcher's python and the model, resolved on the rank's node.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cluster import settings
from pd_server.ranks import DEAD, RankRegistry

log = logging.getLogger("launcher.ray_ranks")

INSTALL_HINT = "Ray is not installed in this venv: run scripts/setup_ray.sh (pip install -e '.[ray]')"
NODE_IP = "{node_ip}"  # in a rank's command line: replaced by its node's IP on that node
NODE_ENV = settings.NODE.name  # the rank's node, as /health shows it
NAMESPACE = "pdserve"
CHECK_INTERVAL_S = 0.5
PLACEMENT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    return ray


def connect(address: str):
    """Join the Ray cluster at `address` ("auto": the one `ray start` left on this host) as a
    driver; returns this node's IP. Raises RuntimeError with what to do when it cannot."""
    ray = import_ray()
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"cannot connect to the Ray cluster at {address!r}: {e} (start one with "
                           "`ray start --head`, then pass its address, or auto on its head node)") from e
    ip = ray.util.get_node_ip_address()
    res = ray.cluster_resources()
    log.info("Ray cluster %s: %d node(s), %s CPU, %s GPU; this node %s", address, len(ray.nodes()),
             res.get("CPU", 0), res.get("GPU", 0), ip)
    return ip


def configs_for_ray(cfg, launch, engine_cfg):
    """Join the Ray cluster (launch.ray); the launcher's configs for ranks on other hosts: the
    rank socket on this node's IP, each rank's --host its own node's IP, no core lending,
    pinning or weight file (they assume one host), threads from the cluster's CPUs; and this
    node's IP (where a Mooncake master started here listens). RuntimeError: cannot connect."""
    node_ip = connect(launch.ray)
    if cfg.rank_addr.startswith("tcp://127."):
        cfg = replace(cfg, rank_addr=f"tcp://{node_ip}:{cfg.rank_addr.rsplit(':', 1)[1]}")
    launch = replace(launch, lend_cores=False, lend_idle_cores=False, pin_cores=False, share_weights=False,
                     prefill_host=NODE_IP, decode_host=NODE_IP)
    if engine_cfg.num_threads == 0:
        cpus = int(import_ray().cluster_resources().get("CPU", 1))
        engine_cfg = replace(engine_cfg, num_threads=max(1, cpus // launch.num_ranks))
    return cfg, launch, engine_cfg, node_ip


def _die_with_parent() -> None:  # (in the child, before exec)
    PR_SET_PDEATHSIG = 1  # SIGTERM: the rank stops as on `pd_start.sh stop`, removing its shared memory
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _is_rank(pid: int, role: str, index: int) -> bool:
    """Whether process `pid` on this node is pdserve rank `role`-`index` (its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(a.endswith(("rank_runtime.colocated", "decode.rank", "prefill.rank", "rank_runtime.fake_rank")) for a in argv) and \
        f"--role\0{role}\0--index\0{index}\0" in "\0".join(argv) + "\0"


class RankHost:
    """The Ray actor holding one rank process (made remote by RayRanks). Not used directly."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: str, log_dir: str,
                 backoff_s: float) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.name = name
        self.node_ip = ray.util.get_node_ip_address()
        self.node = f"{socket.gethostname()} {self.node_ip} ({ctx.get_node_id()[:8]})"
        if ctx.was_current_actor_reconstructed:
            time.sleep(backoff_s)
        from launcher.supervisor import remove_dead_ranks_shm

        remove_dead_ranks_shm()  # a rank killed with its actor (this one's last life) could not
        argv = [a.replace(NODE_IP, self.node_ip) for a in argv]
        if not os.path.exists(argv[0]):  # another layout on this node: its own interpreter
            argv[0] = sys.executable
        out = subprocess.DEVNULL
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(log_dir) / f"rank-{name}.log", "ab")  # noqa: SIM115 - the child owns it
        self.stopping = False
        self.proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env, NODE_ENV: self.node},
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        if out is not subprocess.DEVNULL:
            out.close()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if self.stopping or code == 0:  # asked to stop (reap, or the router's Shutdown)
            return
        from launcher.supervisor import remove_rank_shm

        remove_rank_shm([self.proc.pid])
        os._exit(1)  # the rank died: so does its actor, which Ray restarts (max_restarts)

    def info(self) -> dict:
        return {"name": self.name, "pid": self.proc.pid, "node": self.node, "node_ip": self.node_ip,
                "actor_pid": os.getpid()}

    def kill_rank(self, pid: int, role: str, index: int) -> bool:
        """SIGKILL rank process `pid` (the router declared it dead): this actor's child, or a
        hung one an earlier life of this actor left behind (SIGTERM at its death did nothing)."""
        if self.proc.pid == pid:
            if self.proc.poll() is not None:
                return False
            self.proc.kill()
            return True
        if not _is_rank(pid, role, index):
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def set_stopping(self) -> None:
        self.stopping = True

    def stop(self, grace_s: float) -> int | None:
        """Stop the rank (it may have exited on the router's Shutdown already); remove its
        shared memory. Returns its exit code."""
        from launcher.supervisor import remove_dead_ranks_shm, remove_rank_shm

        self.stopping = True
        p = self.proc
        for sig, wait in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            if p.poll() is not None:
                break
            if sig == signal.SIGTERM:
                p.send_signal(signal.SIGCONT)  # a stopped rank handles SIGTERM only once continued
            if sig is not None:
                p.send_signal(sig)
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        remove_rank_shm([p.pid])
        remove_dead_ranks_shm()
        return p.poll()


class RayRanks:
    """The launcher's side: places the ranks, kills the ones the router declared dead, stops
    them all. Same interface as supervisor.Supervisor (start, run, stopping, reap)."""

    def __init__(self, registry: RankRegistry, command: Callable[[str, int], list[str]], roles, threads: int,
                 gpus: float, max_restarts: int, backoff_s: float, start_timeout_s: float, placement: str,
                 log_dir: str = "", env: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic):
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group

        self.registry, self.command, self.clock = registry, command, clock
        self.max_restarts, self.backoff_s, self.start_timeout_s = max_restarts, backoff_s, start_timeout_s
        self.log_dir, self.env = log_dir, dict(env or {})
        self.slots = [(role, i) for role, n in roles for i in range(n)]
        offered = ray.cluster_resources()
        self.bundles = []
        for role, _ in self.slots:
            b = {"CPU": float(threads)}
            if gpus:
                b["GPU"] = float(gpus)
            if f"pdserve_{role}" in offered:  # some node says it runs this role: only those do
                b[f"pdserve_{role}"] = 0.01
            self.bundles.append(b)
        self.pg = placement_group(self.bundles, strategy=placement.upper(), name=f"pdserve-{os.getpid()}")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError and friends
            self._remove_pg()
            raise RuntimeError(f"Ray could not place {len(self.bundles)} rank(s) within {PLACEMENT_TIMEOUT_S:.0f}s: "
                               f"needs {self.bundles}, the cluster offers {offered} ({e})") from e
        self.host_cls = ray.remote(RankHost)
        self.actors: dict[str, object] = {}
        self._handled: set[int] = set()  # rank pids check() has killed

    def _remove_pg(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - the cluster may be gone
            log.exception("removing the placement group failed")

    def start(self, role: str, index: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name, i = f"{role}-{index}", self.slots.index((role, index))
        b = self.bundles[i]
        opts = dict(name=f"pdserve-{os.getpid()}-{name}", num_cpus=b["CPU"], num_gpus=b.get("GPU", 0),
                    resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")},
                    max_restarts=self.max_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
        self.actors[name] = self.host_cls.options(**opts).remote(
            name, self.command(role, index), self.env, os.getcwd(), self.log_dir, self.backoff_s)
        ready_by = self.clock() + self.start_timeout_s if self.start_timeout_s else 0.0
        self.registry.expect(role, index, None, ready_by)
        log.info("placed %s as a Ray actor (bundle %d: %s)", name, i, b)

    def check(self) -> None:
        """Kill the rank process of every rank the router declared dead (a hung rank, a silent
        one): its actor exits with it and Ray restarts both."""
        for rank in self.registry.ranks.values():
            actor = self.actors.get(rank.name)
            if rank.state != DEAD or actor is None or rank.pid is None or rank.pid in self._handled:
                continue
            self._handled.add(rank.pid)
            log.warning("killing %s (pid %s) through its actor: %s", rank.name, rank.pid, rank.dead_reason)
            actor.kill_rank.remote(rank.pid, rank.role, rank.index)  # fire and forget: a dead node never answers

    async def run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad check
                log.exception("ray rank check failed")
            await asyncio.sleep(CHECK_INTERVAL_S)

    def info(self) -> list[dict]:
        """Each live actor's info (name, rank pid, node, actor pid)."""
        refs = [a.info.remote() for a in self.actors.values()]
        return self.ray.get(refs, timeout=CALL_TIMEOUT_S)

    def stopping(self) -> None:
        """Before the router tells the ranks to exit: their exits are not deaths to restart."""
        self._wait([a.set_stopping.remote() for a in self.actors.values()], 5.0)

    def reap(self, grace_s: float) -> None:
        """Stop every rank and its actor, remove the placement group, leave the cluster."""
        self._wait([a.stop.remote(grace_s) for a in self.actors.values()], grace_s + 10.0)
        for a in self.actors.values():
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._remove_pg()
        self.ray.shutdown()

    def _wait(self, refs: list, timeout: float) -> None:
        if not refs:
            return
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        except Exception:  # noqa: BLE001 - an actor on a lost node; the kill below covers it
            log.exception("waiting on the rank actors failed")
