#!/usr/bin/env python3
"""Checks of the operator artifacts that no off-the-shelf tool does (run by check.sh).

  opslint.py dashboard-lint DASHBOARD.json SCHEMA_VERSION
      Grafana wiring: schemaVersion is the one @grafana/schema ships as current; a
      `datasource` variable of type datasource (prometheus) and a `group` query variable
      `label_values(rootrank_rank_up, group)`; every panel and target uses the datasource
      `${datasource}`; unique panel ids, unique refIds per panel, a non-empty expr per target;
      grid positions inside 24 columns and not overlapping.
  opslint.py promql-metrics SPEC.md DASHBOARD.json ALERTS.yml
      Every PromQL expression (dashboard targets, the group variable, alert rules) names only
      metrics of SPEC section 8 (`up` too, Prometheus's own), histograms only through
      _bucket/_sum/_count, label matchers only with that metric's labels (plus instance, job,
      and le on _bucket), `by`/`without` only with labels of the metrics in the expression;
      and every SPEC metric is charted on the dashboard.
  opslint.py dashboard-rules DASHBOARD.json OUT.json
      Writes every dashboard expression, Grafana variables replaced by plain values, as a
      Prometheus recording rule file, for `promtool check rules` to parse.
  opslint.py prom-wiring COMPOSE_CONFIG.yml PROMETHEUS_MIRROR_DIR
      From the output of `docker-compose config`: the prometheus service mounts; builds a
      mirror of its /etc/prometheus in the given folder (for `promtool check config`), and
      checks the job `rootrank` scrapes the `rootrank` service on the port the coordinator
      listens on, and that Grafana's dashboard mount is where its provider looks.
  opslint.py coordinator-smoke DOCKERFILE ROOTRANK_BIN SPEC.md
      Runs the Dockerfile's ENTRYPOINT + CMD with a real `rootrank` binary against a throwaway
      etcd, all on loopback (the listen address 0.0.0.0:PORT becomes 127.0.0.1:<free port>,
      ROOTRANK_ETCD_ENDPOINTS as in compose): the image's HEALTHCHECK command must succeed,
      /readyz must turn 200, /metrics must pass `promtool check metrics` and expose only SPEC
      section 8 families with their SPEC types; EXPOSE, CMD --listen and HEALTHCHECK agree on
      the port.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

GRAFANA_VARS = [
    (re.compile(r"\$__rate_interval|\$\{__rate_interval\}|\$__interval|\$\{__interval\}|\$__range|\$\{__range\}"), "5m"),
    (re.compile(r"\$\{group(:[a-z]+)?\}|\$group\b"), ".*"),
]
DS = {"type": "prometheus", "uid": "${datasource}"}
COMMON_LABELS = {"instance", "job"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "atan2", "inf", "nan", "start", "end"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                "topk", "quantile", "limitk", "limit_ratio"}


class Fail(Exception):
    pass


LOG_TAILS = []  # printed after a failure's message

# Metrics the coordinator exports beyond SPEC section 8, each announced in docs/contract.md
# ("Changes to SPEC sections 4-8"): /metrics may carry these, and nothing else unannounced.
EXTENSIONS = {
    "rootrank_http_connections": ("gauge", set()),
    "rootrank_http_connections_refused_total": ("counter", set()),
}


def grafana_to_promql(expr):
    for rx, val in GRAFANA_VARS:
        expr = rx.sub(val, expr)
    return expr


def spec_metrics(spec_path):
    """{name: (type, {labels})} from the table of SPEC section 8 (a row may mark the version
    that added it: `rootrank_x` (v3))."""
    text = open(spec_path, encoding="utf-8").read()
    m = re.search(r"^## 8\. .*?$(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        raise Fail(f"{spec_path}: no section 8 (metrics)")
    out = {}
    for row in re.finditer(r"^\|\s*`(rootrank_[a-z0-9_]+)`(?:\s*\(v\d+\))?\s*\|\s*(\w+)\s*\|([^|\n]*)\|", m.group(1), re.M):
        name, typ, labels = row.groups()
        labs = set() if "(" in labels else {l.strip() for l in labels.split(",") if l.strip()}
        out[name] = (typ, labs)
    if len(out) < 5:
        raise Fail(f"{spec_path}: found only {len(out)} metrics in section 8: {sorted(out)}")
    return out


# Metrics SPEC names outside section 8's table (v4 names rootrank_etcd_alarm{alarm} in section 5),
# with the type SPEC leaves implicit. A mention that is not listed here fails the lint, so a new
# one is noticed instead of silently allowed or refused.
SPEC_NOTE_TYPES = {"rootrank_etcd_alarm": "gauge"}


def spec_note_metrics(spec_path):
    """{name: (type, {labels})} for metrics SPEC names as `rootrank_x{label}` outside section 8."""
    text = open(spec_path, encoding="utf-8").read()
    text = re.sub(r"^## 8\. .*?(?=^## |\Z)", "", text, flags=re.S | re.M)
    out = {}
    for name, labels in re.findall(r"`(rootrank_[a-z0-9_]+)\{([a-z_, ]*)\}`", text):
        if name not in SPEC_NOTE_TYPES:
            raise Fail(f"{spec_path} names {name} outside section 8; add its type to SPEC_NOTE_TYPES")
        out[name] = (SPEC_NOTE_TYPES[name], {l.strip() for l in labels.split(",") if l.strip()})
    return out


def all_spec_metrics(spec_path):
    return {**spec_metrics(spec_path), **spec_note_metrics(spec_path)}


def allowed_series(spec):
    """series name -> allowed label names."""
    allowed = {"up": set()}
    for name, (typ, labs) in spec.items():
        labs = labs | COMMON_LABELS
        if typ == "histogram":
            allowed[name + "_bucket"] = labs | {"le"}
            allowed[name + "_sum"] = labs
            allowed[name + "_count"] = labs
        else:
            allowed[name] = labs
    return {k: v | COMMON_LABELS for k, v in allowed.items()}


TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<dur>\d+(?:\.\d+)?(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)
  | (?P<num>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?))
  | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>@])
""", re.X)


