//! One typed configuration, from flags and environment, validated at start.

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};
use uuid::Uuid;

use crate::account::{AccountsMode, Identity, named_id};
// Authentication, rate limits and the admin listener (issue 17).
use crate::auth::rate::{DEFAULT_BURST_PER_CALLER, DEFAULT_RATE_PER_CALLER};
use crate::auth::{
    AuthConfig, AuthMode, Authenticator, DEFAULT_AUDIENCE, DEFAULT_ISSUER, DEFAULT_LEEWAY_SECS,
    MAX_RATE_PER_CALLER,
};
use crate::projection::{
    DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_INDEX_ENTRIES, DEFAULT_MAX_RESIDENT_ACCOUNTS,
    ProjectionConfig,
};
use crate::store::celeriant::CeleriantConfig;
use crate::store::faults::FaultConfig;
use crate::watch::WatchConfig;
use crate::write_loop::{
    DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BATCH_EVENTS, DEFAULT_MAX_LIVE_WRITES,
    DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT, WriteConfig,
};

/// The longest idempotency window accepted, in seconds (one day).
pub const MAX_WINDOW_SECS: u64 = 86_400;
/// How long an answer waits for its client to read any of it, unless configured: longer
/// than a watch stream's own stall limit with the default keep-alive (2 x 15 s), so that
/// one comes first and the stream can still tell its client why it ended.
pub const DEFAULT_WRITE_STALL_SECS: u64 = 60;
/// The largest accepted `--write-stall-secs`.
pub const MAX_WRITE_STALL_SECS: u64 = 3_600;
/// The most requests served at once, unless configured; beyond it a request waits for a slot
/// (up to `--max-queue-wait-ms`). No more than one account's write queue holds: were every
/// request in flight a write to one hot account, none would be refused by the write side's
/// per-account cap at once (a refusal that clients re-sending at once turn into a spin); the
/// excess waits here instead. 64 requests in flight already reach a replica's peak.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT;
/// How long shutdown waits for in-flight requests, unless configured.
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 10;
/// The most bytes of one request's head (request line and headers) read, unless
/// configured; a longer head is answered 414 (its request line alone passes the limit) or 431,
/// in the API's JSON error shape, and its connection closed. Tally's own
/// headers (an Idempotency-Key, a content type) take well under 1 KiB, proxies add a few
/// hundred bytes; 16 KiB leaves room for tracing and auth headers without letting every
/// connection pin hyper's ~400 KB read buffer.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// The accepted range of `--max-header-bytes`: below 1 KiB ordinary requests fail, and
/// above 256 KiB the cap would sit next to hyper's own read-buffer limit (~400 KB).
pub const HEADER_BYTES_RANGE: std::ops::RangeInclusive<usize> = 1024..=256 * 1024;

// Admission at the HTTP edge (issue 13).
/// The most client connections open at once, unless configured. At the cap the server stops
/// accepting: further clients wait in the kernel's accept queue, costing neither memory nor
/// CPU here (about 10 KiB per open connection otherwise).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// How long a request over `--max-concurrent-requests` waits for a slot, unless configured:
/// long enough that a burst or a re-sending client waits instead of spinning on refusals,
/// short enough that an admitted request's wait stays far under a second.
pub const DEFAULT_MAX_QUEUE_WAIT_MS: u64 = 250;
/// The gate's floor, unless configured: requests worked on at once that the gate never goes
/// below, and where it starts. Enough to keep two cores busy with room for a batch; on the
/// embedded store with the server pinned to one core and 1,500 connections (wrk), a fixed 4
/// to 32 slots all kept 0.76-0.81 of peak goodput, where 128 kept 0.70.
pub const DEFAULT_MIN_ACTIVE_REQUESTS: usize = 16;
/// The gate's ceiling, unless configured: no more than the in-flight limit behind it, so a
/// request that passed the gate is never the one shed there.
pub const DEFAULT_MAX_ACTIVE_REQUESTS: usize = DEFAULT_MAX_CONCURRENT_REQUESTS;
/// The largest `--max-active-requests` accepted.
pub const MAX_ACTIVE_REQUESTS: usize = 65_536;
/// The longest `--max-queue-wait-ms` accepted (the write deadline's order of magnitude).
pub const MAX_QUEUE_WAIT_MS: u64 = 10_000;
/// The most runtime worker threads `--worker-threads` accepts.
pub const MAX_WORKER_THREADS: usize = 256;
/// The most client connections `--max-connections` accepts: far past what one process's
/// file descriptors allow on any usual system.
pub const MAX_CONNECTIONS: usize = 1 << 20;
/// The most live writes `--max-live-writes` accepts.
pub const MAX_LIVE_WRITES: usize = 1 << 20;
/// The most operations `--max-batch-events` accepts in one store write.
pub const MAX_BATCH_EVENTS: usize = 4096;
/// The most accounts `--max-resident-accounts` accepts (a few hundred bytes each, folded).
pub const MAX_RESIDENT_ACCOUNTS: usize = 100_000_000;
/// The most recent-writes entries `--max-index-entries` accepts (about 100 bytes each).
pub const MAX_INDEX_ENTRIES: usize = 100_000_000;
/// The longest `--write-deadline-ms` accepted (ten minutes).
pub const MAX_WRITE_DEADLINE_MS: u64 = 600_000;
/// The most store writes `--write-max-attempts` accepts for one request.
pub const MAX_WRITE_ATTEMPTS: u64 = 1_000;
/// The longest `--idle-timeout-secs` accepted (a week).
pub const MAX_IDLE_TIMEOUT_SECS: u64 = 7 * 86_400;
/// The longest `--shutdown-grace-secs` accepted (an hour).
pub const MAX_SHUTDOWN_GRACE_SECS: u64 = 3_600;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// The embedded in-process store: for development and tests; keeps nothing across restarts.
    Memory,
    /// A Celeriant cluster: the durable store every replica shares.
    Celeriant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// Tally: idempotent account writes over the Celeriant event store.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "tally",
    version,
    about,
    after_help = "Development tokens: `tally token --help` (issue 17)."
)]
pub struct Config {
    /// Address to serve HTTP on.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Event store backend.
    #[arg(long, env = "TALLY_STORE", value_enum, default_value_t = StoreKind::Memory)]
    pub store: StoreKind,

