//! Scan on miss, on both projections: a retry older than the recent-writes
//! window, but inside `--idempotency-scan-window`, is found in the account's own batches and
//! answered like any replay, with the original response; past the scan window it is a new
//! write; a different operation under the key is refused. The Postgres half runs when
//! `TALLY_TEST_POSTGRES_URL` is set (see `common::pg`).

use crate::common;

use std::sync::Arc;

use common::windowed_log::{CELERIANT_WINDOW, WindowedLog, one_deposit};
use common::{TestApp, new_account, pg, spawn, test_config};
use reqwest::StatusCode;
use tally::projection::{ManualClock, SCAN_MAX_PAGES, SCAN_MAX_VERSIONS};
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

/// An embedded store on a manual server clock, and a manual local clock.
fn store_and_clocks() -> (SharedLog, Clocks) {
    let server = Arc::new(ServerClock::new(T0));
    let store: SharedLog = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: server.clone(),
        ..MemoryOptions::default()
    }));
    let local = Arc::new(ManualClock::new(0));
    (store, Clocks { server, local })
}

/// One replica with a 60 s index window and a 600 s scan window, on `projection_flags`.
async fn replica(projection_flags: &[String], scan: bool) -> (TestApp, Clocks) {
    let (store, clocks) = store_and_clocks();
    let mut flags: Vec<String> = projection_flags.to_vec();
    // Nothing remembered past the window: the scan is what finds a late retry.
    flags.extend(["--idempotency-window".into(), "60".into()]);
    flags.extend(["--idempotency-retention".into(), "60".into()]);
    if scan {
        flags.extend(["--idempotency-scan-window".into(), "600".into()]);
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let t = spawn(test_config(&flags), Some(store), Some(clocks.local.clone())).await;
    t.app.started().await;
    (t, clocks)
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

/// Two replicas (60 s index window, 600 s scan window) over one embedded store.
async fn two_replicas() -> (TestApp, TestApp, SharedLog, Clocks) {
    let (store, clocks) = store_and_clocks();
    let local = &clocks.local;
    let flags = [
        "--idempotency-window",
        "60",
        "--idempotency-scan-window",
        "600",
    ];
    let a = spawn(
        test_config(&flags),
        Some(store.clone()),
        Some(local.clone()),
    )
    .await;
    let b = spawn(
        test_config(&flags),
        Some(store.clone()),
        Some(local.clone()),
    )
    .await;
    a.app.started().await;
    b.app.started().await;
    (a, b, store, clocks)
}

/// Rule: a scan's replay is the original response on a replica that never loaded the
/// account too (its state is the empty account at version 0, below the found batch), never
/// the current balance. Else, on live Celeriant, the first such retry would get it.
#[tokio::test]
async fn memory_a_late_retry_on_a_replica_that_never_loaded_the_account_gets_the_original() {
    let (a, b, _store, clocks) = two_replicas().await;
    let account = new_account();
    let first = a.deposit(&account, 100, Some("cold-1")).await;
    assert_eq!(answer(&first), (100, 1));
    assert_eq!(
        answer(&a.deposit(&account, 20, Some("cold-2")).await),
        (120, 2)
    );
    clocks.advance(120_000);
    let retry = b.deposit(&account, 100, Some("cold-1")).await;
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(retry.body, first.body, "the original response");
    assert_eq!(b.balance(&account).await, (120, 2), "written once");
}

/// Rule: a scan that starts below a trim point reads what is left above it; it does not
/// turn every write to a trimmed account into a 409.
#[tokio::test]
async fn memory_a_scan_on_a_trimmed_account_reads_above_the_trim() {
    let (a, _b, store, clocks) = two_replicas().await;
    let account = new_account();
    for (i, key) in ["t-1", "t-2", "t-3", "t-4"].into_iter().enumerate() {
        let version = u64::try_from(i).unwrap() + 1;
        assert_eq!(
            answer(&a.deposit(&account, 10, Some(key)).await),
            (10 * version as i64, version)
        );
    }
    let key = a.app.identity.key(account.parse().unwrap());
    store.trim_start(key, 3).await.expect("trim");
    clocks.advance(120_000);
    // A new request (a miss, so scanned) and a retry of a kept batch's key.
    assert_eq!(
        answer(&a.deposit(&account, 5, Some("t-new")).await),
        (45, 5)
    );
    let retry = a.deposit(&account, 10, Some("t-4")).await;
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(answer(&retry), (40, 4));
    assert_eq!(a.balance(&account).await, (45, 5));
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

/// The account of the long-stream tests.
const LONG_ACCOUNT: &str = "00000000-0000-0000-0000-0000000005ca";

/// A replica scanning 600 s back over an account whose `3 * SCAN_MAX_VERSIONS` batches, all
/// the service's own, were committed long before the scan window (`long_ago`) or within it,
/// on a store paged in windows of `width` versions; its fold is warm (one deposit) and the
/// read count reset.
async fn long_account(width: u64, long_ago: bool) -> (TestApp, Arc<WindowedLog>) {
    let server = Arc::new(ServerClock::new(T0));
    let memory = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: server.clone(),
        ..MemoryOptions::default()
    }));
    let windowed = Arc::new(WindowedLog::new(memory.clone(), width));
    let local = Arc::new(ManualClock::new(0));
    let flags = [
        "--idempotency-window",
        "60",
        "--idempotency-scan-window",
        "600",
    ];
    let store: SharedLog = windowed.clone();
    let t = spawn(test_config(&flags), Some(store), Some(local.clone())).await;
    t.app.started().await;
    let key = t.app.identity.key(LONG_ACCOUNT.parse().unwrap());
    for seq in 1..=3 * SCAN_MAX_VERSIONS {
        let write = one_deposit(key, seq, Some(u128::from(seq)), 1);
        memory
            .write_now(t.app.identity.client(), vec![write])
            .expect("old batch");
    }
    if long_ago {
        // Far past the scan window: every batch above is out of a scan's reach.
        server.advance(3_600_000);
        local.advance_ms(3_600_000);
    }
    answer(&t.deposit(LONG_ACCOUNT, 5, Some("warm-up")).await);
    windowed.reset();
    (t, windowed)
}

