//! The production backend: [`EventLog`] over a Celeriant cluster, through the
//! `celeriant_client_tokio` 0.2 connection pool.
//!
//! Every client-library type stays inside this module; the rest of Tally sees only the port.
//!
//! How the port maps onto the server (each point checked against a real server):
//! - outcomes: `map_error` sorts every client error into the port's classes. A write that
//!   was sent and got no readable answer is `OutcomeUnknown`; anything refused before it was
//!   sent is `NotApplied`. Reads are safe to repeat, so a read that lost its reply is retried
//!   a bounded number of times before it fails as `NotApplied`;
//! - client-sequence filters: the server drops the *events* of a batch that fall outside
//!   `min_client_seq`/`max_client_seq`, where the port keeps or drops whole batches. Those two
//!   filters are therefore applied here, not sent;
//! - `min_server_timestamp_ms` is inclusive on the server (the client crate's doc comment says
//!   exclusive; the server code and a live test say inclusive), so it is passed through as is;
//! - pagination: a page covers at most [`READ_PAGE_MAX_VERSIONS`] versions, and the server's
//!   own byte-bounded cursor is honoured inside that window;
//! - multi-aggregate rejections: the server runs all checks on one aggregate before the next,
//!   in hash order, so a write failing on two legs for different reasons gets either error.
//!   The adapter restates such a rejection in the port's order (see `in_port_order`);
//! - an empty write is refused here with code 2000 (a sharded server would answer 9002);
//! - server timestamps are taken as epoch milliseconds, which is the server's default
//!   (`--timestamp-precision milliseconds`, epoch offset 0). Other settings are unsupported.
//!
//! Where the server still differs from the port's documented semantics (passed through):
//! - `trim_start` past the tip is refused even by one (`keep_from > max_version` is 3004,
//!   `Other`): the newest batch can never be trimmed;
//! - `client_seq` 0 is the server's "no sequence" sentinel: an enforced write whose lowest
//!   sequence is 0 is accepted while the durable high-water mark is 0;
//! - when several legs of one write violate idempotency, which leg's sequences the 2002
//!   reports is arbitrary;
//! - a multi-aggregate write must stay on one shard (9001 `CrossShard`); with the default
//!   `--routing-rule aggregate_id` two accounts usually sit on different shards.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use celeriant_client_tokio::{
    AuthError, DeleteError, DetailsError, ReadError, SchemaError, TrimError, WatchError, WriteError,
};
use celeriant_client_tokio::{
    CeleriantPool, ClientError, ClientIdentityConfig, ClientTlsConfig, PoolOptions, ServerError,
    sni_host,
};
use celeriant_msg::error_codes as codes;
use celeriant_msg::request::read_filters::ReadFilters;
use celeriant_msg::request::requests::{
    AggregateDetailsRequest, ReadRequest, SingleAggregateWrite, TrimStartRequest, WriteRequest,
};
use celeriant_msg::response::aggregate_event_batch::AggregateEventBatch;
use celeriant_wal::aggregate_key::AggregateKey as WireKey;
use celeriant_wal::datablocks::datablock_aggregate_event::DatablockAggregateEvent;
use tokio::time::Instant;

use super::{
    AggregateDetails, AggregateKey, AggregateWrite, Batch, ClientId, Event, EventLog, EventType,
    ReadFilter, ReadPage, StoreError, StoreResult,
};

/// Most versions one `read` call asks the server for. The server also cuts a page at its
/// response-size limit; whichever is smaller wins.
pub const READ_PAGE_MAX_VERSIONS: u64 = 512;

/// Most attempts for one read whose reply was lost (the first try included).
pub const READ_MAX_ATTEMPTS: u32 = 3;

/// Pause before retry `n` of a read is `n` times this.
const READ_RETRY_BACKOFF: Duration = Duration::from_millis(25);

/// A read's retries must start within this many request timeouts of its first attempt.
const READ_RETRY_DEADLINE_FACTOR: u32 = 2;

/// `Other.code` for failures raised on this side of the wire (never a server code).
pub const LOCAL_ERROR_CODE: u32 = 0;

