//! The per-account in-memory fold: balance, stream cursor, the highest client sequence this
//! service wrote, and the recent-writes index, all moved together under one lock per
//! account.
//!
//! The colocation rule: whoever advances an account's cursor indexes the events it passes in
//! the same critical section, because catch-up never replays an event behind the cursor.
//! The fold does it for events it replays; the write path does it for its own write before
//! (or as) it bumps the cursor.

pub mod clock;
pub mod index;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use parking_lot::Mutex;

use crate::account::{AccountEvent, AccountId, Identity, fold};
use crate::metrics::Metrics;
use crate::store::{
    AggregateWrite, Batch, BatchStream, Event, EventType, ReadFilter, SharedLog, StoreError,
};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use index::{RecentIndex, RecentWrite};

/// How long a write's response stays answerable from the index, unless configured.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(90);
/// The most accounts one replica keeps folded in memory, unless configured.
pub const DEFAULT_MAX_RESIDENT_ACCOUNTS: usize = 1_000_000;
/// An account untouched this long is dropped from memory (it is re-folded on demand).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How many more accounts than the cap an eviction pass removes, as a fraction of the cap,
/// so passes do not run on every insert.
const EVICTION_SLACK_DIVISOR: usize = 100;
/// How many batches ahead of the one being folded the fold prefetches payloads (and twice
/// as far, events).
const FOLD_LOOKAHEAD: usize = 8;
/// The event type of a server-clock probe (in the clock aggregate, never in an account).
const SERVER_CLOCK_PROBE_EVENT: EventType = EventType { major: 1, minor: 0 };
/// How often a replica re-anchors its estimate of the server's now. Between anchors the
/// estimate runs on the local monotonic clock, so this bounds how long a clock rate error or
/// a server clock step can skew index lifetimes.
pub const SERVER_CLOCK_RESYNC: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
pub struct ProjectionConfig {
    pub window: Duration,
    pub max_resident_accounts: usize,
    pub idle_timeout: Duration,
}

impl Default for ProjectionConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            max_resident_accounts: DEFAULT_MAX_RESIDENT_ACCOUNTS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
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
}

/// Why a fold stopped; kept on the account so every later request answers the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Broken {
    Poisoned { version: u64, reason: String },
    Trimmed { min_available: u64 },
}

/// A consistent view of one account at one version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub balance: i64,
    pub version: u64,
    pub max_client_seq: u64,
}

/// What the fold needs besides the batches.
#[derive(Clone, Copy, Debug)]
pub struct FoldContext {
    /// Only batches of this client id raise the account's max client sequence.
    pub client_id: u128,
    pub window_ms: u64,
    /// The server's now as this replica estimates it ([`Projection::server_tip_ms`]).
    pub tip_ms: u64,
    /// Local monotonic now.
    pub now_ms: u64,
}

/// One account's folded state.
#[derive(Default)]
pub struct AccountState {
    pub balance: i64,
    /// The stream cursor: the last version folded.
    pub version: u64,
    /// The highest client sequence of this service's own batches.
    pub max_client_seq: u64,
    /// Caught up from the store at least once since it was loaded.
    pub warm: bool,
    pub broken: Option<Box<Broken>>,
    pub recent: RecentIndex,
    pub last_touch_ms: u64,
}

