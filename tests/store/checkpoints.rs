//! Checkpoints: a cold fold starts from the newest checkpoint older than the window, checked
//! against the stream, and reads only what follows; the writer writes one per threshold,
//! guarded on the checkpoint stream's version; retention trims below one and the account
//! stays servable cold.
//!
//! Every test but the last runs on the in-memory store with a server clock it moves by hand
//! (ageing past the window needs server time), and asserts against the whole fold of the
//! stream. The last runs `tally trim` against the real server `CELERIANT_ADDRESS` names.

use crate::common::windowed_log::one_deposit;
use crate::common::{hand_clocks, required};

use std::sync::Arc;
use std::time::Duration;

use tally::account::{AccountEvent, AccountId, Identity};
use tally::metrics::Metrics;
use tally::projection::checkpoint_writer::CheckpointConfig;
use tally::projection::keys::Segment;
use tally::projection::{AccountView, Checkpoint, Projection, ProjectionConfig};
use tally::reader::AccountReader;
use tally::store::faults::{Fault, FaultConfig, FaultyLog};
use tally::store::memory::{MemoryLog, ServerClock, ServerTime};
use tally::store::{AggregateWrite, Event, EventLog, SharedLog, StoreError};
use uuid::Uuid;

const WINDOW: Duration = Duration::from_secs(90);
const WINDOW_MS: u64 = 90_000;

struct World {
    server: Arc<ServerClock>,
    log: Arc<MemoryLog>,
    identity: Identity,
    account: AccountId,
    next_seq: u64,
}

impl World {
    fn new() -> Self {
        let (server, log) = hand_clocks::paged_store_at(hand_clocks::SERVER_START_MS, 64);
        Self {
            server,
            log,
            identity: Identity::default(),
            account: AccountId(Uuid::new_v4()),
            next_seq: 1,
        }
    }

    /// Deposits `amount` as one batch with a fresh sequence and event id (= the sequence).
    fn deposit(&mut self, amount: i64) -> u64 {
        let key = self.identity.key(self.account);
        let seq = self.next_seq;
        self.next_seq += 1;
        let w = one_deposit(key, seq, Some(u128::from(seq)), amount);
        self.log
            .write_now(self.identity.client(), vec![w])
            .expect("write")[0]
    }

    /// A fresh replica (cold: nothing resident) over `log`.
    fn replica(&self, log: SharedLog, checkpoints: CheckpointConfig) -> Arc<Projection> {
        Arc::new(hand_clocks::replica(
            log,
            self.identity,
            ProjectionConfig {
                window: WINDOW,
                // Nothing remembered past the window unless a test says so.
                retention: WINDOW,
                checkpoints,
                ..ProjectionConfig::default()
            },
        ))
    }

    /// A fresh replica over the world's store that remembers keys for `retention`.
    fn remembering_for(&self, retention: Duration) -> Arc<Projection> {
        Arc::new(hand_clocks::replica(
            self.log.clone(),
            self.identity,
            ProjectionConfig {
                window: WINDOW,
                retention,
                ..ProjectionConfig::default()
            },
        ))
    }

    fn cold(&self) -> Arc<Projection> {
        self.replica(self.log.clone(), CheckpointConfig::default())
    }

    /// Writes a checkpoint of `account` from a replica that folded it whole.
    async fn checkpoint(&self) -> Arc<Projection> {
        let p = self.cold();
        p.sync_server_clock().await.expect("anchor");
        p.catch_up(self.account).await.expect("fold");
        p.write_checkpoint(self.account).await;
        assert_eq!(written(&p), 1, "the checkpoint was written");
        p
    }

    /// Appends a raw event to the checkpoint stream (a forged or stale checkpoint).
    fn append_checkpoint(&self, cp: &Checkpoint) {
        self.append_event(cp.event());
    }

