#!/usr/bin/env bash
# The whole test suite on a fresh machine: bootstrap (venv, torch, models), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
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
