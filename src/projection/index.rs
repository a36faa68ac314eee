//! The recent-writes index of one account: event id -> the response that write produced and
//! what it wrote, for a bounded window.
//!
//! It restores a lost response; it does not prevent double writes (the store's client
//! sequence check does that).
//!
//! Layout, chosen for the fold's hot path (a cold catch-up indexes every event of the window):
//! records live in insertion order in one deque, appended sequentially, and expiry pops them
//! from the front without scanning. Lookup goes through a compact open-addressing table of
//! 8-byte slots (linear probing, at most half full), each holding 32 bits of the id's hash
//! and the record's position in the deque, so an insert touches one random cache line
//! instead of a map bucket of the whole record. A slot always points at the latest record of
//! its id; older records of the same id stay in the deque until they expire, exactly like
//! the order log of a map-plus-queue index.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use uuid::Uuid;

use crate::account::{AccountEvent, AccountId};

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
    /// [`write_tag`] of the event as one of this service's own batches carried it (its client
    /// sequence and timestamp), when read from the stream; `None` when not known here (a
    /// write recorded on success, a Postgres row, another writer's batch). It tells a run
    /// that lost an answer whether a landing it finds is its own write or another request's:
    /// replicas share one client id and derive the same next sequence from the same fold, so
    /// the sequence alone cannot, but each write stamps its events with its own send time.
    pub write_tag: Option<u32>,
}

/// The bits of a write tag an index entry keeps ([`RecentWrite::write_tag`]).
const WRITE_TAG_BITS: u32 = 29;

/// The tag of an event written with `client_seq` at `timestamp_ms`: a mix of both, cut to
/// [`WRITE_TAG_BITS`]. Equal for the same write; for two different writes equal only by a
/// 1-in-2^29 chance, and then a landing is taken as possibly one's own (never a wrong
/// replay claim).
pub fn write_tag(client_seq: u64, timestamp_ms: u64) -> u32 {
    let mixed = (client_seq ^ timestamp_ms.rotate_left(23)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> (64 - WRITE_TAG_BITS)) as u32
}

/// One account's index. Empty indexes cost one pointer, so idle accounts stay small.
#[derive(Default)]
pub struct RecentIndex {
    inner: Option<Box<Inner>>,
}

/// A record: what one event answers, in 56 bytes. The id is kept as two words (no 16-byte
/// alignment), and the event as its kind and amount; a transfer's counterparty lives in
/// `Inner::parties`, so the other events do not carry 16 unused bytes each. The write tag
/// rides in `meta`'s spare bits.
#[derive(Clone, Copy)]
struct Record {
    id_lo: u64,
    id_hi: u64,
    balance: i64,
    version: u64,
    expires_at_ms: u64,
    amount: i64,
    /// The event kind in the low two bits; bit 2 set when the write tag is known, the tag
    /// in bits 3..32; for a transfer, the low 32 bits of its counterparty's sequence in
    /// `Inner::parties` in the high 32; for an open ([`OPENED`]), bit 32.
    meta: u64,
}

const _: () = assert!(std::mem::size_of::<Record>() == 56);

const KIND_MASK: u64 = 0b11;
const KIND_DEPOSITED: u64 = 0;
const KIND_WITHDRAWN: u64 = 1;
const KIND_TRANSFERRED_OUT: u64 = 2;
const KIND_TRANSFERRED_IN: u64 = 3;
/// An open: kind [`KIND_DEPOSITED`] with this bit, which only a transfer's counterparty bits
/// could otherwise hold (a deposit never sets them), and no amount.
const OPENED: u64 = 1 << 32;
const TAG_KNOWN: u64 = 1 << 2;
const TAG_SHIFT: u32 = 3;
const _: () = assert!(
    TAG_SHIFT + WRITE_TAG_BITS <= 32,
    "the tag stays below the party bits"
);

impl Record {
    fn id(&self) -> u128 {
        (u128::from(self.id_hi) << 64) | u128::from(self.id_lo)
    }