    /// How long a write's response can be replayed for a retry with the same Idempotency-Key,
    /// in seconds. A stated API property: sent on every write response.
    #[arg(long, env = "TALLY_IDEMPOTENCY_WINDOW", default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=MAX_WINDOW_SECS))]
    pub idempotency_window: u64,

    /// The service's Celeriant client id (a UUID). One id for the whole service, shared by
    /// every replica; never per replica or per request. Default: UUIDv5 of "Tally".
    #[arg(long, env = "TALLY_CLIENT_ID")]
    pub client_id: Option<Uuid>,

    /// The Celeriant org id (a UUID). Default: UUIDv5 of "DemoOrg".
    #[arg(long, env = "TALLY_ORG_ID")]
    pub org_id: Option<Uuid>,

    /// The aggregate type id of accounts (a UUID). Default: UUIDv5 of "Account".
    #[arg(long, env = "TALLY_ACCOUNT_TYPE_ID")]
    pub account_type_id: Option<Uuid>,

    /// Seed the demo accounts (Alice, Bob, Charlie) at start, create-only. Default: true on
    /// the memory store, false on Celeriant.
    #[arg(long, env = "TALLY_SEED_DEMO_ACCOUNTS")]
    pub seed_demo_accounts: Option<bool>,

    /// Wrap the store in the fault injector, for demos and black-box tests, e.g.
    /// `lost-ack=0.1,lost-request=0.05,refused=0.05,inflight=0.1,read-lag=0.2,seed=7`.
    // Parsed once, by clap through `FaultConfig`'s `FromStr`: a bad spec is refused at start.
    #[arg(long, env = "TALLY_FAULTS")]
    pub faults: Option<FaultConfig>,

    /// Requests served at once; beyond it a request waits up to `--max-queue-wait-ms` for a
    /// slot, then gets a 503.
    #[arg(long, env = "TALLY_MAX_CONCURRENT_REQUESTS", default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub max_concurrent_requests: usize,

    /// Seconds an answer may wait for its client to read any of it (the connection's send
    /// buffer full) before the connection is closed: a client that stops reading holds no
    /// connection for ever. An event stream's client too: keep this above twice
    /// `--watch-keepalive-secs`, after which a stalled stream ends and can tell its client.
    #[arg(long, env = "TALLY_WRITE_STALL_SECS", default_value_t = DEFAULT_WRITE_STALL_SECS, value_parser = clap::value_parser!(u64).range(1..=MAX_WRITE_STALL_SECS))]
    pub write_stall_secs: u64,

    /// How long a request over `--max-concurrent-requests` waits for a slot (first come,
    /// first served) before it is refused with 503, in ms; 0 refuses at once. At the
    /// `--max-connections` cap the refusal also closes its connection, so a client waiting
    /// to be accepted takes its place.
    #[arg(long, env = "TALLY_MAX_QUEUE_WAIT_MS", default_value_t = DEFAULT_MAX_QUEUE_WAIT_MS, value_parser = clap::value_parser!(u64).range(0..=MAX_QUEUE_WAIT_MS))]
    pub max_queue_wait_ms: u64,

    /// The gate's floor: requests worked on at once (taken before a request is read) never
    /// drop below it; the gate adapts between this and `--max-active-requests` to how busy
    /// the CPU is.
    #[arg(long, env = "TALLY_MIN_ACTIVE_REQUESTS", default_value_t = DEFAULT_MIN_ACTIVE_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub min_active_requests: usize,

