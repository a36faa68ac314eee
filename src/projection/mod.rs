//! The per-account in-memory fold: balance, stream cursor, the highest client sequence this
//! service wrote, and the recent-writes index, all moved together under one lock per
//! account.
//!
//! The colocation rule: whoever advances an account's cursor indexes the events it passes in
//! the same critical section, because catch-up never replays an event behind the cursor.
//! The fold does it for events it replays; the write path does it for its own write before
//! (or as) it bumps the cursor.

//!
//! Files: `state` (one account's state and the fold), `anchor` (the estimate of the server's
//! now that ages index entries), `regress` (a store that went backwards), `sweep` (bounded memory: expiry, idle and capacity
//! eviction), `index` (the recent-writes index), `clock` (the local monotonic clock),
//! `port` (what the write loop and the reader call, over either backend), `postgres` (the
//! Postgres backend: cursor and index shared by the fleet in one database), `checkpoint`
//! (an account's state at a landed version, which a cold fold starts from) and
//! `checkpoint_writer` (who writes one and when, and retention's trim below one).
//!
//! Two backends, chosen together as one setting ([`Backend`]): the memory fold above, where
//! each replica folds the stream itself, and Postgres, where cursor and index are rows of one
//! shared database. There is no way to mix them (a shared cursor with a per-replica index
//! would double-write; see docs/postgres.md).

mod anchor;
pub mod checkpoint;
pub mod checkpoint_writer;
pub mod clock;
pub mod config;
mod existed;
pub mod index;
mod port;
pub mod postgres;
mod regress;
mod scan;
mod state;
mod sweep;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::account::{AccountEvent, AccountId, Identity};
use crate::metrics::Metrics;
use crate::store::{Batch, BatchStream, ReadFilter, SharedLog, StoreError};
pub use anchor::SERVER_CLOCK_RESYNC;
pub use checkpoint::{CHECKPOINT_TAIL, Checkpoint};
pub use checkpoint_writer::{CheckpointConfig, TrimReport};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use index::{RecentIndex, RecentWrite};
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

#[derive(Clone, Copy, Debug)]
pub struct ProjectionConfig {
    pub window: Duration,
    pub max_resident_accounts: usize,
    pub idle_timeout: Duration,
    /// See [`DEFAULT_MAX_INDEX_ENTRIES`] and [`Projection::check_index_room`].
    pub max_index_entries: usize,
    /// Scan on miss: how far back in server time a request the index misses is
    /// looked for in the account's own batches. `None`: off. See [`Projection::scan_for`].
    pub scan_window: Option<Duration>,
    /// When checkpoints are written, and how history is retained (`checkpoint_writer.rs`).
    pub checkpoints: CheckpointConfig,
}

impl Default for ProjectionConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            max_resident_accounts: DEFAULT_MAX_RESIDENT_ACCOUNTS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_index_entries: DEFAULT_MAX_INDEX_ENTRIES,
            scan_window: None,
            checkpoints: CheckpointConfig::default(),
        }
    }
}