def tokenize(expr):
    toks, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise Fail(f"cannot tokenize at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            toks.append((m.lastgroup, m.group()))
    return toks


def promql_refs(expr):
    """[(metric, [matcher labels])], [grouping labels] of one PromQL expression."""
    toks = tokenize(expr)
    selectors, grouping = [], []
    i = 0
    while i < len(toks):
        kind, val = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "op" and val == "[":
            while i < len(toks) and toks[i][1] != "]":
                i += 1
        elif kind == "id" and val.lower() in GROUPING and nxt == "(":
            i += 2
            while i < len(toks) and toks[i][1] != ")":
                if toks[i][0] == "id":
                    grouping.append(toks[i][1])
                i += 1
        elif kind == "id" and val.lower() in KEYWORDS:
            if val.lower() == "offset":
                i += 1
        elif kind == "id" and (nxt == "(" or (val in AGGREGATIONS and str(nxt).lower() in ("by", "without"))):
            pass  # a function or an aggregation
        elif (kind == "id") or (kind == "op" and val == "{"):
            name = val if kind == "id" else None
            labels = []
            j = i + 1 if kind == "id" else i
            if j < len(toks) and toks[j][1] == "{":
                j += 1
                while j < len(toks) and toks[j][1] != "}":
                    if toks[j][0] == "id":
                        labels.append(toks[j][1])
                        if toks[j][1] == "__name__" and j + 2 < len(toks) and toks[j + 2][0] == "str":
                            name = toks[j + 2][1][1:-1]
                    j += 1
                i = j
            selectors.append((name, labels))
        i += 1
    return selectors, grouping


def check_expr(where, expr, allowed, errors):
    try:
        selectors, grouping = promql_refs(expr)
    except Fail as e:
        errors.append(f"{where}: {e}")
        return set()
    used = set()
    if not selectors:
        errors.append(f"{where}: no metric in {expr!r}")
    labels_in_scope = set(COMMON_LABELS)
    for name, labels in selectors:
        if name is None:
            errors.append(f"{where}: selector without a metric name in {expr!r}")
            continue
        if name not in allowed:
            hint = " (a histogram: use _bucket, _sum or _count)" if name + "_bucket" in allowed else ""
            errors.append(f"{where}: metric {name!r} is not in SPEC section 8{hint}: {expr!r}")
            continue
        used.add(name)
        labels_in_scope |= allowed[name]
        for l in labels:
            if l != "__name__" and l not in allowed[name]:
                errors.append(f"{where}: {name} has no label {l!r} (has {sorted(allowed[name])}): {expr!r}")
    for l in grouping:
        if l not in labels_in_scope:
            errors.append(f"{where}: grouping label {l!r} is on none of the metrics of {expr!r}")
    return used


def dashboard_targets(dash):
    for p in dash.get("panels", []):
        for sub in [p] + p.get("panels", []):
            for t in sub.get("targets", []):
                yield sub, t


def cmd_dashboard_lint(dash_path, schema_version):
    dash = json.load(open(dash_path, encoding="utf-8"))
    errors = []
    if dash.get("schemaVersion") != int(schema_version):
        errors.append(f"schemaVersion is {dash.get('schemaVersion')}, @grafana/schema's current is {schema_version}")
    vars_ = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = vars_.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append("no template variable `datasource` of type datasource with query prometheus")
    grp = vars_.get("group")
    q = grp.get("query") if grp else None
    if isinstance(q, dict):
        q = q.get("query")
    if not grp or grp.get("type") != "query" or q != "label_values(rootrank_rank_up, group)":
        errors.append("no query variable `group` = label_values(rootrank_rank_up, group)")
    elif grp.get("datasource") != DS:
        errors.append(f"variable group: datasource is {grp.get('datasource')}, want {DS}")
    ids, cells = set(), {}
    for p in dash.get("panels", []):
        pid, title = p.get("id"), p.get("title")
        if pid in ids:
            errors.append(f"panel id {pid} used twice")
        ids.add(pid)
        if p.get("type") != "row" and p.get("datasource") != DS:
            errors.append(f"panel {pid} {title!r}: datasource is {p.get('datasource')}, want {DS}")
        refs = set()
        for t in p.get("targets", []):
            if t.get("refId") in refs:
                errors.append(f"panel {pid}: refId {t.get('refId')} used twice")
            refs.add(t.get("refId"))
            if "datasource" in t and t["datasource"] != DS:
                errors.append(f"panel {pid} target {t.get('refId')}: datasource is {t['datasource']}, want {DS}")
            if not str(t.get("expr", "")).strip():
                errors.append(f"panel {pid} target {t.get('refId')}: no expr")
        if p.get("type") != "row" and not p.get("targets"):
            errors.append(f"panel {pid} {title!r}: no targets")
        g = p.get("gridPos", {})
        x, y, w, h = (g.get(k, 0) for k in ("x", "y", "w", "h"))
        if x < 0 or w < 1 or h < 1 or x + w > 24:
            errors.append(f"panel {pid}: gridPos {g} outside the 24-column grid")
        for cx in range(x, x + w):
            for cy in range(y, y + h):
                if (cx, cy) in cells:
                    errors.append(f"panel {pid} overlaps panel {cells[(cx, cy)]} at x={cx} y={cy}")
                    break
                cells[(cx, cy)] = pid
            else:
                continue
            break
    if errors:
        raise Fail("\n".join(errors))
    n = sum(1 for _ in dashboard_targets(dash))
    print(f"{len(ids)} panels, {n} targets, schemaVersion {schema_version}, datasource ${{datasource}}")


def cmd_promql_metrics(spec_path, dash_path, alerts_path):
    spec = all_spec_metrics(spec_path)
    allowed = allowed_series(spec)
    dash = json.load(open(dash_path, encoding="utf-8"))
    rules = yaml.safe_load(open(alerts_path, encoding="utf-8"))
    errors, charted, n = [], set(), 0
    for p, t in dashboard_targets(dash):
        n += 1
        charted |= check_expr(f"dashboard panel {p.get('id')} {p.get('title')!r} {t.get('refId')}",
                              grafana_to_promql(t.get("expr", "")), allowed, errors)
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else (q or "")
            m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)\s*", q)
            if not m:
                errors.append(f"variable {v.get('name')}: not label_values(SELECTOR, LABEL): {q!r}")
                continue
            n += 1
            check_expr(f"variable {v.get('name')}", m.group(1) + "{" + m.group(2) + '=""}', allowed, errors)
    for g in (rules or {}).get("groups", []):
        for r in g.get("rules", []):
            n += 1
            check_expr(f"rule {r.get('alert') or r.get('record')}", str(r.get("expr", "")), allowed, errors)
    hist = {f"{k}_bucket" for k, (t, _) in spec.items() if t == "histogram"}
    for name, (typ, _) in spec.items():
        series = {name + s for s in ("_bucket", "_sum", "_count")} if typ == "histogram" else {name}
        if not series & charted:
            errors.append(f"SPEC metric {name} is on no dashboard panel")
    if errors:
        raise Fail("\n".join(errors))
    print(f"{n} expressions use only SPEC section 8 metrics and labels "
          f"({len(spec)} metrics in SPEC, all charted; histograms via {sorted(hist)})")


