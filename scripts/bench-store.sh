#!/usr/bin/env bash
# The store's limit beside Tally's rate, in one sitting (`make bench-store` builds first):
#
#   1. a fresh Celeriant server, and the server's own write benchmark against it
#      (celeriant-bench: BENCH_TASKS tasks, one small JSON event per request with
#      expected_version): the store's single-event write rate;
#   2. another fresh server, a release `tally` on it, and `tally-load --scenario spread`
#      (BENCH_CONNECTIONS connections, BENCH_ACCOUNTS accounts pre-funded, so warm, before the
#      measured phase, exactly-once verified after it): Tally's deposits per second;
#   3. the ratio of the two.
#
# Both runs share this machine's cores with the server (and Tally's run with the load generator
# too); a figure compares only with one taken in the same sitting.
# Knobs: BENCH_SECONDS (10; much shorter runs are dominated by celeriant-bench's warm-up, whose
# first requests wait about 0.7 s), BENCH_TASKS (64), BENCH_CONNECTIONS (64), BENCH_ACCOUNTS (1000),
# CELERIANT_BIN / CELERIANT_BENCH_BIN (default ../shared/celeriant/), TALLY_RELEASE_DIR.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/parts.sh
source "$root/scripts/lib/parts.sh"
server=$(realpath -m "${CELERIANT_BIN:-$root/../shared/celeriant/celeriant}")
bench=${CELERIANT_BENCH_BIN:-$(dirname "$server")/celeriant-bench}
release=${TALLY_RELEASE_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}
seconds=${BENCH_SECONDS:-10}
tasks=${BENCH_TASKS:-64}
connections=${BENCH_CONNECTIONS:-64}
accounts=${BENCH_ACCOUNTS:-1000}

need_executables bench-store "make bench-store builds Tally; CELERIANT_BIN names the server" \
    "$server" "$bench" "$release/tally" "$release/tally-load"
scratch_dir tally-bench-store
work=$SCRATCH

# fresh_server NAME: a new server in its own data directory; leaves its port in $port.
fresh_server() {
    celeriant_start "$server" "$work/$1" "$work/$1.log" --routing-rule aggregate_type_id
    port=$STARTED_PORT
    wait_tcp "bench-store: the $1 server" "$port" "$STARTED_PID" "$work/$1.log"
}

echo "bench-store: $(nproc) cores, ${seconds}s each; server $server" >&2

fresh_server store
"$bench" --address1 "127.0.0.1:$port" --address2 "127.0.0.1:$port" --plaintext \
    --tasks "$tasks" --connections "$tasks" --duration "$seconds" --workload --occ \
    >"$work/celeriant-bench.out" 2>&1 || { cat "$work/celeriant-bench.out" >&2; exit 1; }
stop_spawned TERM
store_rate=$(python3 - "$work/celeriant-bench.out" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
# The benchmark prints its throughput as "<N> writes/s" or "Throughput: <N>"; take the last.
found = re.findall(r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(?:writes|ops|req(?:uests)?)/s", text, re.I) \
    or re.findall(r"throughput[^0-9]*([0-9][0-9,]*(?:\.[0-9]+)?)", text, re.I)
if not found:
    sys.exit("bench-store: no rate in celeriant-bench's output:\n" + text)
print(found[-1].replace(",", ""))
PY
)

fresh_server tally-store
store_port=$port
api_port=$(free_port)
"$release/tally" --store celeriant --celeriant-address "127.0.0.1:$store_port" \
    --listen "127.0.0.1:$api_port" >"$work/tally.log" 2>&1 &
tally_pid=$!
spawned "$tally_pid"
wait_tcp "bench-store: tally" "$api_port" "$tally_pid" "$work/tally.log"
"$release/tally-load" --target "http://127.0.0.1:$api_port" --scenario spread \
    --accounts "$accounts" --connections "$connections" --duration "$seconds" --seed 7 \
    --server-pid "$tally_pid" --json >"$work/tally-load.json" 2>"$work/tally-load.err" ||
    { cat "$work/tally-load.err" "$work/tally-load.json" >&2; exit 1; }
stop_spawned TERM

python3 - "$work/tally-load.json" "$store_rate" "$tasks" "$connections" "$work/celeriant-bench.out" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
store = float(sys.argv[2])
tally = report["goodput"]
verdict = report["exactly_once"]["verdict"]
print(f"celeriant-bench ({sys.argv[3]} tasks, one event per request): {store:,.0f} writes/s")
print(f"tally spread deposits ({sys.argv[4]} connections, warm accounts): {tally:,.0f}/s, "
      f"p99 {report['admitted_latency_us']['p99'] / 1000:.1f} ms, exactly-once {verdict}")
print(f"ratio: {tally / store:.2f}x the store's single-write rate")
if verdict.lower() not in ("pass", "passed"):
    sys.exit("bench-store: the exactly-once verifier did not pass")
PY
