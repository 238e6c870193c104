"""A system under test as one process group: wait for its /health, stop every process of it.

    port = free_port()
    proc = subprocess.Popen(cmd, start_new_session=True)   # the group's leader
    wait_healthy(url, proc, timeout_s)                     # RuntimeError if it exits or times out
    stop(proc, timeout_s)                                  # SIGTERM, SIGKILL after timeout_s

Used by bench/agentx/compare.py (launcher.launch) and bench/mission (vLLM's `vllm serve`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll `url`/health until 200. Returns the seconds it took; RuntimeError if `proc` exits
    first or `timeout_s` passes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not healthy within {timeout_s:.0f} s")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGTERM `proc`'s group (it leads one: start_new_session=True), SIGKILL what is left after
    `timeout_s`. True if it went cleanly; RuntimeError if anything survives SIGKILL."""
    pgid, clean = proc.pid, True
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait(timeout=10)
        return True
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        proc.poll()
        if time.monotonic() > deadline:
            clean = False
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        time.sleep(0.2)
    proc.wait(timeout=10)
    for _ in range(50):  # SIGKILLed children may take a moment to be reaped by init
        if not group_alive(pgid):
            break
        time.sleep(0.1)
    if group_alive(pgid):
        raise RuntimeError(f"processes of group {pgid} survived SIGKILL")
    return clean