    fn append_event(&self, event: Event) {
        let w = AggregateWrite {
            key: self.identity.checkpoint_key(self.account),
            events: vec![event],
            expected_version: None,
            allow_create: true,
            enforce_client_idempotency: false,
        };
        self.log
            .write_now(self.identity.client(), vec![w])
            .expect("write");
    }
}

fn loads(p: &Projection, result: &str) -> u64 {
    p.metrics()
        .checkpoint_loads
        .with_label_values(&[result])
        .get()
}

fn written(p: &Projection) -> u64 {
    p.metrics()
        .checkpoint_writes
        .with_label_values(&["written"])
        .get()
}

/// The balance and version a replica's fold gives, after anchoring its server clock.
async fn fold(p: &Projection, account: AccountId) -> (i64, u64) {
    p.sync_server_clock().await.expect("anchor");
    let (_, snap) = p.catch_up(account).await.expect("fold");
    (snap.balance, snap.version)
}

/// Rule: a cold fold starts from the newest checkpoint older than the window and reads only
/// the events after it; its balance and cursor equal the whole fold's.
#[tokio::test]
async fn a_cold_fold_starts_from_a_checkpoint_older_than_the_window_and_reads_only_what_follows() {
    let mut w = World::new();
    for amount in 1..=500 {
        w.deposit(amount);
    }
    w.checkpoint().await;
    w.server.advance(WINDOW_MS + 1);
    for amount in 501..=510 {
        w.deposit(amount);
    }
    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, ((1..=510).sum(), 510));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(
        cold.metrics().events_folded.get(),
        10,
        "only the events after the checkpoint were folded"
    );
}

/// Rule: a keyed checkpoint is used at any age, even inside the window, and every write it
/// covers still answers, from the keys it carries: nothing before it is folded.
#[tokio::test]
async fn a_keyed_checkpoint_inside_the_window_is_used_and_every_write_it_covers_still_answers() {
    let mut w = World::new();
    for amount in 1..=20 {
        w.deposit(amount);
    }
    w.checkpoint().await;
    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, ((1..=20).sum(), 20));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(cold.metrics().events_folded.get(), 0, "nothing was folded");
    let view = AccountView::Memory(cold.resident_slot(w.account).expect("resident"));
    for seq in 1..=20u64 {
        let hit = cold
            .remembered(w.account, &view, u128::from(seq))
            .await
            .expect("read")
            .unwrap_or_else(|| panic!("the write of sequence {seq} must answer"));
        let balance: i64 = (1..=seq as i64).sum();
        assert_eq!((hit.version, hit.balance), (seq, balance));
    }
    assert!(
        cold.remembered(w.account, &view, 21)
            .await
            .expect("read")
            .is_none(),
        "a key never written is not remembered"
    );
}

/// Rule: a cold replica whose keyed chain is whole loads every key within the retention
/// from the checkpoints, however many, and folds only the events after the newest; a key
/// past the retention is not remembered.
#[tokio::test]
async fn a_cold_replica_loads_the_keys_of_every_checkpoint_back_through_the_retention() {
    let mut w = World::new();
    let retention = Duration::from_secs(3_600);
    let writer = w.remembering_for(retention);
    writer.sync_server_clock().await.expect("anchor");
    // Five checkpoints, 200 events apart, two minutes apart in server time.
    for round in 0..5u64 {
        for amount in 1..=200 {
            w.deposit(amount);
        }
        w.server.advance(120_000);
        writer.sync_server_clock().await.expect("anchor");
        writer.catch_up(w.account).await.expect("fold");
        writer.write_checkpoint(w.account).await;
        assert_eq!(written(&writer), round + 1);
    }
    for amount in 1..=7 {
        w.deposit(amount);
    }
    let cold = w.remembering_for(retention);
    let total: i64 = 5 * (1..=200).sum::<i64>() + (1..=7).sum::<i64>();
    assert_eq!(fold(&cold, w.account).await, (total, 1_007));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(cold.metrics().events_folded.get(), 7, "only what follows");
    let view = AccountView::Memory(cold.resident_slot(w.account).expect("resident"));
    for seq in [1u64, 199, 200, 201, 650, 1_000, 1_003] {
        let hit = cold.remembered(w.account, &view, u128::from(seq)).await;
        assert_eq!(
            hit.expect("read").map(|h| h.version),
            Some(seq),
            "key {seq} is remembered"
        );
    }
    // An hour later the first 200 (committed before the first two minutes) are past it.
    w.server.advance(3_600_000 - 5 * 120_000 + 1_000);
    cold.sync_server_clock().await.expect("anchor");
    assert!(
        cold.remembered(w.account, &view, 1)
            .await
            .expect("read")
            .is_none(),
        "past the retention"
    );
}

