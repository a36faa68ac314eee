//! The per-account in-memory fold: balance, stream cursor, the highest client sequence this
//! service wrote, and the recent-writes index, all moved together under one lock per
//! account.
//!
//! The colocation rule: whoever advances an account's cursor indexes the events it passes in
//! the same critical section, because catch-up never replays an event behind the cursor.
//! The fold does it for events it replays; the write path does it for its own write before
//! (or as) it bumps the cursor.
//!
//! Files: this one (the projection's configuration, errors and the [`Projection`] itself),
//! `resident` (the map of resident accounts and the warm snapshot), `catch_up` (the memory
//! fold's catch-up, page by page; its tests in `catch_up_tests`), `own_write` (recording this
//! replica's own writes), `index_room` (the replica-wide entry count and its cap), `state`
//! (one account's state and the fold), `anchor` (the estimate of the server's now that ages
//! index entries), `regress` (a store that went backwards), `sweep` (bounded memory: expiry,
//! idle and capacity eviction), `index` (the recent-writes index), `clock` (the local
//! monotonic clock), `port` (what the write loop and the reader call, over either backend),
//! `postgres` (the Postgres backend: cursor and index shared by the fleet in one database),
//! `checkpoint` (an account's state at a landed version, which a cold fold starts from) and
//! `checkpoint_writer` (who writes one and when, and retention's trim below one).
//!
//! Two backends, chosen together as one setting ([`Backend`]): the memory fold above, where
//! each replica folds the stream itself, and Postgres, where cursor and index are rows of one
//! shared database. There is no way to mix them (a shared cursor with a per-replica index
//! would double-write; see docs/postgres.md).

mod anchor;
mod catch_up;
#[cfg(test)]
mod catch_up_tests;
pub mod checkpoint;
pub mod checkpoint_writer;
pub mod clock;
mod cold_start;
pub mod config;
mod existed;
mod holds;
#[cfg(test)]
mod holds_tests;
pub mod index;
mod index_room;
mod key_chain;
pub mod keys;
mod own_write;
mod port;
pub mod postgres;
mod regress;
mod remember;
mod remembered;
mod resident;
mod scan;
mod state;
mod sweep;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::time::Duration;

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::account::{AccountId, Identity};
use crate::metrics::Metrics;
use crate::store::{SharedLog, StoreError};
pub use anchor::SERVER_CLOCK_RESYNC;
pub use checkpoint::{CHECKPOINT_TAIL, Checkpoint};
pub use checkpoint_writer::{CheckpointConfig, TrimReport};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use holds::HoldView;
pub use index::{RecentIndex, RecentWrite};
pub use index_room::IndexFull;
pub use own_write::RecordedWrite;
pub use port::{AccountView, Loaded, Recorded};
pub use postgres::{PgProjection, PostgresSettings};
pub use scan::{SCAN_MAX_PAGES, SCAN_MAX_VERSIONS, ScanHit};
pub use state::{AccountState, Broken, CheckpointMark, FoldContext, MAX_OWN_CLIENT_SEQ, Snapshot};
pub use sweep::SweepStats;

/// How long a write's response stays answerable from the index, unless configured.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(90);
/// The most accounts one replica keeps folded in memory, unless configured.
pub const DEFAULT_MAX_RESIDENT_ACCOUNTS: usize = 1_000_000;
/// An account untouched this long is dropped from memory (it is re-folded on demand).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// The recent-writes index entries one replica holds (over all its accounts) before the
/// write side refuses new writes, unless configured.
///
/// Sized from measured memory: an entry costs 74-126 bytes on an account holding hundreds of
/// them, about 130 at ten per account, and 520 when it is its account's only one (an
/// account's first entry brings the index's fixed part); a transfer leg 16-64 bytes more.
/// 10k single-account writes/s over the 90 s window is 0.9 M entries, 10k transfers/s (two
/// legs each) 1.8 M: 3 M leaves the 80% alert above both, at about 225-400 MB when
/// accounts hold a few entries or more.
pub const DEFAULT_MAX_INDEX_ENTRIES: usize = 3_000_000;

/// How long a landed write's key is remembered past the window, unless configured.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(86_400);
/// The keys one account remembers past the window, unless configured: a day of a write every
/// 0.1 s, about 12 MB.
pub const DEFAULT_MAX_KEYS_PER_ACCOUNT: usize = 1_000_000;
/// The keys one replica remembers past the window over all its accounts, unless configured:
/// a day of 185 writes/s, about 200 MB at 12-13 bytes a key.
pub const DEFAULT_MAX_KEYS: usize = 16_000_000;
/// The most either key cap accepts.
pub const MAX_KEYS: usize = 1_000_000_000;

