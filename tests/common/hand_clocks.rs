//! Clocks a test moves by hand: an embedded store on a server clock, and replicas on local
//! clocks of their own, for the rules that age writes past the window or the retention.
//!
//! Server time ages what a replica reads back from the store. A replica's own clock ages
//! what it wrote itself. A test that ages both moves both.

use std::sync::Arc;

use tally::account::Identity;
use tally::metrics::Metrics;
use tally::projection::{ManualClock, Projection, ProjectionConfig};
use tally::store::SharedLog;
use tally::store::memory::{DEFAULT_PAGE_SIZE, MemoryLog, MemoryOptions, ServerClock};

use super::{TestApp, spawn, test_config};

/// The server time a store starts at when the test needs no particular one.
pub const SERVER_START_MS: u64 = 1_000_000;

/// An embedded store whose server clock starts at `start_ms` and moves only when the test
/// moves it, with the default read page.
pub fn store_at(start_ms: u64) -> (Arc<ServerClock>, Arc<MemoryLog>) {
    paged_store_at(start_ms, DEFAULT_PAGE_SIZE)
}

/// [`store_at`] with at most `page_size` batches a read page, for the rules about reads
/// that take several pages.
pub fn paged_store_at(start_ms: u64, page_size: usize) -> (Arc<ServerClock>, Arc<MemoryLog>) {
    let server = Arc::new(ServerClock::new(start_ms));
    let log = Arc::new(MemoryLog::with_options(MemoryOptions {
        page_size,
        clock: server.clone(),
    }));
    (server, log)
}

/// A memory-fold replica over `log` with metrics of its own, whose local clock stands at 0:
/// the ages it sees come from server time alone.
pub fn replica(log: SharedLog, identity: Identity, config: ProjectionConfig) -> Projection {
    Projection::new(
        log,
        identity,
        config,
        Arc::new(ManualClock::new(0)),
        Arc::new(Metrics::new()),
    )
}

/// An instance over `store` with `flags`, on a local clock at 0 that the test moves.
pub async fn spawn_on_hand_clock(flags: &[&str], store: SharedLog) -> (TestApp, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0));
    let app = spawn(test_config(flags), Some(store), Some(clock.clone())).await;
    (app, clock)
}
