//! The error-code tables: which client and server errors leave a write's outcome unknown,
//! which prove nothing was applied, and which are version conflicts (2003), idempotency
//! refusals (2002), in-flight duplicates (2013), trimmed versions (1000), missing aggregates,
//! cross-shard writes (9001), or passed through as `Other` with the server's code.
//!
//! Kept in one place because this is where a lost write could hide: every client-error
//! variant is named, and anything not proven refused is treated as possibly applied.

use celeriant_client_tokio::{
    AuthError, ClientError, DeleteError, DetailsError, ReadError, SchemaError, ServerError,
    TrimError, WatchError, WriteError,
};
use celeriant_msg::error_codes as codes;

use crate::store::StoreError;

/// `Other.code` for failures raised on this side of the wire (never a server code).
pub const LOCAL_ERROR_CODE: u32 = 0;

/// The kind of call that failed, which decides what an unanswered request means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Details,
    Ping,
    Write,
    Trim,
}

impl Op {
    /// Whether the call changes the log, so that a lost answer leaves its outcome unknown.
    fn mutates(self) -> bool {
        match self {
            Op::Write | Op::Trim => true,
            Op::Read | Op::Details | Op::Ping => false,
        }
    }
}

/// A request that went out and got no usable answer: unknown for a mutation, and for a read
/// (which changes nothing) safe to send again.
fn unanswered(op: Op, reason: String) -> StoreError {
    if op.mutates() {
        StoreError::OutcomeUnknown { reason }
    } else {
        StoreError::shed(reason)
    }
}

/// Sorts a client error into the port's outcome classes. Pure; every variant is named.
pub(crate) fn map_error(op: Op, e: ClientError) -> StoreError {
    match e {
        // Sent, then no readable answer: the server may have acted on it.
        ClientError::RequestTimeout => unanswered(op, "request timed out after it was sent".into()),
        ClientError::ConnectionLostAfterSend(io) => unanswered(
            op,
            format!("connection lost after the request was sent: {io}"),
        ),
        // Raised both before sending (request too large to frame) and after (a reply that
        // could not be decoded); the safe reading is "after".
        e @ ClientError::WireError(_) => unanswered(op, e.to_string()),
        e @ ClientError::ReadError(_) => unanswered(op, e.to_string()),
        e @ ClientError::CorrelationMismatch { .. } => unanswered(op, e.to_string()),
        e @ ClientError::ProtocolError => unanswered(op, e.to_string()),

        // Never sent: no node that could take it was reached (the client walks every node it
        // knows before it says so, and "no leader found" is said this way too).
        e @ ClientError::ConnectionFailed(_) => StoreError::unreachable(e.to_string()),
        e @ ClientError::ConnectionTimeout => StoreError::unreachable(e.to_string()),
        e @ ClientError::NotLeader { .. } => StoreError::unreachable(e.to_string()),
        // Refused or held back on this side: the store itself may be fine.
        e @ ClientError::PoolTimeout { .. } => StoreError::shed(e.to_string()),
        e @ ClientError::ServerBusy => StoreError::shed(e.to_string()),
        // The handshake could not resolve the compression dictionary: nothing was sent.
        e @ ClientError::DictUnavailable { .. } => StoreError::shed(e.to_string()),

        // Misconfiguration: repeating will not help.
        e @ ClientError::IdentityRequired => StoreError::Other {
            code: codes::IDENTIFY_REQUIRED,
            message: e.to_string(),
        },
        e @ ClientError::IdentityError(_) => StoreError::Other {
            code: LOCAL_ERROR_CODE,
            message: e.to_string(),
        },
        e @ ClientError::InvalidShardRange { .. } => StoreError::Other {
            code: LOCAL_ERROR_CODE,
            message: e.to_string(),
        },

        ClientError::Server(server) => {
            let (code, message) = server_code(server);
            map_server_code(op, code, message)
        }

        // A variant added after 0.2.0: take the class that can never lose a write.
        other => unanswered(op, format!("unclassified client error: {other}")),
    }
}