    /// The gate's ceiling; equal to `--min-active-requests` it fixes the limit. Connections
    /// over the limit wait with their request unread, in the kernel's socket buffer.
    #[arg(long, env = "TALLY_MAX_ACTIVE_REQUESTS", default_value_t = DEFAULT_MAX_ACTIVE_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub max_active_requests: usize,

    /// Client connections open at once; at the cap the server stops accepting until one
    /// closes (clients wait in the kernel's accept queue).
    #[arg(long, env = "TALLY_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = count(MAX_CONNECTIONS))]
    pub max_connections: usize,

    /// Runtime worker threads; by default one per core this process may use. Give a
    /// replica fewer than the machine's cores when it shares them (with a load generator,
    /// a sidecar, the store): workers then contend for the same cores and move connections
    /// between them (Envoy's `--concurrency`, nginx's `worker_processes`).
    #[arg(long, env = "TALLY_WORKER_THREADS", value_parser = count(MAX_WORKER_THREADS))]
    pub worker_threads: Option<usize>,

    /// How long one write may spend retrying before it answers a retryable 409, in ms.
    #[arg(long, env = "TALLY_WRITE_DEADLINE_MS", default_value_t = DEFAULT_DEADLINE.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..=MAX_WRITE_DEADLINE_MS))]
    pub write_deadline_ms: u64,

    /// Turns of the write loop one request may take (each ends in a store write, or earlier
    /// when a catch-up, scan or decision sends it round again) before it answers a
    /// retryable 409.
    #[arg(long, env = "TALLY_WRITE_MAX_ATTEMPTS", default_value_t = DEFAULT_MAX_ATTEMPTS, value_parser = RangedU64ValueParser::<u32>::new().range(1..=MAX_WRITE_ATTEMPTS))]
    pub write_max_attempts: u32,

    /// Write at the local cursor first on a warm account (one store round trip), catching up
    /// only when the version guard says the fold was stale.
    #[arg(long, env = "TALLY_ONE_ROUND_TRIP", default_value_t = true, action = clap::ArgAction::Set)]
    pub one_round_trip: bool,

    /// Batch single-account writes that queue on one account into one store write.
    #[arg(long, env = "TALLY_BATCHING", default_value_t = true, action = clap::ArgAction::Set)]
    pub batching: bool,

    /// The most operations written together in one batch.
    #[arg(long, env = "TALLY_MAX_BATCH_EVENTS", default_value_t = DEFAULT_MAX_BATCH_EVENTS, value_parser = count(MAX_BATCH_EVENTS))]
    pub max_batch_events: usize,

    /// Most requests alive on the write side at once (running, queued or coalesced); beyond
    /// it, 503 at once. Unlike --max-concurrent-requests, a write whose client disconnected
    /// still counts until it ends.
    #[arg(long, env = "TALLY_MAX_LIVE_WRITES", default_value_t = DEFAULT_MAX_LIVE_WRITES, value_parser = count(MAX_LIVE_WRITES))]
    pub max_live_writes: usize,

    /// Most writes waiting in one account's queue; beyond it a write waits for a place in
    /// arrival order, and answers a retryable 503 if its deadline passes first.
    #[arg(long, env = "TALLY_MAX_QUEUED_WRITES_PER_ACCOUNT", default_value_t = DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub max_queued_writes_per_account: usize,

    /// Most accounts kept folded in memory; the least recently used beyond it are dropped.
    #[arg(long, env = "TALLY_MAX_RESIDENT_ACCOUNTS", default_value_t = DEFAULT_MAX_RESIDENT_ACCOUNTS, value_parser = count(MAX_RESIDENT_ACCOUNTS))]
    pub max_resident_accounts: usize,

    /// Most recent-writes index entries this replica holds (over all its accounts); at the
    /// cap, new writes are refused with a retryable 503 until expiry frees room. Entries are
    /// never dropped early: the idempotency window stays whole.
    #[arg(long, env = "TALLY_MAX_INDEX_ENTRIES", default_value_t = DEFAULT_MAX_INDEX_ENTRIES, value_parser = count(MAX_INDEX_ENTRIES))]
    pub max_index_entries: usize,

    /// Most bytes of a request's line and headers; a longer head is answered 414 (the request
    /// line alone passes it) or 431.
    #[arg(long, env = "TALLY_MAX_HEADER_BYTES", default_value_t = DEFAULT_MAX_HEADER_BYTES, value_parser = usize_in(HEADER_BYTES_RANGE))]
    pub max_header_bytes: usize,

    /// Drop an account from memory after this many idle seconds.
    #[arg(long, env = "TALLY_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(0..=MAX_IDLE_TIMEOUT_SECS))]
    pub idle_timeout_secs: u64,

