//! The Postgres projection against a real Postgres: the throwaway cluster of
//! `scripts/with-postgres.sh` (`make test` runs every suite inside it). Each test works in a
//! fresh schema; replicas of one test share it, and share one store.
//!
//! Skipped only when `TALLY_TEST_POSTGRES_URL` is unset outside CI (see `common::pg`).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::windowed_log::one_deposit;
use common::{TestApp, hand_clocks, new_account, pg, spawn, test_config};
use reqwest::StatusCode;
use tally::account::{AccountEvent, AccountId, Identity};
use tally::metrics::Metrics;
use tally::projection::postgres::{RowLife, WARM_MAX_KEYS_PER_ACCOUNT};
use tally::projection::{
    Backend, ManualClock, PgProjection, PostgresSettings, Projection, ProjectionConfig,
    RecentWrite, RecordedWrite, Snapshot,
};
use tally::store::memory::{MemoryLog, ServerClock};
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreResult,
};
use tokio::sync::Notify;
use uuid::Uuid;

/// A replica on the Postgres projection at `url`, over `store`.
async fn replica(url: &str, store: SharedLog, extra: &[&str]) -> TestApp {
    let mut flags: Vec<String> = pg::flags(url);
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    spawn(test_config(&flags), Some(store), None).await
}

fn settings(url: &str) -> PostgresSettings {
    PostgresSettings {
        url: url.into(),
        pool_size: 4,
        statement_timeout: Duration::from_secs(5),
    }
}

fn statements(t: &TestApp, statement: &str) -> u64 {
    t.app
        .metrics
        .projection_db_statements
        .with_label_values(&[statement, "ok"])
        .get()
}

fn record_failures(t: &TestApp) -> u64 {
    t.app.metrics.projection_record_failures.get()
}

/// The account row: (balance, version).
async fn row(db: &tokio_postgres::Client, account: &str) -> Option<(i64, i64)> {
    let id: Uuid = account.parse().expect("uuid");
    db.query_opt(
        "SELECT balance_cents, version FROM tally_accounts WHERE account_id = $1",
        &[&id],
    )
    .await
    .expect("row query")
    .map(|r| (r.get(0), r.get(1)))
}

/// The index row of `key` (a UUID key is its own event id): (balance, version, expiry).
async fn index_row(
    db: &tokio_postgres::Client,
    account: &str,
    key: &str,
) -> Option<(i64, i64, i64)> {
    let id: Uuid = account.parse().expect("uuid");
    let event: Uuid = key.parse().expect("uuid key");
    db.query_opt(
        "SELECT balance_cents, version, expires_at_ms FROM tally_recent_writes
         WHERE account_id = $1 AND event_id = $2",
        &[&id, &event],
    )
    .await
    .expect("index query")
    .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// A row's lifetimes ending together at `ms`: a row as the window alone would keep it.
fn until(ms: u64) -> RowLife {
    RowLife {
        window_ends_ms: ms,
        expires_at_ms: ms,
    }
}

/// Rows to persist, each living until its own `expires_at_ms`.
fn lived(rows: Vec<(u128, RecentWrite)>) -> Vec<(u128, RecentWrite, RowLife)> {
    rows.into_iter()
        .map(|(id, w)| (id, w, until(w.expires_at_ms)))
        .collect()
}

fn key() -> String {
    Uuid::new_v4().to_string()
}

fn created(r: &common::Reply) -> (i64, u64) {
    assert!(r.status.is_success(), "{} {}", r.status, r.text);
    (
        r.body["balanceCents"].as_i64().expect("balance"),
        r.body["aggregateVersion"].as_u64().expect("version"),
    )
}

/// Rule: migrations are embedded and applied at start, once, even when several replicas
/// start against an empty database at the same moment (the advisory lock serialises them).
#[tokio::test]
async fn migrations_apply_once_when_replicas_start_together() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mut starts = Vec::new();
    for _ in 0..4 {
        let s = settings(&url);
        starts.push(tokio::spawn(async move {
            PgProjection::connect(&s, Arc::new(Metrics::new()))
                .await
                .map(|_| ())
        }));
    }
    for s in starts {
        s.await
            .expect("task")
            .expect("a replica migrates or finds the schema applied");
    }
    let db = pg::connect(&url).await;
    let applied: i64 = db
        .query_one("SELECT count(*) FROM tally_schema_migrations", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(applied, 3, "each migration once (0001 to 0003)");
    // And again later: nothing to do.
    PgProjection::connect(&settings(&url), Arc::new(Metrics::new()))
        .await
        .expect("restart");
}

/// Rule (colocation): the write path's record is one statement that moves the cursor and
/// writes the index row together; on an account this replica holds a complete warm copy
/// of, a write costs ONE database round trip (the record: no row read), and so does its
/// retry's answer (none).
#[tokio::test]
async fn a_warm_write_sends_one_statement_its_record_of_cursor_and_index_row() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let store: SharedLog = Arc::new(MemoryLog::new());
    let t = replica(&url, store, &[]).await;
    let db = pg::connect(&url).await;
    let account = new_account();
    created(&t.deposit(&account, 500, Some(&key())).await);
    let (loads, records) = (statements(&t, "load"), statements(&t, "record"));
    let k = key();
    let (balance, version) = created(&t.deposit(&account, 250, Some(&k)).await);
    assert_eq!((balance, version), (750, 2));
    assert_eq!(
        statements(&t, "load") - loads,
        0,
        "no row read: the replica's warm copy is complete"
    );
    assert_eq!(
        statements(&t, "record") - records,
        1,
        "one record statement"
    );
    assert_eq!(row(&db, &account).await, Some((750, 2)));
    let (b, v, _) = index_row(&db, &account, &k).await.expect("the index row");
    assert_eq!((b, v), (750, 2));
    // The retry is answered from the warm copy, without a statement.
    let before = (statements(&t, "load"), statements(&t, "record"));
    let r = t.deposit(&account, 250, Some(&k)).await;
    assert!(r.replayed());
    assert_eq!(created(&r), (750, 2));
    assert_eq!((statements(&t, "load"), statements(&t, "record")), before);
}

/// Two replicas on one fresh schema over one embedded store, and an account funded with
/// 1,000 through `b`.
async fn funded_pair(url: &str) -> (Arc<MemoryLog>, TestApp, TestApp, String) {
    let mem = Arc::new(MemoryLog::new());
    let a = replica(url, mem.clone(), &[]).await;
    let b = replica(url, mem.clone(), &[]).await;
    let account = new_account();
    created(&b.deposit(&account, 1_000, Some(&key())).await);
    (mem, a, b, account)
}

