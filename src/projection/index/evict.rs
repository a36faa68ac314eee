//! Ageing out: the entries whose window has passed leave from the front of the records, and
//! an index left mostly empty gives its memory back.

use super::RecentIndex;
use super::table::MIN_SLOTS;

/// Records the deque keeps room for before a shrink is considered.
const SHRINK_ABOVE: usize = 64;

impl RecentIndex {
    /// Drops entries that expired at or before `now_ms`, oldest first; returns how many.
    pub fn evict_expired(&mut self, now_ms: u64) -> usize {
        let Some(inner) = self.inner.as_mut() else {
            return 0;
        };
        let mut evicted = 0;
        while let Some(front) = inner.records.front() {
            if front.expires_at_ms > now_ms {
                break;
            }
            // The id may have a newer record with a later expiry.
            let id = front.id();
            if let Some(i) = inner.find(id, inner.tag(id))
                && inner.record(inner.slots[i]).expires_at_ms <= now_ms
            {
                inner.remove_slot(i);
                evicted += 1;
            }
            inner.pop_front();
        }
        if inner.live == 0 {
            self.inner = None;
        } else {
            if inner.records.capacity() > SHRINK_ABOVE
                && inner.records.len() < inner.records.capacity() / 4
            {
                inner.records.shrink_to_fit();
                inner.parties.shrink_to_fit();
            }
            if inner.slots.len() > MIN_SLOTS && inner.live * 8 < inner.slots.len() {
                let capacity = (inner.live * 2).next_power_of_two();
                inner.rebuild(capacity);
            }
        }
        evicted
    }
}
