//! Keys remembered past the window, on real `tally` processes over the live Celeriant server
//! named by `CELERIANT_ADDRESS` (unset, skipped outside CI and a failure under `CI=true`).
//!
//! Replicas A and B start first; A writes, B folds the accounts before the writes (warm but
//! stale). Once two windows have passed since the last original answer, replica C starts,
//! fresh: it never held any of the accounts. Then, on A, B and C:
//! - a retry gets the original status and body, marked replayed, and writes nothing;
//! - the same key with another amount is 422 `IDEMPOTENCY_KEY_REUSED`;
//! - the key lookup answers the same original on every replica, and an unknown key is 404;
//! - a transfer is found from either of its accounts;
//! - an account with a checkpoint gives C its keys from the checkpoint, not from a fold;
//! - a Tally replica in a mixed fleet replays a write either service landed.
//!
//! The window is short (a few seconds), so a real wait passes it. A write's whole life must fit
//! in the window (the replica refuses to start otherwise), hence the short write deadline and
//! store request timeout. The scenarios share one fleet and one wait.

use crate::common;
use crate::mixed_fleet;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::remote::Remote;
use common::{Reply, metric_sample, metric_sum, new_account};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;
use uuid::Uuid;

/// The idempotency window every replica runs with, in seconds.
const WINDOW_SECS: u64 = 3;
/// The retention: far past anything this test waits for.
const RETENTION_SECS: u64 = 600;
/// A write's life (deadline plus one store request) is 2.5 s, inside the window.
const WRITE_DEADLINE_MS: &str = "1500";
const STORE_REQUEST_TIMEOUT_MS: &str = "1000";
/// Events past a checkpoint that call for the next one: low, so one scenario reaches it.
const CHECKPOINT_EVERY_EVENTS: u64 = 8;
/// Deposits the checkpoint scenario writes: past the threshold, so A writes a checkpoint.
const CHECKPOINTED_DEPOSITS: u64 = CHECKPOINT_EVERY_EVENTS + 2;
/// Added to the two windows, so the retry is past them whatever the rounding.
const WAIT_MARGIN: Duration = Duration::from_millis(250);
/// How long a replica may take to log that it listens, and then to answer /readyz 200.
const START_BOUND: Duration = Duration::from_secs(20);
const READY_BOUND: Duration = Duration::from_secs(20);
const READY_PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// How long A's checkpoint writer may take to write the checkpoint once it is due.
const CHECKPOINT_BOUND: Duration = Duration::from_secs(10);
const METRIC_PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// Any one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Lines of each replica's log shown when the test fails.
const LOG_TAIL_LINES: usize = 20;

// --- Replicas --------------------------------------------------------------------------------

/// One `tally` process (the test profile's binary, as fleet.sh runs it here), killed when
/// dropped. Other process suites start theirs with flags of their own ([`Replica::start_with`]).
pub(crate) struct Replica {
    pub(crate) name: &'static str,
    /// Its API, as any base URL's (`get`, `post`, the keyed writes, `balance`, `history`).
    pub(crate) http: Remote,
    log: Arc<Mutex<Vec<String>>>,
    _child: tokio::process::Child,
}

impl Replica {
    /// Starts a replica on a free port over `celeriant` with this suite's window and
    /// checkpoint settings, and waits until it is ready.
    async fn start(name: &'static str, celeriant: &str) -> Replica {
        let window = WINDOW_SECS.to_string();
        let retention = RETENTION_SECS.to_string();
        let every = CHECKPOINT_EVERY_EVENTS.to_string();
        let flags = [
            ["--idempotency-window", &window],
            ["--idempotency-retention", &retention],
            ["--write-deadline-ms", WRITE_DEADLINE_MS],
            ["--celeriant-request-timeout-ms", STORE_REQUEST_TIMEOUT_MS],
            ["--checkpoint-every-events", &every],
        ]
        .concat();
        Replica::start_with(name, celeriant, &flags).await
    }

