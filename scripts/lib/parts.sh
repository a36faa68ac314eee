# shellcheck shell=bash
# Helpers for the scripts that start real parts (servers, databases) around a command and stop
# them after it, however it ends. Sourced, never run.

# How long a part may take to accept its first connection.
readonly PART_READY_TIMEOUT_SECS=30

# A free TCP port on loopback (the kernel's choice, so two callers rarely collide).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Every process a script started with `spawned`, killed and reaped by `stop_spawned`.
SPAWNED=()
spawned() { SPAWNED+=("$1"); }

# shellcheck disable=SC2317 # called from EXIT traps
stop_spawned() {
    local signal=${1:-KILL} pid
    for pid in "${SPAWNED[@]}"; do kill "-$signal" "$pid" 2>/dev/null || true; done
    for pid in "${SPAWNED[@]}"; do wait "$pid" 2>/dev/null || true; done
    SPAWNED=()
}

# need_executables WHO HINT PATH...: exits, naming the first PATH that is not an executable
# and how to get it (HINT), unless every PATH is one.
need_executables() {
    local who=$1 hint=$2 bin
    shift 2
    for bin in "$@"; do
        [ -x "$bin" ] || { echo "$who: $bin is missing ($hint)" >&2; exit 1; }
    done
}

# scratch_dir NAME: a new directory /tmp/NAME.XXXXXX in SCRATCH; when the script exits, every
# spawned part is killed and the directory removed.
scratch_dir() {
    SCRATCH=$(mktemp -d "/tmp/$1.XXXXXX")
    trap 'stop_spawned KILL; rm -rf "$SCRATCH"' EXIT
}

# wait_tcp NAME PORT PID LOG: until 127.0.0.1:PORT accepts a connection; fails with LOG when
# the process PID exits first or the part takes longer than PART_READY_TIMEOUT_SECS.
wait_tcp() {
    local name=$1 port=$2 pid=$3 log=$4 deadline=$((SECONDS + PART_READY_TIMEOUT_SECS))
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
            echo "$name did not start on 127.0.0.1:$port; its log:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
}

# celeriant_start SERVER DATA_DIR LOG ARGS...: a standalone Celeriant server on free loopback
# ports with its data in DATA_DIR; leaves its client port in STARTED_PORT and its pid in
# STARTED_PID (not printed: a command substitution's subshell would lose the pid).
celeriant_start() {
    local server=$1 data=$2 log=$3
    shift 3
    STARTED_PORT=$(free_port)
    mkdir -p "$data"
    CELERIANT_METRICS_ENABLED=false "$server" --standalone --data-root "$data" \
        --listen-address 127.0.0.1 --client-port "$STARTED_PORT" \
        --replication-port "$(free_port)" "$@" >"$log" 2>&1 &
    STARTED_PID=$!
    spawned "$STARTED_PID"
}

# run_command CMD...: runs CMD and exits with its status. A signal to this script stops CMD
# and ends the script through `exit`, so its EXIT trap still tears the parts down: CMD runs in
# the background and the script waits for it, because bash runs a trap only between commands
# and `wait` is one it can interrupt.
run_command() {
    local status
    "$@" &
    RUNNING_CHILD=$!
    trap 'kill -TERM "$RUNNING_CHILD" 2>/dev/null; exit 130' INT
    trap 'kill -TERM "$RUNNING_CHILD" 2>/dev/null; exit 143' TERM HUP
    set +e
    wait "$RUNNING_CHILD"
    status=$?
    set -e
    exit "$status"
}
