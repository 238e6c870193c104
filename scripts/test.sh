#!/usr/bin/env bash
# The whole test suite on a fresh machine: bootstrap (venv, torch, models), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
# The optional Ray extra, for tests/e2e/test_e2e_ray.py (which skips, saying why, without it).
"$ROOT/scripts/setup_ray.sh" || echo "[test] Ray could not be installed: its tests will be skipped" >&2
# The optional Mooncake Store L3 tier, for its tests (which skip, saying why, without it).
"$ROOT/scripts/setup_mooncake.sh" || echo "[test] Mooncake could not be installed: its tests will be skipped" >&2
cd "$ROOT"
set +e
.venv/bin/python -m pytest "${@:-tests}"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit $rc
