//! Read windows, pages, filters and batches between the port and the wire.

use super::*;

#[test]
fn window_starts_at_one_and_is_capped() {
    let w = window(&ReadFilter::default());
    assert_eq!(
        w,
        Window {
            from: 1,
            to: READ_PAGE_MAX_VERSIONS,
            caller_bound: false
        }
    );
    let w = window(&ReadFilter {
        from_version: 10,
        to_version: Some(12),
        ..ReadFilter::default()
    });
    assert_eq!(
        w,
        Window {
            from: 10,
            to: 12,
            caller_bound: true
        }
    );
    let w = window(&ReadFilter {
        from_version: 10,
        to_version: Some(10 + READ_PAGE_MAX_VERSIONS),
        ..ReadFilter::default()
    });
    assert_eq!(w.to, 9 + READ_PAGE_MAX_VERSIONS);
    assert!(!w.caller_bound);
    let w = window(&ReadFilter::from_version(u64::MAX));
    assert_eq!((w.from, w.to), (u64::MAX, u64::MAX));
}

/// Rule: a read sends the server its version window only; every batch filter is applied
/// here (the server would cut events out of batches, and serves a filtered window from disk).
#[test]
fn batch_filters_stay_on_this_side() {
    let filter = ReadFilter {
        from_version: 3,
        to_version: None,
        min_client_seq: Some(5),
        max_client_seq: Some(9),
        include_client_id: Some(77),
        min_server_timestamp_ms: Some(1_000),
    };
    let f = server_filters(window(&filter));
    assert_eq!(f.from_aggregate_version, 3);
    assert_eq!(f.to_aggregate_version, Some(2 + READ_PAGE_MAX_VERSIONS));
    assert_eq!(f.min_client_seq, None);
    assert_eq!(f.max_client_seq, None);
    assert_eq!(f.include_client_id, None);
    assert_eq!(f.min_server_timestamp, None);
}

#[test]
fn next_page_follows_the_server_cursor_first() {
    let w = window(&ReadFilter::default());
    assert_eq!(next_after(w, Some(40), Some(39)), Some(40));
}

#[test]
fn next_page_stops_at_the_callers_bound() {
    let w = window(&ReadFilter {
        to_version: Some(5),
        ..ReadFilter::default()
    });
    assert_eq!(next_after(w, None, Some(5)), None);
}

#[test]
fn a_full_window_continues_after_it() {
    let w = window(&ReadFilter::default());
    let end = READ_PAGE_MAX_VERSIONS;
    assert_eq!(next_after(w, None, Some(end)), Some(end + 1));
}

#[test]
fn a_short_window_is_the_tip() {
    let w = window(&ReadFilter::default());
    assert_eq!(next_after(w, None, Some(3)), None);
    assert_eq!(next_after(w, None, None), None);
}

#[test]
fn the_last_version_has_no_next_page() {
    let w = window(&ReadFilter::from_version(u64::MAX));
    assert_eq!(next_after(w, None, Some(u64::MAX)), None);
}

fn event(seq: u64, payload: &'static [u8]) -> Event {
    Event {
        client_seq: seq,
        event_id: Some(0xfeed),
        event_type: EventType { major: 3, minor: 1 },
        payload: Bytes::from_static(payload),
        timestamp_ms: 1_700_000_000_000,
    }
}

#[test]
fn events_survive_the_round_trip() {
    let original = event(7, b"{\"amount\":5}");
    let wire = wire_event(original.clone());
    assert_eq!(wire.event_seq, 0);
    assert_eq!(wire.iv, None);
    assert_eq!(port_event(wire), original);
}

#[test]
fn batches_translate_field_by_field() {
    let batch = AggregateEventBatch {
        aggregate_version: 4,
        client_id: 99,
        user_id: None,
        server_timestamp: 1_234,
        events: vec![wire_event(event(1, b"a")), wire_event(event(2, b"b"))],
    };
    let b = port_batch(batch);
    assert_eq!(b.version, 4);
    assert_eq!(b.client_id, 99);
    assert_eq!(b.server_timestamp_ms, 1_234);
    assert_eq!(b.events.len(), 2);
    assert_eq!(b.events[1].payload, Bytes::from_static(b"b"));
}

#[test]
fn a_shared_payload_is_copied_not_stolen() {
    let wire = wire_event(event(1, b"shared"));
    let keep = Arc::clone(&wire.event_value);
    let back = port_event(wire);
    assert_eq!(back.payload, Bytes::from_static(b"shared"));
    assert_eq!(keep.as_slice(), b"shared");
}

#[test]
fn write_size_estimate_counts_payloads_and_overheads() {
    let w = AggregateWrite {
        key: PING_KEY,
        events: vec![event(1, b"12345"), event(2, b"")],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: false,
    };
    assert_eq!(
        estimated_request_bytes(&[w]),
        AGGREGATE_OVERHEAD_BYTES + 2 * EVENT_OVERHEAD_BYTES + 5
    );
}

#[tokio::test]
async fn an_oversized_write_is_refused_before_sending() {
    // Nothing listens on this address; a refusal that reached the network would be NotApplied.
    let cfg = CeleriantConfig {
        address: "127.0.0.1:1".into(),
        ..CeleriantConfig::default()
    };
    let log = CeleriantLog::connect(&cfg).expect("valid");
    let big = Bytes::from(vec![0u8; MAX_REQUEST_BYTES as usize]);
    let mut e = event(1, b"");
    e.payload = big;
    let write = AggregateWrite {
        key: PING_KEY,
        events: vec![e],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: false,
    };
    match log.write(1, vec![write]).await {
        Err(StoreError::Other { code, .. }) => assert_eq!(code, LOCAL_ERROR_CODE),
        other => panic!("expected a local refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn a_duplicate_aggregate_in_one_write_is_refused() {
    let cfg = CeleriantConfig {
        address: "127.0.0.1:1".into(),
        ..CeleriantConfig::default()
    };
    let log = CeleriantLog::connect(&cfg).expect("valid");
    let one = AggregateWrite {
        key: PING_KEY,
        events: vec![event(1, b"x")],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: false,
    };
    match log.write(1, vec![one.clone(), one]).await {
        Err(StoreError::Other { code, message }) => {
            assert_eq!(code, LOCAL_ERROR_CODE);
            assert!(message.contains("twice"), "{message}");
        }
        other => panic!("expected a local refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unreachable_server_fails_ping_as_not_applied() {
    // Port 1 on loopback refuses at once: no timing involved.
    let cfg = CeleriantConfig {
        address: "127.0.0.1:1".into(),
        ..CeleriantConfig::default()
    };
    let log = CeleriantLog::connect(&cfg).expect("valid");
    let e = log.ping().await.expect_err("nothing listens on port 1");
    assert!(is_not_applied(&e), "{e:?}");
    // A refused connection is the store out of reach, which the replica's health reports.
    assert!(e.is_unreachable(), "{e:?}");
}