    /// Starts a replica on a free port over `celeriant` with `flags` added, and waits until
    /// it is ready.
    pub(crate) async fn start_with(name: &'static str, celeriant: &str, flags: &[&str]) -> Replica {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tally"));
        for (var, _) in std::env::vars() {
            if var.starts_with("TALLY_") || var.starts_with("CELERIANT_") || var == "RUST_LOG" {
                cmd.env_remove(var);
            }
        }
        cmd.args(["--listen", "127.0.0.1:0", "--log-format", "json"])
            .args(["--seed-demo-accounts", "false"])
            .args(["--store", "celeriant", "--celeriant-address", celeriant])
            .args(flags)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("replica {name}: tally starts: {e}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (listening_tx, listening) = tokio::sync::oneshot::channel();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        tokio::spawn(keep_lines(stdout, log.clone(), Some(listening_tx)));
        tokio::spawn(keep_lines(stderr, log.clone(), None));
        let addr = match tokio::time::timeout(START_BOUND, listening).await {
            Ok(Ok(addr)) => addr,
            _ => panic!(
                "replica {name} did not log that it listens within {START_BOUND:?}:\n{}",
                tail(&log)
            ),
        };
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .no_proxy()
            .build()
            .expect("client");
        let base = format!("http://{addr}");
        common::wait_ready(&client, &[&base], READY_BOUND, READY_PROBE_INTERVAL).await;
        Replica {
            name,
            http: Remote { base, client },
            log,
            _child: child,
        }
    }

    /// `GET /api/accounts/{account}/writes/{key}` (the keys here are UUIDs: no escaping).
    async fn lookup(&self, account: &str, key: &str) -> Reply {
        self.get(&format!("/api/accounts/{account}/writes/{key}"))
            .await
    }

    pub(crate) async fn metrics(&self) -> String {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, StatusCode::OK, "metrics on {}", self.name);
        r.text
    }
}

impl std::ops::Deref for Replica {
    type Target = Remote;

    fn deref(&self) -> &Remote {
        &self.http
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- replica {} ({}), last lines:\n{}",
                self.name,
                self.http.base,
                tail(&self.log)
            );
        }
    }
}

/// Keeps each line of a replica's output; names the address from the line saying it listens.
async fn keep_lines(
    out: impl tokio::io::AsyncRead + Unpin,
    log: Arc<Mutex<Vec<String>>>,
    mut listening: Option<tokio::sync::oneshot::Sender<String>>,
) {
    let mut lines = BufReader::new(out).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if listening.is_some()
            && let Ok(v) = serde_json::from_str::<Value>(&line)
            && v["fields"]["message"] == "tally listening"
            && let Some(addr) = v["fields"]["addr"].as_str()
            && let Some(tx) = listening.take()
        {
            let _ = tx.send(addr.to_owned());
        }
        log.lock().expect("log").push(line);
    }
}

