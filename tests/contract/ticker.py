"""Keeps the contract run's watched account live: funds it and a peer, then writes every
kind of account event in turn (deposit, transfer in, withdrawal, transfer out) until it is
stopped, so that any four events in a row of the account's stream hold all four kinds and
the fleet-wide stream sees a write every few milliseconds. Prints `ready` once a whole
round has landed.

Usage: ticker.py BASE_URL TOKEN ACCOUNT PEER (BASE_URL like http://127.0.0.1:8080).
"""

import http.client
import itertools
import json
import sys
import time
import urllib.parse

# How long to wait for the replica to start serving writes.
READY_WITHIN_SECS = 30
# The pause between two writes: a watched stream's next event is this far off at most.
PAUSE_SECS = 0.02


def main() -> None:
    base, token, account, peer = sys.argv[1:5]
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    keys = (f"contract-tick-{n}" for n in itertools.count())

    def write(path: str, body: dict) -> int:
        conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "Idempotency-Key": next(keys),
            },
        )
        response = conn.getresponse()
        response.read()
        return response.status

    deadline = time.monotonic() + READY_WITHIN_SECS
    while True:
        try:
            if write(f"/api/accounts/{account}/deposit", {"amountCents": 1_000_000}) == 200:
                break
        except OSError:
            conn.close()
        if time.monotonic() > deadline:
            sys.exit("ticker: the replica did not take a deposit in time")
        time.sleep(0.1)
    rounds = [
        (f"/api/accounts/{peer}/deposit", {"amountCents": 1_000_000}),
        (f"/api/accounts/{account}/deposit", {"amountCents": 7}),
        (f"/api/accounts/{peer}/transfers", {"toAccountId": account, "amountCents": 5}),
        (f"/api/accounts/{account}/withdraw", {"amountCents": 7}),
        (f"/api/accounts/{account}/transfers", {"toAccountId": peer, "amountCents": 5}),
    ]
    for path, body in rounds:
        status = write(path, body)
        if status != 200:
            sys.exit(f"ticker: {path} answered {status}")
    print("ready", flush=True)
    for path, body in itertools.cycle(rounds[1:]):
        status = write(path, body)
        if status != 200:
            print(f"ticker: {path} answered {status}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_SECS)


if __name__ == "__main__":
    main()
