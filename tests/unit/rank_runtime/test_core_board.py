"""Idle cores lent between the ranks of one host (rank_runtime/core_board.py) and the launcher's wiring."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from engine.config import EngineConfig
from launcher.launch import LaunchConfig, rank_command
from rank_runtime.core_board import CoreBoard, board_path, create_board


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_a_peer_counts_as_idle_once_settled(tmp_path, threads):
    path = create_board(tmp_path / "board", 2)
    a, b = (CoreBoard(path, i, own_threads=1, settle_s=0.05) for i in range(2))
    b.idle()
    since = b._idle_since  # what b wrote on the board
    assert a.idle_peers(now=since) == 0  # not settled: a busy rank's short gaps are not lent
    assert a.idle_peers(now=since + 0.06) == 1
    b.busy()
    assert a.idle_peers(now=since + 0.06) == 0


def test_ranks_borrow_only_cores_no_other_rank_holds(tmp_path, threads):
    """Issue 36: 2 prefill + 2 decode ranks on 2 cores. Both decode ranks busy, both prefill
    ranks idle: counted as threads, each decode rank took the idle ranks' and 4 OpenMP threads
    spun on 2 cores. Counted as cores, the first takes the one free core and the second none;
    once the first gives it back (its decode batch ends) the second may have it."""
    path = create_board(tmp_path / "board", 4, threads=1, cores=2)
    p0, p1, d0, d1 = (CoreBoard(path, i, own_threads=1, settle_s=0.0) for i in range(4))
    p0.idle()
    p1.idle()
    assert d0.busy() == 1  # d1 holds the other core (busy): nothing is free
    d1.idle()
    d0.recheck()
    assert d0.threads == 2
    assert d1.busy() == 1  # back on its own core; d0 holds the other
    d0.recheck()
    assert d0.threads == 1 and d1.busy() == 1 and torch.get_num_threads() == 1
    p0.busy()  # a prompt arrives: 3 busy ranks, one thread each, the OS shares the 2 cores
    d0.recheck()
    assert d0.threads == d1.threads == p0.threads == 1
    d0.idle()
    p0.recheck()
    assert p0.threads == 1  # d1 holds one core, p0 its own


@pytest.mark.parametrize("ranks,cores,own", [(4, 2, 1), (2, 2, 1), (3, 4, 1), (2, 4, 2), (5, 3, 1)])
def test_no_interleaving_oversubscribes_the_cores(tmp_path, threads, ranks, cores, own):
    """Random interleavings of busy / recheck / idle over the ranks of one board. After any
    rank's call that leaves it above its own threads, the busy ranks hold at most `cores`
    threads; once every busy rank has passed a layer boundary, they hold at most
    max(cores, their own threads): borrowing never puts two threads on a core."""
    import random

    rng = random.Random(ranks * 100 + cores)
    path = create_board(tmp_path / "board", ranks, threads=own, cores=cores)
    board = [CoreBoard(path, i, own_threads=own, settle_s=0.0) for i in range(ranks)]
    state = ["busy"] * ranks  # slots start busy

    def held() -> int:
        return sum(b.threads for b, s in zip(board, state) if s == "busy")

    def own_busy() -> int:
        return sum(b.own for b, s in zip(board, state) if s == "busy")

    for _ in range(600):
        i = rng.randrange(ranks)
        op = rng.choice(["busy", "busy_eager", "recheck", "idle"])
        b = board[i]
        if op == "idle":
            b.idle()
            state[i] = "idle"
        elif op == "recheck":
            if state[i] == "busy":
                b.recheck()
        else:
            b.busy(eager=op == "busy_eager")
            state[i] = "busy"
        if b.threads > b.own:
            assert held() <= cores, (op, i, [x.threads for x in board], state)
        for j, other in enumerate(board):
            if state[j] == "busy":
                other.recheck()
        assert held() <= max(cores, own_busy()), (op, i, [x.threads for x in board], state)
        assert all(x.threads >= x.own for x in board)


def test_a_pinned_rank_widens_its_affinity_only_while_it_borrows(tmp_path, threads):
    from rank_runtime.core_board import host_cpus

    cpus = host_cpus()
    if len(cpus) < 2:
        pytest.skip("needs 2 cpus")
    before = os.sched_getaffinity(0)
    path = create_board(tmp_path / "board", 2, threads=1, cores=2)
    try:
        a = CoreBoard(path, 0, 1, settle_s=0.0, home=cpus[:1], host=cpus[:2])
        b = CoreBoard(path, 1, 1, settle_s=0.0, home=cpus[1:2], host=cpus[:2])
        os.sched_setaffinity(0, cpus[:1])  # what the rank did at start
        b.idle()
        assert a.busy() == 2 and os.sched_getaffinity(0) == set(cpus[:2])
        b.busy()
        a.recheck()
        assert a.threads == 1 and os.sched_getaffinity(0) == {cpus[0]}
    finally:
        from rank_runtime.core_board import pin_threads

        pin_threads(before)


def test_launcher_pins_ranks_to_disjoint_cores_only_where_they_fit():
    cpus = [0, 1, 2, 3]

    def pinned(launch, role, i, threads):
        cmd = rank_command(EngineConfig(num_threads=threads), launch, role, i, "ipc://x", cpus=cpus)
        return cmd[cmd.index("--cpus") + 1] if "--cpus" in cmd else None

    pd = LaunchConfig(prefill=1, decode=1)
    assert (pinned(pd, "prefill", 0, 2), pinned(pd, "decode", 0, 2)) == ("0,1", "2,3")
    many = LaunchConfig(prefill=2, decode=3)
    assert pinned(many, "decode", 1, 1) is None  # 5 ranks on 4 cores: the OS places them
    assert pinned(LaunchConfig(colocated=2, pin_cores=False), "colocated", 1, 2) is None
    assert pinned(LaunchConfig(colocated=4), "colocated", 3, 1) == "3"


def test_a_new_board_removes_those_of_dead_launchers(tmp_path):
    # A launcher killed with SIGKILL cannot unlink its board; the next one on the host does.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = create_board(board_path(tmp_path, int(dead)), 2)
    live = create_board(board_path(tmp_path, os.getppid()), 2)  # a running launcher's
    other = tmp_path / "pdserve-cores-notes"
    other.write_text("not a board")
    mine = create_board(board_path(tmp_path, os.getpid()), 2)
    assert not stale.exists()
    assert live.exists() and other.exists() and mine.exists()


def test_a_rank_borrows_the_threads_of_idle_peers(tmp_path, threads):
    path = create_board(tmp_path / "board", 3, threads=2, cores=6)
    a, b, c = (CoreBoard(path, i, own_threads=2, max_threads=6, settle_s=0.0) for i in range(3))
    assert a.busy() == 2  # every slot starts busy: ranks still loading lend nothing
    b.idle()
    assert a.busy() == 4 and torch.get_num_threads() == 4
    c.idle()
    assert a.busy() == 6 and torch.get_num_threads() == 6
    assert b.busy() == 2  # b is back on its own cores; a holds the rest until its next layer
    a.recheck()
    assert a.threads == 4 and torch.get_num_threads() == 4  # c's cores and its own
    assert b.busy() == 2  # a holds every free core: b borrows nothing
    a.idle()
    assert a.threads == 2 and torch.get_num_threads() == 2
    c.close()  # a stopped rank reads busy
    assert b.busy() == 4 and b.idle_peers() == 1


def test_lent_threads_go_back_between_layers_once_the_owner_is_busy(tmp_path, threads):
    path = create_board(tmp_path / "board", 2)
    a, b = CoreBoard(path, 0, 1, 2, settle_s=0.0), CoreBoard(path, 1, 1, 2, settle_s=0.0)
    b.idle()
    assert a.busy() == 2
    a.recheck()
    assert a.threads == 2 and torch.get_num_threads() == 2  # b still idle
    b.busy()
    a.recheck()
    assert a.threads == 1 and torch.get_num_threads() == 1


def test_a_step_takes_the_threads_of_a_peer_that_goes_idle_during_it(tmp_path, threads):
    """A prompt that arrives just as the peer finishes: its step starts on its own threads (the
    peer has not settled) and takes the peer's at a later layer boundary once it has."""
    path = create_board(tmp_path / "board", 2)
    a, b = CoreBoard(path, 0, 1, 2, settle_s=0.05), CoreBoard(path, 1, 1, 2, settle_s=0.05)
    b.busy()
    assert a.busy() == 1
    b.idle()
    a.recheck()
    assert a.threads == 1  # not settled yet
    time.sleep(0.06)
    a.recheck()
    assert a.threads == 2 and torch.get_num_threads() == 2
    a.idle()
    assert a.threads == 1
    a.busy(invariant=False)  # a step whose bits depend on the thread count never borrows
    a.recheck()
    assert a.threads == 1