/// One replica on a fresh schema over an embedded store, a connection to the database, and
/// an account funded with 100 through it.
async fn funded_one(url: &str) -> (Arc<MemoryLog>, TestApp, tokio_postgres::Client, String) {
    let mem = Arc::new(MemoryLog::new());
    let a = replica(url, mem.clone(), &[]).await;
    let db = pg::connect(url).await;
    let account = new_account();
    created(&a.deposit(&account, 100, Some(&key())).await);
    (mem, a, db, account)
}

/// The retry was answered as a replay of `first`.
fn assert_replay_of(retry: &common::Reply, first: (i64, u64)) {
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(created(retry), first);
}

/// Rule (the warm copy is complete, never merely current): a replica whose copy was
/// brought up to date PAST another replica's write (by a read) holds that write's index
/// row too, so the retry landing on it is replayed, not written a second time.
#[tokio::test]
async fn a_replica_warm_past_another_replicas_write_replays_its_retry() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    // B warms first (funding the account), then A writes twice (one key to retry), then B
    // reads: B's copy now stands at A's last write, without having written anything since.
    let (mem, a, b, account) = funded_pair(&url).await;
    let k = key();
    let first = created(&a.withdraw(&account, 300, Some(&k)).await);
    created(&a.deposit(&account, 5, Some(&key())).await);
    assert_eq!(b.balance(&account).await, (705, 3));
    let loads = statements(&b, "load");
    assert_replay_of(&b.withdraw(&account, 300, Some(&k)).await, first);
    assert_eq!(statements(&b, "load"), loads, "answered from the warm copy");
    assert_eq!(a.balance(&account).await, (705, 3), "written once");
    // And a copy built cold from the database (a replica that never saw the account).
    let c = replica(&url, mem.clone(), &[]).await;
    assert_eq!(c.balance(&account).await, (705, 3));
    assert_replay_of(&c.withdraw(&account, 300, Some(&k)).await, first);
    assert_eq!(c.balance(&account).await, (705, 3), "written once");
}

/// Rule (fleet): two replicas share one database and one store; a retry landing on the
/// replica that did not write is replayed with the original answer, written once.
#[tokio::test]
async fn a_retry_on_the_replica_that_did_not_write_is_replayed() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let (_mem, a, b, account) = funded_pair(&url).await;
    let k = key();
    let first = created(&a.withdraw(&account, 300, Some(&k)).await);
    assert_replay_of(&b.withdraw(&account, 300, Some(&k)).await, first);
    // A transfer retried on the other replica too.
    let other = new_account();
    let k = key();
    let r = a.transfer(&account, &other, 100, Some(&k)).await;
    assert!(r.status.is_success(), "{}", r.text);
    let again = b.transfer(&account, &other, 100, Some(&k)).await;
    assert!(again.replayed(), "{}", again.text);
    assert_eq!(again.body, r.body);
    assert_eq!(b.balance(&account).await, (600, 3));
    assert_eq!(a.balance(&other).await, (100, 1));
    // Reusing the key for another payload is refused on either replica.
    let reused = b.transfer(&account, &other, 101, Some(&k)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reused.text
    );
    assert_eq!(reused.error_code(), "IDEMPOTENCY_KEY_REUSED");
}

/// Rule: a record statement that fails after the store accepted the write still answers
/// (logged and counted), and the next catch-up replays the event: a retry on any replica
/// then finds it.
#[tokio::test]
async fn a_failed_record_still_answers_and_the_next_catch_up_replays_it() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let a = replica(&url, mem.clone(), &[]).await;
    let b = replica(&url, mem.clone(), &[]).await;
    let db = pg::connect(&url).await;
    let account = new_account();
    created(&a.deposit(&account, 100, Some(&key())).await);
    // Every statement that writes an account row now fails.
    db.batch_execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'scripted failure'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON tally_accounts
             FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .await
    .expect("install the failing trigger");
    let k = key();
    let answered = created(&a.deposit(&account, 40, Some(&k)).await);
    assert_eq!(answered, (140, 2), "the write landed and is answered");
    assert_eq!(record_failures(&a), 1);
    assert_eq!(row(&db, &account).await, Some((100, 1)), "nothing recorded");
    assert_eq!(index_row(&db, &account, &k).await, None);
    db.batch_execute("DROP TRIGGER refuse ON tally_accounts")
        .await
        .expect("drop the trigger");
    // The next write on the replica that wrote brings the shared row up to date: it does not
    // ride a warm copy the database fell behind (its records would be guarded on a cursor
    // the database never reached, and the row would stay stale while only it wrote).
    let after = created(&a.deposit(&account, 5, Some(&key())).await);
    assert_eq!(after, (145, 3));
    assert_eq!(
        row(&db, &account).await,
        Some((145, 3)),
        "the row caught up"
    );
    assert!(
        index_row(&db, &account, &k).await.is_some(),
        "the missed row too"
    );
    // A retry on the replica that wrote (its row read is stale: the version guard sends it
    // to a catch-up, which replays the event) and on the other one.
    for t in [&a, &b] {
        let retry = t.deposit(&account, 40, Some(&k)).await;
        assert!(retry.replayed(), "{}", retry.text);
        assert_eq!(created(&retry), answered);
    }
    assert_eq!(
        mem.batch_count(Identity::default().key(AccountId(account.parse().unwrap()))),
        3
    );
    assert_eq!(row(&db, &account).await, Some((145, 3)));
}

/// Rule: a record that finds the row below the version its write expected (here the
/// database lost the commit of the record before it, as asynchronous commit allows after a
/// crash) moves nothing itself; the writer catches the row up before answering and drops
/// its copy. Kept, the copy sent every later write down the fast path, whose records were
/// all guarded on a version the row never reached, and an account not
/// written again kept a stale row.
#[tokio::test]
async fn a_row_a_record_finds_behind_is_caught_up_by_its_writer() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let (_mem, a, db, account) = funded_one(&url).await;
    let lost = key();
    assert_eq!(
        created(&a.deposit(&account, 40, Some(&lost)).await),
        (140, 2)
    );
    assert_eq!(row(&db, &account).await, Some((140, 2)));
    // The database comes back without the second record's commit.
    let id: Uuid = account.parse().expect("uuid");
    let event: Uuid = lost.parse().expect("uuid key");
    db.execute(
        "UPDATE tally_accounts SET version = 1, balance_cents = 100 WHERE account_id = $1",
        &[&id],
    )
    .await
    .expect("roll the row back");
    db.execute(
        "DELETE FROM tally_recent_writes WHERE account_id = $1 AND event_id = $2",
        &[&id, &event],
    )
    .await
    .expect("drop its index row");
    let rows_behind = || a.app.metrics.projection_rows_behind.get();
    assert_eq!(
        created(&a.deposit(&account, 5, Some(&key())).await),
        (145, 3)
    );
    assert_eq!(rows_behind(), 1, "the row was below version 2");
    assert_eq!(record_failures(&a), 0, "the statement itself succeeded");
    // The writer caught the row up before answering, with the lost index row (else
    // it would stay behind until the account's next write).
    assert_eq!(row(&db, &account).await, Some((145, 3)));
    assert!(index_row(&db, &account, &lost).await.is_some());
    // The next write lands on the caught-up row.
    assert_eq!(
        created(&a.deposit(&account, 7, Some(&key())).await),
        (152, 4)
    );
    assert_eq!(row(&db, &account).await, Some((152, 4)));
    assert_eq!(rows_behind(), 1);
}

