#!/usr/bin/env python3
"""A stand-in for the `tally` binary, for deploy/check.sh only: it takes Tally's command
line, serves /healthz and /readyz, and answers every other request with JSON naming the
replica (its port), the method, the path and the Idempotency-Key it received. It keeps no
accounts: it exists to test the load-balancer config and fleet.sh, not Tally.

A request carrying `X-Stub-Drop: 1` is read and then dropped without an answer, like a
replica that died after receiving it. Every request is logged to stdout as one JSON line,
so a test can count which replica saw what. SIGTERM stops it cleanly with exit code 0.
Loopback only: it refuses any --listen address outside 127.0.0.0/8.
"""

import argparse
import ipaddress
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:8080")
    # Tally's other flags are accepted and ignored.
    for flag in (
        "--store", "--idempotency-window", "--client-id", "--org-id", "--account-type-id",
        "--seed-demo-accounts", "--celeriant-address", "--celeriant-seeds",
        "--celeriant-tls-ca", "--celeriant-tls-cert", "--celeriant-tls-key",
        "--celeriant-tls-server-name", "--celeriant-api-key", "--max-concurrent-requests",
        "--max-resident-accounts", "--log-format",
    ):
        p.add_argument(flag)
    return p.parse_args(argv)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stub-tally"

    def log_message(self, *args):  # the JSON line below is the log
        pass

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        record = {
            "replica": self.server.server_address[1],
            "method": self.command,
            "path": self.path,
            "idempotency_key": self.headers.get("Idempotency-Key"),
            "request_id": self.headers.get("X-Request-Id"),
            "tag": self.headers.get("X-Stub-Tag"),
        }
        print(json.dumps(record), flush=True)
        if self.headers.get("X-Stub-Drop") == "1":
            self.close_connection = True
            return
        if self.path in ("/healthz", "/readyz"):
            body = b"ok\n"
            ctype = "text/plain"
        else:
            body = (json.dumps(record) + "\n").encode()
            ctype = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Stub-Replica", str(record["replica"]))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _handle
    do_POST = _handle


def main(argv):
    args = parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if not ipaddress.ip_address(host).is_loopback:
        sys.exit(f"stub_tally: refusing non-loopback address {host}")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    server.daemon_threads = True

    def stop(_signo, _frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
