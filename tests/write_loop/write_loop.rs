//! The write loop, arm by arm. Every test is named after the rule it pins, forces the arm with
//! scripted store behaviour (no sleeps as synchronisation: holds, hooks and queued faults), and
//! asserts the response, the exact writes the loop sent, and what the stream holds afterwards
//! (batches, events per event id, and the balance folded from the stream).
//!
//! Layering of the store a scripted replica writes through:
//! `WriteService -> HookedLog (records every write, runs per-write steps) -> FaultyLog -> MemoryLog`.
//! Sibling replicas share the same `MemoryLog` (one store, one client id) and are built either
//! on the scripted path or straight on the `MemoryLog`.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

use common::hooked_log::{Around, HookedLog, LegRecord, Step, WriteRecord, hook};

use tally::account::events::{DEPOSITED, TRANSFERRED_OUT};
use tally::account::{
    AccountEvent, AccountId, AccountsMode, AmountCents, Identity, Operation, RuleError, fold,
};
use tally::metrics::{Metrics, arm};
use tally::projection::{
    Backend, ManualClock as LocalClock, PgProjection, PostgresSettings, Projection,
    ProjectionConfig, ProjectionError,
};
use tally::store::faults::{Fault, FaultConfig, FaultyLog};
use tally::store::memory::{MemoryLog, MemoryOptions, ServerClock, ServerTime};
use tally::store::{
    AggregateKey, AggregateWrite, Batch, Event, EventType, ReadFilter, SharedLog, StoreError,
    StoreResult,
};
use tally::write_loop::verify::{self, SeqOwnership};
use tally::write_loop::{
    LegResult, WriteConfig, WriteError, WriteOutcome, WriteRequest, WriteService,
};

/// Server time of the first write, epoch ms.
const T0: u64 = 1_700_000_000_000;
/// The production window, which the projections here use unless a test says otherwise.
const WINDOW_MS: u64 = 90_000;

// Event ids (idempotency keys) used across tests.
const E0: u128 = 0xE0;
const E1: u128 = 0xE1;
const E2: u128 = 0xE2;
const E3: u128 = 0xE3;
const E4: u128 = 0xE4;
const E_SIB: u128 = 0x5B;

// ---------------------------------------------------------------------------------------------
// The scripted, recording store (tests/common/hooked_log.rs) and what it recorded
// ---------------------------------------------------------------------------------------------

/// Store latency before each write: a simulated network/fsync delay, not synchronisation.
struct Latency(Option<Duration>);

#[async_trait]
impl Around for Latency {
    async fn before_write(&self) {
        if let Some(latency) = self.0 {
            tokio::time::sleep(latency).await;
        }
    }
}

/// What `n` first touches that bounced look like in a write history: a write at version 0
/// under sequence 1, refused by the version guard because the account exists
/// (`Projection::first_touch`; the memory fold only). None on Postgres.
fn first_touch_bounces(n: usize) -> Vec<(u64, Vec<u64>, &'static str)> {
    let n = if on_postgres() { 0 } else { n };
    vec![(0, vec![1], "conflict"); n]
}

/// A projection without a recent-writes index (a zero window): only the held sequence and
/// the point read can tell that a write landed.
fn no_window() -> ProjectionConfig {
    ProjectionConfig {
        window: Duration::ZERO,
        retention: Duration::ZERO,
        ..ProjectionConfig::default()
    }
}

/// The default window, with nothing remembered past it (the retention equal to the window):
/// these tests pin the window's rules. The retention's are pinned by `tests/api`'s
/// `a_retry_past_the_window_inside_the_retention_*` and `tests/store/checkpoints.rs`.
fn window_only() -> ProjectionConfig {
    let d = ProjectionConfig::default();
    ProjectionConfig {
        retention: d.window,
        ..d
    }
}

/// A short label of a store answer, for comparing write histories.
fn label(result: &StoreResult<Vec<u64>>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(StoreError::Conflict { .. }) => "conflict",
        Err(StoreError::IdempotencyViolation { .. }) => "2002",
        Err(StoreError::InflightDuplicate) => "2013",
        Err(StoreError::OutcomeUnknown { .. }) => "unknown",
        Err(StoreError::NotApplied { .. }) => "not_applied",
        Err(_) => "other",
    }
}