/// Client id stamped on trim requests; the port's `trim_start` names no writer, and the
/// server records it only as metadata.
const TRIM_CLIENT_ID: u128 = 0;

/// The key `ping` asks about. It never has to exist: "not found" proves the server answered.
const PING_KEY: AggregateKey = AggregateKey {
    org_id: 0,
    aggregate_type_id: 0,
    aggregate_id: 0,
};

/// Estimated encoding overhead per event and per aggregate, used to refuse a write that
/// could not fit the request-size limit before anything is sent.
const EVENT_OVERHEAD_BYTES: usize = 128;
const AGGREGATE_OVERHEAD_BYTES: usize = 128;

/// Largest request the client will send, in bytes (the client library's default, below the
/// server's 16 MiB default).
pub const MAX_REQUEST_BYTES: u64 = 10_000_000;

const DEFAULT_ADDRESS: &str = "127.0.0.1:10000";
const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Connections per node. Each store request holds one connection until it is answered, and
/// under load Celeriant answers a write only after its amortised fsync (about 4 ms by
/// default), so the pool caps store requests in flight: 16 connections held 1,000-account
/// deposits to 2,833/s where 64 reach about 8,500/s (BENCHMARKS.md). Connections are opened
/// on demand, so an idle replica holds few.
const DEFAULT_POOL_SIZE: usize = 64;
/// Upper bound for either timeout.
pub const MAX_TIMEOUT_MS: u64 = 600_000;
/// Upper bound for connections per node.
pub const MAX_POOL_SIZE: usize = 1_024;
/// Upper bound for seed addresses.
pub const MAX_SEEDS: usize = 64;

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// A Celeriant API key. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let key = s.trim();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        Ok(ApiKey(key.to_owned()))
    }
}

/// How Tally reaches Celeriant. Flatten into the main config with `#[command(flatten)]`.
///
/// Authentication: client 0.2 supports Celeriant API keys (sent in the connection's
/// `Identify` handshake, base64 of 32 bytes, as `celeriant keys generate` prints them). It also
/// supports RSA key-pair identity, which Tally does not use. The server refuses API keys over
/// plaintext unless it runs with `--insecure-allow-plaintext-auth`, so pair a key with TLS.
#[derive(Clone, Debug, clap::Args)]
pub struct CeleriantConfig {
    /// Primary Celeriant node, HOST:PORT.
    #[arg(long = "celeriant-address", env = "CELERIANT_ADDRESS", default_value = DEFAULT_ADDRESS)]
    pub address: String,

    /// Further nodes (comma-separated HOST:PORT), for leader discovery and failover.
    #[arg(
        long = "celeriant-seeds",
        env = "CELERIANT_SEEDS",
        value_delimiter = ',',
        num_args = 0..
    )]
    pub seeds: Vec<String>,

    /// Deadline for one request's answer, in milliseconds.
    #[arg(
        long = "celeriant-request-timeout-ms",
        env = "TALLY_CELERIANT_REQUEST_TIMEOUT_MS",
        default_value_t = DEFAULT_REQUEST_TIMEOUT_MS
    )]
    pub request_timeout_ms: u64,

    /// Deadline for dialling a node (and its TLS and identify handshakes), in milliseconds.
    #[arg(
        long = "celeriant-connect-timeout-ms",
        env = "TALLY_CELERIANT_CONNECT_TIMEOUT_MS",
        default_value_t = DEFAULT_CONNECT_TIMEOUT_MS
    )]
    pub connect_timeout_ms: u64,

    /// Most open connections per node.
    #[arg(
        long = "celeriant-pool-size",
        env = "TALLY_CELERIANT_POOL_SIZE",
        default_value_t = DEFAULT_POOL_SIZE
    )]
    pub pool_size: usize,

    /// CA bundle (PEM) that signs the nodes' certificates. Setting it turns TLS on.
    #[arg(long = "celeriant-tls-ca", env = "TALLY_CELERIANT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// Client certificate chain (PEM) for mutual TLS; needs `--celeriant-tls-key`.
    #[arg(long = "celeriant-tls-cert", env = "TALLY_CELERIANT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// Client private key (PEM) for mutual TLS; needs `--celeriant-tls-cert`.
    #[arg(long = "celeriant-tls-key", env = "TALLY_CELERIANT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// Name to verify the nodes' certificates against. Defaults to the host of the address.
    #[arg(
        long = "celeriant-tls-server-name",
        env = "TALLY_CELERIANT_TLS_SERVER_NAME"
    )]
    pub tls_server_name: Option<String>,

    /// Celeriant API key (base64). Never logged.
    #[arg(
        long = "celeriant-api-key",
        env = "CELERIANT_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<ApiKey>,
}

