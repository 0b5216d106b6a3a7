#!/usr/bin/env bash
# Builds the Python package: dist/rootrank-<version>-cp39-abi3-linux_x86_64.whl (one wheel
# for every CPython >= 3.9). maturin comes from PyPI into a small cached venv, once.
#   WHEEL_PROFILE=dev   a debug build (faster to compile; what nothing ships)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${ROOTRANK_CACHE_DIR:-$HOME/.cache/rootrank}"
TOOLS="$CACHE/maturin-venv"
PY="${PYTHON:-python3}"
mkdir -p "$CACHE"
exec 9>"$CACHE/.maturin.lock"
flock 9
if [[ ! -x "$TOOLS/bin/maturin" ]]; then
    "$PY" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet "maturin>=1.5,<2"
fi
profile=(--release)
if [[ "${WHEEL_PROFILE:-release}" == "dev" ]]; then profile=(); fi
rm -f dist/rootrank-*.whl
"$TOOLS/bin/maturin" build "${profile[@]}" --quiet -m crates/python/Cargo.toml -o dist --compatibility linux >&2
ls dist/rootrank-*.whl