/// (expected version, client seqs, outcome) of every single-aggregate write, in order.
fn shape(records: &[WriteRecord]) -> Vec<(u64, Vec<u64>, &'static str)> {
    records
        .iter()
        .map(|r| {
            assert_eq!(r.legs.len(), 1, "a single-account write: {r:?}");
            let leg = &r.legs[0];
            (
                leg.expected_version.expect("every loop write is guarded"),
                leg.seqs.clone(),
                label(&r.result),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The fleet: one store, any number of replicas sharing one client id
// ---------------------------------------------------------------------------------------------

struct Env {
    identity: Identity,
    server_clock: Arc<ServerClock>,
    mem: Arc<MemoryLog>,
    faulty: Arc<FaultyLog<MemoryLog>>,
    /// The scripted path a replica writes through.
    script: Arc<HookedLog<Latency>>,
    /// With `TALLY_TEST_PROJECTION=postgres`: the schema every replica of this
    /// fleet shares, created on the first replica's start.
    pg_url: tokio::sync::OnceCell<String>,
}

impl Env {
    fn new() -> Self {
        Self::build(FaultConfig::default(), None)
    }

    fn build(faults: FaultConfig, latency: Option<Duration>) -> Self {
        let server_clock = Arc::new(ServerClock::new(T0));
        let mem = Arc::new(MemoryLog::with_options(MemoryOptions {
            clock: server_clock.clone(),
            ..MemoryOptions::default()
        }));
        let faulty = Arc::new(FaultyLog::new(Arc::clone(&mem), faults));
        let script = Arc::new(HookedLog::around(faulty.clone(), Latency(latency)));
        Self {
            identity: Identity::default(),
            server_clock,
            mem,
            faulty,
            script,
            pg_url: tokio::sync::OnceCell::new(),
        }
    }

    fn key(&self, account: AccountId) -> AggregateKey {
        self.identity.key(account)
    }

    /// A replica writing through the scripted, faulty path.
    async fn replica(&self) -> Arc<Replica> {
        self.replica_with(window_only(), WriteConfig::default())
            .await
    }

    async fn replica_with(&self, projection: ProjectionConfig, write: WriteConfig) -> Arc<Replica> {
        let pg = self.postgres().await;
        let anchor = pg.map(|_| self.server_clock.now_ms());
        Replica::build(
            self.script.clone(),
            self.identity,
            projection,
            write,
            pg,
            anchor,
        )
        .await
    }

    /// A replica that knows nothing of any account: on Postgres, one on a database of its
    /// own (a replica of this fleet shares the fleet's rows, so it is never cold).
    async fn cold_replica(&self) -> Arc<Replica> {
        if !on_postgres() {
            return self.replica().await;
        }
        // As in `Env::postgres`: a database socket on a paused clock fires deadlines at once.
        resume_real_time();
        let url = common::pg::fresh_url().await.expect("the test Postgres");
        let config = (window_only(), WriteConfig::default());
        let anchor = Some(self.server_clock.now_ms());
        let script = self.script.clone();
        Replica::build(
            script,
            self.identity,
            config.0,
            config.1,
            Some(&url),
            anchor,
        )
        .await
    }

    /// A sibling replica straight on the store (same client id, no faults, not recorded).
    async fn sibling(&self) -> Arc<Replica> {
        self.sibling_with(window_only()).await
    }

    async fn sibling_with(&self, projection: ProjectionConfig) -> Arc<Replica> {
        let pg = self.postgres().await;
        let anchor = pg.map(|_| self.server_clock.now_ms());
        let (log, write) = (self.mem.clone(), WriteConfig::default());
        Replica::build(log, self.identity, projection, write, pg, anchor).await
    }

    /// The fleet's shared schema when the suite runs on the Postgres projection.
    async fn postgres(&self) -> Option<&str> {
        if !common::pg::suite_on_postgres() {
            return None;
        }
        let url = self
            .pg_url
            .get_or_init(|| async {
                // The suite's tests start with tokio's clock paused (backoffs and latencies
                // cost nothing); a paused clock jumps to the next timer whenever every task
                // waits, including on a database socket, so deadlines would fire at once.
                // On Postgres the test runs on the real clock from here on.
                resume_real_time();
                common::pg::fresh_url()
                    .await
                    .expect("TALLY_TEST_PROJECTION=postgres needs TALLY_TEST_POSTGRES_URL")
            })
            .await;
        Some(url)
    }

    fn stream(&self, account: AccountId) -> Vec<Batch> {
        stream(&self.mem, self.key(account))
    }

    /// The account's stream holds `batches` batches, `event_id`'s deposit of `amount`
    /// exactly once, at `version`, and folds to `balance`.
    fn assert_deposit_landed_once(
        &self,
        account: AccountId,
        event_id: u128,
        version: u64,
        amount: i64,
        batches: usize,
        balance: i64,
    ) {
        let s = self.stream(account);
        assert_eq!(self.batches(account), batches);
        assert_eq!(
            events_with_id(&s, event_id),
            vec![(version, AccountEvent::Deposited { amount })]
        );
        assert_eq!(folded_balance(&s), balance);
    }

    fn batches(&self, account: AccountId) -> usize {
        self.mem.batch_count(self.key(account))
    }

    /// Appends one raw event written by another service (its own client id).
    fn foreign_write(&self, account: AccountId, event_type: EventType, payload: &'static [u8]) {
        let key = self.key(account);
        let version = self.mem.details_now(key).map_or(0, |d| d.max_version);
        let foreign = tally::account::named_id(Identity::REFERENCE_SERVICE_CLIENT).as_u128();
        self.mem
            .write_now(
                foreign,
                vec![AggregateWrite {
                    key,
                    events: vec![Event {
                        client_seq: version + 1,
                        event_id: None,
                        event_type,
                        payload: Bytes::from_static(payload),
                        timestamp_ms: 0,
                    }],
                    expected_version: Some(version),
                    allow_create: true,
                    enforce_client_idempotency: true,
                }],
            )
            .expect("foreign write");
    }
}

thread_local! {
    /// Whether this test thread's runtime runs on the real clock (each test has its own).
    static REAL_CLOCK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Unpauses tokio's clock, once per test.
fn resume_real_time() {
    if !REAL_CLOCK.replace(true) {
        tokio::time::resume();
    }
}

/// For the tests that start on the real clock: nothing to unpause.
fn on_real_clock() {
    REAL_CLOCK.set(true);
}

/// Whether this run puts the suite on the Postgres projection (`TALLY_TEST_PROJECTION`).
fn on_postgres() -> bool {
    common::pg::suite_on_postgres()
}

/// True (and says why) when a test pins a rule of the memory fold alone, so it does not
/// run on Postgres.
fn memory_only(why: &str) -> bool {
    if on_postgres() {
        eprintln!("memory projection only: {why}");
    }
    on_postgres()
}

struct Replica {
    svc: WriteService,
    projection: Arc<Projection>,
    clock: Arc<LocalClock>,
}

impl Replica {
    async fn build(
        log: SharedLog,
        identity: Identity,
        projection: ProjectionConfig,
        write: WriteConfig,
        postgres: Option<&str>,
        anchor: Option<u64>,
    ) -> Arc<Self> {
        let clock = Arc::new(LocalClock::new(0));
        let metrics = Arc::new(Metrics::new());
        let projection = Arc::new(match postgres {
            None => Projection::new(log, identity, projection, clock.clone(), metrics),
            Some(url) => {
                let settings = PostgresSettings {
                    url: url.into(),
                    pool_size: 4,
                    statement_timeout: Duration::from_secs(5),
                };
                let pg = PgProjection::connect(&settings, metrics.clone())
                    .await
                    .expect("the test Postgres");
                Projection::with_postgres(log, identity, projection, clock.clone(), metrics, pg)
            }
        });
        if let Some(now) = anchor {
            // As an App's start-up does before it serves: a Postgres replica's records
            // carry server-time expiry, which needs the server's now.
            projection.observe_server_time(now);
        }
        Arc::new(Self {
            svc: WriteService::new(projection.clone(), write),
            projection,
            clock,
        })
    }

    async fn run(&self, req: WriteRequest) -> Result<WriteOutcome, WriteError> {
        self.svc.execute(req).await
    }

    async fn ok(&self, req: WriteRequest) -> WriteOutcome {
        match self.run(req).await {
            Ok(outcome) => outcome,
            Err(e) => panic!("{req:?} failed: {e}"),
        }
    }

    fn arm(&self, operation: &str, arm: &str) -> u64 {
        self.projection
            .metrics()
            .write_outcomes
            .with_label_values(&[operation, arm])
            .get()
    }

    /// The live index entry for `event_id` on `account`, if this replica holds one.
    /// On Postgres, the index is the fleet's shared table: the live row there.
    async fn indexed(&self, account: AccountId, event_id: u128) -> Option<(i64, u64)> {
        if let Backend::Postgres(pg) = self.projection.backend() {
            let tip = self.projection.server_tip_ms();
            let row = pg.load(account, &[event_id], tip, None).await;
            return row
                .expect("the test Postgres")
                .hits
                .first()
                .map(|(_, w)| (w.balance, w.version));
        }
        let slot = self.projection.resident_slot(account)?;
        let st = slot.state.lock();
        st.recent
            .get(event_id, self.projection.now_ms())
            .map(|w| (w.balance, w.version))
    }
}

// ---------------------------------------------------------------------------------------------
// Requests, responses and the stream
// ---------------------------------------------------------------------------------------------

fn acct(n: u128) -> AccountId {
    AccountId(Uuid::from_u128(n))
}

fn cents(n: i64) -> AmountCents {
    AmountCents::new(n).expect("a valid amount")
}

fn deposit(account: AccountId, amount: i64, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::Deposit {
            account,
            amount: cents(amount),
        },
        event_id,
    }
}

fn withdraw(account: AccountId, amount: i64, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::Withdraw {
            account,
            amount: cents(amount),
        },
        event_id,
    }
}

fn transfer(from: AccountId, to: AccountId, amount: i64, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::transfer(from, to, cents(amount)).expect("two accounts"),
        event_id,
    }
}

/// A response: (account, balance, version) per leg.
fn outcome(legs: &[(AccountId, i64, u64)], replayed: bool) -> WriteOutcome {
    WriteOutcome {
        legs: legs
            .iter()
            .map(|&(account, balance, version)| LegResult {
                account,
                balance,
                version,
            })
            .collect(),
        replayed,
    }
}

/// Every batch still stored for `key`, oldest first (from the minimum available version).
fn stream(mem: &MemoryLog, key: AggregateKey) -> Vec<Batch> {
    let mut from = mem.details_now(key).map_or(1, |d| d.min_available_version);
    let mut out = Vec::new();
    loop {
        let page = match mem.read_now(key, &ReadFilter::from_version(from)) {
            Ok(page) => page,
            Err(StoreError::AggregateNotFound) => return out,
            Err(e) => panic!("reading the stream: {e}"),
        };
        out.extend(page.batches);
        match page.next_version {
            Some(next) => from = next,
            None => return out,
        }
    }
}

/// (batch version, event) of every event carrying `event_id`.
fn events_with_id(batches: &[Batch], event_id: u128) -> Vec<(u64, AccountEvent)> {
    batches
        .iter()
        .flat_map(|b| {
            b.events
                .iter()
                .filter(move |e| e.event_id == Some(event_id))
                .map(move |e| {
                    let event = AccountEvent::decode(e.event_type, &e.payload).expect("decodes");
                    (b.version, event)
                })
        })
        .collect()
}

/// The balance folded from a whole stream (from version 1).
fn folded_balance(batches: &[Batch]) -> i64 {
    assert!(
        batches.first().is_none_or(|b| b.version == 1),
        "the stream must be whole to fold it"
    );
    running_balances(batches).last().map_or(0, |r| r.2)
}

/// (version, event id, balance right after the event) for every event, in stream order.
fn running_balances(batches: &[Batch]) -> Vec<(u64, Option<u128>, i64)> {
    let mut balance = 0i64;
    let mut out = Vec::new();
    for b in batches {
        for e in b.events.iter() {
            let event = AccountEvent::decode(e.event_type, &e.payload).expect("decodes");
            balance = fold::apply(balance, &event).expect("no overflow");
            out.push((b.version, e.event_id, balance));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Ambiguous outcomes
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_retry_after_a_lost_ack_is_the_read_back_and_never_writes_again() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    env.faulty.fail_next_write(Fault::LostAck);
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 150, 2)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "ok"), (1, vec![2], "unknown")],
        "the catch-up found the landed event by id: no second write"
    );
    env.assert_deposit_landed_once(x, E1, 2, 50, 2, 150);
}

#[tokio::test(start_paused = true)]
async fn the_lost_ack_followed_by_a_conflict_must_not_deposit_twice() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // A's deposit lands and its ack is lost; meanwhile sibling B deposits, moving the version
    // again; and A's next catch-up lags behind both, so the held write meets a 2003 that
    // hides A's own landed write.
    env.faulty.fail_next_write(Fault::LostAck);
    let b2 = b.clone();
    env.script.push(Step::After(hook(async move {
        assert_eq!(
            b2.ok(deposit(x, 7, E_SIB)).await,
            outcome(&[(x, 157, 3)], false)
        );
    })));
    env.faulty.lag_next_read(2);
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(
        got,
        Ok(outcome(&[(x, 150, 2)], false)),
        "the original response, rebuilt from the index"
    );
    let mut expected = vec![(0, vec![1], "ok"), (1, vec![2], "unknown")];
    if !on_postgres() {
        // Held seq, version from the (lagging) catch-up: a conflict, and no re-derived
        // write: the next catch-up found E1 by id. (On Postgres B's catch-up indexed E1 in
        // the shared table before B wrote, so A's first catch-up finds it there.)
        expected.push((1, vec![2], "conflict"));
    }
    assert_eq!(shape(&env.script.records()), expected);
    assert_eq!(a.arm("deposit", arm::CONFLICT), u64::from(!on_postgres()));
    env.assert_deposit_landed_once(x, E1, 2, 50, 3, 157);
}

#[tokio::test(start_paused = true)]
async fn after_an_ambiguous_failure_the_next_write_holds_the_seq_with_a_refreshed_version() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // The request is lost before the server; meanwhile another service appends to the account.
    env.faulty.fail_next_write(Fault::LostRequest);
    let env_mem = env.mem.clone();
    let key = env.key(x);
    env.script.push(Step::After(hook(async move {
        let foreign = tally::account::named_id(Identity::REFERENCE_SERVICE_CLIENT).as_u128();
        env_mem
            .write_now(
                foreign,
                vec![AggregateWrite {
                    key,
                    events: vec![Event {
                        client_seq: 1,
                        event_id: None,
                        event_type: DEPOSITED,
                        payload: Bytes::from_static(br#"{"AmountCents":5}"#),
                        timestamp_ms: 0,
                    }],
                    expected_version: Some(1),
                    allow_create: false,
                    enforce_client_idempotency: true,
                }],
            )
            .expect("foreign write");
    })));
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 155, 3)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            // Same client seq, expected version refreshed by the catch-up.
            (2, vec![2], "ok"),
        ]
    );
    let s = env.stream(x);
    assert_eq!(events_with_id(&s, E1).len(), 1);
    assert_eq!(folded_balance(&s), 155);
}

/// Replica A, keeping no index (nor its sibling B: on Postgres the fleet shares one), runs a
/// deposit of 50 (E1) on account 1 (100 at version 1) whose write lands under seq 2 with its
/// ack lost, while B (same client id) lands 7 on top at version 3; A's next read hides
/// `lag` batches. Only the held sequence stands between A's retry and a second deposit.
async fn lost_ack_under_a_sibling_without_index(
    env: &Env,
    lag: u64,
) -> (Arc<Replica>, Result<WriteOutcome, WriteError>) {
    let a = env.replica_with(no_window(), WriteConfig::default()).await;
    let b = env.sibling_with(no_window()).await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;
    env.faulty.fail_next_write(Fault::LostAck);
    env.script.push(Step::After(hook(async move {
        b.ok(deposit(x, 7, E_SIB)).await;
    })));
    if lag > 0 {
        env.faulty.lag_next_read(lag);
    }
    let got = a.run(deposit(x, 50, E1)).await;
    (a, got)
}

