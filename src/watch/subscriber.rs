//! One stream's task: replays from the resume point, then follows the hub's frames, sends
//! keep-alives, and ends with a reason. It ends at once when the client goes away (its
//! HTTP body is dropped), releasing its place.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

use super::channel::{Cursor, delta_of, frame_of};
use super::{
    AccountFrame, END_LAGGED, EndReason, Hub, Item, Place, Resume, WriteFrame, end_reason,
};
use crate::account::AccountId;
use crate::store::{AggregateKey, Batch, BatchStream, EventLog, ReadFilter, StoreError};

/// How a stream stopped.
enum Stop {
    /// The client went away: nothing more to send.
    Gone,
    /// The client took nothing for the stall limit: it stopped reading. Nothing more can
    /// reach it either; its place goes back.
    Stalled,
    End(EndReason),
}

/// Sends one item, waiting at most the stall limit for room: the client having gone, or
/// having stopped reading, is a [`Stop`]. Without the limit a client that keeps its
/// connection open and reads nothing would hold its place for ever.
async fn send(hub: &Hub, out: &mpsc::Sender<Item>, item: Item) -> Result<(), Stop> {
    match tokio::time::timeout(hub.limits.stall_limit(), out.send(item)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Stop::Gone),
        Err(_) => Err(Stop::Stalled),
    }
}

/// Ends the stream: counts why, and tells the client if it is still there and reading.
async fn finish(hub: &Hub, out: &mpsc::Sender<Item>, end: &AtomicU8, stop: Stop) {
    match stop {
        Stop::Gone => {}
        // A stream the hub already dropped as lagged was counted then.
        Stop::Stalled if end.load(Ordering::SeqCst) == END_LAGGED => {}
        Stop::Stalled => hub.count_stalled(),
        Stop::End(reason) => {
            hub.count_end(&reason);
            let _ = send(hub, out, Item::End(reason)).await;
        }
    }
}

pub(super) struct AccountTask {
    pub hub: Arc<Hub>,
    pub account: AccountId,
    pub resume: Resume,
    /// Where the channel stood when this subscriber joined: frames follow from after it.
    pub at: Cursor,
    pub frames: mpsc::Receiver<Arc<AccountFrame>>,
    pub end: Arc<AtomicU8>,
    pub out: mpsc::Sender<Item>,
    pub place: Place,
}

impl AccountTask {
    pub async fn run(mut self) {
        let stop = match self.stream().await {
            Ok(never) => match never {},
            Err(stop) => stop,
        };
        finish(&self.hub, &self.out, &self.end, stop).await;
        drop(self.place);
    }

    async fn stream(&mut self) -> Result<std::convert::Infallible, Stop> {
        let at = self.at;
        let mut next = match self.resume {
            Resume::Live => {
                let snapshot = Item::Snapshot {
                    account: self.account,
                    version: at.version,
                    balance_cents: at.balance,
                };
                send(&self.hub, &self.out, snapshot).await?;
                at.version + 1
            }
            Resume::From(from) => {
                let from = from.max(1);
                if from <= at.version {
                    self.replay(from).await?;
                }
                from.max(at.version + 1)
            }
        };
        let keepalive = self.hub.limits.keepalive();
        let mut last = next.checked_sub(1).filter(|v| *v > 0);
        loop {
            tokio::select! {
                biased;
                _ = self.out.closed() => return Err(Stop::Gone),
                frame = self.frames.recv() => {
                    let Some(frame) = frame else {
                        return Err(Stop::End(end_reason(&self.end, last)));
                    };
                    // Below a resume point that was ahead of the channel: already had.
                    if frame.version < next {
                        continue;
                    }
                    if frame.version > next {
                        // The channel fans out every version in order; a hole is a bug.
                        tracing::error!(account = %self.account, expected = next, got = frame.version, "watch frames skipped a version");
                        return Err(Stop::End(EndReason::StoreError(format!(
                            "internal: expected version {next}, got {}", frame.version
                        ))));
                    }
                    next = frame.version + 1;
                    last = Some(frame.version);
                    send(&self.hub, &self.out, Item::Events(frame)).await?;
                }
                _ = tokio::time::sleep(keepalive) => send(&self.hub, &self.out, Item::KeepAlive).await?,
            }
        }
    }

