#!/usr/bin/env python3
"""Generates tally-dashboard.json, the Grafana dashboard over src/metrics.rs.

Edit this file, not the JSON, then run `python3 deploy/grafana/gen_dashboard.py`;
deploy/check.sh fails when the committed JSON differs from what this prints.

Every metric lives in src/metrics.rs. Panels come in pairs where it helps: the aggregate
over the fleet, then the same quantity per replica (`instance`). The variables pick the
Prometheus data source, the scrape job and the replicas, and `resident_cap` repeats
TALLY_MAX_RESIDENT_ACCOUNTS from deploy/k8s/configmap.yaml (check.sh keeps them equal).
"""

import json
import os
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tally-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
RI = "$__rate_interval"
RESIDENT_CAP = "100000"
FIVEXX = 'status_class="5xx"'
NOT_2XX = 'status_class!="2xx"'
UNVERIFIABLE = 'arm="unverifiable"'
NOT_SUCCESS = 'arm!="success"'
# The store's `result` label: "ok" for success (not pinned in src/metrics.rs, see README).
NOT_OK = 'result!="ok"'  # TALLY_MAX_RESIDENT_ACCOUNTS in deploy/k8s/configmap.yaml


def sel(extra=""):
    return "{" + SEL + (", " + extra if extra else "") + "}"


def rate(metric, extra=""):
    return f"rate({metric}{sel(extra)}[{RI}])"


def quantile(q, hist, by):
    group = ", ".join(["le"] + by)
    return f"histogram_quantile({q}, sum by ({group}) ({rate(hist + '_bucket')}))"


def mean(hist, by=None):
    grp = f"sum by ({', '.join(by)}) " if by else "sum"
    return f"{grp}({rate(hist + '_sum')}) / {grp}({rate(hist + '_count')})"


def t(expr, legend):
    return {"expr": expr, "legendFormat": legend}


class Layout:
    def __init__(self):
        self.panels = []
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def _id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title):
        if self.x:
            self.y += self.row_h
            self.x = 0
        self.panels.append({
            "type": "row", "id": self._id(), "title": title, "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": [],
        })
        self.y += 1
        self.row_h = 0

    def _place(self, w, h):
        if self.x + w > 24:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def _targets(self, targets):
        out = []
        for n, tgt in enumerate(targets):
            out.append({"refId": chr(ord("A") + n), "datasource": DS, "expr": tgt["expr"],
                        "legendFormat": tgt["legendFormat"], "range": True})
        return out

    def ts(self, title, targets, unit="short", desc="", w=12, h=8, stack=False, min0=True):
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        defaults = {"unit": unit, "custom": custom}
        if min0:
            defaults["min"] = 0
        self.panels.append({
            "type": "timeseries", "id": self._id(), "title": title, "description": desc,
            "datasource": DS, "gridPos": self._place(w, h), "targets": self._targets(targets),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
        })

    def stat(self, title, expr, unit="short", desc="", red_above=None, w=4, h=4):
        steps = [{"color": "green", "value": None}]
        if red_above is not None:
            steps.append({"color": "red", "value": red_above})
        self.panels.append({
            "type": "stat", "id": self._id(), "title": title, "description": desc,
            "datasource": DS, "gridPos": self._place(w, h),
            "targets": self._targets([t(expr, title)]),
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                        "orientation": "auto", "textMode": "auto"},
        })


