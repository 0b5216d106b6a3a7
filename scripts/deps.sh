#!/usr/bin/env bash
# Installs the system packages rootrank needs, and only those that are missing (idempotent:
# a second run does nothing). Debian/Ubuntu, as root or with sudo.
#
#   scripts/deps.sh          everything: the build, the tests, the benchmarks (`make test`)
#   scripts/deps.sh build    what building and running rootrank needs (`make demo`, `make serve`)
#
# build:
#   etcd-server etcd-client      the store (the demo and the tests start throwaway etcd processes)
#   protobuf-compiler libprotobuf-dev   etcd-client's gRPC code generation
#   clang libclang-dev g++       nixl-sys (bindgen, its C++ stub)
# and for the tests and benchmarks:
#   prometheus                   promtool, to check the /metrics exposition
#   wrk hey                      HTTP load for the benchmarks
#   chromium                     the operator page's browser test (headless)
#   nftables iproute2            the partition tests (network namespaces, blackhole rules)
#   python3-venv                 the wheel's install test
#   openssl                      certificates for the TLS tests (made per test)
#   faketime                     libfaketime: rank and coordinator processes with their clocks off
set -euo pipefail

BUILD=(etcd-server etcd-client protobuf-compiler libprotobuf-dev clang libclang-dev g++)
TESTS=(prometheus wrk hey chromium nftables iproute2 python3-venv openssl faketime)
case "${1:-all}" in
    build) PKGS=("${BUILD[@]}") ;;
    all) PKGS=("${BUILD[@]}" "${TESTS[@]}") ;;
    *) echo "usage: scripts/deps.sh [build|all]" >&2; exit 2 ;;
esac

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "deps: all system packages present"
else
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
    echo "deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The Debian prometheus package starts a server on install; rootrank's tests start their
# own processes and need none running.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
fi
need=(etcd etcdctl protoc clang)
if [[ "${1:-all}" == all ]]; then need+=(promtool); fi
for bin in "${need[@]}"; do
    command -v "$bin" >/dev/null || { echo "deps: $bin still missing after install" >&2; exit 1; }
done
