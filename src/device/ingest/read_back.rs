//! The read-back that proves a run the store's mark covers really landed: the device's
//! batches covering the run are read back and must hold these very events (same sequence,
//! event id and payload). A device restored from an old backup reissues sequences for new
//! events; without the check those sales would be swallowed as "already synced". Events the
//! store no longer has (trimmed) are never taken on the mark alone (a final refusal for an
//! operator); events a lagging read does not show yet make the answer a retry.

use std::collections::BTreeMap;

use crate::device::DeviceId;
use crate::device::error::{DeviceSyncError, RetryReason};
use crate::device::run::DeviceRun;
use crate::store::{
    AggregateKey, Batch, BatchStream, Event, EventLog, ReadFilter, StoreError, StoreResult,
    WholeRange,
};

/// Proves a run the store's mark covers is really there: every event of the run must be read
/// back from this device's batches on `key` (the run's account) with the same sequence, id,
/// type and payload.
pub(super) async fn check_landed(
    log: &dyn EventLog,
    key: AggregateKey,
    device: DeviceId,
    run: &DeviceRun,
    expected: &[Event],
) -> Result<(), DeviceSyncError> {
    let read = read_within_budget(log, key, device, run).await?;
    expected
        .iter()
        .try_for_each(|want| check_event(&read, device, want))
}

/// [`read_run`] within [`READ_BACK_BUDGET`]; a read that fails or runs out of time proves
/// nothing either way, and the run is retried.
async fn read_within_budget(
    log: &dyn EventLog,
    key: AggregateKey,
    device: DeviceId,
    run: &DeviceRun,
) -> Result<RunRead, DeviceSyncError> {
    let (first, last) = (run.first_seq(), run.last_seq());
    let detail = match tokio::time::timeout(READ_BACK_BUDGET, read_run(log, key, device, run)).await
    {
        Ok(Ok(read)) => return Ok(read),
        Ok(Err(e)) => format!("reading back run {first}..={last} failed: {e}"),
        Err(_) => format!(
            "reading back run {first}..={last} took longer than {} s",
            READ_BACK_BUDGET.as_secs()
        ),
    };
    Err(DeviceSyncError::Retry {
        reason: RetryReason::Unverified,
        detail,
    })
}

/// Whether the read shows the run's event `want` as it was sent; if not, why not.
fn check_event(read: &RunRead, device: DeviceId, want: &Event) -> Result<(), DeviceSyncError> {
    let seq = want.client_seq;
    match read.found.get(&seq) {
        Some(got)
            if got.event_id == want.event_id
                && got.event_type == want.event_type
                && got.payload == want.payload =>
        {
            Ok(())
        }
        Some(_) => {
            tracing::warn!(device = %device, seq, "device reissued a sequence");
            Err(DeviceSyncError::RunConflictsWithStore { seq })
        }
        // Trimmed away: the mark says some event of this device's held the sequence,
        // not that it was this one. Never answered as synced on the mark alone.
        None if read.reach == Reach::Trimmed => {
            tracing::warn!(device = %device, seq, "device run below its mark was trimmed away");
            Err(DeviceSyncError::RunTrimmed { seq })
        }
        // The read shows a later sequence of this device's and every version where
        // this one could stand below it (see `read_run`): it is not there. The device
        // synced out of order (or skipped ahead), and resending cannot help.
        None if read.seen.is_some_and(|seen| seen.highest > seq) => {
            tracing::warn!(device = %device, seq, "device run below its mark never landed");
            Err(DeviceSyncError::RunNeverLanded { seq })
        }
        None => Err(DeviceSyncError::Retry {
            reason: RetryReason::Unverified,
            detail: format!(
                "the store's mark covers sequence {seq} but a read does not show it yet"
            ),
        }),
    }
}

