#!/usr/bin/env bash
# Builds the Python package: dist/rootrank-<version>-cp39-abi3-manylinux_2_28_x86_64.whl (one
# wheel for every CPython >= 3.9 on any Linux with glibc >= 2.28: RHEL 8, Ubuntu 20.04 and
# later), with the `rootrank` command in it. maturin and zig (its linker, which targets an old
# glibc from any machine) come from PyPI into a small cached venv, once.
#   WHEEL_PROFILE=dev   a debug build (faster to compile; what nothing ships)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${ROOTRANK_CACHE_DIR:-$HOME/.cache/rootrank}"
TOOLS="$CACHE/maturin-venv"
PY="${PYTHON:-python3}"
mkdir -p "$CACHE"
exec 9>"$CACHE/.maturin.lock"
flock 9
ZIG="ziglang==0.15.2"
if [[ ! -x "$TOOLS/bin/maturin" ]]; then
    "$PY" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet "maturin>=1.5,<2"
fi
if [[ "$("$TOOLS/bin/python" -m pip show ziglang 2>/dev/null | sed -n 's/^Version: //p')" != "${ZIG#*==}" ]]; then
    "$TOOLS/bin/python" -m pip install --quiet "$ZIG"
fi
profile=(--release)
if [[ "${WHEEL_PROFILE:-release}" == "dev" ]]; then profile=(); fi
rm -f dist/rootrank-*.whl
# maturin finds zig through the venv's python (the ziglang package).
PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/maturin" build "${profile[@]}" --quiet -m crates/python/Cargo.toml -o dist \
    --zig --compatibility manylinux_2_28 >&2
ls dist/rootrank-*.whl
