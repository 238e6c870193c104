"""A serving configuration to simulate or measure: colocated N, or xPyD; the engine limits.

Names match bench/agentx/compare.py's: `colocated-N`, `xPyD`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """A configuration: `colocated` ranks, or `prefill` + `decode` ranks (PD)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("rank counts must be >= 0")
        if bool(self.colocated) == bool(self.prefill or self.decode):
            raise ValueError("a split is colocated N, or xPyD with x, y >= 1")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("PD needs at least one prefill and one decode rank")

    @property
    def ranks(self) -> int:
        return self.colocated + self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"colocated-{self.colocated}" if self.colocated else f"{self.prefill}P{self.decode}D"

    @classmethod
    def parse(cls, text: str) -> "Split":
        t = text.strip().upper()
        if t.startswith("COLOCATED-"):
            return cls(colocated=int(t.split("-", 1)[1]))
        p, _, d = t.partition("P")
        if not d.endswith("D"):
            raise ValueError(f"not a split name: {text!r} (colocated-N or xPyD)")
        return cls(prefill=int(p), decode=int(d[:-1]))


def splits(ranks: int) -> list[Split]:
    """Colocated `ranks`, then every xPyD with x + y = ranks (x ascending)."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    return [Split(colocated=ranks)] + [Split(prefill=x, decode=ranks - x) for x in range(1, ranks)]


@dataclass(frozen=True)
class Limits:
    """The engine and router knobs the simulation mirrors (their defaults)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    page_size: int = 16
    load_tokens: int = 256  # CacheAware's price of one request in flight, in prompt tokens
