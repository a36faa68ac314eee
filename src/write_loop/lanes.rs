//! The write side's per-account lanes and batching: the gate that one writer of this replica
//! holds while it writes an account, the queue of single-account requests waiting to go out
//! with it ([`WriteService::submit_batched`]), and how a writer takes them out as one batch
//! ([`WriteService::take_batch`]).
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
use tokio::time::Instant;

use dashmap::DashMap;
use parking_lot::Mutex;
use tokio::sync::{Semaphore, oneshot};

use super::service::{WriteService, invariant};
use super::{Answer, WriteError, WriteRequest};
use crate::account::AccountId;
use crate::metrics::refused;

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
    pub gate: tokio::sync::Mutex<()>,
    /// Single-account operations waiting to be written together.
    pub queue: Mutex<VecDeque<QueuedWrite>>,
    /// Free places in `queue`: taken (and forgotten) by a request as it joins, given back by
    /// the writer for every request it takes out. Starts at the queue's cap.
    pub room: Semaphore,
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

impl WriteService {
    /// Queues a single-account request in its account's lane on this replica. Whoever holds
    /// the lane's gate writes everything queued, in arrival order, as one batch.
    pub(super) async fn submit_batched(
        &self,
        account: AccountId,
        req: WriteRequest,
        arrived: Instant,
    ) -> Answer {
        let lane = self.lanes.enter(account);
        // A full queue drains by a batch per store write, so a place usually frees within a
        // round trip: wait for one (in arrival order) rather than refuse a request that
        // would have been written, but never past the request's own deadline.
        let deadline = arrived + self.config.deadline;
        match tokio::time::timeout_at(deadline, lane.room.acquire()).await {
            Ok(Ok(place)) => place.forget(),
            Ok(Err(_)) => return Err(invariant("a lane's room semaphore was closed")),
            Err(_) => {
                return Err(self.refuse(
                    refused::ACCOUNT_QUEUE,
                    "the write waited its whole deadline for room in the account's queue",
                ));
            }
        }
        let (reply, mut rx) = oneshot::channel();
        lane.queue.lock().push_back(QueuedWrite {
            req,
            reply,
            arrived,
        });
        loop {
            // The writer ahead of us usually answers us in its batch: take that answer as
            // soon as it comes rather than queue for the gate only to find it.
            let _gate = tokio::select! {
                biased;
                answer = &mut rx => return answer.unwrap_or_else(|_| Err(writer_vanished())),
                gate = lane.gate.lock() => gate,
            };
            if let Ok(answer) = rx.try_recv() {
                return answer;
            }
            let batch = self.take_batch(&lane);
            if batch.is_empty() {
                // Our request was taken by a writer that has not answered yet: its answer
                // comes on `rx` (or the writer's task ended before sending anything of ours).
                return rx.await.unwrap_or_else(|_| Err(writer_vanished()));
            }
            let started = batch.iter().map(|q| q.arrived).min().unwrap_or(arrived);
            let (reqs, replies): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|q| (q.req, q.reply)).unzip();
            let answers = self.run(reqs, started).await;
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
    }

    /// Takes the next batch from a lane's queue, in arrival order, and gives the places it
    /// frees back to the lane. A request whose deadline (counted from its arrival) passed
    /// while it queued was never sent: it is answered retryably here and not written.
    fn take_batch(&self, lane: &Lane) -> Vec<QueuedWrite> {
        let now = Instant::now();
        let max = self.config.max_batch_events.max(1);
        let mut q = lane.queue.lock();
        let mut batch = Vec::with_capacity(q.len().min(max));
        let mut taken = 0;
        while batch.len() < max {
            let Some(next) = q.pop_front() else { break };
            taken += 1;
            if now.duration_since(next.arrived) >= self.config.deadline {
                let err = self.refuse(
                    refused::QUEUED_PAST_DEADLINE,
                    "the write waited its whole deadline in the account's queue",
                );
                let _ = next.reply.send(Err(err));
            } else {
                batch.push(next);
            }
        }
        drop(q);
        lane.room.add_permits(taken);
        batch
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