def test_a_long_step_takes_an_idle_peers_threads_before_it_settles(tmp_path, threads):
    """A prompt's prefill (more than eager_rows rows) borrows a peer that has just gone idle; a
    short step waits for it to settle; either hands the threads back once the peer is busy."""
    path = create_board(tmp_path / "board", 2)
    a, b = CoreBoard(path, 0, 1, 2, settle_s=60.0), CoreBoard(path, 1, 1, 2, settle_s=60.0)
    b.idle()
    assert a.busy() == 1  # a decode step: the peer has not settled
    assert a.busy(eager=True) == 2 and torch.get_num_threads() == 2
    a.recheck()
    assert a.threads == 2  # between layers too
    b.busy()
    a.recheck()
    assert a.threads == 1
    b.idle()
    assert a.busy(invariant=False, eager=True) == 1  # bits that depend on the thread count: never


def test_a_rank_marks_itself_idle_before_it_waits_for_work(tmp_path, threads):
    """Not after the wait (up to IDLE_WAIT_S): a peer's prefill that starts meanwhile gets the cores."""
    from rank_runtime.loop import RankLoop

    path = create_board(tmp_path / "board", 2)
    mine, peer = CoreBoard(path, 0, 1, 2, settle_s=0.0), CoreBoard(path, 1, 1, 2, settle_s=0.0)
    seen = []

    class Loop(RankLoop):
        def __init__(self) -> None:  # no engine: nothing to run
            self.engine = type("Idle", (), {"has_unfinished": lambda _: False,
                                            "poll_prefetch": lambda _, wait=False: False})()
            self.board, self._stats = mine, None

        def _admit(self, wait_s: float) -> None:
            seen.append(peer.busy(eager=True))

        def _snapshot(self):
            return None

    mine.busy()
    Loop().run_once()
    assert seen == [2]


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


