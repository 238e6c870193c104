#!/usr/bin/env bash
# One short command for a session lent a GPU: parity tests and the engine benchmark on CUDA.
# Assumes torch with CUDA and the project are importable (bootstrap on that machine or PYTHONPATH).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 1
# Each part bounded, so a hang in one still leaves the others their time.
PDSERVE_TEST_DEVICE=cuda timeout "${GPU_CHECK_PYTEST_TIMEOUT:-900}" "$PY" -m pytest -q tests/models tests/unit/engine/test_engine_tiny.py \
    tests/unit/native/test_page_copy.py
rc=$?
timeout "${GPU_CHECK_BENCH_TIMEOUT:-900}" "$PY" bench/bench_engine.py --device cuda --reps 2
exit $rc
