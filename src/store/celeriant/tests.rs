//! Unit tests for the Celeriant backend's pure parts: outcome mapping, configuration, filter
//! translation and pagination. The behaviour against a live server is in
//! `tests/store/celeriant.rs`.

use std::io;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use celeriant_client_tokio::{
    ClientError, DeleteError, DetailsError, ReadError, ServerError, TrimError, WriteError,
};
use celeriant_crypto::CryptoError;
use celeriant_msg::error_codes as codes;
use celeriant_msg::read_wire_data_error::ReadWireDataError;
use celeriant_msg::response::aggregate_event_batch::AggregateEventBatch;
use celeriant_wire::network::wire_error::WireError;
use clap::Parser;

use super::check_order::*;
use super::classify::*;
use super::config::*;
use super::wire::*;
use super::*;
use crate::store::{Event, EventType};

const ALL_OPS: [Op; 5] = [Op::Read, Op::Details, Op::Ping, Op::Write, Op::Trim];

fn io_err() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "reset")
}

/// A named constructor for one client error (ClientError is not Clone).
type Case = (&'static str, fn() -> ClientError);

fn is_unknown(e: &StoreError) -> bool {
    matches!(e, StoreError::OutcomeUnknown { .. })
}

fn is_not_applied(e: &StoreError) -> bool {
    matches!(e, StoreError::NotApplied { .. })
}

/// Every post-send failure.
fn post_send_errors() -> Vec<Case> {
    vec![
        ("RequestTimeout", || ClientError::RequestTimeout),
        ("ConnectionLostAfterSend", || {
            ClientError::ConnectionLostAfterSend(io_err())
        }),
        ("WireError", || {
            ClientError::WireError(WireError::MalformedFrame("bad".into()))
        }),
        ("WireError::MessageTooLarge", || {
            ClientError::WireError(WireError::MessageTooLarge {
                message_length: 2,
                max_size_bytes: 1,
            })
        }),
        ("ReadError", || {
            ClientError::ReadError(ReadWireDataError::UnknownMessageType(99))
        }),
        ("CorrelationMismatch", || ClientError::CorrelationMismatch {
            sent: Some(1),
            received: Some(2),
        }),
        ("ProtocolError", || ClientError::ProtocolError),
    ]
}

/// Every failure that proves nothing was applied.
fn pre_send_errors() -> Vec<Case> {
    vec![
        ("ConnectionFailed", || {
            ClientError::ConnectionFailed(io_err())
        }),
        ("ConnectionTimeout", || ClientError::ConnectionTimeout),
        ("PoolTimeout", || ClientError::PoolTimeout {
            address: "127.0.0.1:1".into(),
        }),
        ("ServerBusy", || ClientError::ServerBusy),
        ("NotLeader", || ClientError::NotLeader {
            leader_address: Some("10.0.0.2:10000".into()),
            error_message: String::new(),
        }),
        ("NotLeader without hint", || ClientError::NotLeader {
            leader_address: None,
            error_message: String::new(),
        }),
        ("DictUnavailable", || ClientError::DictUnavailable {
            sha: "abc".into(),
        }),
    ]
}

#[test]
fn post_send_failures_leave_a_mutation_unknown() {
    for (name, make) in post_send_errors() {
        for op in [Op::Write, Op::Trim] {
            let mapped = map_error(op, make());
            assert!(is_unknown(&mapped), "{name} on {op:?} mapped to {mapped:?}");
            assert!(mapped.may_have_applied());
        }
    }
}

#[test]
fn post_send_failures_on_reads_are_safe_to_repeat() {
    for (name, make) in post_send_errors() {
        for op in [Op::Read, Op::Details, Op::Ping] {
            let mapped = map_error(op, make());
            assert!(
                is_not_applied(&mapped),
                "{name} on {op:?} mapped to {mapped:?}"
            );
        }
    }
}

#[test]
fn pre_send_failures_are_not_applied_for_every_op() {
    for (name, make) in pre_send_errors() {
        for op in ALL_OPS {
            let mapped = map_error(op, make());
            assert!(
                is_not_applied(&mapped),
                "{name} on {op:?} mapped to {mapped:?}"
            );
            assert!(!mapped.may_have_applied());
        }
    }
}

#[test]
fn identity_and_local_misuse_are_other() {
    assert_eq!(
        map_error(Op::Write, ClientError::IdentityRequired),
        StoreError::Other {
            code: codes::IDENTIFY_REQUIRED,
            message: ClientError::IdentityRequired.to_string(),
        }
    );
    for make in [
        (|| ClientError::IdentityError(CryptoError::InvalidNonce)) as fn() -> ClientError,
        || ClientError::InvalidShardRange {
            start_shard: 2,
            max_shard_hint: 1,
        },
    ] {
        for op in ALL_OPS {
            match map_error(op, make()) {
                StoreError::Other { code, .. } => assert_eq!(code, LOCAL_ERROR_CODE),
                other => panic!("expected Other, got {other:?}"),
            }
        }
    }
}

fn server(kind: WriteError, message: &str) -> ClientError {
    ClientError::Server(ServerError::Write {
        kind,
        error_message: message.into(),
    })
}

#[test]
fn occ_violation_is_conflict_with_both_versions() {
    let e = server(
        WriteError::OptimisticConcurrencyViolation {
            expected_version: Some(3),
            current_aggregate_version: Some(5),
        },
        r#"{"expected_version":3,"current_aggregate_version":5}"#,
    );
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::Conflict {
            expected: 3,
            current: 5
        }
    );
}