#[tokio::test(start_paused = true)]
async fn the_held_seq_catches_a_landed_write_that_the_index_cannot_answer() {
    let env = Env::new();
    let x = acct(1);
    // Re-deriving after the lost ack would take seq 4 and deposit again.
    let (a, got) = lost_ack_under_a_sibling_without_index(&env, 0).await;

    // Proven by the point read, answered from current state (no index entry to replay).
    assert_eq!(got, Ok(outcome(&[(x, 157, 3)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            (3, vec![2], "2002"),
        ]
    );
    assert_eq!(a.arm("deposit", arm::SEQ_OURS), 1);
    env.assert_deposit_landed_once(x, E1, 2, 50, 3, 157);
}

/// Rule: a conflict (2003) never releases a sequence whose earlier write went unanswered.
/// That write may have landed; only the held sequence (2002 and the point read) can prove
/// it whatever the index holds: the index keeps a landing only for its window, and a run
/// (its deadline, a slow catch-up) can outlast that. Released, the sequence would be
/// re-derived on the next attempt and the deposit written twice.
#[tokio::test(start_paused = true)]
async fn a_conflict_never_releases_a_seq_whose_write_went_unanswered() {
    let env = Env::new();
    let x = acct(1);
    // No index: as when the landing is older than the window by the time it is folded. A's
    // next catch-up lags behind both writes, so its retry of seq 2 meets the version guard.
    let (_a, got) = lost_ack_under_a_sibling_without_index(&env, 2).await;

    assert_eq!(got, Ok(outcome(&[(x, 157, 3)], false)));
    let mut expected = vec![(0, vec![1], "ok"), (1, vec![2], "unknown")];
    if !on_postgres() {
        // The lagging catch-up's version: a conflict, and the held seq kept. (On Postgres
        // A's catch-up reads B's write from the shared row, not the lagging store read, and
        // its held seq meets the 2002 at once.)
        expected.push((1, vec![2], "conflict"));
    }
    expected.push((3, vec![2], "2002"));
    assert_eq!(shape(&env.script.records()), expected);
    env.assert_deposit_landed_once(x, E1, 2, 50, 3, 157);
}

#[tokio::test(start_paused = true)]
async fn a_conflict_re_derives_the_seq_from_fresh_state() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;
    // B takes seq 2 at version 2; A's local fold still says version 1, max seq 1.
    b.ok(deposit(x, 20, E_SIB)).await;

    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 170, 3)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "conflict"),
            (2, vec![3], "ok"),
        ]
    );
    assert_eq!(events_with_id(&env.stream(x), E1).len(), 1);
}

// ---------------------------------------------------------------------------------------------
// 2002: who owns the sequence
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_sibling_that_takes_our_held_seq_must_not_report_success() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // A's write (seq 2) is lost before the server: A holds seq 2. Sibling B, same client id,
    // derives seq 2 from the stream and lands it.
    env.faulty.fail_next_write(Fault::LostRequest);
    let b2 = b.clone();
    env.script.push(Step::After(hook(async move {
        assert_eq!(
            b2.ok(deposit(x, 20, E_SIB)).await,
            outcome(&[(x, 120, 2)], false)
        );
    })));
    let got = a.run(deposit(x, 10, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 130, 3)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            // Held seq on a refreshed version: 2002 about B's event. The point read says
            // sibling, so A re-derives...
            (2, vec![2], "2002"),
            // ...and lands once under a fresh seq.
            (2, vec![3], "ok"),
        ]
    );
    assert_eq!(a.arm("deposit", arm::SEQ_SIBLING), 1);
    assert_eq!(a.arm("deposit", arm::SEQ_OURS), 0);
    let s = env.stream(x);
    assert_eq!(env.batches(x), 3);
    assert_eq!(
        events_with_id(&s, E1),
        vec![(3, AccountEvent::Deposited { amount: 10 })]
    );
    assert_eq!(
        events_with_id(&s, E_SIB),
        vec![(2, AccountEvent::Deposited { amount: 20 })]
    );
    assert_eq!(folded_balance(&s), 130);
}

#[tokio::test(start_paused = true)]
async fn an_unwritten_verdict_is_a_retryable_unverifiable_and_writes_nothing() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // The store says seq 2 is taken, but no batch of ours holds it (a lagging or soft-deleted
    // view would look the same). Never guess.
    env.script
        .push(Step::Reject(StoreError::IdempotencyViolation {
            last_seq: Some(9),
            attempted_seq: Some(2),
        }));
    let got = a.run(deposit(x, 50, E1)).await;

    assert!(
        matches!(got, Err(WriteError::Unverifiable { .. })),
        "{got:?}"
    );
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "ok"), (1, vec![2], "2002")]
    );
    assert_eq!(a.arm("deposit", arm::UNVERIFIABLE), 1);
    assert_eq!(env.batches(x), 1);
    assert!(events_with_id(&env.stream(x), E1).is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_seq_whose_batch_was_trimmed_is_unwritten_not_a_verdict() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    let key = env.key(x);
    a.ok(deposit(x, 100, E0)).await;

    // A holds seq 2 after a lost request; sibling B lands seqs 2 and 3 meanwhile.
    env.faulty.fail_next_write(Fault::LostRequest);
    let b2 = b.clone();
    env.script.push(Step::After(hook(async move {
        b2.ok(deposit(x, 1, 0xB1)).await;
        b2.ok(deposit(x, 2, 0xB2)).await;
    })));
    // A's retry gets the (true) 2002 for seq 2; before A can look, the batch holding seq 2
    // is trimmed away.
    let mem = env.mem.clone();
    env.script.push(Step::After(hook(async move {
        mem.trim_start_now(key, 3).expect("trim");
    })));
    let got = a.run(deposit(x, 50, E1)).await;

    assert!(
        matches!(got, Err(WriteError::Unverifiable { .. })),
        "{got:?}"
    );
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            (3, vec![2], "2002")
        ]
    );
    assert!(events_with_id(&env.stream(x), E1).is_empty());
    // The same point read, asked directly: nothing visible holds seq 2.
    let owners = verify::read_seq_owners(env.mem.as_ref(), key, env.identity.client(), 2, 2)
        .await
        .expect("point read past the trim");
    assert_eq!(verify::ownership(&owners, 2, E1), SeqOwnership::Unwritten);

    // The caller's retry is safe: E1 never landed, so it lands now, once.
    assert_eq!(
        a.ok(deposit(x, 50, E1)).await,
        outcome(&[(x, 153, 4)], false)
    );
    assert_eq!(shape(&env.script.records()[3..]), vec![(3, vec![4], "ok")]);
    assert_eq!(
        events_with_id(&env.stream(x), E1),
        vec![(4, AccountEvent::Deposited { amount: 50 })]
    );
}

// ---------------------------------------------------------------------------------------------
// 2013: in-flight duplicates
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn an_in_flight_duplicate_is_held_and_resolves_to_a_clean_write() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // Attempt 1 times out while the server still holds it; attempt 2 (same seq) gets 2013;
    // then the held write rolls back, so attempt 3 lands cleanly with the same seq.
    env.script.push(Step::Detach(env.faulty.hold_next_write()));
    let script = env.script.clone();
    env.script.push(Step::After(hook(async move {
        script.roll_back_detached().await;
    })));
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 150, 2)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            (1, vec![2], "2013"),
            (1, vec![2], "ok"),
        ]
    );
    assert_eq!(env.faulty.counts().inflight_duplicate, 1);
    assert_eq!(a.arm("deposit", arm::INFLIGHT_DUPLICATE), 1);
    env.assert_deposit_landed_once(x, E1, 2, 50, 2, 150);
}

#[tokio::test(start_paused = true)]
async fn an_in_flight_duplicate_that_resolves_to_a_2002_is_verified_as_ours() {
    let env = Env::new();
    // A zero window takes the index out of play: the 2002 and its point read are the only
    // way this replica can learn that its held write landed.
    let a = env.replica_with(no_window(), WriteConfig::default()).await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    env.script.push(Step::Detach(env.faulty.hold_next_write()));
    let script = env.script.clone();
    env.script.push(Step::After(hook(async move {
        assert_eq!(script.commit_detached().await, Ok(vec![2]));
    })));
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 150, 2)], false)));
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "unknown"),
            (1, vec![2], "2013"),
            // The held write became durable at version 2: the held seq on the refreshed
            // version is a 2002, and the point read finds E1 on it.
            (2, vec![2], "2002"),
        ]
    );
    assert_eq!(a.arm("deposit", arm::SEQ_OURS), 1);
    env.assert_deposit_landed_once(x, E1, 2, 50, 2, 150);
}

#[tokio::test(start_paused = true)]
async fn not_applied_is_retried_as_is() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    env.faulty.fail_next_write(Fault::Refused);
    let got = a.run(deposit(x, 50, E1)).await;

    assert_eq!(got, Ok(outcome(&[(x, 150, 2)], false)));
    let records = env.script.records();
    assert_eq!(
        shape(&records),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "not_applied"),
            (1, vec![2], "ok"),
        ]
    );
    assert_eq!(
        records[1].legs, records[2].legs,
        "the identical write again"
    );
    assert_eq!(events_with_id(&env.stream(x), E1).len(), 1);
}

/// The first read after an unanswered write takes `delay` (on tokio's paused clock): a
/// store that is slow just when the loop needs it.
struct SlowReadAfterUnknown {
    armed: std::sync::atomic::AtomicBool,
    delay: Duration,
}