/// A store that, once armed, holds every successful write's answer forever: the replica
/// writing through it is as good as killed between the store's ack and its record.
struct AckThenHang {
    inner: SharedLog,
    armed: AtomicBool,
    acked: Notify,
}

#[async_trait]
impl EventLog for AckThenHang {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        let r = self.inner.write(client, writes).await;
        if r.is_ok() && self.armed.load(Ordering::SeqCst) {
            self.acked.notify_one();
            std::future::pending::<()>().await;
        }
        r
    }
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.inner.read(key, filter).await
    }
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule: a replica killed between the store's ack and its record statement loses nothing:
/// the retry on another replica finds the event by catch-up and replays it.
#[tokio::test]
async fn a_replica_killed_between_ack_and_record_is_covered_by_catch_up() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let hang = Arc::new(AckThenHang {
        inner: mem.clone(),
        armed: AtomicBool::new(false),
        acked: Notify::new(),
    });
    let a = replica(&url, hang.clone(), &[]).await;
    let b = replica(&url, mem.clone(), &[]).await;
    let account = new_account();
    created(&a.deposit(&account, 100, Some(&key())).await);
    hang.armed.store(true, Ordering::SeqCst);
    let k = key();
    let request = {
        let (client, url) = (
            a.client.clone(),
            a.url(&format!("/api/accounts/{account}/deposit")),
        );
        let k = k.clone();
        tokio::spawn(async move {
            client
                .post(url)
                .header("Idempotency-Key", k)
                .json(&serde_json::json!({ "amountCents": 7 }))
                .send()
                .await
        })
    };
    hang.acked.notified().await;
    // Killed: the request and the whole replica go away without recording.
    request.abort();
    drop(a);
    let retry = b.deposit(&account, 7, Some(&k)).await;
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(created(&retry), (107, 2));
    assert_eq!(b.balance(&account).await, (107, 2));
}

/// A store that remembers where every read started.
struct ReadLog {
    inner: SharedLog,
    reads: parking_lot::Mutex<Vec<u64>>,
}

#[async_trait]
impl EventLog for ReadLog {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        self.inner.write(client, writes).await
    }
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.reads.lock().push(filter.from_version);
        self.inner.read(key, filter).await
    }
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule (warm restart): a fresh replica against a warm database answers a retry from the
/// shared rows, without re-folding the stream, and catches up only from the shared cursor.
#[tokio::test]
async fn a_fresh_replica_on_a_warm_database_answers_a_retry_without_refolding() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let a = replica(&url, mem.clone(), &[]).await;
    let account = new_account();
    let keys: Vec<String> = (0..20).map(|_| key()).collect();
    let mut answers = Vec::new();
    for k in &keys {
        answers.push(created(&a.deposit(&account, 10, Some(k)).await));
    }
    a.shutdown().await;
    let reads = Arc::new(ReadLog {
        inner: mem.clone(),
        reads: parking_lot::Mutex::new(Vec::new()),
    });
    let c = replica(&url, reads.clone(), &[]).await;
    reads.reads.lock().clear();
    let retry = c.deposit(&account, 10, Some(&keys[6])).await;
    assert!(retry.replayed(), "{}", retry.text);
    assert_eq!(created(&retry), answers[6]);
    assert_eq!(c.balance(&account).await, (200, 20));
    let from: Vec<u64> = reads.reads.lock().clone();
    assert!(
        from.iter().all(|&v| v > 20),
        "a warm database is never re-folded from the start: reads from {from:?}"
    );
}

/// The index row of `key`: (window end, expiry), both server time.
async fn row_life(db: &tokio_postgres::Client, account: &str, key: &str) -> Option<(i64, i64)> {
    let id: Uuid = account.parse().expect("uuid");
    let event: Uuid = key.parse().expect("uuid key");
    db.query_opt(
        "SELECT window_ends_ms, expires_at_ms FROM tally_recent_writes
         WHERE account_id = $1 AND event_id = $2",
        &[&id, &event],
    )
    .await
    .expect("index query")
    .map(|r| (r.get(0), r.get(1)))
}

/// A store on a server clock at `t0`, a replica-side clock at 0, and the flags of a replica
/// on `url` with a 60-second window and a 180-second retention.
fn retention_setup(url: &str, t0: u64) -> (Arc<ServerClock>, SharedLog, Vec<String>) {
    let (server, mem) = hand_clocks::store_at(t0);
    let mut flags = pg::flags(url);
    flags.extend(
        [
            "--idempotency-window",
            "60",
            "--idempotency-retention",
            "180",
        ]
        .map(String::from),
    );
    (server, mem, flags)
}

