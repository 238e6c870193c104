"""Read the ranks' step logs of one run ($PDSERVE_STEP_LOG, rank_runtime/step_log.py) and say
where the time went: per rank, its prompt steps by the threads they started with (ms of wall and
of the engine thread per prompt token, and how much of their time another rank's steps ran
beside them), and its decode-only steps' wall times by how many prompt steps of other ranks ran
beside them.

    PDSERVE_STEP_LOG=/tmp/steps scripts/mission_bench.sh --configs 2P2D --no-synthetic ...
    .venv/bin/python bench/step_log.py /tmp/steps [--since UNIX_TIME] [--until UNIX_TIME]

A directory holds every rank of one server run (a new run appends new files: clear it between
runs). Prints markdown tables; the numbers explain a benchmark's, they do not replace it.
"""
from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_runtime.step_log import FIELDS, SUFFIX  # noqa: E402


@dataclass(frozen=True)
class Step:
    start: float
    decode_rows: int
    prompt_tokens: int
    wall_ms: float
    thread_ms: float
    process_ms: float
    threads: int

    @property
    def end(self) -> float:
        return self.start + self.wall_ms / 1e3


def read_dir(directory: str | Path, since: float = 0.0, until: float = float("inf")) -> dict[str, list[Step]]:
    """Rank name (the file's stem) -> its steps in order, those starting in [since, until)."""
    out = {}
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        steps = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != len(FIELDS):
                continue  # a line cut short by a killed rank
            s = Step(float(parts[0]), int(parts[1]), int(parts[2]), *map(float, parts[3:6]), int(parts[6]))
            if since <= s.start < until:
                steps.append(s)
        out[path.name[:-len(SUFFIX)]] = steps
    return out


def overlap_s(start: float, end: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    """Seconds of [start, end) covered by `spans` (sorted, not overlapping one another: one rank's
    steps), `starts` their start times."""
    total, i = 0.0, max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(spans) and spans[i][0] < end:
        a, b = spans[i]
        total += max(0.0, min(b, end) - max(a, start))
        i += 1
    return total


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(ranks: dict[str, list[Step]]) -> str:
    spans = {r: [(s.start, s.end) for s in steps] for r, steps in ranks.items()}
    starts = {r: [a for a, _ in sp] for r, sp in spans.items()}
    prompt_spans = {r: sorted((s.start, s.end) for s in steps if s.prompt_tokens) for r, steps in ranks.items()}
    prompt_starts = {r: [a for a, _ in sp] for r, sp in prompt_spans.items()}
    lines = ["| rank | prompt steps (threads at start) | tokens a step | wall ms / token | engine thread ms / token "
             "| other ranks' steps beside (mean) |",
             "|---|---|---:|---:|---:|---:|"]
    dec = ["| rank | decode-only steps | prompt steps beside | wall p50 ms | p90 | p99 | engine thread / wall |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for rank, steps in ranks.items():
        prompt = [s for s in steps if s.prompt_tokens]
        for threads in sorted({s.threads for s in prompt}):
            group = [s for s in prompt if s.threads == threads]
            tokens = sum(s.prompt_tokens for s in group)
            wall = sum(s.wall_ms for s in group)
            beside = sum(overlap_s(s.start, s.end, spans[o], starts[o]) for s in group for o in ranks if o != rank)
            lines.append(f"| {rank} | {len(group)} ({threads}) | {tokens / len(group):.0f} | {wall / tokens:.3f} | "
                         f"{sum(s.thread_ms for s in group) / tokens:.3f} | {beside * 1e3 / wall:.2f} |")
        decode = [s for s in steps if not s.prompt_tokens and s.decode_rows]
        by_beside: dict[int, list[Step]] = {}
        for s in decode:
            mid = (s.start + s.end) / 2
            n = sum(1 for o in ranks if o != rank and overlap_s(mid, mid + 1e-6, prompt_spans[o], prompt_starts[o]))
            by_beside.setdefault(min(n, 2), []).append(s)
        for n, group in sorted(by_beside.items()):
            walls = [s.wall_ms for s in group]
            ratio = sum(s.thread_ms for s in group) / sum(walls)
            dec.append(f"| {rank} | {len(group)} | {n if n < 2 else '2+'} | {statistics.median(walls):.1f} | "
                       f"{_q(walls, 0.9):.1f} | {_q(walls, 0.99):.1f} | {ratio:.2f} |")
    return "\n".join(["Prompt steps (steps computing prompt tokens):", "", *lines, "",
                      "Decode-only steps, by other ranks' prompt steps running at their midpoint:", "", *dec])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    ap.add_argument("--since", type=float, default=0.0, help="only steps starting at or after this wall clock")
    ap.add_argument("--until", type=float, default=float("inf"), help="only steps starting before this wall clock")
    args = ap.parse_args(argv)
    ranks = read_dir(args.directory, args.since, args.until)
    if not any(ranks.values()):
        print(f"no steps in {args.directory}", file=sys.stderr)
        return 1
    print(summarize(ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
