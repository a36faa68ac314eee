//! One watched account: the version and balance its stream stands at, and its subscribers.
//!
//! The cursor lock is held while the channel reads new batches and fans them out, and while
//! a subscriber joins, so a joiner sees exactly the frames after the version it is told.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

use parking_lot::Mutex;

use super::{
    AccountFrame, END_FEED_GAP, END_STORE_ERROR, END_UNREADABLE, Entry, Hub, Slot, WatchError,
    fan_out,
};
use crate::account::{AccountEvent, AccountId, fold};
use crate::backoff::Backoff;
use crate::log_limit::{LogLimit, REPORT_INTERVAL};
use crate::projection::{Projection, ProjectionError};
use crate::reader::{HistoryEntry, Writer};
use crate::store::{Batch, BatchStream, ClientId, ReadFilter, StoreError};

/// Reads a notified version may take to become visible (a read served by a lagging
/// replica of the store) before the channel waits for the next notification or resync.
const ADVANCE_ATTEMPTS: u32 = 5;
/// The pause between those reads (fixed: a replica catches up in a moment or not at all).
const ADVANCE_REREAD_PAUSE: Duration = Duration::from_millis(20);
/// How long an account's reads may keep failing (retried every [`FAILED_READ_RETRY`])
/// before its streams end with `event: error` (clients resume with `Last-Event-ID`): a
/// stream that only sent keep-alives would look idle to a client while the replica cannot
/// see the account at all.
pub(super) const READ_FAILURE_LIMIT: Duration = Duration::from_secs(10);
/// How soon a channel's reader reads again after a read failed, at most (see
/// [`retry_pause`]).
pub(super) const FAILED_READ_RETRY: Duration = Duration::from_secs(1);
/// The pauses after failed reads: within [`FAILED_READ_RETRY`], in whole milliseconds.
const FAILED_READ_PAUSE: Backoff =
    Backoff::fixed(FAILED_READ_RETRY).in_grains_of(Duration::from_millis(1));

/// Where an account's stream stands: its newest delivered version and the balance after it
/// (`None` when the stream cannot be folded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cursor {
    pub version: u64,
    pub balance: Option<i64>,
}

pub(super) struct Channel {
    account: AccountId,
    subs: Mutex<Vec<Slot<Arc<AccountFrame>>>>,
    /// `None` until the first subscriber reads where the account stands.
    cursor: tokio::sync::Mutex<Option<Cursor>>,
    /// When the account's reads started failing, while they still do.
    failing_since: Mutex<Option<Instant>>,
    /// The newest version a notification named.
    notified: AtomicU64,
    /// Whether a read to the tip was asked for.
    tip_wanted: AtomicBool,
    /// Whether the channel's reader task runs: at most one per channel.
    reading: AtomicBool,
}

impl Channel {
    pub fn new(account: AccountId) -> Self {
        Self {
            account,
            subs: Mutex::new(Vec::new()),
            cursor: tokio::sync::Mutex::new(None),
            failing_since: Mutex::new(None),
            notified: AtomicU64::new(0),
            tip_wanted: AtomicBool::new(false),
            reading: AtomicBool::new(false),
        }
    }

    /// Adds a subscriber; it receives every frame after the returned cursor.
    pub async fn register(
        &self,
        hub: &Hub,
        slot: Slot<Arc<AccountFrame>>,
    ) -> Result<Cursor, WatchError> {
        let mut cursor = self.cursor.lock().await;
        let at = match *cursor {
            Some(at) => at,
            None => {
                let at = start(&hub.projection, self.account).await?;
                *cursor = Some(at);
                // Failures before the cursor was dropped were the old streams'.
                *self.failing_since.lock() = None;
                at
            }
        };
        self.subs.lock().push(slot);
        // A shutdown that ran before the push did not see this slot.
        if *hub.shutdown.borrow() {
            return Err(WatchError::ShuttingDown);
        }
        Ok(at)
    }

