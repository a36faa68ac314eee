//! A multi-aggregate write's refusal, restated in the server's check order.

use super::*;

fn leg(expected: Option<u64>, allow_create: bool) -> AggregateGuard {
    AggregateGuard {
        key: PING_KEY,
        expected,
        allow_create,
    }
}

fn idempotency() -> StoreError {
    StoreError::IdempotencyViolation {
        last_seq: Some(5),
        attempted_seq: Some(5),
    }
}

#[test]
fn a_missing_leg_outranks_a_stale_one() {
    let legs = [leg(Some(0), true), leg(None, false)];
    let seen = [Observed::At(1), Observed::Missing];
    let server = StoreError::Conflict {
        expected: 0,
        current: 1,
    };
    assert_eq!(
        port_order(&legs, &seen, server),
        StoreError::AggregateNotFound
    );
}

#[test]
fn a_stale_leg_outranks_a_duplicate_sequence() {
    let legs = [leg(Some(1), true), leg(Some(0), true)];
    let seen = [Observed::At(1), Observed::At(1)];
    assert_eq!(
        port_order(&legs, &seen, idempotency()),
        StoreError::Conflict {
            expected: 0,
            current: 1
        }
    );
}

#[test]
fn the_first_stale_leg_in_request_order_is_reported() {
    let legs = [leg(Some(3), true), leg(Some(0), true)];
    let seen = [Observed::At(4), Observed::At(1)];
    assert_eq!(
        port_order(&legs, &seen, idempotency()),
        StoreError::Conflict {
            expected: 3,
            current: 4
        }
    );
}

/// A leg read missing (or below its guard) is a conflict, but one that claims no version
/// below the guard: a details read may lag, or miss a create the server hides, and a
/// conflict below the expected version drops the fold (`projection/regress.rs`).
#[test]
fn a_leg_read_below_its_guard_is_a_conflict_that_claims_no_regression() {
    let legs = [leg(Some(2), true)];
    for seen in [Observed::Missing, Observed::At(1)] {
        assert_eq!(
            port_order(&legs, &[seen], idempotency()),
            StoreError::Conflict {
                expected: 2,
                current: 2
            },
            "{seen:?}"
        );
    }
}

#[test]
fn when_every_guard_holds_the_server_answer_stands() {
    let legs = [leg(Some(1), true), leg(None, true), leg(None, false)];
    let seen = [Observed::At(1), Observed::Skipped, Observed::At(7)];
    assert_eq!(port_order(&legs, &seen, idempotency()), idempotency());
    assert_eq!(
        port_order(&legs, &seen, StoreError::InflightDuplicate),
        StoreError::InflightDuplicate
    );
}

#[test]
fn only_check_order_rejections_are_restated() {
    assert!(order_sensitive(&idempotency()));
    assert!(order_sensitive(&StoreError::InflightDuplicate));
    assert!(order_sensitive(&StoreError::Conflict {
        expected: 1,
        current: 2
    }));
    for e in [
        StoreError::AggregateNotFound,
        StoreError::CrossShard,
        StoreError::OutcomeUnknown { reason: "x".into() },
        StoreError::shed("x"),
        StoreError::unreachable("x"),
    ] {
        assert!(!order_sensitive(&e), "{e:?}");
    }
}

#[tokio::test]
async fn an_empty_write_is_refused_with_the_servers_code() {
    let cfg = CeleriantConfig {
        address: "127.0.0.1:1".into(),
        ..CeleriantConfig::default()
    };
    let log = CeleriantLog::connect(&cfg).expect("valid");
    match log.write(1, Vec::new()).await {
        Err(StoreError::Other { code, .. }) => assert_eq!(code, codes::WRITE_EMPTY_EVENTS_LIST),
        other => panic!("expected code 2000, got {other:?}"),
    }
}