    /// How long shutdown waits for in-flight requests, in seconds.
    #[arg(long, env = "TALLY_SHUTDOWN_GRACE_SECS", default_value_t = DEFAULT_SHUTDOWN_GRACE_SECS, value_parser = clap::value_parser!(u64).range(0..=MAX_SHUTDOWN_GRACE_SECS))]
    pub shutdown_grace_secs: u64,

    /// Log format; the level comes from RUST_LOG (default info).
    #[arg(long, env = "TALLY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,

    // Authentication, rate limits and the admin listener (issue 17).
    /// Whether API requests must carry a bearer token (JWT): `none` lets anyone who reaches
    /// the replica do anything (development), `jwt` checks every API request.
    #[arg(long, env = "TALLY_AUTH", value_enum, default_value_t = AuthMode::None)]
    pub auth: AuthMode,

    /// With `--auth jwt`: a file holding the HS256 shared secret (at least 32 bytes).
    #[arg(long, env = "TALLY_AUTH_SECRET_FILE")]
    pub auth_secret_file: Option<std::path::PathBuf>,

    /// With `--auth jwt`: a JWKS file of RS256, ES256 or EdDSA public keys (each with a
    /// kid), reread when it changes.
    #[arg(long, env = "TALLY_AUTH_JWKS_FILE")]
    pub auth_jwks_file: Option<std::path::PathBuf>,

    /// The issuer (`iss`) tokens must name.
    #[arg(long, env = "TALLY_AUTH_ISSUER", default_value = DEFAULT_ISSUER)]
    pub auth_issuer: String,

    /// The audience (`aud`) tokens must name.
    #[arg(long, env = "TALLY_AUTH_AUDIENCE", default_value = DEFAULT_AUDIENCE)]
    pub auth_audience: String,

    /// Clock skew allowed on a token's `exp` and `nbf`, in seconds.
    #[arg(long, env = "TALLY_AUTH_LEEWAY_SECS", default_value_t = DEFAULT_LEEWAY_SECS)]
    pub auth_leeway_secs: u64,

    /// With `--auth jwt`: requests a second each caller may make on this replica (beyond
    /// it, 429 with Retry-After); 0 is no limit.
    #[arg(long, env = "TALLY_RATE_LIMIT_PER_CALLER", default_value_t = DEFAULT_RATE_PER_CALLER, value_parser = RangedU64ValueParser::<u32>::new().range(0..=u64::from(MAX_RATE_PER_CALLER)))]
    pub rate_limit_per_caller: u32,

    /// The burst each caller may make at once; a value below the per-second rate is raised
    /// to it.
    #[arg(long, env = "TALLY_RATE_LIMIT_BURST", default_value_t = DEFAULT_BURST_PER_CALLER, value_parser = RangedU64ValueParser::<u32>::new().range(0..=u64::from(MAX_RATE_PER_CALLER)))]
    pub rate_limit_burst: u32,

    /// Serve `/metrics` (with `/healthz` and `/readyz`) on this address instead of the
    /// API's; the API's `/metrics` then answers 404.
    #[arg(long, env = "TALLY_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    /// How to reach Celeriant (used with `--store celeriant`).
    #[command(flatten)]
    pub celeriant: CeleriantConfig,

    // Watch stream (issue 16): its limits, `--watch-*`.
    #[command(flatten)]
    pub watch: WatchConfig,
    // --- The Postgres projection (issue 14) ---
    /// Where the projection lives: its cursor, balance, highest own sequence AND its
    /// recent-writes index, always together. `memory`: each replica folds the stream itself;
    /// `postgres`: one database shared by every replica (needs --postgres-url).
    #[arg(long = "projection", env = "TALLY_PROJECTION", value_enum, default_value_t = ProjectionKind::Memory)]
    pub projection_kind: ProjectionKind,

    /// The Postgres projection's database URL (`postgres://user:password@host:5432/db`).
    /// Never logged; in Kubernetes it comes from a Secret.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub postgres_url: Option<String>,

    /// Connections in this replica's Postgres pool.
    #[arg(long, env = "TALLY_POSTGRES_POOL_SIZE", default_value_t = crate::projection::postgres::DEFAULT_POOL_SIZE, value_parser = count(MAX_POSTGRES_POOL_SIZE))]
    pub postgres_pool_size: usize,

    /// The longest one Postgres statement may run, and the longest a request waits for a
    /// pooled connection, in ms.
    #[arg(long, env = "TALLY_POSTGRES_STATEMENT_TIMEOUT_MS", default_value_t = crate::projection::postgres::DEFAULT_STATEMENT_TIMEOUT.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..=MAX_POSTGRES_STATEMENT_TIMEOUT_MS))]
    pub postgres_statement_timeout_ms: u64,