impl Default for CeleriantConfig {
    fn default() -> Self {
        Self {
            address: DEFAULT_ADDRESS.to_owned(),
            seeds: Vec::new(),
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            pool_size: DEFAULT_POOL_SIZE,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_server_name: None,
            api_key: None,
        }
    }
}

/// Why a [`CeleriantConfig`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid Celeriant setting {flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error("cannot load the Celeriant TLS files: {0}")]
    Tls(String),
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        flag,
        reason: reason.into(),
    }
}

/// Checks a `HOST:PORT` address: a non-empty host and a non-zero port.
fn check_address(flag: &'static str, address: &str) -> Result<(), ConfigError> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(invalid(flag, format!("{address:?} is not HOST:PORT")));
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(invalid(flag, format!("{address:?} has no valid host")));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(invalid(flag, format!("{address:?} has no valid port"))),
    }
}

fn check_timeout(flag: &'static str, ms: u64) -> Result<(), ConfigError> {
    if ms == 0 || ms > MAX_TIMEOUT_MS {
        return Err(invalid(
            flag,
            format!("{ms} is outside 1..={MAX_TIMEOUT_MS}"),
        ));
    }
    Ok(())
}

impl CeleriantConfig {
    /// Checks every setting without touching the network or the file system.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_address("--celeriant-address", &self.address)?;
        if self.seeds.len() > MAX_SEEDS {
            return Err(invalid(
                "--celeriant-seeds",
                format!("{} seeds; at most {MAX_SEEDS}", self.seeds.len()),
            ));
        }
        for seed in &self.seeds {
            check_address("--celeriant-seeds", seed)?;
        }
        check_timeout("--celeriant-request-timeout-ms", self.request_timeout_ms)?;
        check_timeout("--celeriant-connect-timeout-ms", self.connect_timeout_ms)?;
        if self.pool_size == 0 || self.pool_size > MAX_POOL_SIZE {
            return Err(invalid(
                "--celeriant-pool-size",
                format!("{} is outside 1..={MAX_POOL_SIZE}", self.pool_size),
            ));
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return Err(invalid(
                    "--celeriant-tls-key",
                    "required with --celeriant-tls-cert",
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "--celeriant-tls-cert",
                    "required with --celeriant-tls-key",
                ));
            }
            _ => {}
        }
        if self.tls_ca.is_none() {
            if self.tls_cert.is_some() {
                return Err(invalid(
                    "--celeriant-tls-ca",
                    "required with --celeriant-tls-cert",
                ));
            }
            if self.tls_server_name.is_some() {
                return Err(invalid(
                    "--celeriant-tls-ca",
                    "required with --celeriant-tls-server-name",
                ));
            }
        }
        if let Some(name) = &self.tls_server_name
            && (name.is_empty() || name.chars().any(char::is_whitespace))
        {
            return Err(invalid(
                "--celeriant-tls-server-name",
                format!("{name:?} is not a host name"),
            ));
        }
        Ok(())
    }

    /// Whether connections use TLS.
    pub fn tls_enabled(&self) -> bool {
        self.tls_ca.is_some()
    }

    fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// Loads the TLS files, when TLS is on.
    fn tls_config(&self) -> Result<Option<ClientTlsConfig>, ConfigError> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let server_name = match &self.tls_server_name {
            Some(name) => name.as_str(),
            None => sni_host(&self.address).map_err(|e| ConfigError::Tls(format!("{e:?}")))?,
        };
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            _ => None,
        };
        ClientTlsConfig::from_paths(ca, identity, server_name)
            .map(Some)
            .map_err(|e| ConfigError::Tls(format!("{e:?}")))
    }

    fn pool_options(&self) -> Result<PoolOptions, ConfigError> {
        let mut options = PoolOptions::new(self.address.clone())
            .with_seed_addresses(self.seeds.clone())
            .with_max_connections(self.pool_size)
            .with_connection_timeout(Duration::from_millis(self.connect_timeout_ms))
            .with_request_timeout(self.request_timeout())
            .with_max_request_size(MAX_REQUEST_BYTES);
        if let Some(tls) = self.tls_config()? {
            options = options.with_tls(tls);
        }
        if let Some(key) = &self.api_key {
            options = options.with_identity(ClientIdentityConfig::from_api_key(key.expose()));
        }
        Ok(options)
    }
}

