"""Continuous batching with chunked prefill, FCFS admission and preemption by recompute.

Each step:
  1. Running sequences, oldest first, get their next tokens (1 when decoding, a
     chunk when still prefilling) within the step's token budget. A sequence that
     cannot get the pages it needs preempts the newest running sequence (its pages
     and SWA slot are freed; it goes back to the head of the queue and will
     recompute prompt + generated tokens), until it fits or is itself preempted.
  2. Waiting sequences are admitted in arrival order while budget, sequence slots,
     pages and SWA slots last; the first that does not fit stops admission (FCFS).
  Prompts one after another (`pack_tokens`): the first prompt chunk of a step may take the whole
  budget, but further prompts join the step only up to `pack_tokens` prompt tokens in all. A
  prompt's first token comes when its last chunk's step ends, and a step's time grows with its
  prompt tokens (compute-bound), so four 350-token prompts in one step give all four their first
  token after ~1,400 tokens of compute, one after another the first after ~350 (mean TTFT ~0.6x);
  the decodes riding along get a token every ~350 prompt tokens instead of every ~1,400. Short
  prompts still share a step (a step costs a pass over the weights whatever it holds). 0: prompts
  fill the budget.
  3. Decode entries (generated tokens: one while decoding, the tokens it had generated for a
     sequence that recomputes them after a preemption or a move from another rank, one a step
     on models with a sliding window) go first in the step (they attend as one padded batch,
     a row per token); prompt tokens, even a one-token chunk, run as prefill chunks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import KVPool
from engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, new tokens this step), one-token entries first
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, pool: KVPool, max_num_seqs: int, max_num_batched_tokens: int, pack_tokens: int = 0) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.pack_tokens = pack_tokens  # see the module docstring; 0: no limit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total, for metrics and tests
        # Admission hook (imported KV, prefix cache): called on a waiting sequence
        # right after it got its SWA slot and before pages are allocated; may set
        # seq.pages and num_computed. Returns False when the sequence cannot be
        # admitted yet (it must then have taken nothing).
        self.on_admit = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence whose KV is already in its pages (and SWA slot) from the next step
        (a PD decode rank's pulled handoff). The caller checked max_num_seqs."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _rows(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes in this step: its schedulable ones within the budget; generated
        tokens recomputed (decode rows) one a step where the model has sliding-window layers,
        whose one-token entries write the ring before reading it."""
        n = min(seq.num_schedulable, budget)
        if n > 1 and self.pool.swa_layers and seq.decodes(n):
            n = 1
        return n

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.pool.free_pages:
            return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Return a sequence's pages and SWA slot to the pool (idempotent)."""
        self.pool.free(seq.pages)
        seq.pages = []
        self.pool.free_slot(seq.swa_slot)
        seq.swa_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.num_cached_prompt = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _prompt_room(self, budget: int, prompt: int) -> int:
        """Tokens the next prompt chunk may take in a step that has `prompt` prompt tokens."""
        if not self.pack_tokens or not prompt:
            return budget
        return max(0, min(budget, self.pack_tokens - prompt))

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        prompt = 0  # prompt tokens in the step so far
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._rows(seq, budget)
            if n and not seq.decodes(n):
                n = self._rows(seq, self._prompt_room(budget, prompt))
            if n == 0:
                continue
            while not self._ensure_pages(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += sum(k for s, k in scheduled if s is victim)
                scheduled = [(s, k) for s, k in scheduled if s is not victim]
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                scheduled.append((seq, n))
                budget -= n
                prompt += 0 if seq.decodes(n) else n
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                if self.pack_tokens and prompt >= self.pack_tokens:
                    break  # (before admission loads a prefix-cache hit it could not use this step)
                seq = self.waiting[0]
                if self.pool.swa_layers and self.pool.free_slots == 0:
                    break
                seq.swa_slot = self.pool.allocate_slot()
                if self.on_admit is not None and not self.on_admit(seq):
                    self.release(seq)
                    break
                n = self._rows(seq, budget)
                if n and not seq.decodes(n):
                    n = self._rows(seq, self._prompt_room(budget, prompt))
                if n == 0 or not self._ensure_pages(seq, seq.num_computed + n):
                    self.release(seq)
                    seq.num_computed = 0
                    break
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                scheduled.append((seq, n))
                budget -= n
                prompt += 0 if seq.decodes(n) else n
        scheduled.sort(key=lambda e: not e[0].decodes(e[1]))  # stable: decode entries first
        return SchedulerOutput(scheduled, preempted)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from whichever queue holds it, freeing its memory."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