    /// Scan on miss: when the recent-writes index misses a request, look for it among the
    /// account's own batches committed this many seconds back (server time), and replay it
    /// if found. 0 (the default) is off. Costs one store read per account of every new
    /// request. Both projections.
    #[arg(long, env = "TALLY_IDEMPOTENCY_SCAN_WINDOW", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=MAX_WINDOW_SECS))]
    pub idempotency_scan_window: u64,

    /// Which ids take writes. `implicit`: every id is an account, created by its first
    /// write, as in the replaced service (keep it while that service shares the fleet).
    /// `explicit`: an account must exist (opened with `POST /api/accounts`, or written
    /// before); a write, transfer leg, device run, balance or history of any other id is a
    /// 404 `ACCOUNT_NOT_FOUND` and writes nothing.
    #[arg(long = "accounts", env = "TALLY_ACCOUNTS", value_enum, default_value_t = AccountsMode::Implicit)]
    pub accounts: AccountsMode,
}

/// Where the projection lives (issue 14). One setting for cursor and index together: the
/// half-shared configuration (a shared cursor with a per-replica index) double-writes, so
/// it cannot be configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProjectionKind {
    Memory,
    Postgres,
}

/// The most connections one replica's Postgres pool may hold (issue 14).
pub const MAX_POSTGRES_POOL_SIZE: usize = 1024;
/// The longest `--postgres-statement-timeout-ms` accepted (ten minutes; Postgres itself
/// refuses a `statement_timeout` past 2^31 - 1 ms, and the replica would never get ready).
pub const MAX_POSTGRES_STATEMENT_TIMEOUT_MS: u64 = 600_000;

/// The parser of a count flag: `1..=max`. Nothing is unbounded, and a value no replica could
/// use is a typo clap refuses at start, naming the flag (several of these size a semaphore,
/// which panics past its own maximum).
pub fn count(max: usize) -> RangedU64ValueParser<usize> {
    usize_in(1..=max)
}

/// The parser of a `usize` flag accepted in `range`.
pub fn usize_in(range: RangeInclusive<usize>) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(*range.start() as u64..=*range.end() as u64)
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

impl Config {
    /// A configuration with every default, for tests and embedding.
    pub fn defaults() -> Self {
        Self::parse_from(["tally"])
    }

