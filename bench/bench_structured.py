"""Structured outputs: what a grammar costs (issue 37's benchmark; not a test).

    .venv/bin/python bench/bench_structured.py [--flags "--colocated 2"] [--port 8310]
        [--levels 1 8] [--rounds 3] [--max-tokens 128] [--compile-only]

1. Grammar compile time, in process, against the embedded SmolLM2 tokenizer: the tool_choice
   "required" grammar of a coding agent's eight tools (the shapes Claude Code's Bash, Read,
   Edit, Write, Glob, Grep, WebFetch and TodoWrite take) and each tool's named grammar, uncached
   (a fresh compiler per repeat) and cached (the same spec again), medians of 5.
2. Serving: starts `scripts/pd_start.sh FLAGS` (as a user does), then at each concurrency level
   runs batches of chat requests, unconstrained and under a response_format json_schema in
   turn (--rounds alternations, the same prompts), streams them and reports output tok/s, ITL
   p50/p99 (gaps between content chunks) and the ratio constrained / free. Stops the server.
Prints markdown tables with the CPU named.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

MODEL = "smollm2-135m-instruct"
_STR = {"type": "string"}
AGENT_TOOLS = {
    "Bash": {"command": _STR, "timeout": {"type": "integer", "maximum": 600000}, "description": _STR},
    "Read": {"file_path": _STR, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
    "Edit": {"file_path": _STR, "old_string": _STR, "new_string": _STR, "replace_all": {"type": "boolean"}},
    "Write": {"file_path": _STR, "content": _STR},
    "Glob": {"pattern": _STR, "path": _STR},
    "Grep": {"pattern": _STR, "path": _STR, "glob": _STR, "-i": {"type": "boolean"}, "head_limit": {"type": "integer"},
             "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]}},
    "WebFetch": {"url": {"type": "string", "format": "uri"}, "prompt": _STR},
    "TodoWrite": {"todos": {"type": "array", "items": {
        "type": "object", "required": ["content", "status", "id"], "additionalProperties": False,
        "properties": {"content": {"type": "string", "minLength": 1}, "id": _STR,
                       "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}}}}},
}
REQUIRED = {"Bash": ["command"], "Read": ["file_path"], "Edit": ["file_path", "old_string", "new_string"],
            "Write": ["file_path", "content"], "Glob": ["pattern"], "Grep": ["pattern"], "WebFetch": ["url", "prompt"],
            "TodoWrite": ["todos"]}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "steps"],
          "properties": {"title": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}}}}


def tools() -> list[dict]:
    return [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": p, "required": REQUIRED[n], "additionalProperties": False}}}
        for n, p in AGENT_TOOLS.items()]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def compile_table(repeats: int = 5) -> str:
    from transformers import AutoTokenizer

    from engine.grammar import GrammarCompiler
    from engine.model_cache import cached_model_dir
    from pd_server.api_models import ChatCompletionRequest
    from pd_server.structured import grammar_for

    tok = AutoTokenizer.from_pretrained(str(cached_model_dir(MODEL)))
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": tools()}
    specs = {"required (8 tools)": grammar_for(ChatCompletionRequest(**base, tool_choice="required"))}
    for name in AGENT_TOOLS:
        specs[f"named {name}"] = grammar_for(ChatCompletionRequest(
            **base, tool_choice={"type": "function", "function": {"name": name}}))
    specs["json_schema (plan)"] = grammar_for(ChatCompletionRequest(
        **{**base, "tools": None}, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    rows = ["| grammar | spec bytes | uncached ms (median of %d) | cached ms |" % repeats, "|---|---:|---:|---:|"]
    warm = GrammarCompiler(lambda: tok, 49152, [2])
    warm.compile(specs["json_schema (plan)"])  # the tokenizer info, once (not a grammar's cost)
    for name, spec in specs.items():
        cold = []
        for _ in range(repeats):
            comp = GrammarCompiler(lambda: tok, 49152, [2])
            comp._get()  # its tokenizer info, outside the timing
            t = time.perf_counter()
            comp.compile(spec)
            cold.append((time.perf_counter() - t) * 1e3)
        warm.compile(spec)
        hot = []
        for _ in range(repeats):
            t = time.perf_counter()
            warm.compile(spec)
            hot.append((time.perf_counter() - t) * 1e3)
        rows.append(f"| {name} | {len(spec.text)} | {statistics.median(cold):.1f} | {statistics.median(hot):.3f} |")
    return "\n".join(rows)


def _stream(url: str, body: dict, out: list) -> None:
    """Appends the arrival times of the request's content chunks to `out`."""
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    out.append(times)


def run_batch(url: str, n: int, constrained: bool, max_tokens: int, round_: int) -> dict:
    bodies = []
    for i in range(n):
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": 100 * round_ + i,
                "messages": [{"role": "user", "content": f"Write a step-by-step plan for project number {i}: "
                                                         "building a small web app. Title it and list the steps."}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "plan", "schema": SCHEMA}}
        bodies.append(body)
    out: list = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_stream, args=(url, b, out)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = sorted((b - a) * 1e3 for times in out for a, b in zip(times, times[1:]))
    chunks = sum(len(times) for times in out)
    return {"tok_s": chunks / wall, "itl_p50": gaps[len(gaps) // 2] if gaps else 0.0,
            "itl_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0, "chunks": chunks}


def serve_table(args) -> str:
    port = str(args.port)
    start = [str(ROOT / "scripts" / "pd_start.sh"), *args.flags.split(), "--port", port]
    subprocess.run(start, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        run_batch(url, 2, True, 16, 99)  # warm-up: compiles the grammar on the router and the ranks
        rows = ["| concurrency | requests | free tok/s | json_schema tok/s | ratio | free ITL p50 / p99 ms | "
                "json_schema ITL p50 / p99 ms | ITL p50 ratio |", "|---:|---:|---:|---:|---:|---|---|---:|"]
        for c in args.levels:
            res = {False: [], True: []}
            for r in range(args.rounds):
                for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                    res[constrained].append(run_batch(url, c, constrained, args.max_tokens, r))
            med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in res.items()}
            f, j = med[False], med[True]
            rows.append(f"| {c} | {c * args.rounds} + {c * args.rounds} | {f['tok_s']:.1f} | {j['tok_s']:.1f} | "
                        f"{j['tok_s'] / f['tok_s']:.2f} | {f['itl_p50']:.1f} / {f['itl_p99']:.1f} | "
                        f"{j['itl_p50']:.1f} / {j['itl_p99']:.1f} | {j['itl_p50'] / f['itl_p50']:.2f} |")
        return "\n".join(rows)
    finally:
        subprocess.run([str(ROOT / "scripts" / "pd_start.sh"), "stop", "--port", port], cwd=ROOT,
                       stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", default="--colocated 2", help="scripts/pd_start.sh flags")
    ap.add_argument("--port", type=int, default=8310)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    print(f"### Structured outputs on {cpu_name()} ({len(os.sched_getaffinity(0))} cores)\n")
    print("Grammar compile time (in process, SmolLM2's tokenizer):\n")
    print(compile_table())
    if not args.compile_only:
        print(f"\nServing (`scripts/pd_start.sh {args.flags}`, {args.max_tokens} max tokens, temperature 0.7, "
              f"medians of {args.rounds} alternations):\n")
        print(serve_table(args))


if __name__ == "__main__":
    main()
