#!/usr/bin/env python3
"""Static checks behind deploy/check.sh. Each subcommand prints one line per finding and
exits 1 if any finding is an error.

  k8s DIR               structure and cross-references of the manifests (duplicate keys,
                        required fields, probes on the admin port, drain budget, one client
                        id, selectors, kustomization coverage, placeholder-only secrets,
                        the watch streams' Ingress timeouts, the controller's upstream
                        keep-alive below Tally's idle close)
  nginx FILE            the nginx config against Tally's timeouts: upstream keepalive_timeout
                        below Tally's idle close, the watch streams' location unbuffered
                        with a read timeout of at least twice the keep-alive interval
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
HTTP_CONFIG_RS = os.path.join(REPO, "src", "http", "config.rs")
WATCH_CONFIG_RS = os.path.join(REPO, "src", "watch", "config.rs")

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DRAIN_DEADLINE_S = 10  # Tally's default drain deadline after SIGTERM
# The watch streams' read timeout at a proxy: at least this, and at least twice the
# keep-alive interval (a stream is silent between keep-alives).
SSE_READ_TIMEOUT_FLOOR_S = 60
# Sample URIs routed through the proxies' configs: the watch streams, and API routes that
# must not be taken for them.
SAMPLE_ID = "0b5c7f0e-2d8a-4a8e-9d5e-3c7f1a2b4c6d"
SSE_URIS = (f"/api/accounts/{SAMPLE_ID}/events", "/api/watch/stream")
API_URIS = (f"/api/accounts/{SAMPLE_ID}/balance", f"/api/accounts/{SAMPLE_ID}/deposit",
            f"/api/accounts/{SAMPLE_ID}/transfers", "/api/transfers", "/api/accounts")

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


# --- facts from Tally's source --------------------------------------------------------------

def source_const(path, pattern, what):
    where = os.path.relpath(path, REPO)
    try:
        with open(path) as f:
            m = re.search(pattern, f.read())
    except OSError as e:
        err(where, f"cannot read it for {what}: {e}")
        return None
    if not m:
        err(where, f"cannot find {what}; update deploy/tools/check_deploy.py")
        return None
    return int(m.group(1))


def tally_idle_close_s():
    """Seconds after which Tally closes a keep-alive connection that sent no full head."""
    return source_const(HTTP_CONFIG_RS, r"const HEADER_READ_TIMEOUT: Duration = Duration::from_secs\((\d+)\);",
                        "HEADER_READ_TIMEOUT (Tally's idle keep-alive close)")


def watch_keepalive_s():
    return source_const(WATCH_CONFIG_RS, r"pub const DEFAULT_KEEPALIVE_SECS: u64 = (\d+);",
                        "DEFAULT_KEEPALIVE_SECS (--watch-keepalive-secs)")


def sse_read_timeout_min(keepalive_s):
    return max(SSE_READ_TIMEOUT_FLOOR_S, 2 * keepalive_s)


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

    # The admin address: probes and scrapes on a listener outside --max-connections
    admin_port = check_admin_port(dfile, dep, c, ports, cfile, data)
    for p in svc_ports.values():
        tp = p.get("targetPort")
        if admin_port is not None and (tp == admin_port or ports.get(tp) == admin_port):
            err(sfile, f"Service port {p.get('name')!r} publishes the admin port {admin_port}: probes and /metrics stay per pod")

    # Ingresses (the API's and the watch streams') + the controller ConfigMap
    ingresses = {name: entry for (kind, name), entry in docs.items() if kind == "Ingress"}
    get("Ingress", "tally")
    for name, (ifile, ing) in sorted(ingresses.items()):
        ann = dig(ing, "metadata", "annotations", default={}) or {}
        if ann.get("nginx.ingress.kubernetes.io/upstream-hash-by") != "$tally_account":
            err(ifile, f"Ingress {name}: upstream-hash-by must be $tally_account (the Ingresses of one "
                       "Service port share one upstream, which takes its hash from whichever ingress-nginx reads first)")
        if "non_idempotent" in ann.get("nginx.ingress.kubernetes.io/proxy-next-upstream", ""):
            err(ifile, f"Ingress {name}: proxy-next-upstream must not include non_idempotent (POSTs would be re-sent)")
        for rule in dig(ing, "spec", "rules", default=[]):
            for path in dig(rule, "http", "paths", default=[]):
                backend = dig(path, "backend", "service", default={})
                if backend.get("name") != "tally" or dig(backend, "port", "name") not in svc_ports:
                    err(ifile, f"Ingress {name}: backend must be Service tally on a named Service port")
    idle = tally_idle_close_s()
    keepalive = watch_keepalive_s()
    if str(data.get("TALLY_WATCH_KEEPALIVE_SECS", "")).isdigit():
        keepalive = int(data["TALLY_WATCH_KEEPALIVE_SECS"])
    if keepalive is not None:
        check_ingress_routes(ingresses, sse_read_timeout_min(keepalive), keepalive)
    mfile, hash_map = get("ConfigMap", "ingress-nginx-controller")
    ukt = str(dig(hash_map, "data", "upstream-keepalive-timeout", default=""))
    if idle is not None:
        if not ukt.isdigit() or int(ukt) >= idle:
            err(mfile, f"upstream-keepalive-timeout is {ukt or 'unset (ingress-nginx: 60)'}; it must be whole "
                       f"seconds below Tally's {idle} s idle close (HEADER_READ_TIMEOUT), e.g. \"5\"")
        else:
            print(f"  {mfile}: upstream-keepalive-timeout {ukt} s < Tally's {idle} s idle close")
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


def check_admin_port(dfile, dep, c, ports, cfile, data):
    """TALLY_ADMIN_LISTEN is set, and the container port, every probe and the scrape
    annotation use it. Returns the admin port, or None."""
    admin = str(data.get("TALLY_ADMIN_LISTEN", ""))
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]*\]|[^:\[\]]+):(\d{1,5})", admin)
    before = len(errors)
    port = int(m.group(2)) if m else None
    if not admin:
        err(cfile, "TALLY_ADMIN_LISTEN must be set: at --max-connections the API address accepts "
                   "nothing, probes included, so probes and scrapes need the admin address")
    elif not m:
        err(cfile, f"TALLY_ADMIN_LISTEN {admin!r} is not HOST:PORT")
    else:
        if m.group(1) not in ("0.0.0.0", "[::]"):
            err(cfile, "TALLY_ADMIN_LISTEN must listen on all interfaces (0.0.0.0 or [::]): the kubelet probes the pod IP")
        if str(data.get("TALLY_LISTEN", "")).rsplit(":", 1)[-1] == str(port):
            err(cfile, "TALLY_ADMIN_LISTEN must use a port of its own, not TALLY_LISTEN's")
    names = [n for n, p in ports.items() if p == port] if port is not None else []
    if port is not None and (not names or not all(names)):
        err(dfile, f"the container must declare containerPort {port} (TALLY_ADMIN_LISTEN), named")
    # The probes and the scrape: on the admin port, and never on the API port even when the
    # admin address is missing.
    api_port = str(data.get("TALLY_LISTEN", "")).rsplit(":", 1)[-1]
    probes = [p for p in ("livenessProbe", "readinessProbe", "startupProbe") if p in c]
    for probe in probes:
        target = dig(c, probe, "httpGet", "port")
        resolved = ports.get(target) if isinstance(target, str) else target
        if (port is not None and resolved != port) or str(resolved) == api_port:
            err(dfile, f"{probe} uses port {target!r}, not the admin port ({port or 'TALLY_ADMIN_LISTEN unset'}): "
                       "at --max-connections the API port accepts nothing, probes included")
    ann = dig(dep, "spec", "template", "metadata", "annotations", default={}) or {}
    scrape_port = str(ann.get("prometheus.io/port"))
    if str(ann.get("prometheus.io/scrape", "")).lower() == "true" and (
            (port is not None and scrape_port != str(port)) or scrape_port == api_port):
        err(dfile, f"prometheus.io/port is {ann.get('prometheus.io/port')!r}, not the admin port "
                   f"({port or 'TALLY_ADMIN_LISTEN unset'}): the API port sits behind --max-connections, and with "
                   "an admin address it answers /metrics 404")
    if port is None:
        return None
    if len(errors) == before:
        users = probes + (["prometheus.io/port"] if "prometheus.io/port" in ann else [])
        print(f"  admin address {admin}: containerPort {names[0]!r}; {', '.join(users)} use it")
    return port


def ingress_route(ingresses, host, uri):
    """The (Ingress name, path) ingress-nginx routes host+uri to, or None. It merges every
    Ingress of a host into one server. If any of them sets use-regex (or rewrite-target),
    every path of the host becomes `location ~* "^PATH"` and the longer paths come first;
    otherwise an Exact path wins, then the longest matching prefix."""
    entries, regex = [], False
    for name, (_, ing) in sorted(ingresses.items()):
        ann = dig(ing, "metadata", "annotations", default={}) or {}
        for rule in dig(ing, "spec", "rules", default=[]):
            if rule.get("host") != host:
                continue
            if ann.get("nginx.ingress.kubernetes.io/use-regex") == "true" or ann.get("nginx.ingress.kubernetes.io/rewrite-target"):
                regex = True
            for p in dig(rule, "http", "paths", default=[]):
                entries.append((name, p.get("path", "/"), p.get("pathType", "ImplementationSpecific")))
    if regex:
        entries.sort(key=lambda e: e[1], reverse=True)  # ingress-nginx's order: path, then length
        entries.sort(key=lambda e: len(e[1]), reverse=True)
        for name, path, _ in entries:
            try:
                if re.match(path, uri, re.I):
                    return name, path
            except re.error:
                continue
        return None
    best = None
    for name, path, kind in entries:
        if kind == "Exact":
            if uri == path:
                return name, path
            continue
        base = path.rstrip("/") if kind == "Prefix" else path
        if kind == "Prefix":
            hit = uri == base or uri.startswith(base + "/")
        else:  # ImplementationSpecific without regex: an nginx prefix location
            hit = uri.startswith(path)
        if hit and (best is None or len(path) > len(best[1])):
            best = (name, path)
    return best


def stream_route_ok(where, route, settings, timeout, seconds, buffering, need, keepalive):
    """One watch-stream route's proxy settings (named `settings`: read timeout, buffering):
    open through the silence between keep-alives, and unbuffered. Each failure is reported;
    True when both hold."""
    ok = True
    if seconds is None or seconds < need:
        err(where, f"{route} with {settings[0]} {timeout or 'unset'}: a watch stream is silent for "
                   f"{keepalive} s between keep-alives (--watch-keepalive-secs), so it needs at least "
                   f"{need} s (twice that, 60 s at least)")
        ok = False
    if buffering != "off":
        err(where, f"{route} with {settings[1]} {buffering or 'unset'}: it must be off so each event "
                   "passes at once")
        ok = False
    return ok


def check_ingress_routes(ingresses, need, keepalive):
    """The watch streams reach an Ingress that keeps them open and unbuffered; the API routes
    do not land on it."""
    hosts = sorted({r.get("host") for _, ing in ingresses.values() for r in dig(ing, "spec", "rules", default=[])},
                   key=str)
    for host in hosts:
        stream_routes = set()
        for uri in SSE_URIS:
            hit = ingress_route(ingresses, host, uri)
            if hit is None:
                err("ingress.yaml", f"no Ingress routes {host}{uri}")
                continue
            fname, ing = ingresses[hit[0]]
            ann = dig(ing, "metadata", "annotations", default={}) or {}
            rt = str(ann.get("nginx.ingress.kubernetes.io/proxy-read-timeout", ""))
            buf = ann.get("nginx.ingress.kubernetes.io/proxy-buffering")
            route = f"{host}{uri} goes to Ingress {hit[0]} (path {hit[1]})"
            if stream_route_ok(fname, route, ("proxy-read-timeout", "proxy-buffering"), rt,
                               int(rt) if rt.isdigit() else None, buf, need, keepalive):
                stream_routes.add(hit)
                print(f"  {host}{uri} -> Ingress {hit[0]} (path {hit[1]}): proxy-read-timeout {rt} >= {need}, "
                      "proxy-buffering off")
        for uri in API_URIS:
            hit = ingress_route(ingresses, host, uri)
            if hit is None:
                err("ingress.yaml", f"no Ingress routes {host}{uri}")
            elif hit in stream_routes:
                err(ingresses[hit[0]][0], f"{host}{uri} is taken by the watch-stream path {hit[1]} (Ingress {hit[0]})")


def map_regex(text):
    """The body of `map $uri $tally_account { ... }`, whitespace-normalised."""
    m = re.search(r"map\s+\$uri\s+\$tally_account\s*\{(.*?)\}\s*$", text, re.S | re.M)
    if not m:
        return None
    body = re.sub(r"#[^\n]*", "", m.group(1))
    return " ".join(body.split())


# --- nginx --------------------------------------------------------------------------------

def nginx_parse(text):
    """An nginx config as [(directive, [args], children or None)]."""
    tokens, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif ch in "{};":
            tokens.append(ch)
            i += 1
        elif ch in "\"'":
            j, buf = i + 1, []
            while j < n and text[j] != ch:
                if text[j] == "\\" and j + 1 < n:
                    buf.append(text[j + 1] if text[j + 1] in "\"'\\" else text[j:j + 2])
                    j += 2
                else:
                    buf.append(text[j])
                    j += 1
            if j >= n:
                raise ValueError("unterminated quoted string")
            tokens.append(("word", "".join(buf)))
            i = j + 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in "{};":
                j += 1
            tokens.append(("word", text[i:j]))
            i = j

    def block(pos, depth):
        out, words = [], []
        while pos < len(tokens):
            t = tokens[pos]
            if t in (";", "{"):
                if not words:
                    raise ValueError(f"unexpected {t!r}")
                if t == ";":
                    out.append((words[0], words[1:], None))
                    pos += 1
                else:
                    kids, pos = block(pos + 1, depth + 1)
                    out.append((words[0], words[1:], kids))
                words = []
            elif t == "}":
                if depth == 0 or words:
                    raise ValueError("unbalanced '}'")
                return out, pos + 1
            else:
                words.append(t[1])
                pos += 1
        if depth or words:
            raise ValueError("unexpected end of file")
        return out, pos

    return block(0, 0)[0]


def nginx_directive(block, name):
    """The arguments of the last `name` directive directly in block, or None."""
    found = None
    for d, args, kids in block:
        if d == name and kids is None:
            found = args
    return found


def nginx_effective(name, default, *blocks):
    """A directive's value as nginx inherits it: the innermost block that sets it wins."""
    for b in blocks:
        args = nginx_directive(b, name)
        if args:
            return args[0]
    return default