#[async_trait]
impl Around for SlowReadAfterUnknown {
    async fn after_write(&self, result: &StoreResult<Vec<u64>>) {
        if matches!(result, Err(StoreError::OutcomeUnknown { .. })) {
            self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    async fn before_read(&self) {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(self.delay).await;
        }
    }
}

/// Rule: no store write is sent after the write's deadline. A catch-up that outlasts it (the
/// store slow after an unanswered write) ends the run with the retryable give-up; it does
/// not go on to write once the client may already have been told to retry elsewhere, where
/// a final answer could then be contradicted by this late write (checking the
/// deadline only at the top of an attempt is not enough).
#[tokio::test(start_paused = true)]
async fn no_write_is_sent_after_the_deadline_when_a_catch_up_outlasts_it() {
    let env = Env::new();
    let write = WriteConfig::default();
    let script = Arc::new(HookedLog::around(
        env.faulty.clone(),
        SlowReadAfterUnknown {
            armed: Default::default(),
            delay: write.deadline * 2,
        },
    ));
    let pg = env.postgres().await;
    let anchor = pg.map(|_| env.server_clock.now_ms());
    let a = Replica::build(
        script.clone(),
        env.identity,
        window_only(),
        write,
        pg,
        anchor,
    )
    .await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    env.faulty.fail_next_write(Fault::LostRequest);
    let got = a.run(deposit(x, 50, E1)).await;

    assert!(
        matches!(got, Err(WriteError::GaveUp { .. })),
        "a retryable give-up, got {got:?}"
    );
    assert_eq!(
        shape(&script.records()),
        vec![(0, vec![1], "ok"), (1, vec![2], "unknown")],
        "nothing sent after the deadline"
    );
    assert!(events_with_id(&env.stream(x), E1).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Transfers
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_transfer_retried_after_a_lost_ack_lands_both_legs_exactly_once() {
    let env = Env::new();
    let a = env.replica().await;
    let (from, to) = (acct(1), acct(2));
    a.ok(deposit(from, 100, E0)).await;

    env.faulty.fail_next_write(Fault::LostAck);
    let got = a.run(transfer(from, to, 30, E1)).await;

    assert_eq!(got, Ok(outcome(&[(from, 70, 2), (to, 30, 1)], false)));
    let records = env.script.records();
    assert_eq!(
        records.len(),
        2,
        "one transfer write, never a second: {records:?}"
    );
    assert_eq!(
        records[1].legs,
        vec![
            LegRecord {
                key: env.key(from),
                expected_version: Some(1),
                seqs: vec![2],
                event_ids: vec![Some(E1)],
                allow_create: true,
            },
            LegRecord {
                key: env.key(to),
                expected_version: Some(0),
                seqs: vec![1],
                event_ids: vec![Some(E1)],
                allow_create: true,
            },
        ]
    );
    assert_eq!(label(&records[1].result), "unknown");
    let (sf, st) = (env.stream(from), env.stream(to));
    assert_eq!((sf.len(), st.len()), (2, 1));
    assert_eq!(
        events_with_id(&sf, E1),
        vec![(2, AccountEvent::TransferredOut { amount: 30, to })]
    );
    assert_eq!(
        events_with_id(&st, E1),
        vec![(1, AccountEvent::TransferredIn { amount: 30, from })]
    );
    assert_eq!((folded_balance(&sf), folded_balance(&st)), (70, 30));
}

#[tokio::test(start_paused = true)]
async fn a_transfer_2002_is_settled_by_either_leg_a_sibling_on_one_leg_means_it_never_landed() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let (from, to) = (acct(1), acct(2));
    a.ok(deposit(from, 100, E0)).await;

    // The transfer (seqs: from 2, to 1) is lost before the server; sibling B lands seq 2 on
    // `from`. The held retry gets a 2002: `from`'s seq 2 is B's, `to`'s seq 1 is unwritten
    // (the violation was on the other leg), which together say: never landed.
    env.faulty.fail_next_write(Fault::LostRequest);
    let b2 = b.clone();
    env.script.push(Step::After(hook(async move {
        b2.ok(deposit(from, 20, E_SIB)).await;
    })));
    let got = a.run(transfer(from, to, 30, E1)).await;

    assert_eq!(got, Ok(outcome(&[(from, 90, 3), (to, 30, 1)], false)));
    let legs: Vec<Vec<(Option<u64>, Vec<u64>)>> = env.script.records()[1..]
        .iter()
        .map(|r| {
            r.legs
                .iter()
                .map(|l| (l.expected_version, l.seqs.clone()))
                .collect()
        })
        .collect();
    assert_eq!(
        legs,
        vec![
            vec![(Some(1), vec![2]), (Some(0), vec![1])],
            vec![(Some(2), vec![2]), (Some(0), vec![1])],
            vec![(Some(2), vec![3]), (Some(0), vec![1])],
        ]
    );
    let labels: Vec<_> = env.script.records()[1..]
        .iter()
        .map(|r| label(&r.result))
        .collect();
    assert_eq!(labels, vec!["unknown", "2002", "ok"]);
    assert_eq!(a.arm("transfer", arm::SEQ_SIBLING), 1);
    let (sf, st) = (env.stream(from), env.stream(to));
    assert_eq!(events_with_id(&sf, E1).len(), 1);
    assert_eq!(events_with_id(&st, E1).len(), 1);
    assert_eq!((folded_balance(&sf), folded_balance(&st)), (90, 30));
}

#[tokio::test(start_paused = true)]
async fn a_transfer_is_answered_from_either_legs_entry_and_a_missing_leg_is_rebuilt_not_rewritten()
{
    if memory_only("each replica ages the entries it folds; Postgres rows carry one expiry") {
        return;
    }
    let env = Env::new();
    let a = env.sibling().await;
    let (from, to) = (acct(1), acct(2));
    a.ok(deposit(from, 100, E0)).await;
    assert_eq!(
        a.ok(transfer(from, to, 30, E1)).await,
        outcome(&[(from, 70, 2), (to, 30, 1)], false)
    );
    // Later writes on both accounts, so "current state" differs from the original response;
    // `to`'s a minute later in server time, and another account's later still.
    a.ok(withdraw(from, 10, E3)).await;
    env.server_clock.advance(60_000);
    a.ok(deposit(to, 5, E2)).await;
    env.server_clock.advance(30_000);
    let z = acct(3);
    a.ok(deposit(z, 1, E4)).await;
    let batches = (env.batches(from), env.batches(to));
    assert_eq!(batches, (3, 2));

    // A replica ages what it folds against the newest server time it has seen. Replica B
    // folds `from` (newest batch at T0) before `to` (newest at T0 + 60 s): `from`'s entry was
    // aged 0, `to`'s 60 s, so past `to`'s expiry only the `from` leg still answers.
    let b = env.replica().await;
    b.projection.refresh(from, &[]).await.expect("fold from");
    b.projection.refresh(to, &[]).await.expect("fold to");
    b.clock.advance_ms(WINDOW_MS - 60_000 + 1);
    assert_eq!(b.indexed(to, E1).await, None);
    assert_eq!(b.indexed(from, E1).await, Some((70, 2)));

    // Replica C folds `to` (aged 60 s), then sees z's newer server time before folding
    // `from` (aged 90 s): the mirror image.
    let c = env.replica().await;
    c.projection.refresh(to, &[]).await.expect("fold to");
    c.projection.refresh(z, &[]).await.expect("fold z");
    c.projection.refresh(from, &[]).await.expect("fold from");
    c.clock.advance_ms(WINDOW_MS - 90_000 + 1);
    assert_eq!(c.indexed(from, E1).await, None);
    assert_eq!(c.indexed(to, E1).await, Some((30, 1)));

    // The hit on `from` proves the whole transfer landed; `to` is rebuilt from current state.
    assert_eq!(
        b.run(transfer(from, to, 30, E1)).await,
        Ok(outcome(&[(from, 70, 2), (to, 35, 2)], true))
    );
    // The hit on `to` proves it too; `from` is rebuilt from current state.
    assert_eq!(
        c.run(transfer(from, to, 30, E1)).await,
        Ok(outcome(&[(from, 60, 3), (to, 30, 1)], true))
    );
    assert!(env.script.records().is_empty(), "neither replica wrote");
    assert_eq!((env.batches(from), env.batches(to)), batches);
    assert_eq!(events_with_id(&env.stream(from), E1).len(), 1);
    assert_eq!(events_with_id(&env.stream(to), E1).len(), 1);
}

// ---------------------------------------------------------------------------------------------
// The recent-writes index across replicas and over time
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_replica_that_folded_another_replicas_write_answers_its_retry_with_the_original_response()
{
    let env = Env::new();
    let a = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;
    assert_eq!(
        a.ok(deposit(x, 50, E1)).await,
        outcome(&[(x, 150, 2)], false)
    );

    // B folds the stream (serving a read, say), then A writes again.
    let b = env.replica().await;
    b.projection.refresh(x, &[]).await.expect("fold");
    a.ok(withdraw(x, 30, E2)).await;

    // The caller's retry of E1 lands on B: the original response, not current state.
    assert_eq!(
        b.run(deposit(x, 50, E1)).await,
        Ok(outcome(&[(x, 150, 2)], true))
    );
    // A replica that never saw the account folds it during the retry's own catch-up.
    let c = env.replica().await;
    assert_eq!(
        c.run(deposit(x, 50, E1)).await,
        Ok(outcome(&[(x, 150, 2)], true))
    );
    // Nothing landed: C's first touch wrote at version 0 (the account might have been new)
    // and the version guard refused it; B wrote nothing.
    assert_eq!(shape(&env.script.records()), first_touch_bounces(1));
    let s = env.stream(x);
    assert_eq!(env.batches(x), 3);
    assert_eq!(events_with_id(&s, E1).len(), 1);
    assert_eq!(folded_balance(&s), 120);
}

#[tokio::test(start_paused = true)]
async fn a_write_gets_the_full_window_even_when_the_replicas_server_tip_is_old() {
    if memory_only(
        "an unanchored replica's own entries; a Postgres replica's records take their expiry \
         from the server-time tip its start-up anchors (and the harness anchors at build)",
    ) {
        return;
    }
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;
    a.projection.refresh(x, &[]).await.expect("fold");
    let tip = a.projection.server_tip_ms();
    assert!(tip <= T0, "A has seen nothing newer than T0");

    // The account idles for 80 s (server and local time alike), then A writes on its warm
    // fold without reading: A's server-time tip stays 80 s behind the new batch.
    env.server_clock.advance(80_000);
    a.clock.advance_ms(80_000);
    assert_eq!(
        a.ok(deposit(x, 50, E1)).await,
        outcome(&[(x, 150, 2)], false)
    );
    assert!(
        a.projection.server_tip_ms() < T0 + 80_000,
        "A's tip is behind its own new batch"
    );

    // A retry just inside the window from the write is answered, not written again.
    a.clock.advance_ms(WINDOW_MS - 1);
    assert_eq!(
        a.run(deposit(x, 50, E1)).await,
        Ok(outcome(&[(x, 150, 2)], true))
    );
    assert_eq!(env.batches(x), 2);
    assert_eq!(events_with_id(&env.stream(x), E1).len(), 1);
    // And the window is what it says: one millisecond later the entry is gone.
    assert_eq!(a.indexed(x, E1).await, Some((150, 2)));
    a.clock.advance_ms(1);
    assert_eq!(a.indexed(x, E1).await, None);
    assert_eq!(a.projection.sweep().index_entries_expired, 2);
}

#[tokio::test(start_paused = true)]
async fn folding_an_old_batch_never_revives_its_entry_when_any_account_shows_a_newer_server_time() {
    if memory_only("each replica ages the entries it folds; Postgres rows carry one expiry") {
        return;
    }
    let env = Env::new();
    let w = env.sibling().await;
    let (x, z) = (acct(1), acct(2));
    w.ok(deposit(x, 100, E1)).await; // x at T0
    env.server_clock.advance(WINDOW_MS + 10_000);
    w.ok(deposit(z, 5, E2)).await; // z at T0 + 100 s

    // B has seen z's newer server time before it folds x: x's batch is 100 s old.
    let b = env.replica().await;
    b.projection.refresh(z, &[]).await.expect("fold z");
    b.projection.refresh(x, &[]).await.expect("fold x");
    assert_eq!(b.indexed(z, E2).await, Some((5, 1)));
    assert_eq!(
        b.indexed(x, E1).await,
        None,
        "an expired write is not revived"
    );
    assert_eq!(
        b.projection
            .resident_slot(x)
            .map(|s| s.state.lock().recent.len()),
        Some(0)
    );

    // Contrast: a replica that has seen nothing newer than x's batch, and is not anchored to
    // the server's clock, measures its age as 0. That is why an App serves nothing until its
    // start-up has anchored it.
    let c = env.replica().await;
    c.projection.refresh(x, &[]).await.expect("fold x");
    assert_eq!(c.indexed(x, E1).await, Some((100, 1)));

    // Within one read, the read's own newest batch is the reference too.
    w.ok(deposit(x, 1, E3)).await; // x v2 at T0 + 100 s
    let d = env.replica().await;
    d.projection.refresh(x, &[]).await.expect("fold x");
    assert_eq!(d.indexed(x, E1).await, None);
    assert_eq!(d.indexed(x, E3).await, Some((101, 2)));
}

/// Black-box finding: a replica started after the window folded an idle account and replayed
/// a retry of its last write as if the window were still open, while a replica that had kept
/// the account wrote it again. Anchored to the server's clock at start, the new replica
/// measures the batch's real age.
#[tokio::test(start_paused = true)]
async fn a_replica_anchored_to_the_server_clock_never_revives_an_idle_accounts_expired_entries() {
    let env = Env::new();
    let w = env.sibling().await;
    let x = acct(1);
    w.ok(deposit(x, 100, E1)).await; // x at T0, nothing written since
    env.server_clock.advance(WINDOW_MS + 10_000);

    let b = env.replica().await;
    assert_eq!(
        b.projection.sync_server_clock().await,
        Ok(T0 + WINDOW_MS + 10_000)
    );
    b.projection.refresh(x, &[]).await.expect("fold x");
    assert_eq!(
        b.indexed(x, E1).await,
        None,
        "an expired write is not revived"
    );

    // Past the window a retry is a new request: it writes again, as the API says.
    assert_eq!(
        b.run(deposit(x, 100, E1)).await,
        Ok(outcome(&[(x, 200, 2)], false))
    );
    assert_eq!(events_with_id(&env.stream(x), E1).len(), 2);
    let clock = env.identity.server_clock_key();
    assert_eq!(env.mem.batch_count(clock), 1, "one probe");
    assert_ne!(
        clock.aggregate_type_id,
        env.key(x).aggregate_type_id,
        "the probe is never in an account's stream"
    );
}

/// Review finding: reads only ever raise the estimate of the server's now, so one that ran
/// ahead (a local clock running fast, a server clock stepped back) would age every later
/// batch too much, and a fresh write would not be indexed. A re-anchor replaces it.
#[tokio::test(start_paused = true)]
async fn a_re_anchor_corrects_an_estimate_of_the_servers_now_that_ran_ahead() {
    let env = Env::new();
    let (w, b) = (env.sibling().await, env.replica().await);
    let x = acct(1);
    b.projection.sync_server_clock().await.expect("anchor");
    assert_eq!(b.projection.server_tip_ms(), T0);

    // B's clock runs fast: 200 s pass locally while 100 s pass on the server (and on W).
    b.clock.advance_ms(200_000);
    env.server_clock.advance(100_000);
    w.clock.advance_ms(100_000);
    assert_eq!(b.projection.server_tip_ms(), T0 + 200_000, "ahead by 100 s");

    b.projection.sync_server_clock().await.expect("re-anchor");
    assert_eq!(b.projection.server_tip_ms(), T0 + 100_000, "corrected");
    w.ok(deposit(x, 100, E1)).await;
    b.projection.refresh(x, &[]).await.expect("fold x");
    assert_eq!(
        b.indexed(x, E1).await,
        Some((100, 1)),
        "a fresh write is indexed"
    );
    assert_eq!(
        b.run(deposit(x, 100, E1)).await,
        Ok(outcome(&[(x, 100, 1)], true))
    );
    assert_eq!(
        env.mem.batch_count(env.identity.server_clock_key()),
        1,
        "each probe trims the ones before it"
    );
}

/// Black-box finding: a replica that wrote an account itself, dropped it as idle and folded it
/// again after the window revived its entry: its tip was the last server time it had read.
/// The tip runs on with the local clock between reads.
#[tokio::test(start_paused = true)]
async fn refolding_an_evicted_account_after_the_window_does_not_revive_its_own_write() {
    let env = Env::new();
    let a = env
        .replica_with(
            ProjectionConfig {
                idle_timeout: Duration::from_secs(1),
                ..window_only()
            },
            WriteConfig::default(),
        )
        .await;
    a.projection.sync_server_clock().await.expect("anchor");
    let x = acct(1);
    a.ok(deposit(x, 100, E1)).await;

    env.server_clock.advance(WINDOW_MS + 10_000);
    a.clock.advance_ms(WINDOW_MS + 10_000);
    assert_eq!(a.projection.sweep().evicted_idle, 1);
    assert!(a.projection.resident_slot(x).is_none());

    a.projection.refresh(x, &[]).await.expect("re-fold x");
    assert_eq!(
        a.indexed(x, E1).await,
        None,
        "its own expired write is not revived"
    );
    assert_eq!(
        a.run(deposit(x, 100, E1)).await,
        Ok(outcome(&[(x, 200, 2)], false))
    );
}

// ---------------------------------------------------------------------------------------------
// Keys, duplicates, rules
// ---------------------------------------------------------------------------------------------

/// Rule (first touch): a deposit to an account this replica has never loaded is
/// written at version 0 without reading first, so a brand-new account costs one store
/// round trip. On an account that exists the version guard refuses it, the catch-up the
/// first touch started beside the write gives the state, and the refusal is not counted as
/// an attempt: a replica allowed one attempt still lands the deposit, once.
#[tokio::test(start_paused = true)]
async fn a_first_touch_writes_at_version_zero_and_a_bounce_costs_no_attempt() {
    if memory_only("the Postgres projection reads the account's row on a first touch") {
        return;
    }
    let env = Env::new();
    let one_attempt = WriteConfig {
        max_attempts: 1,
        ..WriteConfig::default()
    };
    let a = env.replica_with(window_only(), one_attempt).await;
    let x = acct(1);
    let round_trips = |r: &Replica| {
        let h = &r.projection.metrics().store_round_trips_per_write;
        (h.get_sample_count(), h.get_sample_sum())
    };
    assert_eq!(
        a.ok(deposit(x, 100, E0)).await,
        outcome(&[(x, 100, 1)], false)
    );
    assert_eq!(round_trips(&a), (1, 1.0), "one round trip: the write");
    // The account is warm after its first write: the next one writes at its cursor.
    assert_eq!(
        a.ok(deposit(x, 5, E1)).await,
        outcome(&[(x, 105, 2)], false)
    );
    assert_eq!(round_trips(&a), (2, 2.0));

    let b = env.replica_with(window_only(), one_attempt).await;
    assert_eq!(
        b.ok(deposit(x, 50, E2)).await,
        outcome(&[(x, 155, 3)], false)
    );
    assert_eq!(
        round_trips(&b),
        (1, 3.0),
        "the bounce, the read beside it, the write"
    );
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "ok"),
            (0, vec![1], "conflict"),
            (2, vec![3], "ok"),
        ]
    );
    // Withdrawals never take a first touch (a balance of 0 would refuse them).
    let c = env.replica().await;
    assert_eq!(
        c.ok(withdraw(x, 55, E3)).await,
        outcome(&[(x, 100, 4)], false)
    );
    assert_eq!(
        env.script.records().len(),
        5,
        "c read first, then wrote once"
    );
    assert_eq!(events_with_id(&env.stream(x), E2).len(), 1);

    // An account evicted while it held events is known to exist: it is read first again.
    let idle_ms = window_only().idle_timeout.as_millis() as u64;
    b.clock.advance_ms(idle_ms + 1);
    assert_eq!(b.projection.sweep().evicted_idle, 1);
    assert!(b.projection.resident_slot(x).is_none());
    assert_eq!(
        b.ok(deposit(x, 1, E4)).await,
        outcome(&[(x, 101, 5)], false)
    );
    assert_eq!(
        shape(&env.script.records())[5..],
        [(4, vec![5], "ok")],
        "no bounce"
    );
}

