//! One stream's task: replays from the resume point, then follows the hub's frames, sends
//! keep-alives, and ends with a reason. It ends at once when the client goes away (its
//! HTTP body is dropped), releasing its place.

use std::sync::Arc;
use std::sync::atomic::AtomicU8;

use tokio::sync::mpsc;

use super::channel::{Cursor, delta_of, frame_of};
use super::{AccountFrame, EndReason, Hub, Item, Place, Resume, WriteFrame, end_reason};
use crate::account::AccountId;
use crate::store::{BatchStream, ReadFilter, StoreError};

/// How a stream stopped.
enum Stop {
    /// The client went away: nothing more to send.
    Gone,
    End(EndReason),
}

/// Sends one item; the client having gone is a [`Stop`].
async fn send(out: &mpsc::Sender<Item>, item: Item) -> Result<(), Stop> {
    out.send(item).await.map_err(|_| Stop::Gone)
}

/// Ends the stream: counts why, and tells the client if it is still there.
async fn finish(hub: &Hub, out: &mpsc::Sender<Item>, stop: Stop) {
    if let Stop::End(reason) = stop {
        hub.count_end(&reason);
        let _ = out.send(Item::End(reason)).await;
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
        finish(&self.hub, &self.out, stop).await;
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
                send(&self.out, snapshot).await?;
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
                    send(&self.out, Item::Events(frame)).await?;
                }
                _ = tokio::time::sleep(keepalive) => send(&self.out, Item::KeepAlive).await?,
            }
        }
    }

    /// Sends versions `from..=at.version` from the store, with the balance after each
    /// event: the balance before `from` is the joined balance minus what the replayed
    /// batches added, so the range is read twice rather than held (the hub bounds the
    /// range before the stream starts: `--watch-max-replay` versions, `Hub::check_replay`;
    /// held, up to 2,048 streams' ranges could be in memory at once).
    async fn replay(&mut self, from: u64) -> Result<(), Stop> {
        let projection = &self.hub.projection;
        let log = projection.log().clone();
        let key = projection.identity().key(self.account);
        let ours = projection.identity().client();
        let to = self.at.version;
        let window = |from| ReadFilter {
            from_version: from,
            to_version: Some(to),
            ..ReadFilter::default()
        };
        let store_error = |e: StoreError| Stop::End(EndReason::StoreError(e.to_string()));
        // Pass one: where the replay really starts, and what it adds to the balance.
        let mut start = from;
        let mut added: Option<i64> = Some(0);
        let mut stream = BatchStream::new(log.as_ref(), key, window(start));
        loop {
            match stream.next_page().await {
                Ok(Some(page)) => {
                    for b in &page {
                        added = added.and_then(|a| delta_of(b).and_then(|d| a.checked_add(d)));
                    }
                }
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available }) if start == from => {
                    let trimmed = Item::Trimmed {
                        from_version: from,
                        first_available: min_available,
                    };
                    send(&self.out, trimmed).await?;
                    start = min_available;
                    stream = BatchStream::new(log.as_ref(), key, window(start));
                }
                Err(e) => return Err(store_error(e)),
            }
        }
        // Pass two: the frames.
        let mut balance = self
            .at
            .balance
            .zip(added)
            .and_then(|(b, a)| b.checked_sub(a));
        let mut stream = BatchStream::new(log.as_ref(), key, window(start));
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(e) => return Err(store_error(e)),
            };
            for b in &page {
                let frame = frame_of(self.account, b, ours, &mut balance).map_err(|reason| {
                    Stop::End(EndReason::Unreadable {
                        version: b.version,
                        reason,
                    })
                })?;
                send(&self.out, Item::Events(Arc::new(frame))).await?;
            }
        }
        Ok(())
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
        finish(&self.hub, &self.out, stop).await;
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
            if self.out.send(item).await.is_err() {
                return Stop::Gone;
            }
        }
    }
}
