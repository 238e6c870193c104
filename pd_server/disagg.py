"""Conditional disaggregation: per PD request, the decode rank prefills it itself or a prefill rank does.

`--disagg` (RouterConfig.disagg) picks the mode:
    always  every prompt goes through a prefill rank, which hands its KV to the decode rank
    never   the decode rank prefills every prompt itself, as a colocated rank would (no handoff)
    auto    (default) per request, DisaggPolicy.decide below

The rule, for a request of n sequences of P prompt tokens (costs in seconds from the cost
curves, disagg_costs.py, at a rank's thread count):
    local   = n x prefill_s(P - h_d, h_d)       the decode rank prefills (h_d: its expected
                                                 host-cache hit: the prompts it prefilled before);
                                                 every sequence decoding there stalls this long
    remote  = n x (prefill_s(P - h_p, h_p) + stage_s(B) + transfer_s(B))
                                                 h_p: the chosen prefill rank's expected hit
                                                 (routing.expected_hit_tokens), B = P x KV bytes
                                                 per token (the copy into the handoff pool, the read)
    wait_p  = the prefill rank's queued work: the estimated prefill seconds of every request the
              router sent it that has not returned its first token (exact: the router counts them)
    wait_d  = the same for prompts queued for local prefill on the decode rank
    step    = decode_s(batch_d, ctx_d): one decode step of the decode rank's batch (its requests
              in flight, at least 1; the mean context of its running sequences from RankStats)
Decode locally when
    (a) short:    local <= max_stall_steps (2) x step: the prefill costs each stream decoding
                  there at most about two tokens' time, or
    (b) faster:   (wait_p + remote) - (wait_d + local) > local: prefilling here saves the request
                  more time to first token than it stalls the streams decoding here: the
                  prefill rank's queue holds more work than the local prefill costs, or the
                  decode rank's host cache holds much more of the prompt (a conversation whose
                  last turn it prefilled), or
    (c) no prefill rank is live or has room;
else a prefill rank prefills. With the 2-core VM's smollm2 curves at 1 thread: (a) holds up to
~12 prompt tokens next to 1 decoding stream, ~68 next to 8 (ctx 1024), ~212 next to 32; a
256-token prompt goes local once ~0.3 s of prefill is queued on its prefill rank (1024: ~1.4 s).
Pure: inputs in, a Placement out (tests/unit/pd_server/test_router_disagg.py drives it); the
dispatcher gathers the inputs and keeps the books, bench/pdtune/sim.py applies the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

DisaggMode = Literal["auto", "always", "never"]
MODES: tuple[str, ...] = ("auto", "always", "never")
MAX_STALL_STEPS = 2.0  # (a): decode steps a local prefill may stall the decode batch for


class StepCosts(Protocol):
    """bench/pdtune/costs.py StepCosts: seconds of one rank's steps."""

    kv_bytes_per_token: float

    def prefill_s(self, new: int, cached: int) -> float: ...

    def decode_s(self, batch: int, ctx: float) -> float: ...

    def stage_s(self, nbytes: float) -> float: ...

    def transfer_s(self, nbytes: float) -> float: ...


@dataclass(frozen=True)
class PlacementInput:
    """What the router knows when it places one request (the chosen prefill and decode rank)."""

    # per sequence: (prompt tokens, expected host-cache hit on the prefill rank, on the decode rank)
    seqs: tuple[tuple[int, int, int], ...]
    prefill_wait_s: float = 0.0  # wait_p
    decode_wait_s: float = 0.0  # wait_d
    decode_batch: int = 1  # sequences on the decode rank (router's count)
    decode_ctx: float = 1024.0  # mean context of the decode rank's sequences, tokens
    prefill_available: bool = True  # a live prefill rank with room was found


@dataclass(frozen=True)
class Placement:
    local: bool  # True: the decode rank prefills
    reason: str  # never | always | no prefill rank | short | faster | long
    local_s: float = 0.0
    remote_s: float = 0.0
    stall_budget_s: float = 0.0
    prefill_wait_s: float = 0.0
    decode_wait_s: float = 0.0

    @property
    def where(self) -> str:
        """Where the prompt is prefilled: "decode" or "prefill" (the metric's label)."""
        return "decode" if self.local else "prefill"

    def describe(self) -> str:
        """One log line's worth."""
        if self.reason in ("never", "always", "no prefill rank"):
            return f"{self.where} ({self.reason})"
        return (f"{self.where} ({self.reason}: local {self.local_s * 1e3:.1f} ms vs stall budget "
                f"{self.stall_budget_s * 1e3:.1f} ms; remote {self.remote_s * 1e3:.1f} ms + queued "
                f"{self.prefill_wait_s * 1e3:.1f} ms, local queued {self.decode_wait_s * 1e3:.1f} ms)")


class DisaggPolicy:
    """The mode and, in auto, the rule of the module docstring. `costs` may be None unless auto."""

    def __init__(self, mode: str, costs: StepCosts | None = None, max_stall_steps: float = MAX_STALL_STEPS) -> None:
        if mode not in MODES:
            raise ValueError(f"disagg mode must be one of {MODES}, got {mode!r}")
        if mode == "auto" and costs is None:
            raise ValueError("disagg auto needs cost curves")
        self.mode, self.costs, self.max_stall_steps = mode, costs, max_stall_steps

    def prefill_s(self, tokens: int, hit: int) -> float:
        """Estimated seconds to prefill one prompt of `tokens` with `hit` cached (0 without costs)."""
        if self.costs is None:
            return 0.0
        return self.costs.prefill_s(max(1, tokens - hit), hit)

    def handoff_s(self, tokens: int) -> float:
        c = self.costs
        nbytes = tokens * c.kv_bytes_per_token
        return c.stage_s(nbytes) + c.transfer_s(nbytes)

    def decide(self, x: PlacementInput) -> Placement:
        if self.mode == "never":
            return Placement(True, "never")
        if self.mode == "always":
            return Placement(False, "always")
        if not x.prefill_available:
            return Placement(True, "no prefill rank")
        local = sum(self.prefill_s(p, hd) for p, _, hd in x.seqs)
        remote = sum(self.prefill_s(p, hp) + self.handoff_s(p) for p, hp, _ in x.seqs)
        budget = self.max_stall_steps * self.costs.decode_s(max(1, x.decode_batch), x.decode_ctx)
        saved = (x.prefill_wait_s + remote) - (x.decode_wait_s + local)
        reason = "short" if local <= budget else "faster" if saved > local else "long"
        return Placement(reason != "long", reason, local, remote, budget, x.prefill_wait_s, x.decode_wait_s)