    /// Checks what the flags' own parsers cannot: settings that are each in range but do not
    /// fit together, and the files and URLs a replica needs before it serves. Each flag's
    /// range is its parser's (see [`count`]): a value no replica could use is refused by
    /// clap, naming the flag, before this runs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_gate_floor_under_ceiling()?;
        self.check_time_relations()?;
        // Issue 17: a token must be checkable before the replica serves.
        Authenticator::new(&self.auth()).map_err(ConfigError)?;
        if self.store == StoreKind::Celeriant {
            self.celeriant
                .validate()
                .map_err(|e| ConfigError(e.to_string()))?;
        }
        self.check_postgres_has_a_url()?;
        Ok(())
    }

    /// The gate adapts between its floor and its ceiling, so the floor may not pass it.
    fn check_gate_floor_under_ceiling(&self) -> Result<(), ConfigError> {
        if self.min_active_requests > self.max_active_requests {
            return Err(ConfigError(format!(
                "--min-active-requests and --max-active-requests need 1 <= min <= max <= {MAX_ACTIVE_REQUESTS}"
            )));
        }
        Ok(())
    }

    /// The longest a write can live: its deadline, and the last store request it may still
    /// have out when the deadline passes.
    pub fn write_life(&self) -> Duration {
        Duration::from_millis(self.write_deadline_ms) + self.store_request_timeout()
    }

    /// The longest one store request may take (0 on the embedded store, which answers in
    /// process).
    pub fn store_request_timeout(&self) -> Duration {
        match self.store {
            StoreKind::Celeriant => Duration::from_millis(self.celeriant.request_timeout_ms),
            StoreKind::Memory => Duration::ZERO,
        }
    }

    /// How long after a retry is sent it may still look for an earlier landing: its waits
    /// before it is read (at the gate, for an in-flight slot, again after a slow body, each
    /// at most `--max-queue-wait-ms`), a stall too short to be fenced, then a write's life
    /// (its last look is a catch-up before its deadline, and a store call may be out).
    pub fn retry_lookup_room(&self) -> Duration {
        self.max_queue_wait() * 3 + crate::stall::THRESHOLD + self.write_life()
    }

    /// Settings that are each in range but do not fit together.
    fn check_time_relations(&self) -> Result<(), ConfigError> {
        // A write's whole life (its deadline, and the last store request it may still have
        // out when the deadline passes) fits in the window: what it wrote is in the
        // recent-writes index for as long as the write itself can look for it there.
        let life_ms = u64::try_from(self.write_life().as_millis()).unwrap_or(u64::MAX);
        if life_ms >= self.idempotency_window.saturating_mul(1000) {
            return Err(ConfigError(format!(
                "--idempotency-window ({} s) must be longer than --write-deadline-ms plus the store's request timeout ({life_ms} ms)",
                self.idempotency_window
            )));
        }
        // A stalled event stream ends itself first, so it can still tell its client why.
        if self.write_stall_secs <= self.watch.stall_limit().as_secs() {
            return Err(ConfigError(format!(
                "--write-stall-secs must be longer than {} x --watch-keepalive-secs ({} s)",
                crate::watch::STALL_KEEPALIVES,
                self.watch.stall_limit().as_secs()
            )));
        }
        Ok(())
    }

    // The Postgres projection (issue 14).
    fn check_postgres_has_a_url(&self) -> Result<(), ConfigError> {
        if self.projection_kind == ProjectionKind::Postgres
            && self.postgres_url.as_deref().is_none_or(str::is_empty)
        {
            return Err(ConfigError(
                "--projection postgres needs --postgres-url (or DATABASE_URL)".into(),
            ));
        }
        Ok(())
    }

    /// The Postgres projection's settings, when `--projection postgres` (issue 14).
    pub fn postgres(&self) -> Option<crate::projection::PostgresSettings> {
        (self.projection_kind == ProjectionKind::Postgres).then(|| {
            crate::projection::PostgresSettings {
                url: self.postgres_url.clone().unwrap_or_default(),
                pool_size: self.postgres_pool_size,
                statement_timeout: Duration::from_millis(self.postgres_statement_timeout_ms),
            }
        })
    }

    /// The store, as a person starting a replica needs to see it: which backend and where
    /// (the embedded one is this process's own, shared with no other replica).
    pub fn store_description(&self) -> String {
        match self.store {
            StoreKind::Memory => "memory (embedded in this process, shared with no other)".into(),
            StoreKind::Celeriant => format!("celeriant at {}", self.celeriant.address),
        }
    }

    /// The projection, likewise: `memory`, or `postgres` with the database's place (never its
    /// credentials).
    pub fn projection_description(&self) -> String {
        match self.projection_kind {
            ProjectionKind::Memory => "memory".into(),
            ProjectionKind::Postgres => format!(
                "postgres at {}",
                crate::projection::postgres::database_place(
                    self.postgres_url.as_deref().unwrap_or_default()
                )
            ),
        }
    }

    pub fn identity(&self) -> Identity {
        let d = Identity::default();
        Identity {
            org_id: self.org_id.unwrap_or(d.org_id),
            account_type_id: self.account_type_id.unwrap_or(d.account_type_id),
            client_id: self.client_id.unwrap_or(d.client_id),
        }
    }

    pub fn seeds_demo_accounts(&self) -> bool {
        self.seed_demo_accounts
            .unwrap_or(self.store == StoreKind::Memory)
    }

    /// How long an answer may wait for its client to read any of it.
    pub fn write_stall(&self) -> Duration {
        Duration::from_secs(self.write_stall_secs)
    }

    /// How long a request waits for an in-flight slot before it is refused.
    pub fn max_queue_wait(&self) -> Duration {
        Duration::from_millis(self.max_queue_wait_ms)
    }

    pub fn window(&self) -> Duration {
        Duration::from_secs(self.idempotency_window)
    }

    pub fn projection(&self) -> ProjectionConfig {
        ProjectionConfig {
            window: self.window(),
            max_resident_accounts: self.max_resident_accounts,
            idle_timeout: Duration::from_secs(self.idle_timeout_secs),
            max_index_entries: self.max_index_entries,
            scan_window: (self.idempotency_scan_window > 0)
                .then(|| Duration::from_secs(self.idempotency_scan_window)),
        }
    }

    /// How requests are authenticated and paced (issue 17).
    pub fn auth(&self) -> AuthConfig {
        AuthConfig {
            mode: self.auth,
            secret_file: self.auth_secret_file.clone(),
            jwks_file: self.auth_jwks_file.clone(),
            issuer: self.auth_issuer.clone(),
            audience: self.auth_audience.clone(),
            leeway_secs: self.auth_leeway_secs,
            rate_per_caller: self.rate_limit_per_caller,
            rate_burst: self.rate_limit_burst,
        }
    }

    pub fn write(&self) -> WriteConfig {
        WriteConfig {
            max_attempts: self.write_max_attempts,
            deadline: Duration::from_millis(self.write_deadline_ms),
            one_round_trip: self.one_round_trip,
            batching: self.batching,
            max_batch_events: self.max_batch_events,
            max_live_writes: self.max_live_writes,
            max_queued_per_account: self.max_queued_writes_per_account,
            accounts: self.accounts,
        }
    }
}

#[cfg(test)]
impl Config {
    /// Why a replica with these flags would not start: clap's refusal of a value out of its
    /// flag's range, or else [`Config::validate`]'s.
    pub(crate) fn refusal(args: &[&str]) -> String {
        match Self::try_parse_from(std::iter::once(&"tally").chain(args)) {
            Err(e) => e.to_string(),
            Ok(c) => c.validate().expect_err("refused").to_string(),
        }
    }
}

