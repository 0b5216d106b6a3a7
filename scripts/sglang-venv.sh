#!/usr/bin/env bash
# A cached Python venv with the real SGLang 0.5.23 (and the torch 2.14.1 stack it pins) that
# runs SGLang's disaggregation code on a CPU-only machine (../shared/SGLANG-FACTS.md). It is
# ~6.5 GB and ~2.85 GiB to download, so it lives outside the clone and is built once:
#
#   ${ROOTRANK_CACHE_DIR:-$HOME/.cache/rootrank}/sglang-0.5.23
#
# Idempotent: when the marker exists, nothing is downloaded. Prints the venv's path last.
# Only what the disaggregation modules import is installed (sglang itself with --no-deps:
# its full requirement list pulls GPU kernels that cannot run here).
# Also unpacks the sglang 0.5.18 and 0.5.22 wheels (no deps, ~40 MB each) next to it, for
# the older fallback code (tests/python/test_sglang_older.py).
set -euo pipefail

SGLANG_VERSION=0.5.23
CACHE="${ROOTRANK_CACHE_DIR:-$HOME/.cache/rootrank}"
VENV="$CACHE/sglang-$SGLANG_VERSION"
MARKER="$VENV/.rootrank-requirements"
OLDER="$CACHE/sglang-older"
PY="${PYTHON:-python3}"

mkdir -p "$CACHE"
exec 9>"$CACHE/.sglang-venv.lock"
flock 9

# What SGLang's disaggregation code and its scheduler module import (not sglang's whole list).
REQS=("torch==2.14.1" torchvision "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1" numpy pyzmq requests msgspec aiohttp orjson psutil pybase64
    packaging pillow starlette fastapi uvicorn pydantic tqdm IPython dill
    "compressed-tensors==0.18.0" loguru gguf setproctitle "nixl-cu13==1.5.1"
    "openai==2.8.0" partial_json_parser einops "xgrammar==0.2.7" pytest mypy
    # What `python -m sglang.launch_server` and the PD router need beyond that (the real-server
    # tier, tests/python/test_server.py).
    uvloop python-multipart jsonschema "soundfile==0.13.1" cffi pycparser "sglang-router==0.3.2"
    # node-watch reads a stalled rank's Python stack with py-spy (tests/python/test_waits.py).
    "py-spy==0.4.3"
    # What tests/python/test_wheel.py asks about the wheel's platform tag.
    "auditwheel==6.8.2")
NODEPS=("sglang==$SGLANG_VERSION" "nixl==1.5.1")
want="$(printf '%s\n' "${REQS[@]}" "${NODEPS[@]}" | sha256sum | cut -c1-16)"
if [[ ! -f "$MARKER" || "$(cat "$MARKER")" != "$want" ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "sglang-venv: building $VENV (one time, ~3 GiB download) ..." >&2
        "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    else
        echo "sglang-venv: updating $VENV (requirements changed) ..." >&2
    fi
    # --no-cache-dir: the venv is the cache; pip's own would keep another ~2.85 GiB of wheels.
    "$VENV/bin/python" -m pip install --quiet --no-cache-dir "${REQS[@]}" >&2
    "$VENV/bin/python" -m pip install --quiet --no-cache-dir --no-deps "${NODEPS[@]}" >&2
    echo "$want" > "$MARKER"
fi

for v in 0.5.18 0.5.22; do
    if [[ ! -f "$OLDER/$v/.ready" ]]; then
        rm -rf "$OLDER/$v"
        mkdir -p "$OLDER/$v"
        "$VENV/bin/python" -m pip download --quiet --no-deps "sglang==$v" -d "$OLDER/$v/wheel" >&2
        "$VENV/bin/python" -m zipfile -e "$OLDER/$v"/wheel/sglang-*.whl "$OLDER/$v/site" >&2
        rm -rf "$OLDER/$v/wheel"
        touch "$OLDER/$v/.ready"
    fi
done
echo "$VENV"