/// Rule: a checkpoint past the account's tip (a store restored from an older copy) is
/// ignored, counted, and the whole stream folded.
#[tokio::test]
async fn a_checkpoint_past_the_tip_is_ignored_counted_and_the_whole_stream_folded() {
    let mut w = World::new();
    for amount in 1..=5 {
        w.deposit(amount);
    }
    w.append_checkpoint(&Checkpoint {
        version: 9,
        balance: 1_000,
        max_client_seq: 9,
        commit_ms: 1,
        fingerprint: 0,
        keys_after: None,
        holds_len: 0,
    });
    w.server.advance(WINDOW_MS + 1);
    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, (15, 5));
    assert_eq!(loads(&cold, "rejected"), 1);
}

/// Rule: a checkpoint whose commit time (or batch) does not match the stream at its version
/// is ignored: never a balance the full fold would not give.
#[tokio::test]
async fn a_checkpoint_whose_commit_time_does_not_match_is_ignored() {
    let mut w = World::new();
    for amount in 1..=5 {
        w.deposit(amount);
    }
    let p = w.checkpoint().await;
    let tail = p.checkpoint_tail(w.account).await.expect("tail");
    let (_, real) = tail.checkpoints[0];
    // A forged checkpoint at the same version, another commit time and balance, newer in
    // the stream than the real one, keyed so that a cold fold takes it first.
    let (_, payload) = Checkpoint {
        commit_ms: real.commit_ms - 1,
        balance: 999,
        ..real
    }
    .keyed(&Segment::default(), None);
    w.append_event(Checkpoint::event_of(payload));
    w.server.advance(WINDOW_MS + 1);
    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, (15, 5));
    assert_eq!(loads(&cold, "rejected"), 1);
}

/// Rule: two replicas never write two checkpoints at one position: the second is a conflict
/// (another replica did it), counted, and nothing else.
#[tokio::test]
async fn two_replicas_checkpointing_one_position_write_one_and_the_other_conflicts() {
    let mut w = World::new();
    for amount in 1..=5 {
        w.deposit(amount);
    }
    let a = w.cold();
    let b = w.cold();
    fold(&a, w.account).await;
    fold(&b, w.account).await;
    a.write_checkpoint(w.account).await;
    b.write_checkpoint(w.account).await;
    assert_eq!(written(&a), 1);
    assert_eq!(
        b.metrics()
            .checkpoint_writes
            .with_label_values(&["conflict"])
            .get(),
        1
    );
    let tail = a.checkpoint_tail(w.account).await.expect("tail");
    assert_eq!(tail.stream_version, 1);
}