#[test]
fn idempotency_violation_carries_both_sequences() {
    let e = server(
        WriteError::ClientIdempotencyViolation {
            last_client_seq: Some(9),
            attempted_client_seq: Some(7),
        },
        r#"{"last_client_seq":9,"attempted_client_seq":7}"#,
    );
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::IdempotencyViolation {
            last_seq: Some(9),
            attempted_seq: Some(7)
        }
    );
}

#[test]
fn a_2002_without_its_mark_leaves_the_mark_unknown_never_0() {
    // A device's landed run would look like it straddles a mark of 0.
    let e = server(
        WriteError::ClientIdempotencyViolation {
            last_client_seq: None,
            attempted_client_seq: Some(7),
        },
        r#"{"attempted_client_seq":7}"#,
    );
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::IdempotencyViolation {
            last_seq: None,
            attempted_seq: Some(7)
        }
    );
}

#[test]
fn a_1000_without_a_usable_minimum_is_unclassified_never_read_as_0() {
    // A trimmed account would look untrimmed.
    for (op, e) in [
        (
            Op::Read,
            ClientError::Server(ServerError::Read {
                kind: ReadError::UnavailableBatchIndex {
                    requested_version: Some(1),
                    minimum_available_version: None,
                },
                error_message: "below the trim".into(),
            }),
        ),
        (
            Op::Read,
            ClientError::Server(ServerError::Read {
                kind: ReadError::UnavailableBatchIndex {
                    requested_version: Some(1),
                    minimum_available_version: Some(0),
                },
                error_message: r#"{"requested":1,"minimum_available":0}"#.into(),
            }),
        ),
    ] {
        let mapped = map_error(op, e);
        assert!(
            matches!(mapped, StoreError::Other { .. }),
            "{op:?}: {mapped:?}"
        );
    }
}

#[test]
fn inflight_duplicate_is_its_own_class() {
    let e = server(
        WriteError::InflightDuplicateWrite {
            last_client_seq: Some(4),
            attempted_client_seq: Some(4),
        },
        r#"{"last_client_seq":4,"attempted_client_seq":4}"#,
    );
    assert_eq!(map_error(Op::Write, e), StoreError::InflightDuplicate);
}

#[test]
fn unavailable_version_is_trimmed_with_the_minimum() {
    let e = ClientError::Server(ServerError::Read {
        kind: ReadError::UnavailableBatchIndex {
            requested_version: Some(1),
            minimum_available_version: Some(6),
        },
        error_message: r#"{"requested":1,"minimum_available":6}"#.into(),
    });
    assert_eq!(
        map_error(Op::Read, e),
        StoreError::Trimmed { min_available: 6 }
    );
}