/// Rule (server time): an index row lives for the retention, not the window: its expiry is
/// the store's server time plus the retention and its window end the server time plus the
/// window, never a replica's clock (here at 0) nor the database's (today's date). Two
/// windows later its key still replays (a reused key is 422) on the replica that wrote it,
/// whose warm copy holds only the window; past the retention it is a new write, and the
/// bounded sweep deletes a row only past its retention.
#[tokio::test]
async fn index_rows_live_for_the_retention_in_server_time_and_the_sweep_keeps_them_until_then() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    const T0: u64 = 5_000_000_000;
    let (server, mem, flags) = retention_setup(&url, T0);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (t, local) = hand_clocks::spawn_on_hand_clock(&flags, mem).await;
    t.app.started().await;
    let db = pg::connect(&url).await;
    let account = new_account();
    let k = key();
    let first = created(&t.deposit(&account, 5, Some(&k)).await);
    let (window_ends, expires) = row_life(&db, &account, &k).await.expect("row");
    assert!(
        (T0 + 60_000..=T0 + 61_000).contains(&(window_ends as u64)),
        "window end {window_ends} is server time + window"
    );
    assert!(
        (T0 + 180_000..=T0 + 181_000).contains(&(expires as u64)),
        "expiry {expires} is server time + retention"
    );
    let Backend::Postgres(pg) = t.app.projection.backend() else {
        panic!("on Postgres")
    };
    let tip = || t.app.projection.server_tip_ms();
    // Two windows later (both clocks moved on): replayed from the row, and a reused key
    // refused, on the replica whose warm copy no longer holds the key.
    server.advance(120_000);
    local.advance_ms(120_000);
    let retry = t.deposit(&account, 5, Some(&k)).await;
    assert_replay_of(&retry, first);
    let reused = t.deposit(&account, 6, Some(&k)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reused.text
    );
    assert_eq!(t.balance(&account).await, (5, 1), "nothing written again");
    assert_eq!(
        pg.sweep(tip()).await.expect("sweep"),
        0,
        "inside the retention"
    );
    assert!(index_row(&db, &account, &k).await.is_some());
    // Past the retention: a new write, whose row takes the key's place with raised times.
    server.advance(61_000);
    local.advance_ms(61_000);
    let late = t.deposit(&account, 5, Some(&k)).await;
    assert!(
        !late.replayed(),
        "past the retention the key is forgotten: {}",
        late.text
    );
    assert_eq!(pg.sweep(tip()).await.expect("sweep"), 0);
    server.advance(181_000);
    local.advance_ms(181_000);
    assert_eq!(
        pg.sweep(tip()).await.expect("sweep"),
        1,
        "past its retention in server time"
    );
    assert_eq!(index_row(&db, &account, &k).await, None);
}

/// Rule: a retry two windows later on a fresh replica over the same database is answered
/// from the rows (its original answer, replayed; a reused key 422) and never writes again;
/// past the retention it is a new write.
#[tokio::test]
async fn a_retry_two_windows_later_on_a_fresh_replica_replays_from_the_rows_and_never_writes_again()
{
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    const T0: u64 = 7_000_000_000;
    let (server, mem, flags) = retention_setup(&url, T0);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (a, _) = hand_clocks::spawn_on_hand_clock(&flags, mem.clone()).await;
    let account = new_account();
    let k = key();
    let first = created(&a.deposit(&account, 40, Some(&k)).await);
    created(&a.deposit(&account, 2, Some(&key())).await);
    a.shutdown().await;
    server.advance(120_000);
    let (b, local) = hand_clocks::spawn_on_hand_clock(&flags, mem.clone()).await;
    b.app.started().await;
    let retry = b.deposit(&account, 40, Some(&k)).await;
    assert_replay_of(&retry, first);
    let reused = b.deposit(&account, 41, Some(&k)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reused.text
    );
    // Warm now: the key is past its window, so the warm copy sends it to the rows.
    assert_replay_of(&b.deposit(&account, 40, Some(&k)).await, first);
    assert_eq!(b.balance(&account).await, (42, 2), "nothing written again");
    let details = mem
        .details(Identity::default().key(AccountId(account.parse().expect("uuid"))))
        .await
        .expect("details");
    assert_eq!(
        details.max_version, 2,
        "the store holds two batches, no more"
    );
    server.advance(61_000);
    local.advance_ms(61_000);
    let late = b.deposit(&account, 40, Some(&k)).await;
    assert!(!late.replayed(), "past the retention: {}", late.text);
    assert_eq!(created(&late), (82, 3));
}

/// Rule: a catch-up persists a row for every keyed event it folds within the retention
/// (not only the window), each living from its batch's commit time: window end = commit +
/// window, expiry = commit + retention; an event past the retention gets none.
#[tokio::test]
async fn a_catch_up_persists_every_key_within_the_retention_aged_from_its_commit_time() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    const T0: u64 = 9_000_000_000;
    let (server, log) = hand_clocks::store_at(T0);
    let identity = Identity::default();
    let account = AccountId(Uuid::new_v4());
    let deposit = |seq: u64| one_deposit(identity.key(account), seq, Some(u128::from(seq)), 10);
    // Committed at T0 (past the retention by the end), T0 + 100 s (past the window, inside
    // the retention) and T0 + 190 s (inside the window); the tip ends at T0 + 200 s.
    for (seq, after) in [(1, 0), (2, 100_000), (3, 90_000)] {
        server.advance(after);
        log.write_now(identity.client(), vec![deposit(seq)])
            .expect("write");
    }
    server.advance(10_000);
    let metrics = Arc::new(Metrics::new());
    let pg = PgProjection::connect(&settings(&url), metrics.clone())
        .await
        .expect("database");
    let config = ProjectionConfig {
        window: Duration::from_secs(60),
        retention: Duration::from_secs(180),
        ..ProjectionConfig::default()
    };
    let fresh = Projection::with_postgres(
        log.clone(),
        identity,
        config,
        Arc::new(ManualClock::new(0)),
        metrics,
        pg,
    );
    fresh.sync_server_clock().await.expect("anchor");
    let loaded = fresh.refresh(account, &[1, 2, 3]).await.expect("caught up");
    assert_eq!(loaded.snap.version, 3);
    assert!(
        fresh.lookup(&loaded.view, 1).is_none(),
        "past the retention"
    );
    assert!(
        fresh.lookup(&loaded.view, 2).is_some(),
        "past the window, inside the retention"
    );
    assert!(fresh.lookup(&loaded.view, 3).is_some());
    let db = pg::connect(&url).await;
    let mut lives: Vec<(Uuid, i64, i64)> = db
        .query(
            "SELECT event_id, window_ends_ms, expires_at_ms FROM tally_recent_writes
             WHERE account_id = $1 ORDER BY version",
            &[&account.0],
        )
        .await
        .expect("rows")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let at = |ms: u64| (T0 + ms) as i64;
    let expected = vec![
        (Uuid::from_u128(2), at(160_000), at(280_000)),
        (Uuid::from_u128(3), at(250_000), at(370_000)),
    ];
    lives.sort();
    assert_eq!(
        lives, expected,
        "one row a key inside the retention, from its commit time"
    );
}

