#!/usr/bin/env bash
# Keys remembered for a day (BENCHMARKS.md, "Keys remembered for a day"): a build with the
# key memory against one without it, alternating run by run in one sitting.
#
#   BASE_RELEASE_DIR=/path/to/older/target/release bash scripts/bench-keys.sh
#
# Both release dirs need `tally`; the new one also `tally-load` (used for both builds).
# Parts (KEYS_PARTS, default "throughput retry first-touch"):
#   throughput   new writes: tally-load spread and hot on the embedded store, spread on a
#                fresh Celeriant server; KEYS_RUNS rounds, base then new in each round.
#                The new build runs with --idempotency-retention KEYS_RETENTION.
#   retry        an old retry (past the window, inside the retention) on a real server:
#                KEYS_RETRY_KEYS keyed deposits on one account through a replica with
#                --idempotency-window KEYS_RETRY_WINDOW, the window waited out, then retries
#                of KEYS_RETRY_SAMPLES of those keys on that warm replica and, one each, on
#                fresh replicas. Store requests and remembered reads per answer from /metrics.
#   first-touch  a fresh replica's first balance read and first deposit, one process per
#                request, on a real server per build: an account with KEYS_FILL keys written
#                through the build (wrk, 64 connections), and an account written right now at
#                about 1,000 deposits/s (wrk, paced) for longer than the window.
# Every figure is one line (`<part> build=<base|new> key=value ...`). Every process this
# script starts is stopped however it ends.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/parts.sh disable=SC1091 # followed under shellcheck -x
source "$root/scripts/lib/parts.sh"
server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
new=${TALLY_RELEASE_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}
base=${BASE_RELEASE_DIR:?BASE_RELEASE_DIR names the baseline release directory}
read -r -a parts <<<"${KEYS_PARTS:-throughput retry first-touch}"
runs=${KEYS_RUNS:-3}
seconds=${KEYS_SECONDS:-10}
retention=${KEYS_RETENTION:-86400}
# The shortest window Tally accepts: it must exceed the write deadline plus the store's
# request timeout (5 s each by default).
retry_window=${KEYS_RETRY_WINDOW:-11}
retry_keys=${KEYS_RETRY_KEYS:-1000}
retry_samples=${KEYS_RETRY_SAMPLES:-5}
fill=${KEYS_FILL:-1000000}
touch_window=${KEYS_TOUCH_WINDOW:-30}
touch_runs=${KEYS_TOUCH_RUNS:-3}
readonly READY_TIMEOUT_SECS=120

work=$(mktemp -d /tmp/tally-bench-keys.XXXXXX)
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    stop_spawned KILL
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

forget() {
    local kept=() p
    for p in "${SPAWNED[@]}"; do [ "$p" = "$1" ] || kept+=("$p"); done
    SPAWNED=("${kept[@]}")
}
stop_one() {
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    forget "$1"
}
dir_of() { if [ "$1" = base ]; then echo "$base"; else echo "$new"; fi; }
# The new build's flags on top of the shared ones: the retention under test.
extra_of() { if [ "$1" = new ]; then echo "--idempotency-retention $retention"; fi; }

# fresh_server NAME: leaves $store_port and $store_pid.
fresh_server() {
    celeriant_start "$server" "$work/$1" "$work/$1.log" --routing-rule aggregate_type_id
    store_port=$STARTED_PORT store_pid=$STARTED_PID
    wait_tcp "bench-keys: the $1 server" "$store_port" "$store_pid" "$work/$1.log"
}

# replica BUILD [STORE_PORT|embedded] [FLAGS...]: a ready `tally`; leaves $api and $tally_pid.
replica() {
    local build=$1 store=$2 port deadline
    shift 2
    port=$(free_port)
    local store_flags=()
    [ "$store" = embedded ] || store_flags=(--store celeriant --celeriant-address "127.0.0.1:$store")
    # shellcheck disable=SC2046 # extra_of prints whole flags
    "$(dir_of "$build")/tally" "${store_flags[@]}" --listen "127.0.0.1:$port" $(extra_of "$build") "$@" \
        >>"$work/tally-$build.log" 2>&1 &
    tally_pid=$!
    spawned "$tally_pid"
    api=http://127.0.0.1:$port
    wait_tcp "bench-keys: tally" "$port" "$tally_pid" "$work/tally-$build.log"
    deadline=$((SECONDS + READY_TIMEOUT_SECS))
    # No signal but the probe says when start-up is done.
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$api/readyz")" = 200 ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "bench-keys: tally not ready" >&2; tail "$work/tally-$build.log" >&2; exit 1; }
        sleep 0.05
    done
}

