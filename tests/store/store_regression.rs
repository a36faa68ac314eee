//! A store that went backwards under a running replica (restored from a backup, or replaced
//! by an empty one): the replica's folds are ahead of it, and must not decide writes once
//! other writers take the stream back up to their versions (on Celeriant, else a
//! withdrawal could answer 200 and take the store's balance below zero). See
//! `src/projection/regress.rs`.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use common::{TestApp, new_account, spawn, test_config};
use parking_lot::RwLock;
use reqwest::StatusCode;
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreResult,
};
use tokio::sync::Notify;

/// A store whose contents can be replaced under the replica using it; once armed, its next
/// read, done, waits for `go` before it answers (signalling `reached` first). A write to the
/// aggregate in `write_armed` waits for `go` (after `reached`) before it is sent at all, so
/// it lands on whatever store is current then.
struct Replaceable {
    inner: RwLock<SharedLog>,
    armed: AtomicBool,
    write_armed: parking_lot::Mutex<Option<u128>>,
    reached: Notify,
    go: Notify,
}

impl Replaceable {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: RwLock::new(Arc::new(MemoryLog::new())),
            armed: AtomicBool::new(false),
            write_armed: parking_lot::Mutex::new(None),
            reached: Notify::new(),
            go: Notify::new(),
        })
    }

    /// Swaps in an empty store and returns it.
    fn replace_with_empty(&self) -> SharedLog {
        let fresh: SharedLog = Arc::new(MemoryLog::new());
        *self.inner.write() = fresh.clone();
        fresh
    }

    fn current(&self) -> SharedLog {
        self.inner.read().clone()
    }
}

#[async_trait]
impl EventLog for Replaceable {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        let held = {
            let mut armed = self.write_armed.lock();
            let hit = writes.iter().any(|w| Some(w.key.aggregate_id) == *armed);
            if hit {
                *armed = None;
            }
            hit
        };
        if held {
            self.reached.notify_one();
            self.go.notified().await;
        }
        self.current().write(client, writes).await
    }
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let page = self.current().read(key, filter).await;
        if self.armed.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            self.go.notified().await;
        }
        page
    }
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.current().details(key).await
    }
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.current().trim_start(key, keep_from_version).await
    }
}

/// The memory fold's rule alone: on Postgres the shared rows are not moved backwards (the
/// docs/stores.md says what an operator does there), so the suite's Postgres pass skips these.
fn memory_only() -> bool {
    let on_postgres = common::pg::suite_on_postgres();
    if on_postgres {
        eprintln!("memory projection only: Postgres rows are not moved backwards");
    }
    on_postgres
}

fn answer(r: &common::Reply) -> (i64, u64) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    (
        r.body["balanceCents"].as_i64().expect("balance"),
        r.body["aggregateVersion"].as_u64().expect("version"),
    )
}

/// A re-anchor as the start-up runner makes it: the clock probe, then the store checks.
async fn anchor(t: &TestApp) {
    t.app.projection.sync_server_clock().await.expect("probe");
    t.app.projection.check_store().await;
}

fn regressions(t: &TestApp, seen_by: &str) -> u64 {
    t.app
        .metrics
        .store_regressions
        .with_label_values(&[seen_by])
        .get()
}

/// An old replica (with `flags`) whose fold of `account` holds 5 deposits of 1,000 (version
/// 5), on a store that is then replaced by an empty one; and a fresh replica on the new store.
async fn old_fold_then_empty_store(account: &str) -> (TestApp, TestApp, SharedLog) {
    old_replica_then_empty_store(account, &[]).await
}

/// [`old_replica_then_empty_store`] with the old replica on the Postgres projection (a
/// fresh database), and its flags; `None` without a test Postgres.
async fn on_postgres_old_replica_then_empty_store(
    account: &str,
) -> Option<(TestApp, TestApp, SharedLog, Vec<String>)> {
    let url = common::pg::fresh_url().await?;
    let flags = common::pg::flags(&url);
    let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (old, fresh, store) = old_replica_then_empty_store(account, &refs).await;
    Some((old, fresh, store, flags))
}