// ---------------------------------------------------------------------------------------------
// Outcome mapping
// ---------------------------------------------------------------------------------------------

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
        StoreError::NotApplied { reason }
    }
}

fn not_applied(reason: impl Into<String>) -> StoreError {
    StoreError::NotApplied {
        reason: reason.into(),
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

        // Refused or never sent.
        e @ ClientError::ConnectionFailed(_) => not_applied(e.to_string()),
        e @ ClientError::ConnectionTimeout => not_applied(e.to_string()),
        e @ ClientError::PoolTimeout { .. } => not_applied(e.to_string()),
        e @ ClientError::ServerBusy => not_applied(e.to_string()),
        e @ ClientError::NotLeader { .. } => not_applied(e.to_string()),
        // The handshake could not resolve the compression dictionary: nothing was sent.
        e @ ClientError::DictUnavailable { .. } => not_applied(e.to_string()),

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

/// Sorts a server error code. Missing numeric fields in the message read as 0.
fn map_server_code(op: Op, code: u32, message: String) -> StoreError {
    let field = |name: &str| json_u64(&message, name).unwrap_or(0);
    match code {
        codes::WRITE_OPTIMISTIC_CONCURRENCY_VIOLATION => StoreError::Conflict {
            expected: field("expected_version"),
            current: field("current_aggregate_version"),
        },
        codes::WRITE_CLIENT_IDEMPOTENCY_VIOLATION => StoreError::IdempotencyViolation {
            last_seq: field("last_client_seq"),
            attempted_seq: field("attempted_client_seq"),
        },
        codes::WRITE_INFLIGHT_DUPLICATE => StoreError::InflightDuplicate,
        codes::READ_UNAVAILABLE_VERSION => StoreError::Trimmed {
            min_available: field("minimum_available"),
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
        | codes::DELETE_REPLICATION_BACKPRESSURE
        | codes::WRITE_NOT_LEADER
        | codes::TRIM_NOT_LEADER
        | codes::DELETE_NOT_LEADER => StoreError::NotApplied {
            reason: format!("server refused ({code}): {message}"),
        },
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
fn read_worth_retrying(e: &ClientError) -> bool {
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

// ---------------------------------------------------------------------------------------------
// Translation
// ---------------------------------------------------------------------------------------------

fn wire_key(key: AggregateKey) -> WireKey {
    WireKey::new(key.org_id, key.aggregate_type_id, key.aggregate_id)
}

fn wire_event(event: Event) -> DatablockAggregateEvent {
    DatablockAggregateEvent {
        client_seq: event.client_seq,
        // Assigned by the server.
        event_seq: 0,
        event_id: event.event_id,
        event_timestamp: event.timestamp_ms,
        event_type_major: event.event_type.major,
        event_type_minor: event.event_type.minor,
        event_value: Arc::new(Vec::from(event.payload)),
        iv: None,
    }
}

fn port_event(event: DatablockAggregateEvent) -> Event {
    let payload = Arc::try_unwrap(event.event_value).unwrap_or_else(|shared| (*shared).clone());
    Event {
        client_seq: event.client_seq,
        event_id: event.event_id,
        event_type: EventType {
            major: event.event_type_major,
            minor: event.event_type_minor,
        },
        payload: Bytes::from(payload),
        timestamp_ms: event.event_timestamp,
    }
}

fn port_batch(batch: AggregateEventBatch) -> Batch {
    Batch {
        version: batch.aggregate_version,
        client_id: batch.client_id,
        server_timestamp_ms: batch.server_timestamp,
        events: batch.events.into_iter().map(port_event).collect(),
    }
}

/// The version window one read asks for: `[from, to]`, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Window {
    from: u64,
    to: u64,
    /// Whether `to` is the caller's own bound (nothing past it is wanted).
    caller_bound: bool,
}

fn window(filter: &ReadFilter) -> Window {
    let from = filter.from_version.max(1);
    let cap = from.saturating_add(READ_PAGE_MAX_VERSIONS - 1);
    match filter.to_version {
        Some(to) if to <= cap => Window {
            from,
            to,
            caller_bound: true,
        },
        _ => Window {
            from,
            to: cap,
            caller_bound: false,
        },
    }
}

/// Whether the server drops whole batches for this filter (so returned versions have gaps).
fn has_server_filters(filter: &ReadFilter) -> bool {
    filter.include_client_id.is_some() || filter.min_server_timestamp_ms.is_some()
}

/// The server-side half of a read filter. The client-sequence filters are left out: the
/// server would cut events out of a batch, where the port keeps or drops the whole batch.
fn server_filters(filter: &ReadFilter, w: Window) -> ReadFilters {
    let mut f = ReadFilters::new(w.from).to_aggregate_version(w.to);
    if let Some(client) = filter.include_client_id {
        f = f.include_client_id(client);
    }
    // Inclusive on the server, as in the port.
    if let Some(ts) = filter.min_server_timestamp_ms {
        f = f.min_server_timestamp(ts);
    }
    f
}

/// Where the next page starts, as far as one response can tell. `Unknown` means the window
/// came back short while the server was filtering, so only the aggregate's tip can say.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    At(Option<u64>),
    Unknown { after: u64 },
}

fn next_after(
    w: Window,
    server_next: Option<u64>,
    last_returned: Option<u64>,
    server_filtered: bool,
) -> Next {
    if let Some(n) = server_next {
        // The server cut the page at its size limit.
        return Next::At(Some(n));
    }
    if w.caller_bound {
        return Next::At(None);
    }
    let Some(after) = w.to.checked_add(1) else {
        return Next::At(None);
    };
    if last_returned == Some(w.to) {
        return Next::At(Some(after));
    }
    if server_filtered {
        Next::Unknown { after }
    } else {
        // Unfiltered versions are contiguous, so a short window ended at the tip.
        Next::At(None)
    }
}

/// An estimate of a write's encoded size, to refuse one the client could not send.
fn estimated_request_bytes(writes: &[AggregateWrite]) -> usize {
    writes
        .iter()
        .map(|w| {
            AGGREGATE_OVERHEAD_BYTES
                + w.events
                    .iter()
                    .map(|e| e.payload.len().saturating_add(EVENT_OVERHEAD_BYTES))
                    .sum::<usize>()
        })
        .sum()
}

// ---------------------------------------------------------------------------------------------
// The log
// ---------------------------------------------------------------------------------------------

/// [`EventLog`] over a Celeriant cluster. Cheap to share behind an `Arc`.
pub struct CeleriantLog {
    pool: CeleriantPool,
    read_retry_window: Duration,
}

impl fmt::Debug for CeleriantLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The pool's options hold the API key: never print them.
        f.debug_struct("CeleriantLog")
            .field("address", &self.pool.options().address)
            .field("seeds", &self.pool.options().seed_addresses)
            .finish_non_exhaustive()
    }
}

impl CeleriantLog {
    /// Validates `cfg`, loads the TLS files and builds the connection pool. Nodes are dialled
    /// lazily on first use, so this does not fail when the cluster is down; use
    /// [`EventLog::ping`] to check that it answers.
    pub fn connect(cfg: &CeleriantConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let options = cfg.pool_options()?;
        Ok(Self {
            pool: CeleriantPool::new(options),
            read_retry_window: cfg.request_timeout() * READ_RETRY_DEADLINE_FACTOR,
        })
    }

    /// Runs a call that is safe to repeat, retrying a lost reply a bounded number of times.
    async fn repeatable<T, F, Fut>(&self, op: Op, mut call: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = Instant::now() + self.read_retry_window;
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    let backoff = READ_RETRY_BACKOFF * attempt;
                    let retry = read_worth_retrying(&e)
                        && attempt < READ_MAX_ATTEMPTS
                        && Instant::now() + backoff < deadline;
                    if !retry {
                        return Err(map_error(op, e));
                    }
                    tracing::debug!(attempt, error = %e, "retrying a Celeriant read");
                    tokio::time::sleep(backoff).await;
                    attempt += 1;
                }
            }
        }
    }

    async fn details_as(&self, op: Op, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let request = AggregateDetailsRequest {
            correlation_id: None,
            aggregate_key: wire_key(key),
        };
        let response = self
            .repeatable(op, || self.pool.aggregate_details(request.clone()))
            .await?;
        if response.is_deleted {
            return Err(StoreError::AggregateNotFound);
        }
        Ok(AggregateDetails {
            min_available_version: response.min_aggregate_version.max(1),
            max_version: response.max_aggregate_version,
            last_server_timestamp_ms: response.last_server_timestamp,
        })
    }

    /// The versions a committed multi-aggregate write produced, in input order. With an
    /// expected version the new version is `expected + 1`; without one it is read back from
    /// the aggregate's details, which can name a later version if another write landed in
    /// between. A failed look-up is `OutcomeUnknown`, since the write itself did commit.
    async fn committed_versions(&self, legs: &[Leg]) -> StoreResult<Vec<u64>> {
        let mut versions = Vec::with_capacity(legs.len());
        for leg in legs {
            let version = match leg.expected {
                Some(v) => v.saturating_add(1),
                None => match self.details_as(Op::Details, leg.key).await {
                    Ok(d) => d.max_version,
                    Err(e) => {
                        return Err(StoreError::OutcomeUnknown {
                            reason: format!(
                                "write committed but its version could not be read: {e}"
                            ),
                        });
                    }
                },
            };
            versions.push(version);
        }
        Ok(versions)
    }

    /// Restates a multi-aggregate rejection in the port's check order.
    ///
    /// The server runs every check on one aggregate before it moves to the next, visiting
    /// them in hash order, so a write with a missing leg and a stale leg can come back as
    /// either error, and one with a stale leg and a duplicate sequence as either 2003 or 2002.
    /// The port checks existence on every leg, then every version guard, then idempotency.
    /// Nothing was appended, so this reads each leg's current version and answers as the port
    /// would. Versions only grow and aggregates are never deleted here, so a leg found missing
    /// or stale now was so when the server checked, or is stale for any retry. A failed
    /// look-up keeps the server's answer.
    async fn in_port_order(&self, legs: &[Leg], server: StoreError) -> StoreError {
        let mut observed = Vec::with_capacity(legs.len());
        for leg in legs {
            let current = if leg.allow_create && leg.expected.is_none() {
                // Neither check can fail on this leg.
                Observed::Skipped
            } else {
                match self.details_as(Op::Details, leg.key).await {
                    Ok(d) => Observed::At(d.max_version),
                    Err(StoreError::AggregateNotFound) => Observed::Missing,
                    Err(_) => return server,
                }
            };
            observed.push(current);
        }
        port_order(legs, &observed, server)
    }
}

