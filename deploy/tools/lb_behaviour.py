#!/usr/bin/env python3
"""Behaviour tests of deploy/nginx/tally.conf and deploy/fleet.sh, run by deploy/check.sh.

Everything runs on 127.0.0.1 with stub replicas (stub_tally.py), bounded in requests and
time, and is stopped at the end whatever happens.

  nginx: requests for one account reach one replica whatever the route; accounts spread;
         POST /api/transfers spreads; Idempotency-Key reaches the replica; a POST that
         reached a replica which then dropped it is NOT re-sent (502, seen once), while a
         GET is; a POST to a replica that refuses connections moves to another one; nginx's
         own refusals (400, 413, 414, 431, 501, 505) answer the API's JSON error shape.
  fleet: refuses to start without CELERIANT_ADDRESS (exit 2); TALLY_STORE=memory warns;
         starts N replicas + nginx; SIGTERM stops everything and exits 0; the time limit
         stops it by itself.

Usage: lb_behaviour.py NGINX_BINARY
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

DEPLOY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(DEPLOY, "tools", "stub_tally.py")
FLEET = os.path.join(DEPLOY, "fleet.sh")
HOST = "127.0.0.1"

failures = []


def check(cond, what):
    print(("ok     " if cond else "FAILED ") + what, flush=True)
    if not cond:
        failures.append(what)


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def port_open(port):
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def free_block(count, start):
    """The first base port >= start with `count` consecutive free ports."""
    base = start
    while base < 60000:
        if all(port_free(base + i) for i in range(count)):
            return base
        base += count + 1
    raise RuntimeError("no free loopback ports")


def wait_for(pred, seconds, step=0.1):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def request(port, method, path, headers=None, body=None):
    """(status, upstream replica port or None, parsed JSON body or None)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        upstream = resp.getheader("X-Tally-Upstream")
        payload = None
        if resp.getheader("Content-Type", "").startswith("application/json"):
            try:
                payload = json.loads(data)
            except ValueError:
                payload = None
        return resp.status, upstream, payload
    finally:
        conn.close()


def raw_exchange(port, data, seconds=5):
    """Send bytes as they are (requests http.client would refuse to write), read to close:
    (status, parsed JSON body or None)."""
    with socket.create_connection((HOST, port), timeout=seconds) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
    head, _, body = out.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def refusal_checks(lb_port):
    """Requests nginx refuses itself, before any replica sees them, answer in the API's JSON
    error shape (internal URIs in tally.conf), not nginx's HTML pages."""
    cases = [
        (b"GET /api/accounts HTTP/1.1\r\n\r\n", 400, "BAD_REQUEST"),  # HTTP/1.1 without Host
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, "URI_TOO_LONG"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, "HEADERS_TOO_LARGE"),
        (b"POST /api/transfers HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, "NOT_IMPLEMENTED"),
        (b"GET /api/accounts HTTP/2.0\r\nHost: t\r\n\r\n", 505, "HTTP_VERSION_NOT_SUPPORTED"),
    ]
    for data, want_status, want_error in cases:
        status, payload = raw_exchange(lb_port, data)
        got = (payload or {}).get("error")
        check(status == want_status and got == want_error, f"nginx's own {want_status} is the API's JSON error shape ({status} {got})")


def replica_of(payload):
    return payload["replica"] if payload else None


def stub_log_lines(paths):
    out = []
    for p in paths:
        with open(p) as f:
            out.extend(json.loads(line) for line in f if line.startswith("{"))
    return out


def stop(proc, sig=signal.SIGTERM, seconds=20):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def routing_checks(lb_port, replica_ports):
    accounts = [str(uuid.uuid4()) for _ in range(24)]
    one_replica_each = True
    homes = set()
    for acct in accounts:
        seen = set()
        for method, path in (
            ("GET", f"/api/accounts/{acct}/balance"),
            ("GET", f"/api/accounts/{acct}/history"),
            ("POST", f"/api/accounts/{acct}/deposit"),
            ("POST", f"/api/accounts/{acct}/withdraw"),
            ("POST", f"/api/accounts/{acct}/transfers"),
            ("GET", f"/api/accounts/{acct}"),
        ):
            status, _, payload = request(lb_port, method, path, {"Content-Type": "application/json"}, b"{}")
            seen.add(replica_of(payload) if status == 200 else None)
        one_replica_each &= len(seen) == 1 and None not in seen
        homes |= seen
    check(one_replica_each, "every route of one account (balance, history, deposit, withdraw, {fromId}/transfers) reaches one replica")
    check(len(homes) >= 2, f"accounts spread over replicas ({len(homes)} of {len(replica_ports)} used by 24 accounts)")

    spread = set()
    for _ in range(30):
        status, _, payload = request(lb_port, "POST", "/api/transfers", {"Content-Type": "application/json"}, b"{}")
        spread.add(replica_of(payload) if status == 200 else None)
    check(None not in spread and len(spread) >= 2, f"POST /api/transfers spreads at random ({len(spread)} replicas over 30 requests)")

    key = str(uuid.uuid4())
    status, _, payload = request(lb_port, "POST", f"/api/accounts/{accounts[0]}/deposit", {"Idempotency-Key": key}, b"{}")
    check(status == 200 and payload and payload.get("idempotency_key") == key, "Idempotency-Key reaches the replica unchanged")
    status, upstream, _ = request(lb_port, "GET", f"/api/accounts/{accounts[0]}/balance")
    check(bool(upstream) and upstream.startswith(f"{HOST}:"), "X-Tally-Upstream names the replica that answered")
    status, _, _ = request(lb_port, "GET", "/metrics")
    check(status == 404, "/metrics is not served through the balancer (scrape replicas directly)")


