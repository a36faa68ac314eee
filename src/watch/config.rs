//! The watch's limits, each a named constant and a flag.

use std::time::Duration;

use crate::flag::usize_in;

/// Watch streams (both routes together) one replica serves at once, unless configured.
/// An open stream costs a task, two small channels and a connection (measured in
/// BENCHMARKS.md, the watch rows); the connection cap (`--max-connections`) bounds it too.
pub const DEFAULT_MAX_SUBSCRIBERS: usize = 2048;
/// Streams on one account at once, unless configured: a hot account cannot take every slot.
pub const DEFAULT_MAX_PER_ACCOUNT: usize = 256;
/// Streams one authenticated caller (`sub`) holds on one replica at once, unless configured:
/// one caller cannot take every slot from the others. A console holds two (the fleet-wide
/// stream and one account's); the rest is room for a client's own streams and reconnects.
pub const DEFAULT_MAX_PER_CALLER: usize = 32;
/// Seconds a caller over `--watch-max-per-caller` is told to wait (`Retry-After`): a slot
/// comes back only when one of its own streams closes, so retrying at once cannot help.
pub const CALLER_FULL_RETRY_AFTER_SECS: u64 = 10;
/// Batches buffered for one subscriber before it counts as fallen behind, unless configured.
/// Beyond it the subscriber gets a final `lagged` event and is closed: never an unbounded
/// buffer. It resumes with `Last-Event-ID`.
pub const DEFAULT_BUFFER: usize = 256;
/// Seconds between keep-alive comments on an idle stream, unless configured: under the
/// usual 60 s proxy idle timeout, with room for one lost.
pub const DEFAULT_KEEPALIVE_SECS: u64 = 15;
/// Versions a resume may replay from the store, unless configured: a resume point further
/// below the stream's version is refused (400 `RESUME_TOO_FAR_BACK`) before the stream
/// starts, and the client reads that range from the history API. A replay reads its range
/// once and holds it (the balance before it is the joined balance minus what it added), so
/// this bounds a replay's store reads and its memory alike: on Celeriant, 8 windows of 512
/// versions.
pub const DEFAULT_MAX_REPLAY: usize = 4096;
/// Keep-alive intervals a stream's client may go without taking anything sent to it (its
/// connection's buffers full: it stopped reading) before the stream gives up on it and
/// releases its place. Its buffer alone cannot tell: a stream with no writes fills it only
/// with keep-alives. 30 s with the default keep-alive.
pub const STALL_KEEPALIVES: u32 = 2;
/// The accepted range of each count flag (its parser's).
pub const COUNT_RANGE: std::ops::RangeInclusive<usize> = 1..=1_000_000;
/// The accepted range of `--watch-keepalive-secs`.
pub const KEEPALIVE_RANGE: std::ops::RangeInclusive<u64> = 1..=300;

/// The watch's flags.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Watch")]
pub struct WatchConfig {
    /// Watch streams this replica serves at once; beyond it, 503.
    #[arg(long = "watch-max-subscribers", env = "TALLY_WATCH_MAX_SUBSCRIBERS", default_value_t = DEFAULT_MAX_SUBSCRIBERS, value_parser = usize_in(COUNT_RANGE))]
    pub max_subscribers: usize,

    /// Watch streams on one account at once; beyond it, 503.
    #[arg(long = "watch-max-per-account", env = "TALLY_WATCH_MAX_PER_ACCOUNT", default_value_t = DEFAULT_MAX_PER_ACCOUNT, value_parser = usize_in(COUNT_RANGE))]
    pub max_per_account: usize,

    /// With `--auth jwt`: watch streams one caller holds on this replica; beyond it, 429.
    #[arg(long = "watch-max-per-caller", env = "TALLY_WATCH_MAX_PER_CALLER", default_value_t = DEFAULT_MAX_PER_CALLER, value_parser = usize_in(COUNT_RANGE))]
    pub max_per_caller: usize,

    /// Batches buffered for one watch stream; further behind, it is closed as lagged.
    #[arg(long = "watch-buffer", env = "TALLY_WATCH_BUFFER", default_value_t = DEFAULT_BUFFER, value_parser = usize_in(COUNT_RANGE))]
    pub buffer: usize,

    /// Versions a resume may replay; a resume from further back is refused (400).
    #[arg(long = "watch-max-replay", env = "TALLY_WATCH_MAX_REPLAY", default_value_t = DEFAULT_MAX_REPLAY, value_parser = usize_in(COUNT_RANGE))]
    pub max_replay: usize,

    /// Seconds between keep-alive comments on an idle watch stream.
    #[arg(long = "watch-keepalive-secs", env = "TALLY_WATCH_KEEPALIVE_SECS", default_value_t = DEFAULT_KEEPALIVE_SECS, value_parser = clap::value_parser!(u64).range(KEEPALIVE_RANGE))]
    pub keepalive_secs: u64,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            max_subscribers: DEFAULT_MAX_SUBSCRIBERS,
            max_per_account: DEFAULT_MAX_PER_ACCOUNT,
            max_per_caller: DEFAULT_MAX_PER_CALLER,
            buffer: DEFAULT_BUFFER,
            max_replay: DEFAULT_MAX_REPLAY,
            keepalive_secs: DEFAULT_KEEPALIVE_SECS,
        }
    }
}

impl WatchConfig {
    pub fn keepalive(&self) -> Duration {
        Duration::from_secs(self.keepalive_secs)
    }

    /// How long one item may wait for a client that takes nothing ([`STALL_KEEPALIVES`]).
    pub fn stall_limit(&self) -> Duration {
        self.keepalive() * STALL_KEEPALIVES
    }
}
