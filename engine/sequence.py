"""A request as the engine sees it: tokens, KV ownership, and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass
class Sequence:
    """Mutable per-request state owned by the engine loop.

    num_computed: tokens of `token_ids` whose KV is in the cache (and SWA ring).
    pages: the KV pages holding positions [i*page_size, (i+1)*page_size).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served from a prefix cache (usage.cached_tokens)
    pages: list[int] = field(default_factory=list)
    swa_slot: int | None = None
    finish_reason: FinishReason | None = None
    stop_str: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # Set when prefill-only: stop after the first sampled token (PD prefill rank).
    prefill_only: bool = False
    # Host prefix cache: ascending positions where the prompt is written through after
    # the step that reaches them; a chunk never crosses the next one (num_schedulable).
    store_points: list[int] = field(default_factory=list)
    # The request's xgrammar GrammarMatcher (engine/grammar.py), advanced by every output token;
    # None without a grammar.
    matcher: object | None = field(default=None, repr=False)
    # Prompt logprobs being filled (engine.outputs.PromptLogprobs), chunk by chunk, until they
    # leave with the first token; None when not asked for (or already sent).
    prompt_lp: object | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_schedulable(self) -> int:
        """Tokens the next step may compute: num_uncomputed, cut at the next store point and at
        the end of the prompt (a resumed or preempted sequence's generated tokens are recomputed
        as decode rows, see decodes)."""
        n = self.num_uncomputed
        if self.store_points and self.store_points[0] > self.num_computed:
            n = min(n, self.store_points[0] - self.num_computed)
        if self.num_computed < len(self.prompt_ids):
            n = min(n, len(self.prompt_ids) - self.num_computed)
        return n

    def decodes(self, n: int) -> bool:
        """Whether a step computing `n` tokens of this sequence is a decode entry: generated
        tokens, each a row of paged decode attention over the keys up to its own position.
        That is one row while decoding; a sequence resumed on another rank or preempted
        recomputes the tokens it generated as `n` such rows (teacher-forced), so their KV has
        the bits the decode steps that made them gave it. Prompt tokens always run as a
        prefill chunk, even one alone, so a prompt's bits do not depend on where the scheduler
        cut it (budget left over, host-cache store points)."""
        return n >= 1 and self.num_computed >= len(self.prompt_ids)

    def prompt_logprob_rows(self, n: int) -> int:
        """Of the `n` tokens the next step computes, how many (the first ones) are prompt
        positions whose logits give a prompt logprob (position j: token j+1's)."""
        if self.prompt_lp is None:
            return 0
        return max(0, min(self.num_computed + n, len(self.prompt_ids) - 1) - self.num_computed)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
