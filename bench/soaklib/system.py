"""The system under soak: started here (`python -m launcher.launch` in its own process group)
or found at a URL; what the soak reads from it: /health, the router's request counter in
/metrics, and each process's memory from /proc.

Idle, for a rank: nothing in flight on the router's side, nothing running or waiting, no
device KV page in use, and (PD) no handoff pending or handoff-pool page held. The host
prefix cache (`host_cache_pages`) is a cache: it keeps pages after requests end, by design,
so it is reported but not part of idle.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
IDLE_FIELDS = ("inflight", "running", "waiting", "pages_used", "handoff_pages_used", "handoffs")
# Router endpoints a soak sends requests to; "other" is the counter's label for unknown routes.
API_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "other"})


@dataclass
class Launched:
    """A system this process started: the launcher (it is the router) leads its process group."""
    proc: subprocess.Popen
    url: str
    run_dir: Path

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group; SIGKILL whatever is left after grace_s."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc):
                time.sleep(0.1)
            if not _group_alive(self.proc):
                break
        self.proc.wait(timeout=5)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader, or the group never empties
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def launch(launch_args: list[str], run_dir: Path, timeout_s: float = 600.0) -> Launched:
    """Start `python -m launcher.launch <launch_args>` on a free 127.0.0.1 port, logs in run_dir;
    returns once /health answers 200. Stops the group and raises RuntimeError when it does not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.launch", "--port", str(port), "--run-dir", str(run_dir), *launch_args]
    with open(run_dir / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    system = Launched(proc, f"http://127.0.0.1:{port}", run_dir)
    try:
        wait_healthy(system.url, timeout_s, proc)
    except BaseException:
        system.stop()
        raise
    return system


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict:
    """Poll /health until 200; returns its body. RuntimeError past timeout_s or if proc exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"launcher exited with code {proc.returncode}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy within {timeout_s:.0f}s")
        time.sleep(0.5)


def busy_fields(rank: dict) -> dict[str, object]:
    """What keeps one /health rank entry from idle (empty: idle)."""
    out: dict[str, object] = {f: rank.get(f, 0) for f in IDLE_FIELDS if rank.get(f, 0)}
    if rank.get("state") != "ready":
        out["state"] = rank.get("state")
    return out


def api_request_count(metrics_text: str) -> int:
    """Requests the router answered on API endpoints (every status, streams included), from the
    `pdserve_requests` counter in /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "pdserve_requests":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("endpoint") in API_ENDPOINTS:
                total += s.value
    return int(total)


@dataclass(frozen=True)
class Memory:
    rss_mb: float
    shmem_mb: float  # shared memory mapped and touched (host cache, handoff pool): bounded by design

    @property
    def private_mb(self) -> float:
        """RSS without shared memory: what a leak grows."""
        return self.rss_mb - self.shmem_mb


def memory(pid: int) -> Memory | None:
    """From /proc/<pid>/status (Linux); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        try:
            return Memory(psutil.Process(pid).memory_info().rss / 2**20, 0.0)  # not Linux
        except psutil.Error:
            return None
    kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in text.splitlines() if ln.startswith(
        ("VmRSS", "RssShmem")))}
    return Memory(kb.get("VmRSS", 0) / 1024, kb.get("RssShmem", 0) / 1024)


def router_pid(rank_pids: list[int]) -> int | None:
    """The router of a system found by URL: the parent the launcher-started ranks share."""
    parents = set()
    for pid in rank_pids:
        try:
            parents.add(psutil.Process(pid).ppid())
        except psutil.Error:
            return None
    return parents.pop() if len(parents) == 1 and 1 not in parents else None
