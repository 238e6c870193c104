"""Prefill ranks run nicer than decode ranks where they share cores (--prefill-nice, RankConfig.nice)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.config import EngineConfig
from launcher.launch import LaunchConfig, rank_command
from rank_runtime.config import RankConfig


def nice_flag(launch: LaunchConfig, role: str) -> str | None:
    cmd = rank_command(EngineConfig(), launch, role, 0, "ipc://x")
    return cmd[cmd.index("--nice") + 1] if "--nice" in cmd else None


def test_prefill_nice_reaches_the_prefill_ranks_only():
    launch = LaunchConfig(prefill=2, decode=2, prefill_nice=7)
    assert (nice_flag(launch, "prefill"), nice_flag(launch, "decode")) == ("7", None)
    assert nice_flag(LaunchConfig(prefill=2, decode=2, prefill_nice=0), "prefill") is None
    with pytest.raises(ValueError, match="PD mode"):
        LaunchConfig(colocated=2, prefill_nice=7)


@pytest.mark.parametrize("bad", [-1, 20])
def test_niceness_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="nice"):
        LaunchConfig(prefill=1, decode=1, prefill_nice=bad)
    with pytest.raises(ValueError, match="nice"):
        RankConfig(router_addr="ipc://x", nice=bad)


def test_renice_takes_every_thread_and_those_started_later():
    # In a child: niceness only goes up without privileges, and this process must keep its own.
    code = textwrap.dedent("""
        import os, threading
        from rank_runtime.core_board import renice_threads
        stop = threading.Event()
        seen = {}
        def start(name):
            ready = threading.Event()
            def worker():
                seen[name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                ready.set()
                stop.wait()
            t = threading.Thread(target=worker); t.start()
            ready.wait(30)
            return t
        before = start("before")
        base = os.getpriority(os.PRIO_PROCESS, 0)
        n = renice_threads(5)
        after = start("after")
        tid = before.native_id
        print(n, base, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, tid), seen["after"])
        stop.set(); before.join(); after.join()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    n, base, main, before, after = map(int, out.stdout.split())
    if base >= 19:
        pytest.skip("this process already runs at the highest niceness: nothing to raise")
    assert n >= 2
    want = min(19, base + 5)
    assert (main, before, after) == (want, want, want)