fn tail(log: &Mutex<Vec<String>>) -> String {
    let log = log.lock().expect("log");
    log[log.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

// --- Checks ----------------------------------------------------------------------------------

fn new_key() -> String {
    Uuid::new_v4().to_string()
}

/// Asserts a first (not replayed) 200 write answer with this body.
#[track_caller]
fn assert_written(r: &Reply, body: &Value) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(&r.body, body, "answer body");
    assert!(
        !r.replayed(),
        "a first write is not a replay: {:?}",
        r.headers
    );
}

/// Asserts that `retry` on `on` is `original` replayed, both horizons stated.
#[track_caller]
fn assert_replay(original: &Reply, retry: &Reply, on: &str) {
    assert_eq!(
        (retry.status, &retry.body),
        (original.status, &original.body),
        "a retry two windows later on {on} gets the original answer: {}",
        retry.text
    );
    assert!(
        retry.replayed(),
        "marked replayed on {on}: {:?}",
        retry.headers
    );
    assert_eq!(
        retry.header("idempotency-key"),
        original.header("idempotency-key")
    );
    let window = WINDOW_SECS.to_string();
    let retention = RETENTION_SECS.to_string();
    assert_eq!(retry.header("idempotency-window"), Some(window.as_str()));
    assert_eq!(
        retry.header("idempotency-retention"),
        Some(retention.as_str())
    );
}

/// Asserts the lookup found `original` (its status and body), not marked as a replay.
#[track_caller]
fn assert_found(r: &Reply, original: &Reply, on: &str) {
    assert_eq!(r.status, StatusCode::OK, "lookup on {on}: {}", r.text);
    assert_eq!(
        r.body,
        json!({ "status": original.status.as_u16(), "body": original.body }),
        "the lookup on {on} answers the original: {}",
        original.text
    );
    assert_eq!(r.header("idempotent-replayed"), None, "lookup on {on}");
}

/// Asserts the key names no write on this account, on each replica.
async fn assert_unknown_key_is_404(replicas: &[&Replica], account: &str) {
    let unknown = new_key();
    for r in replicas {
        let answer = r.lookup(account, &unknown).await;
        assert_eq!(
            answer.status,
            StatusCode::NOT_FOUND,
            "on {}: {}",
            r.name,
            answer.text
        );
        common::assert_error(&answer, 404, "KEY_NOT_FOUND");
    }
}

/// Asserts each replica reads exactly these events (event id, type, amount), in order.
async fn assert_history(replicas: &[&Replica], account: &str, want: &[(&str, &str, i64)]) {
    for r in replicas {
        let events = r.history(account).await;
        let seen: Vec<(String, String, i64)> = events
            .iter()
            .map(|e| {
                (
                    e["eventId"].as_str().unwrap_or("").to_owned(),
                    e["type"].as_str().unwrap_or("").to_owned(),
                    e["amountCents"].as_i64().unwrap_or(0),
                )
            })
            .collect();
        let want: Vec<(String, String, i64)> = want
            .iter()
            .map(|(id, kind, cents)| (id.to_string(), kind.to_string(), *cents))
            .collect();
        assert_eq!(seen, want, "history of {account} read on {}", r.name);
    }
}

/// Polls A's metrics until its checkpoint writer has written one (the signal that the
/// checkpoint a cold replica will load exists).
async fn wait_for_a_checkpoint(a: &Replica) {
    let deadline = Instant::now() + CHECKPOINT_BOUND;
    loop {
        let text = a.metrics().await;
        if metric_sample(&text, r#"tally_checkpoint_writes_total{outcome="written"}"#) >= 1.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "A wrote no checkpoint within {CHECKPOINT_BOUND:?}: {}",
            text.lines()
                .filter(|l| l.starts_with("tally_checkpoint"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(METRIC_PROBE_INTERVAL).await;
    }
}

// --- Scenarios, before the wait --------------------------------------------------------------

/// A withdrawal on A, on an account B holds warm from before it, then a later write.
struct Withdrawal {
    account: String,
    fund: String,
    key: String,
    later: String,
    original: Reply,
}

async fn withdraw_on_a(a: &Replica, b: &Replica) -> Withdrawal {
    let (account, fund, key, later) = (new_account(), new_key(), new_key(), new_key());
    let r = a.deposit(&account, 5_000, &fund).await;
    assert_written(&r, &json!({ "balanceCents": 5_000, "aggregateVersion": 1 }));
    assert_eq!(b.balance(&account).await, (5_000, 1), "B folds it first");
    let original = a.withdraw(&account, 1_200, &key).await;
    assert_written(
        &original,
        &json!({ "balanceCents": 3_800, "aggregateVersion": 2 }),
    );
    // The account moves on: a replay must answer what the withdrawal did, not the balance now.
    let r = a.deposit(&account, 7, &later).await;
    assert_written(&r, &json!({ "balanceCents": 3_807, "aggregateVersion": 3 }));
    Withdrawal {
        account,
        fund,
        key,
        later,
        original,
    }
}

/// A transfer on A between two accounts B holds warm from before it; both move on after it.
struct Transfer {
    from: String,
    to: String,
    key: String,
    from_fund: String,
    to_fund: String,
    later_from: String,
    later_to: String,
    original: Reply,
}

async fn transfer_on_a(a: &Replica, b: &Replica) -> Transfer {
    let (from, to) = (new_account(), new_account());
    let (from_fund, to_fund) = (new_key(), new_key());
    let r = a.deposit(&from, 10_000, &from_fund).await;
    assert_written(
        &r,
        &json!({ "balanceCents": 10_000, "aggregateVersion": 1 }),
    );
    let r = a.deposit(&to, 500, &to_fund).await;
    assert_written(&r, &json!({ "balanceCents": 500, "aggregateVersion": 1 }));
    assert_eq!(
        b.balance(&from).await,
        (10_000, 1),
        "B folds the payer first"
    );
    assert_eq!(b.balance(&to).await, (500, 1), "B folds the payee first");
    let key = new_key();
    let original = a.transfer(&from, &to, 2_500, &key).await;
    assert_written(
        &original,
        &json!({
            "from": { "balanceCents": 7_500, "aggregateVersion": 2 },
            "to": { "balanceCents": 3_000, "aggregateVersion": 2 },
        }),
    );
    // Both legs move on after it: a replay must answer both legs as the transfer left them.
    let (later_from, later_to) = (new_key(), new_key());
    let r = a.withdraw(&from, 100, &later_from).await;
    assert_written(&r, &json!({ "balanceCents": 7_400, "aggregateVersion": 3 }));
    let r = a.deposit(&to, 1, &later_to).await;
    assert_written(&r, &json!({ "balanceCents": 3_001, "aggregateVersion": 3 }));
    Transfer {
        from,
        to,
        key,
        from_fund,
        to_fund,
        later_from,
        later_to,
        original,
    }
}

/// An account whose first deposit's key is below a checkpoint A wrote.
struct Checkpointed {
    account: String,
    keys: Vec<String>,
    original: Reply,
}

async fn checkpointed_on_a(a: &Replica) -> Checkpointed {
    let account = new_account();
    let keys: Vec<String> = (0..CHECKPOINTED_DEPOSITS).map(|_| new_key()).collect();
    let mut original = None;
    for (i, key) in keys.iter().enumerate() {
        let n = i as u64 + 1;
        let r = a.deposit(&account, 10, key).await;
        assert_written(
            &r,
            &json!({ "balanceCents": 10 * n as i64, "aggregateVersion": n }),
        );
        original.get_or_insert(r);
    }
    wait_for_a_checkpoint(a).await;
    Checkpointed {
        account,
        keys,
        original: original.expect("at least one deposit"),
    }
}

// --- Scenarios, two windows later ------------------------------------------------------------

/// Rule: a fresh replica loads the keys below a checkpoint with the checkpoint: the retry of
/// the account's first write replays on C, which started from the checkpoint, folded only
/// the events after it, and confirmed the key with one read of its batch.
async fn a_fresh_replica_answers_a_key_below_a_checkpoint_from_the_checkpoints_keys(
    replicas: [&Replica; 3],
    s: &Checkpointed,
) {
    let c = replicas[2];
    let before = c.metrics().await;
    let retry = c.deposit(&s.account, 10, &s.keys[0]).await;
    assert_replay(&s.original, &retry, c.name);
    let after = c.metrics().await;
    let delta = |series: &str| metric_sample(&after, series) - metric_sample(&before, series);
    assert_eq!(
        delta(r#"tally_checkpoint_loads_total{result="used"}"#),
        1.0,
        "C's cold fold started from A's checkpoint"
    );
    let folded = metric_sum(&after, "tally_projection_events_folded_total")
        - metric_sum(&before, "tally_projection_events_folded_total");
    // The checkpoint is at or past the threshold, so C folded only what lies after it: the
    // first deposit (version 1) was never folded, its key came with the checkpoint.
    assert!(
        folded <= (CHECKPOINTED_DEPOSITS - CHECKPOINT_EVERY_EVENTS) as f64,
        "C folded {folded} of {CHECKPOINTED_DEPOSITS} events: it should start from the checkpoint"
    );
    assert_eq!(
        delta(r#"tally_idempotency_remembered_reads_total{result="hit"}"#),
        1.0,
        "the key memory answered, confirmed by one read"
    );
    // The same key with another amount is still the same key.
    let reused = c.deposit(&s.account, 11, &s.keys[0]).await;
    common::assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    for r in replicas {
        assert_found(&r.lookup(&s.account, &s.keys[0]).await, &s.original, r.name);
    }
    let want: Vec<(&str, &str, i64)> = s
        .keys
        .iter()
        .map(|k| (k.as_str(), "Deposited", 10))
        .collect();
    assert_history(&replicas, &s.account, &want).await;
    let n = CHECKPOINTED_DEPOSITS;
    for r in replicas {
        assert_eq!(
            r.balance(&s.account).await,
            (10 * n as i64, n),
            "on {}",
            r.name
        );
    }
}

/// Rule: a withdrawal retried two windows later replays on the replica that wrote it, on a
/// warm one and on a fresh one; another amount under its key is refused; the lookup answers
/// the same original everywhere; nothing is written again.
async fn a_retry_two_windows_later_on_a_fresh_replica_replays_the_original(
    replicas: [&Replica; 3],
    s: &Withdrawal,
) {
    let c = replicas[2];
    let before = c.metrics().await;
    // The fresh replica first: it has never held the account.
    for r in [replicas[2], replicas[0], replicas[1]] {
        let retry = r.withdraw(&s.account, 1_200, &s.key).await;
        assert_replay(&s.original, &retry, r.name);
    }
    let after = c.metrics().await;
    let hit = r#"tally_idempotency_remembered_reads_total{result="hit"}"#;
    assert_eq!(
        metric_sample(&after, hit) - metric_sample(&before, hit),
        1.0,
        "past the window, C answers from the key memory (one confirming read)"
    );
    for r in replicas {
        let reused = r.withdraw(&s.account, 1_201, &s.key).await;
        common::assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    }
    for r in replicas {
        assert_found(&r.lookup(&s.account, &s.key).await, &s.original, r.name);
    }
    assert_unknown_key_is_404(&replicas, &s.account).await;
    assert_history(
        &replicas,
        &s.account,
        &[
            (&s.fund, "Deposited", 5_000),
            (&s.key, "Withdrawn", 1_200),
            (&s.later, "Deposited", 7),
        ],
    )
    .await;
    for r in replicas {
        assert_eq!(r.balance(&s.account).await, (3_807, 3), "on {}", r.name);
    }
}

/// Rule: a transfer retried two windows later replays both original legs on every replica,
/// by either route, and the lookup finds it from either account on every replica.
async fn a_transfer_two_windows_later_replays_and_is_found_from_either_account(
    replicas: [&Replica; 3],
    t: &Transfer,
) {
    let [a, b, c] = replicas;
    let retry = c.transfer(&t.from, &t.to, 2_500, &t.key).await;
    assert_replay(&t.original, &retry, c.name);
    let retry = b.account_transfer(&t.from, &t.to, 2_500, &t.key).await;
    assert_replay(&t.original, &retry, b.name);
    let retry = a.transfer(&t.from, &t.to, 2_500, &t.key).await;
    assert_replay(&t.original, &retry, a.name);
    let reused = c.transfer(&t.from, &t.to, 2_499, &t.key).await;
    common::assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    for r in replicas {
        for account in [&t.from, &t.to] {
            assert_found(&r.lookup(account, &t.key).await, &t.original, r.name);
        }
    }
    assert_unknown_key_is_404(&replicas, &t.from).await;
    assert_unknown_key_is_404(&replicas, &t.to).await;
    assert_history(
        &replicas,
        &t.from,
        &[
            (&t.from_fund, "Deposited", 10_000),
            (&t.key, "TransferredOut", 2_500),
            (&t.later_from, "Withdrawn", 100),
        ],
    )
    .await;
    assert_history(
        &replicas,
        &t.to,
        &[
            (&t.to_fund, "Deposited", 500),
            (&t.key, "TransferredIn", 2_500),
            (&t.later_to, "Deposited", 1),
        ],
    )
    .await;
    for r in replicas {
        assert_eq!(r.balance(&t.from).await, (7_400, 3), "on {}", r.name);
        assert_eq!(r.balance(&t.to).await, (3_001, 3), "on {}", r.name);
    }
}

// --- The test --------------------------------------------------------------------------------

/// One fleet for the scenarios, and one wait: two windows after the last original answer,
/// replica C starts and every scenario is checked on A, B and C. A Tally replica joined to
/// the replaced service (`mixed_fleet`) shares the wait. The module's name sorts first, and
/// libtest starts tests in name order: the wait overlaps the other tests' work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_two_windows_old_replays_and_is_found_on_every_replica_fresh_ones_too() {
    let Some(celeriant) = common::required::celeriant_address() else {
        return;
    };
    let (a, b) = tokio::join!(
        Replica::start("A", &celeriant),
        Replica::start("B", &celeriant)
    );
    let (window, retention) = (WINDOW_SECS.to_string(), RETENTION_SECS.to_string());
    // The mixed fleet's replica runs in process, on the embedded store's settings: a write's
    // life is its deadline alone.
    let mixed_flags = [
        "--idempotency-window",
        &window,
        "--idempotency-retention",
        &retention,
        "--write-deadline-ms",
        WRITE_DEADLINE_MS,
    ];
    let (mixed, (withdrawal, transfer, checkpointed)) = tokio::join!(
        mixed_fleet::keys_landed_by_both_services(&mixed_flags),
        async {
            let withdrawal = withdraw_on_a(&a, &b).await;
            let transfer = transfer_on_a(&a, &b).await;
            (withdrawal, transfer, checkpointed_on_a(&a).await)
        }
    );
    // A wait on time, not a synchronisation: the age of a key is the rule under test. Every
    // original answer came before this instant, so each key is then over two windows old.
    let wrote = Instant::now();
    let (_, c) = tokio::join!(
        tokio::time::sleep_until(wrote + Duration::from_secs(2 * WINDOW_SECS) + WAIT_MARGIN),
        // C starts during the wait and holds nothing yet: it only needs to be ready.
        Replica::start("C", &celeriant)
    );
    a_fresh_replica_answers_a_key_below_a_checkpoint_from_the_checkpoints_keys(
        [&a, &b, &c],
        &checkpointed,
    )
    .await;
    a_retry_two_windows_later_on_a_fresh_replica_replays_the_original([&a, &b, &c], &withdrawal)
        .await;
    a_transfer_two_windows_later_replays_and_is_found_from_either_account([&a, &b, &c], &transfer)
        .await;
    if let Some(mixed) = &mixed {
        mixed_fleet::past_its_window_a_tally_replica_in_a_mixed_fleet_replays_either_services_write(
            mixed,
        )
        .await;
    }
}