#[test]
fn every_not_found_code_is_aggregate_not_found() {
    let cases = [
        ClientError::Server(ServerError::Read {
            kind: ReadError::AggregateNotExists,
            error_message: "{}".into(),
        }),
        server(WriteError::AggregateNotExists, "{}"),
        ClientError::Server(ServerError::Details {
            kind: DetailsError::AggregateNotExists,
            error_message: "{}".into(),
        }),
        ClientError::Server(ServerError::Trim {
            kind: TrimError::AggregateNotExists,
            error_message: "{}".into(),
        }),
    ];
    for e in cases {
        assert_eq!(map_error(Op::Read, e), StoreError::AggregateNotFound);
    }
}

#[test]
fn multiple_shards_is_cross_shard() {
    let e = ClientError::Server(ServerError::ShardRouting {
        error_code: codes::SHARD_ROUTING_MULTIPLE_SHARDS,
        error_message: r#"{"num_shards":2}"#.into(),
    });
    assert_eq!(map_error(Op::Write, e), StoreError::CrossShard);
    let other_routing = ClientError::Server(ServerError::ShardRouting {
        error_code: codes::SHARD_ROUTING_NO_KEY,
        error_message: "{}".into(),
    });
    assert_eq!(
        map_error(Op::Write, other_routing),
        StoreError::Other {
            code: codes::SHARD_ROUTING_NO_KEY,
            message: "{}".into()
        }
    );
}

#[test]
fn fsync_and_replication_failures_may_have_landed() {
    for kind in [WriteError::ReplicationError, WriteError::FsyncError] {
        let mapped = map_error(Op::Write, server(kind, r#"{"detail":"x"}"#));
        assert!(is_unknown(&mapped), "{mapped:?}");
    }
    for kind in [TrimError::ReplicationError, TrimError::FsyncError] {
        let e = ClientError::Server(ServerError::Trim {
            kind,
            error_message: "{}".into(),
        });
        assert!(is_unknown(&map_error(Op::Trim, e)));
    }
}

#[test]
fn backpressure_and_not_leader_codes_are_not_applied() {
    for code in [
        codes::SERVER_BUSY,
        codes::TRIM_REPLICATION_BACKPRESSURE,
        codes::WRITE_NOT_LEADER,
        codes::TRIM_NOT_LEADER,
    ] {
        let e = ClientError::Server(ServerError::Unknown {
            error_code: code,
            error_message: "{}".into(),
        });
        assert!(is_not_applied(&map_error(Op::Write, e)), "code {code}");
    }
    let e = server(WriteError::ReplicationBackpressure, "{}");
    assert!(is_not_applied(&map_error(Op::Write, e)));
}

#[test]
fn untyped_codes_map_like_typed_ones() {
    let e = ClientError::Server(ServerError::Unknown {
        error_code: codes::WRITE_OPTIMISTIC_CONCURRENCY_VIOLATION,
        error_message: r#"{"expected_version":1,"current_aggregate_version":2}"#.into(),
    });
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::Conflict {
            expected: 1,
            current: 2
        }
    );
}

#[test]
fn missing_fields_read_as_zero_not_a_panic() {
    let e = server(
        WriteError::OptimisticConcurrencyViolation {
            expected_version: None,
            current_aggregate_version: None,
        },
        "not json",
    );
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::Conflict {
            expected: 0,
            current: 0
        }
    );
}

/// A conflict that names its expected version but not the current one never claims the
/// store stands below it (that drops the fold: `projection/regress.rs`).
#[test]
fn a_conflict_without_its_current_version_reads_as_at_the_expected_one() {
    let e = server(
        WriteError::OptimisticConcurrencyViolation {
            expected_version: Some(7),
            current_aggregate_version: None,
        },
        r#"{"expected_version":7}"#,
    );
    assert_eq!(
        map_error(Op::Write, e),
        StoreError::Conflict {
            expected: 7,
            current: 7
        }
    );
}