/// Reads an unsigned field from a server error's JSON message.
fn json_u64(message: &str, field: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(message)
        .ok()?
        .get(field)?
        .as_u64()
}

/// Sorts a server error code. Numbers the server's message left out are never read as 0:
/// a 2002's sequences stay unknown (`None`; a device's landed run would otherwise look like
/// it straddles a mark of 0), and a 1000 without a usable minimum (versions start at 1) is
/// left unclassified, retryable and never final (a trimmed account would otherwise look
/// untrimmed). A 2003 without its current version reads as standing at the expected one:
/// a current version below the expected one says the store went backwards, and drops the
/// fold (`projection/regress.rs`), which a message that left the number out must not claim.
fn map_server_code(op: Op, code: u32, message: String) -> StoreError {
    let field = |name: &str| json_u64(&message, name);
    match code {
        codes::WRITE_OPTIMISTIC_CONCURRENCY_VIOLATION => {
            let expected = field("expected_version").unwrap_or(0);
            StoreError::Conflict {
                expected,
                current: field("current_aggregate_version").unwrap_or(expected),
            }
        }
        codes::WRITE_CLIENT_IDEMPOTENCY_VIOLATION => StoreError::IdempotencyViolation {
            last_seq: field("last_client_seq"),
            attempted_seq: field("attempted_client_seq"),
        },
        codes::WRITE_INFLIGHT_DUPLICATE => StoreError::InflightDuplicate,
        codes::READ_UNAVAILABLE_VERSION => match field("minimum_available") {
            Some(min_available) if min_available > 0 => StoreError::Trimmed { min_available },
            _ => StoreError::Other { code, message },
        },
        codes::READ_AGGREGATE_NOT_EXISTS
        | codes::WRITE_AGGREGATE_NOT_EXISTS
        | codes::EXISTS_AGGREGATE_NOT_EXISTS
        | codes::TRIM_AGGREGATE_NOT_EXISTS => StoreError::AggregateNotFound,
        codes::SHARD_ROUTING_MULTIPLE_SHARDS => StoreError::CrossShard,
        // Shed before anything was queued.
        codes::SERVER_BUSY
        | codes::WRITE_REPLICATION_BACKPRESSURE
        | codes::TRIM_REPLICATION_BACKPRESSURE
        | codes::DELETE_REPLICATION_BACKPRESSURE => {
            StoreError::shed(format!("server refused ({code}): {message}"))
        }
        // Refused before anything was queued, by a node that is not the leader: until one
        // is, no node takes the write.
        codes::WRITE_NOT_LEADER | codes::TRIM_NOT_LEADER | codes::DELETE_NOT_LEADER => {
            StoreError::unreachable(format!("server refused ({code}): {message}"))
        }
        // The batch was queued (and may be on disk) when fsync or replication failed: it can
        // survive, be replicated later, or be rolled back.
        codes::WRITE_REPLICATION_ERROR
        | codes::WRITE_FSYNC_ERROR
        | codes::TRIM_REPLICATION_ERROR
        | codes::TRIM_FSYNC_ERROR
            if op.mutates() =>
        {
            StoreError::OutcomeUnknown {
                reason: format!("server error {code} after the request was queued: {message}"),
            }
        }
        _ => StoreError::Other { code, message },
    }
}

