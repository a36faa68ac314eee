#!/usr/bin/env bash
# Runs a command with a throwaway Postgres cluster and TALLY_TEST_POSTGRES_URL pointing at it
# (issue 14): initdb in a temporary directory, a free port on 127.0.0.1, torn down after,
# whatever the command's outcome. Installs Debian's postgresql when it is missing (as root).
#
#   bash scripts/with-postgres.sh cargo test --locked
#
# initdb refuses to run as root, so as root the cluster belongs to the `postgres` user
# (created by the package), and the server runs as that user.
set -euo pipefail

find_bin() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
        [ -x "$d/initdb" ] && echo "$d"
    done | sort -V | tail -n 1
}

bin=$(find_bin)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "with-postgres: Postgres is not installed and this is not root: apt-get install postgresql" >&2
        exit 1
    fi
    echo "with-postgres: installing Debian's postgresql" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends postgresql >&2
    bin=$(find_bin)
fi

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null && return
    # No python: probe from a random start with bash's /dev/tcp.
    local p=$(( 20000 + RANDOM % 20000 ))
    while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
    echo "$p"
}

dir=$(mktemp -d /tmp/tally-pg.XXXXXX)
port=$(free_port)
owner=()
if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    chown postgres "$dir"
    owner=(runuser -u postgres --)
fi
# Runs a command as the cluster's owner, from the cluster's directory: the owner may not be
# able to enter the caller's (a checkout under /root), and runuser keeps it, so the tools
# would say "could not change directory ... Permission denied".
as_owner() {
    (cd "$dir" && "${owner[@]}" "$@")
}

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT
# A signal stops the command and ends the script through `exit`, so the EXIT trap tears the
# cluster down too. (The command runs in the background and the script waits for it: bash
# runs a trap only between commands, and `wait` is one it can interrupt.)
child=""
# shellcheck disable=SC2317 # called by the INT/TERM traps
stop_child() {
    if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; fi
}
trap 'stop_child; exit 130' INT
trap 'stop_child; exit 143' TERM HUP

as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync >"$dir/initdb.log" 2>&1 ||
    { cat "$dir/initdb.log" >&2; exit 1; }
# A test cluster: durability off (it is thrown away), enough connections for parallel tests.
# TALLY_PG_DURABLE=1 keeps Postgres's durable defaults (fsync, synchronous commit): for
# benchmarks, so a figure is what a real deployment pays.
durability="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
if [ "${TALLY_PG_DURABLE:-0}" = 1 ]; then
    durability=""
fi
as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 $durability -c max_connections=400" \
    start >/dev/null || { cat "$dir/server.log" >&2; exit 1; }

export TALLY_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$port/postgres"
echo "with-postgres: throwaway cluster on 127.0.0.1:$port" >&2
set +e
"$@" &
child=$!
wait "$child"
status=$?
set -e
exit "$status"
