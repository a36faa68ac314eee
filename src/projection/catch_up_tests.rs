//! The catch-up and the index cap, on a memory store: what a fold indexes, how a cold
//! multi-page read ages its entries, and what the cap refuses.

use super::*;
use crate::account::AccountEvent;
use crate::store::memory::{MemoryLog, MemoryOptions, ServerClock};
use crate::store::{AggregateWrite, Event};
use uuid::Uuid;

const WINDOW_MS: u64 = 90_000;

async fn deposit(log: &MemoryLog, identity: &Identity, account: AccountId, seq: u64) {
    let e = AccountEvent::Deposited { amount: 1 };
    let w = AggregateWrite {
        key: identity.key(account),
        events: vec![Event {
            client_seq: seq,
            event_id: Some(u128::from(seq)),
            event_type: e.event_type(),
            payload: e.encode(),
            timestamp_ms: 0,
        }],
        expected_version: Some(seq - 1),
        allow_create: true,
        enforce_client_idempotency: true,
    };
    log.write_now(identity.client(), vec![w]).expect("write");
}

fn capped(log: Arc<MemoryLog>, cap: usize, clock: Arc<ManualClock>) -> Projection {
    Projection::new(
        log,
        Identity::default(),
        ProjectionConfig {
            window: Duration::from_millis(WINDOW_MS),
            max_index_entries: cap,
            ..ProjectionConfig::default()
        },
        clock,
        Arc::new(Metrics::new()),
    )
}

/// Rule: at the cap the index refuses new writes (counted) and keeps every entry for its
/// whole window; expiry, not the cap, is what frees room.
#[test]
fn at_the_index_cap_new_writes_are_refused_until_expiry_frees_room() {
    let clock = Arc::new(ManualClock::new(0));
    let projection = capped(Arc::new(MemoryLog::new()), 3, clock.clone());
    let metrics = projection.metrics().clone();
    assert_eq!(metrics.index_entries_cap.get(), 3);
    let slot = projection.slot(AccountId(Uuid::new_v4()));
    let deposit = AccountEvent::Deposited { amount: 1 };
    projection.record_write(
        &slot,
        &RecordedWrite {
            expected_version: 0,
            generation: 0,
            new_version: 1,
            balance_after: 2,
            max_client_seq: 2,
            events: &[(1, 1, deposit), (2, 2, deposit)],
        },
    );
    assert_eq!(projection.check_index_room(), Ok(()));
    projection.record_write(
        &slot,
        &RecordedWrite {
            expected_version: 1,
            generation: 0,
            new_version: 2,
            balance_after: 3,
            max_client_seq: 3,
            events: &[(3, 3, deposit)],
        },
    );
    assert!(projection.index_full());
    assert_eq!(
        projection.check_index_room(),
        Err(IndexFull { entries: 3, cap: 3 })
    );
    assert_eq!(metrics.writes_refused_index_full.get(), 1);
    // Full, and still answering every entry until the end of its window.
    clock.advance_ms(WINDOW_MS - 1);
    projection.sweep();
    assert!(projection.index_full());
    for id in 1..=3 {
        assert!(
            slot.state.lock().recent.get(id, clock.now_ms()).is_some(),
            "{id}"
        );
    }
    assert!(projection.check_index_room().is_err());
    assert_eq!(metrics.writes_refused_index_full.get(), 2);
    clock.advance_ms(1);
    projection.sweep();
    assert_eq!(projection.index_entries(), 0);
    assert_eq!(projection.check_index_room(), Ok(()));
    assert_eq!(metrics.writes_refused_index_full.get(), 2);
}

/// Rule (colocation): the fold indexes every event it replays inside the window, cap or
/// no cap, so the count may pass the cap; only new writes are refused.
#[tokio::test]
async fn the_fold_indexes_everything_it_replays_even_past_the_cap() {
    let log = Arc::new(MemoryLog::new());
    let identity = Identity::default();
    let account = AccountId(Uuid::new_v4());
    for seq in 1..=5 {
        deposit(&log, &identity, account, seq).await;
    }
    let projection = capped(log, 2, Arc::new(ManualClock::new(0)));
    let (slot, snap) = projection.catch_up(account).await.expect("catch-up");
    assert_eq!(snap.version, 5);
    assert_eq!(projection.index_entries(), 5);
    assert!(projection.index_full());
    assert_eq!(projection.metrics().index_entries.get(), 5);
    let st = slot.state.lock();
    for seq in 1..=5u64 {
        assert!(st.recent.get(u128::from(seq), 0).is_some(), "event {seq}");
    }
}

/// Rule: a replayed batch's age is measured against the newest server time, even when a
/// cold replica reads the stream in several pages (each page's own tip is older).
#[tokio::test]
async fn a_cold_multi_page_catch_up_never_revives_entries_older_than_the_window() {
    let server = Arc::new(ServerClock::new(1_000_000));
    let log = Arc::new(MemoryLog::with_options(MemoryOptions {
        page_size: 3,
        clock: server.clone(),
    }));
    let identity = Identity::default();
    let account = AccountId(Uuid::new_v4());
    for seq in 1..=6 {
        deposit(&log, &identity, account, seq).await;
    }
    server.advance(WINDOW_MS + 1_000);
    for seq in 7..=9 {
        deposit(&log, &identity, account, seq).await;
    }
    let projection = Projection::new(
        log,
        identity,
        ProjectionConfig {
            window: Duration::from_millis(WINDOW_MS),
            ..ProjectionConfig::default()
        },
        Arc::new(ManualClock::new(0)),
        Arc::new(Metrics::new()),
    );
    let (slot, snap) = projection.catch_up(account).await.expect("catch-up");
    assert_eq!((snap.balance, snap.version), (9, 9));
    let st = slot.state.lock();
    for seq in 1..=6u64 {
        assert!(
            st.recent.get(u128::from(seq), 0).is_none(),
            "event {seq} is older than the window and must not answer"
        );
    }
    for seq in 7..=9u64 {
        assert!(st.recent.get(u128::from(seq), 0).is_some(), "event {seq}");
    }
}
