"""Cost curves of one machine, as `pd_tune.py measure` saved them, and what a rank pays per step.

The JSON (`CostCurves.to_json`) holds, per torch thread count t measured:
  prefill[t]: seconds of one engine step that prefills one prompt chunk of `new` tokens after
              `cached` tokens already in KV (a host-cache hit, loaded at admission), on a grid
              new x cached; the sampled first token included.
  decode[t]:  seconds of one step of `batch` one-token rows at context `ctx`, grid batch x ctx.
and, thread-independent, transfer (a decode rank's read of `bytes` of KV from a prefill rank's
handoff pool, shm backend) and stage (the prefill rank's copy of the same bytes into that pool,
inside the step that samples the first token), both seconds vs bytes.
Between and beyond grid points the curves are piecewise linear (bi-linear in 2-D), extrapolated
from the end segments, never below 0.

`RankCosts` is what the simulator calls: the curves at one rank's thread count, times a
slowdown when more ranks than cores share the machine (each rank then gets cores/ranks of one).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pd_server.disagg import StepCosts  # noqa: F401 - what the simulator calls (re-exported)
# The router reads the same files the same way (its reader; FORMAT: bump when the JSON layout changes).
from pd_server.disagg_costs import FORMAT, interp1


@dataclass
class Grid2:
    """z[i][j] measured at (xs[i], ys[j]); both axes sorted ascending."""

    xs: list[float]
    ys: list[float]
    z: list[list[float]]

    def __post_init__(self) -> None:
        if len(self.z) != len(self.xs) or any(len(row) != len(self.ys) for row in self.z):
            raise ValueError("grid shape does not match its axes")
        if self.xs != sorted(set(self.xs)) or self.ys != sorted(set(self.ys)):
            raise ValueError("grid axes must be strictly ascending")

    def __call__(self, x: float, y: float) -> float:
        along_y = [interp1(self.ys, row, y) for row in self.z]  # one value per xs
        return interp1(self.xs, along_y, x)

    def to_json(self, xname: str, yname: str) -> dict:
        return {xname: self.xs, yname: self.ys, "seconds": self.z}

    @classmethod
    def from_json(cls, d: dict, xname: str, yname: str) -> "Grid2":
        return cls([float(v) for v in d[xname]], [float(v) for v in d[yname]],
                   [[float(v) for v in row] for row in d["seconds"]])


@dataclass
class Curve1:
    xs: list[float]
    ys: list[float]

    def __call__(self, x: float) -> float:
        return interp1(self.xs, self.ys, x)


@dataclass
class CostCurves:
    model: str
    cores: int  # CPU cores of the machine that measured
    kv_bytes_per_token: float
    prefill: dict[int, Grid2]  # threads -> grid over (new tokens, cached tokens)
    decode: dict[int, Grid2]  # threads -> grid over (batch, context tokens)
    transfer: Curve1  # bytes -> seconds
    stage: Curve1  # bytes -> seconds
    meta: dict = field(default_factory=dict)  # how it was measured (backend, reps, load note)

    def for_ranks(self, ranks: int, cores: int | None = None, shared: bool = False) -> "RankCosts":
        """Costs of one rank when `ranks` ranks share `cores` cores (default: the measured
        machine's), as the launcher assigns threads: cores // ranks, at least 1. Oversubscribed
        cores slow every step by ranks * threads / cores, unless `shared` (the simulator then
        shares the cores among the ranks computing at each moment: Simulator cpu_cores)."""
        cores = cores or self.cores
        threads = max(1, cores // ranks)
        return RankCosts(self, self._nearest(threads), 1.0 if shared else max(1.0, ranks * threads / cores))

    def _nearest(self, threads: int) -> int:
        """The largest measured thread count <= threads (else the smallest measured)."""
        have = sorted(set(self.prefill) & set(self.decode))
        if not have:
            raise ValueError("cost curves hold no thread count with both prefill and decode")
        below = [t for t in have if t <= threads]
        return below[-1] if below else have[0]

    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "cores": self.cores,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefill": {str(t): g.to_json("new", "cached") for t, g in sorted(self.prefill.items())},
                "decode": {str(t): g.to_json("batch", "ctx") for t, g in sorted(self.decode.items())},
                "transfer": {"bytes": self.transfer.xs, "seconds": self.transfer.ys},
                "stage": {"bytes": self.stage.xs, "seconds": self.stage.ys}, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "CostCurves":
        if d.get("format") != FORMAT:
            raise ValueError(f"cost curves format {d.get('format')!r}, this code reads {FORMAT}")
        return cls(d["model"], int(d["cores"]), float(d["kv_bytes_per_token"]),
                   {int(t): Grid2.from_json(g, "new", "cached") for t, g in d["prefill"].items()},
                   {int(t): Grid2.from_json(g, "batch", "ctx") for t, g in d["decode"].items()},
                   Curve1(d["transfer"]["bytes"], d["transfer"]["seconds"]),
                   Curve1(d["stage"]["bytes"], d["stage"]["seconds"]), d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostCurves":
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass
class RankCosts:
    """StepCosts of one rank: the curves at `threads`, compute times `slowdown` (>= 1)."""

    curves: CostCurves
    threads: int
    slowdown: float

    @property
    def kv_bytes_per_token(self) -> float:
        return self.curves.kv_bytes_per_token

    def prefill_s(self, new: int, cached: int) -> float:
        return self.curves.prefill[self.threads](new, cached) * self.slowdown

    def decode_s(self, batch: int, ctx: float) -> float:
        return self.curves.decode[self.threads](batch, ctx) * self.slowdown

    def stage_s(self, nbytes: float) -> float:
        return self.curves.stage(nbytes) * self.slowdown

    def transfer_s(self, nbytes: float) -> float:
        return self.curves.transfer(nbytes) * self.slowdown
