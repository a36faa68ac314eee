#!/usr/bin/env bash
# Batches against single requests, and the machine's limits, in one sitting. Each run is on a
# fresh Tally (and, on Celeriant, a fresh server), in this order per round:
#
#   1. the do-nothing HTTP server (examples/null_server.rs) under wrk: what any hyper server
#      pays per request here;
#   2. the embedded store: spread deposits one a request, then as batches of BATCH items;
#   3. Celeriant alone: celeriant-bench at 64 and at 256 tasks (the store's single-write rate);
#   4. Celeriant under Tally: single deposits, then batches.
#
# Each line gives the rate, p50 and p99 (per request, so per batch with --batch), the CPU an
# item of the sampled process (Tally; the Celeriant server with SAMPLE=store), the generator's
# CPU, store writes per 2xx item and the exactly-once verdict. celeriant-bench's line gives
# the server's CPU a write. The script fails on any verdict but a pass.
#
#   scripts/bench/batch.sh                              # 2 rounds, every part
#   PARTS="embedded" ROUNDS=1 scripts/bench/batch.sh    # one part, one round
#   TALLY_ARGS="--batch-items-in-flight 32" PARTS="embedded" scripts/bench/batch.sh
#   BASE_BIN=/path/to/older/tally PARTS="embedded" scripts/bench/batch.sh   # batches on both
#
# Knobs: ROUNDS (2), SECONDS_PER_RUN (10), CONNECTIONS (64), ACCOUNTS (10000), BATCH (100),
# PARTS ("null embedded store celeriant"; "embedded-batch" and "celeriant-batch" run the batch
# half alone), TALLY_ARGS (extra flags for every Tally),
# BASE_BIN (an older tally: each batch run is repeated on it, named "-base"), SAMPLE ("tally";
# "store" samples the Celeriant server's CPU instead of Tally's), CELERIANT_BIN,
# TALLY_RELEASE_DIR.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source-path=SCRIPTDIR source=../lib/parts.sh
source "$root/scripts/lib/parts.sh"
server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
bench=$(dirname "$server")/celeriant-bench
release=${TALLY_RELEASE_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}
rounds=${ROUNDS:-2}
seconds=${SECONDS_PER_RUN:-10}
connections=${CONNECTIONS:-64}
accounts=${ACCOUNTS:-10000}
batch=${BATCH:-100}
parts=${PARTS:-null embedded store celeriant}
read -r -a tally_args <<<"${TALLY_ARGS:-}"

need_executables batch "cargo build --release --locked --bins --example null_server" \
    "$release/tally" "$release/tally-load" "$release/examples/null_server"
scratch_dir tally-bench-batch
work=$SCRATCH

has() { [[ " $parts " == *" $1 "* ]]; }

# The do-nothing server under wrk's deposits: requests/s and its CPU us per request.
null_run() {
    local port pid ticks0 ticks1 out requests rps
    port=$(free_port)
    "$release/examples/null_server" "127.0.0.1:$port" >"$work/null.log" 2>&1 &
    pid=$!
    spawned "$pid"
    wait_tcp "batch: null_server" "$port" "$pid" "$work/null.log"
    ticks0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    out=$(wrk -t2 -c"$connections" -d"${seconds}s" --timeout 10s \
        -s "$root/scripts/bench/dep.lua" "http://127.0.0.1:$port" -- spread)
    ticks1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    stop_spawned TERM
    requests=$(awk '/requests in/{print $1}' <<<"$out")
    rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
    echo "null-server: $rps requests/s, $(( (ticks1 - ticks0) * 10000 / requests )) us CPU per request"
}

