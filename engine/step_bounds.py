"""What an engine can tell about its next step before it runs: a bound on its rows, and whether
its bits will depend on the thread count it runs with. A rank asks both before each step to
decide whether the step may borrow idle ranks' cores (rank_runtime/core_board.py)."""
from __future__ import annotations

import functools


class StepBounds:
    """Mixed into LLMEngine; reads its `scheduler`, `runner` and `cfg`."""

    def next_step_rows(self) -> int:
        """A bound on the next step's rows: every running and waiting sequence's next chunk,
        capped by the token budget (0 with nothing to run)."""
        sched = self.scheduler
        rows = sum(s.num_schedulable for s in sched.running) + sum(s.num_schedulable for s in sched.waiting)
        return min(rows, sched.budget)

    def next_step_rows_at_most(self, max_rows: int, rows: int | None = None) -> bool:
        """True when the next step will run at least one and at most `max_rows` rows (by
        next_step_rows' bound, or `rows` where the caller has it)."""
        sched = self.scheduler
        if not (sched.running or sched.waiting):
            return False
        return (self.next_step_rows() if rows is None else rows) <= max_rows

    def invariant_rows(self) -> int:
        """Steps of up to this many rows give every row the same bits at any thread count (0: no
        step does), so they may run on threads lent by idle ranks. bf16 on the CPU with the
        linear kernel: its limit (native.linear.invariant_rows). float32 where every linear reads
        a quant copy (native/quant_linear.py, AVX2): QUANT_F32_ROWS, for steps of decode rows
        only (`next_step_invariant`: prompt chunks take torch's attention and GEMM)."""
        return self._invariant[0]

    def invariant_steps(self) -> tuple[int, bool]:
        """(invariant_rows(), whether that holds for steps of decode rows only)."""
        return self._invariant

    @functools.cached_property
    def _invariant(self) -> tuple[int, bool]:
        import torch

        if self.runner.device.type != "cpu":
            return 0, False
        if self.cfg.torch_dtype == torch.bfloat16:
            from native.linear import invariant_rows
            return invariant_rows(), False
        if self.cfg.torch_dtype == torch.float32:
            from engine.layers.linear import Linear
            from native.quant_linear import QUANT_F32_ROWS, quant_f32_available

            linears = [m for m in self.runner.model.modules() if isinstance(m, Linear)]
            if linears and quant_f32_available() and all(m.quant_weight() is not None for m in linears):
                return QUANT_F32_ROWS, True
        return 0, False

    def next_step_invariant(self, rows: int | None = None) -> bool:
        """True when the next step's bits will not depend on the thread count it runs with: at
        most invariant_rows() rows (`rows`: next_step_rows() where the caller has it), and,
        where that holds for decode rows only, no prompt chunk."""
        limit, decode_only = self._invariant
        if not limit or not self.next_step_rows_at_most(limit, rows):
            return False
        sched = self.scheduler
        return not decode_only or (not sched.waiting and all(s.decodes(s.num_schedulable) for s in sched.running))
