//! Every Prometheus metric Tally exports, defined in one place.
//!
//! One [`Metrics`] per running instance (its own registry), so several instances in one
//! test process never mix their counts. Base units are seconds; counters end in `_total`;
//! no label ever carries an account id or an idempotency key.
//!
//! Long on purpose (the one file in `src/` over 600 lines, and `register` the one function
//! over 70): every metric, its help text and its labels sit in one list an operator or a
//! newcomer reads top to bottom, and a metric defined anywhere else would be one nobody finds.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets in seconds, from 100 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
/// Small-count buckets: attempts per write, round trips per write, events per batch.
const COUNT_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];
/// Writes or aggregates in one combined store request (up to `--combine-max-aggregates`).
const GROUP_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0];

/// Why the write side refused a request before sending anything, the values of the
/// `reason` label of `tally_write_refused_total`.
pub mod refused {
    pub const LIVE_WRITES: &str = "live_writes";
    pub const ACCOUNT_QUEUE: &str = "account_queue";
    pub const QUEUED_PAST_DEADLINE: &str = "queued_past_deadline";
    /// Read just after the replica stood still (`stall.rs`).
    pub const STALL: &str = "stall";
}

/// `outcome` of `tally_auth_requests_total`.
pub mod auth_outcome {
    pub const OK: &str = "ok";
    pub const MISSING: &str = "missing";
    pub const INVALID: &str = "invalid";
    pub const FORBIDDEN: &str = "forbidden";
    /// A missing or refused token from a peer past its failure allowance: answered 429.
    pub const PEER_LIMITED: &str = "peer_limited";
}

/// `outcome` of `tally_rate_limit_decisions_total`.
pub mod rate_outcome {
    pub const ALLOWED: &str = "allowed";
    pub const LIMITED: &str = "limited";
}

/// What a device sync run came to, the values of the `outcome` label of
/// `tally_device_sync_runs_total`.
pub mod device_outcome {
    pub const SYNCED: &str = "synced";
    pub const ALREADY_SYNCED: &str = "already_synced";
    pub const RETRY: &str = "retry";
    pub const REFUSED: &str = "refused";
    pub const CONFLICT: &str = "conflict";
}

/// Write-loop arms, the values of the `arm` label.
pub mod arm {
    pub const SUCCESS: &str = "success";
    pub const CONFLICT: &str = "conflict";
    pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";
    pub const INFLIGHT_DUPLICATE: &str = "inflight_duplicate";
    pub const SEQ_OURS: &str = "seq_ours";
    pub const SEQ_SIBLING: &str = "seq_sibling";
    pub const UNVERIFIABLE: &str = "unverifiable";
    pub const NOT_APPLIED: &str = "not_applied";
    pub const GAVE_UP: &str = "gave_up";
    pub const REJECTED: &str = "rejected";
    pub const REPLAYED: &str = "replayed";
    pub const STORE_ERROR: &str = "store_error";
    /// A run that ended because the store could not be reached (answered 503).
    pub const STORE_UNREACHABLE: &str = "store_unreachable";
    /// A first touch (an account taken as empty without a read) bounced off the version
    /// guard: the account exists. Not contention, so not counted as a conflict.
    pub const FIRST_TOUCH_BOUNCE: &str = "first_touch_bounce";

    /// Every arm, for the series that exist from start ([`super::Metrics::new`]).
    pub const ALL: [&str; 14] = [
        SUCCESS,
        CONFLICT,
        OUTCOME_UNKNOWN,
        INFLIGHT_DUPLICATE,
        SEQ_OURS,
        SEQ_SIBLING,
        UNVERIFIABLE,
        NOT_APPLIED,
        GAVE_UP,
        REJECTED,
        REPLAYED,
        STORE_ERROR,
        STORE_UNREACHABLE,
        FIRST_TOUCH_BOUNCE,
    ];
}

/// Where a replica saw the store go backwards (`tally_store_regressions_total`'s label).
pub mod seen_by {
    pub const CONFLICT: &str = "conflict";
    pub const ANCHOR: &str = "anchor";
}

