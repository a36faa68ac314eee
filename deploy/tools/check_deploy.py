#!/usr/bin/env python3
"""Static checks behind deploy/check.sh. Each subcommand prints one line per finding and
exits 1 if any finding is an error.

  k8s DIR               structure and cross-references of the manifests (duplicate keys,
                        required fields, probes, drain budget, one client id, selectors,
                        kustomization coverage, placeholder-only secrets)
  metrics               dashboard JSON and alert rules against src/metrics.rs: metric names,
                        histogram suffixes, label names, `arm`/`reason` values, coverage, and
                        the resident-account cap repeated in configmap, alerts and dashboard
  dashboard-rules OUT   writes every dashboard query, Grafana variables filled in, as a
                        Prometheus recording-rule file, so promtool can parse each one
  rules-structure FILE  fallback when promtool is unavailable: the rule file's YAML shape
"""

import json
import os
import re
import sys

import yaml

DEPLOY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(DEPLOY)
METRICS_RS = os.path.join(REPO, "src", "metrics.rs")
DASHBOARD = os.path.join(DEPLOY, "grafana", "tally-dashboard.json")
ALERTS = os.path.join(DEPLOY, "prometheus", "tally-alerts.yaml")
K8S = os.path.join(DEPLOY, "k8s")
NGINX_CONF = os.path.join(DEPLOY, "nginx", "tally.conf")

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DRAIN_DEADLINE_S = 10  # Tally's default drain deadline after SIGTERM

errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")
    print(f"  error: {where}: {msg}")


def finish(what):
    if errors:
        print(f"{what}: {len(errors)} error(s)")
        return 1
    print(f"{what}: ok")
    return 0


# --- YAML with duplicate-key detection ------------------------------------------------------

class StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=StrictLoader) if d is not None]


def dig(obj, *path, default=None):
    for p in path:
        if isinstance(obj, dict) and p in obj:
            obj = obj[p]
        elif isinstance(obj, list) and isinstance(p, int) and p < len(obj):
            obj = obj[p]
        else:
            return default
    return obj


# --- k8s ----------------------------------------------------------------------------------

