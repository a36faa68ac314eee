#!/usr/bin/env bash
# Runs a local Tally fleet: N replicas on 127.0.0.1 behind nginx, which hashes by account id.
#
#   CELERIANT_ADDRESS=127.0.0.1:10000 deploy/fleet.sh       run until Ctrl-C (or the time limit)
#   deploy/fleet.sh render OUT_FILE                          only write the nginx config
#
# Environment:
#   CELERIANT_ADDRESS    the store every replica shares (required, unless TALLY_STORE=memory)
#   TALLY_BIN            the tally binary (default target/release/tally)
#   TALLY_STORE          celeriant (default) or memory (each replica then has its OWN store)
#   TALLY_CLIENT_ID      one id for the whole fleet (default: unset, so every replica takes
#                        tally's own default, the id a replica started by hand takes too)
#   FLEET_SIZE           replicas, 1..16 (default 3)
#   FLEET_BASE_PORT      first replica port (default 8081; replica i listens on base+i)
#   FLEET_LISTEN         where nginx listens, loopback only (default 127.0.0.1:8080)
#   FLEET_MAX_SECONDS    stop by itself after this long, 0 = only on Ctrl-C (default 3600)
#   FLEET_KEEP_LOGS      1 = keep the work dir (logs, nginx config) after a clean stop
#   FLEET_MAX_RESTARTS   times each replica that exits is started again, 0..100 (default 5);
#                        past it the replica stays down and the others go on serving
#   TALLY_PROJECTION     memory (default) or postgres: every replica on one shared database,
#                        DATABASE_URL (or the TALLY_TEST_POSTGRES_URL that
#                        scripts/with-postgres.sh exports), e.g. a throwaway one:
#                        TALLY_PROJECTION=postgres scripts/with-postgres.sh deploy/fleet.sh
# Every other TALLY_* / CELERIANT_* / RUST_LOG variable reaches the replicas unchanged.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib/common.sh"

TEMPLATE="$DEPLOY_DIR/nginx/tally.conf"
FLEET_SIZE=${FLEET_SIZE:-3}
FLEET_BASE_PORT=${FLEET_BASE_PORT:-8081}
FLEET_LISTEN=${FLEET_LISTEN:-127.0.0.1:8080}
FLEET_MAX_SECONDS=${FLEET_MAX_SECONDS:-3600}
FLEET_KEEP_LOGS=${FLEET_KEEP_LOGS:-0}
FLEET_MAX_RESTARTS=${FLEET_MAX_RESTARTS:-5}
# Replicas drain within 10 s after SIGTERM; give them a little more before SIGKILL.
SHUTDOWN_SECONDS=15
STARTUP_SECONDS=30
# A replica that exits is started again after this many seconds, doubled for each restart it
# already had, at most RESTART_DELAY_MAX_SECONDS: a replica that cannot start (a bad flag,
# a store that refuses it) does not spin.
RESTART_DELAY_SECONDS=1
RESTART_DELAY_MAX_SECONDS=16

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