def nginx_seconds(value):
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "M": 2592000, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|M|y)?", value)
    if not parts or "".join(a + b for a, b in parts) != value:
        return None
    return sum(int(a) * units[b or "s"] for a, b in parts)


def nginx_location(server, uri):
    """The top-level location of server that nginx picks for uri: (args, children) or None."""
    prefix, regexes = None, []
    for d, args, kids in server:
        if d != "location" or kids is None or not args or args[0].startswith("@"):
            continue
        if args[0] == "=" and len(args) == 2:
            if uri == args[1]:
                return args, kids
        elif args[0] in ("~", "~*") and len(args) == 2:
            regexes.append((args, kids, re.I if args[0] == "~*" else 0))
        else:
            path = args[-1]
            if uri.startswith(path) and (prefix is None or len(path) > len(prefix[0][-1])):
                prefix = (args, kids)
    if prefix and prefix[0][0] == "^~":
        return prefix
    for args, kids, flags in regexes:
        if re.search(args[1], uri, flags):
            return args, kids
    return prefix


def check_nginx(path):
    where = os.path.relpath(path, REPO) if os.path.abspath(path).startswith(REPO + os.sep) else path
    idle, keepalive = tally_idle_close_s(), watch_keepalive_s()
    if idle is None or keepalive is None:
        return
    try:
        with open(path) as f:
            conf = nginx_parse(f.read())
    except (OSError, ValueError) as e:
        err(where, f"cannot parse: {e}")
        return
    http = next((kids for d, _, kids in conf if d == "http" and kids is not None), None)
    if http is None:
        err(where, "no http block")
        return

    # Upstream keep-alive: nginx must close an idle connection before the replica does.
    upstreams = [(args[0], kids) for d, args, kids in http if d == "upstream" and kids is not None and args]
    if not upstreams:
        err(where, "no upstream block")
    for name, ups in upstreams:
        if nginx_directive(ups, "keepalive") is None:
            continue  # no connection reuse, so no idle connection either
        raw = nginx_effective("keepalive_timeout", "60s (the default)", ups)
        secs = nginx_seconds(raw.split()[0])
        if secs is None or secs >= idle:
            err(where, f"upstream {name}: keepalive_timeout {raw} must be below Tally's {idle} s idle close "
                       "(HEADER_READ_TIMEOUT in src/http/config.rs), so nginx, not the replica, closes an idle "
                       "connection (a replica closing one as nginx sends a POST on it is a 502)")
        else:
            print(f"  {where}: upstream {name}: keepalive_timeout {raw} < Tally's {idle} s idle close")

    # The watch streams: unbuffered, and open through the silence between keep-alives.
    need = sse_read_timeout_min(keepalive)
    servers = [kids for d, _, kids in http if d == "server" and kids is not None]
    if not servers:
        err(where, "no server block")
    for server in servers:
        stream_locations = set()
        for uri in SSE_URIS:
            loc = nginx_location(server, uri)
            if loc is None:
                err(where, f"no location serves {uri}")
                continue
            label = "location " + " ".join(loc[0])
            rt = nginx_effective("proxy_read_timeout", "60s", loc[1], server, http)
            buf = nginx_effective("proxy_buffering", "on", loc[1], server, http)
            if stream_route_ok(where, f"{uri} goes to `{label}`", ("proxy_read_timeout", "proxy_buffering"), rt,
                               nginx_seconds(rt), buf, need, keepalive):
                stream_locations.add(label)
                print(f"  {where}: {uri} -> `{label}`: proxy_read_timeout {rt} >= {need}s, proxy_buffering off")
        for uri in API_URIS:
            loc = nginx_location(server, uri)
            if loc is not None and "location " + " ".join(loc[0]) in stream_locations:
                err(where, f"{uri} is taken by the watch-stream location `location {' '.join(loc[0])}`")


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
    if cmd == "nginx":
        check_nginx(args[0] if args else NGINX_CONF)
        return finish("nginx timeouts")
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