/// The write operations (`Operation::name`), for the series that exist from start.
const OPERATIONS: [&str; 3] = ["deposit", "withdraw", "transfer"];
/// Eviction reasons (`projection/sweep.rs`).
const EVICTION_REASONS: [&str; 2] = ["idle", "capacity"];
/// The Postgres projection's statements (`projection/postgres`), and their outcomes.
const DB_STATEMENTS: [&str; 4] = ["load", "persist", "record", "sweep"];
const DB_OUTCOMES: [&str; 2] = ["ok", "error"];

pub struct Metrics {
    registry: Registry,
    // HTTP
    pub http_requests: IntCounterVec,
    pub http_duration: HistogramVec,
    pub http_in_flight: IntGauge,
    pub http_shed: IntCounter,
    // Write loop
    pub write_attempts: HistogramVec,
    pub write_outcomes: IntCounterVec,
    pub write_batch_events: Histogram,
    pub write_refused: IntCounterVec,
    // Devices
    pub device_sync_runs: IntCounterVec,
    pub device_sync_events: IntCounter,
    pub write_live: IntGauge,
    pub write_answer_timeouts: IntCounter,
    pub process_stalls: IntCounter,
    // Idempotency
    pub idem_replays: IntCounter,
    pub idem_key_reuse: IntCounter,
    pub idem_keys_minted: IntCounter,
    pub idem_coalesced: IntCounter,
    // Store
    pub store_requests: IntCounterVec,
    /// 1 while the store answers, 0 from a call that reached no node until the next answer.
    pub store_reachable: IntGauge,
    pub store_outages: IntCounter,
    pub store_duration: HistogramVec,
    pub store_round_trips_per_write: Histogram,
    pub store_write_group: Histogram,
    pub store_write_aggregates: Histogram,
    pub store_write_splits: IntCounterVec,
    // Projection
    pub events_folded: IntCounter,
    pub catchup_duration: Histogram,
    pub resident_accounts: IntGauge,
    pub index_entries: IntGauge,
    pub evictions: IntCounterVec,
    pub poisoned_accounts: IntCounter,
    pub store_regressions: IntCounterVec,
    pub rows_refused: IntGauge,
    // Start-up (step labels are the fixed step names: `serverClock`, `seed:<demo name>`)
    pub startup_steps_pending: IntGauge,
    pub startup_step_attempts: IntCounterVec,
    pub startup_seed_outcomes: IntCounterVec,
    pub server_clock_anchors: IntCounterVec,
    // Bounds: the recent-writes index cap
    pub index_entries_cap: IntGauge,
    pub writes_refused_index_full: IntCounter,
    // Admission at the HTTP edge
    pub http_connections: IntGauge,
    pub http_accept_paused: IntCounter,
    pub http_write_stalls: IntCounter,
    pub http_queued: IntGauge,
    pub http_queue_wait: Histogram,
    pub http_gate_limit: IntGauge,
    pub http_gate_waiting: IntGauge,
    pub http_gate_active: IntGauge,
    pub http_gate_taken: IntCounter,
    pub http_gate_waits_expired: IntCounter,
    // Authentication and rate limits: by outcome, never by caller.
    pub auth_outcomes: IntCounterVec,
    pub rate_limit_decisions: IntCounterVec,
    // Watch stream
    pub watch_subscribers: IntGaugeVec,
    pub watch_dropped: IntCounterVec,
    pub watch_refused: IntCounterVec,
    pub watch_feed_gaps: IntCounter,
    pub watch_read_failures: IntCounter,
    pub fault_injection_enabled: IntGauge,
    // The Postgres projection
    pub projection_record_failures: IntCounter,
    pub projection_rows_behind: IntCounter,
    pub projection_db_statements: IntCounterVec,
    pub projection_db_round_trips_per_write: Histogram,
    pub projection_db_rows_replayed: IntCounter,
    pub projection_db_rows_swept: IntCounter,
    pub idem_scans: IntCounterVec,
    // Batches (`http/batch.rs`)
    pub batch_items: Histogram,
    pub batch_item_results: IntCounterVec,
    // Holds (`write_loop/expiry.rs`, `write_loop/sweeper.rs`)
    pub holds_expired: IntCounter,
    pub hold_sweeps: IntCounterVec,
    // The key memory past the window (`projection/keys/`)
    pub remembered_keys: IntGauge,
    pub remembered_keys_cap: IntGauge,
    pub keys_forgotten: IntCounterVec,
    pub remembered_looks: IntCounterVec,
    // Checkpoints (`projection/checkpoint.rs`)
    pub checkpoint_writes: IntCounterVec,
    pub checkpoint_loads: IntCounterVec,
    pub trims: IntCounterVec,
}

