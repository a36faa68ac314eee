//! [`WindowedLog`]: a store decorator that pages reads the way Celeriant does, and counts them,
//! for the suites that pin how much store work one answer may cost.
//!
//! The embedded store fills a page with batches the filters keep, however many versions it
//! passes to find them; Celeriant reads one window of at most 512 versions per request
//! (`READ_PAGE_MAX_VERSIONS`), whatever the filters keep, and goes on after it. A read whose
//! filters drop most batches is one page here and many there; this decorator makes it many
//! here too, so a bound on pages is tested against the store that pays for them.
//! [`one_deposit`] is the one-event batch these suites, and the store suites, fill streams with.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;
use tally::account::AccountEvent;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, Event, EventLog, ReadFilter,
    ReadPage, SharedLog, StoreResult, WatchFeed, WatchFilter,
};

/// Celeriant's page: at most this many versions per read.
pub const CELERIANT_WINDOW: u64 = 512;

/// A batch of one deposit of `amount` at client sequence `seq`, created on demand, with no
/// version guard.
pub fn one_deposit(
    key: AggregateKey,
    seq: u64,
    event_id: Option<u128>,
    amount: i64,
) -> AggregateWrite {
    let event = AccountEvent::Deposited { amount };
    AggregateWrite {
        key,
        events: vec![Event {
            client_seq: seq,
            event_id,
            event_type: event.event_type(),
            payload: event.encode(),
            timestamp_ms: 0,
        }],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: true,
    }
}

pub struct WindowedLog {
    inner: SharedLog,
    width: u64,
    reads: AtomicUsize,
    versions: AtomicU64,
}

impl WindowedLog {
    /// `inner`, read at most `width` versions (at least 1) per page.
    pub fn new(inner: SharedLog, width: u64) -> Self {
        Self {
            inner,
            width: width.max(1),
            reads: AtomicUsize::new(0),
            versions: AtomicU64::new(0),
        }
    }

    /// Reads (pages) asked for since the last [`reset`](Self::reset), failed ones included.
    pub fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }

    /// Versions those reads spanned, whether their batches were kept or not.
    pub fn versions_read(&self) -> u64 {
        self.versions.load(Ordering::SeqCst)
    }

    pub fn reset(&self) {
        self.reads.store(0, Ordering::SeqCst);
        self.versions.store(0, Ordering::SeqCst);
    }
}

#[async_trait]
impl EventLog for WindowedLog {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.inner.write(client_id, writes).await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let from = filter.from_version.max(1);
        let window_end = from.saturating_add(self.width - 1);
        let to = filter.to_version.map_or(window_end, |t| t.min(window_end));
        let windowed = ReadFilter {
            to_version: Some(to),
            ..filter.clone()
        };
        let mut page = self.inner.read(key, &windowed).await?;
        if let Some(next) = page.next_version {
            self.versions.fetch_add(next - from, Ordering::SeqCst);
            return Ok(page);
        }
        // The window is done; as on Celeriant, where the read ends is the tip's to say.
        let tip = self.inner.details(key).await?.max_version;
        let end = filter.to_version.map_or(tip, |t| t.min(tip));
        let spanned = (to.min(end) + 1).saturating_sub(from);
        self.versions.fetch_add(spanned, Ordering::SeqCst);
        if to < end {
            page.next_version = Some(to + 1);
        }
        Ok(page)
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }

    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        self.inner.watch(filter).await
    }
}
