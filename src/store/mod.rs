//! The event-log port: the one interface the rest of Tally talks to.
//!
//! Two implementations live beside it: [`memory::MemoryLog`], an in-process store with
//! Celeriant's write and read semantics, and `celeriant::CeleriantLog`, the production
//! backend. [`faults::FaultyLog`] decorates either with seeded, deterministic faults.
//!
//! The semantics every implementation must honour (and that `tests/store/conformance.rs` pins):
//! - a write is checked in this order, for the whole request: aggregate existence
//!   (`allow_create`), the version guard on every aggregate, then client idempotency on every
//!   aggregate that enforces it (rejected when that aggregate's own lowest `client_seq` in
//!   the write is at or below its (aggregate, client id) high-water mark: each member of a
//!   multi-aggregate write is judged by its own sequences, not the request's). Only then is
//!   anything appended, to all aggregates or to none;
//! - a rejection names one member's numbers, never the member: a conflict reports the first
//!   stale member in request order, an idempotency violation one violating member's pair;
//! - the high-water mark moves on every write that lands, enforced or not, to each member's
//!   own highest sequence (a rejected write moves no mark), and survives `trim_start`;
//! - one write to one aggregate appends one batch, which is one version;
//! - reads below the trim point fail with [`StoreError::Trimmed`]; a read past the tip is
//!   empty; filters apply to whole batches;
//! - a watch ([`EventLog::watch`]) reports every write committed after it was opened, by any
//!   writer, as (aggregate, new version), each aggregate's in version order; when it cannot
//!   vouch that nothing was missed it says so with [`WatchItem::Gap`], never silently.

pub mod celeriant;
pub mod combine;
pub mod config;
pub mod faults;
pub mod health;
pub mod memory;
pub mod metered;
pub mod probe;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

/// Wall-clock now, epoch milliseconds: what a writer stamps on an event as its client-side
/// timestamp ([`Event::timestamp_ms`]). Informational only, so the wall clock is fine here;
/// nothing that ages or orders anything reads it.
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A writer's identity as Celeriant sees it. Names the service, never a replica or a request.
pub type ClientId = u128;

/// Celeriant's three-part aggregate key. Tally uses one org and one aggregate type; the
/// account id is the aggregate id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AggregateKey {
    pub org_id: u128,
    pub aggregate_type_id: u128,
    pub aggregate_id: u128,
}

impl fmt::Debug for AggregateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:032x}/{:032x}/{:032x}",
            self.org_id, self.aggregate_type_id, self.aggregate_id
        )
    }
}

/// An event type: Celeriant's (major, minor) pair. Major 0 is reserved by the server.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct EventType {
    pub major: u64,
    pub minor: u64,
}

/// One event as written and as read back.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Event {
    /// The writer's per-(aggregate, client id) sequence: Celeriant's idempotency key.
    pub client_seq: u64,
    /// The caller's idempotency key, opaque to the store and handed back on read.
    pub event_id: Option<u128>,
    pub event_type: EventType,
    pub payload: Bytes,
    /// Client-side timestamp, epoch milliseconds. Informational only.
    pub timestamp_ms: u64,
}

/// The events for one aggregate inside a write request.
#[derive(Clone, Debug)]
pub struct AggregateWrite {
    pub key: AggregateKey,
    pub events: Vec<Event>,
    /// `Some(v)`: apply only if the aggregate is at version `v` (0 = does not exist yet).
    pub expected_version: Option<u64>,
    pub allow_create: bool,
    pub enforce_client_idempotency: bool,
}

impl AggregateWrite {
    /// The lowest `client_seq` of the write, which is what the idempotency check judges.
    pub fn lowest_client_seq(&self) -> Option<u64> {
        self.events.iter().map(|e| e.client_seq).min()
    }

    pub fn highest_client_seq(&self) -> Option<u64> {
        self.events.iter().map(|e| e.client_seq).max()
    }
}

/// A committed batch: everything one write appended to one aggregate.
#[derive(Clone, Debug)]
pub struct Batch {
    pub version: u64,
    pub client_id: ClientId,
    /// Server time when the batch was committed, epoch milliseconds; non-decreasing per
    /// aggregate.
    pub server_timestamp_ms: u64,
    pub events: Arc<[Event]>,
}

impl Batch {
    pub fn min_client_seq(&self) -> u64 {
        self.events.iter().map(|e| e.client_seq).min().unwrap_or(0)
    }

    pub fn max_client_seq(&self) -> u64 {
        self.events.iter().map(|e| e.client_seq).max().unwrap_or(0)
    }
}

