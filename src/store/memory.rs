//! An in-process event log with Celeriant's write and read semantics.
//!
//! Each aggregate sits behind its own mutex in a concurrent map, so reads and writes on
//! unrelated aggregates never contend. A multi-aggregate write locks its aggregates in key
//! order (no deadlock), checks every leg, and only then appends to all of them. No lock is
//! ever held across an `.await`: every method does its work synchronously.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use celeriant_msg::error_codes;
use dashmap::DashMap;
use parking_lot::{Mutex, MutexGuard};

use tokio::sync::broadcast;

use super::{
    AggregateDetails, AggregateKey, AggregateWrite, Batch, ClientId, Commit, EventLog, ReadFilter,
    ReadPage, StoreError, StoreResult, WatchFeed, WatchFilter, WatchItem,
};

/// Matching batches returned per read page unless [`MemoryOptions::page_size`] says otherwise.
pub const DEFAULT_PAGE_SIZE: usize = 1024;

/// Commits a watch may fall behind by before it reports a [`WatchItem::Gap`], unless
/// [`MemoryLog::with_watch_capacity`] says otherwise. Each slot holds one small [`Commit`].
pub const DEFAULT_WATCH_CAPACITY: usize = 4096;

/// Error code for a request the Celeriant wire cannot express (the same aggregate twice in
/// one write). Not a Celeriant code: the real server keys a write's legs by aggregate.
pub const DUPLICATE_AGGREGATE_CODE: u32 = 0;

/// The store's notion of "now", epoch milliseconds. Injectable so tests control time.
pub trait ServerTime: Send + Sync {
    /// Current server time, epoch milliseconds.
    fn now_ms(&self) -> u64;
}

/// The wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl ServerTime for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// The server's clock in tests: it moves only when told to. (Not the projection's
/// `ManualClock`, which is a replica's local clock.)
#[derive(Debug, Default)]
pub struct ServerClock {
    now_ms: AtomicU64,
}

impl ServerClock {
    /// A clock reading `start_ms`.
    pub fn new(start_ms: u64) -> Self {
        Self {
            now_ms: AtomicU64::new(start_ms),
        }
    }

