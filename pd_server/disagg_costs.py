"""Step costs the router prices prefill placement with (disagg.py): `pd_tune.py measure`'s curves.

The JSON is bench/pdtune/costs.py's (format 1; that module documents it): per torch thread
count, prefill seconds on a grid of (new, cached) tokens and decode-step seconds on a grid of
(batch, context), plus KV stage and transfer seconds vs bytes. This is a reader only (the
router does not import bench/): piecewise linear between grid points, extrapolated from the end
segments, never below 0, as there.

Which file: `--disagg-costs PATH`, else the curves in pd_server/costs/ (package data; `pd_tune.py
measure --out` writes more) whose `model` is the
served model (those measured in the dtype the ranks compute in first: `meta.dtype`, bfloat16
where a file names none; then those measured on this many cores), else BUILTIN: this repository's
smollm2-135m-instruct curves at 1 thread on the 2-core VM, rounded. For another model the
seconds are off, but the rule compares costs with costs (a prefill against decode steps of the
same rank, against queued prefills), and those ratios move far less between models than the
seconds do.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1  # bench/pdtune/costs.py FORMAT (the file both read)
CURVES_DIR = Path(__file__).resolve().parent / "costs"

BUILTIN = {  # smollm2-135m-instruct-cpu2.json, threads 1, rounded to 0.1 ms
    "format": FORMAT, "model": "builtin", "cores": 2, "kv_bytes_per_token": 23040.0,
    "prefill": {"1": {"new": [32, 256, 1024], "cached": [0, 1024, 4096],
                      "seconds": [[0.0491, 0.0752, 0.1589], [0.3023, 0.4579, 0.8914], [1.3929, 1.9602, 3.5053]]}},
    "decode": {"1": {"batch": [1, 8, 32], "ctx": [128, 1024, 4096],
                     "seconds": [[0.0133, 0.0139, 0.0238], [0.0368, 0.0453, 0.1006], [0.0672, 0.1263, 0.3352]]}},
    "transfer": {"bytes": [368640, 94371840], "seconds": [0.0001, 0.0109]},
    "stage": {"bytes": [368640, 94371840], "seconds": [0.0005, 0.1562]},
}


def interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted xs; linear extrapolation from the end segments; >= 0."""
    if len(xs) == 1:
        return max(0.0, ys[0])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class _Grid:
    xs: list[float]
    ys: list[float]
    z: list[list[float]]  # z[i][j] at (xs[i], ys[j])

    def __call__(self, x: float, y: float) -> float:
        return interp1(self.xs, [interp1(self.ys, row, y) for row in self.z], x)

    @classmethod
    def from_json(cls, d: dict, xname: str, yname: str) -> "_Grid":
        xs, ys = [float(v) for v in d[xname]], [float(v) for v in d[yname]]
        z = [[float(v) for v in row] for row in d["seconds"]]
        if len(z) != len(xs) or any(len(row) != len(ys) for row in z) or xs != sorted(set(xs)) \
                or ys != sorted(set(ys)):
            raise ValueError(f"cost grid {xname} x {yname}: axes not ascending or shape mismatch")
        return cls(xs, ys, z)


@dataclass(frozen=True)
class RankCosts:
    """One rank's step costs in seconds at one thread count (bench/pdtune/costs.py StepCosts)."""

    kv_bytes_per_token: float
    threads: int
    _prefill: _Grid
    _decode: _Grid
    _transfer: tuple[list[float], list[float]]
    _stage: tuple[list[float], list[float]]

    def prefill_s(self, new: int, cached: int) -> float:
        """One prefill step of `new` prompt tokens after `cached` already in KV."""
        return self._prefill(new, cached)

    def decode_s(self, batch: int, ctx: float) -> float:
        """One decode step of `batch` rows at mean context `ctx` tokens."""
        return self._decode(batch, ctx)

    def stage_s(self, nbytes: float) -> float:
        return interp1(*self._stage, nbytes)

    def transfer_s(self, nbytes: float) -> float:
        return interp1(*self._transfer, nbytes)


@dataclass(frozen=True)
class CostFile:
    """Parsed curves: every measured thread count."""

    source: str  # the path, or "builtin"
    model: str
    cores: int
    raw: dict
    dtype: str = "bfloat16"  # what the ranks computed in when measured (meta.dtype)

    @classmethod
    def parse(cls, d: dict, source: str) -> "CostFile":
        if d.get("format") != FORMAT:
            raise ValueError(f"{source}: cost curves format {d.get('format')!r}, the router reads {FORMAT}")
        have = sorted(set(d["prefill"]) & set(d["decode"]), key=int)
        if not have:
            raise ValueError(f"{source}: no thread count with both prefill and decode curves")
        f = cls(source, str(d.get("model", "")), int(d.get("cores", 1)), d,
                str((d.get("meta") or {}).get("dtype", "bfloat16")))
        f.at(int(have[0]))  # parse once now: a bad file fails at start, not at the first request
        return f

    @classmethod
    def load(cls, path: str | Path) -> "CostFile":
        return cls.parse(json.loads(Path(path).read_text()), str(path))

    def at(self, threads: int) -> RankCosts:
        """The curves at the largest measured thread count <= threads (else the smallest)."""
        d = self.raw
        have = sorted(int(t) for t in set(d["prefill"]) & set(d["decode"]))
        t = max([h for h in have if h <= threads], default=have[0])
        tr, st = d["transfer"], d["stage"]
        return RankCosts(float(d["kv_bytes_per_token"]), t, _Grid.from_json(d["prefill"][str(t)], "new", "cached"),
                         _Grid.from_json(d["decode"][str(t)], "batch", "ctx"),
                         ([float(v) for v in tr["bytes"]], [float(v) for v in tr["seconds"]]),
                         ([float(v) for v in st["bytes"]], [float(v) for v in st["seconds"]]))


def find_costs(model: str, path: str = "", curves_dir: Path = CURVES_DIR, dtype: str = "bfloat16") -> CostFile:
    """The curves for `model` (the served name): `path` if given (errors raise), else the
    matching file in `curves_dir` (measured in `dtype`, the ranks' compute dtype, first; then on
    this host's core count), else BUILTIN."""
    if path:
        return CostFile.load(path)
    found = []
    for p in sorted(curves_dir.glob("*.json")) if curves_dir.is_dir() else []:
        try:
            f = CostFile.load(p)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a cost file of this format: look on
        if f.model == model:
            found.append(f)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    found.sort(key=lambda f: (f.dtype != dtype, f.cores != cores))
    return found[0] if found else CostFile.parse(BUILTIN, "builtin")
