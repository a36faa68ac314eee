#!/usr/bin/env bash
# Validates everything under deploy/ without a cluster, kubectl or Prometheus server:
#   shell     shellcheck on every script (deploy/, scripts/, .ci/run)
#   k8s       schema validation of every manifest (kubernetes-validate, offline schemas for
#             Kubernetes 1.30 and 1.37, strict: unknown fields fail), then structure and
#             cross-reference checks (probes on the admin port, drain budget, one client id,
#             selectors, the watch streams' Ingress timeouts, ...)
#   nginx     nginx -t on the committed config and on rendered fleet configs, its timeouts
#             against Tally's (upstream keep-alive, watch streams), then
#             behaviour tests on loopback with stub replicas: hashing by account id, no
#             re-sent POSTs, failover, and fleet.sh start/stop
#   grafana   the dashboard is valid JSON, matches its generator, and queries only
#             metrics, labels and arm values that src/metrics.rs defines
#   alerts    promtool check rules + promtool test rules; the dashboard's queries parsed
#             by promtool too
# Missing tools are installed from Debian's packages (shellcheck, nginx, prometheus for
# promtool) and PyPI (kubernetes-validate, into a venv under ~/.cache). Exits non-zero on
# any failure; the last line reads "N passed, N failed".
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib/common.sh"
cd "$REPO_DIR"

KUBERNETES_VALIDATE_VERSION=1.37.0
K8S_VERSIONS=(1.30.0 1.37.0)
CACHE_DIR=${TALLY_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tally-deploy-check}
VENV="$CACHE_DIR/venv-kv$KUBERNETES_VALIDATE_VERSION"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tally-check.XXXXXX")
chmod 755 "$WORK"
trap 'rm -rf -- "$WORK"' EXIT

PASSED=0
FAILED=0
FAILED_STEPS=()
VERSIONS=()
PY=python3 # replaced by the venv's python once it exists (it has PyYAML)

step() {
    local name=$1
    shift
    say ""
    say "== $name"
    if "$@"; then
        PASSED=$((PASSED + 1))
        say "-- passed: $name"
    else
        FAILED=$((FAILED + 1))
        FAILED_STEPS+=("$name")
        say "-- FAILED: $name"
    fi
}