    fn is_transfer(&self) -> bool {
        self.meta & KIND_MASK >= KIND_TRANSFERRED_OUT
    }
}

/// An unused slot. Used slots are never 0: their tag has its low bit set.
const EMPTY: u64 = 0;
/// The smallest table.
const MIN_SLOTS: usize = 16;
/// Records the deque keeps room for before a shrink is considered.
const SHRINK_ABOVE: usize = 64;
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
const MAX_RECORDS: u64 = 1 << 32;

/// Panics unless `len` records can all be addressed by a 32-bit position (see
/// [`MAX_RECORDS`]).
#[inline]
fn assert_addressable(len: usize) {
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

/// Asks the CPU to start loading the cache line of `p`. Only a hint: it reads nothing for
/// the program and cannot fault.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch has no memory-safety preconditions (it never dereferences for the
    // program and cannot fault, whatever the address); it needs SSE, which every x86-64 CPU
    // has and the x86_64 targets enable.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

struct Inner {
    hasher: foldhash::fast::RandomState,
    /// Every record not yet expired out, oldest first.
    records: VecDeque<Record>,
    /// The insertion sequence number of `records[0]`.
    front_seq: u64,
    /// Power-of-two table: [`EMPTY`], or (tag << 32) | (low 32 bits of the record's sequence).
    slots: Vec<u64>,
    /// Used slots: distinct ids indexed.
    live: usize,
    /// Records with a sequence below this are indexed; later ones were appended by a
    /// [`Bulk`] that has not committed yet.
    indexed_seq: u64,
    /// The tags of those pending records, in order, computed as they were appended.
    pending_tags: Vec<u32>,
    /// The counterparties of the transfer records, in record order.
    parties: VecDeque<[u8; 16]>,
    /// The sequence number of `parties[0]`.
    parties_front_seq: u64,
}

impl Inner {
    fn new() -> Self {
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

    /// Appends a record to be indexed by the next [`Inner::commit`].
    #[inline]
    fn append(&mut self, event_id: u128, write: RecentWrite) {
        // The hard check runs once per commit; here only in debug builds (the hot path).
        debug_assert!((self.records.len() as u64) < MAX_RECORDS);
        self.pending_tags.push(self.tag(event_id));
        let (kind, amount, party) = match write.event {
            AccountEvent::Opened => (KIND_DEPOSITED | OPENED, 0, None),
            AccountEvent::Deposited { amount } => (KIND_DEPOSITED, amount, None),
            AccountEvent::Withdrawn { amount } => (KIND_WITHDRAWN, amount, None),
            AccountEvent::TransferredOut { amount, to } => (KIND_TRANSFERRED_OUT, amount, Some(to)),
            AccountEvent::TransferredIn { amount, from } => {
                (KIND_TRANSFERRED_IN, amount, Some(from))
            }
        };
        let mut meta = kind;
        if let Some(tag) = write.write_tag {
            debug_assert!(tag < 1 << WRITE_TAG_BITS, "a write tag fits its bits");
            meta |= TAG_KNOWN | (u64::from(tag & ((1 << WRITE_TAG_BITS) - 1)) << TAG_SHIFT);
        }
        if let Some(party) = party {
            let seq = self
                .parties_front_seq
                .wrapping_add(self.parties.len() as u64);
            meta |= (seq & u64::from(u32::MAX)) << 32;
            self.parties.push_back(*party.0.as_bytes());
        }
        self.records.push_back(Record {
            id_lo: event_id as u64,
            id_hi: (event_id >> 64) as u64,
            balance: write.balance,
            version: write.version,
            expires_at_ms: write.expires_at_ms,
            amount,
            meta,
        });
    }

    /// What `record` answers.
    fn write_of(&self, record: &Record) -> RecentWrite {
        let amount = record.amount;
        let party = || {
            let at = ((record.meta >> 32) as u32).wrapping_sub(self.parties_front_seq as u32);
            AccountId(Uuid::from_bytes(self.parties[at as usize]))
        };
        let event = match record.meta & KIND_MASK {
            KIND_DEPOSITED if record.meta & OPENED != 0 => AccountEvent::Opened,
            KIND_DEPOSITED => AccountEvent::Deposited { amount },
            KIND_WITHDRAWN => AccountEvent::Withdrawn { amount },
            KIND_TRANSFERRED_OUT => AccountEvent::TransferredOut {
                amount,
                to: party(),
            },
            _ => AccountEvent::TransferredIn {
                amount,
                from: party(),
            },
        };
        let write_tag = (record.meta & TAG_KNOWN != 0)
            .then(|| ((record.meta & u64::from(u32::MAX)) >> TAG_SHIFT) as u32);
        RecentWrite {
            balance: record.balance,
            version: record.version,
            expires_at_ms: record.expires_at_ms,
            event,
            write_tag,
        }
    }

    /// Drops the oldest record (and its counterparty, for a transfer).
    fn pop_front(&mut self) {
        if let Some(popped) = self.records.pop_front() {
            self.front_seq = self.front_seq.wrapping_add(1);
            if popped.is_transfer() {
                self.parties.pop_front();
                self.parties_front_seq = self.parties_front_seq.wrapping_add(1);
            }
        }
    }

    /// The sequence the next appended record gets.
    #[inline]
    fn end_seq(&self) -> u64 {
        self.front_seq.wrapping_add(self.records.len() as u64)
    }

    #[inline]
    fn tag(&self, event_id: u128) -> u32 {
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
    fn record(&self, slot: u64) -> &Record {
        &self.records[self.position(slot)]
    }

    /// The slot holding `event_id`, if it is indexed.
    fn find(&self, event_id: u128, tag: u32) -> Option<usize> {
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
    fn grow_for(&mut self, additional: usize) {
        let need = (self.live + additional).saturating_mul(2);
        if need <= self.slots.len() {
            return;
        }
        self.rebuild(need.next_power_of_two());
    }

    /// Re-lays the table at `capacity` slots (a power of two, at least the minimum).
    fn rebuild(&mut self, capacity: usize) {
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

    fn insert(&mut self, event_id: u128, write: RecentWrite) {
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
    fn commit(&mut self) {
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
    fn remove_slot(&mut self, mut i: usize) {
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

impl RecentIndex {
    /// Records `write` under `event_id`. A second record of the same id keeps the later
    /// expiry, so a fold that re-indexes a write never shortens the writer's full window.
    pub fn insert(&mut self, event_id: u128, write: RecentWrite) {
        self.inner
            .get_or_insert_with(|| Box::new(Inner::new()))
            .insert(event_id, write);
    }

    /// Reserves room for `n` more entries (a long catch-up knows its size up front).
    pub fn reserve(&mut self, n: usize) {
        let inner = self.inner.get_or_insert_with(|| Box::new(Inner::new()));
        inner.records.reserve(n);
        inner.pending_tags.reserve(n);
        inner.grow_for(n);
    }

    /// Appends records in bulk; they are indexed when the returned guard is dropped, exactly
    /// as if each had been [`RecentIndex::insert`]ed in turn. Nothing else can use the index
    /// meanwhile: the guard borrows it.
    pub fn bulk(&mut self) -> Bulk<'_> {
        Bulk { index: self }
    }

    /// The live entry for `event_id`; an expired entry is a miss.
    pub fn get(&self, event_id: u128, now_ms: u64) -> Option<RecentWrite> {
        let inner = self.inner.as_ref()?;
        let i = inner.find(event_id, inner.tag(event_id))?;
        let record = inner.record(inner.slots[i]);
        (record.expires_at_ms > now_ms).then(|| inner.write_of(record))
    }

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

    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| i.live)
    }

    /// Every id's latest record (expired or not), in no particular order: what a Postgres
    /// catch-up persists after folding into a scratch index.
    pub fn live_entries(&self) -> Vec<(u128, RecentWrite)> {
        let Some(inner) = self.inner.as_ref() else {
            return Vec::new();
        };
        inner
            .slots
            .iter()
            .filter(|&&slot| slot != EMPTY)
            .map(|&slot| {
                let record = inner.record(slot);
                (record.id(), inner.write_of(record))
            })
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bulk appends to a [`RecentIndex`], indexed on drop. See [`RecentIndex::bulk`].
pub struct Bulk<'a> {
    index: &'a mut RecentIndex,
}

/// Where a [`Bulk`] stood: [`Bulk::rollback`] takes back what was appended after it.
#[derive(Clone, Copy, Debug)]
pub struct BulkMark {
    records: usize,
    parties: usize,
}

impl Bulk<'_> {
    /// Where the bulk stands now.
    #[inline]
    pub fn mark(&self) -> BulkMark {
        self.index.inner.as_deref().map_or(
            BulkMark {
                records: 0,
                parties: 0,
            },
            |inner| BulkMark {
                records: inner.records.len(),
                parties: inner.parties.len(),
            },
        )
    }

    /// Takes back every record appended since `mark`: none of them is indexed yet.
    pub fn rollback(&mut self, mark: BulkMark) {
        let Some(inner) = self.index.inner.as_mut() else {
            return;
        };
        let appended = inner.records.len() - mark.records;
        assert!(
            appended <= inner.pending_tags.len(),
            "only records a bulk appended and has not indexed are taken back"
        );
        inner.records.truncate(mark.records);
        inner
            .pending_tags
            .truncate(inner.pending_tags.len() - appended);
        inner.parties.truncate(mark.parties);
    }

    /// Records `write` under `event_id`, after every record appended before it.
    #[inline]
    pub fn push(&mut self, event_id: u128, write: RecentWrite) {
        self.index
            .inner
            .get_or_insert_with(|| Box::new(Inner::new()))
            .append(event_id, write);
    }
}

impl Drop for Bulk<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.index.inner.as_mut() {
            inner.commit();
        }
    }
}

#[cfg(test)]
impl RecentIndex {
    /// An empty index whose sequences (records and counterparties) start at `seq`, so a
    /// test can cross the 32-bit wrap of positions without 2^32 inserts. (Once emptied by
    /// expiry it starts over at 0, like any index.)
    fn starting_at(seq: u64) -> Self {
        let mut inner = Inner::new();
        inner.front_seq = seq;
        inner.indexed_seq = seq;
        inner.parties_front_seq = seq;
        Self {
            inner: Some(Box::new(inner)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn write(expires_at_ms: u64) -> RecentWrite {
        RecentWrite {
            balance: 1,
            version: 1,
            expires_at_ms,
            event: AccountEvent::Deposited { amount: 1 },
            write_tag: None,
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

    #[test]
    fn a_re_record_answers_with_the_latest_response() {
        let mut idx = RecentIndex::default();
        idx.insert(7, write(900));
        let later = RecentWrite {
            balance: 5,
            version: 4,
            ..write(100)
        };
        idx.insert(7, later);
        assert_eq!(
            idx.get(7, 0),
            Some(RecentWrite {
                expires_at_ms: 900,
                ..later
            })
        );
        assert_eq!(idx.len(), 1);
    }

    #[test]
    fn a_large_index_grows_finds_everything_and_drains_to_nothing() {
        let mut idx = RecentIndex::default();
        let n = 100_000u64;
        for i in 0..n {
            // Ids that differ only in their high word, to exercise the hashing of both.
            idx.insert(u128::from(i) << 64, write(i + 1));
        }
        assert_eq!(idx.len(), n as usize);
        for i in (0..n).step_by(997) {
            assert_eq!(
                idx.get(u128::from(i) << 64, 0).map(|w| w.expires_at_ms),
                Some(i + 1)
            );
        }
        assert!(idx.get(u128::from(n) << 64, 0).is_none());
        assert_eq!(idx.evict_expired(n / 2), (n / 2) as usize);
        assert!(idx.get(u128::from(n / 2) << 64, 0).is_some());
        assert!(idx.get(u128::from(n / 2 - 1) << 64, 0).is_none());
        assert_eq!(idx.evict_expired(n), (n / 2) as usize);
        assert!(idx.is_empty());
        assert!(idx.inner.is_none());
    }

    #[test]
    fn positions_stay_exact_across_the_32_bit_wrap_of_sequences() {
        // Sequences run from 8 below 2^32 to 24 above it, then the front expires past it.
        let start = u64::from(u32::MAX) - 7;
        let mut idx = RecentIndex::starting_at(start);
        let party = |i: u64| AccountId(Uuid::from_u128(u128::from(i) + 1000));
        for i in 0..32u64 {
            let event = if i % 2 == 0 {
                AccountEvent::TransferredOut {
                    amount: i as i64,
                    to: party(i),
                }
            } else {
                AccountEvent::Deposited { amount: i as i64 }
            };
            idx.insert(
                u128::from(i),
                RecentWrite {
                    balance: i as i64,
                    version: i,
                    expires_at_ms: 100 + i,
                    event,
                    write_tag: (!i.is_multiple_of(3)).then(|| write_tag(u64::MAX - i, i)),
                },
            );
        }
        let check = |idx: &RecentIndex, from: u64| {
            for i in from..32u64 {
                let w = idx.get(u128::from(i), 0).expect("indexed");
                assert_eq!((w.version, w.expires_at_ms), (i, 100 + i), "id {i}");
                if i % 2 == 0 {
                    assert_eq!(
                        w.event,
                        AccountEvent::TransferredOut {
                            amount: i as i64,
                            to: party(i)
                        },
                        "id {i}"
                    );
                }
            }
        };
        check(&idx, 0);
        // The front moves past the wrap; what is left still resolves to its own record.
        assert_eq!(idx.evict_expired(100 + 20), 21);
        check(&idx, 21);
        assert!(idx.get(20, 0).is_none());
    }

    #[test]
    fn every_position_below_2_pow_32_is_addressable() {
        assert_addressable(0);
        assert_addressable(MAX_RECORDS as usize);
    }

    #[test]
    #[should_panic(expected = "beyond the 4294967296 a 32-bit position addresses")]
    fn an_index_longer_than_32_bit_positions_address_is_an_assertion() {
        assert_addressable(MAX_RECORDS as usize + 1);
    }

    /// The reference semantics: a map of the latest record per id (with the latest expiry)
    /// plus an insertion-order log of (expiry, id) that eviction pops from the front.
    #[derive(Default)]
    struct Model {
        map: HashMap<u128, RecentWrite>,
        order: VecDeque<(u64, u128)>,
    }

    impl Model {
        fn insert(&mut self, id: u128, w: RecentWrite) {
            let expires = match self.map.get(&id) {
                Some(old) if old.expires_at_ms > w.expires_at_ms => old.expires_at_ms,
                _ => w.expires_at_ms,
            };
            self.map.insert(
                id,
                RecentWrite {
                    expires_at_ms: expires,
                    ..w
                },
            );
            self.order.push_back((expires, id));
        }

        fn get(&self, id: u128, now: u64) -> Option<RecentWrite> {
            self.map.get(&id).filter(|w| w.expires_at_ms > now).copied()
        }

        fn evict(&mut self, now: u64) -> usize {
            let mut n = 0;
            while let Some(&(expires, id)) = self.order.front() {
                if expires > now {
                    break;
                }
                self.order.pop_front();
                if self.map.get(&id).is_some_and(|w| w.expires_at_ms <= now) {
                    self.map.remove(&id);
                    n += 1;
                }
            }
            // An index left with no id is dropped whole, order log included.
            if self.map.is_empty() {
                self.order.clear();
            }
            n
        }
    }

    /// A record of one of the five kinds, its fields derived from the draws; transfers
    /// name a counterparty that differs per record, so a mix-up of parties shows.
    fn drawn(expires: u16, balance: i8, kind: u8, party: u16) -> RecentWrite {
        let amount = i64::from(party) - 300;
        let party = AccountId(uuid::Uuid::from_u128(u128::from(party) * 0x1_0000_0001));
        RecentWrite {
            balance: i64::from(balance),
            version: u64::from(party.0.as_u128() as u16),
            expires_at_ms: u64::from(expires),
            event: match kind % 5 {
                0 => AccountEvent::Deposited { amount },
                1 => AccountEvent::Withdrawn { amount },
                2 => AccountEvent::TransferredOut { amount, to: party },
                3 => AccountEvent::TransferredIn {
                    amount,
                    from: party,
                },
                _ => AccountEvent::Opened,
            },
            // Known for most records, with tags that use every bit (and their neighbours').
            write_tag: (!kind.is_multiple_of(5))
                .then(|| write_tag(u64::from(balance as u8), u64::from(kind))),
        }
    }

    /// (id, expires, balance, kind, party)
    type Draw = (u8, u16, i8, u8, u16);

    fn draw() -> impl Strategy<Value = Draw> {
        (
            any::<u8>(),
            any::<u16>(),
            any::<i8>(),
            any::<u8>(),
            any::<u16>(),
        )
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Draw),
        Get { id: u8, now: u16 },
        Evict { now: u16 },
        Reserve { n: u8 },
        Bulk(Vec<Draw>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => draw().prop_map(Op::Insert),
            3 => (any::<u8>(), any::<u16>()).prop_map(|(id, now)| Op::Get { id, now }),
            1 => any::<u16>().prop_map(|now| Op::Evict { now }),
            1 => any::<u8>().prop_map(|n| Op::Reserve { n }),
            2 => proptest::collection::vec(draw(), 0..40).prop_map(Op::Bulk),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn behaves_exactly_like_a_map_with_an_order_log(
            ops in proptest::collection::vec(op(), 0..400),
            // Sequences from 0, or just below the 32-bit and 64-bit wraps.
            start in prop_oneof![
                Just(0u64),
                (u64::from(u32::MAX) - 300)..=u64::from(u32::MAX),
                (u64::MAX - 300)..=u64::MAX,
            ],
        ) {
            let mut idx = RecentIndex::starting_at(start);
            let mut model = Model::default();
            // Ids spread over both words, from a small space so that ids repeat.
            let id_of = |id: u8| (u128::from(id % 64) << 70) ^ u128::from(id);
            for op in ops {
                match op {
                    Op::Insert((id, expires, balance, kind, party)) => {
                        let w = drawn(expires, balance, kind, party);
                        idx.insert(id_of(id), w);
                        model.insert(id_of(id), w);
                    }
                    Op::Get { id, now } => {
                        prop_assert_eq!(idx.get(id_of(id), u64::from(now)), model.get(id_of(id), u64::from(now)));
                    }
                    Op::Evict { now } => {
                        prop_assert_eq!(idx.evict_expired(u64::from(now)), model.evict(u64::from(now)));
                    }
                    Op::Reserve { n } => idx.reserve(usize::from(n)),
                    Op::Bulk(records) => {
                        let mut bulk = idx.bulk();
                        for &(id, expires, balance, kind, party) in &records {
                            bulk.push(id_of(id), drawn(expires, balance, kind, party));
                        }
                        drop(bulk);
                        for (id, expires, balance, kind, party) in records {
                            model.insert(id_of(id), drawn(expires, balance, kind, party));
                        }
                    }
                }
                prop_assert_eq!(idx.len(), model.map.len());
            }
            for id in 0..=255u8 {
                prop_assert_eq!(idx.get(id_of(id), 0), model.get(id_of(id), 0));
            }
        }
    }
}
