#!/usr/bin/env bash
# Issue 17: runs Schemathesis against the real `tally` binary on the embedded store, with
# authentication on (HS256, a throwaway secret, rate limits off so the run is not paced).
# Every phase (examples, coverage, fuzzing, stateful links: deposit, then balance and
# history); the checks and their one narrowing are in schemathesis.toml beside this file.
#
# Environment: TALLY_BIN (the binary), SCHEMATHESIS (the CLI). Exits with Schemathesis's
# status; stops the replica it started.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
: "${TALLY_BIN:?the tally binary to test}"
: "${SCHEMATHESIS:?the schemathesis CLI}"

work=$(mktemp -d)
server=""
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    if [[ -n "$server" ]]; then
        kill "$server" 2>/dev/null || true
        wait "$server" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# A fresh secret for this run only.
head -c 48 /dev/urandom | base64 | tr -d '\n' > "$work/secret"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
device=6a1f0c3e-5b2d-4c7e-8f90-1a2b3c4d5e6f

"$TALLY_BIN" --listen "127.0.0.1:$port" --store memory \
    --auth jwt --auth-secret-file "$work/secret" --rate-limit-per-caller 0 \
    --log-format json > "$work/tally.log" 2>&1 &
server=$!

TALLY_CONTRACT_TOKEN=$("$TALLY_BIN" token --secret-file "$work/secret" --sub "$device" \
    --scope accounts:read --scope accounts:write --scope devices:sync)
TALLY_CONTRACT_DEVICE=$device
export TALLY_CONTRACT_TOKEN TALLY_CONTRACT_DEVICE

# The spec is read from the replica itself (what it serves is what is tested); Schemathesis
# waits for it, so the run starts once the replica listens.
cd "$work" # Hypothesis keeps its example database in the working directory.
status=0
"$SCHEMATHESIS" --config-file "$here/schemathesis.toml" run \
    "http://127.0.0.1:$port/openapi.json" \
    --wait-for-schema 30 --no-color || status=$?
if [[ $status -ne 0 ]]; then
    echo "contract: Schemathesis failed (exit $status); the replica's log:" >&2
    tail -n 50 "$work/tally.log" >&2
fi
exit $status