def build():
    L = Layout()

    L.row("Overview (whole fleet)")
    L.stat("Requests/s", f"sum({rate('tally_http_requests_total')})", "reqps")
    L.stat("5xx share", f"sum({rate('tally_http_requests_total', FIVEXX)}) / sum({rate('tally_http_requests_total')})",
           "percentunit", "Share of requests answered 5xx.", red_above=0.01)
    L.stat("Writes/s", f"sum({rate('tally_write_attempts_count')})", "ops",
           "Completed write-loop runs (deposit, withdraw, transfer).")
    L.stat("Unverifiable (range)", f"sum(increase(tally_write_outcomes_total{sel(UNVERIFIABLE)}[$__range]))",
           "short", "2002 answers whose sequence owner could not be read back: refused retryably.", red_above=1)
    L.stat("Poisoned folds (range)", f"sum(increase(tally_projection_poisoned_accounts_total{sel()}[$__range]))",
           "short", "Folds stopped on an undecodable event or a trimmed stream.", red_above=1)
    L.stat("Replicas reporting", f"count(tally_http_requests_in_flight{sel()})", "short",
           "Replicas whose /metrics this Prometheus scrapes.")

    L.row("HTTP")
    L.ts("Request rate by route", [t(f"sum by (route, method) ({rate('tally_http_requests_total')})", "{{method}} {{route}}")], "reqps")
    L.ts("Request rate by replica", [t(f"sum by (instance) ({rate('tally_http_requests_total')})", "{{instance}}")], "reqps")
    L.ts("Status classes", [t(f"sum by (status_class) ({rate('tally_http_requests_total')})", "{{status_class}}")], "reqps", stack=True)
    L.ts("Status classes by replica (non-2xx)",
         [t(f"sum by (instance, status_class) ({rate('tally_http_requests_total', NOT_2XX)})", "{{instance}} {{status_class}}")], "reqps")
    L.ts("Latency p50 by route", [t(quantile(0.5, "tally_http_request_duration_seconds", ["route"]), "{{route}}")], "s")
    L.ts("Latency p99 by route", [t(quantile(0.99, "tally_http_request_duration_seconds", ["route"]), "{{route}}")], "s")
    L.ts("Latency p99 by replica", [t(quantile(0.99, "tally_http_request_duration_seconds", ["instance"]), "{{instance}}")], "s")
    L.ts("In flight by replica", [t(f"sum by (instance) (tally_http_requests_in_flight{sel()})", "{{instance}}")], "short",
         "Requests being served. Compare with TALLY_MAX_CONCURRENT_REQUESTS.")
    L.ts("Edge admission: queued for a slot, open connections",
         [t(f"sum by (instance) (tally_http_requests_queued{sel()})", "queued {{instance}}"),
          t(f"sum by (instance) (tally_http_connections_open{sel()})", "connections {{instance}}")], "short",
         "Requests waiting (at most --max-queue-wait-ms) for an in-flight slot, and open connections against --max-connections.")
    L.ts("Edge gate: adaptive limit and connections waiting unread",
         [t(f"sum by (instance) (tally_http_gate_limit{sel()})", "limit {{instance}}"),
          t(f"sum by (instance) (tally_http_gate_active{sel()})", "active {{instance}}"),
          t(f"sum by (instance) (tally_http_gate_waiting{sel()})", "waiting {{instance}}")], "short",
         "Requests each replica works on at once (adapted from latency between --min-active-requests and "
         "--max-active-requests), the slots held, and connections whose next request waits for a slot, still unread in the kernel.")
    L.ts("Edge gate: slots taken, and waits that ran out",
         [t(f"sum by (instance) ({rate('tally_http_gate_slots_taken_total')})", "taken {{instance}}"),
          t(f"sum by (instance) ({rate('tally_http_gate_waits_expired_total')})", "ran out {{instance}}")], "reqps",
         "Gate slots taken per second (about one per request), and requests that waited --max-queue-wait-ms for a slot "
         "and were read without one (the in-flight limit then queues or sheds them). Steady non-zero: the replica is "
         "past what it can serve in that time.")
    L.ts("Edge admission: queue wait and accept pauses",
         [t(quantile(0.99, "tally_http_queue_wait_seconds", []), "queue wait p99"),
          t(f"sum by (instance) ({rate('tally_http_accept_paused_total')})", "accept paused {{instance}}"),
          t(f"sum by (instance) ({rate('tally_http_write_stalls_total')})", "write stalls {{instance}}")], "short",
         "How long admitted requests waited for a slot, how often accepting paused at the connection cap, and "
         "connections closed because their client read none of an answer for --write-stall-secs.")
    L.ts("Shed (503 at the concurrency limit)",
         [t(f"sum({rate('tally_http_requests_shed_total')})", "fleet"),
          t(f"sum by (instance) ({rate('tally_http_requests_shed_total')})", "{{instance}}")], "reqps", w=24)

    L.row("Write loop")
    L.ts("Arms taken, by arm", [t(f"sum by (arm) ({rate('tally_write_outcomes_total')})", "{{arm}}")], "ops",
         "Every arm of the write loop: success, conflict (2003, re-derive), outcome_unknown (hold the sequence), "
         "inflight_duplicate (2013), seq_ours / seq_sibling / unverifiable (verdicts on a 2002), and the rest.")
    L.ts("Arms other than success, by replica",
         [t(f"sum by (instance, arm) ({rate('tally_write_outcomes_total', NOT_SUCCESS)})", "{{instance}} {{arm}}")], "ops")
    L.ts("Arms by operation", [t(f"sum by (operation, arm) ({rate('tally_write_outcomes_total')})", "{{operation}} {{arm}}")], "ops")
    L.ts("Store attempts per write",
         [t(quantile(0.5, "tally_write_attempts", ["operation"]), "p50 {{operation}}"),
          t(quantile(0.99, "tally_write_attempts", ["operation"]), "p99 {{operation}}"),
          t(mean("tally_write_attempts", ["operation"]), "mean {{operation}}")], "short",
         "1 is a write that landed first time; more means conflicts, timeouts or 2013s.")
    L.ts("Events per store write (hot-account batching)",
         [t(quantile(0.5, "tally_write_batch_events", []), "p50"),
          t(quantile(0.99, "tally_write_batch_events", []), "p99"),
          t(mean("tally_write_batch_events"), "mean")], "short")
    L.ts("Mean attempts per write, by replica",
         [t(mean("tally_write_attempts", ["instance"]), "{{instance}}")], "short")
    L.ts("Write-side refusals (503, nothing sent), by limit",
         [t(f"sum by (reason) ({rate('tally_write_refused_total')})", "{{reason}}")], "ops",
         "live_writes: --max-live-writes reached; account_queue: a hot account's queue at "
         "--max-queued-writes-per-account; queued_past_deadline: a write waited its whole deadline in the queue.")
    L.ts("Live writes by replica", [t(f"sum by (instance) (tally_write_live{sel()})", "{{instance}}")], "short",
         "Requests alive on the write side (running, queued or coalesced), including writes whose caller left. "
         "Compare with --max-live-writes.")

    L.row("Idempotency")
    L.ts("Idempotency events",
         [t(f"sum({rate('tally_idempotency_replays_total')})", "replays (original response)"),
          t(f"sum({rate('tally_idempotency_key_reuse_total')})", "key reuse refused"),
          t(f"sum({rate('tally_idempotency_keys_minted_total')})", "keys minted (no Idempotency-Key)"),
          t(f"sum({rate('tally_idempotency_coalesced_total')})", "coalesced duplicates"),
          t(f"sum({rate('tally_write_answers_late_total')})", "late answers (409, the write went on)")], "ops")
    L.ts("Idempotency events by replica",
         [t(f"sum by (instance) ({rate('tally_idempotency_replays_total')})", "replays {{instance}}"),
          t(f"sum by (instance) ({rate('tally_idempotency_coalesced_total')})", "coalesced {{instance}}"),
          t(f"sum by (instance) ({rate('tally_idempotency_key_reuse_total')})", "reuse {{instance}}"),
          t(f"sum by (instance) ({rate('tally_idempotency_keys_minted_total')})", "minted {{instance}}")], "ops")

    L.ts("Keys remembered past the window",
         [t(f"sum by (instance) (tally_idempotency_remembered_keys{sel()})", "keys {{instance}}"),
          t(f"max(tally_idempotency_remembered_keys_cap{sel()})", "cap (a replica)")], "short",
         "Keys each replica's key memory holds past the window (--idempotency-retention), and the replica-wide cap (--idempotency-max-keys).")
    L.ts("Keys forgotten by a cap, and remembered keys read",
         [t(f"sum by (cap) ({rate('tally_idempotency_keys_forgotten_total')})", "forgotten ({{cap}} cap)"),
          t(f"sum by (result) ({rate('tally_idempotency_remembered_reads_total')})", "read: {{result}}")], "ops",
         "Forgotten: keys dropped inside the retention to keep a cap; that account's answers state the shorter horizon. Read: the batch a remembered key points at (hit, collision with another key, expired, collided: too many keys share one fingerprint).")
    L.ts("Batches: items per batch",
         [t(quantile(0.5, "tally_batch_items", []), "p50"),
          t(quantile(0.99, "tally_batch_items", []), "p99"),
          t(f"sum({rate('tally_batch_items_count')})", "batches/s")], "short",
         "Items in one POST /api/batch, and batches a second.")
    L.ts("Batch items by result",
         [t(f"sum by (status) ({rate('tally_batch_item_results_total')})", "{{status}}")], "ops",
         "Each item's result status: 2xx, 4xx (a refusal), 409 and 503 (retryable: resend the item with its key), 5xx.")

    L.row("Holds (--holds true)")
    L.ts("Hold expiries",
         [t(f"sum({rate('tally_holds_expired_total')})", "expired (fleet)"),
          t(f"sum by (instance) ({rate('tally_holds_expired_total')})", "{{instance}}")], "ops",
         "HoldExpired events each replica wrote: by the next write's touch, a post or void of a due hold, or the sweeper.")
    L.ts("Hold sweeper passes by result",
         [t(f"sum by (result) ({rate('tally_hold_sweeps_total')})", "{{result}}")], "ops",
         "swept: expired due holds; idle: nothing due; busy: skipped while over half the live-write permits are in use "
         "(client writes first); failed: an expiry not written, tried again next pass.")

    L.row("Store (Celeriant)")
    L.ts("Store reachable, by replica", [t(f"min by (instance) (tally_store_reachable{sel()})", "{{instance}}")], "short",
         "1 while the store answers; 0 from a call that reached no node until the next answer. Writes and reads answer 503 STORE_UNAVAILABLE meanwhile (TallyStoreUnreachable).")
    L.ts("Store lost, by replica", [t(f"sum by (instance) (increase(tally_store_outages_total{sel()}[{RI}]))", "{{instance}}")], "short",
         "Times the replica lost the store. The replica's log has one WARN for each, naming the store and the error.")
    L.ts("Store requests by operation", [t(f"sum by (operation) ({rate('tally_store_requests_total')})", "{{operation}}")], "reqps")
    L.ts("Store requests by result", [t(f"sum by (operation, result) ({rate('tally_store_requests_total')})", "{{operation}} {{result}}")], "reqps")
    L.ts("Store requests not ok, by replica",
         [t(f"sum by (instance, result) ({rate('tally_store_requests_total', NOT_OK)})", "{{instance}} {{result}}")], "reqps",
         "Includes the protocol answers the write loop expects (conflicts, 2002, 2013) as well as errors.")
    L.ts("Store latency p50 / p99 by operation",
         [t(quantile(0.5, "tally_store_request_duration_seconds", ["operation"]), "p50 {{operation}}"),
          t(quantile(0.99, "tally_store_request_duration_seconds", ["operation"]), "p99 {{operation}}")], "s")
    L.ts("Store round trips per write",
         [t(quantile(0.5, "tally_store_round_trips_per_write", []), "p50"),
          t(quantile(0.99, "tally_store_round_trips_per_write", []), "p99"),
          t(mean("tally_store_round_trips_per_write"), "mean")], "short",
         "Reads and writes one write request cost. Grows when catch-up misses locality (hash reshuffles, spread).")
    L.ts("Store latency p99 by replica", [t(quantile(0.99, "tally_store_request_duration_seconds", ["instance"]), "{{instance}}")], "s")
    L.ts("Group commit: writes and accounts per store write",
         [t(mean("tally_store_write_group_size"), "writes per request (mean)"),
          t(mean("tally_store_write_aggregates"), "accounts per request (mean)"),
          t(quantile(0.99, "tally_store_write_aggregates", []), "accounts per request p99")], "short",
         "How many write-loop writes (and accounts) shared one store request; 1 when combining is off or the load is light.")
    L.ts("Group commit: combined writes split", [t(f"sum by (cause) ({rate('tally_store_write_splits_total')})", "{{cause}}")], "ops",
         "Combined writes the store refused as a whole; each member was sent again alone. cross_shard turns combining off.")

    L.row("Projection (in-memory folds)")
    L.ts("Events folded/s", [t(f"sum({rate('tally_projection_events_folded_total')})", "fleet"),
                             t(f"sum by (instance) ({rate('tally_projection_events_folded_total')})", "{{instance}}")], "ops")
    L.ts("Catch-up latency", [t(quantile(0.5, "tally_projection_catchup_duration_seconds", []), "p50"),
                              t(quantile(0.99, "tally_projection_catchup_duration_seconds", []), "p99"),
                              t(quantile(0.99, "tally_projection_catchup_duration_seconds", ["instance"]), "p99 {{instance}}")], "s")
    L.ts("Resident accounts vs cap",
         [t(f"sum by (instance) (tally_projection_resident_accounts{sel()})", "{{instance}}"),
          t("vector($resident_cap)", "cap (TALLY_MAX_RESIDENT_ACCOUNTS)")], "short",
         "Per replica, against the cap set by --max-resident-accounts (dashboard variable resident_cap).")
    L.ts("Recent-writes index entries vs cap",
         [t(f"sum by (instance) (tally_projection_index_entries{sel()})", "{{instance}}"),
          t(f"max by (instance) (tally_projection_index_entries_cap{sel()})", "cap {{instance}}")], "short",
         "Per replica, against --max-index-entries. At the cap new writes get a retryable 503 (TallyIndexNearCap warns at 80%).")
    L.ts("Writes refused: index full", [t(f"sum by (instance) ({rate('tally_writes_refused_index_full_total')})", "{{instance}}")], "ops",
         "New writes answered 503 because the recent-writes index was at its cap. Entries are never dropped early to make room.")
    L.ts("Evictions by reason", [t(f"sum by (reason) ({rate('tally_projection_evictions_total')})", "{{reason}}"),
                                 t(f"sum by (instance, reason) ({rate('tally_projection_evictions_total')})", "{{instance}} {{reason}}")], "ops",
         "idle is housekeeping; capacity means the cap is too small for this replica's share of accounts.")
    L.ts("Poisoned folds", [t(f"sum by (instance) (increase(tally_projection_poisoned_accounts_total{sel()}[{RI}]))", "{{instance}}")], "short",
         "Any value above 0 needs a look: see the TallyPoisonedAccount alert.")
    L.ts("Store went backwards", [t(f"sum by (instance, seen_by) (increase(tally_store_regressions_total{sel()}[{RI}]))", "{{instance}} {{seen_by}}")], "short",
         "The store showed fewer versions than a replica had folded (restored or replaced): see the TallyStoreWentBackwards alert.")
    L.ts("Replica stood still", [t(f"sum by (instance) (increase(tally_process_stalls_total{sel()}[{RI}]))", "{{instance}}")], "short",
         "The process was stopped or frozen past the stall threshold; keyed writes were refused retryably for a few seconds after (TallyProcessStalled).")
    L.ts("Postgres rows refused", [t(f"max by (instance) (tally_projection_rows_refused{sel()})", "{{instance}}")], "short",
         "1 while a Postgres replica serves no row because the store went backwards under them (TallyRowsRefused): an operator reconciles the rows and restarts it.")

    L.ts("Checkpoints written, by outcome", [t(f"sum by (outcome) ({rate('tally_checkpoint_writes_total')})", "{{outcome}}")], "ops",
         "A conflict means another replica wrote that checkpoint first.")
    L.ts("Cold folds from a checkpoint, by result", [t(f"sum by (result) ({rate('tally_checkpoint_loads_total')})", "{{result}}")], "ops",
         "rejected: a checkpoint that did not check against the stream, ignored (the whole stream was folded).")
    L.ts("Trims, by outcome", [t(f"sum by (outcome) ({rate('tally_trims_total')})", "{{outcome}}")], "ops",
         "Streams trimmed below a checkpoint by --retain-history-secs or tally trim.")

    L.row("Start-up and devices")
    L.ts("Start-up steps pending", [t(f"max by (instance) (tally_startup_steps_pending{sel()})", "{{instance}}")], "short",
         "Until 0 the replica answers /readyz and the API with 503; /readyz lists the steps.")
    L.ts("Start-up step attempts", [t(f"sum by (step, result) ({rate('tally_startup_step_attempts_total')})", "{{step}} {{result}}")], "ops")
    L.ts("Server-clock anchors", [t(f"sum by (instance, result) ({rate('tally_server_clock_anchors_total')})", "{{instance}} {{result}}")], "ops",
         "A failed re-anchor keeps the last anchor; readiness does not change.")
    L.ts("Device sync runs by outcome", [t(f"sum by (outcome) ({rate('tally_device_sync_runs_total')})", "{{outcome}}"),
                                         t(f"sum({rate('tally_device_sync_events_total')})", "events synced")], "ops",
         "Offline devices' runs: synced, already_synced (an earlier attempt landed), retry, refused, conflict.")

    # Issue 17: authentication and per-caller rate limits, by outcome (never by caller).
    L.row("Authentication and rate limits")
    L.ts("Token checks by outcome", [t(f"sum by (outcome) ({rate('tally_auth_requests_total')})", "{{outcome}}")], "ops",
         "API requests checked with --auth jwt: ok, missing (no token: 401), invalid (refused token: 401), "
         "forbidden (scope, account or device not granted: 403). A rise in invalid is clock skew, a rotated key or an attack.")
    L.ts("Rate-limit decisions", [t(f"sum by (outcome) ({rate('tally_rate_limit_decisions_total')})", "{{outcome}}")], "ops",
         "Authenticated requests against their caller's --rate-limit-per-caller: allowed, limited (429 with Retry-After).")
    # Watch stream (issue 16).
    L.row("Watch stream")
    L.ts("Watch streams open", [t(f"sum by (instance, stream) (tally_watch_subscribers{sel()})", "{{instance}} {{stream}}")], "short",
         "Open SSE streams per replica: account (/api/accounts/{id}/events) and all (/api/watch/stream). Capped by --watch-max-subscribers.")
    L.ts("Watch streams ended by the replica", [t(f"sum by (reason) ({rate('tally_watch_dropped_total')})", "{{reason}}")], "ops",
         "lagged: a client fell behind --watch-buffer; shutdown; feed_gap: the store's watch lost notifications; store_error; unreadable.")
    L.ts("Watch subscriptions refused", [t(f"sum by (instance, limit) ({rate('tally_watch_refused_total')})", "{{instance}} {{limit}}")], "ops",
         "503s at --watch-max-subscribers (replica) or --watch-max-per-account (account).")
    L.ts("Watch feed gaps and read failures",
         [t(f"sum by (instance) (increase(tally_watch_feed_gaps_total{sel()}[{RI}]))", "gaps {{instance}}"),
          t(f"sum by (instance) (increase(tally_watch_read_failures_total{sel()}[{RI}]))", "read failures {{instance}}")], "short",
         "Gaps: the store's watch fell behind or reconnected, and the replica re-read every watched account. Read failures: a watched account's read failed or skipped a version (10 s of them end its streams).")
    L.stat("Fault injection on", f"max(tally_fault_injection_enabled{sel()})", "short",
           "1 when any replica runs with --faults (a demo or test setting; never in production).", red_above=1)
    # The Postgres projection (issue 14). Flat at zero on the memory projection.
    L.row("Postgres projection")
    L.ts("Projection statements by kind and outcome",
         [t(f"sum by (statement, outcome) ({rate('tally_projection_db_statements_total')})", "{{statement}} {{outcome}}")], "ops",
         "load (row + index lookup in one statement), persist (a catch-up's replay), record (a write), sweep.")
    L.ts("Database round trips per write",
         [t(mean("tally_projection_db_round_trips_per_write"), "mean"),
          t(quantile(0.99, "tally_projection_db_round_trips_per_write", []), "p99")], "short",
         "Projection statements per write-loop run: 2 on the fast path (the row read with its lookup, the record).")
    L.ts("Record failures and rows behind",
         [t(f"sum by (instance) (increase(tally_projection_record_failures_total{sel()}[{RI}]))", "failed {{instance}}"),
          t(f"sum by (instance) (increase(tally_projection_rows_behind_total{sel()}[{RI}]))", "behind {{instance}}")], "short",
         "Writes that landed but whose record statement failed (answered anyway, replayed by the next catch-up), and account rows a record found below the version its write expected (the database lost a commit, or two statements of one account raced), each caught up by its writer.")
    L.ts("Scans on miss by result", [t(f"sum by (result) ({rate('tally_idempotency_scans_total')})", "{{result}}")], "ops",
         "--idempotency-scan-window (both projections): hit, miss, bounded, error. Zero when off.")
    L.ts("Index rows replayed and swept",
         [t(f"sum({rate('tally_projection_db_index_rows_replayed_total')})", "replayed"),
          t(f"sum({rate('tally_projection_db_index_rows_swept_total')})", "swept")], "ops")

    templating = {"list": [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        {"type": "query", "name": "job", "label": "Job", "datasource": DS,
         "query": {"query": "label_values(tally_http_requests_total, job)", "refId": "job"},
         "definition": "label_values(tally_http_requests_total, job)",
         "current": {}, "hide": 0, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
         "sort": 1, "regex": "", "options": []},
        {"type": "query", "name": "instance", "label": "Replica", "datasource": DS,
         "query": {"query": 'label_values(tally_http_requests_total{job=~"$job"}, instance)', "refId": "instance"},
         "definition": 'label_values(tally_http_requests_total{job=~"$job"}, instance)',
         "current": {}, "hide": 0, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
         "sort": 1, "regex": "", "options": []},
        {"type": "textbox", "name": "resident_cap", "label": "Resident-account cap", "query": RESIDENT_CAP,
         "current": {"text": RESIDENT_CAP, "value": RESIDENT_CAP}, "hide": 0,
         "options": [{"selected": True, "text": RESIDENT_CAP, "value": RESIDENT_CAP}]},
    ]}

    return {
        "title": "Tally",
        "uid": "tally-overview",
        "description": "Tally account service: HTTP, write loop, idempotency, store and in-memory projection. "
                       "Metrics defined in src/metrics.rs; generated by deploy/grafana/gen_dashboard.py.",
        "tags": ["tally", "celeriant"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": templating,
        "panels": L.panels,
    }


def render():
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--stdout"]:
        sys.stdout.write(render())
    else:
        with open(OUT, "w") as f:
            f.write(render())
        print(f"wrote {OUT}")