check_settings() {
    if ! [[ $FLEET_SIZE =~ ^[0-9]+$ ]] || ((FLEET_SIZE < 1 || FLEET_SIZE > 16)); then
        die 2 "FLEET_SIZE must be 1..16, got '$FLEET_SIZE'"
    fi
    if ! [[ $FLEET_BASE_PORT =~ ^[0-9]+$ ]] || ((FLEET_BASE_PORT < 1024 || FLEET_BASE_PORT + FLEET_SIZE - 1 > 65535)); then
        die 2 "FLEET_BASE_PORT must leave FLEET_SIZE ports in 1024..65535, got '$FLEET_BASE_PORT'"
    fi
    is_loopback_listen "$FLEET_LISTEN" ||
        die 2 "FLEET_LISTEN must be a loopback HOST:PORT (127.x.x.x, localhost or [::1]), got '$FLEET_LISTEN'"
    local lb_port=${FLEET_LISTEN##*:}
    if ((lb_port >= FLEET_BASE_PORT && lb_port < FLEET_BASE_PORT + FLEET_SIZE)); then
        die 2 "FLEET_LISTEN port $lb_port collides with the replica ports $FLEET_BASE_PORT..$((FLEET_BASE_PORT + FLEET_SIZE - 1))"
    fi
    [[ $FLEET_MAX_SECONDS =~ ^[0-9]+$ ]] || die 2 "FLEET_MAX_SECONDS must be a whole number of seconds"
    if ! [[ $FLEET_MAX_RESTARTS =~ ^[0-9]+$ ]] || ((FLEET_MAX_RESTARTS > 100)); then
        die 2 "FLEET_MAX_RESTARTS must be 0..100, got '$FLEET_MAX_RESTARTS'"
    fi
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
fi

if [[ ${1:-} == render ]]; then
    [[ $# -eq 2 ]] || die 2 "usage: deploy/fleet.sh render OUT_FILE"
    check_settings
    render_nginx "$TEMPLATE" "$2" "$FLEET_LISTEN" "$FLEET_BASE_PORT" "$FLEET_SIZE"
    exit 0
fi
[[ $# -eq 0 ]] || die 2 "unknown arguments: $* (see deploy/fleet.sh --help)"

check_settings

# --- the store -------------------------------------------------------------------------
TALLY_STORE=${TALLY_STORE:-celeriant}
case $TALLY_STORE in
celeriant)
    [[ -n ${CELERIANT_ADDRESS:-} ]] || die 2 "CELERIANT_ADDRESS is not set. The replicas must share one Celeriant store: set CELERIANT_ADDRESS=HOST:PORT (or TALLY_STORE=memory for a demo whose replicas do NOT share a store)."
    ;;
memory)
    cat >&2 <<'EOF'
######################################################################################
#  WARNING: TALLY_STORE=memory. Every replica gets its OWN in-memory store.           #
#  The replicas do NOT share a store: a write on one is invisible to the others, a    #
#  retry that lands on another replica writes again, and POST /api/transfers (spread  #
#  at random) scatters balances over unrelated stores. Fine for poking at the API,    #
#  meaningless for anything about correctness. Set CELERIANT_ADDRESS for a real fleet.#
######################################################################################
EOF
    ;;
*) die 2 "TALLY_STORE must be celeriant or memory, got '$TALLY_STORE'" ;;
esac

# --- the projection (issue 14) ---------------------------------------------------------------
TALLY_PROJECTION=${TALLY_PROJECTION:-memory}
case $TALLY_PROJECTION in
memory) ;;
postgres)
    DATABASE_URL=${DATABASE_URL:-${TALLY_TEST_POSTGRES_URL:-}}
    [[ -n $DATABASE_URL ]] || die 2 "TALLY_PROJECTION=postgres needs DATABASE_URL (one database every replica shares), or run under scripts/with-postgres.sh for a throwaway one"
    export DATABASE_URL
    ;;
*) die 2 "TALLY_PROJECTION must be memory or postgres, got '$TALLY_PROJECTION'" ;;
esac
export TALLY_PROJECTION

# One writer identity for the whole fleet, stable across runs: the replicas are one service.
# A fresh id per run (or per replica) would restart Celeriant's duplicate-sequence history.
# Unless TALLY_CLIENT_ID names one, it is tally's own default (defined in one place, in
# src/account), so a replica started by hand on the same store is the same writer, not a
# second one whose deposits the fleet shows as a foreign client's.
if [[ -n ${TALLY_CLIENT_ID:-} ]]; then
    export TALLY_CLIENT_ID
else
    unset TALLY_CLIENT_ID
fi

# nginx sends a request without a Host on as `Host: tally` (its server_name): the replicas
# serve their API under that name too, besides the local ones, unless told otherwise.
export TALLY_ALLOWED_HOSTS=${TALLY_ALLOWED_HOSTS:-tally}