# metric NAME: the sum of the samples of $api's /metrics named NAME, over all their labels.
metric() {
    curl -s "$api/metrics" | awk -v m="$1" '$1 == m || index($1, m "{") == 1 { s += $NF } END { printf "%d\n", s }'
}
rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status"; }

load() {
    local build=$1 scenario=$2 store=$3
    "$new/tally-load" --target "$api" --scenario "$scenario" --accounts 1000 --connections 64 \
        --duration "$seconds" --seed 7 --server-pid "$tally_pid" --json 2>"$work/load.err" >"$work/load.json" ||
        { cat "$work/load.err" "$work/load.json" >&2; exit 1; }
    echo "throughput build=$build store=$store scenario=$scenario $(python3 - "$work/load.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
lat = r["admitted_latency_us"]
print(f"deposits_per_sec={r['goodput']:.0f} p50_ms={lat['p50'] / 1000:.1f} "
      f"p99_ms={lat['p99'] / 1000:.1f} tally_cpu_us_per_request={r['server']['cpu_us_per_request']:.1f} "
      f"exactly_once={r['exactly_once']['verdict']}")
PY
)"
}

part_throughput() {
    local run build scenario
    for run in $(seq "$runs"); do
        for scenario in spread hot; do
            for build in base new; do
                replica "$build" embedded
                load "$build" "$scenario" embedded
                stop_one "$tally_pid"
            done
        done
        for build in base new; do
            fresh_server "load-$run-$build"
            replica "$build" "$store_port"
            load "$build" spread celeriant
            stop_one "$tally_pid"
            stop_one "$store_pid"
        done
    done
}

# request METHOD PATH [KEY]: one request on a new connection (curl); sets $ms, $status, and
# $replayed (the replay header's value, or "no"); the body is in $work/body.
request() {
    local method=$1 path=$2 key=${3:-} out
    if [ "$method" = GET ]; then
        out=$(curl -s -D "$work/head" -o "$work/body" -w '%{http_code} %{time_total}' "$api$path")
    else
        out=$(curl -s -D "$work/head" -o "$work/body" -w '%{http_code} %{time_total}' -X POST \
            -H 'content-type: application/json' -H "idempotency-key: $key" \
            --data '{"amountCents":1}' "$api$path")
    fi
    status=${out%% *}
    ms=$(awk -v s="${out#* }" 'BEGIN { printf "%.2f", s * 1000 }')
    replayed=$(awk -F': ' 'tolower($1) == "idempotent-replayed" { gsub("\r", "", $2); print $2 }' "$work/head")
    replayed=${replayed:-no}
}

# retry_one BUILD HOW KEY: retries KEY's deposit on $api and prints what it cost.
retry_one() {
    local build=$1 how=$2 key=$3 reads0 hits0 reads1 hits1 want
    reads0=$(metric tally_store_requests_total)
    hits0=$(metric tally_idempotency_remembered_reads_total)
    request POST "/api/accounts/$account/deposit" "$key"
    reads1=$(metric tally_store_requests_total)
    hits1=$(metric tally_idempotency_remembered_reads_total)
    want=$(grep -F "$key " "$work/answers" | cut -d' ' -f2-)
    local same=no
    [ "$(cat "$work/body")" = "$want" ] && same=yes
    echo "retry build=$build replica=$how ms=$ms status=$status replayed=$replayed same_body=$same store_requests=$((reads1 - reads0)) remembered_reads=$((hits1 - hits0))"
}

part_retry() {
    local build run i key
    for run in $(seq "$runs"); do
        for build in base new; do
            fresh_server "retry-$run-$build"
            account=$(cat /proc/sys/kernel/random/uuid)
            replica "$build" "$store_port" --idempotency-window "$retry_window"
            # The keys and their first answers, one connection (keep-alive).
            python3 - "$api" "$account" "$retry_keys" "$run-$build" >"$work/answers" <<'PY'
import http.client, sys, urllib.parse
api, account, n, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
u = urllib.parse.urlparse(api)
c = http.client.HTTPConnection(u.hostname, u.port)
for i in range(n):
    key = f"retry-{tag}-{i}"
    c.request("POST", f"/api/accounts/{account}/deposit", body='{"amountCents":1}',
              headers={"content-type": "application/json", "idempotency-key": key})
    r = c.getresponse()
    body = r.read().decode()
    assert r.status == 200, (r.status, body)
    print(key, body)
PY
            # Past the window: time has to pass (the store stamps its own commit times).
            sleep $((retry_window + 1))
            for i in $(seq "$retry_samples"); do
                key=retry-$run-$build-$(((i * 97) % retry_keys))
                retry_one "$build" warm "$key"
            done
            stop_one "$tally_pid"
            for i in $(seq "$retry_samples"); do
                key=retry-$run-$build-$(((i * 89 + 1) % retry_keys))
                replica "$build" "$store_port" --idempotency-window "$retry_window"
                retry_one "$build" cold "$key"
                stop_one "$tally_pid"
            done
            stop_one "$store_pid"
        done
    done
}