/// Rule: a scan's store work is bounded by the scan window, read from the top: on a long
/// account whose batches are older than the window, a new request's miss stops at the
/// first window that reaches past it, never reading the stream from version 1.
#[tokio::test]
async fn memory_a_miss_on_a_long_account_reads_only_its_newest_versions() {
    let (t, windowed) = long_account(CELERIANT_WINDOW, true).await;
    let misses = scans(&t, "miss");
    let fresh = t.deposit(LONG_ACCOUNT, 5, Some("fresh")).await;
    assert!(!fresh.replayed(), "{}", fresh.text);
    assert_eq!(scans(&t, "miss"), misses + 1);
    assert!(
        windowed.versions_read() <= 2 * CELERIANT_WINDOW,
        "{} versions read for one miss",
        windowed.versions_read()
    );
}

/// Rule: past `SCAN_MAX_PAGES` reads a scan gives up as it always did past its cap: counted
/// `bounded`, answered as a miss (the request is new), never a store error. (Every batch
/// within the scan window, and a store paged in 100 versions: the cap comes first.)
#[tokio::test]
async fn memory_a_scan_past_its_page_cap_gives_up_as_a_miss() {
    let (t, windowed) = long_account(100, false).await;
    let bounded = scans(&t, "bounded");
    let fresh = t.deposit(LONG_ACCOUNT, 5, Some("fresh")).await;
    assert!(!fresh.replayed(), "{}", fresh.text);
    assert_eq!(answer(&fresh).1, 3 * SCAN_MAX_VERSIONS + 2);
    assert_eq!(scans(&t, "bounded"), bounded + 1);
    // Each scan window is 512 versions, five of the store's pages of 100.
    assert!(
        windowed.reads() <= SCAN_MAX_PAGES * 6 + 2,
        "{} reads",
        windowed.reads()
    );
}

