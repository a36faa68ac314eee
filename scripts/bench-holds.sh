#!/usr/bin/env bash
# Holds (BENCHMARKS.md, "Holds"): place-and-post pairs against deposits, deposits with holds
# on and off, and the sweeper's cost, in one sitting on the embedded store.
#
#   cargo build --release --locked --bin tally
#   bash scripts/bench-holds.sh                      # the embedded store
#   HOLDS_STORE=celeriant bash scripts/bench-holds.sh  # a fresh Celeriant server, shared
#
# Parts (HOLDS_PARTS, default "ceiling pairs onoff sweep"):
#   ceiling  the machine's limit for this load: the same wrk deposits against a server that
#            does nothing (examples/null_server.rs, built with
#            `cargo build --release --locked --example null_server`), HOLDS_RUNS runs.
#   pairs  one replica with --holds true; 1-cent deposits and place-and-post pairs, on one
#          hot account and spread over 1,000, HOLDS_RUNS rounds in that order.
#   onoff  spread and hot deposits on a fresh replica with --holds false, then true,
#          HOLDS_RUNS rounds.
#   sweep  HOLDS_SWEEP_HOLDS holds over HOLDS_SWEEP_ACCOUNTS accounts, all expiring
#          HOLDS_SWEEP_EXPIRES seconds after the fill began; then the time until every one
#          expired and the replica's CPU over it, nothing else running. Then the same holds
#          again, and deposits on 1,000 other accounts for HOLDS_SECONDS while they are open
#          but not due, and again from the moment they fall due (while it sweeps).
#          Sweeper flags: HOLDS_SWEEP_BUDGET (64), HOLDS_SWEEP_INTERVAL_MS (1000).
# On Celeriant, one fresh server (CELERIANT_BIN, or ../shared/celeriant/celeriant) serves
# every replica started; each run's accounts are fresh but for their fixed ids, so a later
# replica folds what earlier ones wrote to them.
# Every wrk run is two threads and HOLDS_CONNECTIONS connections. Each line printed is one
# figure: `<part> <what> key=value ...`; CPU is the replica's user and system time.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/parts.sh disable=SC1091 # followed under shellcheck -x
source "$root/scripts/lib/parts.sh"
tally=${TALLY_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/tally}
lua=$root/scripts/bench-holds.lua
read -r -a parts <<<"${HOLDS_PARTS:-ceiling pairs onoff sweep}"
runs=${HOLDS_RUNS:-3}
seconds=${HOLDS_SECONDS:-10}
connections=${HOLDS_CONNECTIONS:-64}
sweep_holds=${HOLDS_SWEEP_HOLDS:-100000}
sweep_accounts=${HOLDS_SWEEP_ACCOUNTS:-10000}
sweep_expires=${HOLDS_SWEEP_EXPIRES:-30}
sweep_budget=${HOLDS_SWEEP_BUDGET:-64}
sweep_interval=${HOLDS_SWEEP_INTERVAL_MS:-1000}
# The sweep's bound: at the default budget it takes holds/(10 x 64) seconds and more.
readonly SWEEP_TIMEOUT_SECS=900
readonly FILL_TIMEOUT_SECS=600
store_flags=()
# The first account id of the replica started last: each start takes fresh ids.
first_account=1

command -v wrk >/dev/null || { echo "bench-holds: wrk is not installed" >&2; exit 1; }
[ -x "$tally" ] || { echo "bench-holds: no $tally: cargo build --release --locked --bin tally" >&2; exit 1; }

work=$(mktemp -d /tmp/tally-bench-holds.XXXXXX)
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    stop_spawned KILL
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

if [ "${HOLDS_STORE:-embedded}" = celeriant ]; then
    server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
    celeriant_start "$server" "$work/celeriant" "$work/celeriant.log" --routing-rule aggregate_type_id
    wait_tcp celeriant "$STARTED_PORT" "$STARTED_PID" "$work/celeriant.log"
    store_flags=(--store celeriant --celeriant-address "127.0.0.1:$STARTED_PORT")