    pub fn remove(&self, id: u64) {
        self.subs.lock().retain(|s| s.id != id);
    }

    pub fn end_all(&self, end: u8) {
        super::end_all(&mut self.subs.lock(), end);
    }

    /// A notification that the account reached `version`: read up to it on the channel's
    /// reader task (see [`Self::read_on`]).
    pub fn notify(self: &Arc<Self>, hub: &Arc<Hub>, version: u64) {
        self.notified.fetch_max(version, Ordering::SeqCst);
        self.read_on(hub);
    }

    /// Read to the tip, whatever was notified (a feed gap, or the periodic resync).
    pub fn resync(self: &Arc<Self>, hub: &Arc<Hub>) {
        self.tip_wanted.store(true, Ordering::SeqCst);
        self.read_on(hub);
    }

    /// Reads what was asked for on a task of the channel's own, at most one at a time
    /// (what is asked meanwhile is read by the same task, next), so neither the feed nor the
    /// resync waits on a read, and an account whose reads lag holds up no other. At most
    /// [`super::MAX_NOTIFIED_READS`] channels read at once. A read that failed (or does not
    /// show a notified version yet) is tried again every [`FAILED_READ_RETRY`] while the
    /// channel has subscribers, so what it missed arrives soon after the store recovers,
    /// and an account that stays unreadable ends its streams after [`READ_FAILURE_LIMIT`]
    /// of failures.
    fn read_on(self: &Arc<Self>, hub: &Arc<Hub>) {
        if self.reading.swap(true, Ordering::SeqCst) {
            return;
        }
        let (channel, hub) = (self.clone(), hub.clone());
        tokio::spawn(async move {
            // Clears `reading` if the task ends any other way than below (a panic, or the
            // hub shutting down), so the next request starts a reader again.
            let mut owner = ReaderFlag {
                flag: &channel.reading,
                held: true,
            };
            let mut retries: u64 = 0;
            loop {
                let (outcome, to) = {
                    let Ok(_read) = hub.reads.acquire().await else {
                        return;
                    };
                    let tip = channel.tip_wanted.swap(false, Ordering::SeqCst);
                    let to = channel.notified.load(Ordering::SeqCst);
                    (channel.advance(&hub, to, tip).await, to)
                };
                if outcome != Advanced::Done && channel.has_subscribers() {
                    // Still this channel's reader: nothing is lost by asking again here.
                    retries += 1;
                    tokio::time::sleep(retry_pause(channel.account, retries)).await;
                    channel.tip_wanted.store(true, Ordering::SeqCst);
                    continue;
                }
                owner.release();
                // A request made during the read saw `reading` set and left its target
                // here; unless another task has taken it since, read again.
                let more = channel.tip_wanted.load(Ordering::SeqCst)
                    || channel.notified.load(Ordering::SeqCst) > to;
                if !more || !owner.take() {
                    return;
                }
            }
        });
    }

    fn has_subscribers(&self) -> bool {
        !self.subs.lock().is_empty()
    }

    /// Reads and fans out every batch after the cursor: to the tip once when `tip` is
    /// asked, and until it reaches `to` (the newest notified version), retrying a read that
    /// does not show it yet (a lagging replica of the store) a few times. Only the channel's
    /// reader calls it (`read_on`), so one read runs per channel.
    async fn advance(&self, hub: &Hub, to: u64, tip: bool) -> Advanced {
        let mut guard = self.cursor.lock().await;
        // Not started: the first joiner reads the tip itself.
        let Some(cursor) = guard.as_mut() else {
            return Advanced::Done;
        };
        let mut tip = tip;
        let mut holed = false;
        for attempt in 1..=ADVANCE_ATTEMPTS {
            if !tip && to <= cursor.version {
                return Advanced::Done;
            }
            match self.read_pass(hub, cursor).await {
                Pass::Over(end) => return end.apply(&mut guard),
                Pass::Hole => holed = true,
                Pass::Whole => {
                    holed = false;
                    // Read whole to the tip: only `to` may still be missing.
                    tip = false;
                    *self.failing_since.lock() = None;
                    if cursor.version >= to {
                        return Advanced::Done;
                    }
                }
            }
            if attempt < ADVANCE_ATTEMPTS {
                tokio::time::sleep(ADVANCE_REREAD_PAUSE).await;
            }
        }
        if holed {
            // A hole that never fills is a store that cannot be read, like a failure.
            hub.metrics.watch_read_failures.inc();
            return self.failure_ending().apply(&mut guard);
        }
        static LOG: LogLimit = LogLimit::new(REPORT_INTERVAL);
        if let Some(report) = LOG.occurred() {
            tracing::warn!(account = %self.account, times = report.count, "a notified version is not readable yet; read again in a second");
        }
        Advanced::Behind
    }

