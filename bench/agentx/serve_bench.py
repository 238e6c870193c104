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
the aiperf_client.Result fields).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx

from bench.agentx import aiperf_client

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
    ap.add_argument("--out", type=Path, default=None, help="default runs/bench-serve-<time>")
    ap.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the project's python (to find the cached tokenizer)")
    a = ap.parse_args(argv)
    url = a.url.rstrip("/").removesuffix("/v1")
    model = a.model or served_model(url)
    tokenizer = a.tokenizer or resolve_tokenizer(model, a.server_python)
    out = a.out or ROOT / "runs" / f"bench-serve-{datetime.now():%Y%m%d-%H%M%S}"
    levels = [int(x) for x in a.concurrency.replace(",", " ").split()]
    rows: list[tuple[int, aiperf_client.Result | None]] = []
    summary = {"url": url, "model": model, "isl": a.isl, "osl": a.osl, "levels": []}
    for i, c in enumerate(levels):
        n = a.requests_per_level or max(8, 2 * c)
        art = out / f"c{c}"
        cmd = aiperf_client.synthetic_cmd(url, model, tokenizer, art, c, n, a.isl, a.osl, a.tick_rate,
                                             a.seed + i)
        print(f"[bench_serve] concurrency {c}: {n} requests", file=sys.stderr, flush=True)
        rc = aiperf_client.run(cmd, art, timeout_s=a.timeout)
        result = None
        if (art / aiperf_client.SUMMARY).exists():
            result = aiperf_client.load_result(art)
        elif rc != 0:
            print(f"[bench_serve] concurrency {c}: aiperf exited with {rc}; see {art / 'aiperf.log'}",
                  file=sys.stderr)
        rows.append((c, result))
        summary["levels"].append({"concurrency": c, "rc": rc, "artifact_dir": str(art.resolve()),
                                  **(result.to_json() if result else {})})
    text = f"{model} at {url}: {a.isl} in / {a.osl} out (ignore_eos), aiperf synthetic\n\n{table(rows)}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(text)
    print(text)
    return 0 if all(r is not None and r.errors == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