/// Rule: the cursor never moves backwards: a catch-up persisting an older fold and a
/// record whose guard no longer holds leave the row alone; the record's index rows still
/// land (they never depend on the bump).
#[tokio::test]
async fn the_shared_cursor_never_moves_backwards() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let pg = PgProjection::connect(&settings(&url), Arc::new(Metrics::new()))
        .await
        .expect("connect");
    let account = AccountId(Uuid::new_v4());
    let snap = |balance, version| Snapshot {
        balance,
        version,
        max_client_seq: version,
        generation: 0,
        ..Snapshot::default()
    };
    pg.persist(account, snap(50, 5), None, &[], 0)
        .await
        .expect("persist 5");
    pg.persist(account, snap(30, 3), None, &[], 0)
        .await
        .expect("persist 3");
    let loaded = pg.load(account, &[], 0, None).await.expect("load");
    assert_eq!(loaded.state.map(|s| s.0), Some(snap(50, 5)));
    let event = AccountEvent::Deposited { amount: 1 };
    let stale = RecordedWrite {
        expected_version: 2,
        generation: 0,
        new_version: 3,
        balance_after: 31,
        max_client_seq: 3,
        events: &[(77, 31, event)],
    };
    pg.record(
        &[tally::projection::postgres::RecordRow {
            account,
            write: &stale,
        }],
        until(1_000),
    )
    .await
    .expect("record");
    let loaded = pg.load(account, &[77], 0, None).await.expect("load");
    assert_eq!(loaded.state.map(|s| s.0), Some(snap(50, 5)));
    assert_eq!(
        loaded.hits.len(),
        1,
        "the index row landed without the bump"
    );
}

/// Rule: an index row is never taken back to an older landing of its key: a record that
/// runs late (its waiter gone), after the key was written again past its window, leaves the
/// newer row, so later retries keep getting the newer answer.
#[tokio::test]
async fn a_late_record_never_takes_an_index_row_back_to_an_older_landing() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let pg = PgProjection::connect(&settings(&url), Arc::new(Metrics::new()))
        .await
        .expect("connect");
    let account = AccountId(Uuid::new_v4());
    let key = 0x5eed_u128;
    let event = AccountEvent::Deposited { amount: 1 };
    let newer = RecentWrite {
        balance: 100,
        version: 10,
        expires_at_ms: 5_000,
        event,
        write_tag: None,
    };
    let snap = Snapshot {
        balance: 100,
        version: 10,
        max_client_seq: 10,
        generation: 0,
        ..Snapshot::default()
    };
    pg.persist(account, snap, None, &lived(vec![(key, newer)]), 0)
        .await
        .expect("persist");
    let late = RecordedWrite {
        expected_version: 2,
        generation: 0,
        new_version: 3,
        balance_after: 31,
        max_client_seq: 3,
        events: &[(key, 31, event)],
    };
    let behind = pg
        .record(
            &[tally::projection::postgres::RecordRow {
                account,
                write: &late,
            }],
            until(9_000),
        )
        .await
        .expect("record");
    assert_eq!(
        behind,
        vec![],
        "a row already past the write is not behind it"
    );
    let loaded = pg.load(account, &[key], 0, None).await.expect("load");
    let hits: Vec<(u64, i64)> = loaded
        .hits
        .iter()
        .map(|(_, w)| (w.version, w.balance))
        .collect();
    assert_eq!(hits, vec![(10, 100)], "the newer landing's row stays");
    // A record from above the row (the row lost a commit the writer counted on) reports it.
    let above = RecordedWrite {
        expected_version: 12,
        generation: 0,
        new_version: 13,
        balance_after: 130,
        max_client_seq: 13,
        events: &[(key + 1, 130, event)],
    };
    let behind = pg
        .record(
            &[tally::projection::postgres::RecordRow {
                account,
                write: &above,
            }],
            until(9_000),
        )
        .await
        .expect("record");
    assert_eq!(behind, vec![account], "the row stands below version 12");
}

