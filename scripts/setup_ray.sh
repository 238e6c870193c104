#!/usr/bin/env bash
# Idempotent set-up of the optional Ray extra in .venv (`pip install -e '.[ray]'`): what
# `pd_start.sh --ray ADDRESS|auto` and tests/e2e/test_e2e_ray.py need. Every host of the Ray
# cluster runs it in the same checkout (docs/deployment.md). A second run does nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
if "$PY" -c "import ray" 2>/dev/null; then
    exit 0
fi
echo "[setup_ray] installing Ray into $ROOT/.venv (a minute once)" >&2
# torch==2.13.0 pinned alongside so that pip never swaps the CPU build for a CUDA one.
"$PY" -m pip --disable-pip-version-check -q install -e "$ROOT[ray]" "torch==2.13.0" >&2
"$PY" -c "import ray" && echo "[setup_ray] done" >&2