/// What this device's batches on the account show of the run (see [`RunRead`]).
///
/// The service keeps nothing per device and a 2002 names only the mark, so the run may
/// stand anywhere in the stream. The read goes down from the newest version,
/// [`READ_BACK_WINDOW`] versions at a time, because that is where a resend after a lost
/// answer finds its run, and because Celeriant serves recent versions from memory and
/// older ones from disk (starting at version 1 made every page of a long account cost a
/// walk of the whole account there: Celeriant e7c6df9).
///
/// A device that names the version its latest synced run landed at (`lastSyncedVersion`)
/// has the versions above that one read first, from both ends in turn, starting right
/// above the hint: its run is its next batch after that one, so a resend after a long
/// time offline is found there in one window, and so is a prompt one (on a Celeriant
/// that just restarted, with nothing in memory, even the newest versions cost a disk
/// read, so the window most likely to hold the run goes first). The hint only orders
/// the read: until an event read above it places the run there, the versions below it
/// are read as without it.
///
/// It stops as soon as the answer is decided (see [`RunRead::decided`]) and gives up past
/// [`MAX_RUN_READ_PAGES`] pages with [`StoreError::NotApplied`], which the caller answers
/// as unverified (a retry).
async fn read_run(
    log: &dyn EventLog,
    key: AggregateKey,
    device: DeviceId,
    run: &DeviceRun,
) -> StoreResult<RunRead> {
    let details = match log.details(key).await {
        Ok(d) => d,
        Err(StoreError::AggregateNotFound) => return Ok(RunRead::new(run)),
        Err(e) => return Err(e),
    };
    let tip = details.max_version;
    let mut scan = Scan {
        log,
        device,
        key,
        read: RunRead::new(run),
        floor: details.min_available_version.max(1),
        reach: if details.min_available_version > 1 {
            Reach::Trimmed
        } else {
            Reach::Whole
        },
        pages: 0,
    };
    let hint = run
        .last_synced_version()
        .filter(|&h| h > scan.floor && h <= tip);
    let mut decided = false;
    let mut high = tip;
    if let Some(h) = hint {
        decided = scan.read_range(h, tip, Ends::Both).await?;
        high = h - 1;
    }
    if !decided {
        let low = scan.floor;
        scan.read_range(low, high, Ends::Top).await?;
    }
    let mut read = scan.read;
    // A trim only hides the run if nothing read places the run above it.
    if !read.saw_earlier() {
        read.reach = scan.reach;
    }
    Ok(read)
}

impl Scan<'_> {
    /// Reads versions `low..=high` a window at a time, from the top down, or from both ends
    /// in turn, bottom first (above a hint, the run is the device's next batch), until the
    /// answer is decided (true) or the range is read (false).
    async fn read_range(&mut self, mut low: u64, mut high: u64, ends: Ends) -> StoreResult<bool> {
        let mut side = match ends {
            Ends::Top => Side::Top,
            Ends::Both => Side::Bottom,
        };
        while low <= high {
            let (from, to) = match side {
                Side::Top => (high.saturating_sub(READ_BACK_WINDOW - 1).max(low), high),
                Side::Bottom => (low, low.saturating_add(READ_BACK_WINDOW - 1).min(high)),
            };
            match self.read_window(from, to).await {
                Ok(()) => {}
                // Trimmed while we read: what is left starts higher up.
                Err(StoreError::Trimmed { min_available }) if min_available > low => {
                    self.reach = Reach::Trimmed;
                    self.floor = self.floor.max(min_available);
                    low = min_available;
                    continue;
                }
                Err(e) => return Err(e),
            }
            if self.read.decided(side) {
                return Ok(true);
            }
            match side {
                Side::Top => high = from - 1,
                Side::Bottom => low = to + 1,
            }
            side = match (ends, side) {
                (Ends::Top, _) | (Ends::Both, Side::Bottom) => Side::Top,
                (Ends::Both, Side::Top) => Side::Bottom,
            };
        }
        Ok(false)
    }

    /// Reads versions `from..=to` (every batch, so the read proves it saw them all), page by
    /// page, and takes this device's batches into the scan. A read that shows less than the
    /// whole window (a replica behind the tip the details call reported) is an error, which
    /// the caller answers as unverified: a verdict is only ever drawn from complete windows.
    async fn read_window(&mut self, from: u64, to: u64) -> StoreResult<()> {
        let filter = ReadFilter {
            to_version: Some(to),
            ..ReadFilter::from_version(from)
        };
        let device = self.device.as_u128();
        let mut stream = BatchStream::new(self.log, self.key, filter);
        let mut whole = WholeRange::new(from, to);
        loop {
            if self.pages >= MAX_RUN_READ_PAGES {
                return Err(StoreError::shed(format!(
                    "the read-back passed {MAX_RUN_READ_PAGES} pages"
                )));
            }
            self.pages += 1;
            let batches = match stream.next_page().await {
                Ok(Some(batches)) => batches,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(e) => return Err(e),
            };
            for b in &batches {
                whole.saw(b.version)?;
            }
            self.read
                .absorb(batches.iter().filter(|b| b.client_id == device));
            if !stream.has_more() {
                break;
            }
        }
        whole.finish()
    }
}