# touch BUILD SHAPE ACCOUNT: one fresh replica per request, first balance read then first
# deposit; prints each with its store requests and the keys the replica then remembers.
touch_one() {
    local build=$1 shape=$2 acct=$3 op port=${store_ports[$1]} r0 r1 rss0
    for op in balance deposit; do
        replica "$build" "$port" --idempotency-window "$touch_window"
        r0=$(metric tally_store_requests_total)
        rss0=$(rss_kib "$tally_pid")
        if [ "$op" = balance ]; then
            request GET "/api/accounts/$acct/balance"
        else
            request POST "/api/accounts/$acct/deposit" "touch-$(cat /proc/sys/kernel/random/uuid)"
        fi
        r1=$(metric tally_store_requests_total)
        echo "first-touch build=$build shape=$shape op=$op ms=$ms status=$status store_requests=$((r1 - r0)) remembered_keys=$(metric tally_idempotency_remembered_keys) rss_delta_kib=$(($(rss_kib "$tally_pid") - rss0))"
        stop_one "$tally_pid"
    done
}

part_first_touch() {
    local build run since
    declare -A store_ports=() writers=() writer_apis=() writer_since=()
    local big=00000000-0000-4000-8000-000000000001 busy=00000000-0000-4000-8000-000000000002
    for build in base new; do
        fresh_server "touch-$build"
        store_ports[$build]=$store_port
        replica "$build" "$store_port" --idempotency-window "$touch_window"
        since=$SECONDS
        wrk -t1 -c64 -d1800s --timeout 10s -s "$root/scripts/bench-keys.lua" "$api" -- "$big" "$fill" \
            >"$work/fill-$build.out" 2>&1
        request GET "/api/accounts/$big/balance"
        echo "first-touch-fill build=$build secs=$((SECONDS - since)) balance=$(cat "$work/body") (1 cent a deposit)"
        # The writer's checkpoints are written off the write path: give it time to finish.
        sleep 5
        stop_one "$tally_pid"
    done
    # The keys past the window.
    sleep $((touch_window + 5))
    for run in $(seq "$touch_runs"); do
        for build in base new; do touch_one "$build" "keys-$fill" "$big"; done
    done
    # A paced writer per build (24 connections, each 20 ms between answer and request: about 1,000 deposits/s each),
    # running longer than the window before the first touch.
    for build in base new; do
        replica "$build" "${store_ports[$build]}" --idempotency-window "$touch_window"
        wrk -t1 -c24 -d1800s --timeout 10s -s "$root/scripts/bench-keys.lua" "$api" -- "$busy" 0 20 \
            >"$work/busy-$build.out" 2>&1 &
        writers[$build]=$! writer_apis[$build]=$api writer_since[$build]=$SECONDS
        spawned "${writers[$build]}"
    done
    sleep $((touch_window + 5))
    for run in $(seq "$touch_runs"); do
        for build in base new; do touch_one "$build" busy "$busy"; done
    done
    for build in base new; do
        api=${writer_apis[$build]}
        request GET "/api/accounts/$busy/balance"
        echo "first-touch-busy build=$build secs=$((SECONDS - writer_since[$build])) balance=$(cat "$work/body") (1 cent a deposit)"
        stop_one "${writers[$build]}"
    done
}

echo "bench-keys: $(nproc) cores; base $base; new $new; parts: ${parts[*]}; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for part in "${parts[@]}"; do
    case $part in
    throughput) part_throughput ;;
    retry) part_retry ;;
    first-touch) part_first_touch ;;
    *) echo "bench-keys: unknown part $part (throughput, retry, first-touch)" >&2; exit 2 ;;
    esac
    echo "bench-keys: part $part done, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
