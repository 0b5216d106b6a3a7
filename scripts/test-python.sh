#!/usr/bin/env bash
# The Python tests (tests/python): the package's API against real etcd and coordinators, and
# rootrank inside the real SGLang 0.5.23 (plus the fallback code of 0.5.18 and 0.5.22).
# Builds the wheel, installs it into the cached SGLang venv (scripts/sglang-venv.sh, built
# once, never downloaded twice) and runs pytest there (`--bench`: the Python benchmarks). Needs target/debug/rootrank (the
# coordinator the tests start): `make test-python` builds it first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(scripts/sglang-venv.sh | tail -n 1)"
WHEEL="$(scripts/wheel.sh | tail -n 1)"
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
if [[ "${1:-}" == "--bench" ]]; then
    # bench_python.py starts its own etcd and a release coordinator; writes bench-results/python.json.
    exec env -u ROOTRANK_ETCD_ENDPOINTS -u ROOTRANK_COORDINATOR -u SGLANG_PLUGINS HF_HUB_OFFLINE=1 \
        ROOTRANK_BIN="${ROOTRANK_BIN:-$PWD/target/release/rootrank}" "$VENV/bin/python" tests/python/bench_python.py
fi
# The tests start their own etcd and coordinators; nothing from the caller's shell leaks in.
# The real-server tier (test_server.py) runs on its own: scripts/test-server.sh.
# test_wheel.py checks the wheel itself (auditwheel, a fresh venv without cargo).
exec env -u ROOTRANK_ETCD_ENDPOINTS -u ROOTRANK_COORDINATOR -u ROOTRANK_PREFIX -u SGLANG_PLUGINS \
    ROOTRANK_BIN="${ROOTRANK_BIN:-$PWD/target/debug/rootrank}" ROOTRANK_WHEEL="$PWD/$WHEEL" \
    "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rA tests/python --ignore=tests/python/test_server.py "$@"
