#!/usr/bin/env bash
# What everything that starts a real SGLang server needs (scripts/test-server.sh,
# scripts/demo-sglang.sh), each step idempotent: the cached SGLang venv (scripts/sglang-venv.sh),
# the wheel built and installed into it (skipped with ROOTRANK_SKIP_WHEEL=1: the wheel already
# installed is used, e.g. while another build holds the machine), and the tiny random-weight
# Llama under ~/.cache/rootrank. Prints the venv's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/sglang-venv.sh | tail -n 1)"
if [[ -z "${ROOTRANK_SKIP_WHEEL:-}" ]]; then
    WHEEL="$(scripts/wheel.sh | tail -n 1)"
    "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$WHEEL" >&2
fi
"$VENV/bin/python" tests/python/server_kit.py make-model >/dev/null
echo "$VENV"
