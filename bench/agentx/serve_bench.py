"""Serving benchmark of any OpenAI-compatible server with aiperf's synthetic mode.

    .venv-bench/bin/python -m bench.agentx.serve_bench URL [--model NAME] [--tokenizer DIR]
        [--concurrency "1 8 32"] [--requests-per-level N] [--isl 512] [--osl 128] [--tick-rate 50]
        [--seed 42] [--out DIR]
    (scripts/bench_serve.sh sets up the client venv and runs this.)

Per concurrency level, one aiperf run: random --isl-token prompts (no shared prefix), exactly
--osl output tokens (ignore_eos), streamed chat completions, N requests (default: 2 x the
level, at least 8, so every level ends), one warm-up request. Each level has its own seed
(--seed + level index), so no level replays an earlier level's prompts into a prefix cache,
and aiperf is paced at --tick-rate under the concurrency cap (see aiperf_client.synthetic_cmd:
unpaced, its scheduler spins a core). The same client, workload and
settings for this system and a peer (e.g. vLLM's CPU build) make their rows comparable.
Prints one table (concurrency, output tok/s, TTFT p50/p99, ITL p50/p99, requests, errors)
and writes it with each level's aiperf artifacts into --out (summary.json: one entry a level,
the aiperf_client.Result fields, and "server": the server's /metrics delta over the level,
server_metrics.ServerDelta, null where it exposes none).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from bench.agentx import aiperf_client, measure

ROOT = Path(__file__).resolve().parents[2]


def served_model(url: str) -> str:
    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def resolve_tokenizer(model: str, server_python: str) -> Path:
    """A local tokenizer for `model`: the engine's cached checkpoint dir for an embedded name or
    a checkpoint path. Raises SystemExit asking for --tokenizer otherwise."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "tokenizer_config.json").exists():
        return path
    try:
        out = subprocess.run([server_python, "-m", "engine.model_cache", model], cwd=ROOT, check=True,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
        return Path(out.strip().splitlines()[-1].split(": ", 1)[1])
    except (subprocess.CalledProcessError, OSError, IndexError) as e:
        raise SystemExit(f"no local tokenizer known for model {model!r}; pass --tokenizer DIR") from e


@dataclass(frozen=True)
class Synthetic:
    """The synthetic workload of every level: `isl`-token random prompts, exactly `osl` output
    tokens, `requests_per_level` requests (0: max(8, 2 x the level)), aiperf paced at
    `tick_rate`, level i seeded `seed` + i, killed after `timeout_s`."""

    isl: int = 512
    osl: int = 128
    requests_per_level: int = 0
    tick_rate: float = 50.0
    seed: int = 42
    timeout_s: float = 900.0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Synthetic:
        return cls(isl=a.isl, osl=a.osl, requests_per_level=a.requests_per_level, tick_rate=a.tick_rate,
                   seed=a.seed, timeout_s=a.timeout)

    def requests(self, level: int) -> int:
        return self.requests_per_level or max(8, 2 * level)

    def run_level(self, url: str, model: str, tokenizer: Path, artifact_dir: Path, level: int,
                  index: int) -> measure.Measured:
        """One aiperf run at concurrency `level`, the `index`-th level of its sweep (its seed)."""
        cmd = aiperf_client.synthetic_cmd(url, model, tokenizer, artifact_dir, level, self.requests(level),
                                          self.isl, self.osl, self.tick_rate, self.seed + index)
        return measure.run(url, cmd, artifact_dir, timeout_s=self.timeout_s)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The Synthetic flags (also bench/mission's)."""
    ap.add_argument("--requests-per-level", type=int, default=0, help="0: max(8, 2 x level)")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--tick-rate", type=float, default=50.0,
                    help="aiperf --request-rate under the concurrency cap, so its scheduler sleeps "
                         "instead of spinning a core (0: aiperf's burst mode)")
    ap.add_argument("--seed", type=int, default=42,
                    help="aiperf --random-seed of the first level; level i uses seed + i, so no level "
                         "replays another's prompts (a rerun against a live server needs a new seed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per level before aiperf is killed")


def parse_levels(text: str) -> list[int]:
    """"1 8 32" or "1,8,32" -> [1, 8, 32]."""
    return [int(x) for x in text.replace(",", " ").split()]


def table(rows: list[tuple[int, aiperf_client.Result | None]]) -> str:
    head = "| concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests | errors |"
    lines = [head, "|" + "---:|" * 8]
    for c, r in rows:
        if r is None:
            lines.append(f"| {c} | failed | - | - | - | - | - | - |")
            continue
        lines.append(f"| {c} | {r.output_tps:.1f} | {r.ttft.get('p50', 0):.0f} | {r.ttft.get('p99', 0):.0f} | "
                     f"{r.itl.get('p50', 0):.1f} | {r.itl.get('p99', 0):.1f} | {r.requests} | {r.errors} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="", help="model id (default: the first of GET /v1/models)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="local tokenizer dir (default: the engine's cached dir for --model)")
    ap.add_argument("--concurrency", default="1 8 32", help="levels, space or comma separated")
    add_workload_args(ap)
    ap.add_argument("--out", type=Path, default=None, help="default runs/bench-serve-<time>")
    ap.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the project's python (to find the cached tokenizer)")
    a = ap.parse_args(argv)
    url = a.url.rstrip("/").removesuffix("/v1")
    model = a.model or served_model(url)
    tokenizer = a.tokenizer or resolve_tokenizer(model, a.server_python)
    out = a.out or ROOT / "runs" / f"bench-serve-{datetime.now():%Y%m%d-%H%M%S}"
    work = Synthetic.from_args(a)
    rows: list[tuple[int, aiperf_client.Result | None]] = []
    summary = {"url": url, "model": model, "isl": a.isl, "osl": a.osl, "levels": []}
    for i, c in enumerate(parse_levels(a.concurrency)):
        art = out / f"c{c}"
        print(f"[bench_serve] concurrency {c}: {work.requests(c)} requests", file=sys.stderr, flush=True)
        m = work.run_level(url, model, tokenizer, art, c, i)
        if m.client is None and m.rc != 0:
            print(f"[bench_serve] concurrency {c}: {m.error}", file=sys.stderr)
        rows.append((c, m.client))
        summary["levels"].append({"concurrency": c, "rc": m.rc, "artifact_dir": str(art.resolve()),
                                  **(m.client.to_json() if m.client else {}),
                                  "server": m.server.to_json() if m.server else None})
    text = f"{model} at {url}: {a.isl} in / {a.osl} out (ignore_eos), aiperf synthetic\n\n{table(rows)}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(text)
    print(text)
    return 0 if all(r is not None and r.errors == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