async fn old_replica_then_empty_store(
    account: &str,
    flags: &[&str],
) -> (TestApp, TestApp, SharedLog) {
    let store = Replaceable::new();
    let old = spawn(test_config(flags), Some(store.clone()), None).await;
    old.app.started().await;
    for _ in 0..5 {
        old.deposit(account, 1_000, None).await;
    }
    assert_eq!(old.balance(account).await, (5_000, 5));
    // A long-lived store: the server-clock aggregate has seen many probes.
    for _ in 0..5 {
        anchor(&old).await;
    }
    let fresh_store = store.replace_with_empty();
    let fresh = spawn(test_config(&[]), Some(fresh_store.clone()), None).await;
    fresh.app.started().await;
    (old, fresh, fresh_store)
}

/// Rule: a conflict whose current version is below the one the write expected means the
/// store went backwards; the fold is dropped and read again, and the write is decided
/// against what the store holds (before: a 409 on every attempt, then 200s on a balance
/// the store did not have once its versions came back up).
#[tokio::test]
async fn a_conflict_below_the_folded_version_folds_the_account_again() {
    if memory_only() {
        return;
    }
    let account = new_account();
    let (old, fresh, _) = old_fold_then_empty_store(&account).await;
    for _ in 0..2 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    assert_eq!(answer(&old.deposit(&account, 7, None).await), (9, 3));
    assert_eq!(regressions(&old, "conflict"), 1);
    let overdraw = old.withdraw(&account, 3_000, None).await;
    assert_eq!(
        overdraw.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        overdraw.text
    );
    assert_eq!(fresh.balance(&account).await, (9, 3));
}

/// Rule: the server-clock probe landing at a lower version than an earlier one means the
/// whole store went backwards; every fold is dropped, so an account whose versions were
/// written back up to the fold's by others is decided against the store (before: the write
/// at the fold's version passed the guard, answered 200 on the old balance).
#[tokio::test]
async fn a_probe_below_an_earlier_one_drops_every_fold() {
    if memory_only() {
        return;
    }
    let account = new_account();
    let (old, fresh, _) = old_fold_then_empty_store(&account).await;
    for _ in 0..5 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
    assert_eq!(
        old.app.metrics.rows_refused.get(),
        0,
        "memory: no rows to refuse"
    );
    assert_eq!(answer(&old.deposit(&account, 7, None).await), (12, 6));
    let overdraw = old.withdraw(&account, 3_000, None).await;
    assert_eq!(
        overdraw.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        overdraw.text
    );
    // Once: the next probes count up from the new store's version.
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
}

/// Rule: a store replaced by an empty one is caught at the next anchor by its epoch, however
/// few probes either store has seen (the probe versions alone cannot tell a young old store
/// from a new one): every fold is dropped, and the write is decided against the new store.
/// The checks take their baseline as soon as the start-up anchor is done, so this holds for
/// a store replaced before the first re-anchor too (before, that re-anchor took the new
/// store's epoch as its baseline and the old fold went on deciding writes).
#[tokio::test]
async fn a_replaced_store_is_caught_by_its_epoch_at_the_next_probe() {
    if memory_only() {
        return;
    }
    let account = new_account();
    let store = Replaceable::new();
    let old = spawn(test_config(&[]), Some(store.clone()), None).await;
    old.app.started().await;
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        old.app.projection.store_checked(1),
    )
    .await
    .expect("the start-up anchor's store check runs at once, not a re-anchor later");
    for _ in 0..5 {
        old.deposit(&account, 1_000, None).await;
    }
    let fresh = spawn(test_config(&[]), Some(store.replace_with_empty()), None).await;
    fresh.app.started().await;
    // The fresh replica's probes outnumber the old store's: only the epoch can tell.
    for _ in 0..3 {
        fresh
            .app
            .projection
            .sync_server_clock()
            .await
            .expect("probe");
    }
    for _ in 0..5 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
    assert_eq!(answer(&old.deposit(&account, 7, None).await), (12, 6));
    // The same store from then on: no second alarm.
    anchor(&old).await;
    fresh
        .app
        .projection
        .sync_server_clock()
        .await
        .expect("probe");
    assert_eq!(regressions(&old, "anchor"), 1);
    assert_eq!(regressions(&fresh, "anchor"), 0);
}