/// Which batches a read returns. Every filter applies to a whole batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadFilter {
    /// First version to return, inclusive. 0 is read as 1.
    pub from_version: u64,
    /// Last version to return, inclusive.
    pub to_version: Option<u64>,
    /// Keep batches whose highest `client_seq` is at least this.
    pub min_client_seq: Option<u64>,
    /// Keep batches whose lowest `client_seq` is at most this.
    pub max_client_seq: Option<u64>,
    /// Keep only batches written by this client id.
    pub include_client_id: Option<ClientId>,
    /// Keep batches committed at or after this server time (epoch ms), inclusive.
    pub min_server_timestamp_ms: Option<u64>,
}

impl ReadFilter {
    pub fn from_version(from_version: u64) -> Self {
        Self {
            from_version,
            ..Self::default()
        }
    }

    /// Whether `batch` passes every batch-level filter except the version range.
    pub fn admits(&self, batch: &Batch) -> bool {
        if let Some(min) = self.min_client_seq
            && batch.max_client_seq() < min
        {
            return false;
        }
        if let Some(max) = self.max_client_seq
            && batch.min_client_seq() > max
        {
            return false;
        }
        if let Some(client) = self.include_client_id
            && batch.client_id != client
        {
            return false;
        }
        if let Some(ts) = self.min_server_timestamp_ms
            && batch.server_timestamp_ms < ts
        {
            return false;
        }
        true
    }
}

/// One page of a read.
#[derive(Clone, Debug, Default)]
pub struct ReadPage {
    pub batches: Vec<Batch>,
    /// Where the next page starts, or `None` when the read is complete.
    pub next_version: Option<u64>,
}

/// What the store knows about one aggregate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AggregateDetails {
    /// Lowest version still readable (above a trim), 1 when nothing was trimmed.
    pub min_available_version: u64,
    pub max_version: u64,
    pub last_server_timestamp_ms: u64,
}

/// Every outcome of a store call that the write loop must tell apart.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// 2003: the version guard failed. Nothing was appended.
    #[error("version conflict: expected {expected}, current {current}")]
    Conflict { expected: u64, current: u64 },
    /// 2002: a committed batch from this client id already recorded a sequence at or above
    /// the write's lowest one. Proves nothing about whose event that was. The sequences
    /// are the server's word, `None` when its message left one out: only a device's sync
    /// needs the committed one, and without it checks the stream instead.
    #[error("client sequence {attempted_seq:?} at or below committed {last_seq:?}")]
    IdempotencyViolation {
        last_seq: Option<u64>,
        attempted_seq: Option<u64>,
    },
    /// 2013: a write holding this sequence is accepted but not yet durable.
    #[error("a write holding this client sequence is in flight")]
    InflightDuplicate,
    /// The request may or may not have been applied (timeout, connection lost after send,
    /// unreadable reply).
    #[error("outcome unknown: {reason}")]
    OutcomeUnknown { reason: String },
    /// Definitely not applied (refused before sending, server busy, not leader). Safe to
    /// retry as is. `cause` says whether the store itself was out of reach.
    #[error("not applied: {reason}")]
    NotApplied { reason: String, cause: NotApplied },
    /// 1001/2005/7001: the aggregate does not exist (and the write did not allow creation).
    #[error("aggregate not found")]
    AggregateNotFound,
    /// 1000: the read started below the trim point.
    #[error("read below the trim point; minimum available version {min_available}")]
    Trimmed { min_available: u64 },
    /// 9001: the aggregates of one write live on different shards.
    #[error("aggregates of one write are on different shards")]
    CrossShard,
    /// Any other server error.
    #[error("store error {code}: {message}")]
    Other { code: u32, message: String },
}

/// Why a store call was definitely not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotApplied {
    /// No node that could take the call was reached: connections refused or timed out, or
    /// no leader. The store is out of reach for every request, not just this one.
    Unreachable,
    /// The store answered and shed the call (busy, backpressure), or this side did not send
    /// it or did not trust its answer (a pool wait, a read that ended early).
    Shed,
}

impl StoreError {
    /// Whether a write that failed this way may have been applied.
    pub fn may_have_applied(&self) -> bool {
        matches!(self, StoreError::OutcomeUnknown { .. })
    }

    /// A call that was not applied because the store shed it or this side held it back.
    pub fn shed(reason: impl Into<String>) -> Self {
        StoreError::NotApplied {
            reason: reason.into(),
            cause: NotApplied::Shed,
        }
    }

    /// A call that was not applied because no node of the store could be reached.
    pub fn unreachable(reason: impl Into<String>) -> Self {
        StoreError::NotApplied {
            reason: reason.into(),
            cause: NotApplied::Unreachable,
        }
    }