/// Outcomes of a checkpoint write (`tally_checkpoint_writes_total{outcome}`).
pub mod checkpoint_write {
    /// Landed at the version it was guarded on.
    pub const WRITTEN: &str = "written";
    /// Another replica wrote one at that position first: nothing to do.
    pub const CONFLICT: &str = "conflict";
    /// The store refused it or did not answer; the next threshold tries again.
    pub const FAILED: &str = "failed";
    /// Not sent: the writer's own queue was full (its budget), or the fold moved on.
    pub const SKIPPED: &str = "skipped";
    pub const ALL: [&str; 4] = [WRITTEN, CONFLICT, FAILED, SKIPPED];
}

/// What a cold fold found in the checkpoint stream (`tally_checkpoint_loads_total{result}`).
pub mod checkpoint_load {
    /// Started from a checkpoint.
    pub const USED: &str = "used";
    /// No checkpoint old enough (or none at all): the whole stream was folded.
    pub const NONE: &str = "none";
    /// A checkpoint that contradicts the stream (past its tip, another commit time or batch
    /// at its version, its version trimmed away, unreadable): ignored, the whole stream folded.
    pub const REJECTED: &str = "rejected";
    /// The checkpoint stream could not be read: the whole stream was folded.
    pub const UNAVAILABLE: &str = "unavailable";
    pub const ALL: [&str; 4] = [USED, NONE, REJECTED, UNAVAILABLE];
}

/// Labels of the key memory's metrics (`tally_idempotency_keys_forgotten_total{cap}`,
/// `tally_idempotency_remembered_reads_total{result}`).
pub mod remembered {
    pub const CAP_ACCOUNT: &str = "account";
    pub const CAP_REPLICA: &str = "replica";
    pub const CAPS: [&str; 2] = [CAP_ACCOUNT, CAP_REPLICA];
    pub const HIT: &str = "hit";
    pub const COLLISION: &str = "collision";
    pub const EXPIRED: &str = "expired";
    pub const COLLIDED: &str = "collided";
    pub const RESULTS: [&str; 4] = [HIT, COLLISION, EXPIRED, COLLIDED];
}

/// Outcomes of a trim by retention (`tally_trims_total{outcome}`).
pub mod trim {
    pub const TRIMMED: &str = "trimmed";
    /// Nothing to trim: no checkpoint older than the window and the retention.
    pub const KEPT: &str = "kept";
    pub const FAILED: &str = "failed";
    pub const ALL: [&str; 3] = [TRIMMED, KEPT, FAILED];
}

impl Metrics {
    pub fn new() -> Self {
        let metrics = Self::register();
        metrics.start_at_zero();
        metrics
    }

    /// A labelled counter has no series until its first increment, and an alert on
    /// `increase(...)` never sees a series go from absent to 1 (so the first
    /// regression of a store would never page). The series the alerts read start at 0.
    fn start_at_zero(&self) {
        for op in OPERATIONS {
            for a in arm::ALL {
                self.write_outcomes.with_label_values(&[op, a]);
            }
        }
        for s in [seen_by::CONFLICT, seen_by::ANCHOR] {
            self.store_regressions.with_label_values(&[s]);
        }
        for reason in [
            refused::LIVE_WRITES,
            refused::ACCOUNT_QUEUE,
            refused::QUEUED_PAST_DEADLINE,
            refused::STALL,
        ] {
            self.write_refused.with_label_values(&[reason]);
        }
        for reason in EVICTION_REASONS {
            self.evictions.with_label_values(&[reason]);
        }
        for outcome in checkpoint_write::ALL {
            self.checkpoint_writes.with_label_values(&[outcome]);
        }
        for result in checkpoint_load::ALL {
            self.checkpoint_loads.with_label_values(&[result]);
        }
        for outcome in trim::ALL {
            self.trims.with_label_values(&[outcome]);
        }
        for class in ["2xx", "4xx", "409", "503", "5xx"] {
            self.batch_item_results.with_label_values(&[class]);
        }
        for cap in remembered::CAPS {
            self.keys_forgotten.with_label_values(&[cap]);
        }
        for result in remembered::RESULTS {
            self.remembered_looks.with_label_values(&[result]);
        }
        for statement in DB_STATEMENTS {
            for outcome in DB_OUTCOMES {
                self.projection_db_statements
                    .with_label_values(&[statement, outcome]);
            }
        }
    }