fi

# start ARGS...: a fresh replica; sets PORT and PID.
start() {
    PORT=$(free_port)
    first_account=$((first_account + 1000000))
    "$tally" --listen "127.0.0.1:$PORT" --seed-demo-accounts false "${store_flags[@]}" "$@" \
        >"$work/tally.log" 2>&1 &
    PID=$!
    spawned "$PID"
    wait_tcp tally "$PORT" "$PID" "$work/tally.log"
}

# stop: the replica stops (drains) and is forgotten; the store runs on.
stop() {
    local kept=() p
    kill -TERM "$PID"
    wait "$PID" 2>/dev/null || true
    for p in "${SPAWNED[@]}"; do [ "$p" = "$PID" ] || kept+=("$p"); done
    SPAWNED=("${kept[@]}")
}

ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }

# load SECONDS MODE ACCOUNTS [QUOTA] [EXPIRES] [FROM]: one wrk run over ACCOUNTS accounts
# from the replica's FROM-th (default 0); prints "rps=.. p50=.. p99=.. [pairs_per_s=..]
# cpu_us=.." (CPU a request). Fails on any non-2xx answer.
load() {
    local secs=$1 mode=$2 accounts=$3 quota=${4:-0} expires=${5:-0} from=${6:-0} t0 t1 out requests
    t0=$(ticks)
    out=$(wrk -t2 -c"$connections" -d"${secs}s" --timeout 10s --latency -s "$lua" \
        "http://127.0.0.1:$PORT" -- "$mode" "$accounts" "$quota" "$expires" "$((first_account + from))")
    t1=$(ticks)
    echo $((t1 - t0)) >"$work/load.ticks"
    if grep -q "Non-2xx" <<<"$out"; then
        echo "bench-holds: $mode on $accounts accounts answered non-2xx:" >&2
        echo "$out" >&2
        exit 1
    fi
    requests=$(awk '/requests in/{print $1}' <<<"$out")
    printf 'rps=%s p50=%s p99=%s %scpu_us=%d\n' \
        "$(awk '/Requests\/sec/{print $2}' <<<"$out")" \
        "$(awk '$1=="50%"{print $2}' <<<"$out")" \
        "$(awk '$1=="99%"{print $2}' <<<"$out")" \
        "$(awk '/^pairs /{printf "pairs_per_s=%s ", $6}' <<<"$out")" \
        $(((t1 - t0) * 10000 / requests))
}

# fill MODE ACCOUNTS QUOTA [EXPIRES] [FROM]: QUOTA writes, counted by the replica; then wrk
# is stopped. Bounded by FILL_TIMEOUT_SECS.
fill() {
    local mode=$1 accounts=$2 quota=$3 expires=${4:-0} from=${5:-0} route base wrk_pid deadline
    route='/api/accounts/{id}/deposit'
    [ "$mode" = fill ] && route='/api/accounts/{id}/holds'
    route="tally_http_request_duration_seconds_count{route=\"$route\"}"
    base=$(metric "$route")
    wrk -t2 -c"$connections" -d"${FILL_TIMEOUT_SECS}s" --timeout 10s -s "$lua" \
        "http://127.0.0.1:$PORT" -- "$mode" "$accounts" "$quota" "$expires" "$((first_account + from))" \
        >"$work/fill.out" &
    wrk_pid=$!
    deadline=$((SECONDS + FILL_TIMEOUT_SECS))
    until [ "$(metric "$route")" -ge "$((base + quota))" ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "bench-holds: $mode did not finish" >&2; exit 1; }
        sleep 0.1
    done
    kill -INT "$wrk_pid"
    wait "$wrk_pid" || true
    if grep -q "Non-2xx" "$work/fill.out"; then
        echo "bench-holds: $mode answered non-2xx:" >&2
        cat "$work/fill.out" >&2
        exit 1
    fi
}

# metric SERIES: its value on the replica, 0 when absent.
metric() {
    curl -fsS "http://127.0.0.1:$PORT/metrics" | awk -v m="$1" '$1==m{v=$2} END{printf "%d\n", v}'
}

