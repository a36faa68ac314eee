#!/usr/bin/env bash
# Cold accounts (BENCHMARKS.md, "Cold accounts"): what the first request to an account costs on
# a replica that never held it, against the length of the account's history.
#
#   cargo build --release --locked -p tally -p tally-load --bin tally --bin tally-load --example cold_history
#   bash scripts/bench-cold.sh
#
# Parts, each on its own fresh server (COLD_PARTS, default "celeriant embedded load"):
#   celeriant  a real Celeriant server. Accounts of COLD_SIZES events are written straight to
#              the store (examples/cold_history.rs `fill`: COLD_BATCH_EVENTS events per store
#              write, Tally's own event shape), then the script waits until the whole history
#              is older than the idempotency window (COLD_WINDOW_SECS, passed to every replica
#              as --idempotency-window: the default 90 is production's, so the wait is the
#              window itself). Each figure is then one request (curl, new connection) to a
#              `tally` process started for it alone, COLD_RUNS times: the first balance read
#              and, on another fresh process, the first deposit. Beside them:
#              - the floor: the same requests to a replica that already holds the smallest
#                account warm;
#              - hot accounts: COLD_HOT_HISTORY events of old history, then
#                COLD_HOT_WINDOW_EVENTS written just before they are read (inside the window,
#                so every one of them enters the recent-writes index);
#              - a trimmed account (COLD_TRIMMED_EVENTS events, trimmed with the store's own
#                trim to its newest batch): the answer a cold replica gives is recorded.
#   embedded   the same shapes on the embedded store. It lives inside one process, so the fresh
#              replicas are fresh in-process instances over one store (`cold_history embedded`,
#              primed the same way).
#   load       warm write throughput: `tally-load --scenario spread` (COLD_LOAD_ACCOUNTS
#              accounts, COLD_LOAD_CONNECTIONS connections, COLD_LOAD_SECONDS s), COLD_LOAD_RUNS
#              times, each on a fresh server and replica.
#   restart    a scaled-down fleet restart: COLD_RESTART_ACCOUNTS accounts of COLD_RESTART_EVENTS
#              events (older than the window), COLD_RESTART_REPLICAS fresh replicas started at
#              once, then spread deposits over those accounts (COLD_LOAD_CONNECTIONS
#              connections, COLD_RESTART_SECONDS s, `cold_history restart`): p99 per second and
#              the second from which it stays under 50 ms. Not in the default parts.
#
# Every figure is printed as one line (`<part>-<what> key=value ...`), then a summary per
# shape. Knobs above, plus CELERIANT_BIN (default ../shared/celeriant/celeriant) and
# TALLY_RELEASE_DIR (default $CARGO_TARGET_DIR/release or target/release). Every server and
# replica this script starts is stopped however it ends.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/parts.sh disable=SC1091 # followed under shellcheck -x
source "$root/scripts/lib/parts.sh"
server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
release=${TALLY_RELEASE_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}
history_bin=$release/examples/cold_history
read -r -a sizes <<<"${COLD_SIZES:-10 10000 100000 1000000}"
read -r -a hot_history <<<"${COLD_HOT_HISTORY:-10 100000}"
read -r -a parts <<<"${COLD_PARTS:-celeriant embedded load}"
runs=${COLD_RUNS:-3}
batch_events=${COLD_BATCH_EVENTS:-64}
window=${COLD_WINDOW_SECS:-90}
hot_window_events=${COLD_HOT_WINDOW_EVENTS:-10000}
trimmed_events=${COLD_TRIMMED_EVENTS:-100000}
load_runs=${COLD_LOAD_RUNS:-3}
load_seconds=${COLD_LOAD_SECONDS:-10}
load_accounts=${COLD_LOAD_ACCOUNTS:-1000}
load_connections=${COLD_LOAD_CONNECTIONS:-64}
prime=${COLD_PRIME:-1}
prime_wait=${COLD_PRIME_WAIT_SECS:-5}
restart_accounts=${COLD_RESTART_ACCOUNTS:-100}
restart_events=${COLD_RESTART_EVENTS:-100000}
restart_replicas=${COLD_RESTART_REPLICAS:-2}
restart_seconds=${COLD_RESTART_SECONDS:-60}
# How long a replica may take to answer /readyz after it listens.
readonly READY_TIMEOUT_SECS=60
# Every history event deposits this much (examples/cold_history.rs, AMOUNT_CENTS).
readonly AMOUNT_CENTS=100

