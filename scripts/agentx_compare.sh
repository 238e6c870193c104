#!/usr/bin/env bash
# AgentX replay (aiperf) against colocated R and every prefill/decode split xPyD with x+y=R,
# one system at a time, then one report: report.md (table + phase breakdown), summary.json,
# ttft.png / itl.png / throughput.png. Sets up both venvs on first use.
#   scripts/agentx_compare.sh [--ranks 2] [--configs all|colocated,1P1D] [--duration 120]
#                             [--concurrency 4] [--trace-dir DIR] [--model NAME] [--out DIR]
# All flags: .venv-bench/bin/python -m bench.agentx.compare --help
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
AIPERF="$("$ROOT/scripts/setup_aiperf.sh")"
cd "$ROOT"
exec "$(dirname "$AIPERF")/python" -m bench.agentx.compare "$@"