def test_lend_all_flag_reaches_the_ranks():
    launch = LaunchConfig(colocated=2, lend_idle_cores=True)
    assert "--lend-all" in rank_command(EngineConfig(), launch, "colocated", 1, "ipc://x", core_board="/b")
    assert "--lend-all" not in rank_command(EngineConfig(), LaunchConfig(colocated=2), "colocated", 1,
                                                "ipc://x", core_board="/b")


def test_steps_of_unstable_bits_borrow_only_when_asked(tmp_path, threads):
    path = create_board(tmp_path / "board", 2)
    a, b = CoreBoard(path, 0, 1, 2, settle_s=0.0), CoreBoard(path, 1, 1, 2, settle_s=0.0, lend_all=True)
    a.idle()
    b.idle()
    assert a.busy(invariant=False) == 1 and a.busy(invariant=True) == 2
    a.idle()
    assert b.busy(invariant=False) == 2
    none = CoreBoard(path, 0, 1, 2, settle_s=0.0, invariant_rows=0)
    from native.linear import invariant_rows

    assert a.invariant_rows == invariant_rows() and none.invariant_rows == 0  # the kernel's, or the engine's


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_give_the_same_bits_on_lent_threads(threads, dtype):
    """The numerics contract that lets the steps `LLMEngine.next_step_invariant` names borrow
    threads by default: prompts run on 1 thread, or with every step that may borrow on 2, give
    bitwise the same tokens and logprobs. bf16: prefill chunks of one prompt or several, up to
    4096 rows a step where the kernel takes any row count, and decode batches at contexts past
    1024 tokens, where 2 threads would cut split-K. float32 (the quant-copy kernel of AVX2 CPUs,
    the default GGUF model): decode steps of up to 16 rows, at the same contexts."""
    from engine.config import EngineConfig as Cfg
    from native.linear import invariant_rows
    from native.paged_attention import set_split_threads
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (1500, 300, 1100, 530)]
    runs, lent_steps = [], 0
    try:
        set_split_threads(1)
        for lent in (1, 2):
            # bf16: a budget the kernel covers, so the prefill chunks borrow too.
            budget = min(max(invariant_rows(), 32), 4096) if dtype == "bfloat16" else 4096
            eng = LLMEngine(Cfg(num_threads=1, kv_cache_gb=0.25, dtype=dtype, max_num_batched_tokens=budget))
            if not eng.invariant_rows():
                eng.close()
                pytest.skip(f"no thread-count invariant {dtype} kernel on this CPU: nothing is lent by default")
            params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
                      SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, logprobs=2),
                      SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
                      SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)]
            out: dict[str, list] = {}
            # The first three together (batched chunks), the last alone (one 530-row prefill).
            for batch in ((0, 1, 2), (3,)):
                for i in batch:
                    eng.add_request(f"r{i}", prompts[i], params[i])
                while eng.has_unfinished():
                    borrow = eng.next_step_invariant()
                    lent_steps += borrow and lent == 2
                    torch.set_num_threads(lent if borrow else 1)
                    for o in eng.step():
                        out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
            runs.append(out)
            eng.close()
    finally:
        set_split_threads(0)
    assert runs[0] == runs[1] and all(len(v) == 12 for v in runs[0].values())
    assert lent_steps >= 20  # decode steps, and (bf16: the chunk GEMM) the prefill chunks too