/// A new write refused because the replica-wide recent-writes index is at its cap.
/// Retryable: expiry frees room within the window, and another replica may have room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the recent-writes index holds {entries} entries, at its cap of {cap}")]
pub struct IndexFull {
    pub entries: usize,
    pub cap: usize,
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
    evict_signal: tokio::sync::Notify,
    /// Accounts evicted while they held events: a first touch reads them first.
    existed: existed::Existed,
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
        Self {
            log,
            identity,
            config,
            clock,
            metrics,
            accounts: DashMap::default(),
            server_offset_ms: AtomicI64::new(i64::MIN),
            index_entries: AtomicI64::new(0),
            evict_signal: tokio::sync::Notify::new(),
            existed: existed::Existed::default(),
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

    /// The account's newest version as the store itself gives it (its details call), 0 for
    /// an account it does not have. One round trip; what a version beyond it means is the
    /// caller's (a Celeriant server was found to hide a new account from this call too:
    /// docs/stores.md, "A create the server hides").
    pub async fn store_version(&self, account: AccountId) -> Result<u64, StoreError> {
        match self.log.details(self.identity.key(account)).await {
            Ok(d) => Ok(d.max_version),
            Err(StoreError::AggregateNotFound) => Ok(0),
            Err(e) => Err(e),
        }
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

    pub fn resident_accounts(&self) -> usize {
        self.accounts.len()
    }

    /// The account's slot, loading an empty (cold) one if it is not resident.
    pub fn slot(&self, account: AccountId) -> Arc<AccountSlot> {
        if let Some(slot) = self.accounts.get(&account) {
            return slot.clone();
        }
        let slot = self.accounts.entry(account).or_default().clone();
        let resident = self.accounts.len();
        self.metrics.resident_accounts.set(resident as i64);
        if resident > self.config.max_resident_accounts {
            self.evict_signal.notify_one();
        }
        slot
    }

    /// The slot only if the account is resident.
    pub fn resident_slot(&self, account: AccountId) -> Option<Arc<AccountSlot>> {
        self.accounts.get(&account).map(|s| s.clone())
    }

    /// The resident account's slot and state when its fold can answer without a store read:
    /// caught up at least once since it was loaded, and not broken.
    pub fn warm_snapshot(&self, account: AccountId) -> Option<(Arc<AccountSlot>, Snapshot)> {
        if self.rows_refused().is_some() {
            return None; // Postgres, after the store went backwards: only `pg_load` answers
        }
        let slot = self.resident_slot(account)?;
        let st = slot.state.lock();
        let snap = (st.warm && st.broken.is_none()).then(|| st.snapshot());
        drop(st);
        snap.map(|snap| (slot, snap))
    }

    /// Reads the account's stream from its cursor and folds what is new. Returns the slot
    /// and the state after the fold. The memory fold's own catch-up: callers that serve
    /// either backend go through [`Projection::refresh`].
    ///
    /// # Panics
    /// On the Postgres backend, whose slots are warm copies with server-time expiry: a
    /// memory fold there would mark a copy complete with entries aged on the local clock,
    /// and a lookup could then miss a live key.
    pub async fn catch_up(
        &self,
        account: AccountId,
    ) -> Result<(Arc<AccountSlot>, Snapshot), ProjectionError> {
        assert!(
            matches!(self.backend, Backend::Memory),
            "the memory fold's catch-up called on the {} projection",
            self.backend_name()
        );
        let slot = self.slot(account);
        let (mut from, generation, cold) = {
            let st = slot.state.lock();
            check_broken(account, &st)?;
            (st.version + 1, st.generation, st.version == 0 && !st.warm)
        };
        // Whether a trim met by this fold is a verdict (see `start_from_checkpoint`).
        let mut definitive = true;
        if cold {
            (from, definitive) = self
                .start_from_checkpoint(account, &slot, generation, None)
                .await;
        }
        let started = Instant::now();
        let mut stream = BatchStream::new(
            self.log.as_ref(),
            self.identity.key(account),
            ReadFilter::from_version(from),
        );
        let mut first_page = true;
        let mut tried_checkpoint = false;
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available }) if !tried_checkpoint => {
                    // Behind a trim (a cold fold whose pick lay below it, or a replica that held
                    // the account from before it): go on from a checkpoint at or above it.
                    tried_checkpoint = true;
                    let next;
                    (next, definitive) = self
                        .start_from_checkpoint(account, &slot, generation, Some(min_available))
                        .await;
                    if next >= min_available {
                        stream = BatchStream::new(
                            self.log.as_ref(),
                            self.identity.key(account),
                            ReadFilter::from_version(next),
                        );
                        first_page = true;
                    }
                    continue;
                }
                Err(StoreError::Trimmed { min_available }) => {
                    self.met_trim(account, &slot, generation, min_available, definitive)?;
                    // Our cursor moved past the trim meanwhile: what we have is whole.
                    break;
                }
                Err(e) => return Err(ProjectionError::Store(e)),
            };
            let Some(last) = page.last() else { continue };
            self.observe_server_time(last.server_timestamp_ms);
            if first_page && stream.has_more() {
                // A long catch-up: age its early pages against the stream's real tip, not
                // against their own last batch, or long-expired entries would come back.
                // One extra call, only for reads longer than a page.
                if let Ok(d) = self.log.details(self.identity.key(account)).await {
                    self.observe_server_time(d.last_server_timestamp_ms);
                }
            }
            first_page = false;
            self.fold_page(account, &slot, generation, &page)?;
        }
        self.metrics
            .catchup_duration
            .observe(started.elapsed().as_secs_f64());
        let now = self.now_ms();
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        st.warm = true;
        st.last_touch_ms = now;
        let expired = st.recent.evict_expired(now);
        self.add_index_entries(-(expired as i64));
        let snap = st.snapshot();
        drop(st);
        Ok((slot, snap))
    }

    /// Folds one page a catch-up read into the account's state, in the generation it was
    /// read for.
    fn fold_page(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        page: &[Batch],
    ) -> Result<(), ProjectionError> {
        let ctx = self.fold_context();
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        let before = st.recent.len();
        let result = st.fold(page, &ctx);
        self.add_index_entries(st.recent.len() as i64 - before as i64);
        match result {
            Ok(applied) => {
                self.metrics.events_folded.inc_by(applied);
                self.note_progress(account, &mut st, applied);
                Ok(())
            }
            Err(broken) => {
                self.metrics.poisoned_accounts.inc();
                st.broken = Some(Box::new(broken));
                Err(broken_error(account, &st))
            }
        }
    }

    /// A catch-up met a trim it cannot go on from. Below the cursor it is a verdict when the
    /// checkpoints could be read (the account is broken as trimmed), else retryable; at or
    /// above it (the cursor moved past the trim meanwhile) nothing is missing.
    fn met_trim(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        min_available: u64,
        definitive: bool,
    ) -> Result<(), ProjectionError> {
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        if st.version + 1 < min_available && !definitive {
            return Err(ProjectionError::Store(StoreError::NotApplied {
                reason: format!(
                    "the stream is trimmed below version {min_available} and its checkpoints could not be read; retry"
                ),
            }));
        }
        if st.version + 1 < min_available {
            self.metrics.poisoned_accounts.inc();
            st.broken = Some(Box::new(Broken::Trimmed { min_available }));
        }
        check_broken(account, &st)
    }

    /// The fold context for a fold starting now.
    pub fn fold_context(&self) -> FoldContext {
        FoldContext {
            client_id: self.identity.client(),
            window_ms: self.window_ms(),
            tip_ms: self.server_tip_ms(),
            now_ms: self.now_ms(),
        }
    }

    /// Records this replica's own successful write to one account: index entries first (or
    /// in the same critical section), then the cursor bump, which never moves backwards and
    /// only happens when the write applied on top of the state we hold. Entries written
    /// here get the full window: this replica never re-folds its own event, so this entry is
    /// the only record it will have.
    pub fn record_write(&self, slot: &AccountSlot, write: &RecordedWrite<'_>) {
        let expires_at_ms = self.now_ms().saturating_add(self.window_ms());
        self.apply_own_write(&mut slot.state.lock(), write, expires_at_ms);
    }

    /// [`Projection::record_write`] on `account`, then the checkpoint count: the write's
    /// events are past the account's checkpoint when the cursor took them.
    pub(crate) fn record_own_write(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        write: &RecordedWrite<'_>,
    ) {
        let expires_at_ms = self.now_ms().saturating_add(self.window_ms());
        let mut st = slot.state.lock();
        self.apply_own_write(&mut st, write, expires_at_ms);
        if st.version == write.new_version && st.generation == write.generation {
            self.note_progress(account, &mut st, write.events.len() as u64);
        }
    }

    /// One own write on a held state (the memory fold's, or a Postgres warm copy): its
    /// index entries, expiring at `expires_at_ms`, then the cursor bump when the write
    /// applied on top of this state.
    fn apply_own_write(
        &self,
        st: &mut AccountState,
        write: &RecordedWrite<'_>,
        expires_at_ms: u64,
    ) {
        // A fold dropped since the write was decided (the store went backwards under it,
        // `regress.rs`) may stand at the expected version again, read from the new store,
        // and the write may have landed on either store: nothing of it is recorded here. If
        // it landed on the store there is now, a retry's conflict and catch-up fold it from
        // there, index entry included.
        if st.generation != write.generation {
            return;
        }
        let before = st.recent.len();
        for &(event_id, balance, event) in write.events {
            // The run that wrote it answers from its own success, never from this entry.
            let w = RecentWrite {
                balance,
                version: write.new_version,
                expires_at_ms,
                event,
                write_tag: None,
            };
            st.recent.insert(event_id, w);
        }
        if st.version == write.expected_version && st.broken.is_none() {
            st.version = write.new_version;
            st.balance = write.balance_after;
            st.max_client_seq = st.max_client_seq.max(write.max_client_seq);
            // Applied at version 0: the stream held nothing before it, so this state is
            // the whole fold (a first touch's write leaves the account warm).
            st.warm |= write.expected_version == 0;
        }
        st.last_touch_ms = self.now_ms();
        self.add_index_entries(st.recent.len() as i64 - before as i64);
    }

    /// Recent-writes index entries over every resident account. Entries that expired since
    /// their account was last swept or caught up still count, so this runs ahead of the
    /// live count by at most one sweep interval's expiries, never behind it.
    pub fn index_entries(&self) -> usize {
        usize::try_from(self.index_entries.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Whether the replica-wide recent-writes index holds its cap or more.
    pub fn index_full(&self) -> bool {
        self.index_entries() >= self.config.max_index_entries
    }

    /// The write side's admission check for a NEW write (one the index cannot answer):
    /// `Err` while the index is full, counted on `tally_writes_refused_index_full_total`;
    /// answer it with a retryable 503.
    ///
    /// The cap bounds memory by refusing writes, never by dropping entries: an entry
    /// expired early would let a retry inside the stated window write twice. So nothing
    /// else stops at the cap: a write already admitted indexes its events, and a fold
    /// indexes every event it replays inside the window (the colocation rule), which
    /// includes other replicas' writes. The count can therefore pass the cap, by the writes
    /// in flight when it was reached plus what catch-ups replay.
    ///
    /// On Postgres the index is the database's table, and the entries counted here are the
    /// warm copies', which stop growing before the cap (`postgres/warm.rs`): never refused.
    pub fn check_index_room(&self) -> Result<(), IndexFull> {
        let entries = self.index_entries();
        if entries < self.config.max_index_entries || self.uses_database() {
            return Ok(());
        }
        self.metrics.writes_refused_index_full.inc();
        Err(IndexFull {
            entries,
            cap: self.config.max_index_entries,
        })
    }

    fn add_index_entries(&self, delta: i64) {
        if delta != 0 {
            let n = self.index_entries.fetch_add(delta, Ordering::Relaxed) + delta;
            self.metrics.index_entries.set(n);
        }
    }
}

/// A successful write to one account, as the write loop hands it to the projection.
pub struct RecordedWrite<'a> {
    pub expected_version: u64,
    /// The generation of the fold the write was decided on ([`Snapshot::generation`]).
    pub generation: u64,
    pub new_version: u64,
    /// The balance after the whole batch.
    pub balance_after: i64,
    pub max_client_seq: u64,
    /// (event id, balance right after that event, the event), in write order.
    pub events: &'a [(u128, i64, AccountEvent)],
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
        None => ProjectionError::Poisoned {
            account,
            version: st.version,
            reason: "unknown".into(),
        },
    }
}