    /// Whether the store was out of reach (see [`NotApplied::Unreachable`]).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            StoreError::NotApplied {
                cause: NotApplied::Unreachable,
                ..
            }
        )
    }

    /// What may be said of this error outside the process: its class and the store's own
    /// numbers, never the free text a client or server put in it (node addresses, OS
    /// errors). The whole error goes to the log.
    pub fn brief(&self) -> String {
        match self {
            StoreError::Conflict { .. }
            | StoreError::IdempotencyViolation { .. }
            | StoreError::InflightDuplicate
            | StoreError::AggregateNotFound
            | StoreError::Trimmed { .. }
            | StoreError::CrossShard => self.to_string(),
            StoreError::OutcomeUnknown { .. } => {
                "outcome unknown: the store's answer was lost".into()
            }
            StoreError::NotApplied {
                cause: NotApplied::Unreachable,
                ..
            } => "not applied: the store could not be reached".into(),
            StoreError::NotApplied {
                cause: NotApplied::Shed,
                ..
            } => "not applied: the store did not take the request".into(),
            StoreError::Other { code, .. } => format!("store error {code}"),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// The event log port. Implementations are cheap to share behind an `Arc`.
#[async_trait]
pub trait EventLog: Send + Sync + 'static {
    /// Appends each aggregate's events as one batch, all or nothing. Returns each
    /// aggregate's new version, in the order of `writes`.
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>>;

    /// [`EventLog::write`] for a request whose caller does not need a refusal restated in
    /// the port's check order: it sends every member again alone on any refusal and learns
    /// each member's own answer then (group commit, `combine`). A backend whose server answers
    /// a multi-aggregate refusal in another order may skip the reads that restate it.
    async fn write_combined(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.write(client_id, writes).await
    }

    /// Reads one page of batches. Reading a missing aggregate is `AggregateNotFound`.
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage>;

    /// Version bounds and last server timestamp of an aggregate.
    ///
    /// A multi-node store may answer this from a follower that lags the leader, as it may a
    /// read: what is final on the tip must come from [`EventLog::leader_tip`].
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails>;

    /// The aggregate's newest version as the node that takes writes holds it, 0 for an
    /// aggregate that does not exist, with nothing written.
    ///
    /// Only the leader takes a write, so this sends one that cannot land: guarded at
    /// [`UNREACHABLE_VERSION`], without creation. The version guard refuses it, and its
    /// refusal names the current version. Every backend passes the same conformance rule.
    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        let probe = AggregateWrite {
            key,
            events: vec![tip_probe_event()],
            expected_version: Some(UNREACHABLE_VERSION),
            allow_create: false,
            enforce_client_idempotency: false,
        };
        match self.write(client_id, vec![probe]).await {
            Err(StoreError::Conflict { current, .. }) => Ok(current),
            Err(StoreError::AggregateNotFound) => Ok(0),
            Err(e) => Err(e),
            Ok(versions) => {
                // The guard lets no stream reach this version: a store that says otherwise
                // broke the port's rules, and nothing it says of the tip is trusted.
                tracing::error!(
                    ?key,
                    ?versions,
                    "a write guarded at an unreachable version was applied"
                );
                Err(StoreError::Other {
                    code: UNREACHABLE_VERSION_APPLIED_CODE,
                    message: "a write guarded at an unreachable version was applied".into(),
                })
            }
        }
    }

    /// Drops every batch below `keep_from_version`. Versions and the client high-water marks
    /// are kept.
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()>;

    /// A cheap liveness probe for readiness checks.
    async fn ping(&self) -> StoreResult<()> {
        Ok(())
    }

    /// Opens a feed of the writes committed from now on to the aggregates `filter` admits,
    /// by any writer. A store without one answers [`WATCH_UNSUPPORTED_CODE`].
    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        let _ = filter;
        Err(StoreError::Other {
            code: WATCH_UNSUPPORTED_CODE,
            message: "this store has no watch".into(),
        })
    }
}

/// Error code of a store that cannot watch (not a Celeriant code).
pub const WATCH_UNSUPPORTED_CODE: u32 = u32::MAX;

/// The version [`EventLog::leader_tip`] guards its probe at. No stream reaches it, so the
/// guard always refuses the probe.
pub const UNREACHABLE_VERSION: u64 = u64::MAX;

/// Error code of a store that applied the tip probe, which its guard must refuse (not a
/// Celeriant code).
pub const UNREACHABLE_VERSION_APPLIED_CODE: u32 = u32::MAX - 1;