/// Rule: records queued together share one statement (the database's per-statement cost
/// is paid once for many writes), each row still guarded on its own expected version; two
/// records of one account never share a statement (an upsert cannot touch a row twice).
#[tokio::test]
async fn queued_records_share_a_statement_and_never_repeat_an_account() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let metrics = Arc::new(Metrics::new());
    let pg = PgProjection::connect(&settings(&url), metrics.clone())
        .await
        .expect("connect");
    let statements = || {
        metrics
            .projection_db_statements
            .with_label_values(&["record", "ok"])
            .get()
    };
    let accounts: Vec<AccountId> = (0..40).map(|_| AccountId(Uuid::new_v4())).collect();
    let pg = Arc::new(pg);
    // (account, expected version, balance after, event id): the 40 first writes, and a
    // second write on account 0.
    let mut writes: Vec<(AccountId, u64, i64, u128)> = accounts
        .iter()
        .zip(1..)
        .map(|(&a, id)| (a, 0, 5, id))
        .collect();
    writes.push((accounts[0], 1, 10, 1_000));
    // Every record is queued before the dispatcher runs (one thread, tasks run in spawn
    // order): one statement takes the 40 first writes, the next one account 0's second.
    let tasks: Vec<_> = writes
        .into_iter()
        .map(|(account, expected, balance, id)| {
            let pg = pg.clone();
            tokio::spawn(async move {
                let events = [(id, balance, AccountEvent::Deposited { amount: 5 })];
                let write = RecordedWrite {
                    expected_version: expected,
                    generation: 0,
                    new_version: expected + 1,
                    balance_after: balance,
                    max_client_seq: expected + 1,
                    events: &events,
                };
                let row = tally::projection::postgres::RecordRow {
                    account,
                    write: &write,
                };
                pg.record(&[row], until(1_000)).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("task"));
    }
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(statements(), 2, "41 records in 2 statements");
    let db = pg::connect(&url).await;
    let bumped: i64 = db
        .query_one("SELECT count(*) FROM tally_accounts WHERE version = 1", &[])
        .await
        .expect("count")
        .get(0);
    let indexed: i64 = db
        .query_one("SELECT count(*) FROM tally_recent_writes", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(indexed, 41, "every index row");
    let zero = row(&db, &accounts[0].0.to_string()).await;
    assert!(
        bumped == 40 && zero == Some((5, 1)) || bumped == 39 && zero == Some((10, 2)),
        "each cursor bumped from its own expected version: {bumped} at 1, account 0 at {zero:?}"
    );
}

/// Rule: a load asked for the rows above a version returns every one inside its retention,
/// so a warm copy built from it is complete; past [`WARM_MAX_KEYS_PER_ACCOUNT`] it returns
/// none, and the replica reads that account from the database instead of holding a copy.
#[tokio::test]
async fn a_load_returns_every_live_row_above_since_or_none_past_the_cap() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let pg = PgProjection::connect(&settings(&url), Arc::new(Metrics::new()))
        .await
        .expect("connect");
    let account = AccountId(Uuid::new_v4());
    let rows = |from: u64, to: u64, expires_at_ms: u64| -> Vec<(u128, RecentWrite)> {
        (from..=to)
            .map(|v| {
                let write = RecentWrite {
                    balance: v as i64,
                    version: v,
                    expires_at_ms,
                    event: AccountEvent::Deposited { amount: 1 },
                    write_tag: None,
                };
                (u128::from(v) << 64 | 7, write)
            })
            .collect()
    };
    let snap = |version| Snapshot {
        balance: version as i64,
        version,
        max_client_seq: version,
        generation: 0,
        ..Snapshot::default()
    };
    // Ten live rows and two expired ones (at tip 1_000).
    let mut ten = rows(1, 10, 5_000);
    ten.extend(rows(11, 12, 900));
    pg.persist(account, snap(12), None, &lived(ten), 0)
        .await
        .expect("persist");
    let all = pg.load(account, &[], 1_000, Some(0)).await.expect("load");
    assert_eq!(all.delta.as_ref().map(Vec::len), Some(10), "every live row");
    let above = pg.load(account, &[], 1_000, Some(7)).await.expect("load");
    let mut versions: Vec<u64> = above
        .delta
        .expect("delta")
        .iter()
        .map(|(_, w, _)| w.version)
        .collect();
    versions.sort_unstable();
    assert_eq!(versions, vec![8, 9, 10]);
    let lookup_only = pg
        .load(account, &[u128::from(3u64) << 64 | 7], 1_000, None)
        .await
        .expect("load");
    assert_eq!(
        (lookup_only.hits.len(), lookup_only.delta.is_none()),
        (1, true)
    );
    // Past the cap: no delta, and the lookups still answered.
    let cap = WARM_MAX_KEYS_PER_ACCOUNT as u64;
    let more = lived(rows(13, 12 + cap, 5_000));
    pg.persist(account, snap(12 + cap), None, &more, 0)
        .await
        .expect("persist");
    let big = pg
        .load(account, &[u128::from(3u64) << 64 | 7], 1_000, Some(0))
        .await
        .expect("load");
    assert!(big.delta.is_none(), "more than the cap: no copy");
    assert_eq!(big.hits.len(), 1, "the lookup still rides along");
    let tail = pg.load(account, &[], 1_000, Some(cap)).await.expect("load");
    assert_eq!(
        tail.delta.map(|d| d.len()),
        Some(12),
        "the rows above the version"
    );
}

/// Rule: a poisoned or trimmed stream answers the same on Postgres: the account's balance
/// is refused with its code, and the mark is shared, so every replica answers alike.
#[tokio::test]
async fn trimmed_streams_answer_account_trimmed_on_every_replica() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let account = new_account();
    let identity = Identity::default();
    let key_of = identity.key(AccountId(account.parse().unwrap()));
    // Written and trimmed before any replica folded it: the stream starts above version 1.
    let writer = replica(&pg::fresh_url().await.expect("url"), mem.clone(), &[]).await;
    for _ in 0..3 {
        created(&writer.deposit(&account, 1, Some(&key())).await);
    }
    mem.trim_start_now(key_of, 3).expect("trim");
    let a = replica(&url, mem.clone(), &[]).await;
    let b = replica(&url, mem.clone(), &[]).await;
    for t in [&a, &b] {
        let r = t.get(&format!("/api/accounts/{account}/balance")).await;
        assert_eq!(r.error_code(), "ACCOUNT_TRIMMED", "{}", r.text);
    }
    let db = pg::connect(&url).await;
    let reason: Option<String> = db
        .query_one(
            "SELECT broken_reason FROM tally_accounts WHERE account_id = $1",
            &[&account.parse::<Uuid>().unwrap()],
        )
        .await
        .expect("row")
        .get(0);
    assert_eq!(reason.as_deref(), Some("trimmed"));
}

/// A store whose next read of one aggregate, once armed, waits for `go` (signalling
/// `reached` first): a catch-up paused between reading the shared row and reading the store.
struct PausedRead {
    inner: SharedLog,
    key: AggregateKey,
    armed: AtomicBool,
    reached: Notify,
    go: Notify,
}

#[async_trait]
impl EventLog for PausedRead {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        self.inner.write(client, writes).await
    }
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        if key == self.key && self.armed.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            self.go.notified().await;
        }
        self.inner.read(key, filter).await
    }
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule: a trim above the row a catch-up started from is not a broken account when another
/// replica moved the shared row past the trim meanwhile: that catch-up answers a retry (not
/// a final 500 `ACCOUNT_TRIMMED`), and the next request is answered from the moved row.
#[tokio::test]
async fn a_trim_the_shared_cursor_already_passed_is_a_retry_not_a_broken_account() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let account = new_account();
    let key_of = Identity::default().key(AccountId(account.parse().unwrap()));
    // Written through another database: the shared rows of `url` know nothing of it.
    let writer = replica(&pg::fresh_url().await.expect("url"), mem.clone(), &[]).await;
    for _ in 0..6 {
        created(&writer.deposit(&account, 1, Some(&key())).await);
    }
    let paused = Arc::new(PausedRead {
        inner: mem.clone(),
        key: key_of,
        armed: AtomicBool::new(false),
        reached: Notify::new(),
        go: Notify::new(),
    });
    let a = Arc::new(replica(&url, paused.clone(), &[]).await);
    let b = replica(&url, mem.clone(), &[]).await;
    a.app.started().await;
    paused.armed.store(true, Ordering::SeqCst);
    let first = {
        let (a, account) = (a.clone(), account.clone());
        tokio::spawn(async move { a.get(&format!("/api/accounts/{account}/balance")).await })
    };
    // `a` read the shared row (no row yet) and waits to read the store from version 1.
    paused.reached.notified().await;
    assert_eq!(
        b.balance(&account).await,
        (6, 6),
        "b moves the shared row to 6"
    );
    mem.trim_start_now(key_of, 4).expect("trim");
    paused.go.notify_one();
    let r = first.await.expect("task");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    assert!(r.header("retry-after").is_some(), "{r:?}");
    assert_eq!(
        a.balance(&account).await,
        (6, 6),
        "answered from the moved row"
    );
}