    /// One read of the stream after the cursor, page by page, each batch fanned out and
    /// the cursor moved past it.
    async fn read_pass(&self, hub: &Hub, cursor: &mut Cursor) -> Pass {
        let log = hub.projection.log();
        let key = hub.projection.identity().key(self.account);
        let mut stream = BatchStream::new(
            log.as_ref(),
            key,
            ReadFilter::from_version(cursor.version + 1),
        );
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => return Pass::Whole,
                Err(StoreError::Trimmed { .. }) => {
                    // Trimmed past what this stream delivered: its subscribers cannot
                    // follow without a gap. They reconnect, and their resume says so.
                    tracing::warn!(account = %self.account, "watched account trimmed past its stream; ending its streams");
                    self.end_all(END_FEED_GAP);
                    return Pass::Over(Ending::forgetting(Advanced::Done));
                }
                Err(e) => {
                    // Through a store outage every watched account's every notification
                    // and resync fails here: one line a second, counting them.
                    static LOG: LogLimit = LogLimit::new(REPORT_INTERVAL);
                    if let Some(report) = LOG.occurred() {
                        tracing::warn!(error = %e, failed = report.count, since_ms = report.since_ms, "watch read failed; read again in a second");
                    }
                    hub.metrics.watch_read_failures.inc();
                    return Pass::Over(self.failure_ending());
                }
            };
            if let Some(short) = self.deliver(hub, cursor, &page) {
                return short;
            }
        }
    }

    /// Fans out the page's batches after the cursor, in order, moving the cursor past
    /// each; `Some` when the page stops short: a skipped version, or an unreadable batch.
    fn deliver(&self, hub: &Hub, cursor: &mut Cursor, page: &[Batch]) -> Option<Pass> {
        let ours = hub.projection.identity().client();
        for batch in page {
            if batch.version <= cursor.version {
                continue;
            }
            if batch.version != cursor.version + 1 {
                // A page that skipped a version (a lagging or partial read) would shift
                // every balance after it: read again from the one missing.
                return Some(Pass::Hole);
            }
            let mut balance = cursor.balance;
            let frame = match frame_of(self.account, batch, ours, &mut balance) {
                Ok(frame) => Arc::new(frame),
                Err(reason) => {
                    tracing::warn!(account = %self.account, version = batch.version, %reason, "watched account is unreadable; ending its streams");
                    self.end_all(END_UNREADABLE);
                    return Some(Pass::Over(Ending::keeping(Advanced::Done)));
                }
            };
            fan_out(&mut self.subs.lock(), &frame, &hub.metrics);
            *cursor = Cursor {
                version: batch.version,
                balance,
            };
        }
        None
    }

    /// How a read that failed (or showed a hole) ends: retried shortly, or, once the
    /// account's reads have failed too long, done with its streams ended and the cursor
    /// dropped.
    fn failure_ending(&self) -> Ending {
        if self.failed_too_long() {
            Ending::forgetting(Advanced::Done)
        } else {
            Ending::keeping(Advanced::Failed)
        }
    }

    /// Notes a read that failed (or showed a hole); once the account's reads have failed
    /// for [`READ_FAILURE_LIMIT`], ends its streams with a store error and says so (the
    /// caller then drops the cursor, so the next joiner starts afresh).
    fn failed_too_long(&self) -> bool {
        let now = Instant::now();
        let mut since = self.failing_since.lock();
        let first = *since.get_or_insert(now);
        if now.saturating_duration_since(first) < READ_FAILURE_LIMIT {
            return false;
        }
        *since = None;
        drop(since);
        self.end_all(END_STORE_ERROR);
        true
    }
}