#[derive(Clone, Copy, Debug)]
pub struct ProjectionConfig {
    pub window: Duration,
    /// How long a landed write's key is remembered (at least the window): past the window,
    /// in the account's key memory (`keys/`).
    pub retention: Duration,
    /// Most keys one account's key memory holds; the oldest go first.
    pub max_keys_per_account: usize,
    /// Most keys this replica's key memories hold together; the oldest go first.
    pub max_keys: usize,
    pub max_resident_accounts: usize,
    pub idle_timeout: Duration,
    /// See [`DEFAULT_MAX_INDEX_ENTRIES`] and [`Projection::check_index_room`].
    pub max_index_entries: usize,
    /// Scan on miss: how far back in server time a request the index misses is
    /// looked for in the account's own batches. `None`: off. See [`Projection::scan_for`].
    pub scan_window: Option<Duration>,
    /// When checkpoints are written, and how history is retained (`checkpoint_writer.rs`).
    pub checkpoints: CheckpointConfig,
    /// Holds are on (`--holds`): the fold keeps each account's holds. Off, a hold event
    /// stops an account's fold.
    pub holds: bool,
}

impl Default for ProjectionConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            retention: DEFAULT_RETENTION,
            max_keys_per_account: DEFAULT_MAX_KEYS_PER_ACCOUNT,
            max_keys: DEFAULT_MAX_KEYS,
            max_resident_accounts: DEFAULT_MAX_RESIDENT_ACCOUNTS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_index_entries: DEFAULT_MAX_INDEX_ENTRIES,
            scan_window: None,
            checkpoints: CheckpointConfig::default(),
            holds: false,
        }
    }
}

/// Why an account cannot be answered from its fold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProjectionError {
    /// An event in the stream could not be decoded or applied. Nothing after it is folded.
    #[error("account {account} is unreadable at version {version}: {reason}")]
    Poisoned {
        account: AccountId,
        version: u64,
        reason: String,
    },
    /// The stream was trimmed above this replica's cursor, so the balance cannot be derived.
    #[error(
        "account {account} stream is trimmed below version {min_available}; its balance cannot be folded"
    )]
    Trimmed {
        account: AccountId,
        min_available: u64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The Postgres projection's database failed a statement (down, timed out, refused):
    /// nothing was applied, so retryable. The detail is logged where it happened and never
    /// answered to a client.
    #[error("the projection database did not answer; retry shortly")]
    Database,
    /// The account's stream holds a hold event and this replica runs with holds off.
    #[error(
        "account {account} has holds (a hold event at version {version}), and this replica runs with --holds false: it cannot state the account's balance; send the request to a replica with holds on"
    )]
    HoldsOff { account: AccountId, version: u64 },
}

/// One resident account: its state under a short, synchronous lock (never held across an
/// `.await`). The projection knows nothing about writes: the write side serialises its own
/// writes to an account in its own lanes.
#[derive(Default)]
pub struct AccountSlot {
    pub state: Mutex<AccountState>,
}

/// Every resident account of this replica.
pub struct Projection {
    log: SharedLog,
    identity: Identity,
    config: ProjectionConfig,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    accounts: DashMap<AccountId, Arc<AccountSlot>, foldhash::fast::RandomState>,
    /// The reference for batch ages: (server timestamp - local monotonic now) as of the last
    /// anchor, raised by every larger one observed since, so that local now + this estimates
    /// the server's now without running ahead of it (a batch's timestamp is never later than
    /// the server's now when it is read), as long as the two clocks run at the same rate.
    /// `i64::MIN` until the first observation.
    server_offset_ms: AtomicI64,
    index_entries: AtomicI64,
    /// Keys in the key memories of every resident account (`remember.rs`).
    remembered_keys: AtomicI64,
    evict_signal: tokio::sync::Notify,
    /// Accounts evicted while they held events: a first touch reads them first.
    existed: existed::Existed,
    /// Accounts with open holds that expire, resident or not, and the earliest server time
    /// one may fall due (`holds.rs`): where the hold sweeper looks.
    expiring: holds::Expiring,
    /// The version the last server-clock probe landed at, and the highest one the store
    /// checks have seen (`regress.rs`).
    probe_version: AtomicU64,
    anchor_version: AtomicU64,
    /// The store's epoch as this replica last saw it (`regress.rs`).
    store_epoch: Mutex<Option<u128>>,
    /// How many store checks have finished (`regress.rs`), for whoever waits on one.
    store_checks: tokio::sync::watch::Sender<u64>,
    /// Postgres only: the store went backwards under the shared rows (`regress.rs`); no row
    /// is served again until an operator has reconciled them and restarted the replica.
    rows_ahead_of_store: AtomicBool,
    /// Where cursor and index live. Under Postgres the memory fold's map holds the warm
    /// copies of rows (`postgres/warm.rs`).
    backend: Backend,
    /// Accounts due a checkpoint, for the writer task (`checkpoint_writer.rs`).
    checkpoint_queue: checkpoint_writer::Queue,
}