/// Whether the account's fold is still the generation a catch-up read for. One dropped in
/// place meanwhile (`regress.rs`): what was read belongs to the old one, and folding it would
/// look like a gap, so the catch-up is retried from the new one.
fn same_fold(st: &AccountState, generation: u64) -> Result<(), ProjectionError> {
    if st.generation == generation {
        Ok(())
    } else {
        Err(ProjectionError::Store(Projection::dropped_during_catch_up()))
    }
}

#[cfg(test)]
mod catch_up_tests {
    use super::*;
    use crate::account::AccountEvent;
    use crate::store::memory::{MemoryLog, MemoryOptions, ServerClock};
    use crate::store::{AggregateWrite, Event};
    use uuid::Uuid;

    const WINDOW_MS: u64 = 90_000;

    async fn deposit(log: &MemoryLog, identity: &Identity, account: AccountId, seq: u64) {
        let e = AccountEvent::Deposited { amount: 1 };
        let w = AggregateWrite {
            key: identity.key(account),
            events: vec![Event {
                client_seq: seq,
                event_id: Some(u128::from(seq)),
                event_type: e.event_type(),
                payload: e.encode(),
                timestamp_ms: 0,
            }],
            expected_version: Some(seq - 1),
            allow_create: true,
            enforce_client_idempotency: true,
        };
        log.write_now(identity.client(), vec![w]).expect("write");
    }