    /// Sets the time (it may go backwards; the store still keeps timestamps non-decreasing).
    pub fn set(&self, ms: u64) {
        self.now_ms.store(ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`, saturating.
    pub fn advance(&self, ms: u64) {
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(ms))
            });
    }
}

impl ServerTime for ServerClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// How a [`MemoryLog`] is built.
#[derive(Clone)]
pub struct MemoryOptions {
    /// Most matching batches one read page returns; 0 is read as 1.
    pub page_size: usize,
    /// Source of server timestamps.
    pub clock: Arc<dyn ServerTime>,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            page_size: DEFAULT_PAGE_SIZE,
            clock: Arc::new(SystemClock),
        }
    }
}

/// One aggregate's state. `version == 0` means the aggregate does not exist (a placeholder
/// left by a create that failed its checks).
#[derive(Default)]
struct Aggregate {
    /// Batches from `min_available` to `version`, oldest first.
    batches: VecDeque<Batch>,
    /// Version of `batches[0]`, or `version + 1` when every batch was trimmed.
    min_available: u64,
    version: u64,
    last_server_timestamp_ms: u64,
    /// High-water mark of `client_seq` per client id. Never trimmed.
    marks: HashMap<ClientId, u64>,
}

impl Aggregate {
    fn exists(&self) -> bool {
        self.version > 0
    }

    fn details(&self) -> AggregateDetails {
        AggregateDetails {
            min_available_version: self.min_available.max(1),
            max_version: self.version,
            last_server_timestamp_ms: self.last_server_timestamp_ms,
        }
    }
}

type Slot = Arc<Mutex<Aggregate>>;

/// The in-process event log. Cheap to share behind an `Arc`.
pub struct MemoryLog {
    aggregates: DashMap<AggregateKey, Slot>,
    page_size: usize,
    clock: Arc<dyn ServerTime>,
    /// Every commit, for watches. Sent under the aggregate's lock, so one aggregate's
    /// commits go out in version order.
    commits: broadcast::Sender<Commit>,
}

impl Default for MemoryLog {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryLog {
    /// A log on the system clock with [`DEFAULT_PAGE_SIZE`].
    pub fn new() -> Self {
        Self::with_options(MemoryOptions::default())
    }

    /// A log with the given page size and clock.
    pub fn with_options(options: MemoryOptions) -> Self {
        Self {
            aggregates: DashMap::new(),
            page_size: options.page_size.max(1),
            clock: options.clock,
            commits: broadcast::channel(DEFAULT_WATCH_CAPACITY).0,
        }
    }

    /// The same log with room for `capacity` commits (0 is read as 1) before a watch that
    /// falls behind sees a [`WatchItem::Gap`]. Call before anyone watches.
    pub fn with_watch_capacity(mut self, capacity: usize) -> Self {
        self.commits = broadcast::channel(capacity.max(1)).0;
        self
    }

    /// Batches currently stored (not trimmed) for `key`; 0 for a missing aggregate.
    pub fn batch_count(&self, key: AggregateKey) -> usize {
        self.slot(key).map_or(0, |s| s.lock().batches.len())
    }

    /// The client-sequence high-water mark for (`key`, `client_id`), if any write set one.
    pub fn client_mark(&self, key: AggregateKey, client_id: ClientId) -> Option<u64> {
        self.slot(key)
            .and_then(|s| s.lock().marks.get(&client_id).copied())
    }

    fn slot(&self, key: AggregateKey) -> Option<Slot> {
        self.aggregates.get(&key).map(|e| Arc::clone(e.value()))
    }

    /// The synchronous body of [`EventLog::write`].
    pub fn write_now(
        &self,
        client_id: ClientId,
        mut writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        validate(&writes)?;

        // Existence, first pass: a missing aggregate that may not be created fails the whole
        // request before anything is locked. Slots are taken in key order.
        let mut order: Vec<usize> = (0..writes.len()).collect();
        order.sort_by_key(|&i| writes[i].key);
        let mut slots: Vec<Slot> = Vec::with_capacity(writes.len());
        for &i in &order {
            let w = &writes[i];
            let slot = if w.allow_create {
                Arc::clone(self.aggregates.entry(w.key).or_default().value())
            } else {
                self.slot(w.key).ok_or(StoreError::AggregateNotFound)?
            };
            slots.push(slot);
        }
        let mut guards: Vec<MutexGuard<'_, Aggregate>> = slots.iter().map(|s| s.lock()).collect();

        check(client_id, &writes, &order, &guards)?;

        // Every check passed: append to all.
        let now = self.clock.now_ms();
        let mut versions = vec![0; writes.len()];
        for (g, &i) in guards.iter_mut().zip(&order) {
            let w = &mut writes[i];
            let highest = w.highest_client_seq();
            let version = g.version + 1;
            let ts = now.max(g.last_server_timestamp_ms);
            if g.batches.is_empty() {
                g.min_available = version;
            }
            g.batches.push_back(Batch {
                version,
                client_id,
                server_timestamp_ms: ts,
                events: std::mem::take(&mut w.events).into(),
            });
            g.version = version;
            g.last_server_timestamp_ms = ts;
            if let Some(highest) = highest {
                let mark = g.marks.entry(client_id).or_insert(highest);
                *mark = (*mark).max(highest);
            }
            versions[i] = version;
            // No receiver is not an error: nobody watches.
            let _ = self.commits.send(Commit {
                key: w.key,
                version,
            });
        }
        Ok(versions)
    }

    /// The synchronous body of [`EventLog::read`].
    pub fn read_now(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let slot = self.slot(key).ok_or(StoreError::AggregateNotFound)?;
        let agg = slot.lock();
        if !agg.exists() {
            return Err(StoreError::AggregateNotFound);
        }
        let from = filter.from_version.max(1);
        let min_available = agg.min_available.max(1);
        if from < min_available {
            return Err(StoreError::Trimmed { min_available });
        }
        let last = filter
            .to_version
            .map_or(agg.version, |t| t.min(agg.version));
        let mut page = ReadPage::default();
        if from > last {
            return Ok(page);
        }
        let start = usize::try_from(from - min_available).unwrap_or(usize::MAX);
        // `from <= last <= version`, so `start` indexes a stored batch.
        for batch in agg.batches.range(start.min(agg.batches.len())..) {
            if batch.version > last {
                break;
            }
            if page.batches.len() == self.page_size {
                page.next_version = Some(batch.version);
                break;
            }
            if filter.admits(batch) {
                page.batches.push(batch.clone());
            }
        }
        Ok(page)
    }

    /// The synchronous body of [`EventLog::details`].
    pub fn details_now(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let slot = self.slot(key).ok_or(StoreError::AggregateNotFound)?;
        let agg = slot.lock();
        if !agg.exists() {
            return Err(StoreError::AggregateNotFound);
        }
        Ok(agg.details())
    }

    /// The synchronous body of [`EventLog::trim_start`].
    pub fn trim_start_now(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        let slot = self.slot(key).ok_or(StoreError::AggregateNotFound)?;
        let mut agg = slot.lock();
        if !agg.exists() {
            return Err(StoreError::AggregateNotFound);
        }
        // As on Celeriant: the newest batch is never trimmed, so keep-from is at most the
        // tip; a keep-from at or below the current minimum changes nothing.
        if keep_from_version > agg.version {
            return Err(StoreError::Other {
                code: error_codes::TRIM_INDEX_OUT_OF_RANGE,
                message: format!(
                    "keep-from version {keep_from_version} is beyond the tip {}",
                    agg.version
                ),
            });
        }
        while agg
            .batches
            .front()
            .is_some_and(|b| b.version < keep_from_version)
        {
            agg.batches.pop_front();
        }
        agg.min_available = agg.min_available.max(keep_from_version);
        Ok(())
    }
}

/// The checks of a write whose slots are locked (`guards[k]` is the aggregate of
/// `writes[order[k]]`), in Celeriant's order: existence, the version guard on every aggregate,
/// then client idempotency on every aggregate that enforces it, each judged by its own lowest
/// sequence against its own mark. The last two visit the aggregates in request order, so a
/// write failing on several names the first of them, as Celeriant's adapter does
/// (`check_order`); the server itself names whichever its hash order meets first.
fn check(
    client_id: ClientId,
    writes: &[AggregateWrite],
    order: &[usize],
    guards: &[MutexGuard<'_, Aggregate>],
) -> StoreResult<()> {
    // A slot may be a placeholder left by a create that failed its checks.
    if order
        .iter()
        .zip(guards)
        .any(|(&i, g)| !writes[i].allow_create && !g.exists())
    {
        return Err(StoreError::AggregateNotFound);
    }
    let mut guard_of = vec![0; writes.len()];
    for (at, &i) in order.iter().enumerate() {
        guard_of[i] = at;
    }
    for (w, &at) in writes.iter().zip(&guard_of) {
        let current = guards[at].version;
        if let Some(expected) = w.expected_version
            && expected != current
        {
            return Err(StoreError::Conflict { expected, current });
        }
    }
    for (w, &at) in writes.iter().zip(&guard_of) {
        if !w.enforce_client_idempotency {
            continue;
        }
        if let (Some(&mark), Some(lowest)) =
            (guards[at].marks.get(&client_id), w.lowest_client_seq())
            && lowest <= mark
        {
            return Err(StoreError::IdempotencyViolation {
                last_seq: Some(mark),
                attempted_seq: Some(lowest),
            });
        }
    }
    Ok(())
}

/// Request-level checks that come before any aggregate is looked at.
fn validate(writes: &[AggregateWrite]) -> StoreResult<()> {
    if writes.is_empty() {
        return Err(StoreError::Other {
            code: error_codes::WRITE_EMPTY_EVENTS_LIST,
            message: "a write must name at least one aggregate".into(),
        });
    }
    for w in writes {
        if w.events.is_empty() {
            return Err(StoreError::Other {
                code: error_codes::WRITE_EMPTY_EVENTS_LIST,
                message: format!("no events for aggregate {:?}", w.key),
            });
        }
        if w.events.iter().any(|e| e.event_type.major == 0) {
            return Err(StoreError::Other {
                code: error_codes::WRITE_ZERO_EVENT_TYPE,
                message: format!("event type major 0 is reserved (aggregate {:?})", w.key),
            });
        }
    }
    let mut keys: Vec<AggregateKey> = writes.iter().map(|w| w.key).collect();
    keys.sort_unstable();
    if let Some(pair) = keys.windows(2).find(|p| p[0] == p[1]) {
        return Err(StoreError::Other {
            code: DUPLICATE_AGGREGATE_CODE,
            message: format!("aggregate {:?} appears twice in one write", pair[0]),
        });
    }
    Ok(())
}

#[async_trait]
impl EventLog for MemoryLog {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.write_now(client_id, writes)
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.read_now(key, filter)
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.details_now(key)
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.trim_start_now(key, keep_from_version)
    }

    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        Ok(Box::new(MemoryFeed {
            commits: self.commits.subscribe(),
            filter,
        }))
    }
}

/// A watch on a [`MemoryLog`]: its commit broadcast, filtered.
struct MemoryFeed {
    commits: broadcast::Receiver<Commit>,
    filter: WatchFilter,
}

#[async_trait]
impl WatchFeed for MemoryFeed {
    async fn next(&mut self) -> StoreResult<WatchItem> {
        loop {
            match self.commits.recv().await {
                Ok(c) if self.filter.admits(&c.key) => return Ok(WatchItem::Commit(c)),
                Ok(_) => {}
                // Overwritten before this feed read them: say so, the reader resyncs.
                Err(broadcast::error::RecvError::Lagged(_)) => return Ok(WatchItem::Gap),
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(StoreError::shed("the store was dropped"));
                }
            }
        }
    }
}
