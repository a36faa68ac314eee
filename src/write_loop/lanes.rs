//! The write side's per-account lanes: the gate that one writer of this replica holds while
//! it writes an account, and the queue of single-account requests waiting to go out with it.
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