#[test]
fn other_server_errors_keep_code_and_message() {
    let cases: Vec<(ClientError, u32)> = vec![
        (
            server(WriteError::EmptyEventsList, "{}"),
            codes::WRITE_EMPTY_EVENTS_LIST,
        ),
        (
            server(WriteError::ZeroEventType, "{}"),
            codes::WRITE_ZERO_EVENT_TYPE,
        ),
        (
            server(WriteError::AggregateRecreateNotAllowed, "{}"),
            codes::WRITE_AGGREGATE_RECREATE_NOT_ALLOWED,
        ),
        (
            server(WriteError::CacheAggregateClientError, "{}"),
            codes::WRITE_CACHE_AGGREGATE_CLIENT_ERROR,
        ),
        (
            ClientError::Server(ServerError::Trim {
                kind: TrimError::IndexOutOfRange,
                error_message: "{}".into(),
            }),
            codes::TRIM_INDEX_OUT_OF_RANGE,
        ),
        (
            ClientError::Server(ServerError::Read {
                kind: ReadError::FetchDatablocks,
                error_message: "{}".into(),
            }),
            codes::READ_FETCH_DATABLOCKS,
        ),
        (
            ClientError::Server(ServerError::Delete {
                kind: DeleteError::CacheError,
                error_message: "{}".into(),
            }),
            codes::DELETE_CACHE_ERROR,
        ),
        (
            ClientError::Server(ServerError::Unknown {
                error_code: 424_242,
                error_message: "{}".into(),
            }),
            424_242,
        ),
    ];
    for (e, code) in cases {
        assert_eq!(
            map_error(Op::Write, e),
            StoreError::Other {
                code,
                message: "{}".into()
            }
        );
    }
}

#[test]
fn a_read_side_fsync_code_is_not_promoted_to_unknown() {
    // Only a mutation can have been queued; the same code on a read is a plain error.
    let e = ClientError::Server(ServerError::Unknown {
        error_code: codes::WRITE_FSYNC_ERROR,
        error_message: "{}".into(),
    });
    assert_eq!(
        map_error(Op::Read, e),
        StoreError::Other {
            code: codes::WRITE_FSYNC_ERROR,
            message: "{}".into()
        }
    );
}

#[test]
fn only_lost_replies_and_broken_connections_are_retried() {
    for (name, make) in post_send_errors() {
        assert!(read_worth_retrying(&make()), "{name}");
    }
    assert!(read_worth_retrying(
        &ClientError::ConnectionFailed(io_err())
    ));
    for e in [
        ClientError::ServerBusy,
        ClientError::ConnectionTimeout,
        ClientError::IdentityRequired,
        ClientError::Server(ServerError::Read {
            kind: ReadError::AggregateNotExists,
            error_message: "{}".into(),
        }),
    ] {
        assert!(!read_worth_retrying(&e), "{e}");
    }
}

// --- configuration ---------------------------------------------------------------------------

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    celeriant: CeleriantConfig,
}

fn parse(args: &[&str]) -> Result<CeleriantConfig, clap::Error> {
    let mut argv = vec!["tally", "--celeriant-address", "10.1.2.3:10000"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv).map(|c| c.celeriant)
}

