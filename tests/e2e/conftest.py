"""Real systems for end-to-end tests: `python -m launcher.launch` (router + rank processes)
on a free 127.0.0.1 port, in its own process group, reaped whatever happens.

`colocated_system`: 2 real colocated ranks on the embedded default model (num_threads=1,
kv_cache_gb=0.25, the launcher's default host cache and cache-aware routing, --log-requests),
one per test session. `fake_system`: 2 stand-in ranks (no model) with
room for 2 requests each, for router behaviour that needs no tokens of substance.
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
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class System:
    proc: subprocess.Popen
    port: int
    log_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=5)
        return r.status_code, r.json()

    def ranks(self) -> dict[str, dict]:
        return {r["name"]: r for r in self.health()[1]["ranks"]}

    def logs(self) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"==> {f.name} <==\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    def wait_until(self, cond, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; health: {self.health()}")


def start_system(tmp: Path, args: list[str], timeout: float) -> System:
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.launch", "--port", str(port), "--run-dir", str(tmp), *args]
    with open(tmp / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    system = System(proc, port, tmp)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {proc.returncode}\n{system.logs()}")
            try:
                r = httpx.get(system.url + "/health", timeout=2)
                if r.status_code == 200:
                    return system
                if r.json().get("status") == "unavailable":
                    raise RuntimeError(f"every rank died during start-up: {r.json()}\n{system.logs()}")
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"system not healthy within {timeout}s\n{system.logs()}")
            time.sleep(0.5)
    except BaseException:
        stop_system(system)
        raise


def stop_system(system: System) -> None:
    """SIGTERM the whole process group, SIGKILL what is left after 15 s."""
    pgid = system.proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        system.proc.poll()
        time.sleep(0.1)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    system.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def colocated_system(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("colocated"),
                          ["--colocated", "2", "--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1",
                           "--max-num-seqs", "16", "--log-requests"], timeout=420)
    try:
        yield system
    finally:
        stop_system(system)


@pytest.fixture(scope="module")
def pd_handoff_system(tmp_path_factory):
    """1 prefill + 1 decode rank, shm, every prompt through the prefill rank (--disagg always):
    the PD twin of colocated_system for the API tests (one per module that asks for it)."""
    system = start_system(tmp_path_factory.mktemp("pd-handoff"),
                          ["--prefill", "1", "--decode", "1", "--transfer", "shm", "--disagg", "always",
                           "--model", MODEL, "--kv-cache-gb", "0.25", "--num-threads", "1", "--max-num-seqs", "16",
                           "--handoff-pool-gb", "0.2", "--hicache-size-gb", "0"], timeout=420)
    try:
        yield system
    finally:
        stop_system(system)


FAKE_SECRET = "fake-system-secret"  # (a test that speaks to its rank socket by hand needs it)


@pytest.fixture(scope="session")
def fake_system(tmp_path_factory):
    system = start_system(tmp_path_factory.mktemp("fake"),
                          ["--fake-ranks", "--fake-step-ms", "20", "--colocated", "2", "--model", MODEL,
                           "--max-inflight-per-rank", "2", "--cluster-secret", FAKE_SECRET], timeout=120)
    try:
        yield system
    finally:
        stop_system(system)