def check_k8s(directory):
    docs = {}  # (kind, name) -> (file, doc)
    files = sorted(f for f in os.listdir(directory) if f.endswith((".yaml", ".yml")))
    for fname in files:
        path = os.path.join(directory, fname)
        try:
            for doc in load_all(path):
                if fname == "kustomization.yaml":
                    continue
                for field in ("apiVersion", "kind"):
                    if not doc.get(field):
                        err(fname, f"missing {field}")
                if not dig(doc, "metadata", "name"):
                    err(fname, "missing metadata.name")
                docs[(doc.get("kind"), dig(doc, "metadata", "name"))] = (fname, doc)
        except yaml.YAMLError as e:
            err(fname, f"invalid YAML: {e}")
    if errors:
        return

    def get(kind, name):
        entry = docs.get((kind, name))
        if entry is None:
            err("k8s", f"no {kind} named {name}")
            return None, {}
        return entry

    # Deployment
    dfile, dep = get("Deployment", "tally")
    pod = dig(dep, "spec", "template", "spec", default={})
    pod_labels = dig(dep, "spec", "template", "metadata", "labels", default={})
    selector = dig(dep, "spec", "selector", "matchLabels", default={})
    if not selector or any(pod_labels.get(k) != v for k, v in selector.items()):
        err(dfile, "spec.selector.matchLabels must match the pod template labels")
    if dig(dep, "spec", "replicas") != 3:
        err(dfile, "spec.replicas must be 3")
    containers = pod.get("containers") or []
    if len(containers) != 1:
        err(dfile, "expected exactly one container")
    c = containers[0] if containers else {}
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    if 8080 not in ports.values():
        err(dfile, "container must expose port 8080")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        if dig(c, probe, "httpGet", "path") != path:
            err(dfile, f"{probe} must GET {path}")
    env_from = c.get("envFrom", [])
    cm_refs = [dig(e, "configMapRef", "name") for e in env_from if "configMapRef" in e]
    secret_refs = [dig(e, "secretRef", "name") for e in env_from if "secretRef" in e]
    if cm_refs != ["tally-config"] or secret_refs != ["tally-celeriant"]:
        err(dfile, "envFrom must load ConfigMap tally-config and Secret tally-celeriant")
    for e in c.get("env", []) or []:
        if e.get("name") == "TALLY_CLIENT_ID":
            err(dfile, "TALLY_CLIENT_ID must come from the ConfigMap, one value for the whole Deployment, never per pod")
    pre_stop = dig(c, "lifecycle", "preStop", default={})
    sleep_s = dig(pre_stop, "sleep", "seconds")
    if sleep_s is None:
        cmd = " ".join(dig(pre_stop, "exec", "command", default=[]) or [])
        m = re.search(r"sleep\s+(\d+)", cmd)
        sleep_s = int(m.group(1)) if m else None
    if sleep_s is None or not 1 <= sleep_s <= 15:
        err(dfile, "preStop must sleep a few seconds so endpoint removal propagates before SIGTERM")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if sleep_s is not None and grace <= sleep_s + DRAIN_DEADLINE_S:
        err(dfile, f"terminationGracePeriodSeconds ({grace}) must exceed preStop sleep ({sleep_s}) + drain deadline ({DRAIN_DEADLINE_S})")
    for kind in ("requests", "limits"):
        for res in ("cpu", "memory"):
            if not dig(c, "resources", kind, res):
                err(dfile, f"resources.{kind}.{res} is required")
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")):
        err(dfile, "must run as non-root")
    if csc.get("readOnlyRootFilesystem") is not True:
        err(dfile, "container needs readOnlyRootFilesystem: true")
    if csc.get("allowPrivilegeEscalation") is not False:
        err(dfile, "container needs allowPrivilegeEscalation: false")
    if "ALL" not in (dig(csc, "capabilities", "drop", default=[]) or []):
        err(dfile, "container must drop ALL capabilities")
    if not dig(pod, "affinity", "podAntiAffinity"):
        err(dfile, "pod anti-affinity is required")
    tls_volumes = {v["name"]: dig(v, "secret", "secretName") for v in pod.get("volumes", []) if "secret" in v}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    tls_mount = next((mounts[n] for n, s in tls_volumes.items() if s == "tally-celeriant-tls" and n in mounts), None)
    if not tls_mount:
        err(dfile, "Secret tally-celeriant-tls must be mounted as files")

    # ConfigMap
    cfile, cm = get("ConfigMap", "tally-config")
    data = cm.get("data", {}) or {}
    for k, v in data.items():
        if not isinstance(v, str):
            err(cfile, f"{k} must be a string")
    if not UUID_RE.match(str(data.get("TALLY_CLIENT_ID", ""))):
        err(cfile, "TALLY_CLIENT_ID must be one fixed lower-case UUID")
    if data.get("TALLY_LISTEN") != "0.0.0.0:8080":
        err(cfile, "TALLY_LISTEN must be 0.0.0.0:8080 in a pod")
    for key in ("CELERIANT_ADDRESS", "TALLY_IDEMPOTENCY_WINDOW", "TALLY_ORG_ID", "TALLY_ACCOUNT_TYPE_ID",
                "TALLY_MAX_RESIDENT_ACCOUNTS", "TALLY_MAX_CONCURRENT_REQUESTS"):
        if not data.get(key):
            err(cfile, f"{key} is required")
    for key in ("TALLY_CELERIANT_TLS_CA", "TALLY_CELERIANT_TLS_CERT", "TALLY_CELERIANT_TLS_KEY"):
        if tls_mount and not str(data.get(key, "")).startswith(tls_mount.rstrip("/") + "/"):
            err(cfile, f"{key} must point into the TLS mount {tls_mount}")
    if any(k in data for k in ("CELERIANT_API_KEY",)):
        err(cfile, "CELERIANT_API_KEY is a secret: keep it in the Secret, not the ConfigMap")

    # Secrets: placeholders only
    for (kind, name), (fname, doc) in docs.items():
        if kind == "Secret":
            if not fname.endswith(".example.yaml"):
                err(fname, "Secrets belong in *.example.yaml files with placeholder values")
            values = list((doc.get("stringData") or {}).values()) + list((doc.get("data") or {}).values())
            for v in values:
                if "REPLACE_ME" not in str(v):
                    err(fname, f"Secret {name} holds a value that is not a REPLACE_ME placeholder")

    # Service
    sfile, svc = get("Service", "tally")
    ssel = dig(svc, "spec", "selector", default={})
    if not ssel or any(pod_labels.get(k) != v for k, v in ssel.items()):
        err(sfile, "selector must match the Deployment's pod labels")
    svc_ports = {p.get("name"): p for p in dig(svc, "spec", "ports", default=[])}
    for p in svc_ports.values():
        tp = p.get("targetPort")
        if tp not in ports and tp not in ports.values():
            err(sfile, f"targetPort {tp!r} is not a container port")

    # HPA
    hfile, hpa = get("HorizontalPodAutoscaler", "tally")
    if hpa.get("apiVersion") != "autoscaling/v2":
        err(hfile, "must be autoscaling/v2")
    target = dig(hpa, "spec", "scaleTargetRef", default={})
    if target.get("kind") != "Deployment" or target.get("name") != "tally":
        err(hfile, "must scale Deployment tally")
    if not any(dig(m, "resource", "name") == "cpu" for m in dig(hpa, "spec", "metrics", default=[])):
        err(hfile, "must scale on CPU")
    if (dig(hpa, "spec", "minReplicas") or 1) < 2:
        err(hfile, "minReplicas must be at least 2")

    # PDB
    pfile, pdb = get("PodDisruptionBudget", "tally")
    if pdb.get("apiVersion") != "policy/v1":
        err(pfile, "must be policy/v1")
    psel = dig(pdb, "spec", "selector", "matchLabels", default={})
    if not psel or any(pod_labels.get(k) != v for k, v in psel.items()):
        err(pfile, "selector must match the Deployment's pod labels")

    # Ingress + the controller map that defines its hash variable
    ifile, ing = get("Ingress", "tally")
    hash_by = dig(ing, "metadata", "annotations", "nginx.ingress.kubernetes.io/upstream-hash-by")
    if hash_by != "$tally_account":
        err(ifile, "upstream-hash-by must be $tally_account")
    next_up = dig(ing, "metadata", "annotations", "nginx.ingress.kubernetes.io/proxy-next-upstream", default="")
    if "non_idempotent" in next_up:
        err(ifile, "proxy-next-upstream must not include non_idempotent (POSTs would be re-sent)")
    for rule in dig(ing, "spec", "rules", default=[]):
        for path in dig(rule, "http", "paths", default=[]):
            backend = dig(path, "backend", "service", default={})
            if backend.get("name") != "tally" or dig(backend, "port", "name") not in svc_ports:
                err(ifile, "backend must be Service tally on a named Service port")
    _, hash_map = get("ConfigMap", "ingress-nginx-controller")
    snippet = dig(hash_map, "data", "http-snippet", default="")
    ingress_map = map_regex(snippet)
    if not ingress_map:
        err("ingress-nginx-hash-map.example.yaml", "http-snippet must define map $uri $tally_account")
    with open(NGINX_CONF) as f:
        local_map = map_regex(f.read())
    if ingress_map and ingress_map != local_map:
        err("ingress-nginx-hash-map.example.yaml", "its map differs from the one in deploy/nginx/tally.conf; keep them identical")

    # kustomization
    kpath = os.path.join(directory, "kustomization.yaml")
    kust = load_all(kpath)[0]
    listed = kust.get("resources", [])
    for r in listed:
        if not os.path.exists(os.path.join(directory, r)):
            err("kustomization.yaml", f"lists missing resource {r}")
    for fname in files:
        if fname != "kustomization.yaml" and not fname.endswith(".example.yaml") and fname not in listed:
            err("kustomization.yaml", f"does not list {fname}")
        if fname.endswith(".example.yaml") and fname in listed:
            err("kustomization.yaml", f"must not apply the example {fname}")


