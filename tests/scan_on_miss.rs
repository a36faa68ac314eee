//! Scan on miss (issue 14), on both projections: a retry older than the recent-writes
//! window, but inside `--idempotency-scan-window`, is found in the account's own batches and
//! answered like any replay, with the original response; past the scan window it is a new
//! write; a different operation under the key is refused. The Postgres half runs when
//! `TALLY_TEST_POSTGRES_URL` is set (see `common::pg`).

mod common;

use std::sync::Arc;

use common::{TestApp, new_account, pg, spawn, test_config};
use reqwest::StatusCode;
use tally::projection::ManualClock;
use tally::store::SharedLog;
use tally::store::memory::{MemoryLog, MemoryOptions, ServerClock};

const T0: u64 = 7_000_000_000;

struct Clocks {
    server: Arc<ServerClock>,
    local: Arc<ManualClock>,
}

impl Clocks {
    fn advance(&self, ms: u64) {
        self.server.advance(ms);
        self.local.advance_ms(ms);
    }
}

/// One replica with a 60 s index window and a 600 s scan window, on `projection_flags`.
async fn replica(projection_flags: &[String], scan: bool) -> (TestApp, Clocks) {
    let server = Arc::new(ServerClock::new(T0));
    let store: SharedLog = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: server.clone(),
        ..MemoryOptions::default()
    }));
    let local = Arc::new(ManualClock::new(0));
    let mut flags: Vec<String> = projection_flags.to_vec();
    flags.extend(["--idempotency-window".into(), "60".into()]);
    if scan {
        flags.extend(["--idempotency-scan-window".into(), "600".into()]);
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let t = spawn(test_config(&flags), Some(store), Some(local.clone())).await;
    t.app.started().await;
    (t, Clocks { server, local })
}

fn answer(r: &common::Reply) -> (i64, u64) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    (
        r.body["balanceCents"].as_i64().expect("balance"),
        r.body["aggregateVersion"].as_u64().expect("version"),
    )
}

fn scans(t: &TestApp, result: &str) -> u64 {
    t.app.metrics.idem_scans.with_label_values(&[result]).get()
}

async fn a_late_retry_inside_the_scan_window_is_replayed(flags: Vec<String>) {
    let (t, clocks) = replica(&flags, true).await;
    let account = new_account();
    let first = t.deposit(&account, 100, Some("scan-1")).await;
    assert_eq!(answer(&first), (100, 1));
    assert_eq!(
        answer(&t.deposit(&account, 50, Some("scan-2")).await),
        (150, 2)
    );
    // Past the index window, well inside the scan window.
    clocks.advance(120_000);
    assert_eq!(
        answer(&t.deposit(&account, 7, Some("scan-3")).await),
        (157, 3)
    );
    let retry = t.deposit(&account, 100, Some("scan-1")).await;
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(
        retry.body, first.body,
        "the original response, not the current balance"
    );
    assert_eq!(t.balance(&account).await, (157, 3), "written once");
    assert!(scans(&t, "hit") >= 1);
    // The same key for another operation is refused, as from the index.
    let reused = t.deposit(&account, 101, Some("scan-1")).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reused.text
    );
    // Past the scan window too: the key is forgotten, a new write.
    clocks.advance(600_000);
    let late = t.deposit(&account, 100, Some("scan-1")).await;
    assert!(!late.replayed(), "{}", late.text);
    assert_eq!(answer(&late), (257, 4));
}

async fn without_the_flag_a_retry_past_the_window_writes_again(flags: Vec<String>) {
    let (t, clocks) = replica(&flags, false).await;
    let account = new_account();
    assert_eq!(
        answer(&t.deposit(&account, 100, Some("plain-1")).await),
        (100, 1)
    );
    clocks.advance(120_000);
    let retry = t.deposit(&account, 100, Some("plain-1")).await;
    assert!(!retry.replayed(), "{}", retry.text);
    assert_eq!(answer(&retry), (200, 2));
    assert_eq!(scans(&t, "miss") + scans(&t, "hit"), 0, "no scan when off");
}

/// Rule (scan on miss, memory projection).
#[tokio::test]
async fn memory_a_late_retry_inside_the_scan_window_is_replayed() {
    a_late_retry_inside_the_scan_window_is_replayed(Vec::new()).await;
}

/// Rule (scan on miss is opt-in, memory projection).
#[tokio::test]
async fn memory_without_the_flag_a_retry_past_the_window_writes_again() {
    without_the_flag_a_retry_past_the_window_writes_again(Vec::new()).await;
}

/// Rule (scan on miss, Postgres projection).
#[tokio::test]
async fn postgres_a_late_retry_inside_the_scan_window_is_replayed() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    a_late_retry_inside_the_scan_window_is_replayed(pg::flags(&url)).await;
}

/// Rule (scan on miss is opt-in, Postgres projection).
#[tokio::test]
async fn postgres_without_the_flag_a_retry_past_the_window_writes_again() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    without_the_flag_a_retry_past_the_window_writes_again(pg::flags(&url)).await;
}
