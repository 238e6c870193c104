#!/usr/bin/env bash
# Engine demo on the embedded default model (bootstraps on first use):
#   scripts/generate.sh "Tell me about Paris" [--model gemma-3-270m] [--max-tokens 64] [--chat]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/python" -m engine.generate "$@"