impl AccountState {
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            balance: self.balance,
            version: self.version,
            max_client_seq: self.max_client_seq,
        }
    }

    /// Folds `batches` in order, skipping any at or behind the cursor, and indexes every
    /// event of a batch younger than the window. A batch's age is measured in server time
    /// against the fold's tip; only the remaining lifetime runs on the local clock.
    /// Returns how many events were applied. On an event it cannot apply, the state stays
    /// at the last whole batch and the reason is returned.
    pub fn fold(&mut self, batches: &[Batch], ctx: &FoldContext) -> Result<u64, Broken> {
        // Server time never decreases along a stream, so the batches young enough to index
        // are a suffix: make room for them once instead of growing the index as it fills.
        let old = batches
            .partition_point(|b| ctx.tip_ms.saturating_sub(b.server_timestamp_ms) >= ctx.window_ms);
        if old < batches.len() {
            self.recent.reserve(batches.len() - old);
        }
        let mut applied = 0u64;
        // Records are appended as the fold goes and indexed in one pass when `index` drops,
        // on every return path.
        let mut index = self.recent.bulk();
        for (at, batch) in batches.iter().enumerate() {
            // Each batch's events sit in their own allocation, and each payload in another:
            // prefetch them a few batches ahead, so the fold does not wait on a cache miss or
            // two per batch.
            if let Some(b) = batches.get(at + 2 * FOLD_LOOKAHEAD) {
                // An event spans two cache lines; its allocation need not start on one.
                let first = b.events.as_ptr().cast::<u8>();
                index::prefetch(first);
                index::prefetch(first.wrapping_add(64));
            }
            if let Some(e) = batches
                .get(at + FOLD_LOOKAHEAD)
                .and_then(|b| b.events.first())
            {
                index::prefetch(e.payload.as_ptr());
            }
            if batch.version <= self.version {
                continue;
            }
            if batch.version != self.version + 1 {
                return Err(Broken::Poisoned {
                    version: batch.version,
                    reason: format!(
                        "gap in the stream: expected version {}, read {}",
                        self.version + 1,
                        batch.version
                    ),
                });
            }
            let age = ctx.tip_ms.saturating_sub(batch.server_timestamp_ms);
            let expires = (age < ctx.window_ms).then(|| ctx.now_ms + (ctx.window_ms - age));
            let own = batch.client_id == ctx.client_id;
            let mut balance = self.balance;
            let mut max_seq = self.max_client_seq;
            for e in batch.events.iter() {
                let event = AccountEvent::decode(e.event_type, &e.payload).map_err(|err| {
                    Broken::Poisoned {
                        version: batch.version,
                        reason: err.to_string(),
                    }
                })?;
                balance = fold::apply(balance, &event).map_err(|err| Broken::Poisoned {
                    version: batch.version,
                    reason: err.to_string(),
                })?;
                if own && e.client_seq > max_seq {
                    max_seq = e.client_seq;
                }
                if let (Some(expires_at_ms), Some(eid)) = (expires, e.event_id) {
                    index.push(
                        eid,
                        RecentWrite {
                            balance,
                            version: batch.version,
                            expires_at_ms,
                            event,
                        },
                    );
                }
            }
            self.balance = balance;
            self.max_client_seq = max_seq;
            self.version = batch.version;
            applied += batch.events.len() as u64;
        }
        Ok(applied)
    }
}

/// One resident account: its state under a short, synchronous lock (never held across an
/// `.await`), and the gate that serialises this replica's writes to it.
#[derive(Default)]
pub struct AccountSlot {
    pub state: Mutex<AccountState>,
    /// Held by the one task writing this account from this replica.
    pub(crate) gate: tokio::sync::Mutex<()>,
    /// Single-account operations waiting to be written together.
    pub(crate) queue: Mutex<Vec<crate::write_loop::Queued>>,
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    pub index_entries_expired: usize,
    pub evicted_idle: usize,
    pub evicted_capacity: usize,
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
}

impl Projection {
    pub fn new(
        log: SharedLog,
        identity: Identity,
        config: ProjectionConfig,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Self {
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
        }
    }