def map_regex(text):
    """The body of `map $uri $tally_account { ... }`, whitespace-normalised."""
    m = re.search(r"map\s+\$uri\s+\$tally_account\s*\{(.*?)\}\s*$", text, re.S | re.M)
    if not m:
        return None
    body = re.sub(r"#[^\n]*", "", m.group(1))
    return " ".join(body.split())


# --- metrics --------------------------------------------------------------------------------

def parse_metrics_rs():
    """{name: {"type": ..., "labels": [...], "help": ...}} and the set of `arm` values."""
    src = open(METRICS_RS).read()
    metrics = {}
    for m in re.finditer(r"\b(counter_vec|counter|gauge_vec|gauge|histogram_vec|histogram)\(\s*r,\s*", src):
        i, depth = m.end(), 1
        while depth and i < len(src):  # the call's argument text, to its closing paren
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        args = src[m.end():i - 1]
        strings = re.findall(r'"((?:[^"\\]|\\.)*)"', args.split("&[")[0])
        if len(strings) < 2:
            continue
        name, help_text = strings[0], " ".join(strings[1:])
        labels = []
        if m.group(1).endswith("_vec"):
            lm = re.search(r"&\[([^\]]*)\]", args)
            labels = re.findall(r'"([^"]+)"', lm.group(1)) if lm else []
        metrics[name] = {"type": m.group(1).replace("_vec", ""), "labels": labels, "help": help_text}
    arm_block = re.search(r"pub mod arm \{(.*?)\n\}", src, re.S)
    arms = set(re.findall(r'pub const [A-Z_]+: &str = "([a-z_]+)";', arm_block.group(1))) if arm_block else set()
    return metrics, arms