#[tokio::test(start_paused = true)]
async fn reusing_a_key_for_a_different_operation_is_key_reused_and_writes_nothing() {
    let env = Env::new();
    let a = env.replica().await;
    let (x, y) = (acct(1), acct(2));
    a.ok(deposit(x, 50, E1)).await;

    for other in [
        deposit(x, 60, E1),
        withdraw(x, 50, E1),
        transfer(x, y, 50, E1),
    ] {
        assert_eq!(a.run(other).await, Err(WriteError::KeyReused), "{other:?}");
    }
    // On a replica that only knows the key from its fold, too.
    let b = env.replica().await;
    assert_eq!(b.run(deposit(x, 60, E1)).await, Err(WriteError::KeyReused));
    // The same operation under the same key is a replay, not a reuse.
    assert_eq!(
        b.run(deposit(x, 50, E1)).await,
        Ok(outcome(&[(x, 50, 1)], true))
    );
    // Only the first deposit landed; B's first touch (its reuse) bounced at version 0.
    let mut expected = vec![(0, vec![1], "ok")];
    expected.extend(first_touch_bounces(1));
    assert_eq!(shape(&env.script.records()), expected);
    assert_eq!(env.batches(x), 1);
    assert_eq!(env.batches(y), 0);
    assert_eq!(a.projection.metrics().idem_key_reuse.get(), 3);
}