    pub fn log(&self) -> &SharedLog {
        &self.log
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

    pub fn window_ms(&self) -> u64 {
        u64::try_from(self.config.window.as_millis()).unwrap_or(u64::MAX)
    }

    /// The server's now as this replica can vouch for it: the newest server time observed,
    /// run on by the local monotonic clock since. 0 before any observation (every batch is
    /// then as young as can be).
    pub fn server_tip_ms(&self) -> u64 {
        let offset = self.server_offset_ms.load(Ordering::Acquire);
        if offset == i64::MIN {
            return 0;
        }
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        u64::try_from(now.saturating_add(offset)).unwrap_or(0)
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

    /// Reads the account's stream from its cursor and folds what is new. Returns the slot
    /// and the state after the fold.
    pub async fn catch_up(
        &self,
        account: AccountId,
    ) -> Result<(Arc<AccountSlot>, Snapshot), ProjectionError> {
        let slot = self.slot(account);
        let from = {
            let st = slot.state.lock();
            check_broken(account, &st)?;
            st.version + 1
        };
        let started = Instant::now();
        let mut stream = BatchStream::new(
            self.log.as_ref(),
            self.identity.key(account),
            ReadFilter::from_version(from),
        );
        let mut first_page = true;
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available }) => {
                    let mut st = slot.state.lock();
                    if st.version + 1 < min_available {
                        self.metrics.poisoned_accounts.inc();
                        st.broken = Some(Box::new(Broken::Trimmed { min_available }));
                    }
                    check_broken(account, &st)?;
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
            let ctx = self.fold_context();
            let mut st = slot.state.lock();
            let before = st.recent.len();
            let result = st.fold(&page, &ctx);
            self.add_index_entries(st.recent.len() as i64 - before as i64);
            match result {
                Ok(applied) => self.metrics.events_folded.inc_by(applied),
                Err(broken) => {
                    self.metrics.poisoned_accounts.inc();
                    st.broken = Some(Box::new(broken));
                    return Err(broken_error(account, &st));
                }
            }
        }
        self.metrics
            .catchup_duration
            .observe(started.elapsed().as_secs_f64());
        let now = self.now_ms();
        let mut st = slot.state.lock();
        st.warm = true;
        st.last_touch_ms = now;
        let expired = st.recent.evict_expired(now);
        self.add_index_entries(-(expired as i64));
        let snap = st.snapshot();
        drop(st);
        Ok((slot, snap))
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

    /// Raises the replica's server-time tip: the server's now was at least `ts_ms` at this
    /// local moment.
    pub fn observe_server_time(&self, ts_ms: u64) {
        let ts = i64::try_from(ts_ms).unwrap_or(i64::MAX);
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        self.server_offset_ms
            .fetch_max(ts.saturating_sub(now), Ordering::AcqRel);
    }

    /// Anchors the server-time tip to the server's now: writes one probe event to the
    /// service's clock aggregate and reads back its commit time. Without an anchor, a replica
    /// that has seen no newer batch would take an idle account's last batch as "now", and
    /// revive its expired index entries when it folds it.
    ///
    /// The anchor *replaces* the estimate (reads in between only raise it), so an estimate
    /// that ran ahead of the server (a server clock stepped back, a local clock running fast)
    /// is corrected at the next anchor: the caller repeats this every
    /// [`SERVER_CLOCK_RESYNC`]. Returns the commit time read.
    pub async fn sync_server_clock(&self) -> Result<u64, StoreError> {
        let key = self.identity.server_clock_key();
        let probe = AggregateWrite {
            key,
            events: vec![Event {
                // Not an idempotent write: it may land twice, and that is harmless.
                client_seq: 0,
                event_id: None,
                event_type: SERVER_CLOCK_PROBE_EVENT,
                payload: Bytes::from_static(b"{}"),
                timestamp_ms: 0,
            }],
            expected_version: None,
            allow_create: true,
            enforce_client_idempotency: false,
        };
        let version = self
            .log
            .write(self.identity.client(), vec![probe])
            .await?
            .first()
            .copied()
            .unwrap_or(0);
        let details = self.log.details(key).await?;
        // Measured after the read: the offset is a lower bound, by about the probe's round
        // trip, so entries may outlive their window by that much but are never cut short.
        let ts = i64::try_from(details.last_server_timestamp_ms).unwrap_or(i64::MAX);
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        self.server_offset_ms
            .store(ts.saturating_sub(now), Ordering::Release);
        // Only the newest probe matters: keep the aggregate at one batch.
        if version > 1
            && let Err(e) = self.log.trim_start(key, version).await
        {
            tracing::debug!(error = %e, "could not trim the server-clock aggregate");
        }
        Ok(details.last_server_timestamp_ms)
    }

    /// Records this replica's own successful write to one account: index entries first (or
    /// in the same critical section), then the cursor bump, which never moves backwards and
    /// only happens when the write applied on top of the state we hold. Entries written
    /// here get the full window: this replica never re-folds its own event, so this entry is
    /// the only record it will have.
    pub fn record_write(&self, slot: &AccountSlot, write: &RecordedWrite<'_>) {
        let now = self.now_ms();
        let expires_at_ms = now.saturating_add(self.window_ms());
        let mut st = slot.state.lock();
        let before = st.recent.len();
        for &(event_id, balance, event) in write.events {
            st.recent.insert(
                event_id,
                RecentWrite {
                    balance,
                    version: write.new_version,
                    expires_at_ms,
                    event,
                },
            );
        }
        if st.version == write.expected_version && st.broken.is_none() {
            st.version = write.new_version;
            st.balance = write.balance_after;
            st.max_client_seq = st.max_client_seq.max(write.max_client_seq);
        }
        st.last_touch_ms = now;
        self.add_index_entries(st.recent.len() as i64 - before as i64);
    }

    fn add_index_entries(&self, delta: i64) {
        if delta != 0 {
            let n = self.index_entries.fetch_add(delta, Ordering::Relaxed) + delta;
            self.metrics.index_entries.set(n);
        }
    }

    /// Expires index entries of every resident account, drops accounts idle past the idle
    /// timeout, and evicts the least recently touched ones above the cap. Accounts in use
    /// (a request holds their slot) are never dropped.
    pub fn sweep(&self) -> SweepStats {
        let now = self.now_ms();
        let idle_ms = u64::try_from(self.config.idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let mut stats = SweepStats::default();
        let mut idle = Vec::new();
        let mut touched = Vec::new();
        let over_cap = self
            .accounts
            .len()
            .saturating_sub(self.config.max_resident_accounts);
        for entry in self.accounts.iter() {
            let Some(mut st) = entry.value().state.try_lock() else {
                continue;
            };
            stats.index_entries_expired += st.recent.evict_expired(now);
            if now.saturating_sub(st.last_touch_ms) >= idle_ms {
                idle.push(*entry.key());
            } else if over_cap > 0 {
                touched.push((st.last_touch_ms, *entry.key()));
            }
        }
        self.add_index_entries(-(stats.index_entries_expired as i64));
        for account in idle {
            if self.evict(account) {
                stats.evicted_idle += 1;
            }
        }
        let excess = self
            .accounts
            .len()
            .saturating_sub(self.config.max_resident_accounts);
        if excess > 0 {
            let target = (excess + self.config.max_resident_accounts / EVICTION_SLACK_DIVISOR)
                .min(touched.len());
            if target > 0 && target < touched.len() {
                touched.select_nth_unstable(target);
            }
            for &(_, account) in touched.iter().take(target) {
                if self.evict(account) {
                    stats.evicted_capacity += 1;
                }
            }
        }
        self.metrics
            .evictions
            .with_label_values(&["idle"])
            .inc_by(stats.evicted_idle as u64);
        self.metrics
            .evictions
            .with_label_values(&["capacity"])
            .inc_by(stats.evicted_capacity as u64);
        self.metrics
            .resident_accounts
            .set(self.accounts.len() as i64);
        stats
    }

    /// Drops an account that no request is using.
    fn evict(&self, account: AccountId) -> bool {
        let removed = self
            .accounts
            .remove_if(&account, |_, slot| Arc::strong_count(slot) == 1);
        if let Some((_, slot)) = &removed {
            let n = slot.state.lock().recent.len();
            self.add_index_entries(-(n as i64));
        }
        removed.is_some()
    }

    /// Runs [`Projection::sweep`] every `interval`, and at once when the cap is exceeded,
    /// until `shutdown` resolves.
    pub async fn run_sweeper(
        self: Arc<Self>,
        interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(interval) => {}
                _ = self.evict_signal.notified() => {}
            }
            let this = self.clone();
            // A sweep walks every resident account; keep it off the async workers.
            let _ = tokio::task::spawn_blocking(move || this.sweep()).await;
        }
    }
}

/// A successful write to one account, as the write loop hands it to the projection.
pub struct RecordedWrite<'a> {
    pub expected_version: u64,
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

fn broken_error(account: AccountId, st: &AccountState) -> ProjectionError {
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