/// One aggregate of a write, as far as the version checks go.
#[derive(Clone, Copy, Debug)]
struct Leg {
    key: AggregateKey,
    expected: Option<u64>,
    allow_create: bool,
}

/// A leg's state after a rejected write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Observed {
    Skipped,
    Missing,
    At(u64),
}

/// The port's answer for a rejected multi-aggregate write: the first leg (in request order)
/// that must exist and does not, else the first stale version guard, else the server's
/// answer.
fn port_order(legs: &[Leg], observed: &[Observed], server: StoreError) -> StoreError {
    let pairs = || legs.iter().zip(observed);
    if pairs().any(|(leg, seen)| !leg.allow_create && *seen == Observed::Missing) {
        return StoreError::AggregateNotFound;
    }
    for (leg, seen) in pairs() {
        let current = match seen {
            Observed::At(v) => *v,
            Observed::Missing => 0,
            Observed::Skipped => continue,
        };
        if let Some(expected) = leg.expected
            && expected != current
        {
            return StoreError::Conflict { expected, current };
        }
    }
    server
}

/// Whether a multi-aggregate rejection may name a later check than the port would.
fn order_sensitive(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Conflict { .. }
            | StoreError::IdempotencyViolation { .. }
            | StoreError::InflightDuplicate
    )
}