#[tokio::test(start_paused = true)]
async fn concurrent_duplicates_on_one_replica_are_coalesced_into_one_write() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    let mut hold = env.faulty.hold_next_write();
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.run(deposit(x, 50, E1)).await }
    });
    assert!(hold.held().await);
    let second = tokio::spawn({
        let a = a.clone();
        async move { a.run(deposit(x, 50, E1)).await }
    });
    let reused = tokio::spawn({
        let a = a.clone();
        async move { a.run(withdraw(x, 50, E1)).await }
    });
    // Both duplicates reach the replica and wait on the first before it is released.
    let coalesced = || a.projection.metrics().idem_coalesced.get();
    for _ in 0..1_000 {
        if coalesced() == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(coalesced(), 2);
    hold.release();

    let (r1, r2) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(r1, Ok(outcome(&[(x, 150, 2)], false)));
    assert_eq!(r2, Ok(outcome(&[(x, 150, 2)], true)));
    assert_eq!(reused.await.unwrap(), Err(WriteError::KeyReused));
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "ok"), (1, vec![2], "ok")]
    );
    let s = env.stream(x);
    assert_eq!(env.batches(x), 2);
    assert_eq!(events_with_id(&s, E1).len(), 1);
    assert_eq!(folded_balance(&s), 150);
}

#[tokio::test(start_paused = true)]
async fn a_different_operation_waiting_on_a_refused_first_is_decided_on_its_own() {
    // The same rule as one sent after the refusal: nothing landed under the key, so the
    // waiting request is a new request, never a reused key.
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    let mut hold = env.faulty.hold_next_write();
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.run(withdraw(x, 50, E1)).await }
    });
    assert!(hold.held().await);
    let second = tokio::spawn({
        let a = a.clone();
        async move { a.run(deposit(x, 30, E1)).await }
    });
    let coalesced = || a.projection.metrics().idem_coalesced.get();
    for _ in 0..1_000 {
        if coalesced() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(coalesced(), 1);
    // Another replica empties the account while the first write is held: released, it
    // bounces, and on fresh state the withdrawal is refused.
    b.ok(withdraw(x, 100, E_SIB)).await;
    hold.release();

    assert_eq!(
        first.await.unwrap(),
        Err(WriteError::Rule(RuleError::InsufficientFunds {
            balance: 0
        }))
    );
    assert_eq!(second.await.unwrap(), Ok(outcome(&[(x, 30, 3)], false)));
    assert_eq!(a.projection.metrics().idem_key_reuse.get(), 0);
    let s = env.stream(x);
    assert_eq!(events_with_id(&s, E1).len(), 1);
    assert_eq!(folded_balance(&s), 30);
}

#[tokio::test(start_paused = true)]
async fn a_rule_rejection_on_a_stale_local_fold_is_not_final_until_checked_on_fresh_state() {
    let env = Env::new();
    let a = env.replica().await;
    let b = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 10, E0)).await;
    // Another replica deposits; A's warm fold still says 10.
    b.ok(deposit(x, 100, E_SIB)).await;

    assert_eq!(
        a.run(withdraw(x, 50, E1)).await,
        Ok(outcome(&[(x, 60, 3)], false))
    );
    assert_eq!(a.arm("withdraw", arm::REJECTED), 0);
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "ok"), (2, vec![3], "ok")],
        "nothing was sent on the stale fold"
    );

    // A rejection on fresh state is final, and nothing is written.
    assert_eq!(
        a.run(withdraw(x, 1_000, E2)).await,
        Err(WriteError::Rule(RuleError::InsufficientFunds {
            balance: 60
        }))
    );
    assert_eq!(a.arm("withdraw", arm::REJECTED), 1);
    assert_eq!(env.script.records().len(), 2);
    let s = env.stream(x);
    assert_eq!(env.batches(x), 3);
    assert!(events_with_id(&s, E2).is_empty());
    assert_eq!(folded_balance(&s), 60);
}

#[tokio::test(start_paused = true)]
async fn a_rule_rejection_is_final_only_on_state_that_reached_the_stores_tip() {
    let env = Env::new();
    let a = env.sibling().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;
    // The withdraw lands on A (funded by the deposit before it), but the caller never gets
    // the answer and retries on B, whose catch-up read lags behind both batches: on that
    // state the withdraw looks like an overdraw.
    assert_eq!(
        a.ok(withdraw(x, 100, E1)).await,
        outcome(&[(x, 0, 2)], false)
    );
    let b = env.replica().await;
    env.faulty.lag_next_read(2);
    assert_eq!(
        b.run(withdraw(x, 100, E1)).await,
        Ok(outcome(&[(x, 0, 2)], true)),
        "a request that landed is never answered with a rule error"
    );
    assert!(env.script.records().is_empty(), "and never written again");
    assert_eq!(events_with_id(&env.stream(x), E1).len(), 1);

    // A new request is not falsely rejected on a lagging read either.
    a.ok(deposit(x, 30, E2)).await;
    env.faulty.lag_next_read(1);
    assert_eq!(
        b.run(withdraw(x, 30, E3)).await,
        Ok(outcome(&[(x, 0, 4)], false))
    );
    assert_eq!(b.arm("withdraw", arm::REJECTED), 0);
    assert_eq!(shape(&env.script.records()), vec![(3, vec![4], "ok")]);
    let s = env.stream(x);
    assert_eq!(env.batches(x), 4);
    assert_eq!(folded_balance(&s), 0);
}

// ---------------------------------------------------------------------------------------------
// Bounds
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn bounded_attempts_give_up_retryably_when_every_write_is_refused() {
    let env = Env::build(
        FaultConfig {
            refused: 1.0,
            ..FaultConfig::default()
        },
        None,
    );
    let a = env
        .replica_with(
            window_only(),
            WriteConfig {
                max_attempts: 4,
                ..WriteConfig::default()
            },
        )
        .await;
    let x = acct(1);

    let got = a.run(deposit(x, 50, E1)).await;

    match got {
        Err(WriteError::GaveUp { attempts: 4, last }) => {
            assert!(last.contains("not applied"), "{last}")
        }
        other => panic!("expected GaveUp after 4 attempts, got {other:?}"),
    }
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "not_applied"); 4]
    );
    assert_eq!(env.faulty.counts().refused, 4);
    assert_eq!(env.batches(x), 0);
    assert_eq!(a.arm("deposit", arm::GAVE_UP), 1);
}