for bin in "$server" "$release/tally" "$release/tally-load" "$history_bin"; do
    [ -x "$bin" ] || {
        echo "bench-cold: $bin is missing (cargo build --release --locked -p tally -p tally-load --bin tally --bin tally-load --example cold_history; CELERIANT_BIN names the server)" >&2
        exit 1
    }
done

work=$(mktemp -d /tmp/tally-bench-cold.XXXXXX)
results=$work/results
: >"$results"
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    stop_spawned KILL
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# emit LINE: one figure, printed and kept for the summary.
emit() {
    echo "$1"
    echo "$1" >>"$results"
}

# forget PID: a process this script started has ended; the cleanup no longer stops it.
forget() {
    local kept=() p
    for p in "${SPAWNED[@]}"; do [ "$p" = "$1" ] || kept+=("$p"); done
    SPAWNED=("${kept[@]}")
}

# stop_one PID: stops one process this script started.
stop_one() {
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    forget "$1"
}

# run_to FILE CMD...: runs CMD with its output in FILE, in the background and waited for, so
# a signal to this script ends it at once (bash runs a trap only between commands, and `wait`
# is one it can interrupt) and the cleanup stops CMD too. Fails as CMD fails.
run_to() {
    local out=$1 pid status=0
    shift
    "$@" >"$out" &
    pid=$!
    spawned "$pid"
    wait "$pid" || status=$?
    forget "$pid"
    return "$status"
}

# emit_from FILE [PREFIX]: every line of FILE as a figure.
emit_from() {
    local line
    while read -r line; do emit "${2:-}$line"; done <"$1"
}

# The machine's state over a part: the share of CPU time the hypervisor stole.
cpu_mark() { read -r _ cpu_user cpu_nice cpu_sys cpu_idle cpu_iowait cpu_irq cpu_softirq cpu_steal _ </proc/stat; }
cpu_report() {
    local a=("$cpu_user" "$cpu_nice" "$cpu_sys" "$cpu_idle" "$cpu_iowait" "$cpu_irq" "$cpu_softirq" "$cpu_steal")
    cpu_mark
    local b=("$cpu_user" "$cpu_nice" "$cpu_sys" "$cpu_idle" "$cpu_iowait" "$cpu_irq" "$cpu_softirq" "$cpu_steal")
    local total=0 i
    for i in "${!a[@]}"; do total=$((total + b[i] - a[i])); done
    emit "$1-machine steal=$(awk -v s=$((b[7] - a[7])) -v t="$total" 'BEGIN { printf "%.3f", t ? s / t : 0 }') idle=$(awk -v s=$((b[3] - a[3])) -v t="$total" 'BEGIN { printf "%.3f", t ? s / t : 0 }') load_average=$(cut -d' ' -f1 /proc/loadavg) (shares of all CPU time over the part; load at its end)"
}

# wal_bytes DIR: bytes a server's write-ahead logs hold, as 4 KiB pages that are not all
# zero. The server allocates each log file whole up front (1 GiB) and writes near both of its
# ends, so neither a file's size nor its last byte says how much it holds.
wal_bytes() {
    python3 - "$1" <<'PY'
import os, sys
CHUNK, PAGE = 1 << 20, 4096
used = 0
for folder, _, files in os.walk(sys.argv[1]):
    for name in files:
        if name.endswith(".wal"):
            with open(os.path.join(folder, name), "rb") as f:
                while chunk := f.read(CHUNK):
                    if chunk.count(0) != len(chunk):
                        used += sum(PAGE for i in range(0, len(chunk), PAGE)
                                    if chunk[i:i + PAGE].count(0) != len(chunk[i:i + PAGE]))
print(used)
PY
}

# fresh_server NAME: a new Celeriant server on its own data directory; leaves its port in
# $store_port, its pid in $store_pid and its data directory in $store_data.
fresh_server() {
    store_data=$work/$1
    celeriant_start "$server" "$store_data" "$work/$1.log" --routing-rule aggregate_type_id
    store_port=$STARTED_PORT store_pid=$STARTED_PID
    wait_tcp "bench-cold: the $1 server" "$store_port" "$store_pid" "$work/$1.log"
}

