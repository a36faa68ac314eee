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
//!
//! Files: this one (the index's API and what an entry answers), `record` (how an entry is
//! packed into a 56-byte record and unpacked), `table` (the deque and the slot table that
//! finds records), `evict` (expiry from the front, and shrinking after it), `bulk` (appends
//! indexed in one pass, as a fold makes them) and `tests`.

mod bulk;
mod evict;
mod record;
mod table;
#[cfg(test)]
mod tests;

use crate::account::AccountEvent;

pub use bulk::{Bulk, BulkMark};
use table::{EMPTY, Inner};

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
const WRITE_TAG_BITS: u32 = 27;

/// The tag of an event written with `client_seq` at `timestamp_ms`: a mix of both, cut to
/// [`WRITE_TAG_BITS`]. Equal for the same write; for two different writes equal only by a
/// 1-in-2^27 chance, and then a landing is taken as possibly one's own (never a wrong
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