def exposed_series(metrics):
    """Series name as scraped -> base metric name."""
    out = {}
    for name, info in metrics.items():
        if info["type"] == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[name + suffix] = name
        else:
            out[name] = name
    return out


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def check_expr(where, expr, metrics, arms, used):
    series = exposed_series(metrics)
    names = set(re.findall(r"\btally_[a-z0-9_]+\b", expr))
    if not names and "vector(" not in expr:
        err(where, f"queries no tally metric: {expr}")
    bases = set()
    for n in names:
        if n not in series:
            hint = " (a histogram: query _bucket, _sum or _count)" if n in metrics else ""
            err(where, f"unknown metric {n}{hint}")
            continue
        bases.add(series[n])
        used.add(series[n])
    # selectors attached to a metric name
    for n, body in re.findall(r"\b(tally_[a-z0-9_]+)\{([^}]*)\}", expr):
        if n not in series:
            continue
        base = series[n]
        allowed = set(metrics[base]["labels"]) | {"job", "instance"} | ({"le"} if n.endswith("_bucket") else set())
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
            if label not in allowed:
                err(where, f"{n} has no label {label!r} (labels: {sorted(allowed)})")
            if label == "arm" and not value.startswith("$"):
                for v in value.split("|"):
                    if v not in arms:
                        err(where, f"arm {v!r} is not a write-loop arm in src/metrics.rs ({sorted(arms)})")
            if label == "reason":
                documented = re.search(r"\(([a-z_, ]+)\)", metrics[base]["help"])
                known = {x.strip() for x in documented.group(1).split(",")} if documented else set()
                for v in value.split("|"):
                    if known and v not in known:
                        err(where, f"reason {v!r} is not one of {sorted(known)}")
            if label == "status_class" and not re.fullmatch(r"[1-5]xx", value):
                err(where, f"status_class {value!r} is not a class like 2xx")
    # grouping labels
    all_labels = {"job", "instance", "le"}
    for b in bases:
        all_labels |= set(metrics[b]["labels"])
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in [x.strip() for x in group.split(",") if x.strip()]:
            if label not in all_labels:
                err(where, f"groups by {label!r}, which none of its metrics has")


def dashboard_targets(dash):
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))
    for p in walk(dash.get("panels", [])):
        for tgt in p.get("targets", []):
            yield p.get("title", "?"), tgt