/// The wire code of a server error, recovered from the client's typed form.
fn server_code(e: ServerError) -> (u32, String) {
    match e {
        ServerError::Read {
            kind,
            error_message,
        } => (read_code(&kind), error_message),
        ServerError::Write {
            kind,
            error_message,
        } => (write_code(&kind), error_message),
        ServerError::Schema {
            kind,
            error_message,
        } => (schema_code(&kind), error_message),
        ServerError::Delete {
            kind,
            error_message,
        } => (delete_code(&kind), error_message),
        ServerError::Trim {
            kind,
            error_message,
        } => (trim_code(&kind), error_message),
        ServerError::Watch {
            kind,
            error_message,
        } => (watch_code(&kind), error_message),
        ServerError::Details {
            kind,
            error_message,
        } => (details_code(&kind), error_message),
        ServerError::Auth {
            kind,
            error_message,
        } => (auth_code(&kind), error_message),
        ServerError::List {
            error_code,
            error_message,
        }
        | ServerError::Replication {
            error_code,
            error_message,
        }
        | ServerError::ShardRouting {
            error_code,
            error_message,
        }
        | ServerError::Unknown {
            error_code,
            error_message,
        } => (error_code, error_message),
    }
}

fn read_code(kind: &ReadError) -> u32 {
    match kind {
        ReadError::UnavailableBatchIndex { .. } => codes::READ_UNAVAILABLE_VERSION,
        ReadError::AggregateNotExists => codes::READ_AGGREGATE_NOT_EXISTS,
        ReadError::CacheLoadLockTimeout => codes::READ_CACHE_LOAD_LOCK_TIMEOUT,
        ReadError::CacheLoadFileScan => codes::READ_CACHE_LOAD_FILE_SCAN,
        ReadError::FetchDatablocks => codes::READ_FETCH_DATABLOCKS,
        ReadError::FetchMetablocks => codes::READ_FETCH_METABLOCKS,
    }
}

fn write_code(kind: &WriteError) -> u32 {
    match kind {
        WriteError::EmptyEventsList => codes::WRITE_EMPTY_EVENTS_LIST,
        WriteError::ZeroEventType => codes::WRITE_ZERO_EVENT_TYPE,
        WriteError::ClientIdempotencyViolation { .. } => codes::WRITE_CLIENT_IDEMPOTENCY_VIOLATION,
        WriteError::OptimisticConcurrencyViolation { .. } => {
            codes::WRITE_OPTIMISTIC_CONCURRENCY_VIOLATION
        }
        WriteError::FailedToSerialiseDatablocks => codes::WRITE_FAILED_TO_SERIALISE_DATABLOCKS,
        WriteError::AggregateNotExists => codes::WRITE_AGGREGATE_NOT_EXISTS,
        WriteError::AggregateRecreateNotAllowed => codes::WRITE_AGGREGATE_RECREATE_NOT_ALLOWED,
        WriteError::ReplicationError => codes::WRITE_REPLICATION_ERROR,
        WriteError::FsyncError => codes::WRITE_FSYNC_ERROR,
        WriteError::CacheAggregateClientError => codes::WRITE_CACHE_AGGREGATE_CLIENT_ERROR,
        WriteError::AggregateExistsCacheError => codes::WRITE_AGGREGATE_EXISTS_CACHE_ERROR,
        WriteError::InflightDuplicateWrite { .. } => codes::WRITE_INFLIGHT_DUPLICATE,
        WriteError::ReplicationBackpressure => codes::WRITE_REPLICATION_BACKPRESSURE,
    }
}

fn schema_code(kind: &SchemaError) -> u32 {
    match kind {
        SchemaError::AlreadyExists => codes::REGISTER_SCHEMA_ALREADY_EXISTS,
        SchemaError::Invalid => codes::REGISTER_SCHEMA_INVALID,
        SchemaError::ValidationFailed => codes::WRITE_SCHEMA_VALIDATION_FAILED,
        SchemaError::CompilationFailed => codes::WRITE_SCHEMA_COMPILATION_FAILED,
        SchemaError::UnsupportedType => codes::REGISTER_SCHEMA_UNSUPPORTED_TYPE,
        SchemaError::CacheLoadError => codes::REGISTER_SCHEMA_CACHE_LOAD_ERROR,
        SchemaError::FsyncError => codes::REGISTER_SCHEMA_FSYNC_ERROR,
        SchemaError::CannotAcceptWrites => codes::REGISTER_SCHEMA_CANNOT_ACCEPT_WRITES,
        SchemaError::ReplicationError => codes::REGISTER_SCHEMA_REPLICATION_ERROR,
        SchemaError::CoordinationFailed => codes::REGISTER_SCHEMA_COORDINATION_FAILED,
    }
}