/// Rule: the writer writes once the event threshold is passed, off the write path, and only
/// for an account that moved: a replica that folds an account below it writes nothing.
#[tokio::test]
async fn the_writer_checkpoints_an_account_past_the_event_threshold_and_no_other() {
    let mut w = World::new();
    let quiet = AccountId(Uuid::new_v4());
    for amount in 1..=30 {
        w.deposit(amount);
    }
    let every = CheckpointConfig {
        every_events: 25,
        ..CheckpointConfig::default()
    };
    let p = w.replica(w.log.clone(), every);
    let writer = tokio::spawn(p.clone().run_checkpoint_writer());
    fold(&p, w.account).await;
    fold(&p, quiet).await;
    let key = w.identity.checkpoint_key(w.account);
    // The writer runs on its own: wait for its write to show in the store.
    let mut landed = false;
    for _ in 0..200 {
        if w.log.details(key).await.is_ok() {
            landed = true;
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    writer.abort();
    assert!(landed, "the account past the threshold got a checkpoint");
    let tail = p.checkpoint_tail(w.account).await.expect("tail");
    assert_eq!(tail.newest_version, 30);
    assert!(matches!(
        w.log.details(w.identity.checkpoint_key(quiet)).await,
        Err(StoreError::AggregateNotFound)
    ));
}

/// Rule: retention trims below the newest checkpoint older than window and retention, keeps
/// that checkpoint's version readable, and a cold replica then serves the balance, every
/// retry inside the window, and history from the first available version.
#[tokio::test]
async fn after_a_trim_a_cold_replica_serves_balance_retries_and_history_from_the_first_version() {
    let mut w = World::new();
    for amount in 1..=100 {
        w.deposit(amount);
    }
    w.checkpoint().await;
    w.server.advance(WINDOW_MS + 1);
    for amount in 101..=110 {
        w.deposit(amount);
    }
    let op = w.cold();
    op.sync_server_clock().await.expect("anchor");
    let report = op
        .trim_account(w.account, Duration::ZERO)
        .await
        .expect("trim");
    assert_eq!(report.trimmed_at, Some(100));
    let d = w
        .log
        .details(w.identity.key(w.account))
        .await
        .expect("details");
    assert_eq!(d.min_available_version, 100);

    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, ((1..=110).sum(), 110));
    let slot = cold.resident_slot(w.account).expect("resident");
    for seq in 101..=110u64 {
        let hit = slot.state.lock().recent.get(u128::from(seq), 0);
        assert_eq!(
            hit.map(|h| h.balance),
            Some((1..=seq as i64).sum()),
            "retry of sequence {seq} replays its original balance"
        );
    }
    let reader = AccountReader::new(cold.clone());
    let page = reader.history(w.account, 1, None).await.expect("history");
    assert_eq!(page.first_available_version, Some(100));
    assert_eq!(page.events.first().map(|e| e.version), Some(100));
    assert_eq!(page.balance_cents, Some((1..=110).sum()));
    // Nothing older than window and retention: nothing to trim.
    let again = op
        .trim_account(w.account, Duration::from_secs(3_600))
        .await
        .expect("trim");
    assert_eq!(again.trimmed_at, None);
}

/// Rule: a crash between a checkpoint write and anything else loses nothing: a checkpoint
/// whose acknowledgement was lost is either in the stream (and checks) or not, and a cold
/// fold gives the whole fold's balance either way; the next write finds the stream's version.
#[tokio::test]
async fn a_checkpoint_whose_ack_was_lost_loses_nothing() {
    let mut w = World::new();
    for amount in 1..=10 {
        w.deposit(amount);
    }
    let faulty = Arc::new(FaultyLog::new(w.log.clone(), FaultConfig::default()));
    let p = w.replica(faulty.clone(), CheckpointConfig::default());
    fold(&p, w.account).await;
    faulty.fail_next_write(Fault::LostAck);
    p.write_checkpoint(w.account).await;
    assert_eq!(
        p.metrics()
            .checkpoint_writes
            .with_label_values(&["failed"])
            .get(),
        1
    );
    w.deposit(11);
    fold(&p, w.account).await;
    p.write_checkpoint(w.account).await;
    assert_eq!(written(&p), 1, "the next write read the stream's version");
    w.server.advance(WINDOW_MS + 1);
    let cold = w.cold();
    assert_eq!(fold(&cold, w.account).await, ((1..=11).sum(), 11));
    assert_eq!(loads(&cold, "used"), 1);
}

/// Rule: with `--retain-history-secs`, a replica trims after each checkpoint it writes, below
/// the newest checkpoint older than the window and the retention; a retention longer than the
/// checkpoint's age trims nothing.
#[tokio::test]
async fn retention_trims_after_a_checkpoint_only_below_one_older_than_window_and_retention() {
    let mut w = World::new();
    for amount in 1..=50 {
        w.deposit(amount);
    }
    w.server.advance(WINDOW_MS + 10_000);
    let retaining = |secs| CheckpointConfig {
        retain_history: Some(Duration::from_secs(secs)),
        ..CheckpointConfig::default()
    };
    let key = w.identity.key(w.account);
    let long = w.replica(w.log.clone(), retaining(3_600));
    fold(&long, w.account).await;
    long.write_checkpoint(w.account).await;
    assert_eq!(written(&long), 1);
    assert_eq!(
        w.log
            .details(key)
            .await
            .expect("details")
            .min_available_version,
        1
    );
    assert_eq!(long.metrics().trims.with_label_values(&["kept"]).get(), 1);

    w.deposit(51);
    let short = w.replica(w.log.clone(), retaining(5));
    fold(&short, w.account).await;
    short.write_checkpoint(w.account).await;
    assert_eq!(
        short.metrics().trims.with_label_values(&["trimmed"]).get(),
        1
    );
    // The checkpoint at 50 is a window and 10 s old; the one just written at 51 is not.
    assert_eq!(
        w.log
            .details(key)
            .await
            .expect("details")
            .min_available_version,
        50
    );
    assert_eq!(fold(&w.cold(), w.account).await, ((1..=51).sum(), 51));
}

/// Rule: after an upgrade, whose checkpoints carry no keys, the first keyed checkpoint
/// carries every key its writer holds, so the next cold replica's chain is whole at once
/// and it folds nothing before it.
#[tokio::test]
async fn after_an_upgrade_the_first_keyed_checkpoint_makes_the_chain_whole() {
    let mut w = World::new();
    let retention = Duration::from_secs(3_600);
    for amount in 1..=20 {
        w.deposit(amount);
    }
    // An older release's checkpoint at 20: no keys, younger than the retention.
    let key = w.identity.key(w.account);
    let batch = w
        .log
        .read(key, &tally::store::ReadFilter::from_version(20))
        .await;
    let batch = batch.expect("read").batches[0].clone();
    w.append_checkpoint(&Checkpoint::at(&batch, (1..=20).sum(), 20));
    w.server.advance(WINDOW_MS + 1);
    for amount in 21..=30 {
        w.deposit(amount);
    }
    let upgraded = w.remembering_for(retention);
    assert_eq!(fold(&upgraded, w.account).await, ((1..=30).sum(), 30));
    upgraded.write_checkpoint(w.account).await;
    assert_eq!(written(&upgraded), 1);

    let cold = w.remembering_for(retention);
    assert_eq!(fold(&cold, w.account).await, ((1..=30).sum(), 30));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(cold.metrics().events_folded.get(), 0, "nothing folded");
    let view = AccountView::Memory(cold.resident_slot(w.account).expect("resident"));
    for seq in [1u64, 20, 25] {
        let hit = cold.remembered(w.account, &view, u128::from(seq)).await;
        assert_eq!(hit.expect("read").map(|h| h.version), Some(seq));
    }
}

/// Rule: without a whole chain of keys, a cold fold starts no further back than the account's
/// key cap of versions below the newest checkpoint, even when no checkpoint is a retention
/// old: keys below that start are forgotten (a fold from further back would drop them to the
/// cap anyway), and the horizon the account's answers state says so.
#[tokio::test]
async fn without_a_chain_a_cold_fold_reads_no_more_than_the_key_cap_and_says_what_it_forgot() {
    let mut w = World::new();
    let (retention, cap) = (Duration::from_secs(3_600), 100);
    let key = w.identity.key(w.account);
    // An older release's checkpoints (no keys) every 100 versions, all younger than the
    // retention.
    for v in 1..=500u64 {
        w.deposit(1);
        if v % 100 == 0 {
            let read = w
                .log
                .read(key, &tally::store::ReadFilter::from_version(v))
                .await;
            let batch = read.expect("read").batches[0].clone();
            w.append_checkpoint(&Checkpoint::at(&batch, v as i64, v));
        }
        w.server.advance(1_000);
    }
    for _ in 0..20 {
        w.deposit(1);
    }
    let cold = Arc::new(hand_clocks::replica(
        w.log.clone(),
        w.identity,
        ProjectionConfig {
            window: WINDOW,
            retention,
            max_keys_per_account: cap,
            ..ProjectionConfig::default()
        },
    ));
    assert_eq!(fold(&cold, w.account).await, (520, 520));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(
        cold.metrics().events_folded.get(),
        120,
        "from the checkpoint at 400, the cap (100) below the newest (500)"
    );
    let horizon = cold.key_horizon(&[w.account]);
    assert!(
        horizon < retention,
        "the shorter horizon is stated: {horizon:?}"
    );
    let view = AccountView::Memory(cold.resident_slot(w.account).expect("resident"));
    let found = |seq: u64| {
        let cold = cold.clone();
        let view = &view;
        async move {
            cold.remembered(w.account, view, u128::from(seq))
                .await
                .expect("read")
        }
    };
    assert_eq!(found(450).await.map(|h| h.version), Some(450));
    assert!(found(350).await.is_none(), "below the start: forgotten");
}

/// Rule: a replica that folded more keys since the last checkpoint than one segment carries
/// writes the newest and forgets the rest, so a cold replica loads those instead of folding
/// the history, and states the shorter horizon.
#[tokio::test]
async fn more_keys_than_a_segment_carries_are_loaded_in_part_with_the_horizon_stated() {
    use tally::projection::keys::MAX_SEGMENT_KEYS;
    let mut w = World::new();
    let retention = Duration::from_secs(3_600);
    let n = MAX_SEGMENT_KEYS as u64 + 1_000;
    for _ in 0..n {
        w.deposit(1);
    }
    let writer = w.remembering_for(retention);
    assert_eq!(fold(&writer, w.account).await, (n as i64, n));
    writer.write_checkpoint(w.account).await;
    assert_eq!(written(&writer), 1);

    let cold = w.remembering_for(retention);
    assert_eq!(fold(&cold, w.account).await, (n as i64, n));
    assert_eq!(loads(&cold, "used"), 1);
    assert_eq!(cold.metrics().events_folded.get(), 0, "nothing folded");
    assert!(
        cold.key_horizon(&[w.account]) < retention,
        "the shorter horizon is stated"
    );
    let view = AccountView::Memory(cold.resident_slot(w.account).expect("resident"));
    let newest = cold.remembered(w.account, &view, u128::from(n)).await;
    assert_eq!(newest.expect("read").map(|h| h.version), Some(n));
    let oldest = cold.remembered(w.account, &view, 1).await;
    assert!(oldest.expect("read").is_none(), "forgotten");
}

/// Rule: a trim finds the newest checkpoint old enough even when it lies far below the tail
/// a cold fold reads (a busy account checkpoints every few seconds), and never one younger
/// than the idempotency retention.
#[tokio::test]
async fn a_trim_finds_a_checkpoint_a_retention_back_beyond_the_tail() {
    let mut w = World::new();
    let writer = w.cold();
    writer.sync_server_clock().await.expect("anchor");
    // 40 checkpoints a window apart: the tail (16) spans the last 16 windows only.
    let mut versions = Vec::new();
    for _ in 0..40 {
        w.deposit(1);
        let v = w.deposit(1);
        writer.sync_server_clock().await.expect("anchor");
        writer.catch_up(w.account).await.expect("fold");
        writer.write_checkpoint(w.account).await;
        versions.push((v, w.server.now_ms()));
        w.server.advance(WINDOW_MS);
    }
    assert_eq!(written(&writer), 40);
    writer.sync_server_clock().await.expect("anchor");
    // Keep 30 windows: the newest checkpoint at least that old is the 10th.
    let retain = Duration::from_millis(29 * WINDOW_MS);
    let report = writer.trim_account(w.account, retain).await.expect("trim");
    let tip = w.server.now_ms();
    let want = versions
        .iter()
        .filter(|(_, at)| tip - at >= 30 * WINDOW_MS)
        .map(|(v, _)| *v)
        .max();
    assert_eq!(want, Some(versions[10].0));
    assert_eq!(report.trimmed_at, want);
    assert_eq!(fold(&w.cold(), w.account).await, (80, 80));
}

/// Rule (real server): `tally trim` trims an account below its newest checkpoint older than
/// the window, keeps that version readable, and a cold replica then serves the balance from
/// the checkpoint and history from the first available version. The window is 1 s here, and
/// the test waits for the checkpoint to age past it (server time has no hand to move).
#[tokio::test]
async fn tally_trim_on_a_real_server_trims_below_the_checkpoint_and_a_cold_replica_serves_it() {
    let Some(address) = required::celeriant_address() else {
        return;
    };
    let cfg = tally::store::celeriant::CeleriantConfig {
        address: address.clone(),
        ..Default::default()
    };
    let log: SharedLog =
        Arc::new(tally::store::celeriant::CeleriantLog::connect(&cfg).expect("Celeriant config"));
    let identity = Identity::default();
    let account = AccountId(Uuid::new_v4());
    let deposit = |seq: u64| {
        let e = AccountEvent::Deposited { amount: 3 };
        AggregateWrite {
            key: identity.key(account),
            events: vec![Event {
                client_seq: seq,
                event_id: Some(u128::from(seq) | (account.as_u128() << 32)),
                event_type: e.event_type(),
                payload: e.encode(),
                timestamp_ms: 0,
            }],
            expected_version: Some(seq - 1),
            allow_create: true,
            enforce_client_idempotency: true,
        }
    };
    for seq in 1..=20 {
        log.write(identity.client(), vec![deposit(seq)])
            .await
            .expect("write");
    }
    let one_second = || {
        Arc::new(Projection::new(
            log.clone(),
            identity,
            ProjectionConfig {
                window: Duration::from_secs(1),
                retention: Duration::from_secs(1),
                ..ProjectionConfig::default()
            },
            Arc::new(tally::projection::MonotonicClock::new()),
            Arc::new(Metrics::new()),
        ))
    };
    let writer = one_second();
    writer.sync_server_clock().await.expect("anchor");
    writer.catch_up(account).await.expect("fold");
    writer.write_checkpoint(account).await;
    assert_eq!(written(&writer), 1);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for seq in 21..=22 {
        log.write(identity.client(), vec![deposit(seq)])
            .await
            .expect("write");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args([
            "trim",
            "--store",
            "celeriant",
            "--celeriant-address",
            &address,
            "--idempotency-window",
            "1",
            "--idempotency-retention",
            "1",
            &account.to_string(),
        ])
        .output()
        .expect("tally trim runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(line["trimmedAt"], 20, "{line}");
    assert_eq!(line["firstAvailableVersion"], 20, "{line}");
    let d = log.details(identity.key(account)).await.expect("details");
    assert_eq!((d.min_available_version, d.max_version), (20, 22));

    let cold = one_second();
    assert_eq!(fold(&cold, account).await, (66, 22));
    assert_eq!(loads(&cold, "used"), 1);
    let page = AccountReader::new(cold.clone())
        .history(account, 1, None)
        .await
        .expect("history");
    assert_eq!(page.first_available_version, Some(20));
    assert_eq!(page.balance_cents, Some(66));
}