# replica: a fresh `tally` on the current server, ready (/readyz 200); leaves its base URL in
# $api and its pid in $tally_pid.
replica() {
    local port deadline
    port=$(free_port)
    "$release/tally" --store celeriant --celeriant-address "127.0.0.1:$store_port" \
        --listen "127.0.0.1:$port" --idempotency-window "$window" >>"$work/tally.log" 2>&1 &
    tally_pid=$!
    spawned "$tally_pid"
    api=http://127.0.0.1:$port
    wait_tcp "bench-cold: tally" "$port" "$tally_pid" "$work/tally.log"
    deadline=$((SECONDS + READY_TIMEOUT_SECS))
    # No signal but the probe says when start-up is done.
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$api/readyz")" = 200 ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "bench-cold: tally did not become ready: $(curl -s "$api/readyz"); the end of its log:" >&2
            grep -v 'route="/readyz"' "$work/tally.log" | tail -n 20 >&2
            exit 1
        fi
        sleep 0.05
    done
}

# request METHOD ACCOUNT OP: one request on a new connection; sets $ms (whole request, curl's
# time_total), $status and leaves the body in $work/body.
request() {
    local method=$1 account=$2 op=$3 out
    if [ "$op" = balance ]; then
        out=$(curl -s -o "$work/body" -w '%{http_code} %{time_total}' "$api/api/accounts/$account/balance")
    else
        out=$(curl -s -o "$work/body" -w '%{http_code} %{time_total}' -X "$method" \
            -H 'content-type: application/json' -H "idempotency-key: $(cat /proc/sys/kernel/random/uuid)" \
            --data '{"amountCents":1}' "$api/api/accounts/$account/deposit")
    fi
    status=${out%% *}
    ms=$(awk -v s="${out#* }" 'BEGIN { printf "%.2f", s * 1000 }')
}

# Deposits the measurements made, per account, so each balance read is checked exactly.
declare -A history_events=() deposits=()

# verdict ACCOUNT OP: sets $answer: "ok" for a 200 (a balance must be the fold of everything
# written, or the run fails), else the status and error code.
verdict() {
    local account=$1 op=$2 want got
    if [ "$status" != 200 ]; then
        answer=status_${status}_$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("error","?"))' "$work/body" 2>/dev/null || echo unreadable)
        return
    fi
    answer=ok
    if [ "$op" = deposit ]; then
        deposits[$account]=$((${deposits[$account]:-0} + 1))
        return
    fi
    want=$((history_events[$account] * AMOUNT_CENTS + ${deposits[$account]:-0}))
    got=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["balanceCents"])' "$work/body")
    if [ "$got" != "$want" ]; then
        echo "bench-cold: account $account balance $got, expected $want" >&2
        exit 1
    fi
}

# cold SHAPE ACCOUNT: COLD_RUNS fresh replicas for the first balance read, and as many for
# the first deposit.
cold() {
    local shape=$1 account=$2 run op
    for run in $(seq "$runs"); do
        for op in balance deposit; do
            replica
            request POST "$account" "$op"
            stop_one "$tally_pid"
            verdict "$account" "$op"
            emit "celeriant-cold shape=$shape op=$op run=$run ms=$ms answer=$answer"
        done
    done
}

# prime FILE PART: one replica reads the balance of every account in FILE (one id a line, 8 at a
# time), then stays up COLD_PRIME_WAIT_SECS before it stops: a replica that folds an account
# is the one that may leave something behind for the next (a checkpoint), and the histories
# were written straight to the store, past every replica. Today it leaves nothing (a balance
# read writes nothing to the store), so primed and unprimed runs measure the same code.
prime() {
    local started=$SECONDS bad
    [ "$prime" = 1 ] || return 0
    replica
    run_to "$work/prime.codes" xargs -P 8 -I{} -a "$1" curl -s -o /dev/null -w '%{http_code}\n' "$api/api/accounts/{}/balance"
    bad=$(grep -vc '^200$' "$work/prime.codes" || true)
    [ "$bad" = 0 ] || { echo "bench-cold: priming: $bad balance reads were not 200" >&2; exit 1; }
    # No signal yet says a replica has nothing left to write in the background.
    sleep "$prime_wait"
    stop_one "$tally_pid"
    emit "$2-prime accounts=$(wc -l <"$1") secs=$((SECONDS - started))"
}