/// One read-back in progress.
struct Scan<'l> {
    log: &'l dyn EventLog,
    device: DeviceId,
    key: AggregateKey,
    read: RunRead,
    /// The lowest version still readable.
    floor: u64,
    /// Whether part of the stream was trimmed away.
    reach: Reach,
    /// Pages read so far, against [`MAX_RUN_READ_PAGES`].
    pages: usize,
}

/// Where a read-back takes its windows from: the top only, or both ends in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ends {
    Top,
    Both,
}

/// The end of the unread range a window is taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Top,
    Bottom,
}

/// Whether a read can reach every version where the run could stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    Whole,
    /// Part of the stream was trimmed away below what was read.
    Trimmed,
}

/// The lowest and highest sequence of this device's among the events read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SeqSpan {
    lowest: u64,
    highest: u64,
}

impl SeqSpan {
    /// The span widened to take in `seq` (the span of `seq` alone from none).
    fn with(span: Option<SeqSpan>, seq: u64) -> SeqSpan {
        match span {
            None => SeqSpan {
                lowest: seq,
                highest: seq,
            },
            Some(s) => SeqSpan {
                lowest: s.lowest.min(seq),
                highest: s.highest.max(seq),
            },
        }
    }
}

/// Versions one step of a device run's read-back covers: one Celeriant page.
pub const READ_BACK_WINDOW: u64 = 512;

/// The most pages one read-back of a device run may take (a Celeriant page spans at most
/// 512 versions: 256 pages are about 131,000 versions; it is paid only by a resend after a
/// lost answer). This caps how far below the newest version (or above the device's hint) a
/// resent run can still be proven: beyond it the answer is the retryable `SYNC_UNVERIFIED`,
/// never a guess.
pub const MAX_RUN_READ_PAGES: usize = 256;

/// The longest one read-back of a device run may take. A device sync's backstop covers its
/// store write and this (`device_sync_deadline` in `http/layer/timeout.rs`), so a slow store's answer is the
/// documented retryable `SYNC_UNVERIFIED`, not the backstop's generic 503.
pub const READ_BACK_BUDGET: std::time::Duration = std::time::Duration::from_secs(4);

/// What a read of one device's batches on one account shows of a run.
///
/// A device's batches on an account hold rising sequences in rising versions (the store
/// refuses a sequence at or below the device's mark), so one event of the device's places the
/// run: below it when its sequence is higher than the run's, above it when lower.
struct RunRead {
    first: u64,
    last: u64,
    /// The run's sequences found, each with its event.
    found: BTreeMap<u64, Event>,
    /// `Trimmed` once the read is done if part of the stream was trimmed away and nothing
    /// read places the run above the trim.
    reach: Reach,
    /// The sequences of this device's read (`None`: none). A missing sequence of the run
    /// below the highest never landed, once the read covers every version where it could
    /// stand. One below the run's places the run above it.
    seen: Option<SeqSpan>,
    /// The sequences of this device's in the window being read: taken in by
    /// [`RunRead::absorb`], read and cleared by [`RunRead::decided`].
    window: Option<SeqSpan>,
}

impl RunRead {
    fn new(run: &DeviceRun) -> Self {
        Self {
            first: run.first_seq(),
            last: run.last_seq(),
            found: BTreeMap::new(),
            reach: Reach::Whole,
            seen: None,
            window: None,
        }
    }

