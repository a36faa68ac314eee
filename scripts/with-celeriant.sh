#!/usr/bin/env bash
# Runs a command beside throwaway real Celeriant servers, and tells the suites where they are:
#
#   bash scripts/with-celeriant.sh cargo test --locked --test conformance
#
# - CELERIANT_ADDRESS: a standalone server routed by aggregate type (every account on one
#   shard, as Tally needs for transfers), the one every real-server suite uses;
# - CELERIANT_SHARDED_ADDRESS: a second one with two shards routed by aggregate id, for the
#   test that a write across shards is refused (9001);
# - CELERIANT_AUTH_ADDRESS: a third that requires clients to identify with an API key, with a
#   read-write key in CELERIANT_AUTH_RW_KEY and a read-only one in CELERIANT_AUTH_RO_KEY
#   (fresh keys each run; the server keeps only their SHA-256 in its data root's api_keys.toml);
# - CELERIANT_REFERENCE_BIN: the replaced service, for the mixed-fleet test.
#
# The binaries come from CELERIANT_BIN (the server; the replaced service is looked up beside
# it) or ../shared/celeriant/. Each server gets a free loopback port and a fresh data
# directory, and both are stopped and removed however the command ends.
#
# A CELERIANT_ADDRESS already set is used as it is: no server is started. Without a binary the
# command runs anyway and the real-server suites say they skipped, except under CI=true, where
# a missing binary is a failure (CI must never pass by skipping them).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
server=${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}
# How long a server may take to accept its first connection (it answers in about a second).
readonly READY_TIMEOUT_SECS=30

if [ -n "${CELERIANT_ADDRESS:-}" ]; then
    echo "with-celeriant: using the server at CELERIANT_ADDRESS=$CELERIANT_ADDRESS" >&2
    reference=${CELERIANT_REFERENCE_BIN:-$(dirname "$server")/celeriant-reference}
    if [ -x "$reference" ]; then export CELERIANT_REFERENCE_BIN=$reference; fi
    exec "$@"
fi

if [ ! -x "$server" ]; then
    how="set CELERIANT_BIN=/path/to/celeriant (the server binary), or CELERIANT_ADDRESS=HOST:PORT of a running server"
    if [ "${CI:-}" = true ]; then
        echo "with-celeriant: no Celeriant server binary at $server; CI=true requires the real-server suites: $how" >&2
        exit 1
    fi
    echo "with-celeriant: no Celeriant server binary at $server: the real-server suites will skip ($how)" >&2
    exec "$@"
fi
server=$(cd "$(dirname "$server")" && pwd)/$(basename "$server")
reference=${CELERIANT_REFERENCE_BIN:-$(dirname "$server")/celeriant-reference}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

work=$(mktemp -d /tmp/tally-celeriant.XXXXXX)
pids=()
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    local pid
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
child=""
# shellcheck disable=SC2317 # called by the INT/TERM traps
stop_child() {
    if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; fi
}
trap 'stop_child; exit 130' INT
trap 'stop_child; exit 143' TERM HUP

# start NAME ARGS...: a server on a free client port, left in $started_port and
# $started_pid (not printed: a command substitution's subshell would lose the pid).
start() {
    local name=$1 replication
    shift
    started_port=$(free_port)
    replication=$(free_port)
    mkdir -p "$work/$name"
    CELERIANT_METRICS_ENABLED=false "$server" --standalone --data-root "$work/$name" \
        --listen-address 127.0.0.1 --client-port "$started_port" --replication-port "$replication" \
        "$@" >"$work/$name.log" 2>&1 &
    started_pid=$!
    pids+=("$started_pid")
}

# ready NAME PORT PID: waits until the server accepts a connection, or fails with its log.
ready() {
    local name=$1 port=$2 pid=$3 deadline=$((SECONDS + READY_TIMEOUT_SECS))
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
            echo "with-celeriant: the $name server did not start on 127.0.0.1:$port; its log:" >&2
            cat "$work/$name.log" >&2
            exit 1
        fi
        sleep 0.1
    done
}

# api_keys NAME: fresh keys for server NAME; prints "RW_KEY RO_KEY" (base64, as clients send
# them) and writes the hashes the server checks into its data root.
api_keys() {
    mkdir -p "$work/$1"
    python3 - "$work/$1/api_keys.toml" <<'PY'
import base64, hashlib, os, sys
keys = {name: os.urandom(32) for name in ("primary_rw", "secondary_rw", "primary_ro", "secondary_ro")}
with open(sys.argv[1], "w") as f:
    f.write("[keys]\n")
    for name, key in keys.items():
        f.write(f'{name} = "{hashlib.sha256(key).hexdigest()}"\n')
print(base64.b64encode(keys["primary_rw"]).decode(), base64.b64encode(keys["primary_ro"]).decode())
PY
}

start main --routing-rule aggregate_type_id
main_port=$started_port main_pid=$started_pid
start sharded --routing-rule aggregate_id --num-shards 2
sharded_port=$started_port sharded_pid=$started_pid
read -r rw_key ro_key < <(api_keys auth)
start auth --routing-rule aggregate_type_id --require-client-identity --insecure-allow-plaintext-auth
auth_port=$started_port auth_pid=$started_pid
ready main "$main_port" "$main_pid"
ready sharded "$sharded_port" "$sharded_pid"
ready auth "$auth_port" "$auth_pid"

export CELERIANT_ADDRESS=127.0.0.1:$main_port
export CELERIANT_SHARDED_ADDRESS=127.0.0.1:$sharded_port
export CELERIANT_AUTH_ADDRESS=127.0.0.1:$auth_port CELERIANT_AUTH_RW_KEY=$rw_key CELERIANT_AUTH_RO_KEY=$ro_key
if [ -x "$reference" ]; then export CELERIANT_REFERENCE_BIN=$reference; fi
echo "with-celeriant: servers from $server at $CELERIANT_ADDRESS (one shard for accounts), $CELERIANT_SHARDED_ADDRESS (two shards) and $CELERIANT_AUTH_ADDRESS (API keys)" >&2
set +e
"$@" &
child=$!
wait "$child"
status=$?
set -e
exit "$status"