def cmd_dashboard_rules(dash_path, out_path):
    dash = json.load(open(dash_path, encoding="utf-8"))
    rules = []
    for p, t in dashboard_targets(dash):
        rules.append({"record": f"ops_check:panel_{p.get('id')}_{t.get('refId')}",
                      "expr": grafana_to_promql(t.get("expr", ""))})
    json.dump({"groups": [{"name": "dashboard-expressions", "rules": rules}]}, open(out_path, "w"), indent=1)
    print(f"{len(rules)} expressions written to {out_path}")


def cmd_prom_wiring(compose_config, mirror):
    cfg = yaml.safe_load(open(compose_config, encoding="utf-8"))
    services = cfg.get("services", {})
    errors = []
    for s in ("etcd", "rootrank", "prometheus"):
        if s not in services:
            errors.append(f"compose: no service {s}")
    if errors:
        raise Fail("\n".join(errors))
    env = services["rootrank"].get("environment", {})
    if not env.get("ROOTRANK_ETCD_ENDPOINTS"):
        errors.append("compose: rootrank has no ROOTRANK_ETCD_ENDPOINTS")
    # Mirror the prometheus container's view of /etc/prometheus.
    found_cfg = False
    for v in services["prometheus"].get("volumes", []):
        if isinstance(v, str):
            src, dst = v.split(":")[0], v.split(":")[1]
        else:
            src, dst = v.get("source"), v.get("target")
        if dst.startswith("/etc/prometheus/") and os.path.isfile(src):
            dest = os.path.join(mirror, os.path.relpath(dst, "/etc/prometheus"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(src, dest)
            found_cfg |= dst == "/etc/prometheus/prometheus.yml"
    if not found_cfg:
        errors.append("compose: prometheus mounts no /etc/prometheus/prometheus.yml")
    else:
        prom = yaml.safe_load(open(os.path.join(mirror, "prometheus.yml"), encoding="utf-8"))
        jobs = {j.get("job_name"): j for j in prom.get("scrape_configs", [])}
        targets = [t for sc in jobs.get("rootrank", {}).get("static_configs", []) for t in sc.get("targets", [])]
        listen = None
        cmd = services["rootrank"].get("command")
        if isinstance(cmd, list) and "--listen" in cmd:
            listen = cmd[cmd.index("--listen") + 1]
        port = (listen or env.get("ROOTRANK_LISTEN") or "0.0.0.0:9750").rsplit(":", 1)[1]
        if f"rootrank:{port}" not in targets:
            errors.append(f"prometheus.yml: job rootrank does not scrape rootrank:{port} (targets {targets})")
    g = services.get("grafana")
    if g:
        prov_dirs = [v for v in g.get("volumes", []) if (v if isinstance(v, str) else v.get("target", "")).find("/etc/grafana/provisioning") >= 0]
        dash_targets = [v.get("target") if isinstance(v, dict) else v.split(":")[1] for v in g.get("volumes", [])
                        if (v.get("target") if isinstance(v, dict) else v.split(":")[1]).endswith(".json")]
        paths = []
        for v in prov_dirs:
            src = v.get("source") if isinstance(v, dict) else v.split(":")[0]
            for root, _, files in os.walk(os.path.join(src, "dashboards")):
                for f in files:
                    for pr in (yaml.safe_load(open(os.path.join(root, f))) or {}).get("providers", []):
                        paths.append(pr.get("options", {}).get("path"))
        if not paths:
            errors.append("compose: grafana has no dashboard provider")
        for t in dash_targets:
            if not any(p and t.startswith(p.rstrip("/") + "/") for p in paths):
                errors.append(f"compose: grafana dashboard {t} is under no provider path {paths}")
    if errors:
        raise Fail("\n".join(errors))
    print(f"prometheus mounts mirrored into {mirror}; job rootrank -> rootrank service; grafana provider paths {paths if g else '-'}")


def dockerfile_instructions(path):
    """[(INSTRUCTION, rest)] with line continuations joined and comments dropped."""
    out, cur = [], ""
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return None, ""


def wait_status(url, want, seconds, procs):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise Fail(f"{name} exited with {p.returncode} while waiting for {url}")
        code, body = http_get(url)
        if code == want:
            return body
        time.sleep(0.2)
    raise Fail(f"{url} did not answer {want} within {seconds} s (last: {code})")


def cmd_coordinator_smoke(dockerfile, binary, spec_path):
    spec = {**all_spec_metrics(spec_path), **EXTENSIONS}
    ins = dockerfile_instructions(dockerfile)
    stages = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    final = ins[stages[-1]:] if stages else ins
    get = lambda w: [r for x, r in final if x == w]
    errors = []
    try:
        entry = json.loads(get("ENTRYPOINT")[-1])
        cmd = json.loads(get("CMD")[-1])
        hc = get("HEALTHCHECK")[-1]
        hc_cmd = json.loads(hc[hc.index(" CMD ") + 5:] if " CMD " in hc else hc[hc.index("CMD ") + 4:])
    except (IndexError, ValueError) as e:
        raise Fail(f"{dockerfile}: final stage needs exec-form ENTRYPOINT, CMD and HEALTHCHECK CMD ({e})")
    exposed = {e.split("/")[0] for r in get("EXPOSE") for e in r.split()}
    if entry != ["rootrank"]:
        errors.append(f"ENTRYPOINT is {entry}, want [\"rootrank\"]")
    if "--listen" not in cmd:
        raise Fail(f"CMD {cmd} has no --listen")
    listen = cmd[cmd.index("--listen") + 1]
    host, _, port = listen.rpartition(":")
    if port not in exposed:
        errors.append(f"CMD listens on {port}, EXPOSE is {sorted(exposed)}")
    hc_urls = [a for a in hc_cmd if a.startswith("http://")]
    if not hc_urls or f":{port}/" not in hc_urls[0]:
        errors.append(f"HEALTHCHECK {hc_cmd} does not probe port {port}")
    if errors:
        raise Fail("\n".join(errors))
    tmp = tempfile.mkdtemp(prefix="ops-smoke-")
    cport, pport, hport = free_port(), free_port(), free_port()
    procs = []
    try:
        etcd_log = open(os.path.join(tmp, "etcd.log"), "w")
        procs.append(("etcd", subprocess.Popen(
            ["etcd", "--name", "smoke", "--data-dir", os.path.join(tmp, "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{cport}", "--advertise-client-urls", f"http://127.0.0.1:{cport}",
             "--listen-peer-urls", f"http://127.0.0.1:{pport}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
             "--initial-cluster", f"smoke=http://127.0.0.1:{pport}"],
            stdout=etcd_log, stderr=subprocess.STDOUT)))
        wait_status(f"http://127.0.0.1:{cport}/health", 200, 20, procs)
        argv = [binary] + [a.replace(listen, f"127.0.0.1:{hport}") for a in cmd]
        env = dict(os.environ, ROOTRANK_ETCD_ENDPOINTS=f"http://127.0.0.1:{cport}", HOME=tmp)
        for k in ("ROOTRANK_LISTEN", "ROOTRANK_PREFIX", "ROOTRANK_COORDINATOR"):
            env.pop(k, None)
        log = open(os.path.join(tmp, "rootrank.log"), "w")
        procs.append(("rootrank", subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)))
        base = f"http://127.0.0.1:{hport}"
        wait_status(base + "/healthz", 200, 30, procs)
        hc_run = [a.replace(f":{port}/", f":{hport}/") for a in hc_cmd]
        r = subprocess.run(hc_run, capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise Fail(f"HEALTHCHECK {hc_run} exited {r.returncode}: {r.stderr.strip()}")
        wait_status(base + "/readyz", 200, 30, procs)
        http_get(base + "/v1/groups")
        code, body = http_get(base + "/v1/rooms/not-a-room/verdict")
        if code != 400 or '"error"' not in body:
            errors.append(f"/v1/rooms/not-a-room/verdict answered {code} {body[:100]!r}, want a JSON 400")
        code, metrics = http_get(base + "/metrics")
        if code != 200:
            raise Fail(f"/metrics answered {code}")
        r = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            errors.append(f"promtool check metrics: {(r.stdout + r.stderr).strip()}")
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics, re.M))
        for name, typ in sorted(types.items()):
            if name not in spec:
                errors.append(f"/metrics exposes {name}, not in SPEC (section 8 or a note naming it)")
            elif spec[name][0] != typ:
                errors.append(f"/metrics: {name} is a {typ}, SPEC says {spec[name][0]}")
        if not types:
            errors.append("/metrics exposes no metric family")
        for name, p in procs:
            if p.poll() is not None:
                errors.append(f"{name} exited with {p.returncode}")
        if errors:
            raise Fail("\n".join(errors))
        unseen = sorted(set(spec) - set(types))
        print(f"{' '.join(['rootrank'] + argv[1:])} with etcd: HEALTHCHECK ok, /readyz 200, "
              f"/metrics passes promtool, {len(types)} SPEC families exposed"
              + (f" (no series yet: {', '.join(unseen)})" if unseen else ""))
    finally:
        for name, p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if errors or sys.exc_info()[0]:
            for f in ("rootrank.log", "etcd.log"):
                path = os.path.join(tmp, f)
                if os.path.exists(path):
                    tail = open(path, errors="replace").read().splitlines()[-8:]
                    LOG_TAILS.append(f"--- last lines of {f}:\n" + "\n".join(tail))
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    cmds = {"dashboard-lint": cmd_dashboard_lint, "promql-metrics": cmd_promql_metrics,
            "dashboard-rules": cmd_dashboard_rules, "prom-wiring": cmd_prom_wiring,
            "coordinator-smoke": cmd_coordinator_smoke}
    if len(argv) < 2 or argv[1] not in cmds:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        cmds[argv[1]](*argv[2:])
    except Fail as e:
        print(f"{argv[1]}: FAILED\n{e}", file=sys.stderr)
        print("\n".join(LOG_TAILS), file=sys.stderr, end="\n" if LOG_TAILS else "")
        return 1
    except (OSError, ValueError, yaml.YAMLError, TypeError) as e:
        print(f"{argv[1]}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