def retry_checks(lb_port, replica_ports, logs):
    # Several rounds, so both fresh and reused keep-alive upstream connections are covered.
    acct = str(uuid.uuid4())
    post_ok = True
    post_seen = []
    codes = set()
    for _ in range(5):
        tag = "post-" + uuid.uuid4().hex
        status, _, payload = request(lb_port, "POST", f"/api/accounts/{acct}/deposit", {"X-Stub-Drop": "1", "X-Stub-Tag": tag}, b"{}")
        time.sleep(0.2)
        seen = sum(1 for r in stub_log_lines(logs) if r.get("tag") == tag)
        post_seen.append(seen)
        post_ok &= status == 502 and seen == 1
        codes.add((payload or {}).get("error"))
    check(post_ok, f"a POST dropped after reaching a replica is never re-sent (502; replicas saw each {post_seen}x)")
    check(codes == {"UPSTREAM_FAILED"}, f"nginx's 502 is the API's JSON error shape ({codes})")
    status, _, payload = request(lb_port, "POST", f"/api/accounts/{acct}/deposit", {"Content-Type": "application/json"}, b"x" * 70_000)
    check(status == 413 and (payload or {}).get("error") == "PAYLOAD_TOO_LARGE", f"nginx's 413 is the API's JSON error shape ({status} {payload})")

    # nginx re-sends a GET to the next replica (proxy_next_upstream_tries 2), and grants
    # one extra try when the failure was on a reused keep-alive connection: 2 or 3 sends.
    tag = "get-" + uuid.uuid4().hex
    request(lb_port, "GET", f"/api/accounts/{acct}/balance", {"X-Stub-Drop": "1", "X-Stub-Tag": tag})
    time.sleep(0.2)
    seen = sum(1 for r in stub_log_lines(logs) if r.get("tag") == tag)
    check(seen in (2, 3), f"a GET dropped by a replica is re-sent (replicas saw it {seen}x)")


def failover_checks(lb_port, dead_port):
    """With one replica refusing connections, every POST still lands on a live one."""
    ok = 0
    moved = 0
    for _ in range(24):
        acct = str(uuid.uuid4())
        status, _, payload = request(lb_port, "POST", f"/api/accounts/{acct}/deposit", {}, b"{}")
        if status == 200:
            ok += 1
            moved += replica_of(payload) != dead_port
    check(ok == 24 and moved == 24, f"POSTs move to a live replica when one refuses connections ({ok}/24 answered)")


def nginx_tests(nginx, work):
    base = free_block(4, 18180)
    lb_port, replica_ports = base, [base + 1, base + 2, base + 3]
    logs = [os.path.join(work, f"stub-{p}.log") for p in replica_ports]
    stubs = []
    nginx_proc = None
    try:
        for port, log in zip(replica_ports, logs):
            with open(log, "w") as out:
                stubs.append(subprocess.Popen([sys.executable, STUB, "--listen", f"{HOST}:{port}"], stdout=out, stderr=subprocess.STDOUT))
        check(all(wait_for(lambda p=p: port_open(p), 10) for p in replica_ports), "stub replicas started")

        conf = os.path.join(work, "nginx.conf")
        env = dict(os.environ, FLEET_SIZE="3", FLEET_BASE_PORT=str(replica_ports[0]), FLEET_LISTEN=f"{HOST}:{lb_port}")
        subprocess.run([FLEET, "render", conf], env=env, check=True)
        prefix = work + "/"
        test = subprocess.run([nginx, "-t", "-q", "-p", prefix, "-e", "stderr", "-c", conf], capture_output=True, text=True)
        check(test.returncode == 0, "nginx -t accepts the rendered 3-replica config" + (": " + test.stderr.strip() if test.returncode else ""))
        if test.returncode:
            return
        nginx_proc = subprocess.Popen([nginx, "-p", prefix, "-e", os.path.join(work, "error.log"), "-c", conf, "-g", "daemon off;"])
        check(wait_for(lambda: port_open(lb_port), 10), "nginx listens on the rendered loopback address")

        routing_checks(lb_port, replica_ports)
        refusal_checks(lb_port)
        retry_checks(lb_port, replica_ports, logs)

        # Let the drop tests' failures age out of fail_timeout (5 s), so the failover check
        # starts from three healthy peers, one of which then dies.
        time.sleep(6)
        stop(stubs[2])
        check(wait_for(lambda: not port_open(replica_ports[2]), 10), "one stub replica stopped")
        failover_checks(lb_port, replica_ports[2])
    finally:
        if nginx_proc is not None:
            stop(nginx_proc, signal.SIGQUIT)
        for s in stubs:
            stop(s)