/// The write loop in process over the embedded store behind a fault injector, with a 60 s
/// index window and a 600 s scan window; one account, and a deposit maker.
struct InProcess {
    svc: tally::write_loop::WriteService,
    faulty: Arc<tally::store::faults::FaultyLog>,
    clocks: Clocks,
    account: tally::account::AccountId,
}

impl InProcess {
    fn new() -> Self {
        use std::time::Duration;
        use tally::account::{AccountId, Identity};
        use tally::metrics::Metrics;
        use tally::projection::{Projection, ProjectionConfig};
        use tally::store::faults::{FaultConfig, FaultyLog};
        use tally::write_loop::{WriteConfig, WriteService};

        let (store, clocks) = store_and_clocks();
        let faulty = Arc::new(FaultyLog::new(store, FaultConfig::default()));
        let projection = Arc::new(Projection::new(
            faulty.clone(),
            Identity::default(),
            ProjectionConfig {
                window: Duration::from_secs(60),
                // Nothing remembered past the window: the scan is what finds a late retry.
                retention: Duration::from_secs(60),
                scan_window: Some(Duration::from_secs(600)),
                ..ProjectionConfig::default()
            },
            clocks.local.clone(),
            Arc::new(Metrics::new()),
        ));
        let svc = WriteService::new(
            projection,
            WriteConfig {
                batching: false,
                ..WriteConfig::default()
            },
        );
        Self {
            svc,
            faulty,
            clocks,
            account: AccountId(uuid::Uuid::new_v4()),
        }
    }

    async fn deposit(&self, cents: i64, event_id: u128) -> tally::write_loop::WriteOutcome {
        use tally::account::{AmountCents, Operation};
        let req = tally::write_loop::WriteRequest {
            op: Operation::Deposit {
                account: self.account,
                amount: AmountCents::new(cents).expect("amount"),
            },
            event_id,
        };
        self.svc.execute(req).await.expect("answered")
    }
}

/// Rule: a scan's replay carries the original body. The balance right after the found event
/// is rebuilt from a second read; a read served behind the tip ends early without an error,
/// so one that did not show every version between the found batch and the state fails the
/// attempt (the loop tries again) instead of answering a 200 with another balance.
#[tokio::test]
async fn memory_a_scan_replay_over_a_lagging_read_answers_the_original_balance() {
    let t = InProcess::new();
    let mut answers = Vec::new();
    for (i, cents) in [1, 2, 4, 8, 16].into_iter().enumerate() {
        answers.push(t.deposit(cents, 100 + i as u128).await.legs[0]);
    }
    let original = answers[2];
    assert_eq!((original.balance, original.version), (7, 3));
    t.clocks.advance(120_000);
    // The scan itself reads the tip; the read that rebuilds the balance (versions 3..=5)
    // is served two batches behind it.
    t.faulty.lag_next_read(0);
    t.faulty.lag_next_read(2);
    let retry = t.deposit(4, 102).await;
    assert!(retry.replayed);
    assert_eq!(
        (retry.legs[0].balance, retry.legs[0].version),
        (original.balance, original.version),
        "the original body, not one rebuilt from a short read"
    );
}

/// Rule: a scan draws a miss only from reads that showed every version up to the state: a
/// read served behind the tip ends early without an error, and a miss drawn from it wrote
/// the late retry again (under `--faults read-lag`).
#[tokio::test]
async fn memory_a_scan_over_a_lagging_read_never_writes_a_late_retry_again() {
    let t = InProcess::new();
    t.deposit(100, 1).await;
    let original = t.deposit(7, 2).await.legs[0];
    assert_eq!((original.balance, original.version), (107, 2));
    t.clocks.advance(120_000);
    // The scan's read of versions 1..=2 is served one batch behind: it shows version 1 only.
    t.faulty.lag_next_read(1);
    let retry = t.deposit(7, 2).await;
    assert!(retry.replayed, "{retry:?}");
    assert_eq!(
        (retry.legs[0].balance, retry.legs[0].version),
        (107, 2),
        "replayed, not written again"
    );
}
