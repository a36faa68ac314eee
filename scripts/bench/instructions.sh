#!/usr/bin/env bash
# Instructions per request (user space) of Tally's request path and of the do-nothing server
# (examples/null_server.rs), counted by valgrind's callgrind under the same wrk load: a
# count, not a time, so it repeats on a busy or shared machine where requests/s do not. A
# run starts the server under callgrind, warms it (3 s), zeroes the counters, loads it
# (8 s of spread deposits from 64 connections), and divides the instructions counted by
# the requests wrk completed. System time (the sockets) is not counted: http-path.sh
# measures the whole.
#
#   scripts/bench/instructions.sh                          # the tree's build and null_server
#   BASE_BIN=/path/to/older/tally scripts/bench/instructions.sh
#
# Leaves each callgrind profile in $OUT_DIR (default target/callgrind) for callgrind_annotate.
set -euo pipefail
cd "$(dirname "$0")/../.."

TARGET=${CARGO_TARGET_DIR:-target}
OUT_DIR=${OUT_DIR:-$TARGET/callgrind}
PORT=${PORT:-18090}
for tool in wrk valgrind callgrind_control callgrind_annotate; do
  command -v "$tool" >/dev/null || { echo "instructions: $tool is not installed" >&2; exit 1; }
done
cargo build --release --locked --bin tally --example null_server >&2
mkdir -p "$OUT_DIR"

count() {
  local name=$1; shift
  local out="$OUT_DIR/$name.out" vpid requests total
  rm -f "$out"*
  valgrind --tool=callgrind --callgrind-out-file="$out" "$@" >"$OUT_DIR/$name.log" 2>&1 &
  vpid=$!
  for _ in $(seq 1 300); do
    curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz" 2>/dev/null && break
    sleep 0.2
  done
  wrk -t1 -c16 -d3s -s scripts/bench/dep.lua "http://127.0.0.1:$PORT" -- spread >/dev/null
  callgrind_control -z "$vpid" >/dev/null
  requests=$(wrk -t2 -c64 -d8s --timeout 10s -s scripts/bench/dep.lua \
    "http://127.0.0.1:$PORT" -- spread | awk '/requests in/{print $1}')
  callgrind_control -d "$vpid" >/dev/null
  kill "$vpid" 2>/dev/null; wait "$vpid" 2>/dev/null || true
  # The zeroing dump and the load's dump: the load's is the newest part file.
  total=$(callgrind_annotate "$(ls -t "$out".* | head -1)" 2>/dev/null \
    | awk '/PROGRAM TOTALS/{gsub(",", "", $1); print $1}')
  echo "$name: $((total / requests)) instructions per request ($requests requests)"
}

count null "$TARGET/release/examples/null_server" "127.0.0.1:$PORT"
if [[ -n "${BASE_BIN:-}" ]]; then
  count base "$BASE_BIN" --listen "127.0.0.1:$PORT"
fi
count tally "$TARGET/release/tally" --listen "127.0.0.1:$PORT"
