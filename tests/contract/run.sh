#!/usr/bin/env bash
# Issue 17: runs Schemathesis against the real `tally` binary on the embedded store, with
# authentication on (HS256, a throwaway secret, rate limits off so the run is not paced;
# the per-peer failure limit too, since its checks send requests without a token).
# Every phase (examples, coverage, fuzzing, stateful links: deposit, then balance and
# history); the checks and their one narrowing are in schemathesis.toml beside this file.
# The watch streams are reached on a live account: ticker.py writes every kind of event to
# it throughout the run, so each stream Schemathesis opens carries a snapshot and all four
# account events (the fleet-wide stream, their writes), each checked against the event
# schema the spec documents; a stream ends after those events (schemathesis.toml). A second
# pass opens the account stream on generated ids, accounts never written
# (schemathesis-streams.toml).
#
# Environment: TALLY_BIN (the binary), SCHEMATHESIS (the CLI). Exits with Schemathesis's
# status; stops the replica it started.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
: "${TALLY_BIN:?the tally binary to test}"
: "${SCHEMATHESIS:?the schemathesis CLI}"

work=$(mktemp -d)
server=""
ticker=""
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    if [[ -n "$ticker" ]]; then
        kill "$ticker" 2>/dev/null || true
        wait "$ticker" 2>/dev/null || true
    fi
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
# The watched account, and the peer of its transfers.
account=3d7c2b1a-9e8f-4a6b-8c5d-0e1f2a3b4c5d
peer=5e4d3c2b-1a09-4f8e-9d7c-6b5a4f3e2d1c

# Holds on, so their routes answer as the spec says rather than 503 HOLDS_OFF.
"$TALLY_BIN" --listen "127.0.0.1:$port" --store memory --holds true \
    --auth jwt --auth-secret-file "$work/secret" --rate-limit-per-caller 0 \
    --auth-failures-per-minute 0 \
    --log-format json > "$work/tally.log" 2>&1 &
server=$!

TALLY_CONTRACT_TOKEN=$("$TALLY_BIN" token --secret-file "$work/secret" --sub "$device" \
    --scope accounts:read --scope accounts:write --scope devices:sync)
TALLY_CONTRACT_DEVICE=$device
TALLY_CONTRACT_ACCOUNT=$account
export TALLY_CONTRACT_TOKEN TALLY_CONTRACT_DEVICE TALLY_CONTRACT_ACCOUNT

# The ticker says `ready` once the account holds every kind of event; the run starts then.
mkfifo "$work/ticker.ready"
python3 "$here/ticker.py" "http://127.0.0.1:$port" "$TALLY_CONTRACT_TOKEN" "$account" "$peer" \
    > "$work/ticker.ready" 2> "$work/ticker.log" &
ticker=$!
if ! read -r -t 60 line < "$work/ticker.ready" || [[ "$line" != ready ]]; then
    echo "contract: the ticker did not start; its log, then the replica's:" >&2
    cat "$work/ticker.log" >&2
    tail -n 50 "$work/tally.log" >&2
    exit 1
fi

# The spec is read from the replica itself (what it serves is what is tested); Schemathesis
# waits for it, so the run starts once the replica listens.
cd "$work" # Hypothesis keeps its example database in the working directory.
status=0
"$SCHEMATHESIS" --config-file "$here/schemathesis.toml" run \
    "http://127.0.0.1:$port/openapi.json" \
    --wait-for-schema 30 --no-color || status=$?
if [[ $status -eq 0 ]]; then
    "$SCHEMATHESIS" --config-file "$here/schemathesis-streams.toml" run \
        "http://127.0.0.1:$port/openapi.json" --include-operation-id watchAccount \
        --wait-for-schema 30 --no-color || status=$?
fi
if [[ $status -ne 0 ]]; then
    echo "contract: Schemathesis failed (exit $status); the ticker's log, then the replica's:" >&2
    cat "$work/ticker.log" >&2
    tail -n 50 "$work/tally.log" >&2
fi
exit $status