/// Rule (Postgres): the shared rows are not moved backwards by one replica; once its probe
/// sees the store went backwards, the replica serves no row (retryable 503s) rather than
/// write on a row whose version the store has reached again with other contents.
#[tokio::test]
async fn on_postgres_a_probe_below_an_earlier_one_stops_serving_rows() {
    let account = new_account();
    let Some((old, fresh, _, _)) = on_postgres_old_replica_then_empty_store(&account).await else {
        return;
    };
    for _ in 0..5 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    assert_eq!(old.app.metrics.rows_refused.get(), 0);
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
    assert_eq!(
        old.app.metrics.rows_refused.get(),
        1,
        "the operator's signal"
    );
    // Refused retryably (the write loop's load keeps failing: a 409 after its attempts).
    let deposit = old.deposit(&account, 7, None).await;
    assert_eq!(deposit.status, StatusCode::CONFLICT, "{}", deposit.text);
    assert!(deposit.header("retry-after").is_some(), "{deposit:?}");
    let read = old.get(&format!("/api/accounts/{account}/balance")).await;
    assert_eq!(
        read.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        read.text
    );
    assert_eq!(fresh.balance(&account).await, (5, 5), "nothing written");
}

/// Rule: a catch-up that read for a fold dropped in place meanwhile folds nothing into the
/// new one (its page starts past version 1 and would look like a gap, poisoning the account
/// for good); it answers a retry, and the next request folds the new store.
#[tokio::test]
async fn a_catch_up_in_flight_across_a_dropped_fold_is_a_retry_not_a_poisoned_account() {
    if memory_only() {
        return;
    }
    let account = new_account();
    let store = Replaceable::new();
    let old = spawn(test_config(&[]), Some(store.clone()), None).await;
    old.app.started().await;
    for _ in 0..2 {
        old.deposit(&account, 1_000, None).await;
    }
    anchor(&old).await;
    // A sibling moves the old stream on, so the old replica's next read has news.
    let sibling = spawn(test_config(&[]), Some(store.current()), None).await;
    sibling.app.started().await;
    answer(&sibling.deposit(&account, 1_000, None).await);
    store.armed.store(true, Ordering::SeqCst);
    let in_flight = {
        let old = Arc::new(old);
        let (o, a) = (old.clone(), account.clone());
        (
            old,
            tokio::spawn(async move { o.get(&format!("/api/accounts/{a}/balance")).await }),
        )
    };
    let (old, read) = in_flight;
    store.reached.notified().await;
    // Replaced, written back up by a fresh replica, and seen at the old one's next anchor.
    let fresh = spawn(test_config(&[]), Some(store.replace_with_empty()), None).await;
    fresh.app.started().await;
    for _ in 0..4 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
    store.go.notify_one();
    let r = read.await.expect("task");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    assert_eq!(
        old.balance(&account).await,
        (4, 4),
        "the new store, folded whole"
    );
}