/// Rule: concurrent transfers in both directions between two accounts, on two replicas
/// sharing the database, all land once and every record statement succeeds (records lock
/// account rows in one order, so opposite transfers never deadlock); the shared rows end
/// at the store's balances.
#[tokio::test]
async fn opposite_transfers_on_two_replicas_all_record() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let a = Arc::new(replica(&url, mem.clone(), &[]).await);
    let b = Arc::new(replica(&url, mem.clone(), &[]).await);
    let (x, y) = (new_account(), new_account());
    created(&a.deposit(&x, 10_000, Some(&key())).await);
    created(&a.deposit(&y, 10_000, Some(&key())).await);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let t = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (from, to) = if i % 4 < 2 {
            (x.clone(), y.clone())
        } else {
            (y.clone(), x.clone())
        };
        tasks.spawn(async move { t.transfer(&from, &to, 10 + i, Some(&key())).await });
    }
    while let Some(r) = tasks.join_next().await {
        let r = r.expect("task");
        assert!(r.status.is_success(), "{} {}", r.status, r.text);
    }
    assert_eq!(record_failures(&a) + record_failures(&b), 0);
    let (bx, vx) = b.balance(&x).await;
    let (by, vy) = a.balance(&y).await;
    assert_eq!(bx + by, 20_000, "money is conserved");
    assert_eq!((vx, vy), (41, 41), "every transfer landed once on each leg");
    let db = pg::connect(&url).await;
    assert_eq!(row(&db, &x).await, Some((bx, 41)));
    assert_eq!(row(&db, &y).await, Some((by, 41)));
}

/// Rule: a database that is down at boot does not stop the replica (as a store that is
/// down does not): it starts unready, `/readyz` names the pending `postgresMigrations`
/// step, and the API answers 503 until the step is done.
#[tokio::test]
async fn a_database_down_at_boot_leaves_the_replica_unready_not_dead() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let t = replica(&url, Arc::new(MemoryLog::new()), &[]).await;
    assert!(!t.app.is_started());
    assert_eq!(
        t.app.startup_waiting(),
        vec!["postgresMigrations".to_string()]
    );
    let ready = t.get("/readyz").await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text
    );
    assert!(ready.text.contains("postgresMigrations"), "{}", ready.text);
    let write = t.deposit(&new_account(), 1, Some(&key())).await;
    assert_eq!(
        write.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        write.text
    );
}

/// Rule: when the projection's database fails a statement, a read is answered a retryable
/// 503 and a write, after its bounded attempts, the write loop's retryable 409; both name
/// the projection database (never the driver's text, which can name tables and hosts), and
/// the write is never sent to the store.
#[tokio::test]
async fn a_database_failure_answers_503_naming_the_projection_database_and_sends_nothing() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mem = Arc::new(MemoryLog::new());
    let a = replica(&url, mem.clone(), &[]).await;
    // A replica without a warm copy of the account: its write must read the row.
    let cold = replica(&url, mem.clone(), &[]).await;
    let db = pg::connect(&url).await;
    let account = new_account();
    created(&a.deposit(&account, 100, Some(&key())).await);
    // Every statement that reads the account row now fails.
    db.batch_execute("ALTER TABLE tally_accounts RENAME TO tally_accounts_away")
        .await
        .expect("hide the table");
    let read = a.get(&format!("/api/accounts/{account}/balance")).await;
    let write = cold.deposit(&account, 40, Some(&key())).await;
    assert_eq!(
        read.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        read.text
    );
    assert_eq!(read.body["error"], "SERVICE_UNAVAILABLE", "{}", read.text);
    assert_eq!(write.status, StatusCode::CONFLICT, "{}", write.text);
    assert_eq!(write.body["error"], "CONFLICT", "{}", write.text);
    assert!(write.header("retry-after").is_some(), "retryable");
    for reply in [&read, &write] {
        assert!(
            reply.text.contains("projection database"),
            "names the projection database: {}",
            reply.text
        );
        assert!(
            !reply.text.contains("tally_accounts"),
            "no driver detail: {}",
            reply.text
        );
    }
    assert_eq!(
        mem.batch_count(Identity::default().key(AccountId(account.parse().unwrap()))),
        1,
        "the failed write was never sent"
    );
    db.batch_execute("ALTER TABLE tally_accounts_away RENAME TO tally_accounts")
        .await
        .expect("restore the table");
    assert_eq!(a.balance(&account).await.0, 100);
}

/// Rule: a row this code never wrote (a negative cursor, a trim without its point) is an
/// error the replica answers retryably, never read as a new account (version 0) inside a 200.
#[tokio::test]
async fn an_account_row_this_code_never_wrote_is_refused_never_read_as_new() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let (mem, _writer, db, account) = funded_one(&url).await;
    for corrupt in [
        "UPDATE tally_accounts SET version = -3",
        "UPDATE tally_accounts SET version = 1, broken_reason = 'trimmed', trimmed_min_available = NULL",
    ] {
        db.batch_execute(corrupt).await.expect("corrupt the row");
        // A replica without a warm copy reads the row.
        let cold = replica(&url, mem.clone(), &[]).await;
        let read = cold.get(&format!("/api/accounts/{account}/balance")).await;
        assert_eq!(
            read.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{corrupt}: {}",
            read.text
        );
        assert!(read.text.contains("projection database"), "{}", read.text);
    }
}

/// A TCP relay to the test cluster that can be frozen: bytes stop flowing both ways, as
/// from a database that hangs or a network that drops packets (no error, no answer).
struct Relay {
    /// `url` with the relay in place of the cluster's address.
    url: String,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    async fn start(url: &str) -> Relay {
        let (user, rest) = url.split_once('@').expect("a URL with user@host");
        let (upstream, path) = rest.split_once('/').expect("a URL with a database");
        let upstream = upstream.to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("relay bound");
        let addr = listener.local_addr().expect("relay address");
        let (frozen, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, watch) = (upstream.clone(), watch.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (client_r, client_w) = client.into_split();
                    let (server_r, server_w) = server.into_split();
                    tokio::join!(
                        pump(client_r, server_w, watch.clone()),
                        pump(server_r, client_w, watch)
                    );
                });
            }
        });
        Relay {
            url: format!("{user}@{addr}/{path}"),
            frozen,
        }
    }

    fn freeze(&self, on: bool) {
        self.frozen.send_replace(on);
    }
}

/// Relays bytes from one side to the other, holding each chunk while the relay is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Rule: a database that stops answering (hung, or behind a network that drops packets) is
/// given up on by the replica itself, within two statement timeouts: a read that needs it is
/// answered the projection's retryable 503, not left to the request's own deadline (10 s,
/// "the request took too long"), since `statement_timeout` only bounds a server that
/// answers.
#[tokio::test]
async fn a_database_that_stops_answering_is_given_up_on_and_named() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let relay = Relay::start(&url).await;
    let mem = Arc::new(MemoryLog::new());
    let t = replica(
        &relay.url,
        mem.clone(),
        &["--postgres-statement-timeout-ms", "300"],
    )
    .await;
    let account = new_account();
    created(&t.deposit(&account, 100, Some(&key())).await);
    relay.freeze(true);
    // An account this replica has no copy of: the read needs the database.
    let read = t
        .get(&format!("/api/accounts/{}/balance", new_account()))
        .await;
    assert_eq!(
        read.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        read.text
    );
    assert!(
        read.text.contains("projection database"),
        "the projection's own answer: {}",
        read.text
    );
    relay.freeze(false);
    assert_eq!(t.balance(&account).await.0, 100);
}

