"""A serving configuration to simulate or measure: colocated N, or xPyD; the engine limits.

Names match bench/agentx/compare.py's: `colocated-N`, `xPyD`. `xPyD+cond` is xPyD with
conditional disaggregation (the router's --disagg auto, pd_server/disagg.py: a decode rank
prefills a request itself when the rule says so); plain xPyD is --disagg always.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """A configuration: `colocated` ranks, or `prefill` + `decode` ranks (PD)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    cond: bool = False  # PD: conditional disaggregation (--disagg auto)

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("rank counts must be >= 0")
        if bool(self.colocated) == bool(self.prefill or self.decode):
            raise ValueError("a split is colocated N, or xPyD with x, y >= 1")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("PD needs at least one prefill and one decode rank")
        if self.cond and self.colocated:
            raise ValueError("conditional disaggregation is a PD option")

    @property
    def ranks(self) -> int:
        return self.colocated + self.prefill + self.decode

    @property
    def name(self) -> str:
        if self.colocated:
            return f"colocated-{self.colocated}"
        return f"{self.prefill}P{self.decode}D" + ("+cond" if self.cond else "")

    @classmethod
    def parse(cls, text: str) -> "Split":
        t = text.strip().upper()
        if t.startswith("COLOCATED-"):
            return cls(colocated=int(t.split("-", 1)[1]))
        t, plus, cond = t.partition("+")
        p, _, d = t.partition("P")
        if not d.endswith("D") or (plus and cond != "COND"):
            raise ValueError(f"not a split name: {text!r} (colocated-N, xPyD or xPyD+cond)")
        return cls(prefill=int(p), decode=int(d[:-1]), cond=bool(plus))


def splits(ranks: int, cond: bool = False) -> list[Split]:
    """Colocated `ranks`, then every xPyD with x + y = ranks (x ascending), each followed by
    xPyD+cond when `cond`."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    pd = [Split(prefill=x, decode=ranks - x, cond=c) for x in range(1, ranks) for c in ((False, True) if cond
                                                                                       else (False,))]
    return [Split(colocated=ranks)] + pd


@dataclass(frozen=True)
class Limits:
    """The engine and router knobs the simulation mirrors (their defaults)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    page_size: int = 16
    load_tokens: int = 256  # CacheAware's price of one request in flight, in prompt tokens
