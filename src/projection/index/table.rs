//! The lookup side of one account's index: the records in insertion order and the
//! open-addressing table of slots that finds an id's latest record (layout: the module doc).

use std::collections::VecDeque;
use std::hash::BuildHasher;

use super::RecentWrite;
use super::prefetch;
use super::record::Record;

/// An unused slot. Used slots are never 0: their tag has its low bit set.
pub(super) const EMPTY: u64 = 0;
/// The smallest table.
pub(super) const MIN_SLOTS: usize = 16;
/// How far ahead of the insert in progress a bulk commit prefetches slots.
const LOOKAHEAD: usize = 32;
/// The largest pending-tag buffer kept between bulks (a catch-up page's worth).
const TAG_BUFFER_KEEP: usize = 4096;
/// The most records one index may hold. A slot stores the low 32 bits of its record's
/// sequence, and [`Inner::position`] subtracts the front's low 32 bits, wrapping: that is the
/// record's position exactly while every position is below 2^32. Beyond it two records
/// would share a position and a lookup would answer with the wrong one, so it is an
/// impossible state, asserted. (It would take 240 GB of records, and the replica-wide
/// entry cap refuses new writes long before: it is not a limit anyone meets.)
pub(super) const MAX_RECORDS: u64 = 1 << 32;

/// Panics unless `len` records can all be addressed by a 32-bit position (see
/// [`MAX_RECORDS`]).
#[inline]
pub(super) fn assert_addressable(len: usize) {
    assert!(
        len as u64 <= MAX_RECORDS,
        "recent-writes index holds {len} records, beyond the {MAX_RECORDS} a 32-bit position addresses"
    );
}

/// 32 hash bits with the low bit forced on, so a used slot is never [`EMPTY`].
#[inline]
fn tag_of(hash: u64) -> u32 {
    ((hash >> 32) as u32) | 1
}

/// The slot a tag probes from. Uses the tag's 31 hash bits, so a table can be rebuilt from
/// its slots alone (up to 2^31 slots).
#[inline]
fn home(tag: u32, mask: usize) -> usize {
    (tag >> 1) as usize & mask
}

#[inline]
fn slot_tag(slot: u64) -> u32 {
    (slot >> 32) as u32
}

pub(super) struct Inner {
    pub(super) hasher: foldhash::fast::RandomState,
    /// Every record not yet expired out, oldest first.
    pub(super) records: VecDeque<Record>,
    /// The insertion sequence number of `records[0]`.
    pub(super) front_seq: u64,
    /// Power-of-two table: [`EMPTY`], or (tag << 32) | (low 32 bits of the record's sequence).
    pub(super) slots: Vec<u64>,
    /// Used slots: distinct ids indexed.
    pub(super) live: usize,
    /// Records with a sequence below this are indexed; later ones were appended by a bulk
    /// ([`super::RecentIndex::bulk`]) that has not committed yet.
    pub(super) indexed_seq: u64,
    /// The tags of those pending records, in order, computed as they were appended.
    pub(super) pending_tags: Vec<u32>,
    /// The parties of the records that have one ([`Record::has_party`]), in record order.
    pub(super) parties: VecDeque<[u8; 16]>,
    /// The sequence number of `parties[0]`.
    pub(super) parties_front_seq: u64,
}

impl Inner {
    pub(super) fn new() -> Self {
        Self {
            hasher: foldhash::fast::RandomState::default(),
            records: VecDeque::new(),
            front_seq: 0,
            slots: vec![EMPTY; MIN_SLOTS],
            live: 0,
            indexed_seq: 0,
            pending_tags: Vec::new(),
            parties: VecDeque::new(),
            parties_front_seq: 0,
        }
    }

    /// The sequence the next appended record gets.
    #[inline]
    pub(super) fn end_seq(&self) -> u64 {
        self.front_seq.wrapping_add(self.records.len() as u64)
    }

