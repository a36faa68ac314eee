//! How the client's errors map to the port's outcomes: unknown, not applied, conflict,
//! sequence used or in flight, trimmed, cross-shard, and what a retry may repeat.

use super::*;

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

/// Rule: a call that reached no node that could take it (refused or timed-out connections,
/// no leader) says the store is out of reach; one the store or the pool shed does not.
#[test]
fn only_failures_to_reach_a_node_say_the_store_is_unreachable() {
    for (name, make) in pre_send_errors() {
        let unreachable = matches!(
            name,
            "ConnectionFailed" | "ConnectionTimeout" | "NotLeader" | "NotLeader without hint"
        );
        for op in ALL_OPS {
            let mapped = map_error(op, make());
            assert_eq!(
                mapped.is_unreachable(),
                unreachable,
                "{name} on {op:?}: {mapped:?}"
            );
        }
    }
    for (name, make) in post_send_errors() {
        assert!(!map_error(Op::Read, make()).is_unreachable(), "{name}");
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
        let mapped = map_error(Op::Write, e);
        assert!(is_not_applied(&mapped), "code {code}");
        // A node that is not the leader cannot take the write: until one is, the store is
        // out of reach for writes. Shedding says nothing of the store's reach.
        let not_leader = [codes::WRITE_NOT_LEADER, codes::TRIM_NOT_LEADER].contains(&code);
        assert_eq!(mapped.is_unreachable(), not_leader, "code {code}");
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
