#!/usr/bin/env bash
# Idempotent set-up of the benchmark client: its own venv `.venv-bench` with aiperf 0.13
# (NVIDIA's OpenAI-API load generator, used for the AgentX replay and bench_serve.sh) and
# matplotlib (report plots). Kept apart from .venv: aiperf pins its own versions of
# pydantic, numpy, transformers, ... that the server must not inherit.
# Prints the aiperf executable's path on stdout (the only thing on stdout), so callers do
#   AIPERF="$(scripts/setup_aiperf.sh)"
# A second run only compares a stamp and prints the path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PD_BENCH_VENV:-$ROOT/.venv-bench}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pdserve-aiperf"
HASH="$(sha256sum "$ROOT/scripts/setup_aiperf.sh" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" && -x "$VENV/bin/aiperf" ]]; then
    echo "$VENV/bin/aiperf"
    exit 0
fi
echo "[setup_aiperf] setting up $VENV (a few minutes once)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >&2
# NOTE: aiperf 0.13 and its dependencies need no torch (its tokenizer path is transformers +
# tokenizers only). Should a later release ask for one, install "torch==2.13.0" first here
# (the CPU build on this machine's disk) so pip keeps it instead of pulling a CUDA build.
"${PIP[@]}" install "aiperf==0.13.*" "matplotlib>=3.8" >&2
"$VENV/bin/aiperf" --help >/dev/null
echo "$HASH" > "$STAMP"
echo "[setup_aiperf] done" >&2
echo "$VENV/bin/aiperf"