/// How one pass over the stream ([`Channel::read_pass`]) ended.
enum Pass {
    /// Read to the end of the stream without a gap.
    Whole,
    /// A page skipped a version: read again from the one missing.
    Hole,
    /// The read is over, whatever is left of its passes.
    Over(Ending),
}

/// A read that is over: its outcome, and whether the channel's cursor goes with it (so the
/// next joiner starts afresh).
struct Ending {
    outcome: Advanced,
    forget_cursor: bool,
}

impl Ending {
    fn keeping(outcome: Advanced) -> Self {
        Self {
            outcome,
            forget_cursor: false,
        }
    }

    fn forgetting(outcome: Advanced) -> Self {
        Self {
            outcome,
            forget_cursor: true,
        }
    }

    fn apply(self, cursor: &mut Option<Cursor>) -> Advanced {
        if self.forget_cursor {
            *cursor = None;
        }
        self.outcome
    }
}

/// What a reader's read came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Advanced {
    /// Read what could be read, or ended the streams: nothing to retry.
    Done,
    /// The store could not be read (or showed a hole): try again shortly.
    Failed,
    /// The read was whole but does not show the notified version yet (a lagging replica
    /// of the store): try again shortly, not counted as a failure.
    Behind,
}

/// How long a reader waits before reading again after a failed read: between half of
/// [`FAILED_READ_RETRY`] and all of it, spread by account and retry, so the readers of
/// many accounts failing together do not all come back at the same instant (found in
/// review). Deterministic: the same account and retry always wait the same.
fn retry_pause(account: AccountId, retry: u64) -> Duration {
    let draw = (account.0.as_u128() as u64) ^ retry.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    FAILED_READ_PAUSE.wait(u32::try_from(retry).unwrap_or(u32::MAX), draw)
}

/// Who holds a channel's `reading` flag; see [`Channel::read_on`].
struct ReaderFlag<'a> {
    flag: &'a AtomicBool,
    held: bool,
}

impl ReaderFlag<'_> {
    fn release(&mut self) {
        self.flag.store(false, Ordering::SeqCst);
        self.held = false;
    }

    /// Takes the flag again; `false` when another reader holds it.
    fn take(&mut self) -> bool {
        self.held = !self.flag.swap(true, Ordering::SeqCst);
        self.held
    }
}

impl Drop for ReaderFlag<'_> {
    fn drop(&mut self) {
        if self.held {
            self.flag.store(false, Ordering::SeqCst);
        }
    }
}

/// Where a new channel starts: the fold's version and balance, or, when the fold cannot
/// derive the balance (trimmed, unreadable), the store's tip without one.
async fn start(projection: &Projection, account: AccountId) -> Result<Cursor, WatchError> {
    match projection
        .refresh(account, &[])
        .await
        .map(|loaded| loaded.snap)
    {
        Ok(snap) => Ok(Cursor {
            version: snap.version,
            balance: Some(snap.balance),
        }),
        Err(ProjectionError::Store(e)) => Err(WatchError::Store(e.brief())),
        Err(e @ ProjectionError::Database) => Err(WatchError::Store(e.to_string())),
        Err(_) => match projection
            .log()
            .details(projection.identity().key(account))
            .await
        {
            Ok(d) => Ok(Cursor {
                version: d.max_version,
                balance: None,
            }),
            Err(e) => Err(WatchError::Store(e.brief())),
        },
    }
}

