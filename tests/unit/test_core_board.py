"""Idle cores lent between the ranks of one host (decode/core_board.py) and the launcher's wiring."""
from __future__ import annotations

import time

import pytest
import torch

from decode.core_board import CoreBoard, create_board
from engine.config import EngineConfig
from pd_server.launch import LaunchConfig, rank_command


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_a_rank_borrows_the_threads_of_settled_idle_peers(tmp_path, threads):
    path = create_board(tmp_path / "board", 3)
    a, b, c = (CoreBoard(path, i, own_threads=2, max_threads=6, settle_s=0.05) for i in range(3))
    assert a.busy() == 2  # every slot starts busy: ranks still loading lend nothing
    b.idle()
    assert a.busy() == 2  # not settled yet: a busy rank's short gaps are not lent
    time.sleep(0.06)
    assert a.busy() == 4 and torch.get_num_threads() == 4
    c.idle()
    time.sleep(0.06)
    assert a.busy() == 6 and torch.get_num_threads() == 6
    assert b.busy() == 4  # b is back, so a would lend only c's
    assert a.busy() == 4
    a.idle()
    assert a.threads == 2 and torch.get_num_threads() == 2
    c.close()  # a stopped rank reads busy
    time.sleep(0.06)
    assert b.busy() == 4 and b.idle_peers() == 1


def test_threads_are_capped_and_bad_slots_refused(tmp_path, threads):
    path = create_board(tmp_path / "board", 2)
    a, b = CoreBoard(path, 0, own_threads=1, max_threads=1, settle_s=0.0), CoreBoard(path, 1, 1, 8, settle_s=0.0)
    a.idle()
    assert b.busy() == 2
    b.idle()
    assert a.busy() == 1  # max_threads 1
    with pytest.raises(ValueError, match="no slot 2"):
        CoreBoard(path, 2, 1)


def test_launcher_gives_each_rank_its_slot():
    launch = LaunchConfig(prefill=2, decode=3)
    cmd = rank_command(EngineConfig(), launch, "decode", 1, "ipc://x", core_board="/dev/shm/b")
    assert cmd[cmd.index("--core-board") + 1] == "/dev/shm/b" and cmd[cmd.index("--core-slot") + 1] == "3"
    cmd = rank_command(EngineConfig(), launch, "prefill", 1, "ipc://x", core_board="/dev/shm/b")
    assert cmd[cmd.index("--core-slot") + 1] == "1"
    assert "--core-board" not in rank_command(EngineConfig(), launch, "prefill", 0, "ipc://x")
