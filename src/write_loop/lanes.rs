//! The write side's per-account lanes and batching: the gate that one writer of this replica
//! holds while it writes an account, the queue of single-account requests waiting to go out
//! with it ([`Lane::join`], [`Lane::turn`]), and how a writer takes them out as one batch
//! ([`Lane::take_batch`]). The service runs each batch.
//!
//! The queue is bounded by a count of free places ([`Lane::room`]): a request takes one before
//! it joins the queue, and the writer that takes requests out gives theirs back, so a
//! request over the cap waits, first come first served, for a place instead of being turned
//! away while the writer is about to drain the queue.
//!
//! A lane exists only while someone uses it: each user holds a [`LaneGuard`], and the last
//! guard to drop removes the lane from the map. So the map is bounded by the requests in
//! flight, and the projection (which evicts idle accounts on its own schedule) knows nothing
//! about writes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use dashmap::DashMap;
use parking_lot::Mutex;
use tokio::sync::{Semaphore, oneshot};

use super::error::WriteError;
use super::{Answer, WriteRequest};
use crate::account::AccountId;

/// A single-account request waiting in its account's lane for a writer.
pub(super) struct QueuedWrite {
    pub req: WriteRequest,
    pub reply: oneshot::Sender<Answer>,
    /// When the request reached the write side: its deadline counts from here.
    pub arrived: Instant,
}

/// One account's lane.
pub(super) struct Lane {
    /// Held by the one task writing this account from this replica.
    gate: tokio::sync::Mutex<()>,
    /// Single-account operations waiting to be written together.
    queue: Mutex<VecDeque<QueuedWrite>>,
    /// Free places in `queue`: taken (and forgotten) by a request as it joins, given back by
    /// the writer for every request it takes out. Starts at the queue's cap.
    room: Semaphore,
}

impl Lane {
    fn new(cap: usize) -> Self {
        Self {
            gate: tokio::sync::Mutex::new(()),
            queue: Mutex::new(VecDeque::new()),
            room: Semaphore::new(cap.max(1)),
        }
    }
}

type LaneMap = DashMap<AccountId, Arc<Lane>, foldhash::fast::RandomState>;

/// Every account this replica is writing right now.
pub(super) struct Lanes {
    map: LaneMap,
    /// The most requests one lane's queue holds.
    cap: usize,
}

impl Lanes {
    pub fn new(cap: usize) -> Self {
        Self {
            map: LaneMap::default(),
            cap,
        }
    }

    /// The account's lane, created if no one is using it.
    pub fn enter(&self, account: AccountId) -> LaneGuard<'_> {
        let lane = self
            .map
            .entry(account)
            .or_insert_with(|| Arc::new(Lane::new(self.cap)))
            .clone();
        LaneGuard {
            map: &self.map,
            account,
            lane,
        }
    }

    /// How many lanes are open (accounts with a request in flight on this replica).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// A user's hold on a lane; the last one to drop removes the lane.
pub(super) struct LaneGuard<'a> {
    map: &'a LaneMap,
    account: AccountId,
    lane: Arc<Lane>,
}

impl std::ops::Deref for LaneGuard<'_> {
    type Target = Lane;

    fn deref(&self) -> &Lane {
        &self.lane
    }
}

impl Drop for LaneGuard<'_> {
    fn drop(&mut self) {
        // Under the shard's write lock no one can clone the lane out of the map, so a count
        // of two (the map's and ours) means no one else holds it.
        self.map.remove_if(&self.account, |_, lane| {
            Arc::ptr_eq(lane, &self.lane) && Arc::strong_count(lane) == 2
        });
    }
}

/// A request's place in its lane's queue: where its answer comes.
pub(super) struct Queued(oneshot::Receiver<Answer>);

/// Why a request found no place in its lane's queue.
#[derive(Debug)]
pub(super) enum NoPlace {
    /// Its deadline passed while it waited for one.
    DeadlinePassed,
    /// The lane's count of places was closed (never done: an invariant).
    RoomClosed,
}

