#!/usr/bin/env bash
# Serving benchmark with aiperf (synthetic: random 512-token prompts, 128 output tokens,
# ignore_eos, concurrency 1, 8 and 32) against any OpenAI-compatible URL; prints one table
# (output tok/s, TTFT and ITL p50/p99, requests, errors). Run it against this system and a
# peer to compare them with the same client and workload.
#   scripts/bench_serve.sh URL [--model NAME] [--tokenizer DIR] [--concurrency "1 8 32"]
#                          [--requests-per-level N] [--isl 512] [--osl 128] [--out DIR]
# --model defaults to the server's first /v1/models id, --tokenizer to the engine's cached
# checkpoint dir for it (embedded names); a peer serving another name needs --tokenizer.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AIPERF="$("$ROOT/scripts/setup_aiperf.sh")"
cd "$ROOT"
exec "$(dirname "$AIPERF")/python" -m bench.agentx.serve_bench "$@"