# fill ACCOUNT=EVENTS...: histories written straight to the store, many events per write.
fill() {
    run_to "$work/fill.out" "$history_bin" fill --celeriant-address "127.0.0.1:$store_port" \
        --batch-events "$batch_events" "$@"
    emit_from "$work/fill.out" celeriant-
}

account_id() { printf '00000000-0000-4000-8000-%012d\n' "$1"; }

part_celeriant() {
    local n i=0 account pairs=() hot=() since disk_before disk_after total=0
    cpu_mark
    fresh_server celeriant
    run_to "$work/wal" wal_bytes "$store_data"
    disk_before=$(<"$work/wal")
    declare -A shape_of=()
    for n in "${sizes[@]}"; do
        i=$((i + 1)) account=$(account_id "$i")
        shape_of[$account]=cold-$n history_events[$account]=$n
        pairs+=("$account=$n") total=$((total + n))
    done
    for n in "${hot_history[@]}"; do
        i=$((i + 1)) account=$(account_id "$i")
        hot+=("$account") shape_of[$account]=hot-$n+$hot_window_events history_events[$account]=$n
        pairs+=("$account=$n") total=$((total + n))
    done
    i=$((i + 1)) trimmed=$(account_id "$i")
    history_events[$trimmed]=$trimmed_events
    pairs+=("$trimmed=$trimmed_events") total=$((total + trimmed_events))
    fill "${pairs[@]}"
    since=$SECONDS
    printf '%s\n' "${pairs[@]%%=*}" >"$work/prime-accounts"
    prime "$work/prime-accounts" celeriant
    run_to "$work/wal" wal_bytes "$store_data"
    disk_after=$(<"$work/wal")
    emit "celeriant-disk events=$total bytes=$((disk_after - disk_before)) bytes_per_event=$(((disk_after - disk_before) / total))"
    run_to "$work/trim.out" "$history_bin" trim --celeriant-address "127.0.0.1:$store_port" "$trimmed"
    emit_from "$work/trim.out" celeriant-

    # The whole history older than the window: the window itself has to pass (the store
    # stamps its own time on every batch, and nothing says when a window has gone by).
    echo "bench-cold: waiting $((window + 5 - (SECONDS - since))) s for the history to leave the ${window}s window" >&2
    while [ $((SECONDS - since)) -lt $((window + 5)) ]; do sleep 1; done

    # The floor: a replica that holds the smallest account warm.
    account=$(account_id 1)
    replica
    request GET "$account" balance
    verdict "$account" balance
    for i in $(seq "$runs"); do
        for op in balance deposit; do
            request POST "$account" "$op"
            verdict "$account" "$op"
            emit "celeriant-floor shape=warm-${sizes[0]} op=$op run=$i ms=$ms answer=$answer"
        done
    done
    stop_one "$tally_pid"

    for i in $(seq "${#sizes[@]}"); do
        account=$(account_id "$i")
        cold "${shape_of[$account]}" "$account"
    done
    # Hot: the window's events written now, read at once.
    pairs=()
    for account in "${hot[@]}"; do
        pairs+=("$account=$hot_window_events")
        history_events[$account]=$((history_events[$account] + hot_window_events))
    done
    since=$SECONDS
    fill "${pairs[@]}"
    for account in "${hot[@]}"; do cold "${shape_of[$account]}" "$account"; done
    if [ $((SECONDS - since)) -ge "$window" ]; then
        echo "bench-cold: the hot runs took longer than the window: their last figures are not hot" >&2
    fi
    cold "trimmed-$trimmed_events" "$trimmed"
    stop_one "$store_pid"
    cpu_report celeriant
}

part_embedded() {
    cpu_mark
    run_to "$work/embedded.out" "$history_bin" embedded --sizes "$(IFS=,; echo "${sizes[*]}")" --runs "$runs" \
        --batch-events "$batch_events" --window-secs "$window" \
        --hot-history "$(IFS=,; echo "${hot_history[*]}")" --hot-window-events "$hot_window_events" \
        --trimmed-events "$trimmed_events" --prime "$([ "$prime" = 1 ] && echo true || echo false)" \
        --prime-wait-secs "$prime_wait" 2>>"$work/embedded.log"
    emit_from "$work/embedded.out"
    cpu_report embedded
}