/// The event the tip probe carries. A write must carry one; this one never lands. Major 0
/// is reserved by the server, so the type is Tally's own.
fn tip_probe_event() -> Event {
    Event {
        client_seq: 0,
        event_id: None,
        event_type: TIP_PROBE_EVENT_TYPE,
        payload: Bytes::new(),
        timestamp_ms: 0,
    }
}

/// The tip probe's event type: one no fold knows, were it ever to land.
pub const TIP_PROBE_EVENT_TYPE: EventType = EventType {
    major: 0x7a11_7199,
    minor: 0,
};

/// Which aggregates a watch reports; `None` admits any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchFilter {
    pub org_id: Option<u128>,
    pub aggregate_type_id: Option<u128>,
}

impl WatchFilter {
    pub fn admits(&self, key: &AggregateKey) -> bool {
        self.org_id.is_none_or(|o| o == key.org_id)
            && self
                .aggregate_type_id
                .is_none_or(|t| t == key.aggregate_type_id)
    }
}

/// One committed write as a watch reports it: `key` reached `version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Commit {
    pub key: AggregateKey,
    pub version: u64,
}

/// What a watch feed yields next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchItem {
    Commit(Commit),
    /// Notifications may have been lost since the previous item (the feed fell behind or
    /// reconnected). A reader that needs every write resyncs by reading the store.
    Gap,
}

/// A live feed of commits. Dropping it ends the subscription.
#[async_trait]
pub trait WatchFeed: Send {
    /// The next notification. An error means the feed is broken: open another (and treat
    /// the time in between as a [`WatchItem::Gap`]). Not cancel-safe on every store: await
    /// it to completion or drop the feed.
    async fn next(&mut self) -> StoreResult<WatchItem>;
}

pub type SharedLog = Arc<dyn EventLog>;

/// Follows a read's pagination one page at a time, so a long history is never held whole.
pub struct BatchStream<'a> {
    log: &'a dyn EventLog,
    key: AggregateKey,
    filter: ReadFilter,
    done: bool,
}

impl<'a> BatchStream<'a> {
    pub fn new(log: &'a dyn EventLog, key: AggregateKey, filter: ReadFilter) -> Self {
        Self {
            log,
            key,
            filter,
            done: false,
        }
    }

    /// Whether the read may have more pages (always true before the first page).
    pub fn has_more(&self) -> bool {
        !self.done
    }

    /// The next page, or `None` when the read is complete.
    pub async fn next_page(&mut self) -> StoreResult<Option<Vec<Batch>>> {
        if self.done {
            return Ok(None);
        }
        let page = self.log.read(self.key, &self.filter).await?;
        match page.next_version {
            Some(next) if next > self.filter.from_version.max(1) => self.filter.from_version = next,
            // No next page, or a cursor that does not move: stop rather than spin.
            _ => self.done = true,
        }
        Ok(Some(page.batches))
    }
}

/// Checks that an unfiltered read of versions `from..=to` showed every one of them, in order:
/// a read served by a replica behind the tip ends early without an error, and whatever is
/// drawn from it (a verdict, a balance rebuilt from it) would be silently wrong.
#[derive(Clone, Copy, Debug)]
pub struct WholeRange {
    from: u64,
    to: u64,
    next: u64,
}

impl WholeRange {
    pub fn new(from: u64, to: u64) -> Self {
        Self {
            from,
            to,
            next: from,
        }
    }

    /// The next batch the read showed: it must be the next version.
    pub fn saw(&mut self, version: u64) -> StoreResult<()> {
        if version != self.next {
            return Err(self.incomplete());
        }
        self.next += 1;
        Ok(())
    }

    /// The read ended: it must have reached `to`.
    pub fn finish(&self) -> StoreResult<()> {
        if self.next <= self.to {
            return Err(self.incomplete());
        }
        Ok(())
    }

    fn incomplete(&self) -> StoreError {
        StoreError::shed(format!(
            "a read of versions {}..={} did not show version {} (a replica behind the tip)",
            self.from, self.to, self.next
        ))
    }
}

/// Every batch of versions `from..=to` of `key`, page by page, proven whole ([`WholeRange`]);
/// any error as the store gave it (a trim among them).
pub async fn read_whole(
    log: &dyn EventLog,
    key: AggregateKey,
    from: u64,
    to: u64,
) -> StoreResult<Vec<Batch>> {
    let filter = ReadFilter {
        to_version: Some(to),
        ..ReadFilter::from_version(from)
    };
    let mut stream = BatchStream::new(log, key, filter);
    let mut whole = WholeRange::new(from, to);
    let mut batches = Vec::new();
    while let Some(page) = stream.next_page().await? {
        for b in &page {
            whole.saw(b.version)?;
        }
        batches.extend(page);
    }
    whole.finish()?;
    Ok(batches)
}