def check_metrics():
    metrics, arms = parse_metrics_rs()
    if len(metrics) < 10 or not arms:
        err("src/metrics.rs", f"could not parse the metric definitions (found {len(metrics)} metrics, {len(arms)} arms)")
        return
    print(f"  src/metrics.rs: {len(metrics)} metrics, {len(arms)} write-loop arms")

    # dashboard
    try:
        with open(DASHBOARD) as f:
            dash = json.load(f)
    except ValueError as e:
        err("tally-dashboard.json", f"invalid JSON: {e}")
        return
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dash:
            err("tally-dashboard.json", f"missing {key}")
    ids = [p.get("id") for p in dash.get("panels", [])]
    if len(ids) != len(set(ids)):
        err("tally-dashboard.json", "panel ids are not unique")
    used_dash = set()
    n = 0
    for title, tgt in dashboard_targets(dash):
        n += 1
        check_expr(f"dashboard panel {title!r}", tgt.get("expr", ""), metrics, arms, used_dash)
    missing = sorted(set(metrics) - used_dash)
    if missing:
        err("tally-dashboard.json", f"metrics not shown anywhere: {missing}")
    print(f"  dashboard: {n} queries over {len(used_dash)} of {len(metrics)} metrics")

    # alerts
    used_alerts = set()
    doc = load_all(ALERTS)[0]
    rules = [r for g in doc.get("groups", []) for r in g.get("rules", [])]
    for r in rules:
        check_expr(f"alert {r.get('alert')}", str(r.get("expr", "")), metrics, arms, used_alerts)
        if not dig(r, "annotations", "runbook"):
            err(f"alert {r.get('alert')}", "needs a runbook annotation")
        elif "\n" in dig(r, "annotations", "runbook").strip():
            err(f"alert {r.get('alert')}", "runbook must be one line")
    print(f"  alerts: {len(rules)} rules over {len(used_alerts)} metrics")

    # the resident-account cap, stated three times
    cm = next(d for d in load_all(os.path.join(K8S, "configmap.yaml")) if d.get("kind") == "ConfigMap")
    cap = str(dig(cm, "data", "TALLY_MAX_RESIDENT_ACCOUNTS"))
    rule = next((r for r in rules if r.get("alert") == "TallyResidentAccountsNearCap"), None)
    m = re.search(r">\s*0\.\d+\s*\*\s*(\d+)", str(rule.get("expr"))) if rule else None
    if not m or m.group(1) != cap:
        err("tally-alerts.yaml", f"TallyResidentAccountsNearCap must use the ConfigMap's cap {cap}")
    var = next((v for v in dig(dash, "templating", "list", default=[]) if v.get("name") == "resident_cap"), {})
    if str(var.get("query")) != cap:
        err("tally-dashboard.json", f"variable resident_cap must default to the ConfigMap's cap {cap}")
    if not errors:
        print(f"  resident-account cap {cap}: ConfigMap, alert and dashboard agree")


def dashboard_rules(out):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    subst = {"$__rate_interval": "5m", "$__range": "1h", "$resident_cap": "100000", "$job": ".*", "$instance": ".*"}
    rules = []
    for n, (_, tgt) in enumerate(dashboard_targets(dash)):
        expr = tgt["expr"]
        for k in sorted(subst, key=len, reverse=True):
            expr = expr.replace(k, subst[k])
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    with open(out, "w") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}, f, sort_keys=False)
    print(f"  wrote {len(rules)} dashboard queries to {out}")


def rules_structure(path):
    doc = load_all(path)[0]
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not groups:
        err(path, "no groups")
        return
    for g in groups:
        if not g.get("name") or not g.get("rules"):
            err(path, "every group needs a name and rules")
        for r in g.get("rules", []):
            if not (r.get("alert") or r.get("record")) or not r.get("expr"):
                err(path, f"rule needs alert/record and expr: {r}")
            if r.get("alert") and not dig(r, "labels", "severity"):
                err(path, f"alert {r['alert']} needs a severity label")


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "k8s":
        check_k8s(args[0] if args else K8S)
        return finish("k8s structure")
    if cmd == "metrics":
        check_metrics()
        return finish("metrics")
    if cmd == "dashboard-rules":
        dashboard_rules(args[0])
        return 0
    if cmd == "rules-structure":
        rules_structure(args[0])
        return finish("rules structure")
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
