#!/usr/bin/env bash
# Creates the least etcd roles and users rootrank needs, and turns etcd's auth on (README,
# "Production"). Idempotent: what exists already is kept.
#
#   scripts/etcd-roles.sh [PREFIX]          (default /rootrank/v1)
#
# etcdctl's own settings say where etcd is and who runs this: ETCDCTL_ENDPOINTS, and for a
# TLS etcd ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY; once auth is on, ETCDCTL_USER=root:PW.
# Passwords of the users it creates come from the environment:
#   ROOTRANK_ROOT_PASSWORD          etcd's root user (created if auth is still off)
#   ROOTRANK_RANK_PASSWORD          rootrank-rank: every rank's agent (the SGLang plugin)
#   ROOTRANK_COORDINATOR_PASSWORD   rootrank-coordinator: `rootrank serve`
#   ROOTRANK_NODE_PASSWORD          rootrank-node: `rootrank node-watch` and `rootrank run`
#
# What each role may do (etcd permissions are key ranges, read and/or write):
#   rootrank-rank         readwrite PREFIX/groups/        live key, room records, own certificate
#   rootrank-coordinator  read PREFIX/, write PREFIX/groups/ (lease_expired certificates),
#                         readwrite PREFIX/coordinators/ (its presence)
#   rootrank-node         read PREFIX/, write PREFIX/groups/ (certificates, stall stacks)
# None of them can touch a key outside PREFIX.
set -euo pipefail
P="${1:-/rootrank/v1}"
P="${P%/}"
export ETCDCTL_API=3
ctl() { etcdctl "$@"; }

role() { # name, then (permission, range) pairs
    local name=$1; shift
    ctl role get "$name" >/dev/null 2>&1 || ctl role add "$name" >/dev/null
    while [[ $# -gt 0 ]]; do
        ctl role grant-permission "$name" "$1" --prefix=true "$2" >/dev/null
        shift 2
    done
}
user() { # name, password, role
    if ! ctl user get "$1" >/dev/null 2>&1; then
        [[ -n "$2" ]] || { echo "etcd-roles: set the password variable for user $1" >&2; exit 2; }
        ctl user add "$1" --new-user-password="$2" >/dev/null
    fi
    ctl user grant-role "$1" "$3" >/dev/null
}

if ! ctl user get root >/dev/null 2>&1; then
    [[ -n "${ROOTRANK_ROOT_PASSWORD:-}" ]] || { echo "etcd-roles: set ROOTRANK_ROOT_PASSWORD (etcd's root user)" >&2; exit 2; }
    ctl user add root --new-user-password="$ROOTRANK_ROOT_PASSWORD" >/dev/null
    ctl user grant-role root root >/dev/null
fi
role rootrank-rank readwrite "$P/groups/"
role rootrank-coordinator read "$P/" write "$P/groups/" readwrite "$P/coordinators/"
role rootrank-node read "$P/" write "$P/groups/"
user rootrank-rank "${ROOTRANK_RANK_PASSWORD:-}" rootrank-rank
user rootrank-coordinator "${ROOTRANK_COORDINATOR_PASSWORD:-}" rootrank-coordinator
user rootrank-node "${ROOTRANK_NODE_PASSWORD:-}" rootrank-node
ctl auth enable >/dev/null 2>&1 || true
echo "etcd-roles: roles rootrank-rank, rootrank-coordinator, rootrank-node under $P/; auth enabled"