    fn capped(log: Arc<MemoryLog>, cap: usize, clock: Arc<ManualClock>) -> Projection {
        Projection::new(
            log,
            Identity::default(),
            ProjectionConfig {
                window: Duration::from_millis(WINDOW_MS),
                max_index_entries: cap,
                ..ProjectionConfig::default()
            },
            clock,
            Arc::new(Metrics::new()),
        )
    }

    /// Rule: at the cap the index refuses new writes (counted) and keeps every entry for its
    /// whole window; expiry, not the cap, is what frees room.
    #[test]
    fn at_the_index_cap_new_writes_are_refused_until_expiry_frees_room() {
        let clock = Arc::new(ManualClock::new(0));
        let projection = capped(Arc::new(MemoryLog::new()), 3, clock.clone());
        let metrics = projection.metrics().clone();
        assert_eq!(metrics.index_entries_cap.get(), 3);
        let slot = projection.slot(AccountId(Uuid::new_v4()));
        let deposit = AccountEvent::Deposited { amount: 1 };
        projection.record_write(
            &slot,
            &RecordedWrite {
                expected_version: 0,
                generation: 0,
                new_version: 1,
                balance_after: 2,
                max_client_seq: 2,
                events: &[(1, 1, deposit), (2, 2, deposit)],
            },
        );
        assert_eq!(projection.check_index_room(), Ok(()));
        projection.record_write(
            &slot,
            &RecordedWrite {
                expected_version: 1,
                generation: 0,
                new_version: 2,
                balance_after: 3,
                max_client_seq: 3,
                events: &[(3, 3, deposit)],
            },
        );
        assert!(projection.index_full());
        assert_eq!(
            projection.check_index_room(),
            Err(IndexFull { entries: 3, cap: 3 })
        );
        assert_eq!(metrics.writes_refused_index_full.get(), 1);
        // Full, and still answering every entry until the end of its window.
        clock.advance_ms(WINDOW_MS - 1);
        projection.sweep();
        assert!(projection.index_full());
        for id in 1..=3 {
            assert!(
                slot.state.lock().recent.get(id, clock.now_ms()).is_some(),
                "{id}"
            );
        }
        assert!(projection.check_index_room().is_err());
        assert_eq!(metrics.writes_refused_index_full.get(), 2);
        clock.advance_ms(1);
        projection.sweep();
        assert_eq!(projection.index_entries(), 0);
        assert_eq!(projection.check_index_room(), Ok(()));
        assert_eq!(metrics.writes_refused_index_full.get(), 2);
    }

