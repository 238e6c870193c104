"""$PDSERVE_STEP_LOG: a rank's loop writes one line per engine step (rank_runtime/step_log.py) with
what the engine says the step computed (LLMEngine.last_step)."""
from __future__ import annotations

from bench.step_log import read_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from rank_runtime.loop import RankLoop
from rank_runtime.step_log import StepLog


class _Engine:
    """What RankLoop.run_once touches: two steps to run, each of a known size."""

    def __init__(self) -> None:
        self.sizes = [(0, 30), (2, 0)]
        self.last_step = (0, 0)

    def has_unfinished(self) -> bool:
        return bool(self.sizes)

    def poll_prefetch(self, wait: bool = False) -> bool:
        return bool(self.sizes)

    def step(self):
        self.last_step = self.sizes.pop(0)
        return []

    def flush_write_through(self) -> None:
        pass


class _Loop(RankLoop):
    def __init__(self, engine) -> None:
        self.engine, self.board, self.step_log, self._cache, self.deferred, self.steps = engine, None, None, None, [], 0

    def _admit(self, wait_s: float) -> None:
        pass

    def _snapshot(self):
        return None


def test_a_rank_loop_logs_each_step(tmp_path):
    loop = _Loop(_Engine())
    loop.step_log = StepLog(tmp_path, "decode", 1)
    loop.run_once()
    loop.run_once()
    loop.run_once()  # nothing left to run: no line
    loop.step_log.close()
    (name, steps), = read_dir(tmp_path).items()
    assert name.startswith("decode-1-")
    assert [(s.decode_rows, s.prompt_tokens, s.threads) for s in steps] == [(0, 30, 0), (2, 0, 0)]
    assert all(s.wall_ms >= 0 and s.thread_ms >= 0 and s.start > 0 for s in steps)


def test_the_engine_says_what_each_step_computed():
    eng = LLMEngine(EngineConfig(num_threads=1, kv_cache_gb=0.05, max_num_batched_tokens=256))
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        eng.add_request("a", list(range(100, 140)), params)
        eng.step()
        assert eng.last_step == (0, 40)
        eng.add_request("b", list(range(200, 207)), params)
        eng.step()
        assert eng.last_step == (1, 7)  # a's decode row beside b's prompt
        eng.step()
        assert eng.last_step == (2, 0)
    finally:
        eng.close()