    /// Takes in the device's batches of one page.
    fn absorb<'b>(&mut self, batches: impl Iterator<Item = &'b Batch>) {
        for e in batches.flat_map(|b| b.events.iter()) {
            if (self.first..=self.last).contains(&e.client_seq) {
                self.found.entry(e.client_seq).or_insert_with(|| e.clone());
            }
            self.seen = Some(SeqSpan::with(self.seen, e.client_seq));
            self.window = Some(SeqSpan::with(self.window, e.client_seq));
        }
    }

    /// Whether an event of this device's with a sequence below the run's was read.
    fn saw_earlier(&self) -> bool {
        self.seen.is_some_and(|s| s.lowest < self.first)
    }

    /// Whether reading on can no longer change the verdict, after a window from the `side`
    /// of the unread range: every sequence of the run was found (runs have no gaps); or,
    /// from the top, an earlier sequence was, above which every version is read and below
    /// which none of the run's can stand; or, from the bottom (above the device's hint), a
    /// later one was, once an earlier one was read above the hint too: until then the run
    /// may stand below the hint, which says nothing for sure.
    fn decided(&mut self, side: Side) -> bool {
        let window = self.window.take();
        let placed = match side {
            Side::Top => window.is_some_and(|w| w.lowest < self.first),
            Side::Bottom => window.is_some_and(|w| w.highest > self.last) && self.saw_earlier(),
        };
        placed || self.found.len() as u64 > self.last - self.first
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::account::Identity;
    use crate::device::error::SyncCode;
    use crate::device::ingest::DeviceSync;
    use crate::device::ingest::tests::{ACCOUNT, DEVICE, event, request};
    use crate::device::protocol::SyncStatus;
    use crate::store::memory::MemoryLog;

    /// The memory store, bent one way: 2002s that leave out the committed sequence, or
    /// reads that take longer than a read-back may.
    struct Bent {
        inner: Arc<MemoryLog>,
        hide_mark: bool,
        slow_reads: bool,
    }

    #[async_trait::async_trait]
    impl crate::store::EventLog for Bent {
        async fn write(
            &self,
            client_id: crate::store::ClientId,
            writes: Vec<crate::store::AggregateWrite>,
        ) -> crate::store::StoreResult<Vec<u64>> {
            match self.inner.write(client_id, writes).await {
                Err(StoreError::IdempotencyViolation { attempted_seq, .. }) if self.hide_mark => {
                    Err(StoreError::IdempotencyViolation {
                        last_seq: None,
                        attempted_seq,
                    })
                }
                other => other,
            }
        }
        async fn read(
            &self,
            key: crate::store::AggregateKey,
            filter: &crate::store::ReadFilter,
        ) -> crate::store::StoreResult<crate::store::ReadPage> {
            if self.slow_reads {
                tokio::time::sleep(READ_BACK_BUDGET * 2).await;
            }
            self.inner.read(key, filter).await
        }
        async fn details(
            &self,
            key: crate::store::AggregateKey,
        ) -> crate::store::StoreResult<crate::store::AggregateDetails> {
            self.inner.details(key).await
        }
        async fn trim_start(
            &self,
            key: crate::store::AggregateKey,
            keep_from_version: u64,
        ) -> crate::store::StoreResult<()> {
            self.inner.trim_start(key, keep_from_version).await
        }
    }

    fn bent(hide_mark: bool, slow_reads: bool) -> (Arc<MemoryLog>, DeviceSync) {
        let inner = Arc::new(MemoryLog::new());
        let log = Bent {
            inner: inner.clone(),
            hide_mark,
            slow_reads,
        };
        (inner, DeviceSync::new(Arc::new(log), Identity::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_back_slower_than_its_budget_is_unverified_within_it() {
        let (_log, core) = bent(false, true);
        let run = request((1..=3).map(|s| event(s, "deposit", 10)).collect());
        core.handle(DEVICE, &run).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = core.handle(DEVICE, &run).await.unwrap_err();
        assert_eq!(err.code(), SyncCode::SyncUnverified, "{err}");
        assert_eq!(started.elapsed(), READ_BACK_BUDGET);
    }

    #[tokio::test]
    async fn a_2002_without_the_mark_is_settled_by_the_stream_never_called_a_straddle() {
        let (log, core) = bent(true, false);
        let run = request((1..=3).map(|s| event(s, "deposit", 10)).collect());
        core.handle(DEVICE, &run).await.unwrap();
        // A lost ack's resend: the stream shows the run, so it is synced.
        let again = core.handle(DEVICE, &run).await.unwrap();
        assert_eq!(again.status, SyncStatus::AlreadySynced);
        assert_eq!(again.last_seq, 3);
        // A run the stream shows only in part (the mark, unknown here, is inside it) is
        // retried, not refused for good.
        let grown = request((2..=5).map(|s| event(s, "deposit", 10)).collect());
        let err = core.handle(DEVICE, &grown).await.unwrap_err();
        assert!(err.is_retryable(), "{err}");
        let key = Identity::default().key(ACCOUNT.parse().unwrap());
        assert_eq!(log.batch_count(key), 1);
    }
}
