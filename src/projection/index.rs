//! The recent-writes index of one account: event id -> the response that write produced and
//! what it wrote, for a bounded window.
//!
//! It restores a lost response; it does not prevent double writes (the store's client
//! sequence check does that). Entries are kept in insertion order beside the map, so expiry
//! pops from the front without scanning.

use std::collections::{HashMap, VecDeque};

use crate::account::AccountEvent;

/// The response one write produced on one account, and what it wrote there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecentWrite {
    /// The account's balance right after this event.
    pub balance: i64,
    /// The version of the batch that carried the event.
    pub version: u64,
    /// Local monotonic time (ms) at which the entry stops answering.
    pub expires_at_ms: u64,
    /// The event itself: the fingerprint a reused key is checked against.
    pub event: AccountEvent,
}

type Map = HashMap<u128, RecentWrite, foldhash::fast::RandomState>;

/// One account's index. Empty indexes cost one pointer, so idle accounts stay small.
#[derive(Default)]
pub struct RecentIndex {
    inner: Option<Box<Inner>>,
}

#[derive(Default)]
struct Inner {
    map: Map,
    /// (expires_at_ms, event id) in insertion order; expiries are near-monotonic in it.
    order: VecDeque<(u64, u128)>,
}

impl RecentIndex {
    /// Records `write` under `event_id`. A second record of the same id keeps the later
    /// expiry, so a fold that re-indexes a write never shortens the writer's full window.
    pub fn insert(&mut self, event_id: u128, write: RecentWrite) {
        let inner = self.inner.get_or_insert_with(Box::default);
        let expires = match inner.map.get(&event_id) {
            Some(old) if old.expires_at_ms > write.expires_at_ms => old.expires_at_ms,
            _ => write.expires_at_ms,
        };
        inner.map.insert(
            event_id,
            RecentWrite {
                expires_at_ms: expires,
                ..write
            },
        );
        inner.order.push_back((expires, event_id));
    }

    /// Reserves room for `n` more entries (a long catch-up knows its size up front).
    pub fn reserve(&mut self, n: usize) {
        let inner = self.inner.get_or_insert_with(Box::default);
        inner.map.reserve(n);
        inner.order.reserve(n);
    }

    /// The live entry for `event_id`; an expired entry is a miss.
    pub fn get(&self, event_id: u128, now_ms: u64) -> Option<RecentWrite> {
        let w = self.inner.as_ref()?.map.get(&event_id)?;
        (w.expires_at_ms > now_ms).then_some(*w)
    }

    /// Drops entries that expired at or before `now_ms`, oldest first; returns how many.
    pub fn evict_expired(&mut self, now_ms: u64) -> usize {
        let Some(inner) = self.inner.as_mut() else {
            return 0;
        };
        let mut evicted = 0;
        while let Some(&(expires, id)) = inner.order.front() {
            if expires > now_ms {
                break;
            }
            inner.order.pop_front();
            // The map may hold a newer record of the same id with a later expiry.
            if inner
                .map
                .get(&id)
                .is_some_and(|w| w.expires_at_ms <= now_ms)
            {
                inner.map.remove(&id);
                evicted += 1;
            }
        }
        if inner.map.is_empty() {
            self.inner = None;
        } else if inner.order.capacity() > 64 && inner.order.len() < inner.order.capacity() / 4 {
            inner.order.shrink_to_fit();
            inner.map.shrink_to_fit();
        }
        evicted
    }

    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| i.map.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(expires_at_ms: u64) -> RecentWrite {
        RecentWrite {
            balance: 1,
            version: 1,
            expires_at_ms,
            event: AccountEvent::Deposited { amount: 1 },
        }
    }

    #[test]
    fn an_expired_entry_is_a_miss_and_is_evicted_in_order() {
        let mut idx = RecentIndex::default();
        idx.insert(1, write(100));
        idx.insert(2, write(200));
        assert!(idx.get(1, 99).is_some());
        assert!(idx.get(1, 100).is_none());
        assert_eq!(idx.evict_expired(150), 1);
        assert_eq!(idx.len(), 1);
        assert!(idx.get(2, 150).is_some());
        assert_eq!(idx.evict_expired(200), 1);
        assert!(idx.is_empty());
    }

    #[test]
    fn re_indexing_a_write_never_shortens_its_lifetime() {
        let mut idx = RecentIndex::default();
        idx.insert(7, write(900));
        idx.insert(7, write(300));
        assert_eq!(idx.get(7, 500).map(|w| w.expires_at_ms), Some(900));
        // The stale order record at 300 must not evict the entry that lives to 900.
        assert_eq!(idx.evict_expired(500), 0);
        assert!(idx.get(7, 500).is_some());
    }
}