/// Rule: a write decided on a fold that was dropped while it was out (the store went back
/// under it) moves no cursor when it lands: the fold read again from the new store may stand
/// at the version the write expected, but the write's balance was computed on the old store
/// (else the old replica's fold would say 500 where the store held 100, and
/// every later write there was decided on money the store did not have).
#[tokio::test]
async fn a_write_decided_before_the_fold_was_dropped_moves_no_cursor_when_it_lands() {
    if memory_only() {
        return;
    }
    let account = new_account();
    let store = Replaceable::new();
    let old = Arc::new(spawn(test_config(&[]), Some(store.clone()), None).await);
    old.app.started().await;
    for _ in 0..2 {
        old.deposit(&account, 1_000, None).await;
    }
    anchor(&old).await;
    let uuid = uuid::Uuid::parse_str(&account)
        .expect("account id")
        .as_u128();
    *store.write_armed.lock() = Some(uuid);
    let withdrawal = {
        let (o, a) = (old.clone(), account.clone());
        tokio::spawn(async move { o.withdraw(&a, 1_500, None).await })
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), store.reached.notified())
        .await
        .expect("the withdrawal's write is held");
    let fresh = spawn(test_config(&[]), Some(store.replace_with_empty()), None).await;
    fresh.app.started().await;
    answer(&fresh.deposit(&account, 1_000, None).await);
    answer(&fresh.deposit(&account, 600, None).await);
    anchor(&old).await;
    assert_eq!(regressions(&old, "anchor"), 1);
    assert_eq!(
        old.balance(&account).await,
        (1_600, 2),
        "the new store, folded"
    );
    store.go.notify_one();
    // The documented hole: the write was decided on the old store's balance, and landed.
    let w = withdrawal.await.expect("task");
    assert_eq!(w.status, StatusCode::OK, "{}", w.text);
    assert_eq!(
        fresh.balance(&account).await,
        (100, 3),
        "what the store holds"
    );
    assert_eq!(
        old.balance(&account).await,
        (100, 3),
        "the old replica folds the landing from the store, not from its own answer"
    );
}

/// Rule (Postgres): a conflict below the shared row's version stops the replica serving rows
/// too: once other writers take the store back up to the row's version, a write at it would
/// otherwise pass the guard on the row's balance.
#[tokio::test]
async fn on_postgres_a_conflict_below_the_row_stops_serving_rows() {
    let account = new_account();
    let Some((old, fresh, _, _)) = on_postgres_old_replica_then_empty_store(&account).await else {
        return;
    };
    for _ in 0..2 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    let first = old.deposit(&account, 7, None).await;
    assert!(!first.status.is_success(), "{}", first.text);
    assert_eq!(regressions(&old, "conflict"), 1);
    // The store back at the row's version: still no 2xx on the old row.
    for _ in 0..3 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    let second = old.deposit(&account, 7, None).await;
    assert!(!second.status.is_success(), "{}", second.text);
    assert!(second.header("retry-after").is_some(), "{second:?}");
    assert_eq!(
        fresh.balance(&account).await,
        (5, 5),
        "nothing written by the old replica"
    );
}

/// Rule (Postgres): the rows remember the store they were folded from, so a replica started
/// after the store was replaced under them (which never saw the old store) serves none of
/// them either (else such a replica would answer 200 on the old rows, and a
/// withdrawal would take the store's balance below zero).
#[tokio::test]
async fn on_postgres_a_replica_started_on_a_replaced_store_serves_no_row() {
    let account = new_account();
    let Some((old, fresh, new_store, flags)) =
        on_postgres_old_replica_then_empty_store(&account).await
    else {
        return;
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    for _ in 0..6 {
        answer(&fresh.deposit(&account, 1, None).await);
    }
    let late = spawn(test_config(&flags), Some(new_store), None).await;
    late.app.started().await;
    assert_eq!(regressions(&late, "anchor"), 1);
    // Every later check sees the rows' other epoch again: acted on, and counted, once.
    anchor(&late).await;
    assert_eq!(regressions(&late, "anchor"), 1);
    let withdraw = late.withdraw(&account, 3_000, None).await;
    assert!(!withdraw.status.is_success(), "{}", withdraw.text);
    let read = late.get(&format!("/api/accounts/{account}/balance")).await;
    assert_eq!(
        read.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        read.text
    );
    assert_eq!(fresh.balance(&account).await, (6, 6), "nothing written");
    drop(old);
}
