#!/usr/bin/env bash
# Runs a command beside throwaway real Celeriant servers, and tells the suites where they are:
#
#   bash scripts/with-celeriant.sh cargo test --locked --test store
#
# - CELERIANT_ADDRESS: a standalone server routed by aggregate type (every account on one
#   shard, as Tally needs for transfers), the one every real-server suite uses;
# - CELERIANT_SHARDED_ADDRESS: a second one with two shards routed by aggregate id, for the
#   test that a write across shards is refused (9001);
# - CELERIANT_AUTH_ADDRESS: a third that requires clients to identify with an API key, with a
#   read-write key in CELERIANT_AUTH_RW_KEY and a read-only one in CELERIANT_AUTH_RO_KEY
#   (fresh keys each run; the server keeps only their SHA-256 in its data root's api_keys.toml);
# - CELERIANT_REFERENCE_BIN: the replaced service, for the mixed-fleet test;
# - CELERIANT_SERVER_BIN: the server binary itself, for a test that starts, kills and
#   restarts a server of its own (a store outage).
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
# shellcheck source-path=SCRIPTDIR source=lib/parts.sh
source "$root/scripts/lib/parts.sh"
server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
reference=${CELERIANT_REFERENCE_BIN:-$(dirname "$server")/celeriant-reference}

if [ -n "${CELERIANT_ADDRESS:-}" ]; then
    echo "with-celeriant: using the server at CELERIANT_ADDRESS=$CELERIANT_ADDRESS" >&2
    if [ -x "$reference" ]; then export CELERIANT_REFERENCE_BIN=$reference; fi
    if [ -x "$server" ]; then export CELERIANT_SERVER_BIN=$server; fi
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

work=$(mktemp -d /tmp/tally-celeriant.XXXXXX)
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    stop_spawned KILL
    rm -rf "$work"
}
trap cleanup EXIT

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

# start NAME ARGS...: one server named NAME; ready_all waits for every one started.
names=() ports=() pids=()
start() {
    local name=$1
    shift
    celeriant_start "$server" "$work/$name" "$work/$name.log" "$@"
    names+=("$name") ports+=("$STARTED_PORT") pids+=("$STARTED_PID")
}
ready_all() {
    local i
    for i in "${!names[@]}"; do
        wait_tcp "with-celeriant: the ${names[$i]} server" "${ports[$i]}" "${pids[$i]}" "$work/${names[$i]}.log"
    done
}

start main --routing-rule aggregate_type_id
start sharded --routing-rule aggregate_id --num-shards 2
read -r rw_key ro_key < <(api_keys auth)
start auth --routing-rule aggregate_type_id --require-client-identity --insecure-allow-plaintext-auth
ready_all

export CELERIANT_ADDRESS=127.0.0.1:${ports[0]}
export CELERIANT_SHARDED_ADDRESS=127.0.0.1:${ports[1]}
export CELERIANT_AUTH_ADDRESS=127.0.0.1:${ports[2]} CELERIANT_AUTH_RW_KEY=$rw_key CELERIANT_AUTH_RO_KEY=$ro_key
if [ -x "$reference" ]; then export CELERIANT_REFERENCE_BIN=$reference; fi
export CELERIANT_SERVER_BIN=$server
echo "with-celeriant: servers from $server at $CELERIANT_ADDRESS (one shard for accounts), $CELERIANT_SHARDED_ADDRESS (two shards) and $CELERIANT_AUTH_ADDRESS (API keys)" >&2
run_command "$@"
