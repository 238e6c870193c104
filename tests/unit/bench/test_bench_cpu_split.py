"""bench/bench_cpu_split.py reads a process group's CPU time and context switches from /proc."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.bench_cpu_split import group_usage

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_group_usage_names_and_counts_the_groups_processes():
    # a child in a group of its own that burns some CPU, then waits to be read
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.2: pass\nprint('ok', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        got = group_usage(os.getpgid(child.pid))
        assert list(got) == [child.pid]
        name, cpu, vol, inv = got[child.pid]
        assert name == "router" and cpu >= 0.1 and vol >= 0 and inv >= 0  # (no rank flags: the router's row)
        assert os.getpid() not in group_usage(os.getpgid(child.pid))
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