def test_the_step_row_bound():
    from engine.config import EngineConfig as Cfg
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(Cfg(num_threads=1, kv_cache_gb=0.25, max_num_batched_tokens=64))
    try:
        assert not eng.next_step_rows_at_most(10**6)  # nothing to run
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        eng.add_request("a", list(range(100, 140)), sp)
        assert eng.next_step_rows_at_most(40) and not eng.next_step_rows_at_most(39)
        eng.add_request("b", list(range(100, 150)), sp)
        assert eng.next_step_rows_at_most(64) and not eng.next_step_rows_at_most(63)  # the budget caps it
        eng.step()
        assert eng.next_step_rows_at_most(64) and not eng.next_step_rows_at_most(26)  # 1 decode row + 26 prefill
        eng.step()
        assert eng.next_step_rows_at_most(2) and not eng.next_step_rows_at_most(1)  # two decode rows
    finally:
        eng.close()


def test_float32_steps_borrow_only_with_decode_rows_alone():
    """On the float32 quant-copy kernel prompt chunks take torch's attention and GEMM, whose bits
    may depend on the thread count: only steps of decode rows, at most 16, may borrow."""
    from engine.config import EngineConfig as Cfg
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    eng = LLMEngine(Cfg(num_threads=1, kv_cache_gb=0.25, dtype="float32", max_num_batched_tokens=64))
    try:
        if eng.invariant_steps() != (16, True):
            pytest.skip("the float32 quant-copy kernel does not run on this CPU")
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        eng.add_request("a", list(range(100, 108)), sp)
        assert eng.next_step_rows_at_most(16) and not eng.next_step_invariant()  # an 8-row prompt chunk
        eng.step()
        assert eng.next_step_invariant()  # one decode row
        eng.add_request("b", list(range(100, 104)), sp)
        assert not eng.next_step_invariant()  # a prompt joins it
        eng.step()
        assert eng.next_step_invariant()  # two decode rows
    finally:
        eng.close()
