//! The balance and history reads over an in-memory store behind fault layers: page
//! boundaries and limits, lagging reads, trims, writers, and `min_version`.

use super::balance::MIN_VERSION_ATTEMPTS;
use super::*;
use crate::account::{AccountEvent, Identity};
use crate::metrics::Metrics;
use crate::projection::{ManualClock, ProjectionConfig};
use crate::store::faults::{FaultConfig, FaultyLog};
use crate::store::memory::MemoryLog;
use crate::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, Event, EventLog, EventType,
    ReadFilter, ReadPage, SharedLog, StoreError, StoreResult,
};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use uuid::Uuid;

/// Fails every `details` and `leader_tip` call while armed and passes everything else through.
/// (`FaultyLog` scripts faults into writes and reads only.)
struct FailingDetails {
    inner: SharedLog,
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl EventLog for FailingDetails {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.inner.write(client_id, writes).await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.inner.read(key, filter).await
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        if self.armed.load(Ordering::SeqCst) {
            return Err(StoreError::shed("scripted: details unavailable"));
        }
        self.inner.details(key).await
    }

    /// Armed, the leader's tip cannot be had either: the store cannot say how far an
    /// account goes.
    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        if self.armed.load(Ordering::SeqCst) {
            return Err(StoreError::shed("scripted: tip unavailable"));
        }
        self.inner.leader_tip(client_id, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

struct Fixture {
    memory: Arc<MemoryLog>,
    faulty: Arc<FaultyLog<MemoryLog>>,
    details: Arc<FailingDetails>,
    identity: Identity,
    metrics: Arc<Metrics>,
    reader: AccountReader,
    account: AccountId,
    next_seq: u64,
}

/// A reader over an in-memory store behind fault layers that inject nothing unless a
/// test scripts them.
fn fixture() -> Fixture {
    let memory = Arc::new(MemoryLog::new());
    let faulty = Arc::new(FaultyLog::new(memory.clone(), FaultConfig::default()));
    let details = Arc::new(FailingDetails {
        inner: faulty.clone(),
        armed: AtomicBool::new(false),
    });
    let identity = Identity::default();
    let metrics = Arc::new(Metrics::new());
    let projection = Projection::new(
        details.clone() as SharedLog,
        identity,
        ProjectionConfig::default(),
        Arc::new(ManualClock::new(0)),
        metrics.clone(),
    );
    Fixture {
        memory,
        faulty,
        details,
        identity,
        metrics,
        reader: AccountReader::new(Arc::new(projection)),
        account: AccountId(Uuid::new_v4()),
        next_seq: 1,
    }
}

impl Fixture {
    /// Appends one batch (one version) of deposits of these amounts.
    async fn deposit_batch(&mut self, amounts: &[i64]) {
        let events = amounts
            .iter()
            .map(|&amount| AccountEvent::Deposited { amount })
            .map(|e| (e.event_type(), e.encode()))
            .collect();
        self.append(events).await;
    }

    async fn append(&mut self, events: Vec<(EventType, Bytes)>) {
        let key = self.identity.key(self.account);
        let current = self.memory.details(key).await.map_or(0, |d| d.max_version);
        let events = events
            .into_iter()
            .map(|(event_type, payload)| {
                let seq = self.next_seq;
                self.next_seq += 1;
                Event {
                    client_seq: seq,
                    event_id: Some(u128::from(seq)),
                    event_type,
                    payload,
                    timestamp_ms: 0,
                }
            })
            .collect();
        let write = AggregateWrite {
            key,
            events,
            expected_version: Some(current),
            allow_create: true,
            enforce_client_idempotency: true,
        };
        self.memory
            .write_now(self.identity.client(), vec![write])
            .expect("write");
    }

    fn catch_ups(&self) -> u64 {
        self.metrics.catchup_duration.get_sample_count()
    }
}

fn versions(page: &HistoryPage) -> Vec<u64> {
    page.events.iter().map(|e| e.version).collect()
}

#[tokio::test]
async fn a_history_page_ends_on_a_version_boundary_within_the_limit() {
    let mut f = fixture();
    f.deposit_batch(&[1]).await;
    f.deposit_batch(&[2, 3, 4]).await;
    f.deposit_batch(&[5]).await;
    // Version 2 would take the page to 4 events: the page stops before it.
    let page = f.reader.history(f.account, 1, Some(3)).await.expect("page");
    assert_eq!(versions(&page), vec![1]);
    assert_eq!(page.next_from_version, Some(2));
    // Exactly the limit, on a boundary.
    let page = f.reader.history(f.account, 1, Some(4)).await.expect("page");
    assert_eq!(versions(&page), vec![1, 2, 2, 2]);
    assert_eq!(page.next_from_version, Some(3));
}

#[tokio::test]
async fn a_batch_larger_than_the_limit_is_served_whole() {
    let mut f = fixture();
    f.deposit_batch(&[1, 2, 3]).await;
    f.deposit_batch(&[4]).await;
    let page = f.reader.history(f.account, 1, Some(1)).await.expect("page");
    assert_eq!(versions(&page), vec![1, 1, 1]);
    assert_eq!(
        page.next_from_version,
        Some(2),
        "the page still moves forward"
    );
}

#[tokio::test]
async fn following_next_from_version_reads_every_event_once_in_order() {
    let mut f = fixture();
    let batches: [&[i64]; 5] = [&[1], &[2, 3], &[4], &[5, 6, 7], &[8]];
    for b in batches {
        f.deposit_batch(b).await;
    }
    let mut amounts = Vec::new();
    let mut from = 0;
    loop {
        let page = f
            .reader
            .history(f.account, from, Some(2))
            .await
            .expect("page");
        assert_eq!(page.current_version, 5);
        assert_eq!(page.balance_cents, Some(36));
        amounts.extend(page.events.iter().map(|e| e.event.amount()));
        match page.next_from_version {
            Some(next) => from = next,
            None => break,
        }
    }
    assert_eq!(amounts, (1..=8).collect::<Vec<i64>>());
}

#[tokio::test]
async fn a_history_limit_outside_its_range_is_refused() {
    let f = fixture();
    for limit in [0, MAX_HISTORY_LIMIT as u64 + 1] {
        assert_eq!(
            f.reader.history(f.account, 1, Some(limit)).await,
            Err(ReadError::LimitOutOfRange {
                max: MAX_HISTORY_LIMIT
            }),
            "limit {limit}"
        );
    }
    assert!(
        f.reader
            .history(f.account, 1, Some(MAX_HISTORY_LIMIT as u64))
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn a_history_read_showing_nothing_where_the_fold_has_events_is_retryable() {
    let mut f = fixture();
    for amount in 1..=3 {
        f.deposit_batch(&[amount]).await;
    }
    // The catch-up read is current; the page read hides the newest 2 batches.
    f.faulty.lag_next_read(0);
    f.faulty.lag_next_read(2);
    assert_eq!(
        f.reader.history(f.account, 3, None).await,
        Err(ReadError::HistoryBehindFold {
            from_version: 3,
            current: 3
        })
    );
    // A read that shows part of it: that part, and where the rest starts.
    f.faulty.lag_next_read(0);
    f.faulty.lag_next_read(1);
    let page = f.reader.history(f.account, 2, None).await.expect("page");
    assert_eq!(versions(&page), vec![2]);
    assert_eq!(page.next_from_version, Some(3));
}

/// Rule: history marks each event's writer: this service, or another client of the
/// store (an offline device, whose client id is its device id), by the batch's client id.
#[tokio::test]
async fn history_marks_each_events_writer_by_its_batchs_client_id() {
    let mut f = fixture();
    f.deposit_batch(&[5]).await;
    let device: u128 = 0xD3;
    let key = f.identity.key(f.account);
    let e = AccountEvent::Withdrawn { amount: 9 };
    let write = AggregateWrite {
        key,
        events: vec![Event {
            client_seq: 1,
            event_id: Some(77),
            event_type: e.event_type(),
            payload: e.encode(),
            timestamp_ms: 0,
        }],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: true,
    };
    f.memory.write_now(device, vec![write]).expect("write");
    let page = f.reader.history(f.account, 1, None).await.expect("page");
    let writers: Vec<Writer> = page.events.iter().map(|e| e.writer).collect();
    assert_eq!(writers, vec![Writer::Service, Writer::Client(device)]);
    assert_eq!(
        page.balance_cents,
        Some(-4),
        "a device's debit may go below zero"
    );
}

/// Rule: a history page's balance is the balance at its `currentAggregateVersion`. A
/// catch-up whose read lagged behind the page's read is folded again, never answered
/// with an older balance beside a newer version.
#[tokio::test]
async fn a_history_balance_matches_its_current_version_when_the_folds_read_lagged() {
    let mut f = fixture();
    for amount in 1..=3 {
        f.deposit_batch(&[amount]).await;
    }
    // The first catch-up's read hides the newest 2 batches; the page read and the
    // second catch-up are current.
    f.faulty.lag_next_read(2);
    let page = f.reader.history(f.account, 1, None).await.expect("page");
    assert_eq!(versions(&page), vec![1, 2, 3]);
    assert_eq!(page.current_version, 3);
    assert_eq!(page.balance_cents, Some(6), "the balance at version 3");
}

#[tokio::test]
async fn a_trimmed_history_starts_at_the_first_available_version_without_a_balance() {
    let mut f = fixture();
    for amount in 1..=4 {
        f.deposit_batch(&[amount]).await;
    }
    f.memory
        .trim_start_now(f.identity.key(f.account), 3)
        .expect("trim");
    let page = f.reader.history(f.account, 1, None).await.expect("page");
    assert_eq!(page.first_available_version, Some(3));
    assert_eq!(versions(&page), vec![3, 4]);
    assert_eq!(page.balance_cents, None, "a cold fold cannot derive it");
    assert_eq!(page.current_version, 4, "from the store's details");
    assert_eq!(page.next_from_version, None);
    assert!(matches!(
        f.reader.balance(f.account, None).await,
        Err(ReadError::Trimmed {
            min_available: 3,
            ..
        })
    ));
}

/// Rule: when neither the fold nor the store can say where the stream ends, the page is
/// a retryable error, never a full page presented as the last one.
#[tokio::test]
async fn a_history_page_whose_tip_the_store_cannot_tell_is_retryable_not_the_last() {
    let mut f = fixture();
    for amount in 1..=6 {
        f.deposit_batch(&[amount]).await;
    }
    // A trimmed stream: the cold fold cannot derive it, so only `details` knows the tip.
    f.memory
        .trim_start_now(f.identity.key(f.account), 3)
        .expect("trim");
    f.details.armed.store(true, Ordering::SeqCst);
    let page = f.reader.history(f.account, 1, Some(2)).await;
    // The failing details call also hides the account's checkpoints, so the fold itself
    // answers retryably (a trim met without them is no verdict); either way, retryable.
    assert!(
        matches!(
            page,
            Err(ReadError::HistoryTipUnknown(StoreError::NotApplied { .. })
                | ReadError::Store(StoreError::NotApplied { .. }))
        ),
        "{page:?}"
    );
    // With the store answering again, the same page says where the rest starts.
    f.details.armed.store(false, Ordering::SeqCst);
    let page = f.reader.history(f.account, 1, Some(2)).await.expect("page");
    assert_eq!(versions(&page), vec![3, 4]);
    assert_eq!(page.current_version, 6);
    assert_eq!(page.next_from_version, Some(5));
}

#[tokio::test]
async fn an_undecodable_event_makes_the_account_unreadable_never_skipped() {
    let mut f = fixture();
    f.deposit_batch(&[1]).await;
    f.append(vec![(
        EventType {
            major: 99,
            minor: 0,
        },
        Bytes::new(),
    )])
    .await;
    assert!(matches!(
        f.reader.history(f.account, 1, None).await,
        Err(ReadError::Unreadable { version: 2, .. })
    ));
    assert!(matches!(
        f.reader.balance(f.account, None).await,
        Err(ReadError::Unreadable { version: 2, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_min_version_this_replica_has_not_seen_is_a_typed_error_after_its_attempts() {
    let mut f = fixture();
    f.deposit_batch(&[5]).await;
    f.deposit_batch(&[7]).await;
    // The store has version 2, but every read of this replica's catch-ups hides it.
    for _ in 0..MIN_VERSION_ATTEMPTS {
        f.faulty.lag_next_read(1);
    }
    assert_eq!(
        f.reader.balance(f.account, Some(2)).await,
        Err(ReadError::NotVisibleYet { min_version: 2 })
    );
    assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS));
    // Once a read shows it, the same request is answered.
    assert_eq!(
        f.reader.balance(f.account, Some(2)).await,
        Ok(Balance {
            balance_cents: 12,
            version: 2,
            held_cents: 0,
        })
    );
}

/// Rule: a `minVersion` beyond the version the store itself gives the account is refused
/// at once (400), as a watch resume beyond the tip is: no retry can answer it, so it must
/// not be a 503. An account the store shows no version of stays retryable.
#[tokio::test(start_paused = true)]
async fn a_min_version_beyond_the_stores_tip_is_refused_after_one_catch_up() {
    let mut f = fixture();
    // An account with no version yet decides nothing: the store may hide a create.
    assert_eq!(
        f.reader.balance(f.account, Some(1)).await,
        Err(ReadError::NotVisibleYet { min_version: 1 })
    );
    assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS));
    f.deposit_batch(&[5]).await;
    assert_eq!(
        f.reader.balance(f.account, Some(u64::MAX)).await,
        Err(ReadError::MinVersionBeyondTip {
            min_version: u64::MAX,
            current: 1
        })
    );
    assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS) + 1);
    // A store that cannot say how far the account goes decides nothing: retryable.
    f.details.armed.store(true, Ordering::SeqCst);
    assert_eq!(
        f.reader.balance(f.account, Some(2)).await,
        Err(ReadError::NotVisibleYet { min_version: 2 })
    );
}

#[tokio::test]
async fn a_min_version_the_fold_already_has_is_answered_without_a_catch_up() {
    let mut f = fixture();
    f.deposit_batch(&[5]).await;
    let first = f.reader.balance(f.account, None).await.expect("balance");
    assert_eq!(f.catch_ups(), 1);
    // The store moves on; a read at the version the fold has answers from the fold.
    f.deposit_batch(&[7]).await;
    assert_eq!(f.reader.balance(f.account, Some(1)).await, Ok(first));
    assert_eq!(f.catch_ups(), 1);
    // Without a min version, a balance read always catches up.
    let now = f.reader.balance(f.account, None).await.expect("balance");
    assert_eq!((now.balance_cents, now.version), (12, 2));
    assert_eq!(f.catch_ups(), 2);
}