#[test]
fn flags_parse_into_the_config() {
    let cfg = parse(&[
        "--celeriant-seeds",
        "a:1,b:2",
        "--celeriant-request-timeout-ms",
        "750",
        "--celeriant-connect-timeout-ms",
        "250",
        "--celeriant-pool-size",
        "4",
        "--celeriant-tls-ca",
        "/ca.pem",
        "--celeriant-tls-cert",
        "/c.pem",
        "--celeriant-tls-key",
        "/k.pem",
        "--celeriant-tls-server-name",
        "db.internal",
        "--celeriant-api-key",
        "c2VjcmV0",
    ])
    .expect("parses");
    assert_eq!(cfg.address, "10.1.2.3:10000");
    assert_eq!(cfg.seeds, vec!["a:1".to_owned(), "b:2".to_owned()]);
    assert_eq!(cfg.request_timeout_ms, 750);
    assert_eq!(cfg.connect_timeout_ms, 250);
    assert_eq!(cfg.pool_size, 4);
    assert_eq!(cfg.tls_ca, Some(PathBuf::from("/ca.pem")));
    assert_eq!(cfg.tls_server_name.as_deref(), Some("db.internal"));
    assert_eq!(cfg.api_key, Some(ApiKey("c2VjcmV0".into())));
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn a_non_numeric_timeout_is_a_parse_error() {
    assert!(parse(&["--celeriant-request-timeout-ms", "soon"]).is_err());
}

#[test]
fn defaults_validate() {
    assert_eq!(CeleriantConfig::default().validate(), Ok(()));
}

#[test]
fn the_api_key_never_shows_in_debug_output() {
    let cfg = CeleriantConfig {
        api_key: Some("top-secret-key".parse().expect("non-empty")),
        ..CeleriantConfig::default()
    };
    let shown = format!("{cfg:?}");
    assert!(!shown.contains("top-secret-key"), "{shown}");
    assert!(shown.contains("redacted"));
    let log = CeleriantLog::connect(&cfg).expect("valid");
    assert!(!format!("{log:?}").contains("top-secret-key"));
}

#[test]
fn an_empty_api_key_is_refused() {
    assert!(ApiKey::from_str("  ").is_err());
    assert!(parse(&["--celeriant-api-key", ""]).is_err());
}

fn rejected_flag(cfg: CeleriantConfig) -> &'static str {
    match cfg.validate() {
        Err(CeleriantConfigError::Invalid { flag, .. }) => flag,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn validate_names_the_bad_setting() {
    let base = CeleriantConfig::default;
    for address in [
        "",
        "nohost",
        ":10000",
        "host:",
        "host:0",
        "host:99999",
        "a b:1",
    ] {
        let cfg = CeleriantConfig {
            address: address.into(),
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-address", "{address:?}");
    }
    let cfg = CeleriantConfig {
        seeds: vec!["ok:1".into(), "bad".into()],
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-seeds");
    let cfg = CeleriantConfig {
        seeds: vec!["h:1".into(); MAX_SEEDS + 1],
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-seeds");
    for ms in [0, MAX_TIMEOUT_MS + 1] {
        let cfg = CeleriantConfig {
            request_timeout_ms: ms,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-request-timeout-ms");
        let cfg = CeleriantConfig {
            connect_timeout_ms: ms,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-connect-timeout-ms");
    }
    for size in [0, MAX_POOL_SIZE + 1] {
        let cfg = CeleriantConfig {
            pool_size: size,
            ..base()
        };
        assert_eq!(rejected_flag(cfg), "--celeriant-pool-size");
    }
    let cfg = CeleriantConfig {
        tls_ca: Some("/ca".into()),
        tls_cert: Some("/c".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-key");
    let cfg = CeleriantConfig {
        tls_ca: Some("/ca".into()),
        tls_key: Some("/k".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-cert");
    let cfg = CeleriantConfig {
        tls_cert: Some("/c".into()),
        tls_key: Some("/k".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-ca");
    let cfg = CeleriantConfig {
        tls_server_name: Some("db".into()),
        ..base()
    };
    assert_eq!(rejected_flag(cfg), "--celeriant-tls-ca");
}

#[test]
fn ipv6_addresses_are_accepted() {
    let cfg = CeleriantConfig {
        address: "[::1]:10000".into(),
        ..CeleriantConfig::default()
    };
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn a_missing_tls_file_fails_connect_not_a_request() {
    let cfg = CeleriantConfig {
        tls_ca: Some("/nonexistent/ca.pem".into()),
        ..CeleriantConfig::default()
    };
    assert!(matches!(
        CeleriantLog::connect(&cfg),
        Err(CeleriantConfigError::Tls(_))
    ));
}

// --- translation -----------------------------------------------------------------------------

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
}

// --- multi-aggregate check order -------------------------------------------------------------

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
        StoreError::NotApplied { reason: "x".into() },
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