# tally_run NAME STORE_ARGS... -- LOAD_ARGS...: a fresh Tally ($TALLY_BIN, default this
# tree's), one tally-load run, one line.
tally_run() {
    local name=$1 store_args=() load_args=() port pid sampled bin=${TALLY_BIN:-$release/tally}
    shift
    while [ "$1" != "--" ]; do store_args+=("$1"); shift; done
    shift
    load_args=("$@")
    port=$(free_port)
    "$bin" "${store_args[@]}" "${tally_args[@]}" --listen "127.0.0.1:$port" \
        >"$work/tally.log" 2>&1 &
    pid=$!
    spawned "$pid"
    wait_tcp "batch: tally" "$port" "$pid" "$work/tally.log"
    sampled=${SAMPLED_PID:-$pid}
    "$release/tally-load" --target "http://127.0.0.1:$port" --scenario spread \
        --accounts "$accounts" --connections "$connections" --duration "$seconds" --seed 7 \
        --server-pid "$sampled" --metrics "http://127.0.0.1:$port" --json "${load_args[@]}" \
        >"$work/load.json" 2>"$work/load.err" || { cat "$work/load.err" "$work/load.json" >&2; exit 1; }
    stop_spawned TERM
    python3 - "$name" "$work/load.json" "$([ "$sampled" = "$pid" ] && echo server || echo store)" <<'PY'
import json, sys
name, r, who = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
b = r.get("batch")
items = b["items_per_sec"] if b else r["goodput"]
n_items = items * r["elapsed_secs"]
cpu = r["server"]["cpu_secs"]
store = r.get("store_requests") or {}
verdict = r["exactly_once"]["verdict"]
print(f"{name}: {items:,.0f} items/s, p50 {r['latency_us']['p50'] / 1000:.1f} ms, "
      f"p99 {r['latency_us']['p99'] / 1000:.1f} ms per request, "
      f"{who} {cpu * 1e6 / max(n_items, 1):.1f} us CPU an item, "
      f"generator {r.get('client_cpu_secs', 0) * 1e6 / max(n_items, 1):.1f} us an item, "
      f"{store.get('writes_per_success', float('nan')):.3f} store writes an item, "
      f"exactly-once {verdict}")
sys.exit(0 if verdict.lower() == "pass" else 1)
PY
}

# A fresh Celeriant server; leaves its port in $port.
fresh_server() {
    celeriant_start "$server" "$work/$1" "$work/$1.log" --routing-rule aggregate_type_id
    port=$STARTED_PORT
    wait_tcp "batch: the $1 server" "$port" "$STARTED_PID" "$work/$1.log"
}

# celeriant_tally NAME LOAD_ARGS...: Tally on a fresh server, the server stopped after.
celeriant_tally() {
    local name=$1
    shift
    celeriant_start "$server" "$work/$name" "$work/$name.log" --routing-rule aggregate_type_id
    local store_pid=$STARTED_PID store_port=$STARTED_PORT
    wait_tcp "batch: the server" "$store_port" "$store_pid" "$work/$name.log"
    if [ "${SAMPLE:-tally}" = store ]; then
        SAMPLED_PID=$store_pid tally_run "$name" --store celeriant \
            --celeriant-address "127.0.0.1:$store_port" -- "$@"
    else
        tally_run "$name" --store celeriant --celeriant-address "127.0.0.1:$store_port" -- "$@"
    fi
    rm -rf "${work:?}/$name"
}

echo "batch: $(nproc) cores, ${seconds}s runs, $connections connections, $accounts accounts, batches of $batch; $(date -u +%FT%TZ)" >&2
for round in $(seq 1 "$rounds"); do
    echo "round $round (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    if has null; then null_run; fi
    if has embedded; then
        tally_run embedded-single --
    fi
    if has embedded || has embedded-batch; then
        tally_run embedded-batch -- --batch "$batch"
        if [ -n "${BASE_BIN:-}" ]; then
            TALLY_BIN=$BASE_BIN tally_run embedded-batch-base -- --batch "$batch"
        fi
    fi
    if has store; then
        for tasks in 64 256; do
            fresh_server "bench$tasks"
            ticks0=$(awk '{print $14 + $15}' "/proc/$STARTED_PID/stat")
            out=$("$bench" --address1 "127.0.0.1:$port" --address2 "127.0.0.1:$port" --plaintext \
                --tasks "$tasks" --connections 64 --duration "$seconds" --workload --occ 2>&1)
            ticks1=$(awk '{print $14 + $15}' "/proc/$STARTED_PID/stat")
            stop_spawned TERM
            rm -rf "${work:?}/bench$tasks"
            rate=$(grep -Eio '[0-9][0-9,.]* *(writes|ops|req(uests)?)/s' <<<"$out" | tail -1 | tr -d ,)
            [ -n "$rate" ] || { echo "batch: no rate in celeriant-bench's output:" >&2; echo "$out" >&2; exit 1; }
            # clock ticks are 1/100 s; the bench's warm-up is in the ticks, not in its rate
            echo "celeriant-bench $tasks tasks: $rate, server $(python3 -c "print(round($((ticks1 - ticks0)) * 1e4 / (${rate%% *} * $seconds), 1))") us CPU a write"
        done
    fi
    if has celeriant; then
        celeriant_tally celeriant-single
    fi
    if has celeriant || has celeriant-batch; then
        celeriant_tally celeriant-batch --batch "$batch"
        if [ -n "${BASE_BIN:-}" ]; then
            TALLY_BIN=$BASE_BIN celeriant_tally celeriant-batch-base --batch "$batch"
        fi
    fi
done