part_load() {
    local run
    cpu_mark
    for run in $(seq "$load_runs"); do
        fresh_server "load-$run"
        replica
        run_to "$work/load.json" "$release/tally-load" --target "$api" --scenario spread --accounts "$load_accounts" \
            --connections "$load_connections" --duration "$load_seconds" --seed 7 --json \
            2>"$work/load.err" || { cat "$work/load.err" "$work/load.json" >&2; exit 1; }
        stop_one "$tally_pid"
        stop_one "$store_pid"
        emit "load-spread run=$run $(python3 - "$work/load.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
lat = r["admitted_latency_us"]
print(f"deposits_per_sec={r['goodput']:.0f} p50_ms={lat['p50'] / 1000:.1f} "
      f"p99_ms={lat['p99'] / 1000:.1f} exactly_once={r['exactly_once']['verdict']}")
PY
)"
    done
    cpu_report load
}

part_restart() {
    local i accounts=$work/restart-accounts pairs=() targets=() pids=() since disk_before disk_after
    cpu_mark
    fresh_server restart
    run_to "$work/wal" wal_bytes "$store_data"
    disk_before=$(<"$work/wal")
    : >"$accounts"
    for i in $(seq "$restart_accounts"); do
        account_id $((1000000 + i)) >>"$accounts"
        pairs+=("$(account_id $((1000000 + i)))=$restart_events")
    done
    run_to "$work/fill.out" "$history_bin" fill --celeriant-address "127.0.0.1:$store_port" \
        --batch-events "$batch_events" "${pairs[@]}"
    grep '^fill-total' "$work/fill.out" >"$work/fill-total"
    emit_from "$work/fill-total" restart-
    since=$SECONDS
    prime "$accounts" restart
    run_to "$work/wal" wal_bytes "$store_data"
    disk_after=$(<"$work/wal")
    emit "restart-disk events=$((restart_accounts * restart_events)) bytes=$((disk_after - disk_before)) bytes_per_event=$(((disk_after - disk_before) / (restart_accounts * restart_events)))"
    # Older than the window, as an account's history mostly is: a fill writes far faster than
    # any account is written, and inside the window every event would take an index entry.
    echo "bench-cold: waiting $((window + 5 - (SECONDS - since))) s for the history to leave the ${window}s window" >&2
    while [ $((SECONDS - since)) -lt $((window + 5)) ]; do sleep 1; done
    for i in $(seq "$restart_replicas"); do
        replica
        targets+=("$api") pids+=("$tally_pid")
    done
    run_to "$work/restart.out" "$history_bin" restart --targets "$(IFS=,; echo "${targets[*]}")" --accounts "$accounts" \
        --connections "$load_connections" --duration-secs "$restart_seconds"
    emit_from "$work/restart.out"
    for i in "${pids[@]}"; do stop_one "$i"; done
    stop_one "$store_pid"
    cpu_report restart
}

echo "bench-cold: $(nproc) cores; server $server; tally $release/tally; parts: ${parts[*]}" >&2
for part in "${parts[@]}"; do
    case $part in
    celeriant) part_celeriant ;;
    embedded) part_embedded ;;
    load) part_load ;;
    restart) part_restart ;;
    *) echo "bench-cold: unknown part $part (celeriant, embedded, load, restart)" >&2; exit 2 ;;
    esac
done

echo
echo "summary (ms per run, in order):"
awk '
    $1 ~ /-(cold|floor)$/ {
        key = $1 " " $2 " " $3
        for (i = 4; i <= NF; i++) if ($i ~ /^ms=/) v = substr($i, 4)
        for (i = 4; i <= NF; i++) if ($i ~ /^answer=/ && $i != "answer=ok") v = v "(" substr($i, 8) ")"
        if (!(key in seen)) { order[++n] = key; seen[key] = 1 }
        runs[key] = runs[key] (runs[key] == "" ? "" : " / ") v
    }
    END { for (i = 1; i <= n; i++) printf "  %-60s %s\n", order[i], runs[order[i]] }
' "$results"