ceiling() {
    local round null=${NULL_BIN:-$(dirname "$tally")/examples/null_server}
    for round in $(seq 1 "$runs"); do
        PORT=$(free_port)
        "$null" "127.0.0.1:$PORT" >"$work/null.log" 2>&1 &
        PID=$!
        spawned "$PID"
        wait_tcp null_server "$PORT" "$PID" "$work/null.log"
        echo "ceiling round=$round null_server $(load "$seconds" deposits 1000)"
        stop
    done
}

pairs() {
    start --holds true
    fill fund 1 1
    fill fund 1000 1000
    local round
    for round in $(seq 1 "$runs"); do
        echo "pairs round=$round hot deposits $(load "$seconds" deposits 1)"
        echo "pairs round=$round hot pairs $(load "$seconds" pairs 1)"
        echo "pairs round=$round spread deposits $(load "$seconds" deposits 1000)"
        echo "pairs round=$round spread pairs $(load "$seconds" pairs 1000)"
    done
    stop
}

onoff() {
    local round holds
    for round in $(seq 1 "$runs"); do
        for holds in false true; do
            start --holds "$holds"
            echo "onoff round=$round holds=$holds spread deposits $(load "$seconds" deposits 1000)"
            echo "onoff round=$round holds=$holds hot deposits $(load "$seconds" deposits 1)"
            stop
        done
    done
}

# fill_due: places the sweep's holds; returns once the first of them is due.
fill_due() {
    local began due now
    began=$(date +%s.%N)
    fill fill "$sweep_accounts" "$sweep_holds" "$sweep_expires"
    echo "sweep filled holds=$sweep_holds accounts=$sweep_accounts in_s=$(echo "$(date +%s.%N) - $began" | bc)"
    [ -z "${1:-}" ] || echo "sweep open deposits $(load "$seconds" deposits 1000 0 0 "$sweep_accounts")"
    due=$(echo "$began + $sweep_expires" | bc)
    now=$(date +%s.%N)
    if [ "$(echo "$now < $due" | bc)" = 1 ]; then sleep "$(echo "$due - $now" | bc)"; fi
}

sweep() {
    start --holds true --hold-sweep-budget "$sweep_budget" --hold-sweep-interval-ms "$sweep_interval"
    local t0 c0 expired
    fill fund "$sweep_accounts" "$sweep_accounts"
    fill fund 1000 1000 0 "$sweep_accounts"
    # Alone: the time until every hold expired, and the replica's CPU meanwhile (idle
    # replica, one metrics read a second).
    fill_due
    t0=$(date +%s.%N)
    c0=$(ticks)
    while :; do
        expired=$(metric tally_holds_expired_total)
        [ "$expired" -ge "$sweep_holds" ] && break
        if [ "$(echo "$(date +%s.%N) - $t0 > $SWEEP_TIMEOUT_SECS" | bc)" = 1 ]; then
            echo "bench-holds: $expired of $sweep_holds expired after ${SWEEP_TIMEOUT_SECS}s" >&2
            exit 1
        fi
        sleep 1
    done
    echo "sweep alone expired=$expired secs=$(echo "$(date +%s.%N) - $t0" | bc) cpu_s=$(echo "($(ticks) - $c0) / 100" | bc -l | cut -c1-6) budget=$sweep_budget interval_ms=$sweep_interval"
    # Under deposits: the same holds again, deposits on other accounts before they fall due
    # and from the moment they do.
    fill_due with-deposits
    echo "sweep sweeping deposits $(load "$seconds" deposits 1000 0 0 "$sweep_accounts") expired_by_then=$(($(metric tally_holds_expired_total) - sweep_holds)) passes=$(curl -fsS "http://127.0.0.1:$PORT/metrics" | grep '^tally_hold_sweeps_total' | tr '\n' ' ')"
    stop
}

for part in "${parts[@]}"; do
    "$part"
done