TALLY_BIN=${TALLY_BIN:-target/release/tally}
if [[ $TALLY_BIN != /* && ! -e $TALLY_BIN && -e "$REPO_DIR/$TALLY_BIN" ]]; then
    TALLY_BIN="$REPO_DIR/$TALLY_BIN"
fi
[[ -x $TALLY_BIN ]] || die 2 "no tally binary at '$TALLY_BIN': build it (cargo build --release) or set TALLY_BIN"

lb_host=${FLEET_LISTEN%:*}
lb_port=${FLEET_LISTEN##*:}
for ((i = 0; i < FLEET_SIZE; i++)); do
    port_open 127.0.0.1 $((FLEET_BASE_PORT + i)) && die 2 "127.0.0.1:$((FLEET_BASE_PORT + i)) is already in use"
done
port_open "${lb_host//[\[\]]/}" "$lb_port" && die 2 "$FLEET_LISTEN is already in use"

NGINX=$(ensure_nginx) || die 2 "nginx is missing and could not be installed (Debian: apt-get install nginx-light)"
SETSID=$(command -v setsid || true)

# --- lifecycle ---------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tally-fleet.XXXXXX")
# nginx workers drop to an unprivileged user when started as root; they need to reach the
# temp dirs nginx creates here.
chmod 755 "$WORK"
REPLICA_PIDS=()
# Per replica: up, starting (restarted, not answering /healthz yet), waiting (to be
# restarted at its RESTART_AT), or gone (out of restarts).
REPLICA_STATES=()
RESTARTS=()
RESTART_AT=()
NGINX_PID=""
STOP=0
FAILED=0
CLEANED=0

# Starts a command in its own session (so a Ctrl-C in the terminal reaches only this script,
# which then stops everything in order) and records nothing else.
spawn() {
    if [[ -n $SETSID ]]; then
        "$SETSID" "$@" &
    else
        "$@" &
    fi
}

alive() { [[ -n $1 ]] && kill -0 "$1" 2>/dev/null; }

cleanup() {
    [[ $CLEANED -eq 1 ]] && return
    CLEANED=1
    trap - INT TERM
    say ""
    say "stopping the fleet"
    # nginx first (QUIT: finish in-flight requests), then the replicas (TERM: drain).
    if alive "$NGINX_PID"; then kill -QUIT "$NGINX_PID" 2>/dev/null || true; fi
    local pid deadline=$((SECONDS + SHUTDOWN_SECONDS))
    for pid in "${REPLICA_PIDS[@]}"; do
        if alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
    done
    while ((SECONDS < deadline)); do
        local left=0
        for pid in "$NGINX_PID" "${REPLICA_PIDS[@]}"; do
            if alive "$pid"; then left=1; fi
        done
        ((left)) || break
        sleep 0.2
    done
    for pid in "$NGINX_PID" "${REPLICA_PIDS[@]}"; do
        if alive "$pid"; then
            warn "pid $pid did not stop within ${SHUTDOWN_SECONDS}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            FAILED=1
        fi
    done
    wait 2>/dev/null || true
    if [[ $FAILED -eq 0 && $FLEET_KEEP_LOGS != 1 ]]; then
        rm -rf -- "$WORK"
    else
        say "logs and config kept in $WORK"
    fi
}
trap cleanup EXIT
trap 'STOP=1' INT TERM

# --- replicas ------------------------------------------------------------------------------
store_args=(--store "$TALLY_STORE")
if [[ $TALLY_STORE == celeriant ]]; then
    store_args+=(--celeriant-address "$CELERIANT_ADDRESS")
fi
# start_replica I: starts replica I on its port, appending to its log.
start_replica() {
    local i=$1 port=$((FLEET_BASE_PORT + $1))
    spawn "$TALLY_BIN" --listen "127.0.0.1:$port" "${store_args[@]}" >>"$WORK/replica-$port.log" 2>&1
    REPLICA_PIDS[i]=$!
}
for ((i = 0; i < FLEET_SIZE; i++)); do
    port=$((FLEET_BASE_PORT + i))
    start_replica "$i"
    REPLICA_STATES[i]=up
    RESTARTS[i]=0
    RESTART_AT[i]=0
    say "replica $i: pid ${REPLICA_PIDS[i]} on 127.0.0.1:$port (log $WORK/replica-$port.log)"
done

# Wait until every replica is alive (/healthz); report readiness (/readyz) without waiting
# for it, since a replica that cannot reach the store is alive but not ready.
deadline=$((SECONDS + STARTUP_SECONDS))
for ((i = 0; i < FLEET_SIZE; i++)); do
    port=$((FLEET_BASE_PORT + i))
    until [[ $(http_status 127.0.0.1 "$port" /healthz) == 200 ]]; do
        if ! alive "${REPLICA_PIDS[i]}"; then
            FAILED=1
            tail -n 20 "$WORK/replica-$port.log" >&2 || true
            die 1 "replica on port $port exited during startup"
        fi
        if ((SECONDS >= deadline || STOP)); then
            FAILED=1
            die 1 "replica on port $port did not answer /healthz within ${STARTUP_SECONDS}s"
        fi
        sleep 0.2
    done
    ready=$(http_status 127.0.0.1 "$port" /readyz)
    [[ $ready == 200 ]] || warn "replica on port $port is alive but not ready (/readyz: ${ready:-no answer}); is the store reachable?"
done

# --- nginx ---------------------------------------------------------------------------------
render_nginx "$TEMPLATE" "$WORK/nginx.conf" "$FLEET_LISTEN" "$FLEET_BASE_PORT" "$FLEET_SIZE" ||
    die 1 "could not render the nginx config"
"$NGINX" -t -q -p "$WORK/" -e "$WORK/error.log" -c "$WORK/nginx.conf" ||
    {
        FAILED=1
        die 1 "nginx -t rejected $WORK/nginx.conf"
    }
# `daemon off` keeps the nginx master as this script's child, so the trap can stop it.
spawn "$NGINX" -p "$WORK/" -e "$WORK/error.log" -c "$WORK/nginx.conf" -g 'daemon off;'
NGINX_PID=$!
deadline=$((SECONDS + 10))
until port_open "${lb_host//[\[\]]/}" "$lb_port"; do
    if ! alive "$NGINX_PID" || ((SECONDS >= deadline)); then
        FAILED=1
        tail -n 20 "$WORK/error.log" >&2 || true
        die 1 "nginx did not start on $FLEET_LISTEN"
    fi
    sleep 0.1
done

# The client id the replicas use, as the first one logged it (`tally listening`).
client_id=$(grep -oE 'client_id[=":]+[0-9a-f-]{36}' "$WORK/replica-$FLEET_BASE_PORT.log" 2>/dev/null |
    head -n 1 | grep -oE '[0-9a-f-]{36}$' || true)
if [[ $TALLY_STORE == celeriant ]]; then
    store_shown="celeriant at $CELERIANT_ADDRESS"
else
    store_shown="memory (one per replica, not shared)"
fi
client_shown=${client_id:-"the binary's default"}
[[ -z ${TALLY_CLIENT_ID:-} ]] || client_shown+=" (from TALLY_CLIENT_ID)"
projection_shown=$TALLY_PROJECTION
if [[ $TALLY_PROJECTION == postgres ]]; then
    # Where the database is, never its user or password.
    projection_shown="postgres at $(sed -E 's#^[a-z]+://([^@/]*@)?##; s#[?].*##' <<<"$DATABASE_URL")"
fi
# Where the accounts come from. On Celeriant the demo accounts are seeded only when asked (a
# durable store keeps what a demo writes), so GET /api/accounts lists none unless they are.
seeds_default=true
[[ $TALLY_STORE == memory ]] || seeds_default=false
accounts_shown="GET /api/accounts lists the demo accounts (Alice, Bob, Charlie)"
if [[ ${TALLY_SEED_DEMO_ACCOUNTS:-$seeds_default} != true ]]; then
    accounts_shown="none listed: the demo accounts are not seeded.
                     Seed them: stop, then TALLY_SEED_DEMO_ACCOUNTS=true make fleet.
                     Or open one: curl -XPOST http://$FLEET_LISTEN/api/accounts \\
                       -H 'content-type: application/json' -H 'Idempotency-Key: open-1' -d '{}'"
fi
# The work dir on a line of its own (tests/common/fleet_script.rs reads it from there).
if [[ $FLEET_KEEP_LOGS == 1 ]]; then
    logs_shown="$WORK
                     (kept after the fleet stops: FLEET_KEEP_LOGS=1)"
else
    logs_shown="$WORK
                     (deleted on a clean stop; FLEET_KEEP_LOGS=1 keeps them)"
fi
cat <<EOF

Tally fleet up: $FLEET_SIZE replicas, store=$store_shown, projection=$projection_shown
  client id          $client_shown
  send requests to   http://$FLEET_LISTEN/api/accounts
                     (the X-Tally-Upstream response header names the replica that answered)
  accounts           $accounts_shown
  metrics, per replica: $(for ((i = 0; i < FLEET_SIZE; i++)); do printf 'http://127.0.0.1:%s/metrics ' $((FLEET_BASE_PORT + i)); done)
  logs               $logs_shown
  a replica that exits is restarted, at most $FLEET_MAX_RESTARTS times (FLEET_MAX_RESTARTS);
  nginx sends its requests to the others meanwhile
Ctrl-C stops everything$( ((FLEET_MAX_SECONDS > 0)) && printf ' (or it stops by itself after %ss)' "$FLEET_MAX_SECONDS").
EOF

# How a process ended, from the status `wait` gave.
exit_shown() {
    if (($1 > 128)); then
        printf 'was killed by SIG%s' "$(kill -l $(($1 - 128)) 2>/dev/null || echo $(($1 - 128)))"
    else
        printf 'exited with status %s' "$1"
    fi
}

# replica_exited I STATUS: the replica is restarted after a pause, or, out of restarts,
# left down (the fleet stops only when no replica is left).
replica_exited() {
    local i=$1 status=$2 port=$((FLEET_BASE_PORT + $1)) how delay left=0 j
    how=$(exit_shown "$status")
    if ((RESTARTS[i] >= FLEET_MAX_RESTARTS)); then
        REPLICA_STATES[i]=gone
        FAILED=1
        warn "replica $i on port $port (pid ${REPLICA_PIDS[i]}) $how; it was restarted $FLEET_MAX_RESTARTS times (FLEET_MAX_RESTARTS), so it stays down; see $WORK/replica-$port.log"
        for ((j = 0; j < FLEET_SIZE; j++)); do
            [[ ${REPLICA_STATES[j]} == gone ]] || left=$((left + 1))
        done
        if ((left == 0)); then
            warn "no replica left"
            STOP=1
        else
            say "$left of $FLEET_SIZE replicas still serve behind nginx on $FLEET_LISTEN"
        fi
        return
    fi
    delay=$((RESTART_DELAY_SECONDS << RESTARTS[i]))
    ((delay <= RESTART_DELAY_MAX_SECONDS)) || delay=$RESTART_DELAY_MAX_SECONDS
    RESTARTS[i]=$((RESTARTS[i] + 1))
    REPLICA_STATES[i]=waiting
    RESTART_AT[i]=$((SECONDS + delay))
    warn "replica $i on port $port (pid ${REPLICA_PIDS[i]}) $how; the others keep serving behind nginx; restarting it in ${delay}s (restart ${RESTARTS[i]} of $FLEET_MAX_RESTARTS); see $WORK/replica-$port.log"
    if [[ $TALLY_STORE == memory ]]; then
        warn "TALLY_STORE=memory: replica $i's store was in its process, so it comes back empty"
    fi
}

# One look at every replica: reap the ones that exited, restart the ones due, and report
# each restarted one once it answers.
watch_replicas() {
    local i pid port status
    for ((i = 0; i < FLEET_SIZE; i++)); do
        pid=${REPLICA_PIDS[i]}
        port=$((FLEET_BASE_PORT + i))
        case ${REPLICA_STATES[i]} in
        up | starting)
            if ! alive "$pid"; then
                status=0
                wait "$pid" 2>/dev/null || status=$?
                replica_exited "$i" "$status"
            elif [[ ${REPLICA_STATES[i]} == starting && $(http_status 127.0.0.1 "$port" /healthz) == 200 ]]; then
                REPLICA_STATES[i]=up
                say "replica $i on 127.0.0.1:$port is back: pid $pid (restart ${RESTARTS[i]} of $FLEET_MAX_RESTARTS)"
            fi
            ;;
        waiting)
            if ((SECONDS >= RESTART_AT[i])); then
                printf -- '--- restart %s of %s\n' "${RESTARTS[i]}" "$FLEET_MAX_RESTARTS" >>"$WORK/replica-$port.log"
                start_replica "$i"
                REPLICA_STATES[i]=starting
                say "replica $i: pid ${REPLICA_PIDS[i]} on 127.0.0.1:$port (restarted, log $WORK/replica-$port.log)"
            fi
            ;;
        gone) ;;
        esac
    done
}

# --- run until told to stop, a process dies, or the time limit -----------------------------
started=$SECONDS
while ((!STOP)); do
    if ! alive "$NGINX_PID"; then
        warn "nginx exited; see $WORK/error.log"
        FAILED=1
        break
    fi
    watch_replicas
    ((STOP)) && break
    if ((FLEET_MAX_SECONDS > 0 && SECONDS - started >= FLEET_MAX_SECONDS)); then
        say "FLEET_MAX_SECONDS=$FLEET_MAX_SECONDS reached"
        break
    fi
    sleep 1 &
    # (quietly: bash would report a replica killed by a signal, which watch_replicas says)
    wait $! 2>/dev/null || true
done
cleanup
exit "$FAILED"
