//! The fold of hold events: what an account holds after them, with holds on, and that a
//! replica with holds off stops on the first one rather than state a balance.

use std::num::NonZeroU32;
use std::sync::Arc;

use bytes::Bytes;
use uuid::Uuid;

use super::{Broken, FoldContext};
use crate::account::AccountEvent;
use crate::account::holds::{Due, HoldId, HoldStatus, Resolution};
use crate::projection::AccountState;
use crate::store::{Batch, Event};

const CLIENT: u128 = 7;

fn batch(version: u64, ts: u64, event_id: u128, e: AccountEvent) -> Batch {
    Batch {
        version,
        client_id: CLIENT,
        server_timestamp_ms: ts,
        events: Arc::from(vec![Event {
            client_seq: version,
            event_id: Some(event_id),
            event_type: e.event_type(),
            payload: Bytes::from(e.encode().to_vec()),
            timestamp_ms: 0,
        }]),
    }
}

fn context(holds: bool) -> FoldContext {
    FoldContext {
        client_id: CLIENT,
        window_ms: 1_000,
        retention_ms: 1_000,
        tip_ms: 10_000,
        now_ms: 0,
        holds,
    }
}

fn stream() -> Vec<Batch> {
    let hold = HoldId(Uuid::from_u128(20));
    vec![
        batch(1, 1_000, 10, AccountEvent::Deposited { amount: 100 }),
        batch(
            2,
            2_000,
            20,
            AccountEvent::HoldPlaced {
                amount: 60,
                to: None,
                expires_in_secs: NonZeroU32::new(5),
            },
        ),
        batch(
            3,
            3_000,
            30,
            AccountEvent::HoldPlaced {
                amount: 30,
                to: None,
                expires_in_secs: None,
            },
        ),
        batch(4, 4_000, 40, AccountEvent::HoldPosted { hold, amount: 25 }),
    ]
}

/// Rule: a post takes what it posts out of the balance and releases the whole hold; the
/// other hold stays held, and a placement's expiry counts from its batch's commit time.
#[test]
fn the_fold_keeps_open_holds_and_releases_a_posted_one_whole() {
    let mut st = AccountState::default();
    st.fold(&stream(), &context(true)).expect("folds");
    let snap = st.snapshot();
    assert_eq!((snap.balance, snap.held, snap.open_holds), (75, 30, 1));
    let book = st.holds.as_deref().expect("a book");
    let posted = HoldId(Uuid::from_u128(20));
    assert_eq!(
        book.status(posted),
        HoldStatus::Resolved(Resolution::Posted)
    );
    assert_eq!(book.resolved(posted).map(|r| r.posted), Some(25));
    assert_eq!(
        book.resolved(posted).and_then(|r| r.was.expires_at_ms()),
        Some(7_000)
    );
    assert_eq!(book.due(u64::MAX, 10), Vec::<(HoldId, Due)>::new());
}

/// Rule: a second resolution of a resolved hold is an impossible state: the fold stops
/// there, at the last whole batch.
#[test]
fn a_second_resolution_in_the_stream_poisons_the_account() {
    let mut st = AccountState::default();
    let mut batches = stream();
    let hold = HoldId(Uuid::from_u128(20));
    batches.push(batch(5, 5_000, 50, AccountEvent::HoldVoided { hold }));
    let err = st.fold(&batches, &context(true)).expect_err("stops");
    assert!(
        matches!(err, Broken::Poisoned { version: 5, .. }),
        "{err:?}"
    );
    assert_eq!((st.version, st.balance), (4, 75));
}

/// Rule: with holds off, the first hold event stops the fold: the replica cannot state
/// what a fleet with holds on folds, so it answers nothing for the account.
#[test]
fn with_holds_off_the_first_hold_event_stops_the_fold() {
    let mut st = AccountState::default();
    let err = st.fold(&stream(), &context(false)).expect_err("stops");
    assert_eq!(err, Broken::HoldsOff { version: 2 });
    assert_eq!((st.version, st.balance), (1, 100));
}
