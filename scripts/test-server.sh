#!/usr/bin/env bash
# The real-server tier (tests/python/test_server.py): a real SGLang 0.5.23 PD deployment
# (prefill TP=2, decode TP=1, NIXL, sglang-router) on this CPU-only machine with the rootrank
# plugin, a real etcd and a real coordinator. Prepares what it needs (scripts/sglang-server-prep.sh:
# the cached SGLang venv with launch_server's and the router's extra packages, the wheel
# installed into it, the tiny random-weight Llama under ~/.cache/rootrank). Needs target/debug/rootrank (or
# ROOTRANK_BIN): `make test-server` builds it first. ~7 GB of RAM while it runs; its SGLang
# processes run at nice 10. ROOTRANK_SKIP_WHEEL=1: use the wheel already installed in the venv
# (when cargo must not run here, e.g. while another build holds the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/sglang-server-prep.sh | tail -n 1)"
start=$(date +%s)
status=0
env -u ROOTRANK_ETCD_ENDPOINTS -u ROOTRANK_COORDINATOR -u ROOTRANK_PREFIX -u SGLANG_PLUGINS \
    ROOTRANK_BIN="${ROOTRANK_BIN:-$PWD/target/debug/rootrank}" \
    "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rA -s tests/python/test_server.py "$@" || status=$?
echo "test-server: $(( $(date +%s) - start )) s" >&2
exit $status
