//! The projection's flags: where it lives and how much of it one replica holds.

use clap::ValueEnum;

use crate::config::count;
use crate::projection::{
    DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_INDEX_ENTRIES, DEFAULT_MAX_RESIDENT_ACCOUNTS,
};

/// The most accounts `--max-resident-accounts` accepts (a few hundred bytes each, folded).
pub const MAX_RESIDENT_ACCOUNTS: usize = 100_000_000;
/// The most recent-writes entries `--max-index-entries` accepts (about 100 bytes each).
pub const MAX_INDEX_ENTRIES: usize = 100_000_000;
/// The longest `--idle-timeout-secs` accepted (a week).
pub const MAX_IDLE_TIMEOUT_SECS: u64 = 7 * 86_400;
/// Where the projection lives. One setting for cursor and index together: the
/// half-shared configuration (a shared cursor with a per-replica index) double-writes, so
/// it cannot be configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProjectionKind {
    Memory,
    Postgres,
}

/// The most connections one replica's Postgres pool may hold.
pub const MAX_POSTGRES_POOL_SIZE: usize = 1024;
/// The longest `--postgres-statement-timeout-ms` accepted (ten minutes; Postgres itself
/// refuses a `statement_timeout` past 2^31 - 1 ms, and the replica would never get ready).
pub const MAX_POSTGRES_STATEMENT_TIMEOUT_MS: u64 = 600_000;

/// The projection's flags (the Postgres ones).
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Projection")]
pub struct ProjectionFlags {
    /// Where the projection lives: its cursor, balance, highest own sequence AND its
    /// recent-writes index, always together. `memory`: each replica folds the stream itself;
    /// `postgres`: one database shared by every replica (needs --postgres-url).
    #[arg(id = "projection", long = "projection", value_name = "PROJECTION_KIND", env = "TALLY_PROJECTION", value_enum, default_value_t = ProjectionKind::Memory)]
    pub kind: ProjectionKind,

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

    /// Most accounts kept folded in memory; the least recently used beyond it are dropped.
    #[arg(long, env = "TALLY_MAX_RESIDENT_ACCOUNTS", default_value_t = DEFAULT_MAX_RESIDENT_ACCOUNTS, value_parser = count(MAX_RESIDENT_ACCOUNTS))]
    pub max_resident_accounts: usize,

    /// Most recent-writes index entries this replica holds (over all its accounts); at the
    /// cap, new writes are refused with a retryable 503 until expiry frees room. Entries are
    /// never dropped early: the idempotency window stays whole.
    #[arg(long, env = "TALLY_MAX_INDEX_ENTRIES", default_value_t = DEFAULT_MAX_INDEX_ENTRIES, value_parser = count(MAX_INDEX_ENTRIES))]
    pub max_index_entries: usize,

    /// Drop an account from memory after this many idle seconds.
    #[arg(long, env = "TALLY_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(0..=MAX_IDLE_TIMEOUT_SECS))]
    pub idle_timeout_secs: u64,
}