#[async_trait]
impl EventLog for CeleriantLog {
    /// One `WriteRequest` carrying one `SingleAggregateWrite` per aggregate. An aggregate may
    /// appear once per write.
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        let estimate = estimated_request_bytes(&writes);
        if estimate as u64 > MAX_REQUEST_BYTES {
            return Err(StoreError::Other {
                code: LOCAL_ERROR_CODE,
                message: format!(
                    "write of about {estimate} bytes exceeds the {MAX_REQUEST_BYTES}-byte request limit"
                ),
            });
        }
        if writes.is_empty() {
            // A sharded server calls this a routing error (9002), a single shard 2000.
            return Err(StoreError::Other {
                code: codes::WRITE_EMPTY_EVENTS_LIST,
                message: "a write must name at least one aggregate".into(),
            });
        }
        let mut legs = Vec::with_capacity(writes.len());
        let mut request = HashMap::with_capacity(writes.len());
        for w in writes {
            legs.push(Leg {
                key: w.key,
                expected: w.expected_version,
                allow_create: w.allow_create,
            });
            let single = SingleAggregateWrite {
                events: w.events.into_iter().map(wire_event).collect(),
                allow_create: w.allow_create,
                expected_version: w.expected_version,
                enforce_client_idempotency: w.enforce_client_idempotency,
            };
            if request.insert(wire_key(w.key), single).is_some() {
                return Err(StoreError::Other {
                    code: LOCAL_ERROR_CODE,
                    message: format!("aggregate {:?} appears twice in one write", w.key),
                });
            }
        }
        let sent = self
            .pool
            .write(WriteRequest {
                correlation_id: None,
                client_id,
                user_id: None,
                writes: request,
            })
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => {
                let e = map_error(Op::Write, e);
                if legs.len() > 1 && order_sensitive(&e) {
                    return Err(self.in_port_order(&legs, e).await);
                }
                return Err(e);
            }
        };
        match (legs.as_slice(), response.max_aggregate_version) {
            ([_], Some(version)) => Ok(vec![version]),
            _ => self.committed_versions(&legs).await,
        }
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let w = window(filter);
        let request = ReadRequest {
            correlation_id: None,
            aggregate_key: wire_key(key),
            filters: server_filters(filter, w),
        };
        let response = self
            .repeatable(Op::Read, || self.pool.read(request.clone()))
            .await?;
        let last_returned = response.event_batches.last().map(|b| b.aggregate_version);
        let next = match next_after(
            w,
            response.next_aggregate_version,
            last_returned,
            has_server_filters(filter),
        ) {
            Next::At(next) => next,
            Next::Unknown { after } => {
                let tip = self.details_as(Op::Read, key).await?.max_version;
                (tip >= after).then_some(after)
            }
        };
        let batches = response
            .event_batches
            .into_iter()
            .map(port_batch)
            .filter(|b| filter.admits(b))
            .collect();
        Ok(ReadPage {
            batches,
            next_version: next,
        })
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.details_as(Op::Details, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.pool
            .trim_start(TrimStartRequest {
                correlation_id: None,
                aggregate_key: wire_key(key),
                keep_from_aggregate_version: keep_from_version,
                client_id: TRIM_CLIENT_ID,
                user_id: None,
            })
            .await
            .map(|_| ())
            .map_err(|e| map_error(Op::Trim, e))
    }

    /// Asks for the details of a key that need not exist: any answer from the server,
    /// "not found" included, proves it is up.
    async fn ping(&self) -> StoreResult<()> {
        match self.details_as(Op::Ping, PING_KEY).await {
            Ok(_) | Err(StoreError::AggregateNotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests;