/// A batch as a frame, folding `balance` forward through it (`None` stays `None`, and an
/// overflow makes it `None`). An undecodable event is an error: nothing is skipped.
pub(super) fn frame_of(
    account: AccountId,
    batch: &Batch,
    ours: ClientId,
    balance: &mut Option<i64>,
) -> Result<AccountFrame, String> {
    let writer = if batch.client_id == ours {
        Writer::Service
    } else {
        Writer::Client(batch.client_id)
    };
    let mut entries = Vec::with_capacity(batch.events.len());
    for e in batch.events.iter() {
        let event =
            AccountEvent::decode(e.event_type, &e.payload).map_err(|err| err.to_string())?;
        *balance = balance.and_then(|b| fold::apply(b, &event).ok());
        entries.push(Entry {
            history: HistoryEntry {
                version: batch.version,
                server_timestamp_ms: batch.server_timestamp_ms,
                event_id: e.event_id,
                event,
                writer,
            },
            balance_cents: *balance,
        });
    }
    Ok(AccountFrame {
        account,
        version: batch.version,
        entries,
        encoded: OnceLock::new(),
    })
}

/// What a batch adds to the balance (credits minus debits), `None` on overflow or an
/// undecodable event (the caller reports the latter when it builds the frame).
pub(super) fn delta_of(batch: &Batch) -> Option<i64> {
    let mut delta: i64 = 0;
    for e in batch.events.iter() {
        let event = AccountEvent::decode(e.event_type, &e.payload).ok()?;
        delta = fold::apply(delta, &event).ok()?;
    }
    Some(delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a reader task that ends without giving its flag back (a panic, the hub shutting
    /// down) clears it, so the channel's next notification starts a reader again; one that
    /// gave it back never clears a flag another reader took since.
    #[test]
    fn a_reader_that_ends_abruptly_gives_its_flag_back_and_never_another_readers() {
        let flag = AtomicBool::new(true);
        drop(ReaderFlag {
            flag: &flag,
            held: true,
        });
        assert!(!flag.load(Ordering::SeqCst), "cleared by the ending reader");

        flag.store(true, Ordering::SeqCst);
        let mut owner = ReaderFlag {
            flag: &flag,
            held: true,
        };
        owner.release();
        assert!(!flag.load(Ordering::SeqCst));
        // Another reader starts before this one asks again: it does not get the flag back,
        // and ending leaves the other's flag set.
        flag.store(true, Ordering::SeqCst);
        assert!(!owner.take());
        drop(owner);
        assert!(flag.load(Ordering::SeqCst), "the other reader's flag stays");
    }

    /// Rule: the pauses after failed reads are pinned: half of `FAILED_READ_RETRY` plus a
    /// whole number of milliseconds drawn from the account and the retry.
    #[test]
    fn retry_pauses_are_pinned() {
        let account = AccountId(uuid::Uuid::from_u128(0xa1));
        let pauses: Vec<u128> = (1..=4)
            .map(|r| retry_pause(account, r).as_millis())
            .collect();
        assert_eq!(pauses, [644, 951, 934, 869]);
        assert_eq!(retry_pause(account, 1).subsec_nanos() % 1_000_000, 0);
    }

    /// Rule: a failed read's pause before the next lies in the upper half of
    /// `FAILED_READ_RETRY`, and differs between accounts and retries.
    #[test]
    fn retry_pauses_are_spread_within_the_upper_half_of_the_retry_interval() {
        let mut seen = std::collections::HashSet::new();
        for n in 0..64u128 {
            let account = AccountId(uuid::Uuid::from_u128(n * 7_919));
            for retry in 1..4 {
                let pause = retry_pause(account, retry);
                assert!(
                    pause >= FAILED_READ_RETRY / 2 && pause < FAILED_READ_RETRY,
                    "{pause:?}"
                );
                seen.insert(pause);
            }
        }
        assert!(seen.len() > 32, "spread: {} distinct pauses", seen.len());
    }
}
