#!/usr/bin/env bash
# Runs the leader-failover test (tests/fleet/cluster_failover.rs) TRIALS times on a fresh real
# 2-node Celeriant cluster each time, and tallies the runs.
#
#   TRIALS=5 bash scripts/cluster-failover.sh      (make cluster-failover TRIALS=5 does this)
#
# Environment:
#   TRIALS              runs, 1..100 (default 1)
#   TALLY_CLUSTER_SEED  the first run's seed (default 20261206); run i uses seed + i - 1
#   CLUSTER_SH          the cluster script (default ../shared/celeriant/cluster/cluster.sh)
#   CARGO               cargo (default cargo)
# The release binary and the test build must be there (the make target builds both).
# Exits 1 when any run failed; each run's whole output is kept in a log named at the end.
set -uo pipefail

ROOT=$(cd "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
CARGO=${CARGO:-cargo}
TRIALS=${TRIALS:-1}
SEED=${TALLY_CLUSTER_SEED:-20261206}
CLUSTER_SH=${CLUSTER_SH:-$ROOT/../shared/celeriant/cluster/cluster.sh}

if ! [[ $TRIALS =~ ^[0-9]+$ ]] || ((TRIALS < 1 || TRIALS > 100)); then
    echo "TRIALS must be 1..100, got '$TRIALS'" >&2
    exit 2
fi
[[ $SEED =~ ^[0-9]+$ ]] || { echo "TALLY_CLUSTER_SEED must be a whole number" >&2; exit 2; }
[[ -f $CLUSTER_SH ]] || { echo "no cluster script at $CLUSTER_SH (set CLUSTER_SH)" >&2; exit 2; }
CLUSTER_SH=$(cd "$(dirname -- "$CLUSTER_SH")" && pwd)/$(basename -- "$CLUSTER_SH")

# Once: moto in a venv and the role probe (each a no-op when already there). The probe is
# built into its own directory, where cluster.sh looks for it, whatever target dir this
# build uses.
env -u CARGO_TARGET_DIR bash "$CLUSTER_SH" setup || exit 1

LOGS=$(mktemp -d "${TMPDIR:-/tmp}/tally-cluster-failover.XXXXXX")
runs=0 violated=0 failed=0
summaries=()
for ((i = 1; i <= TRIALS; i++)); do
    seed=$((SEED + i - 1))
    log=$LOGS/run-$i.log
    echo "=== cluster-failover run $i of $TRIALS (seed $seed), log $log"
    TALLY_CLUSTER_TEST=1 TALLY_CLUSTER_SEED=$seed TALLY_CLUSTER_SCRIPT=$CLUSTER_SH \
        "$CARGO" test --workspace --locked --test fleet -- cluster_failover:: --ignored --nocapture \
        >"$log" 2>&1
    rc=$?
    runs=$((runs + 1))
    summary=$(grep -m1 '^cluster-failover summary:' "$log" || true)
    grep -E '^(VIOLATION|BREACH|READ BEHIND)' "$log" | head -n 10
    if [[ -z $summary ]]; then
        echo "run $i: no summary (exit $rc); its last lines:"
        tail -n 25 "$log"
        failed=$((failed + 1))
        continue
    fi
    echo "run $i (exit $rc): ${summary#cluster-failover summary: }"
    summaries+=("$summary")
    if [[ $summary =~ \ violations=([0-9]+) ]] && ((BASH_REMATCH[1] > 0)); then
        violated=$((violated + 1))
    elif ((rc != 0)); then
        failed=$((failed + 1))
    fi
done

failovers=$(printf '%s\n' "${summaries[@]}" | sed -n 's/.* failover_s=\([0-9.]*\).*/\1/p' | paste -sd, -)
echo "cluster-failover: $runs runs, $violated with a stale final refusal, $failed failed otherwise;" \
    "failover seconds: ${failovers:--}; logs in $LOGS"
((violated == 0 && failed == 0))
