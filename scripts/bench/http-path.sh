#!/usr/bin/env bash
# Tally's own request path against a server that does nothing (examples/null_server.rs),
# under the same wrk load in one sitting: spread deposits on the embedded store, each run on
# a fresh process, the servers alternating run by run. Prints each run's requests/s and CPU
# per request (the server's user and system time over the requests wrk completed), then the
# median of each and Tally's ratios to the do-nothing server.
#
#   scripts/bench/http-path.sh                   # builds both, 3 rounds of 10 s
#   BASE_BIN=/path/to/older/tally scripts/bench/http-path.sh   # an older build beside them
#
# Knobs: ROUNDS (3), SECONDS_PER_RUN (10), CONNECTIONS (64), THREADS (2), SCENARIO (spread).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
SCENARIO=${SCENARIO:-spread}
PORT=${PORT:-18080}
TARGET=${CARGO_TARGET_DIR:-target}

command -v wrk >/dev/null || { echo "http-path: wrk is not installed (apt-get install wrk)" >&2; exit 1; }
cargo build --release --locked --bin tally --example null_server >&2

declare -A servers=(
  [null]="$TARGET/release/examples/null_server 127.0.0.1:$PORT"
  [tally]="$TARGET/release/tally --listen 127.0.0.1:$PORT"
)
order=(null tally)
if [[ -n "${BASE_BIN:-}" ]]; then
  servers[base]="$BASE_BIN --listen 127.0.0.1:$PORT"
  order=(null base tally)
fi

# One run: start the server, load it, read its CPU time from /proc, stop it.
run() {
  local name=$1 log pid ticks0 ticks1 out requests rps
  log=$(mktemp)
  ${servers[$name]} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz" 2>/dev/null && break
    sleep 0.1
  done
  ticks0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  out=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"${SECONDS_PER_RUN}s" --timeout 10s \
    -s scripts/bench/dep.lua "http://127.0.0.1:$PORT" -- "$SCENARIO")
  ticks1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$log"
  if grep -q "Non-2xx" <<<"$out"; then
    echo "http-path: $name answered non-2xx:" >&2; echo "$out" >&2; exit 1
  fi
  requests=$(awk '/requests in/{print $1}' <<<"$out")
  rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
  # clock ticks are 1/100 s: microseconds per request = ticks * 10000 / requests
  echo "$name $rps $(( (ticks1 - ticks0) * 10000 / requests ))"
}

results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  for name in "${order[@]}"; do
    line=$(run "$name")
    echo "round $round: $line (name, requests/s, CPU us per request)"
    echo "$line" >>"$results"
  done
done

python3 - "$results" "${order[@]}" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {}
for name in sys.argv[2:]:
    rps = [float(r[1]) for r in rows if r[0] == name]
    cpu = [float(r[2]) for r in rows if r[0] == name]
    med[name] = (statistics.median(rps), statistics.median(cpu))
    print(f"{name:6} median {med[name][0]:9.0f} requests/s, {med[name][1]:5.1f} us CPU per request")
for name in sys.argv[2:]:
    if name != "null":
        print(f"{name:6} / null: {med[name][0] / med['null'][0]:.2f}x requests/s, "
              f"{med[name][1] / med['null'][1]:.2f}x CPU per request")
EOF
rm -f "$results"
