# shellcheck shell=bash
# Helpers shared by deploy/fleet.sh and deploy/check.sh. Sourced, never run.

# The repository root and deploy/, whatever the caller's working directory.
DEPLOY_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
REPO_DIR=$(cd -- "$DEPLOY_DIR/.." && pwd)
export DEPLOY_DIR REPO_DIR

say() { printf '%s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() {
    local code=$1
    shift
    printf 'error: %s\n' "$*" >&2
    exit "$code"
}

# Finds a program on PATH or in the sbin directories that a non-root PATH often lacks.
find_program() {
    local name=$1 dir
    if command -v "$name" >/dev/null 2>&1; then
        command -v "$name"
        return 0
    fi
    for dir in /usr/sbin /sbin /usr/local/sbin; do
        if [[ -x "$dir/$name" ]]; then
            printf '%s\n' "$dir/$name"
            return 0
        fi
    done
    return 1
}

APT_UPDATED=0
# apt_install PKG [PKG...]: installs the first package of the list that installs, from
# Debian's packages. Needs root and apt-get; runs `apt-get update` once per process.
apt_install() {
    local pkg
    if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        warn "cannot install $* here (needs root and apt-get)"
        return 1
    fi
    if [[ $APT_UPDATED -eq 0 ]]; then
        say "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || return 1
        APT_UPDATED=1
    fi
    for pkg in "$@"; do
        say "apt-get install $pkg"
        if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null; then
            return 0
        fi
    done
    return 1
}

# ensure_program NAME PKG [PKG...]: prints the path of NAME, installing it from Debian's
# packages first when it is missing.
ensure_program() {
    local name=$1 path
    shift
    if path=$(find_program "$name"); then
        printf '%s\n' "$path"
        return 0
    fi
    apt_install "$@" >&2 || return 1
    find_program "$name"
}

# nginx: Debian's nginx-light where it exists (bookworm), else nginx (trixie dropped the
# flavours). On a machine that runs systemd, installing the package also starts the system
# nginx on port 80; neither script uses or stops that one.
ensure_nginx() {
    ensure_program nginx nginx-light nginx
}

# Whether something accepts TCP connections on HOST:PORT.
port_open() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# http_status HOST PORT PATH: prints the status code of a GET, or nothing. Bash-only, so
# neither script needs curl.
http_status() {
    local host=$1 port=$2 path=$3
    (
        exec 3<>"/dev/tcp/$host/$port" || exit 1
        printf 'GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$path" "$host" >&3
        local line="" proto code
        IFS= read -r -t 3 line <&3 || true
        read -r proto code _ <<<"${line%$'\r'}"
        [[ $proto == HTTP/* ]] && printf '%s\n' "$code"
    ) 2>/dev/null || true
}

# render_nginx TEMPLATE OUT LISTEN BASE_PORT COUNT: writes the nginx config for COUNT
# replicas on 127.0.0.1:BASE_PORT.. listening on LISTEN, by rewriting the lines between the
# template's `fleet:` markers. Fails if the template lacks them.
render_nginx() {
    local template=$1 out=$2 listen=$3 base=$4 count=$5 i servers="" params
    local markers
    markers=$(grep -cE '# fleet:(upstreams|listen):(begin|end)$' "$template" || true)
    [[ $markers -eq 4 ]] || {
        warn "$template: expected the 4 fleet: marker lines, found $markers"
        return 1
    }
    # The parameters (max_fails=...) of the template's first server line apply to all.
    params=$(awk '/# fleet:upstreams:begin$/ { on = 1; next }
                  on && $1 == "server" { sub(/;$/, ""); $1 = ""; $2 = ""; sub(/^ +/, ""); print; exit }' "$template")
    for ((i = 0; i < count; i++)); do
        servers+="        server 127.0.0.1:$((base + i))${params:+ $params};"$'\n'
    done
    FLEET_SERVERS=$servers FLEET_LISTEN_LINE="        listen $listen;" awk '
        /# fleet:upstreams:begin$/ { print; printf "%s", ENVIRON["FLEET_SERVERS"]; skip = 1; next }
        /# fleet:listen:begin$/    { print; print ENVIRON["FLEET_LISTEN_LINE"]; skip = 1; next }
        /# fleet:(upstreams|listen):end$/ { skip = 0 }
        !skip { print }
    ' "$template" >"$out"
}

# Loopback only: 127.0.0.0/8, [::1] or localhost, with a port.
is_loopback_listen() {
    [[ $1 =~ ^(127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|localhost|\[::1\]):[0-9]{1,5}$ ]]
}
