//! The projection's flags: where it lives and how much of it one replica holds.

use clap::ValueEnum;

use crate::flag::count;
use crate::projection::checkpoint_writer::{
    DEFAULT_CHECKPOINT_EVERY_EVENTS, DEFAULT_CHECKPOINT_IN_FLIGHT, DEFAULT_CHECKPOINT_INTERVAL,
};
use crate::projection::{
    CheckpointConfig, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_INDEX_ENTRIES,
    DEFAULT_MAX_RESIDENT_ACCOUNTS,
};
use std::time::Duration;

/// The most accounts `--max-resident-accounts` accepts (a few hundred bytes each, folded).
pub const MAX_RESIDENT_ACCOUNTS: usize = 100_000_000;
/// The most recent-writes entries `--max-index-entries` accepts (about 100 bytes each).
pub const MAX_INDEX_ENTRIES: usize = 100_000_000;
/// The longest `--idle-timeout-secs` accepted (a week).
pub const MAX_IDLE_TIMEOUT_SECS: u64 = 7 * 86_400;
/// The most events `--checkpoint-every-events` accepts between checkpoints.
pub const MAX_CHECKPOINT_EVERY_EVENTS: u64 = 100_000_000;
/// The longest `--checkpoint-interval-secs` accepted (a week).
pub const MAX_CHECKPOINT_INTERVAL_SECS: u64 = 7 * 86_400;
/// The most checkpoints one replica writes at once (`--checkpoint-in-flight`).
pub const MAX_CHECKPOINT_IN_FLIGHT: usize = 64;
/// The longest `--retain-history-secs` accepted (ten years).
pub const MAX_RETAIN_HISTORY_SECS: u64 = 10 * 366 * 86_400;
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
    /// Where the projection (cursor, balance and recent-writes index, together) lives.
    #[arg(id = "projection", long = "projection", value_name = "PROJECTION_KIND", env = "TALLY_PROJECTION", value_enum, default_value_t = ProjectionKind::Memory)]
    pub kind: ProjectionKind,

    /// The Postgres projection's database URL. Never logged.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub postgres_url: Option<String>,

    /// Connections in this replica's Postgres pool.
    #[arg(long, env = "TALLY_POSTGRES_POOL_SIZE", default_value_t = crate::projection::postgres::DEFAULT_POOL_SIZE, value_parser = count(MAX_POSTGRES_POOL_SIZE))]
    pub postgres_pool_size: usize,

    /// The longest a Postgres statement, or a wait for a connection, may take, in ms.
    #[arg(long, env = "TALLY_POSTGRES_STATEMENT_TIMEOUT_MS", default_value_t = crate::projection::postgres::DEFAULT_STATEMENT_TIMEOUT.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..=MAX_POSTGRES_STATEMENT_TIMEOUT_MS))]
    pub postgres_statement_timeout_ms: u64,

    /// Most accounts kept folded in memory; the least recently used go first.
    #[arg(long, env = "TALLY_MAX_RESIDENT_ACCOUNTS", default_value_t = DEFAULT_MAX_RESIDENT_ACCOUNTS, value_parser = count(MAX_RESIDENT_ACCOUNTS))]
    pub max_resident_accounts: usize,

    /// Most recent-writes index entries on this replica; at the cap, new writes get a 503.
    #[arg(long, env = "TALLY_MAX_INDEX_ENTRIES", default_value_t = DEFAULT_MAX_INDEX_ENTRIES, value_parser = count(MAX_INDEX_ENTRIES))]
    pub max_index_entries: usize,

    /// Drop an account from memory after this many idle seconds.
    #[arg(long, env = "TALLY_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(0..=MAX_IDLE_TIMEOUT_SECS))]
    pub idle_timeout_secs: u64,

    /// Events past an account's last checkpoint that call for the next (0: never write).
    #[arg(long, env = "TALLY_CHECKPOINT_EVERY_EVENTS", default_value_t = DEFAULT_CHECKPOINT_EVERY_EVENTS, value_parser = clap::value_parser!(u64).range(0..=MAX_CHECKPOINT_EVERY_EVENTS))]
    pub checkpoint_every_events: u64,

    /// Or once this many seconds passed since the last one (with at least 100 events past it).
    #[arg(long, env = "TALLY_CHECKPOINT_INTERVAL_SECS", default_value_t = DEFAULT_CHECKPOINT_INTERVAL.as_secs(), value_parser = clap::value_parser!(u64).range(1..=MAX_CHECKPOINT_INTERVAL_SECS))]
    pub checkpoint_interval_secs: u64,

    /// Checkpoints this replica writes at once.
    #[arg(long, env = "TALLY_CHECKPOINT_IN_FLIGHT", default_value_t = DEFAULT_CHECKPOINT_IN_FLIGHT, value_parser = count(MAX_CHECKPOINT_IN_FLIGHT))]
    pub checkpoint_in_flight: usize,

    /// Trim history older than the window plus this many seconds. Unset: never trim.
    #[arg(long, env = "TALLY_RETAIN_HISTORY_SECS", value_parser = clap::value_parser!(u64).range(0..=MAX_RETAIN_HISTORY_SECS))]
    pub retain_history_secs: Option<u64>,
}

impl ProjectionFlags {
    /// The checkpoint writer's and retention's settings.
    pub fn checkpoints(&self) -> CheckpointConfig {
        CheckpointConfig {
            every_events: self.checkpoint_every_events,
            interval: Duration::from_secs(self.checkpoint_interval_secs),
            in_flight: self.checkpoint_in_flight,
            retain_history: self.retain_history_secs.map(Duration::from_secs),
        }
    }
}