/// The demo accounts seeded on the embedded store: (name, opening balance in cents). Their
/// ids are UUIDv5 of the name, in the shared identity namespace.
pub const DEMO_ACCOUNTS: [(&str, i64); 3] =
    [("Alice", 50_000), ("Bob", 25_000), ("Charlie", 10_000)];

/// The id of a demo account.
pub fn demo_account_id(name: &str) -> Uuid {
    named_id(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_name_the_service() {
        let c = Config::defaults();
        c.validate().unwrap();
        assert_eq!(c.identity().client_id, named_id("Tally"));
        assert!(c.seeds_demo_accounts());
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
    }

    #[test]
    fn out_of_range_settings_are_refused() {
        let e = Config::refusal(&["--idempotency-window", "0"]);
        assert!(e.contains("--idempotency-window"), "{e}");
        let c = Config::parse_from(["tally", "--store", "celeriant"]);
        assert!(!c.seeds_demo_accounts());
    }

    #[test]
    fn admission_flags_are_checked() {
        let c = Config::defaults();
        assert_eq!(c.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(
            c.max_queue_wait(),
            Duration::from_millis(DEFAULT_MAX_QUEUE_WAIT_MS)
        );
        let c = Config::parse_from(["tally", "--max-queue-wait-ms", "0"]);
        c.validate().unwrap();
        assert!(c.max_queue_wait().is_zero());
        assert_eq!(
            (c.min_active_requests, c.max_active_requests),
            (DEFAULT_MIN_ACTIVE_REQUESTS, DEFAULT_MAX_ACTIVE_REQUESTS)
        );
        for bad in [
            ["--max-connections", "0"],
            ["--max-queue-wait-ms", "10001"],
            ["--min-active-requests", "0"],
            ["--min-active-requests", "257"],
            ["--max-active-requests", "65537"],
            ["--worker-threads", "0"],
            ["--worker-threads", "257"],
        ] {
            let e = Config::refusal(&bad);
            assert!(e.contains(bad[0]), "{e}");
        }
    }

    #[test]
    fn the_bounds_flags_reach_their_configs_and_are_refused_out_of_range() {
        let c = Config::parse_from([
            "tally",
            "--max-index-entries",
            "7",
            "--max-header-bytes",
            "4096",
        ]);
        c.validate().unwrap();
        assert_eq!(c.projection().max_index_entries, 7);
        assert_eq!(c.max_header_bytes, 4096);
        let d = Config::defaults();
        assert_eq!(
            (d.projection().max_index_entries, d.max_header_bytes),
            (DEFAULT_MAX_INDEX_ENTRIES, DEFAULT_MAX_HEADER_BYTES)
        );
        for bad in [
            ["--max-index-entries", "0"],
            ["--max-header-bytes", "1023"],
            ["--max-header-bytes", "262145"],
        ] {
            let e = Config::refusal(&bad);
            assert!(e.contains(bad[0]), "{e}");
        }
    }

    /// Rule: every count and time flag has a named upper bound, refused by name past it
    /// (several size a semaphore, which would panic at start).
    #[test]
    fn every_count_and_time_flag_is_refused_past_its_bound_by_name() {
        let past = |n: u64| (n + 1).to_string();
        for (flag, value) in [
            (
                "--max-concurrent-requests",
                past(MAX_ACTIVE_REQUESTS as u64),
            ),
            ("--max-connections", past(MAX_CONNECTIONS as u64)),
            ("--max-connections", u64::MAX.to_string()),
            ("--max-live-writes", past(MAX_LIVE_WRITES as u64)),
            ("--max-live-writes", "0".into()),
            (
                "--max-queued-writes-per-account",
                past(MAX_ACTIVE_REQUESTS as u64),
            ),
            ("--max-batch-events", past(MAX_BATCH_EVENTS as u64)),
            (
                "--max-resident-accounts",
                past(MAX_RESIDENT_ACCOUNTS as u64),
            ),
            ("--max-index-entries", past(MAX_INDEX_ENTRIES as u64)),
            ("--write-deadline-ms", past(MAX_WRITE_DEADLINE_MS)),
            ("--write-deadline-ms", "0".into()),
            ("--write-max-attempts", past(MAX_WRITE_ATTEMPTS)),
            ("--idle-timeout-secs", past(MAX_IDLE_TIMEOUT_SECS)),
            ("--shutdown-grace-secs", past(MAX_SHUTDOWN_GRACE_SECS)),
            ("--watch-keepalive-secs", u64::MAX.to_string()),
            ("--rate-limit-per-caller", past(MAX_RATE_PER_CALLER.into())),
            ("--rate-limit-burst", u32::MAX.to_string()),
        ] {
            let e = Config::refusal(&[flag, &value, "--idempotency-window", "86400"]);
            assert!(e.contains(flag), "{flag} {value}: {e}");
        }
        let at_the_bounds = Config::parse_from([
            "tally",
            "--max-connections",
            &MAX_CONNECTIONS.to_string(),
            "--max-batch-events",
            &MAX_BATCH_EVENTS.to_string(),
            "--write-max-attempts",
            &MAX_WRITE_ATTEMPTS.to_string(),
            "--rate-limit-per-caller",
            &MAX_RATE_PER_CALLER.to_string(),
            "--rate-limit-burst",
            &MAX_RATE_PER_CALLER.to_string(),
        ]);
        at_the_bounds.validate().unwrap();
    }

    /// Rule: a write's whole life (deadline, plus the store request it may still have out)
    /// fits in the idempotency window, so what it wrote stays in the index while it looks.
    #[test]
    fn a_window_no_longer_than_a_writes_life_is_refused() {
        let c = Config::parse_from(["tally", "--idempotency-window", "5"]);
        let e = c.validate().expect_err("5 s window, 5 s deadline");
        assert!(e.to_string().contains("--idempotency-window"), "{e}");
        Config::parse_from(["tally", "--idempotency-window", "6"])
            .validate()
            .unwrap();
        // On Celeriant a last request may still be out for its own timeout (5 s).
        let celeriant = ["tally", "--store", "celeriant", "--idempotency-window"];
        let c = Config::parse_from([&celeriant[..], &["10"]].concat());
        assert!(c.validate().is_err(), "5 s deadline + 5 s request timeout");
        Config::parse_from([&celeriant[..], &["11"]].concat())
            .validate()
            .unwrap();
    }

    /// Rule: a stalled event stream ends itself (with a final event naming why) before the
    /// connection's write-stall limit closes it silently.
    #[test]
    fn a_write_stall_within_a_streams_own_stall_limit_is_refused() {
        let c = Config::parse_from(["tally", "--write-stall-secs", "30"]);
        let e = c.validate().expect_err("30 s is 2 x the 15 s keep-alive");
        assert!(e.to_string().contains("--write-stall-secs"), "{e}");
        Config::parse_from(["tally", "--write-stall-secs", "31"])
            .validate()
            .unwrap();
        Config::parse_from([
            "tally",
            "--write-stall-secs",
            "3",
            "--watch-keepalive-secs",
            "1",
        ])
        .validate()
        .unwrap();
    }

    /// Rule (issue 14): the Postgres projection needs its URL and sane pool settings; cursor
    /// and index are one setting, so no flag can split them.
    #[test]
    fn the_postgres_projection_flags_are_checked() {
        let ok = Config::parse_from([
            "tally",
            "--projection",
            "postgres",
            "--postgres-url",
            "postgres://h/db",
        ]);
        assert!(ok.validate().is_ok());
        let settings = ok.postgres().expect("postgres settings");
        assert_eq!(
            settings.pool_size,
            crate::projection::postgres::DEFAULT_POOL_SIZE
        );
        assert!(Config::defaults().postgres().is_none(), "memory by default");
        // On Postgres with a URL, one more flag and its value.
        let pg = |flag, value| {
            vec![
                "tally",
                "--projection",
                "postgres",
                "--postgres-url",
                "x",
                flag,
                value,
            ]
        };
        for bad in [
            vec!["tally", "--projection", "postgres"],
            vec!["tally", "--projection", "postgres", "--postgres-url", ""],
            pg("--postgres-pool-size", "0"),
            pg("--postgres-statement-timeout-ms", "0"),
            pg("--postgres-statement-timeout-ms", "2147483648"),
            vec!["tally", "--idempotency-scan-window", "86401"],
        ] {
            let e = Config::refusal(&bad[1..]);
            assert!(e.contains("--"), "{bad:?}: {e}");
        }
        let scan = Config::parse_from(["tally", "--idempotency-scan-window", "600"]);
        assert_eq!(
            scan.projection().scan_window,
            Some(Duration::from_secs(600))
        );
        assert_eq!(Config::defaults().projection().scan_window, None);
    }

    #[test]
    fn a_bad_fault_spec_is_refused_when_the_flags_are_parsed() {
        let e = Config::try_parse_from(["tally", "--faults", "lost-ack=2"])
            .expect_err("a probability above 1");
        let message = e.to_string();
        assert!(message.contains("--faults"), "{message}");
        assert!(message.contains("lost-ack=2"), "{message}");
    }

    #[test]
    fn a_fault_spec_is_parsed_once_into_its_config() {
        let c = Config::parse_from(["tally", "--faults", "refused=0.5,seed=7"]);
        let expected = FaultConfig {
            refused: 0.5,
            seed: 7,
            ..FaultConfig::default()
        };
        assert_eq!(c.faults, Some(expected));
    }
}
