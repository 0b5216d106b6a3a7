#!/usr/bin/env bash
# `make demo-sglang`: rootrank inside a real SGLang PD server (tests/python/demo_sglang.py),
# told for people. Prepares what it needs like the real-server tier (scripts/sglang-server-prep.sh:
# the cached SGLang venv, the wheel installed into it, the tiny model); needs target/debug/rootrank
# (or ROOTRANK_BIN): `make demo-sglang` builds it first. ~4 min and ~5 GB of RAM here.
# ROOTRANK_SKIP_WHEEL=1: use the wheel already installed in the venv. ROOTRANK_DEMO_KEEP=1 keeps the logs.
# --bench: instead, tests/python/bench_server.py (`make bench-server`: latency and throughput
# through the router with the plugin off and on, one run; ~8 min).
# --survival: instead, tests/python/bench_survival.py (`make bench-survival`: two prefill
# instances behind the router, one prefill rank SIGKILLed mid-load, SGLang alone and with
# rootrank side by side; ~30 min).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/sglang-server-prep.sh | tail -n 1)"
cd tests/python
exec env -u ROOTRANK_ETCD_ENDPOINTS -u ROOTRANK_COORDINATOR -u ROOTRANK_PREFIX -u SGLANG_PLUGINS \
    ROOTRANK_BIN="${ROOTRANK_BIN:-$PWD/../../target/debug/rootrank}" \
    "$VENV/bin/python" "$(case "${1:-}" in --bench) echo bench_server.py ;; --survival) echo bench_survival.py ;;
                          *) echo demo_sglang.py ;; esac)"
