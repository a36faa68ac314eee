//! The write side's flags: deadlines, attempts, the live-writes and per-account queue limits,
//! batching and group commit. Flattened into [`crate::config::Config`].

use clap::builder::RangedU64ValueParser;

use super::{
    DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BATCH_EVENTS, DEFAULT_MAX_LIVE_WRITES,
    DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT,
};
use crate::flag::count;
use crate::store::combine;

/// The most writes `--max-queued-writes-per-account` accepts. The HTTP edge's limits on
/// requests at once go no higher: one account's queue could take them all.
pub const MAX_QUEUED_WRITES_PER_ACCOUNT: usize = 65_536;
/// The most live writes `--max-live-writes` accepts.
pub const MAX_LIVE_WRITES: usize = 1 << 20;
/// The most operations `--max-batch-events` accepts in one store write.
pub const MAX_BATCH_EVENTS: usize = 4096;
/// The longest `--write-deadline-ms` accepted (ten minutes).
pub const MAX_WRITE_DEADLINE_MS: u64 = 600_000;
/// The most store writes `--write-max-attempts` accepts for one request.
pub const MAX_WRITE_ATTEMPTS: u64 = 1_000;

/// The write side's flags (one heading of `tally --help`). `--one-round-trip`, `--batching`
/// and the combining limits are hidden from `--help`: they are for measuring the design
/// (BENCHMARKS.md, "Flags for measuring the design").
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Writes")]
pub struct WriteFlags {
    /// How long one write may retry before a retryable 409, in ms.
    #[arg(long, env = "TALLY_WRITE_DEADLINE_MS", default_value_t = DEFAULT_DEADLINE.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1..=MAX_WRITE_DEADLINE_MS))]
    pub write_deadline_ms: u64,

    /// Turns of the write loop one request may take before a retryable 409.
    #[arg(long, env = "TALLY_WRITE_MAX_ATTEMPTS", default_value_t = DEFAULT_MAX_ATTEMPTS, value_parser = RangedU64ValueParser::<u32>::new().range(1..=MAX_WRITE_ATTEMPTS))]
    pub write_max_attempts: u32,

    /// Most requests alive on the write side at once; beyond it, 503.
    #[arg(long, env = "TALLY_MAX_LIVE_WRITES", default_value_t = DEFAULT_MAX_LIVE_WRITES, value_parser = count(MAX_LIVE_WRITES))]
    pub max_live_writes: usize,

    /// Most writes queued on one account; beyond it, a write waits for a place.
    #[arg(long, env = "TALLY_MAX_QUEUED_WRITES_PER_ACCOUNT", default_value_t = DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT, value_parser = count(MAX_QUEUED_WRITES_PER_ACCOUNT))]
    pub max_queued_writes_per_account: usize,

    /// The most operations written together in one batch.
    #[arg(long, env = "TALLY_MAX_BATCH_EVENTS", default_value_t = DEFAULT_MAX_BATCH_EVENTS, value_parser = count(MAX_BATCH_EVENTS))]
    pub max_batch_events: usize,

    /// Write at the local cursor first on a warm account (one store round trip), catching up
    /// only when the version guard says the fold was stale.
    #[arg(hide = true, long, env = "TALLY_ONE_ROUND_TRIP", default_value_t = true, action = clap::ArgAction::Set)]
    pub one_round_trip: bool,

    /// Batch single-account writes that queue on one account into one store write.
    #[arg(hide = true, long, env = "TALLY_BATCHING", default_value_t = true, action = clap::ArgAction::Set)]
    pub batching: bool,

    /// Send ready writes of different accounts as one store request (group commit).
    #[arg(long, env = "TALLY_COMBINE_WRITES", default_value_t = true, action = clap::ArgAction::Set)]
    pub combine_writes: bool,

    /// Store writes in flight at once while combining.
    #[arg(hide = true, long, env = "TALLY_COMBINE_MAX_IN_FLIGHT", default_value_t = combine::DEFAULT_MAX_IN_FLIGHT, value_parser = count(combine::MAX_IN_FLIGHT))]
    pub combine_max_in_flight: usize,

    /// The most accounts one combined store write carries.
    #[arg(hide = true, long, env = "TALLY_COMBINE_MAX_AGGREGATES", default_value_t = combine::DEFAULT_MAX_AGGREGATES, value_parser = count(combine::MAX_AGGREGATES))]
    pub combine_max_aggregates: usize,
}