/// The projection backend: both the cursor and the recent-writes index live in it.
pub enum Backend {
    /// Each replica folds the stream itself, in memory.
    Memory,
    /// Every replica shares one database's rows.
    Postgres(PgProjection),
}

impl Projection {
    pub fn new(
        log: SharedLog,
        identity: Identity,
        config: ProjectionConfig,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics
            .index_entries_cap
            .set(i64::try_from(config.max_index_entries).unwrap_or(i64::MAX));
        metrics
            .remembered_keys_cap
            .set(i64::try_from(config.max_keys).unwrap_or(i64::MAX));
        Self {
            log,
            identity,
            config,
            clock,
            metrics,
            accounts: DashMap::default(),
            server_offset_ms: AtomicI64::new(i64::MIN),
            index_entries: AtomicI64::new(0),
            remembered_keys: AtomicI64::new(0),
            evict_signal: tokio::sync::Notify::new(),
            existed: existed::Existed::default(),
            expiring: holds::Expiring::default(),
            probe_version: AtomicU64::new(0),
            anchor_version: AtomicU64::new(0),
            store_epoch: Mutex::new(None),
            store_checks: tokio::sync::watch::Sender::new(0),
            rows_ahead_of_store: AtomicBool::new(false),
            backend: Backend::Memory,
            checkpoint_queue: checkpoint_writer::Queue::default(),
        }
    }

    /// A projection on the Postgres backend (connected and migrated by the caller).
    pub fn with_postgres(
        log: SharedLog,
        identity: Identity,
        config: ProjectionConfig,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        pg: PgProjection,
    ) -> Self {
        Self {
            backend: Backend::Postgres(pg),
            ..Self::new(log, identity, config, clock, metrics)
        }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The backend's name, as `--projection` spells it.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Memory => "memory",
            Backend::Postgres(_) => "postgres",
        }
    }

    pub fn log(&self) -> &SharedLog {
        &self.log
    }

    /// The account's newest version as the store's leader holds it
    /// ([`crate::store::EventLog::leader_tip`]), 0 for an account it does not have. One
    /// round trip. A follower's word would do for a retryable answer, but the callers give
    /// final ones (a 400 beyond the tip, a 404 for an account never opened), and a
    /// follower that lags would make them wrong.
    pub async fn store_version(&self, account: AccountId) -> Result<u64, StoreError> {
        self.log
            .leader_tip(self.identity.client(), self.identity.key(account))
            .await
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn config(&self) -> &ProjectionConfig {
        &self.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The epoch time the write loop stamps its events with (see [`Clock::epoch_ms`]).
    pub fn event_time_ms(&self) -> u64 {
        self.clock.epoch_ms()
    }

    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.config.window.as_millis()).unwrap_or(u64::MAX)
    }
}

fn check_broken(account: AccountId, st: &AccountState) -> Result<(), ProjectionError> {
    if st.broken.is_some() {
        return Err(broken_error(account, st));
    }
    Ok(())
}

pub(crate) fn broken_error(account: AccountId, st: &AccountState) -> ProjectionError {
    match st.broken.as_deref() {
        Some(Broken::Trimmed { min_available }) => ProjectionError::Trimmed {
            account,
            min_available: *min_available,
        },
        Some(Broken::Poisoned { version, reason }) => ProjectionError::Poisoned {
            account,
            version: *version,
            reason: reason.clone(),
        },
        Some(Broken::HoldsOff { version }) => ProjectionError::HoldsOff {
            account,
            version: *version,
        },
        None => ProjectionError::Poisoned {
            account,
            version: st.version,
            reason: "unknown".into(),
        },
    }
}