# --- shell --------------------------------------------------------------------------------
check_shell() {
    local sc
    sc=$(ensure_program shellcheck shellcheck) || {
        warn "shellcheck unavailable"
        return 1
    }
    VERSIONS+=("shellcheck $("$sc" --version | awk '/^version:/ { print $2 }')")
    "$sc" -x deploy/*.sh deploy/lib/*.sh scripts/*.sh scripts/lib/*.sh .ci/run || return 1
    say "shellcheck: clean"
}

# --- k8s ----------------------------------------------------------------------------------
setup_venv() {
    [[ -x "$VENV/bin/kubernetes-validate" ]] && return 0
    say "installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION from PyPI into $VENV"
    mkdir -p "$CACHE_DIR"
    python3 -m venv "$VENV" &&
        "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
}

PYYAML_READY=0
ensure_pyyaml() {
    [[ $PYYAML_READY -eq 1 ]] && return 0
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import yaml' 2>/dev/null; then
        PY="$VENV/bin/python"
    elif ! python3 -c 'import yaml' 2>/dev/null; then
        apt_install python3-yaml >/dev/null || python3 -m pip install -q --user pyyaml || return 1
    fi
    VERSIONS+=("PyYAML $("$PY" -c 'import yaml; print(yaml.__version__)') ($("$PY" --version 2>&1))")
    PYYAML_READY=1
}

check_k8s_schema() {
    local manifests=() f v
    for f in deploy/k8s/*.yaml; do
        [[ $(basename "$f") == kustomization.yaml ]] || manifests+=("$f")
    done
    if ! setup_venv; then
        warn "kubernetes-validate could not be installed: FALLING BACK to YAML parsing and structure checks only (next step)"
        ensure_pyyaml || return 1
        "$PY" - "${manifests[@]}" <<'EOF' || return 1
import sys, yaml
for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc and not all(doc.get(k) for k in ("apiVersion", "kind", "metadata")):
            sys.exit(f"{path}: a document lacks apiVersion, kind or metadata")
print(f"parsed {len(sys.argv) - 1} manifests (fallback: no schema validation)")
EOF
        return 0
    fi
    VERSIONS+=("kubernetes-validate $("$VENV/bin/pip" show kubernetes-validate | awk '/^Version:/ { print $2 }') (offline schemas, strict)")
    for v in "${K8S_VERSIONS[@]}"; do
        say "kubernetes-validate --strict -k $v: ${#manifests[@]} files"
        "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "${manifests[@]}" || return 1
    done
    say "every manifest validates against the Kubernetes ${K8S_VERSIONS[*]} schemas"
}

check_k8s_structure() {
    ensure_pyyaml || return 1
    "$PY" deploy/tools/check_deploy.py k8s deploy/k8s
}

# --- nginx --------------------------------------------------------------------------------
check_nginx() {
    local nginx rendered out
    nginx=$(ensure_nginx) || {
        warn "nginx unavailable"
        return 1
    }
    VERSIONS+=("$("$nginx" -v 2>&1 | sed 's/^nginx version: //')")

    # The committed file is itself a complete config, and it is what fleet.sh renders with
    # its defaults (so the template and the script agree on ports and parameters).
    "$nginx" -t -q -p "$WORK/" -e stderr -c "$REPO_DIR/deploy/nginx/tally.conf" || return 1
    say "nginx -t: deploy/nginx/tally.conf"
    # Its timeouts against Tally's: upstream keep-alive below the replicas' idle close, the
    # watch streams unbuffered and open past their keep-alive interval.
    ensure_pyyaml || return 1
    "$PY" deploy/tools/check_deploy.py nginx deploy/nginx/tally.conf || return 1
    deploy/fleet.sh render "$WORK/default.conf" || return 1
    cmp -s "$WORK/default.conf" deploy/nginx/tally.conf || {
        warn "deploy/fleet.sh render with default settings differs from deploy/nginx/tally.conf"
        diff "$WORK/default.conf" deploy/nginx/tally.conf >&2 || true
        return 1
    }
    say "fleet.sh render (defaults) == deploy/nginx/tally.conf"
    for spec in "1 127.0.0.1:18080 18081" "16 [::1]:18080 18101" "5 localhost:18080 19001"; do
        read -r n listen base <<<"$spec"
        rendered="$WORK/fleet-$n.conf"
        FLEET_SIZE=$n FLEET_LISTEN=$listen FLEET_BASE_PORT=$base deploy/fleet.sh render "$rendered" || return 1
        [[ $(grep -c '^        server 127\.0\.0\.1:' "$rendered") -eq $n ]] || {
            warn "rendered config for $n replicas has the wrong number of server lines"
            return 1
        }
        if ! out=$("$nginx" -t -p "$WORK/" -e stderr -c "$rendered" 2>&1); then
            printf '%s\n' "$out" >&2
            return 1
        fi
        say "nginx -t: rendered for $n replicas, listen $listen"
    done

    python3 deploy/tools/lb_behaviour.py "$nginx"
}

# --- grafana --------------------------------------------------------------------------------
check_grafana() {
    ensure_pyyaml || return 1
    python3 -m json.tool deploy/grafana/tally-dashboard.json >/dev/null || return 1
    say "valid JSON: deploy/grafana/tally-dashboard.json"
    python3 deploy/grafana/gen_dashboard.py --stdout >"$WORK/dashboard.json" || return 1
    cmp -s "$WORK/dashboard.json" deploy/grafana/tally-dashboard.json || {
        warn "tally-dashboard.json is stale: run python3 deploy/grafana/gen_dashboard.py"
        return 1
    }
    say "tally-dashboard.json matches gen_dashboard.py"
    "$PY" deploy/tools/check_deploy.py metrics
}

# --- alerts ---------------------------------------------------------------------------------
check_alerts() {
    local promtool
    ensure_pyyaml || return 1
    if ! promtool=$(ensure_program promtool prometheus); then
        warn "promtool unavailable: FALLING BACK to a YAML structure check of the rules"
        "$PY" deploy/tools/check_deploy.py rules-structure deploy/prometheus/tally-alerts.yaml
        return
    fi
    VERSIONS+=("promtool $("$promtool" --version 2>&1 | awk 'NR == 1 { print $3 }')")
    "$promtool" check rules deploy/prometheus/tally-alerts.yaml || return 1
    "$promtool" test rules deploy/prometheus/tally-alerts.test.yaml || return 1
    # promtool has no "check this expression" command; a recording rule per query makes it
    # parse every dashboard query with the real PromQL parser.
    "$PY" deploy/tools/check_deploy.py dashboard-rules "$WORK/dashboard-queries.yaml" || return 1
    "$promtool" check rules "$WORK/dashboard-queries.yaml"
}

step "shellcheck" check_shell
step "k8s: schema (kubernetes-validate)" check_k8s_schema
step "k8s: structure and cross-references" check_k8s_structure
step "nginx: config test and load-balancer behaviour" check_nginx
step "grafana: dashboard against src/metrics.rs" check_grafana
step "prometheus: alert rules" check_alerts

say ""
say "tools:"
for v in "${VERSIONS[@]}"; do say "  $v"; done
if ((FAILED)); then
    say "failed steps:"
    for s in "${FAILED_STEPS[@]}"; do say "  $s"; done
fi
say "$PASSED passed, $FAILED failed"
((FAILED == 0))