    /// Sends versions `from..=at.version` from the store, with the balance after each
    /// event: the balance before `from` is the joined balance minus what the replayed
    /// batches added, so the range is read twice rather than held (the hub bounds the
    /// range before the stream starts: `--watch-max-replay` versions, `Hub::check_replay`;
    /// held, up to 2,048 streams' ranges could be in memory at once). Both passes read
    /// exactly the same versions ([`RangeRead`]), so the balances line up.
    async fn replay(&mut self, from: u64) -> Result<(), Stop> {
        let projection = &self.hub.projection;
        let log = projection.log().clone();
        let key = projection.identity().key(self.account);
        let ours = projection.identity().client();
        let to = self.at.version;
        // Pass one: where the replay really starts, and what it adds to the balance.
        let mut start = from;
        let mut added: Option<i64> = Some(0);
        let mut range = RangeRead::new(log.as_ref(), key, start, to);
        loop {
            match range.next_page().await {
                Ok(Some(page)) => {
                    for b in &page {
                        added = added.and_then(|a| delta_of(b).and_then(|d| a.checked_add(d)));
                    }
                }
                Ok(None) => break,
                Err(RangeError::Store(StoreError::Trimmed { min_available }))
                    if start == from && range.next == from =>
                {
                    let trimmed = Item::Trimmed {
                        from_version: from,
                        first_available: min_available,
                    };
                    send(&self.hub, &self.out, trimmed).await?;
                    start = min_available;
                    range = RangeRead::new(log.as_ref(), key, start, to);
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Pass two: the frames.
        let mut balance = self
            .at
            .balance
            .zip(added)
            .and_then(|(b, a)| b.checked_sub(a));
        let mut range = RangeRead::new(log.as_ref(), key, start, to);
        while let Some(page) = range.next_page().await? {
            for b in &page {
                let frame = frame_of(self.account, b, ours, &mut balance).map_err(|reason| {
                    Stop::End(EndReason::Unreadable {
                        version: b.version,
                        reason,
                    })
                })?;
                send(&self.hub, &self.out, Item::Events(Arc::new(frame))).await?;
            }
        }
        Ok(())
    }
}

/// Reads in a row that a lagging replica of the store may cut short, with no version
/// gained, before a replay gives up (as the channel's own advance does).
const REPLAY_READ_ATTEMPTS: u32 = 5;
/// The pause between those reads (fixed, as the channel's).
const REPLAY_REREAD_PAUSE: Duration = Duration::from_millis(20);

/// Why a replay range could not be read whole.
enum RangeError {
    Store(StoreError),
    /// The store's reads kept ending before the range did.
    Short {
        reached: u64,
        to: u64,
    },
}

impl From<RangeError> for Stop {
    fn from(e: RangeError) -> Self {
        let message = match e {
            // The class only: the message reaches the stream's caller; the log has the rest.
            RangeError::Store(e) => e.brief(),
            RangeError::Short { reached, to } => format!(
                "the store's reads stop at version {reached} of a replay up to {to}; resume again"
            ),
        };
        Stop::End(EndReason::StoreError(message))
    }
}

/// Versions `from..=to` of one account, each exactly once and in order, however the
/// store's reads cut them. A read served by a lagging replica of the store ends early or
/// skips versions, without an error: such a read is made again from the first missing
/// version, and a range still short after [`REPLAY_READ_ATTEMPTS`] reads without progress
/// ends the stream with an error event (the client resumes from its last id). A stream
/// never goes live over a hole, and the two passes of a replay see the same batches.
struct RangeRead<'a> {
    log: &'a dyn EventLog,
    key: AggregateKey,
    /// The next version to hand out.
    next: u64,
    to: u64,
    stream: BatchStream<'a>,
    stalls: u32,
}

impl<'a> RangeRead<'a> {
    fn new(log: &'a dyn EventLog, key: AggregateKey, from: u64, to: u64) -> Self {
        Self {
            log,
            key,
            next: from,
            to,
            stream: BatchStream::new(log, key, Self::window(from, to)),
            stalls: 0,
        }
    }

    fn window(from: u64, to: u64) -> ReadFilter {
        ReadFilter {
            from_version: from,
            to_version: Some(to),
            ..ReadFilter::default()
        }
    }

    /// The next batches of the range, in order; `None` once `to` was handed out.
    async fn next_page(&mut self) -> Result<Option<Vec<Batch>>, RangeError> {
        while self.next <= self.to {
            let page = match self.stream.next_page().await {
                Ok(Some(page)) => page,
                // A lagging read may not show even the account.
                Ok(None) | Err(StoreError::AggregateNotFound) => Vec::new(),
                Err(e) => return Err(RangeError::Store(e)),
            };
            let mut out = Vec::new();
            let mut hole = false;
            for b in page {
                if b.version < self.next {
                    continue;
                }
                if b.version != self.next || b.version > self.to {
                    hole = b.version > self.next;
                    break;
                }
                self.next += 1;
                out.push(b);
            }
            let short = hole || (!self.stream.has_more() && self.next <= self.to);
            if short {
                // Read again from the first version missing.
                self.stream =
                    BatchStream::new(self.log, self.key, Self::window(self.next, self.to));
            }
            if !out.is_empty() {
                self.stalls = 0;
                return Ok(Some(out));
            }
            if short {
                self.stalls += 1;
                if self.stalls >= REPLAY_READ_ATTEMPTS {
                    return Err(RangeError::Short {
                        reached: self.next - 1,
                        to: self.to,
                    });
                }
                tokio::time::sleep(REPLAY_REREAD_PAUSE).await;
            }
        }
        Ok(None)
    }
}

pub(super) struct AllTask {
    pub hub: Arc<Hub>,
    pub frames: mpsc::Receiver<Arc<WriteFrame>>,
    pub end: Arc<AtomicU8>,
    pub out: mpsc::Sender<Item>,
    pub place: Place,
}

impl AllTask {
    pub async fn run(mut self) {
        let stop = self.stream().await;
        finish(&self.hub, &self.out, &self.end, stop).await;
        drop(self.place);
    }

    async fn stream(&mut self) -> Stop {
        let keepalive = self.hub.limits.keepalive();
        loop {
            let item = tokio::select! {
                biased;
                _ = self.out.closed() => return Stop::Gone,
                frame = self.frames.recv() => match frame {
                    Some(frame) => Item::Write(frame),
                    None => return Stop::End(end_reason(&self.end, None)),
                },
                _ = tokio::time::sleep(keepalive) => Item::KeepAlive,
            };
            if let Err(stop) = send(&self.hub, &self.out, item).await {
                return stop;
            }
        }
    }
}