/// Real time: the deadline runs on the wall clock.
#[tokio::test]
async fn the_deadline_gives_up_retryably_before_the_attempts_run_out() {
    on_real_clock();
    let env = Env::build(
        FaultConfig {
            refused: 1.0,
            ..FaultConfig::default()
        },
        None,
    );
    let a = env
        .replica_with(
            window_only(),
            WriteConfig {
                max_attempts: 1_000,
                deadline: Duration::from_millis(40),
                ..WriteConfig::default()
            },
        )
        .await;
    let x = acct(1);

    let started = Instant::now();
    let got = a.run(deposit(x, 50, E1)).await;
    let took = started.elapsed();

    match got {
        Err(WriteError::GaveUp { attempts, .. }) => {
            assert!((2..1_000).contains(&attempts), "{attempts}");
            // Every attempt wrote, except the last when its backoff ran past the deadline:
            // nothing is sent after it.
            let writes = env.script.records().len() as u32;
            assert!(
                writes == attempts || writes + 1 == attempts,
                "{writes} writes in {attempts} attempts"
            );
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    assert!(took >= Duration::from_millis(40), "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(env.batches(x), 0);
}

// ---------------------------------------------------------------------------------------------
// Streams the fold cannot read whole
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_trimmed_stream_is_an_error_on_a_cold_replica_and_no_obstacle_on_a_warm_one() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    for (amount, eid) in [(10, E0), (20, E1), (30, E2)] {
        a.ok(deposit(x, amount, eid)).await;
    }
    env.mem.trim_start_now(env.key(x), 3).expect("trim");

    let trimmed = ProjectionError::Trimmed {
        account: x,
        min_available: 3,
    };
    let cold = env.cold_replica().await;
    assert_eq!(
        cold.run(deposit(x, 5, E_SIB)).await,
        Err(WriteError::Account(trimmed.clone())),
        "never a balance folded from part of the stream"
    );
    assert_eq!(cold.projection.refresh(x, &[]).await.err(), Some(trimmed));

    // A's cursor is past the trim point: it keeps working.
    assert_eq!(
        a.run(deposit(x, 40, E3)).await,
        Ok(outcome(&[(x, 100, 4)], false))
    );
    let snap = a
        .projection
        .refresh(x, &[])
        .await
        .expect("warm catch-up")
        .snap;
    assert_eq!((snap.balance, snap.version), (100, 4));
    let s = env.stream(x);
    assert_eq!(s.iter().map(|b| b.version).collect::<Vec<_>>(), vec![3, 4]);
    assert!(events_with_id(&s, E_SIB).is_empty());
    assert_eq!(events_with_id(&s, E3).len(), 1);
}

/// Writes one batch of `events` (sequence, event id, type, payload) to `account` under OUR
/// client id, as something sharing it could.
fn own_client_write(
    env: &Env,
    account: AccountId,
    events: Vec<(u64, u128, EventType, &'static [u8])>,
) {
    let key = env.key(account);
    let version = env.mem.details_now(key).map_or(0, |d| d.max_version);
    env.mem
        .write_now(
            env.identity.client(),
            vec![AggregateWrite {
                key,
                events: events
                    .into_iter()
                    .map(|(client_seq, id, event_type, payload)| Event {
                        client_seq,
                        event_id: Some(id),
                        event_type,
                        payload: Bytes::from_static(payload),
                        timestamp_ms: 0,
                    })
                    .collect(),
                expected_version: Some(version),
                allow_create: true,
                enforce_client_idempotency: false,
            }],
        )
        .expect("own-client write");
}

/// Rule: a batch folds whole or not at all, its recent-writes entries included: a batch
/// whose second event cannot be decoded leaves no entry for its first (else
/// the entries would be kept, counted against the index's cap and, on Postgres, persisted).
#[tokio::test(start_paused = true)]
async fn a_batch_that_does_not_fold_whole_leaves_no_index_entry() {
    let env = Env::new();
    let x = acct(1);
    own_client_write(
        &env,
        x,
        vec![
            (1, E0, DEPOSITED, br#"{"AmountCents":5}"#),
            (2, E1, DEPOSITED, br#"{"AmountCents":"lots"}"#),
        ],
    );
    let a = env.replica().await;
    let got = a.projection.refresh(x, &[]).await.err();
    assert!(
        matches!(got, Some(ProjectionError::Poisoned { version: 1, .. })),
        "{got:?}"
    );
    assert_eq!(a.indexed(x, E0).await, None);
    assert_eq!(a.projection.index_entries(), 0);
}

/// Rule: a stream holding a client sequence of ours past `MAX_OWN_CLIENT_SEQ` (written by
/// something else under our client id) poisons its account: the next sequence cannot be
/// derived without overflowing (before: `u64::MAX + 1`, a panic in debug builds and a
/// wrap to 0 in release, where every write then answered 409 for ever).
#[tokio::test(start_paused = true)]
async fn a_client_sequence_of_ours_past_the_bound_poisons_the_account() {
    let env = Env::new();
    let x = acct(1);
    own_client_write(
        &env,
        x,
        vec![(u64::MAX, E0, DEPOSITED, br#"{"AmountCents":5}"#)],
    );
    let a = env.cold_replica().await;
    let got = a.run(deposit(x, 5, E1)).await;
    assert!(
        matches!(
            got,
            Err(WriteError::Account(ProjectionError::Poisoned {
                version: 1,
                ..
            }))
        ),
        "{got:?}"
    );
    assert_eq!(env.batches(x), 1, "nothing written");
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_event_poisons_the_account_naming_its_version() {
    let env = Env::new();
    let a = env.replica().await;
    let (x, y) = (acct(1), acct(2));
    a.ok(deposit(x, 100, E0)).await;
    env.foreign_write(x, DEPOSITED, br#"{"AmountCents":"lots"}"#);
    env.foreign_write(x, DEPOSITED, br#"{"AmountCents":1}"#);

    let poisoned_at = |r: &Result<WriteOutcome, WriteError>| match r {
        Err(WriteError::Account(ProjectionError::Poisoned {
            account, version, ..
        })) => Some((*account, *version)),
        _ => None,
    };
    // A cold replica stops at version 2.
    let cold = env.cold_replica().await;
    let got = cold.run(deposit(x, 5, E1)).await;
    assert_eq!(poisoned_at(&got), Some((x, 2)), "{got:?}");
    // The warm writer's stale write bounces, and its catch-up hits the same event.
    let got = a.run(deposit(x, 5, E2)).await;
    assert_eq!(poisoned_at(&got), Some((x, 2)), "{got:?}");
    // It stays poisoned: every later request answers the same.
    let again = cold.projection.refresh(x, &[]).await.err();
    assert!(
        matches!(again, Some(ProjectionError::Poisoned { version: 2, .. })),
        "{again:?}"
    );

    // An unknown event type poisons too, and is named.
    env.foreign_write(
        y,
        EventType {
            major: 99,
            minor: 0,
        },
        b"{}",
    );
    let got = cold.run(deposit(y, 5, E3)).await;
    assert_eq!(poisoned_at(&got), Some((y, 1)), "{got:?}");

    assert_eq!(env.batches(x), 3);
    assert_eq!(env.batches(y), 1);
    let written: Vec<_> = shape(&env.script.records());
    // The cold replica's first touches (x, then y) write at version 0 and bounce.
    let bounce = || first_touch_bounces(1);
    let expected: Vec<_> = [
        vec![(0, vec![1], "ok")],
        bounce(),
        vec![(1, vec![2], "conflict")],
        bounce(),
    ]
    .concat();
    assert_eq!(written, expected, "nothing written past the poison");
}

// ---------------------------------------------------------------------------------------------
// The hot account
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn hot_account_deposits_are_batched_and_each_lands_exactly_once() {
    const N: u64 = 64;
    let env = Env::build(FaultConfig::default(), Some(Duration::from_millis(2)));
    let a = env.replica().await;
    let x = acct(1);

    let tasks: Vec<_> = (1..=N)
        .map(|i| {
            let a = a.clone();
            tokio::spawn(async move { a.run(deposit(x, i as i64, 0x1000 + u128::from(i))).await })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }

    let s = env.stream(x);
    let running = running_balances(&s);
    assert_eq!(running.len() as u64, N, "every deposit, once");
    assert!(
        env.batches(x) < N as usize,
        "{} batches for {N} requests",
        env.batches(x)
    );
    for (i, answer) in (1..=N).zip(&answers) {
        let eid = 0x1000 + u128::from(i);
        let outcome = answer.as_ref().unwrap_or_else(|e| panic!("{eid:x}: {e}"));
        assert!(!outcome.replayed);
        let hits: Vec<_> = running.iter().filter(|r| r.1 == Some(eid)).collect();
        assert_eq!(hits.len(), 1, "{eid:x} lands exactly once");
        let (version, _, balance) = *hits[0];
        assert_eq!(
            outcome.legs,
            vec![LegResult {
                account: x,
                balance,
                version
            }],
            "each response is its own event's balance and batch"
        );
    }
    assert_eq!(folded_balance(&s), (N * (N + 1) / 2) as i64);
}

#[tokio::test(start_paused = true)]
async fn an_overdraw_inside_a_batch_is_rejected_alone() {
    let env = Env::new();
    let a = env.replica().await;
    let x = acct(1);
    a.ok(deposit(x, 100, E0)).await;

    // A deposit holds the account's writer (its write held in flight) while three requests
    // queue behind it; they are then written together.
    let mut hold = env.faulty.hold_next_write();
    let spawn = |req: WriteRequest| {
        let a = a.clone();
        tokio::spawn(async move { a.run(req).await })
    };
    let first = spawn(deposit(x, 1, E1));
    assert!(hold.held().await);
    let w1 = spawn(withdraw(x, 60, 0xA1));
    let w2 = spawn(withdraw(x, 60, 0xA2));
    let d3 = spawn(deposit(x, 5, 0xA3));
    // Current-thread runtime: the spawned tasks run in spawn order as soon as this task
    // yields; each enqueues its request on its first poll, then waits for the account's
    // writer. (Had one missed the queue, it would land in a batch of its own and the
    // batch assertions below would fail, not pass.)
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    hold.release();

    assert_eq!(first.await.unwrap(), Ok(outcome(&[(x, 101, 2)], false)));
    assert_eq!(w1.await.unwrap(), Ok(outcome(&[(x, 41, 3)], false)));
    // Refused on top of w1, which had not landed yet, so the refusal waits for the batch:
    // it is final on the state the account really reached (41 + 5), never on a speculative one.
    assert_eq!(
        w2.await.unwrap(),
        Err(WriteError::Rule(RuleError::InsufficientFunds {
            balance: 46
        }))
    );
    assert_eq!(d3.await.unwrap(), Ok(outcome(&[(x, 46, 3)], false)));
    let records = env.script.records();
    assert_eq!(
        shape(&records),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "ok"),
            (2, vec![3, 4], "ok")
        ],
        "the overdraw is left out of the batch; the others go together"
    );
    assert_eq!(records[2].legs[0].event_ids, vec![Some(0xA1), Some(0xA3)]);
    let s = env.stream(x);
    assert_eq!(env.batches(x), 3);
    assert!(events_with_id(&s, 0xA2).is_empty());
    assert_eq!(folded_balance(&s), 46);
}

// ---------------------------------------------------------------------------------------------
// Everything at once
// ---------------------------------------------------------------------------------------------

/// Seeds the chaos test always runs. `TALLY_CHAOS_SEEDS=n` runs seeds `0..n` instead (each
/// as deterministic as these), for a wider search.
const CHAOS_SEEDS: &[u64] = &[0x7a11_5eed, 1, 2, 3];

/// Seeded faults on every path (lost acks, lost requests, refusals, in-flight holds, lagging
/// reads), three replicas sharing one client id, concurrent callers that retry every
/// retryable failure on another replica with the same key. Whatever happens: every request
/// lands at most once, a request answered Ok landed exactly once, a request answered with a
/// rule error never landed, and no account's folded balance ever goes below zero.
#[test]
fn under_seeded_faults_every_request_lands_at_most_once_and_rules_hold() {
    let seeds: Vec<u64> = match std::env::var("TALLY_CHAOS_SEEDS") {
        Ok(n) => (0..n.parse().expect("a seed count")).collect(),
        Err(_) => CHAOS_SEEDS.to_vec(),
    };
    for seed in seeds {
        REAL_CLOCK.set(false);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(chaos(seed));
    }
}

async fn chaos(seed: u64) {
    const CALLERS: u64 = 6;
    const REQUESTS_PER_CALLER: u64 = 30;
    const CALLER_RETRIES: usize = 8;
    let env = Env::build(
        FaultConfig {
            lost_ack: 0.1,
            lost_request: 0.08,
            refused: 0.05,
            inflight: 0.05,
            read_lag: 0.15,
            read_lag_batches: 2,
            seed,
            inflight_hold: Duration::from_millis(3),
        },
        None,
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(env.replica().await);
    }
    let accounts: Vec<AccountId> = (1..=4).map(acct).collect();

    let mut callers = Vec::new();
    for c in 0..CALLERS {
        let replicas = replicas.clone();
        let accounts = accounts.clone();
        callers.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (c << 32));
            let mut results = Vec::new();
            for r in 0..REQUESTS_PER_CALLER {
                let eid = (u128::from(c) << 64) | u128::from(r) | (1 << 120);
                let ai = rng.gen_range(0..accounts.len());
                let a = accounts[ai];
                let amount = rng.gen_range(1..=60);
                let req = match rng.gen_range(0..20) {
                    0..7 => deposit(a, amount, eid),
                    7..15 => withdraw(a, amount, eid),
                    _ => {
                        let step = rng.gen_range(1..accounts.len());
                        transfer(a, accounts[(ai + step) % accounts.len()], amount, eid)
                    }
                };
                let mut answer = None;
                for attempt in 0..CALLER_RETRIES {
                    let replica = &replicas[rng.gen_range(0..replicas.len())];
                    let got = replica.run(req).await;
                    let retryable = matches!(
                        got,
                        Err(WriteError::Unverifiable { .. })
                            | Err(WriteError::GaveUp { .. })
                            | Err(WriteError::Store(_))
                    );
                    answer = Some(got);
                    if !retryable || attempt + 1 == CALLER_RETRIES {
                        break;
                    }
                }
                results.push((req, answer.expect("at least one attempt")));
            }
            results
        }));
    }
    let mut results = Vec::new();
    for c in callers {
        results.extend(c.await.unwrap());
    }

    let mut landed: HashMap<u128, usize> = HashMap::new();
    for &a in &accounts {
        let s = env.stream(a);
        for (version, eid, balance) in running_balances(&s) {
            assert!(
                balance >= 0,
                "seed {seed}: {a} went to {balance} at version {version}"
            );
            *landed
                .entry(eid.expect("every event has an id"))
                .or_default() += 1;
        }
    }
    let (mut oks, mut rejected) = (0u64, 0u64);
    let mut seen = HashSet::new();
    for (req, answer) in &results {
        assert!(seen.insert(req.event_id));
        let legs = req.op.legs().as_slice().len();
        let count = landed.get(&req.event_id).copied().unwrap_or(0);
        assert!(
            count == 0 || count == legs,
            "seed {seed}: {req:?} landed {count} events"
        );
        match answer {
            Ok(_) => {
                oks += 1;
                assert_eq!(
                    count, legs,
                    "seed {seed}: {req:?} answered Ok but landed {count} times"
                );
            }
            Err(WriteError::Rule(_)) => {
                rejected += 1;
                assert_eq!(count, 0, "seed {seed}: {req:?} rejected but landed")
            }
            Err(_) => {}
        }
    }
    assert!(landed.keys().all(|k| seen.contains(k)));
    let counts = env.faulty.counts();
    assert!(counts.lost_ack > 0 && counts.lost_request > 0 && counts.inflight > 0);
    assert!(
        oks > CALLERS * REQUESTS_PER_CALLER / 2,
        "seed {seed}: {oks} ok"
    );
    assert!(rejected > 0, "seed {seed}: the mix must exercise the rules");
    eprintln!(
        "seed {seed}: faults {counts:?}; {oks} ok, {rejected} rejected of {}",
        results.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Explicit accounts: an account must exist before it takes a write
// ---------------------------------------------------------------------------------------------

fn explicit() -> WriteConfig {
    WriteConfig {
        accounts: AccountsMode::Explicit,
        ..WriteConfig::default()
    }
}

fn open(account: AccountId, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::Open { account },
        event_id,
    }
}

fn not_found(account: AccountId) -> Result<WriteOutcome, WriteError> {
    Err(WriteError::Rule(RuleError::AccountNotFound { account }))
}

/// Rule: with explicit accounts a write, or a transfer with either leg, on an account never
/// opened is refused on the store's tip, and nothing is sent; an opened account takes writes.
#[tokio::test(start_paused = true)]
async fn with_explicit_accounts_a_write_to_an_account_never_opened_is_refused_and_nothing_is_sent()
{
    let env = Env::new();
    let a = env.replica_with(window_only(), explicit()).await;
    let (x, y) = (acct(1), acct(2));
    assert_eq!(a.run(deposit(x, 100, E0)).await, not_found(x));
    assert_eq!(a.run(withdraw(x, 100, E1)).await, not_found(x));
    assert!(
        env.script.records().is_empty(),
        "refused before any write was sent"
    );
    assert_eq!(env.batches(x), 0);

    assert_eq!(a.run(open(y, E2)).await, Ok(outcome(&[(y, 0, 1)], false)));
    assert_eq!(
        a.run(deposit(y, 100, E3)).await,
        Ok(outcome(&[(y, 100, 2)], false))
    );
    assert_eq!(a.run(transfer(y, x, 10, E4)).await, not_found(x));
    assert_eq!(a.run(transfer(x, y, 10, E_SIB)).await, not_found(x));
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "ok"), (1, vec![2], "ok")],
        "the open and the deposit; neither transfer was sent"
    );
    assert_eq!(env.batches(x), 0);
    assert_eq!(folded_balance(&env.stream(y)), 100);
    assert_eq!(a.arm("deposit", arm::REJECTED), 1);
    assert_eq!(a.arm("transfer", arm::REJECTED), 2);
}

/// Rule: with explicit accounts only an open may create a stream: every other write goes
/// with `allow_create` off, so the store itself refuses it on an account that does not
/// exist, whatever the replica decided on. With implicit accounts every write may create.
#[tokio::test(start_paused = true)]
async fn with_explicit_accounts_only_an_open_may_create_an_accounts_stream() {
    let env = Env::new();
    let a = env.replica_with(window_only(), explicit()).await;
    let b = env.replica().await;
    let (x, y) = (acct(1), acct(2));
    a.ok(open(x, E0)).await;
    a.ok(deposit(x, 5, E1)).await;
    b.ok(deposit(y, 5, E2)).await;
    let creates: Vec<bool> = env
        .script
        .records()
        .iter()
        .map(|r| r.legs[0].allow_create)
        .collect();
    assert_eq!(creates, vec![true, false, true]);
}

/// Rule: the store's "no such account" on a write decided on a state that showed the
/// account is neither a success nor a final refusal: nothing was appended, so the write is
/// decided again on fresh state (which here still holds the account, and it lands once).
#[tokio::test(start_paused = true)]
async fn a_write_the_store_finds_no_account_for_is_decided_again_on_fresh_state() {
    let env = Env::new();
    let a = env.replica_with(window_only(), explicit()).await;
    let x = acct(1);
    a.ok(open(x, E0)).await;
    env.script.push(Step::Reject(StoreError::AggregateNotFound));
    assert_eq!(
        a.run(deposit(x, 50, E1)).await,
        Ok(outcome(&[(x, 50, 2)], false))
    );
    assert_eq!(
        shape(&env.script.records()),
        vec![
            (0, vec![1], "ok"),
            (1, vec![2], "other"),
            (1, vec![2], "ok")
        ]
    );
    assert_eq!(a.arm("deposit", arm::STORE_ERROR), 1);
    env.assert_deposit_landed_once(x, E1, 2, 50, 2, 50);
}

/// Rule: an open is a write like any other. Its lost ack is settled by the catch-up, a retry
/// under its key on any replica replays it, and the account is opened once; an open of it
/// under another key is refused, final, and writes nothing.
#[tokio::test(start_paused = true)]
async fn a_retried_open_whose_ack_was_lost_replays_the_same_account_and_opens_it_once() {
    let env = Env::new();
    let a = env.replica_with(window_only(), explicit()).await;
    let b = env.sibling().await;
    let x = acct(1);
    env.faulty.fail_next_write(Fault::LostAck);
    assert_eq!(a.run(open(x, E0)).await, Ok(outcome(&[(x, 0, 1)], false)));
    assert_eq!(a.arm("open", arm::OUTCOME_UNKNOWN), 1);
    assert_eq!(b.run(open(x, E0)).await, Ok(outcome(&[(x, 0, 1)], true)));
    assert_eq!(a.run(open(x, E0)).await, Ok(outcome(&[(x, 0, 1)], true)));
    assert_eq!(
        b.run(open(x, E1)).await,
        Err(WriteError::Rule(RuleError::AccountExists { account: x }))
    );
    assert_eq!(
        shape(&env.script.records()),
        vec![(0, vec![1], "unknown")],
        "one write: the retries were read back"
    );
    let s = env.stream(x);
    assert_eq!(events_with_id(&s, E0), vec![(1, AccountEvent::Opened)]);
    assert!(events_with_id(&s, E1).is_empty());
    assert_eq!(env.batches(x), 1);
}

/// Rule: a refusal on the replica's copy is never final (with explicit accounts, a copy that
/// shows no account where another replica has opened one since): the read the copy stood in
/// for follows at once and does not count, so even a run of one attempt decides the write on
/// the store. With one attempt, such a copy once refused every later write to the account.
#[tokio::test(start_paused = true)]
async fn with_one_attempt_a_refusal_on_the_replicas_copy_is_decided_again_on_the_store() {
    let env = Env::new();
    let one_attempt = WriteConfig {
        max_attempts: 1,
        ..explicit()
    };
    let a = env.replica_with(window_only(), one_attempt).await;
    let b = env.sibling().await;
    let x = acct(1);
    assert_eq!(a.run(deposit(x, 10, E0)).await, not_found(x));
    b.ok(open(x, E1)).await;
    // A's copy still shows no account: the store does, and the deposit lands.
    assert_eq!(
        a.run(deposit(x, 10, E2)).await,
        Ok(outcome(&[(x, 10, 2)], false))
    );
    assert_eq!(
        a.run(deposit(x, 10, E3)).await,
        Ok(outcome(&[(x, 20, 3)], false))
    );
    env.assert_deposit_landed_once(x, E2, 2, 10, 3, 20);
    assert!(events_with_id(&env.stream(x), E0).is_empty());
}

/// Pins the transfer-leg event layout used above: one event per leg, same id on both.
#[test]
fn a_transfer_has_one_event_per_leg_and_the_payer_leg_first() {
    let t = transfer(acct(1), acct(2), 5, E1);
    let legs = t.op.legs();
    assert_eq!(legs.as_slice().len(), 2);
    assert_eq!(legs.as_slice()[0].event.event_type(), TRANSFERRED_OUT);
}