    fn register() -> Self {
        let registry = Registry::new();
        let r = &registry;
        Self {
            http_requests: counter_vec(
                r,
                "tally_http_requests_total",
                "HTTP requests by route template, method and status class.",
                &["route", "method", "status_class"],
            ),
            http_duration: histogram_vec(
                r,
                "tally_http_request_duration_seconds",
                "HTTP request duration by route template.",
                &["route"],
                LATENCY_BUCKETS,
            ),
            http_in_flight: gauge(
                r,
                "tally_http_requests_in_flight",
                "HTTP requests being served.",
            ),
            http_shed: counter(
                r,
                "tally_http_requests_shed_total",
                "Requests refused with 503 because the concurrency limit was reached (or dropped unanswered when their client left while they waited for it).",
            ),
            write_attempts: histogram_vec(
                r,
                "tally_write_attempts",
                "Store write attempts per completed write-loop run, by operation.",
                &["operation"],
                COUNT_BUCKETS,
            ),
            write_outcomes: counter_vec(
                r,
                "tally_write_outcomes_total",
                "Write-loop arms taken, by operation and arm.",
                &["operation", "arm"],
            ),
            write_batch_events: histogram(
                r,
                "tally_write_batch_events",
                "Events sent in one store write (hot-account batching sends several).",
                COUNT_BUCKETS,
            ),
            write_refused: counter_vec(
                r,
                "tally_write_refused_total",
                "Writes refused with 503 before anything was sent, by the limit that refused them.",
                &["reason"],
            ),
            device_sync_runs: counter_vec(
                r,
                "tally_device_sync_runs_total",
                "Device sync runs by outcome (synced, already_synced, retry, refused, conflict).",
                &["outcome"],
            ),
            device_sync_events: counter(
                r,
                "tally_device_sync_events_total",
                "Events of device runs answered synced or already synced.",
            ),
            write_live: gauge(
                r,
                "tally_write_live",
                "Requests alive on the write side (running, queued or coalesced).",
            ),
            process_stalls: counter(
                r,
                "tally_process_stalls_total",
                "Times this replica stood still (stopped or frozen) past the stall threshold; keyed writes are refused retryably for a few seconds after each (src/stall.rs).",
            ),
            write_answer_timeouts: counter(
                r,
                "tally_write_answers_late_total",
                "Writes answered 409 (outcome not known yet, retry with the key) because the write loop had not answered within the request's deadline; the write went on.",
            ),
            idem_replays: counter(
                r,
                "tally_idempotency_replays_total",
                "Retries answered with the original response from the recent-writes index.",
            ),
            idem_key_reuse: counter(
                r,
                "tally_idempotency_key_reuse_total",
                "Requests refused because their key was used for another operation or payload.",
            ),
            idem_keys_minted: counter(
                r,
                "tally_idempotency_keys_minted_total",
                "Write requests that came without an Idempotency-Key, so the server minted one.",
            ),
            idem_coalesced: counter(
                r,
                "tally_idempotency_coalesced_total",
                "Concurrent duplicates on one replica that waited for the first and shared its answer.",
            ),
            store_requests: counter_vec(
                r,
                "tally_store_requests_total",
                "Store requests by operation and result.",
                &["operation", "result"],
            ),
            store_reachable: gauge(
                r,
                "tally_store_reachable",
                "1 while the event store answers; 0 from a store call that reached no node (connection refused or timed out, no leader) until the store answers again.",
            ),
            store_outages: counter(
                r,
                "tally_store_outages_total",
                "Times this replica lost the event store (tally_store_reachable went from 1 to 0).",
            ),
            store_duration: histogram_vec(
                r,
                "tally_store_request_duration_seconds",
                "Store request duration by operation.",
                &["operation"],
                LATENCY_BUCKETS,
            ),
            store_round_trips_per_write: histogram(
                r,
                "tally_store_round_trips_per_write",
                "Store round trips (reads and writes) one write request cost.",
                COUNT_BUCKETS,
            ),
            store_write_group: histogram(
                r,
                "tally_store_write_group_size",
                "Writes (one per write-loop batch) combined into one store write request.",
                GROUP_BUCKETS,
            ),
            store_write_aggregates: histogram(
                r,
                "tally_store_write_aggregates",
                "Aggregates (accounts) carried by one store write request.",
                GROUP_BUCKETS,
            ),
            store_write_splits: counter_vec(
                r,
                "tally_store_write_splits_total",
                "Combined store writes refused as a whole and sent again one write at a time, by the store's answer.",
                &["cause"],
            ),
            events_folded: counter(
                r,
                "tally_projection_events_folded_total",
                "Events applied to the in-memory fold by catch-up.",
            ),
            catchup_duration: histogram(
                r,
                "tally_projection_catchup_duration_seconds",
                "Duration of one account catch-up.",
                LATENCY_BUCKETS,
            ),
            resident_accounts: gauge(
                r,
                "tally_projection_resident_accounts",
                "Accounts currently folded in memory.",
            ),
            index_entries: gauge(
                r,
                "tally_projection_index_entries",
                "Live entries of the recent-writes index, over all resident accounts.",
            ),
            evictions: counter_vec(
                r,
                "tally_projection_evictions_total",
                "Accounts dropped from memory, by reason (idle, capacity).",
                &["reason"],
            ),
            poisoned_accounts: counter(
                r,
                "tally_projection_poisoned_accounts_total",
                "Folds that stopped on an event they could not decode, or on a trimmed stream.",
            ),
            store_regressions: counter_vec(
                r,
                "tally_store_regressions_total",
                "Times the store showed fewer versions than this replica had folded (a store restored or replaced under a running replica), by where it was seen (conflict, anchor); the folds concerned are dropped and read again.",
                &["seen_by"],
            ),
            rows_refused: gauge(
                r,
                "tally_projection_rows_refused",
                "1 while this replica serves no Postgres row because the store went backwards under them (until an operator reconciles the rows and restarts it), else 0.",
            ),
            startup_steps_pending: gauge(
                r,
                "tally_startup_steps_pending",
                "Start-up steps not done yet; the replica serves the API once this is 0.",
            ),
            startup_step_attempts: counter_vec(
                r,
                "tally_startup_step_attempts_total",
                "Start-up step attempts, by step name and result (done, failed).",
                &["step", "result"],
            ),
            startup_seed_outcomes: counter_vec(
                r,
                "tally_startup_seed_outcomes_total",
                "How demo-account seeds finished: written (acknowledged), found (an earlier \
                 or sibling write landed it), occupied (the account began otherwise).",
                &["outcome"],
            ),
            server_clock_anchors: counter_vec(
                r,
                "tally_server_clock_anchors_total",
                "Server-clock anchor attempts (start-up and periodic), by result (ok, failed).",
                &["result"],
            ),
            // Bounds: the recent-writes index cap. The cap is a gauge so that an alert reads
            // entries / cap without repeating the configured number.
            index_entries_cap: gauge(
                r,
                "tally_projection_index_entries_cap",
                "The most recent-writes index entries this replica holds before it refuses new writes (--max-index-entries).",
            ),
            writes_refused_index_full: counter(
                r,
                "tally_writes_refused_index_full_total",
                "New writes refused with a retryable 503 because the recent-writes index was at its cap.",
            ),
            // Admission at the HTTP edge. Refusals themselves are counted in
            // tally_http_requests_shed_total.
            http_connections: gauge(
                r,
                "tally_http_connections_open",
                "Client connections open (at most --max-connections).",
            ),
            http_accept_paused: counter(
                r,
                "tally_http_accept_paused_total",
                "Times the server stopped accepting because --max-connections were open.",
            ),
            http_write_stalls: counter(
                r,
                "tally_http_write_stalls_total",
                "Connections closed because their client took none of an answer for --write-stall-secs.",
            ),
            http_queued: gauge(
                r,
                "tally_http_requests_queued",
                "Requests waiting for an in-flight slot (over --max-concurrent-requests).",
            ),
            http_queue_wait: histogram(
                r,
                "tally_http_queue_wait_seconds",
                "Time a request over --max-concurrent-requests waited for a slot, admitted or shed.",
                LATENCY_BUCKETS,
            ),
            http_gate_limit: gauge(
                r,
                "tally_http_gate_limit",
                "Requests the gate lets this replica work on at once, adapted from latency between --min-active-requests and --max-active-requests.",
            ),
            http_gate_waiting: gauge(
                r,
                "tally_http_gate_waiting",
                "Connections whose next request waits, unread, for a gate slot.",
            ),
            http_gate_active: gauge(
                r,
                "tally_http_gate_active",
                "Gate slots held now: requests being read or worked on (at most tally_http_gate_limit, but for a moment after it shrinks).",
            ),
            http_gate_taken: counter(
                r,
                "tally_http_gate_slots_taken_total",
                "Gate slots taken: one per request served, and one more each time a slow client gives its slot back and takes another.",
            ),
            http_gate_waits_expired: counter(
                r,
                "tally_http_gate_waits_expired_total",
                "Requests read without a gate slot after waiting --max-queue-wait-ms for one (or arriving too late in their connection's idle time to wait that long); the in-flight limit then queues or sheds them.",
            ),
            auth_outcomes: counter_vec(
                r,
                "tally_auth_requests_total",
                "API requests checked for a bearer token, by outcome (ok, missing, invalid, forbidden, peer_limited).",
                &["outcome"],
            ),
            rate_limit_decisions: counter_vec(
                r,
                "tally_rate_limit_decisions_total",
                "Authenticated requests checked against their caller's rate limit, by outcome (allowed, limited).",
                &["outcome"],
            ),
            // Watch stream
            watch_subscribers: gauge_vec(
                r,
                "tally_watch_subscribers",
                "Watch streams open on this replica, by stream (account, all).",
                &["stream"],
            ),
            watch_dropped: counter_vec(
                r,
                "tally_watch_dropped_total",
                "Watch streams the replica ended, by reason (lagged, stalled, shutdown, feed_gap, store_error, unreadable).",
                &["reason"],
            ),
            watch_refused: counter_vec(
                r,
                "tally_watch_refused_total",
                "Watch subscriptions refused at a limit, by limit (replica, account, caller).",
                &["limit"],
            ),
            watch_feed_gaps: counter(
                r,
                "tally_watch_feed_gaps_total",
                "Times the store's watch feed fell behind or reconnected, so the replica resynced by reading.",
            ),
            watch_read_failures: counter(
                r,
                "tally_watch_read_failures_total",
                "Reads of a watched account that failed or showed a missing version; an account whose reads fail for 10 s ends its streams.",
            ),
            fault_injection_enabled: gauge(
                r,
                "tally_fault_injection_enabled",
                "1 when the replica runs with --faults (the console shows its fault panel then), else 0.",
            ),
            // The Postgres projection. Zero on the memory projection.
            projection_record_failures: counter(
                r,
                "tally_projection_record_failures_total",
                "Writes that landed in the store but whose record statement failed (answered anyway; the next catch-up replays them).",
            ),
            projection_rows_behind: counter(
                r,
                "tally_projection_rows_behind_total",
                "Account rows a write's record found below the version the write expected (the database lost a commit, or two statements of one account raced); the writer caught each up before answering.",
            ),
            projection_db_statements: counter_vec(
                r,
                "tally_projection_db_statements_total",
                "Postgres projection statements, by statement (load, persist, record, sweep) and outcome (ok, error).",
                &["statement", "outcome"],
            ),
            projection_db_round_trips_per_write: histogram(
                r,
                "tally_projection_db_round_trips_per_write",
                "Postgres projection statements per write-loop run (one request, or one batch of a hot account's requests).",
                COUNT_BUCKETS,
            ),
            projection_db_rows_replayed: counter(
                r,
                "tally_projection_db_index_rows_replayed_total",
                "Recent-writes index rows a catch-up persisted for events it replayed inside the window.",
            ),
            projection_db_rows_swept: counter(
                r,
                "tally_projection_db_index_rows_swept_total",
                "Expired recent-writes index rows deleted by the background sweep.",
            ),
            idem_scans: counter_vec(
                r,
                "tally_idempotency_scans_total",
                "Scans on miss (--idempotency-scan-window) by result: hit, miss, bounded (gave up at the page bound).",
                &["result"],
            ),
            batch_items: histogram(
                r,
                "tally_batch_items",
                "Items in one POST /api/batch that passed the batch's own checks.",
                &[
                    1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 10_000.0,
                ],
            ),
            batch_item_results: counter_vec(
                r,
                "tally_batch_item_results_total",
                "Batch items by the status of their result: 2xx, 4xx (a refusal), 409 and 503 (retryable), 5xx.",
                &["status"],
            ),
            holds_expired: counter(
                r,
                "tally_holds_expired_total",
                "Hold expiries this replica wrote that landed (by a write's touch or by the sweeper).",
            ),
            hold_sweeps: counter_vec(
                r,
                "tally_hold_sweeps_total",
                "Hold sweeper passes by result: idle (nothing due), swept, busy (skipped: the write side was busy), failed.",
                &["result"],
            ),
            remembered_keys: gauge(
                r,
                "tally_idempotency_remembered_keys",
                "Keys remembered past the window, over all resident accounts.",
            ),
            remembered_keys_cap: gauge(
                r,
                "tally_idempotency_remembered_keys_cap",
                "The most keys this replica remembers past the window (--idempotency-max-keys).",
            ),
            keys_forgotten: counter_vec(
                r,
                "tally_idempotency_keys_forgotten_total",
                "Keys forgotten inside the retention to keep a cap, by cap: account or replica. The horizon stated on that account's answers shrinks.",
                &["cap"],
            ),
            remembered_looks: counter_vec(
                r,
                "tally_idempotency_remembered_reads_total",
                "Store reads of a batch a remembered key points at, by result: hit, collision (another key's batch), expired (past the retention), collided (too many keys share the fingerprint; retryable).",
                &["result"],
            ),
            checkpoint_writes: counter_vec(
                r,
                "tally_checkpoint_writes_total",
                "Checkpoint writes by outcome: written, conflict (another replica wrote that position), failed, skipped (the writer's budget was full).",
                &["outcome"],
            ),
            checkpoint_loads: counter_vec(
                r,
                "tally_checkpoint_loads_total",
                "Cold folds by what the checkpoint stream gave: used, none, rejected (contradicts the stream: whole fold), unavailable (whole fold).",
                &["result"],
            ),
            trims: counter_vec(
                r,
                "tally_trims_total",
                "Account streams trimmed below a checkpoint by retention, by outcome: trimmed, kept (nothing old enough), failed.",
                &["outcome"],
            ),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        // Encoding into a Vec only fails on a malformed metric family, which the fixed
        // definitions above rule out; an empty scrape is the safe answer if it ever does.
        if encoder.encode(&self.registry.gather(), &mut buf).is_err() {
            buf.clear();
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Counts one write-loop arm.
    pub fn arm(&self, operation: &str, arm: &str) {
        self.write_outcomes
            .with_label_values(&[operation, arm])
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

// The definitions above are fixed, so registration can only fail on a duplicate name, which
// is a programming error caught by the first test that builds a `Metrics`.
fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid counter definition");
    r.register(Box::new(c.clone())).expect("unique metric name");
    c
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter definition");
    r.register(Box::new(c.clone())).expect("unique metric name");
    c
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid gauge definition");
    r.register(Box::new(g.clone())).expect("unique metric name");
    g
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid gauge definition");
    r.register(Box::new(g.clone())).expect("unique metric name");
    g
}

fn histogram(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid histogram definition");
    r.register(Box::new(h.clone())).expect("unique metric name");
    h
}

fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid histogram definition");
    r.register(Box::new(h.clone())).expect("unique metric name");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_registers_once_and_renders() {
        let m = Metrics::new();
        m.arm("deposit", arm::SUCCESS);
        m.http_requests
            .with_label_values(&["/healthz", "GET", "2xx"])
            .inc();
        let text = m.render();
        assert!(
            text.contains("tally_write_outcomes_total{arm=\"success\",operation=\"deposit\"} 1")
        );
        assert!(text.contains("tally_http_requests_total"));
    }
}
