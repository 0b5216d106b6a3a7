#!/usr/bin/env bash
# Fetch the real NIXL runtime (CPU-usable; UCX backend) into <repo>/.cache/nixl.
#
# The libraries come from the PyPI wheel nixl-cu12 (no torch needed: --no-deps).
# The wheel is unpacked as is: its RPATHs point between the folders
# `.nixl_cu12.mesonpy.libs/` and `nixl_cu12.libs/`, so their names are kept.
#
# Idempotent: when the marker file exists, nothing is done.
# Env:
#   NIXL_WHEEL_VERSION  wheel version (default 1.5.1)
#   NIXL_WHEEL_DIR      a folder that may already hold the wheel (default: none, download)
set -euo pipefail

VERSION="${NIXL_WHEEL_VERSION:-1.5.1}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
DEST="$REPO_ROOT/.cache/nixl"
MARKER="$DEST/.rootrank-nixl-$VERSION"
CAPI="$DEST/.nixl_cu12.mesonpy.libs/libnixl_capi.so"

if [[ -f "$MARKER" && -f "$CAPI" ]]; then
    echo "NIXL $VERSION already unpacked in $DEST"
    exit 0
fi

# Serialise concurrent runs (parallel test processes): one unpacks, the
# others wait and then find the marker.
mkdir -p "$REPO_ROOT/.cache"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$REPO_ROOT/.cache/.nixl.lock"
    flock 9
    if [[ -f "$MARKER" && -f "$CAPI" ]]; then
        echo "NIXL $VERSION already unpacked in $DEST"
        exit 0
    fi
fi

PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found; it is needed to download and unpack the nixl-cu12 wheel" >&2
    exit 1
fi

WHEEL_DIR="${NIXL_WHEEL_DIR:-}"
WHEEL="$(ls "$WHEEL_DIR"/nixl_cu12-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
TMP=""
cleanup() { if [[ -n "$TMP" ]]; then rm -rf "$TMP"; fi; }
trap cleanup EXIT
if [[ -z "$WHEEL" ]]; then
    TMP="$(mktemp -d)"
    echo "downloading nixl-cu12==$VERSION (no deps) ..."
    "$PY" -m pip download --quiet --no-deps "nixl-cu12==$VERSION" -d "$TMP"
    WHEEL="$(ls "$TMP"/nixl_cu12-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$WHEEL" ]]; then
        echo "error: pip did not produce a nixl_cu12-$VERSION wheel in $TMP" >&2
        exit 1
    fi
fi

echo "unpacking $WHEEL into $DEST ..."
rm -rf "$DEST.partial"
mkdir -p "$DEST.partial"
"$PY" -m zipfile -e "$WHEEL" "$DEST.partial"
if [[ ! -f "$DEST.partial/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]]; then
    echo "error: libnixl_capi.so missing from $WHEEL (expected .nixl_cu12.mesonpy.libs/libnixl_capi.so)" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
touch "$MARKER"
echo "NIXL $VERSION ready: $CAPI"