/// Rule: on a fresh database the rows' store epoch is checked once the migrations have made
/// its table, never before (a first run saw `relation "tally_store_epoch" does not exist`
/// warned at every start), and the `tally listening` line names the projection and where
/// its database is, without credentials. The real binary, as a user starts it.
#[tokio::test]
async fn a_fresh_database_is_migrated_before_the_rows_store_epoch_is_checked() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tally"));
    for (name, _) in std::env::vars() {
        if name.starts_with("TALLY_") || name == "RUST_LOG" || name == "DATABASE_URL" {
            cmd.env_remove(name);
        }
    }
    let mut args = vec!["--listen", "127.0.0.1:0", "--log-format", "json"];
    args.extend(["--seed-demo-accounts", "false"]);
    let pg_flags = pg::flags(&url);
    args.extend(pg_flags.iter().map(String::as_str));
    let mut child = cmd
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tally starts");
    let stdout = child.stdout.take().expect("stdout");
    // Read on a thread of its own: the test's runtime stays free, and the read ends when
    // the child is killed.
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let listening = line.contains("tally listening");
            lines.push(line);
            if listening {
                break;
            }
        }
        lines
    });
    let lines = tokio::task::spawn_blocking(move || reader.join().expect("reader"))
        .await
        .expect("joined");
    let _ = child.kill();
    let _ = child.wait();
    let log: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("a JSON line: {l}")))
        .collect();
    let listening = log
        .iter()
        .find(|v| v["fields"]["message"] == "tally listening")
        .unwrap_or_else(|| panic!("no listening line: {lines:#?}"));
    // By `listening`, start-up's first attempts (migrations, the first store checks) ran.
    for v in &log {
        let warned = v["level"] == "WARN" || v["level"] == "ERROR";
        assert!(
            !(warned && v.to_string().contains("epoch")),
            "a store-epoch warning on a fresh database: {v}"
        );
    }
    let projection = listening["fields"]["projection"].as_str().unwrap_or("");
    assert!(
        projection.starts_with("postgres at 127.0.0.1:") && !projection.contains('@'),
        "{listening}"
    );
    // And the rows were bound to the store once their table existed.
    let db = pg::connect(&url).await;
    let bound = db
        .query_one("SELECT count(*) FROM tally_store_epoch", &[])
        .await
        .expect("the table exists")
        .get::<_, i64>(0);
    assert_eq!(bound, 1, "the rows' store epoch is recorded");
}

/// Rule: `scripts/with-postgres.sh` runs from any directory without a word from Postgres's
/// tools: as root the cluster's owner is `postgres`, who cannot enter a directory such as
/// /root, and initdb and pg_ctl complained of it on every run.
#[tokio::test]
async fn with_postgres_is_quiet_from_a_directory_the_clusters_owner_cannot_enter() {
    // Inside the script already (so Postgres is installed), a second, nested cluster.
    if pg::base_url().is_none() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let private = std::env::temp_dir().join(format!("tally-private-{}", Uuid::new_v4()));
    std::fs::create_dir(&private).expect("a temp dir");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/with-postgres.sh");
    let out = tokio::process::Command::new("bash")
        .arg(&script)
        .args(["sh", "-c", r#"test -n "$TALLY_TEST_POSTGRES_URL""#])
        .current_dir(&private)
        .output()
        .await
        .expect("bash runs the script");
    let _ = std::fs::remove_dir_all(&private);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let noise: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("with-postgres: "))
        .collect();
    assert!(noise.is_empty(), "unexpected output: {noise:#?}");
}

/// Rule: a replica on a fresh database starts an account from its checkpoint (the newest
/// one a window old, checked against the stream), not from the whole stream, so it serves
/// an account trimmed below that checkpoint; and the row it persists is the checkpoint's
/// state plus what followed.
#[tokio::test]
async fn a_fresh_database_starts_an_account_from_its_checkpoint_and_serves_it_trimmed() {
    let Some(url) = pg::fresh_url().await else {
        return;
    };
    let (server, log) = hand_clocks::paged_store_at(hand_clocks::SERVER_START_MS, 16);
    let identity = Identity::default();
    let account = AccountId(Uuid::new_v4());
    let deposit = |seq: u64| one_deposit(identity.key(account), seq, Some(u128::from(seq)), 10);
    for seq in 1..=40 {
        log.write_now(identity.client(), vec![deposit(seq)])
            .expect("write");
    }
    // A memory replica folds it and writes a checkpoint at version 40; it ages past the
    // window, the stream goes on, and is trimmed below the checkpoint.
    let memory = hand_clocks::replica(
        log.clone(),
        identity,
        ProjectionConfig {
            // Nothing remembered past the window: the trim may cut right behind it.
            retention: ProjectionConfig::default().window,
            ..ProjectionConfig::default()
        },
    );
    memory.sync_server_clock().await.expect("anchor");
    memory.catch_up(account).await.expect("fold");
    memory.write_checkpoint(account).await;
    server.advance(memory.window_ms() + 1);
    for seq in 41..=45 {
        log.write_now(identity.client(), vec![deposit(seq)])
            .expect("write");
    }
    memory.sync_server_clock().await.expect("anchor");
    let trimmed = memory
        .trim_account(account, Duration::ZERO)
        .await
        .expect("trim");
    assert_eq!(trimmed.trimmed_at, Some(40));

    let metrics = Arc::new(Metrics::new());
    let pg = PgProjection::connect(&settings(&url), metrics.clone())
        .await
        .expect("database");
    let fresh = Projection::with_postgres(
        log.clone(),
        identity,
        ProjectionConfig {
            // Nothing remembered past the window: the trim may cut right behind it.
            retention: ProjectionConfig::default().window,
            ..ProjectionConfig::default()
        },
        Arc::new(ManualClock::new(0)),
        metrics.clone(),
        pg,
    );
    fresh.sync_server_clock().await.expect("anchor");
    let loaded = fresh.refresh(account, &[44]).await.expect("served cold");
    assert_eq!((loaded.snap.balance, loaded.snap.version), (450, 45));
    assert_eq!(loaded.snap.max_client_seq, 45);
    assert_eq!(
        metrics.checkpoint_loads.with_label_values(&["used"]).get(),
        1
    );
    assert_eq!(metrics.events_folded.get(), 5, "only what followed it");
    assert!(
        fresh.lookup(&loaded.view, 44).is_some(),
        "a write inside the window still replays"
    );
}
