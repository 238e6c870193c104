#!/usr/bin/env bash
# The mission benchmark: 2P2D, 1P1D, colocated-2 (scripts/pd_start.sh), vLLM (scripts/peer_vllm.sh
# serve, only where .venv-vllm exists) and llama.cpp's server (scripts/peer_llamacpp.sh serve, only
# where its setup built it), one at a time, each under the synthetic levels of
# scripts/bench_serve.sh (c1 c8 c32) and the AgentX replay; every process it starts is stopped.
# Prints one markdown table (medians over --repeats, ratios to colocated-2, vLLM, llama.cpp) and writes
# report.md, summary.json and each run's JSON and aiperf artifacts to runs/mission-<time>/.
#   scripts/mission_bench.sh [--configs 2P2D,1P1D,colocated-2,vllm,llamacpp] [--config NAME='pd_start flags']
#                            [--levels "1 8 32"] [--agentx-duration 120] [--agentx-concurrency 4]
#                            [--no-agentx] [--no-synthetic] [--kv-reuse-duration S] [--repeats N] [--port P]
#                            [--seed S] [--out DIR]
# --kv-reuse-duration S adds bench/bench_kv_reuse.py's multi-turn sessions (working set many times
# the host caches; load "kv-reuse") after the other loads.
# All flags: .venv/bin/python -m bench.mission --help
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
"$ROOT/scripts/setup_aiperf.sh" >/dev/null
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m bench.mission "$@"