    /// Rule (colocation): the fold indexes every event it replays inside the window, cap or
    /// no cap, so the count may pass the cap; only new writes are refused.
    #[tokio::test]
    async fn the_fold_indexes_everything_it_replays_even_past_the_cap() {
        let log = Arc::new(MemoryLog::new());
        let identity = Identity::default();
        let account = AccountId(Uuid::new_v4());
        for seq in 1..=5 {
            deposit(&log, &identity, account, seq).await;
        }
        let projection = capped(log, 2, Arc::new(ManualClock::new(0)));
        let (slot, snap) = projection.catch_up(account).await.expect("catch-up");
        assert_eq!(snap.version, 5);
        assert_eq!(projection.index_entries(), 5);
        assert!(projection.index_full());
        assert_eq!(projection.metrics().index_entries.get(), 5);
        let st = slot.state.lock();
        for seq in 1..=5u64 {
            assert!(st.recent.get(u128::from(seq), 0).is_some(), "event {seq}");
        }
    }

    /// Rule: a replayed batch's age is measured against the newest server time, even when a
    /// cold replica reads the stream in several pages (each page's own tip is older).
    #[tokio::test]
    async fn a_cold_multi_page_catch_up_never_revives_entries_older_than_the_window() {
        let server = Arc::new(ServerClock::new(1_000_000));
        let log = Arc::new(MemoryLog::with_options(MemoryOptions {
            page_size: 3,
            clock: server.clone(),
        }));
        let identity = Identity::default();
        let account = AccountId(Uuid::new_v4());
        for seq in 1..=6 {
            deposit(&log, &identity, account, seq).await;
        }
        server.advance(WINDOW_MS + 1_000);
        for seq in 7..=9 {
            deposit(&log, &identity, account, seq).await;
        }
        let projection = Projection::new(
            log,
            identity,
            ProjectionConfig {
                window: Duration::from_millis(WINDOW_MS),
                ..ProjectionConfig::default()
            },
            Arc::new(ManualClock::new(0)),
            Arc::new(Metrics::new()),
        );
        let (slot, snap) = projection.catch_up(account).await.expect("catch-up");
        assert_eq!((snap.balance, snap.version), (9, 9));
        let st = slot.state.lock();
        for seq in 1..=6u64 {
            assert!(
                st.recent.get(u128::from(seq), 0).is_none(),
                "event {seq} is older than the window and must not answer"
            );
        }
        for seq in 7..=9u64 {
            assert!(st.recent.get(u128::from(seq), 0).is_some(), "event {seq}");
        }
    }
}