fn delete_code(kind: &DeleteError) -> u32 {
    match kind {
        DeleteError::AggregateNotExists => codes::DELETE_AGGREGATE_NOT_EXISTS,
        DeleteError::EmptyDeleteList => codes::DELETE_EMPTY_DELETE_LIST,
        DeleteError::OptimisticConcurrencyViolation { .. } => {
            codes::DELETE_OPTIMISTIC_CONCURRENCY_VIOLATION
        }
        DeleteError::CacheError => codes::DELETE_CACHE_ERROR,
        DeleteError::ReplicationError => codes::DELETE_REPLICATION_ERROR,
        DeleteError::FsyncError => codes::DELETE_FSYNC_ERROR,
        DeleteError::ReplicationBackpressure => codes::DELETE_REPLICATION_BACKPRESSURE,
    }
}

fn trim_code(kind: &TrimError) -> u32 {
    match kind {
        TrimError::AggregateNotExists => codes::TRIM_AGGREGATE_NOT_EXISTS,
        TrimError::CacheError => codes::TRIM_CACHE_ERROR,
        TrimError::ReplicationError => codes::TRIM_REPLICATION_ERROR,
        TrimError::FsyncError => codes::TRIM_FSYNC_ERROR,
        TrimError::IndexOutOfRange => codes::TRIM_INDEX_OUT_OF_RANGE,
        TrimError::ReplicationBackpressure => codes::TRIM_REPLICATION_BACKPRESSURE,
    }
}

fn watch_code(kind: &WatchError) -> u32 {
    match kind {
        WatchError::RequestInvalid => codes::WATCH_REQUEST_INVALID,
        WatchError::LatencyTooHigh => codes::WATCH_LATENCY_TOO_HIGH,
        WatchError::TooManySubscribers { .. } => codes::WATCH_TOO_MANY_SUBSCRIBERS,
        WatchError::ReadIo => codes::WATCH_READ_IO,
        WatchError::ReadSerialization => codes::WATCH_READ_SERIALIZATION,
        WatchError::ReadOther => codes::WATCH_READ_OTHER,
    }
}

fn details_code(kind: &DetailsError) -> u32 {
    match kind {
        DetailsError::CacheError => codes::EXISTS_CACHE_ERROR,
        DetailsError::AggregateNotExists => codes::EXISTS_AGGREGATE_NOT_EXISTS,
        DetailsError::MetablockReadError => codes::EXISTS_METABLOCK_READ_ERROR,
    }
}

fn auth_code(kind: &AuthError) -> u32 {
    match kind {
        AuthError::InvalidNonce => codes::IDENTIFY_INVALID_NONCE,
        AuthError::InvalidSignature => codes::IDENTIFY_INVALID_SIGNATURE,
        AuthError::Mismatch => codes::IDENTIFY_MISMATCH,
        AuthError::Required => codes::IDENTIFY_REQUIRED,
        AuthError::AuthRequired => codes::AUTH_REQUIRED,
        AuthError::InvalidKey => codes::AUTH_INVALID_KEY,
        AuthError::InsufficientPermissions => codes::AUTH_INSUFFICIENT_PERMISSIONS,
    }
}

/// Whether a failed read may succeed if sent again at once: its reply was lost or garbled,
/// or the connection it used broke (a single-node pool reports a lost read reply as
/// `ConnectionFailed`).
pub(super) fn read_worth_retrying(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::RequestTimeout
            | ClientError::ConnectionLostAfterSend(_)
            | ClientError::WireError(_)
            | ClientError::ReadError(_)
            | ClientError::CorrelationMismatch { .. }
            | ClientError::ProtocolError
            | ClientError::ConnectionFailed(_)
    )
}
