#!/usr/bin/env bash
# Idempotent set-up of the optional Mooncake Store backend of the L3 KV tier
# (hicache/mooncake_store.py, tests/unit/hicache/test_mooncake_store.py): Debian's libibverbs1 and
# librdmacm1 (mooncake's store module and mooncake_master link them even for TCP), then PyPI's
# mooncake-transfer-engine-non-cuda (the CPU build; it ships mooncake_master into .venv/bin) in .venv.
# A second run does nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
# 0.3.13.post1: the version whose API and failure timings hicache/mooncake_store.py documents.
PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

# The loader's own answer (not dpkg's), so that it holds on any distribution.
libs_ok() { "$PY" -c "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('librdmacm.so.1')" 2>/dev/null; }
if ! libs_ok; then
    if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "[setup_mooncake] needs libibverbs.so.1 and librdmacm.so.1: as root on Debian/Ubuntu," \
             "apt-get install -y libibverbs1 librdmacm1 (then run this again)" >&2
        exit 1
    fi
    echo "[setup_mooncake] installing libibverbs1 librdmacm1 with apt-get" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >&2
    libs_ok
fi

if "$PY" -c "import mooncake.store" 2>/dev/null && [[ -x "$ROOT/.venv/bin/mooncake_master" ]]; then
    exit 0
fi
echo "[setup_mooncake] installing $PKG into $ROOT/.venv" >&2
# No torch pin needed: the wheel requires only aiohttp, requests and msgpack.
"$PY" -m pip --disable-pip-version-check -q install "$PKG" >&2
"$PY" -c "import mooncake.store" && echo "[setup_mooncake] done" >&2