/// What a queued request does next.
pub(super) enum Turn<'a> {
    /// It has its answer (from a writer ahead of it).
    Answered(Answer),
    /// It holds the lane's gate: it writes what is queued.
    Write(tokio::sync::MutexGuard<'a, ()>),
}

/// What a writer takes out of its lane's queue at once.
pub(super) struct Taken {
    /// To write together, in arrival order.
    pub batch: Vec<QueuedWrite>,
    /// Past their deadline (counted from arrival) while queued: never sent, to be answered
    /// retryably.
    pub expired: Vec<QueuedWrite>,
}

impl Lane {
    /// Queues a single-account request in this lane, once a place is free. A full queue
    /// drains by a batch per store write, so a place usually frees within a round trip:
    /// a request waits for one (in arrival order) rather than being refused when it would
    /// have been written, but never past `deadline`.
    pub async fn join(
        &self,
        req: WriteRequest,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<Queued, NoPlace> {
        match tokio::time::timeout_at(deadline, self.room.acquire()).await {
            Ok(Ok(place)) => place.forget(),
            Ok(Err(_)) => return Err(NoPlace::RoomClosed),
            Err(_) => return Err(NoPlace::DeadlinePassed),
        }
        let (reply, rx) = oneshot::channel();
        self.queue.lock().push_back(QueuedWrite {
            req,
            reply,
            arrived,
        });
        Ok(Queued(rx))
    }

    /// Waits until `queued` is answered or holds the gate. The writer ahead usually answers
    /// it in its batch: that answer is taken as soon as it comes, rather than queueing for
    /// the gate only to find it.
    pub async fn turn(&self, queued: &mut Queued) -> Turn<'_> {
        let gate = tokio::select! {
            biased;
            answer = &mut queued.0 => {
                return Turn::Answered(answer.unwrap_or_else(|_| Err(writer_vanished())));
            }
            gate = self.gate.lock() => gate,
        };
        match queued.0.try_recv() {
            Ok(answer) => Turn::Answered(answer),
            Err(_) => Turn::Write(gate),
        }
    }

    /// Takes the next batch out of the queue, at most `max` requests in arrival order, and
    /// gives the places it frees back to the lane. A request whose `deadline` (counted from
    /// its arrival) passed while it queued is taken out as expired.
    pub fn take_batch(&self, max: usize, deadline: Duration) -> Taken {
        let now = Instant::now();
        let max = max.max(1);
        let mut q = self.queue.lock();
        let mut taken = Taken {
            batch: Vec::with_capacity(q.len().min(max)),
            expired: Vec::new(),
        };
        let mut places = 0;
        while taken.batch.len() < max {
            let Some(next) = q.pop_front() else { break };
            places += 1;
            if now.duration_since(next.arrived) >= deadline {
                taken.expired.push(next);
            } else {
                taken.batch.push(next);
            }
        }
        drop(q);
        self.room.add_permits(places);
        taken
    }
}

impl Queued {
    /// Its answer, from the writer that took it out of the queue.
    pub async fn answer(self) -> Answer {
        self.0.await.unwrap_or_else(|_| Err(writer_vanished()))
    }
}

/// A queued request's writer took it and ended without answering: only possible when that
/// writer's task was cancelled mid-run (the runtime shutting down), after which the request
/// may or may not have been sent. Retryable (a retry with the same key settles it), never a
/// success.
fn writer_vanished() -> WriteError {
    WriteError::Unverifiable {
        reason: "the account's writer ended before answering".into(),
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;

    /// Rule: the lane map holds only accounts being written, so it is bounded by the requests
    /// in flight, not by every account ever written.
    #[test]
    fn a_lane_is_removed_when_its_last_user_leaves() {
        let lanes = Lanes::new(4);
        let account = AccountId(Uuid::from_u128(7));
        let first = lanes.enter(account);
        let second = lanes.enter(account);
        assert!(
            Arc::ptr_eq(&first.lane, &second.lane),
            "one lane per account"
        );
        drop(first);
        assert_eq!(lanes.len(), 1, "still in use by the second");
        drop(second);
        assert_eq!(lanes.len(), 0);
    }
}