    #[inline]
    pub(super) fn tag(&self, event_id: u128) -> u32 {
        tag_of(self.hasher.hash_one(event_id))
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Where the record a used slot points at sits in `records`. Sequences are compared in
    /// 32 bits, which is exact while fewer than 2^32 records are held.
    #[inline]
    fn position(&self, slot: u64) -> usize {
        let at = (slot as u32).wrapping_sub(self.front_seq as u32) as usize;
        debug_assert!(at < self.records.len(), "a slot points past the records");
        at
    }

    #[inline]
    pub(super) fn record(&self, slot: u64) -> &Record {
        &self.records[self.position(slot)]
    }

    /// The slot holding `event_id`, if it is indexed.
    pub(super) fn find(&self, event_id: u128, tag: u32) -> Option<usize> {
        let mask = self.mask();
        let mut i = home(tag, mask);
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return None;
            }
            if slot_tag(slot) == tag && self.record(slot).id() == event_id {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Makes room for `additional` more ids at a load of at most one half.
    pub(super) fn grow_for(&mut self, additional: usize) {
        let need = (self.live + additional).saturating_mul(2);
        if need <= self.slots.len() {
            return;
        }
        self.rebuild(need.next_power_of_two());
    }

    /// Re-lays the table at `capacity` slots (a power of two, at least the minimum).
    pub(super) fn rebuild(&mut self, capacity: usize) {
        let capacity = capacity.max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; capacity]);
        let mask = capacity - 1;
        for slot in old.into_iter().filter(|&s| s != EMPTY) {
            let mut i = home(slot_tag(slot), mask);
            while self.slots[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
        }
    }

    /// Appends a record to be indexed by the next [`Inner::commit`].
    #[inline]
    pub(super) fn append(&mut self, event_id: u128, write: RecentWrite) {
        // The hard check runs once per commit; here only in debug builds (the hot path).
        debug_assert!((self.records.len() as u64) < MAX_RECORDS);
        self.pending_tags.push(self.tag(event_id));
        let party_seq = self
            .parties_front_seq
            .wrapping_add(self.parties.len() as u64);
        let (record, party) = Record::pack(event_id, write, party_seq);
        if let Some(party) = party {
            self.parties.push_back(party);
        }
        self.records.push_back(record);
    }

    /// What `record` answers.
    pub(super) fn write_of(&self, record: &Record) -> RecentWrite {
        record.unpack(|seq| self.parties[seq.wrapping_sub(self.parties_front_seq as u32) as usize])
    }

    /// Drops the oldest record (and its counterparty, for a transfer).
    pub(super) fn pop_front(&mut self) {
        if let Some(popped) = self.records.pop_front() {
            self.front_seq = self.front_seq.wrapping_add(1);
            if popped.has_party() {
                self.parties.pop_front();
                self.parties_front_seq = self.parties_front_seq.wrapping_add(1);
            }
        }
    }

    pub(super) fn insert(&mut self, event_id: u128, write: RecentWrite) {
        self.append(event_id, write);
        self.commit();
    }

    /// Indexes the record at position `at` (whose id hashes to `tag`): takes a free slot, or
    /// re-points its id's slot at it, keeping the later expiry.
    #[inline]
    fn place(&mut self, at: usize, tag: u32) {
        let seq = self.front_seq.wrapping_add(at as u64);
        let mask = self.mask();
        let mut i = home(tag, mask);
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                self.live += 1;
                break;
            }
            if slot_tag(slot) == tag {
                let old = self.record(slot);
                if old.id() == self.records[at].id() {
                    // A re-record keeps the later expiry: a fold that re-indexes a write never
                    // shortens the writer's full window.
                    let keep = old.expires_at_ms;
                    let r = &mut self.records[at];
                    r.expires_at_ms = r.expires_at_ms.max(keep);
                    break;
                }
            }
            i = (i + 1) & mask;
        }
        self.slots[i] = (u64::from(tag) << 32) | (seq & u64::from(u32::MAX));
    }

    /// Indexes every record appended since the last commit, in order (so the result is the
    /// same as inserting them one by one). The table is sized once, and each record's slot
    /// is prefetched [`LOOKAHEAD`] records ahead of placing it, so the cache misses of a long
    /// run of inserts overlap instead of queueing one behind the other.
    pub(super) fn commit(&mut self) {
        let end = self.end_seq();
        let tags = std::mem::take(&mut self.pending_tags);
        debug_assert_eq!(tags.len() as u64, end.wrapping_sub(self.indexed_seq));
        if tags.is_empty() {
            self.pending_tags = tags;
            return;
        }
        // Before any slot gets a position that could alias another (one compare per bulk).
        assert_addressable(self.records.len());
        self.grow_for(tags.len());
        let first = self.indexed_seq.wrapping_sub(self.front_seq) as usize;
        let mask = self.mask();
        for &tag in tags.iter().take(LOOKAHEAD) {
            prefetch(&self.slots[home(tag, mask)]);
        }
        for (k, &tag) in tags.iter().enumerate() {
            if let Some(&ahead) = tags.get(k + LOOKAHEAD) {
                prefetch(&self.slots[home(ahead, mask)]);
            }
            self.place(first + k, tag);
        }
        self.indexed_seq = end;
        // Keep the buffer for the next bulk, unless it was a long one.
        let mut tags = tags;
        tags.clear();
        if tags.capacity() <= TAG_BUFFER_KEEP {
            self.pending_tags = tags;
        }
    }

    /// Empties slot `i`, shifting later members of its probe run back (no tombstones).
    pub(super) fn remove_slot(&mut self, mut i: usize) {
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot == EMPTY {
                break;
            }
            let k = home(slot_tag(slot), mask);
            // Move `slot` into the hole at `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < k && k <= j
            } else {
                i < k || k <= j
            };
            if !stays {
                self.slots[i] = slot;
                i = j;
            }
        }
        self.slots[i] = EMPTY;
        self.live -= 1;
    }
}