class Fleet:
    """fleet.sh in its own session, with stdout and stderr collected by reader threads."""

    def __init__(self, env):
        self.proc = subprocess.Popen([FLEET], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.out, self.err = [], []
        self.up = threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self.readers:
            t.start()

    def _read(self, stream, sink):
        for line in stream:
            sink.append(line)
            if line.startswith("Tally fleet up"):
                self.up.set()

    def wait_up(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.up.wait(0.2):
                return True
        return self.up.is_set()

    def wait(self, seconds):
        try:
            rc = self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return None
        for t in self.readers:
            t.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def fleet_tests(work):
    base = free_block(4, 18280)
    lb_port, replica_ports = base, [base + 1, base + 2, base + 3]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERIANT_", "TALLY_", "FLEET_"))}
    env.update(TALLY_BIN=STUB, FLEET_SIZE="3", FLEET_BASE_PORT=str(replica_ports[0]), FLEET_LISTEN=f"{HOST}:{lb_port}", TMPDIR=work)

    res = subprocess.run([FLEET], env=env, capture_output=True, text=True, timeout=30)
    check(res.returncode == 2 and "CELERIANT_ADDRESS" in res.stderr, "fleet.sh without CELERIANT_ADDRESS says so and exits 2")

    res = subprocess.run([FLEET], env=dict(env, FLEET_LISTEN="0.0.0.0:18080", CELERIANT_ADDRESS="127.0.0.1:9"), capture_output=True, text=True, timeout=30)
    check(res.returncode == 2, "fleet.sh refuses a non-loopback listen address")

    fleet = Fleet(dict(env, CELERIANT_ADDRESS="127.0.0.1:9", FLEET_MAX_SECONDS="120"))
    try:
        up = fleet.wait_up(40)
        check(up, "fleet.sh starts 3 replicas and nginx" + ("" if up else ": " + "".join(fleet.err[-5:]).strip()))
        if up:
            check(all(port_open(p) for p in replica_ports + [lb_port]), "replicas and nginx listen on loopback")
            acct = str(uuid.uuid4())
            homes = {replica_of(request(lb_port, m, f"/api/accounts/{acct}/{r}", {}, b"{}")[2])
                     for m, r in (("GET", "balance"), ("POST", "deposit"), ("POST", "transfers"))}
            check(len(homes) == 1 and None not in homes, "through the fleet, one account reaches one replica")
        fleet.proc.send_signal(signal.SIGTERM)
        rc = fleet.wait(30)
        check(rc == 0, f"fleet.sh stops on SIGTERM and exits 0 (exit {rc})")
        check(wait_for(lambda: not any(port_open(p) for p in replica_ports + [lb_port]), 10),
              "SIGTERM stopped every replica and nginx")
    finally:
        fleet.kill()

    fleet = Fleet(dict(env, TALLY_STORE="memory", FLEET_MAX_SECONDS="2"))
    try:
        rc = fleet.wait(40)
    finally:
        fleet.kill()
    check("do NOT share a store" in "".join(fleet.err), "TALLY_STORE=memory prints the loud warning")
    check(rc == 0 and not any(port_open(p) for p in replica_ports + [lb_port]),
          f"FLEET_MAX_SECONDS stops the fleet by itself (exit {rc})")


def main():
    nginx = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="tally-lb-check.") as work:
        os.chmod(work, 0o755)  # nginx workers run unprivileged when started as root
        nginx_tests(nginx, work)
        fleet_tests(work)
    print(f"{len(failures)} behaviour check(s) failed" if failures else "all behaviour checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
