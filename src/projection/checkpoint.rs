//! Checkpoints: an account's folded state at one landed version, kept in a stream of its own
//! so that a cold fold reads only what follows it.
//!
//! The rule (docs/architecture.md, "Checkpoints"):
//! - a checkpoint lives in the account's checkpoint stream ([`Identity::checkpoint_key`]), an
//!   aggregate of Tally's own type: the account stream is never written by it, so the replaced
//!   service and older replicas never see one;
//! - it states the account version it covers, the balance and the highest client sequence of
//!   our client id there, and that version's commit time and batch fingerprint. It is built
//!   only from a fold's state at a version whose batch the writer has just read back from the
//!   store ([`Projection::write_checkpoint`]), never from a decision not yet written;
//! - it carries no recent-writes entries. A keyed one carries the keys landed since the
//!   checkpoint before it ([`Segment`]): a cold fold takes the newest whose chain of keys
//!   reaches back through the retention (`key_chain.rs`), at any age. Without such a chain it
//!   uses only a checkpoint whose commit time is at least a retention older than the server's
//!   now ([`pick`]), so every key the fold must hold lies after it and is folded. Ages are
//!   server time against the replica's estimate of the server's now, which never runs ahead
//!   of it: an underestimate only makes fewer checkpoints eligible;
//! - existence (explicit accounts) needs nothing more: a checkpoint covers a version of at
//!   least 1, so the stream it stands for exists;
//! - before it is used it is checked against the stream ([`Checkpoint::check`]): the batch at
//!   its version must be readable and carry its commit time and fingerprint. A checkpoint past
//!   the tip, one from a store restored from an older copy, or one whose version was trimmed
//!   away is ignored, counted (`tally_checkpoint_loads_total{result="rejected"}`), and the
//!   whole stream is folded: a checkpoint never gives a balance the full fold would not.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use std::num::NonZeroU32;

use uuid::Uuid;

use super::Projection;
use super::keys::Segment;
use crate::account::AccountId;
use crate::account::holds::{Commit, HoldBook, HoldId, OpenHold, Resolution, Resolved};
use crate::store::{Batch, Event, EventType, StoreError, read_whole};

/// The event type of a checkpoint (in the checkpoint stream, never in an account).
pub const CHECKPOINT_EVENT: EventType = EventType { major: 1, minor: 0 };
/// The payload layout's version; a payload of any other is ignored (counted as rejected).
const FORMAT: u8 = 1;
/// The layout that carries the keys of the versions since the checkpoint before
/// ([`Segment`]) after the same fixed part.
const FORMAT_KEYED: u8 = 2;
/// The keyed layout with the account's holds between the fixed part and the keys: a `u32`
/// length, then the open holds and the remembered resolutions ([`encode_holds`]). Written
/// only for an account that has holds; a replica with holds off never uses one.
const FORMAT_HELD: u8 = 3;
const ENCODED_LEN: usize = 1 + 5 * 8;
/// The newest checkpoints a cold fold reads to pick from (one read). The writer spaces
/// checkpoints at least a quarter window apart, so these span at least four windows.
pub const CHECKPOINT_TAIL: u64 = 16;

/// An account's folded state at one landed version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The account version it covers (at least 1).
    pub version: u64,
    pub balance: i64,
    /// The highest client sequence of our client id at `version`.
    pub max_client_seq: u64,
    /// Server commit time of the batch at `version`, epoch ms.
    pub commit_ms: u64,
    /// [`fingerprint`] of the batch at `version`.
    pub fingerprint: u64,
    /// A keyed checkpoint's segment starts after this version: it carries every key the
    /// fold took above it. `None`: it carries no keys (written by an older release).
    pub keys_after: Option<u64>,
    /// The byte length of the holds it carries ([`FORMAT_HELD`]); 0: the account had none.
    pub holds_len: u32,
}

/// Why a checkpoint was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// The stream does not show its version (past the tip, or a read behind it).
    Missing,
    /// The batch at its version has another commit time or content (a restored store).
    OtherBatch,
    /// Its version was trimmed away.
    Trimmed,
}

impl Checkpoint {
    /// The checkpoint of a state at `batch`'s version (the batch as read from the store).
    pub fn at(batch: &Batch, balance: i64, max_client_seq: u64) -> Self {
        Self {
            version: batch.version,
            balance,
            max_client_seq,
            commit_ms: batch.server_timestamp_ms,
            fingerprint: fingerprint(batch),
            keys_after: None,
            holds_len: 0,
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(ENCODED_LEN);
        b.put_u8(FORMAT);
        self.encode_fixed(&mut b);
        b.freeze()
    }

    /// It, carrying `keys` (the keys of the versions after `keys.after`), and the account's
    /// holds when it has any.
    pub fn keyed(mut self, keys: &Segment, holds: Option<&HoldBook>) -> (Self, Bytes) {
        self.keys_after = Some(keys.after);
        let held = holds.filter(|b| !b.is_empty()).map(encode_holds);
        let held_len = held.as_ref().map_or(0, |h| 4 + h.len());
        let mut b = BytesMut::with_capacity(ENCODED_LEN + held_len + 24 + keys.keys.len() * 8);
        b.put_u8(if held.is_some() {
            FORMAT_HELD
        } else {
            FORMAT_KEYED
        });
        self.encode_fixed(&mut b);
        if let Some(held) = held {
            self.holds_len = held.len() as u32;
            b.put_u32_le(self.holds_len);
            b.put_slice(&held);
        }
        keys.encode(&mut b);
        (self, b.freeze())
    }

    /// Where the keys start in its event's payload.
    fn keys_offset(&self) -> usize {
        if self.holds_len > 0 {
            ENCODED_LEN + 4 + self.holds_len as usize
        } else {
            ENCODED_LEN
        }
    }

    /// The holds its event carries: empty when it carries none; `None` when they do not
    /// decode (a malformed checkpoint: not used).
    pub fn holds(&self, event: &Event) -> Option<HoldBook> {
        if self.holds_len == 0 {
            return Some(HoldBook::default());
        }
        let at = ENCODED_LEN + 4;
        decode_holds(event.payload.get(at..at + self.holds_len as usize)?)
    }

    fn encode_fixed(&self, b: &mut BytesMut) {
        b.put_u64_le(self.version);
        b.put_i64_le(self.balance);
        b.put_u64_le(self.max_client_seq);
        b.put_u64_le(self.commit_ms);
        b.put_u64_le(self.fingerprint);
    }

    /// The checkpoint an event of the checkpoint stream carries; `None` for anything else.
    /// A keyed one's segment is read apart ([`Checkpoint::segment`]).
    pub fn decode(event: &Event) -> Option<Self> {
        let mut p = event.payload.as_ref();
        if event.event_type != CHECKPOINT_EVENT || p.len() < ENCODED_LEN {
            return None;
        }
        let (keyed, held) = match p.get_u8() {
            FORMAT if p.len() == ENCODED_LEN - 1 => (false, false),
            FORMAT_KEYED if p.len() >= ENCODED_LEN - 1 + 8 => (true, false),
            FORMAT_HELD if p.len() >= ENCODED_LEN - 1 + 4 + 8 => (true, true),
            _ => return None,
        };
        let mut cp = Self {
            version: p.get_u64_le(),
            balance: p.get_i64_le(),
            max_client_seq: p.get_u64_le(),
            commit_ms: p.get_u64_le(),
            fingerprint: p.get_u64_le(),
            keys_after: None,
            holds_len: 0,
        };
        if held {
            cp.holds_len = p.get_u32_le();
            if cp.holds_len == 0 || p.len() < cp.holds_len as usize + 8 {
                return None;
            }
            p.advance(cp.holds_len as usize);
        }
        if keyed {
            let after = p.get_u64_le();
            cp.keys_after = (after < cp.version).then_some(after);
            cp.keys_after?;
        }
        (cp.version > 0).then_some(cp)
    }

    /// The keys a keyed checkpoint's event carries; `None` for an unkeyed or malformed one.
    pub fn segment(&self, event: &Event) -> Option<Segment> {
        self.keys_after?;
        let keys = event.payload.get(self.keys_offset()..)?;
        Segment::decode(keys, self.version)
    }

    /// The event that writes it, unkeyed.
    pub fn event(&self) -> Event {
        Self::event_of(self.encode())
    }

    /// The event that writes a checkpoint's payload.
    pub fn event_of(payload: Bytes) -> Event {
        Event {
            // Not an idempotent write: the stream's version guard decides, and a checkpoint
            // landing twice is harmless.
            client_seq: 0,
            event_id: None,
            event_type: CHECKPOINT_EVENT,
            payload,
            timestamp_ms: 0,
        }
    }

    /// Whether every batch inside the window (server time, against `tip_ms`) lies after it.
    pub fn outside_window(&self, tip_ms: u64, window_ms: u64) -> bool {
        tip_ms.saturating_sub(self.commit_ms) >= window_ms && tip_ms > 0
    }

    /// Checks it against the batch the store holds at its version.
    pub fn check(&self, batch: &Batch) -> Result<(), Mismatch> {
        if batch.version != self.version {
            return Err(Mismatch::Missing);
        }
        if batch.server_timestamp_ms != self.commit_ms || fingerprint(batch) != self.fingerprint {
            return Err(Mismatch::OtherBatch);
        }
        Ok(())
    }
}

/// One hold's bytes: id, amount, destination (flagged), expiry seconds (0: none), placing
/// version and commit time (flagged exact or a lower bound).
const HOLD_LEN: usize = 16 + 8 + 1 + 16 + 4 + 8 + 1 + 8;
/// A resolution's bytes: the hold's, then how (1 post, 2 void, 3 expiry) and what a post took.
const RESOLVED_LEN: usize = HOLD_LEN + 1 + 8;

/// An account's holds as a checkpoint carries them: the counts, the open holds, then the
/// remembered resolutions, oldest first.
fn encode_holds(book: &HoldBook) -> Vec<u8> {
    let open = book.open();
    let resolved: Vec<&Resolved> = book.resolutions().collect();
    let mut b = BytesMut::with_capacity(8 + open.len() * HOLD_LEN + resolved.len() * RESOLVED_LEN);
    b.put_u32_le(open.len() as u32);
    b.put_u32_le(resolved.len() as u32);
    for (id, h) in &open {
        put_hold(&mut b, *id, h);
    }
    for r in resolved {
        put_hold(&mut b, r.hold, &r.was);
        b.put_u8(match r.how {
            Resolution::Posted => 1,
            Resolution::Voided => 2,
            Resolution::Expired => 3,
        });
        b.put_i64_le(r.posted);
    }
    b.to_vec()
}

fn put_hold(b: &mut BytesMut, id: HoldId, h: &OpenHold) {
    b.put_u128_le(id.as_u128());
    b.put_i64_le(h.amount);
    b.put_u8(u8::from(h.to.is_some()));
    b.put_u128_le(h.to.map_or(0, |t| t.as_u128()));
    b.put_u32_le(h.expires_in_secs.map_or(0, |s| s.get()));
    b.put_u64_le(h.placed_version);
    let (exact, ms) = match h.placed {
        Commit::Known(ms) => (1, ms),
        Commit::AtLeast(ms) => (0, ms),
    };
    b.put_u8(exact);
    b.put_u64_le(ms);
}

fn get_hold(p: &mut &[u8]) -> (HoldId, OpenHold) {
    let id = HoldId(Uuid::from_u128(p.get_u128_le()));
    let amount = p.get_i64_le();
    let has_to = p.get_u8() == 1;
    let to = p.get_u128_le();
    let secs = p.get_u32_le();
    let placed_version = p.get_u64_le();
    let exact = p.get_u8() == 1;
    let ms = p.get_u64_le();
    let hold = OpenHold {
        amount,
        to: has_to.then(|| AccountId(Uuid::from_u128(to))),
        expires_in_secs: NonZeroU32::new(secs),
        placed_version,
        placed: if exact {
            Commit::Known(ms)
        } else {
            Commit::AtLeast(ms)
        },
    };
    (id, hold)
}

/// The holds [`encode_holds`] wrote; `None` for bytes it did not write.
fn decode_holds(mut p: &[u8]) -> Option<HoldBook> {
    if p.len() < 8 {
        return None;
    }
    let open = p.get_u32_le() as usize;
    let resolved = p.get_u32_le() as usize;
    if p.len() != open.checked_mul(HOLD_LEN)? + resolved.checked_mul(RESOLVED_LEN)? {
        return None;
    }
    let open: Vec<_> = (0..open).map(|_| get_hold(&mut p)).collect();
    let mut done = Vec::with_capacity(resolved);
    for _ in 0..resolved {
        let (hold, was) = get_hold(&mut p);
        let how = match p.get_u8() {
            1 => Resolution::Posted,
            2 => Resolution::Voided,
            3 => Resolution::Expired,
            _ => return None,
        };
        done.push(Resolved {
            hold,
            how,
            posted: p.get_i64_le(),
            was,
        });
    }
    HoldBook::from_parts(open, done)
}

/// A stable 64-bit digest of a batch's writer and events (FNV-1a: the same in every build,
/// so a checkpoint written by one release checks under the next).
pub fn fingerprint(batch: &Batch) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    eat(&batch.client_id.to_le_bytes());
    for e in batch.events.iter() {
        eat(&e.client_seq.to_le_bytes());
        eat(&e.event_id.unwrap_or(0).to_le_bytes());
        eat(&e.event_type.major.to_le_bytes());
        eat(&e.event_type.minor.to_le_bytes());
        eat(&(e.payload.len() as u64).to_le_bytes());
        eat(&e.payload);
    }
    h
}

/// The newest of `candidates` (as read, oldest first) whose commit lies at least `age_ms`
/// before `tip_ms` (the window for a cold fold, the window and retention for a trim).
pub fn pick<'a>(
    candidates: impl IntoIterator<Item = &'a Checkpoint>,
    tip_ms: u64,
    age_ms: u64,
) -> Option<Checkpoint> {
    candidates
        .into_iter()
        .filter(|c| c.outside_window(tip_ms, age_ms))
        .max_by_key(|c| c.version)
        .copied()
}

/// The checkpoint stream's tail, as one read gives it.
#[derive(Clone, Debug, Default)]
pub struct Tail {
    /// The checkpoint stream's version (0: it does not exist): a writer's guard.
    pub stream_version: u64,
    /// The newest checkpoint's account version (0: none).
    pub newest_version: u64,
    /// Every checkpoint read that decodes, with its position in the checkpoint stream,
    /// oldest first.
    pub checkpoints: Vec<(u64, Checkpoint)>,
    /// The event each of them was read from (a keyed one's segment is read from it).
    pub events: Vec<Event>,
    /// Events read that are not checkpoints of this format.
    pub undecodable: u64,
}

impl Tail {
    pub fn iter(&self) -> impl Iterator<Item = &Checkpoint> {
        self.checkpoints.iter().map(|(_, c)| c)
    }

    /// Where `cp` sits in the checkpoint stream.
    pub fn position_of(&self, cp: &Checkpoint) -> Option<u64> {
        self.checkpoints
            .iter()
            .find(|(_, c)| c == cp)
            .map(|(at, _)| *at)
    }
}

impl Projection {
    /// Reads the last [`CHECKPOINT_TAIL`] checkpoints of `account` (a details call, and one
    /// read when the stream exists). Observes the server times it sees.
    pub async fn checkpoint_tail(&self, account: AccountId) -> Result<Tail, StoreError> {
        let key = self.identity.checkpoint_key(account);
        let details = match self.log.details(key).await {
            Ok(d) => d,
            Err(StoreError::AggregateNotFound) => return Ok(Tail::default()),
            Err(e) => return Err(e),
        };
        self.observe_server_time(details.last_server_timestamp_ms);
        let from = (details.max_version + 1)
            .saturating_sub(CHECKPOINT_TAIL)
            .max(details.min_available_version)
            .max(1);
        // Proven whole: a read served behind the tip would hide the newest checkpoints, and
        // a fold or a trim would take "none old enough" from it.
        let batches = read_whole(self.log.as_ref(), key, from, details.max_version).await?;
        let mut tail = Tail {
            stream_version: details.max_version,
            ..Tail::default()
        };
        for b in &batches {
            for event in b.events.iter() {
                match Checkpoint::decode(event) {
                    Some(cp) => {
                        tail.checkpoints.push((b.version, cp));
                        tail.events.push(event.clone());
                    }
                    None => tail.undecodable += 1,
                }
            }
        }
        tail.newest_version = tail.iter().map(|c| c.version).max().unwrap_or(0);
        Ok(tail)
    }

    /// The checkpoint stream's version and its newest checkpoint (by position): where the
    /// next one's guard and keys start. One details call, and one read when it exists.
    pub async fn newest_checkpoint(
        &self,
        account: AccountId,
    ) -> Result<(u64, Option<Checkpoint>), StoreError> {
        let key = self.identity.checkpoint_key(account);
        let details = match self.log.details(key).await {
            Ok(d) => d,
            Err(StoreError::AggregateNotFound) => return Ok((0, None)),
            Err(e) => return Err(e),
        };
        let top = details.max_version;
        if top == 0 {
            return Ok((0, None));
        }
        let batches = read_whole(self.log.as_ref(), key, top, top).await?;
        let newest = batches
            .iter()
            .flat_map(|b| b.events.iter())
            .find_map(Checkpoint::decode);
        Ok((top, newest))
    }

    /// The newest checkpoint whose commit is at least `age_ms` older than the server's now,
    /// with its position ([`Projection::newest_checkpoint_where`]).
    pub async fn checkpoint_older_than(
        &self,
        account: AccountId,
        tail: &Tail,
        age_ms: u64,
    ) -> Result<Option<(u64, Checkpoint)>, StoreError> {
        let tip = self.server_tip_ms();
        self.newest_checkpoint_where(account, tail, |c| c.outside_window(tip, age_ms))
            .await
    }

    /// The newest checkpoint that `old_enough` holds for, with its position: from the tail
    /// when it holds one, else by a binary search over the older positions of the checkpoint
    /// stream (a busy account's tail spans seconds, and a trim looks a retention back).
    /// `old_enough` must hold for a prefix of the stream (commit times and versions rise with
    /// positions), so the search reads about log2(positions) checkpoints, one each.
    pub async fn newest_checkpoint_where(
        &self,
        account: AccountId,
        tail: &Tail,
        old_enough: impl Fn(&Checkpoint) -> bool,
    ) -> Result<Option<(u64, Checkpoint)>, StoreError> {
        if let Some(&(at, cp)) = tail.checkpoints.iter().rev().find(|(_, c)| old_enough(c)) {
            return Ok(Some((at, cp)));
        }
        let Some(&(lowest, _)) = tail.checkpoints.first() else {
            return Ok(None);
        };
        let key = self.identity.checkpoint_key(account);
        let mut lo = self.log.details(key).await?.min_available_version.max(1);
        let mut hi = lowest.saturating_sub(1);
        let mut found = None;
        while lo <= hi {
            let mid = lo + (hi - lo) / 2;
            let cp = read_whole(self.log.as_ref(), key, mid, mid)
                .await?
                .iter()
                .flat_map(|b| b.events.iter())
                .find_map(Checkpoint::decode);
            match cp {
                Some(cp) if old_enough(&cp) => {
                    found = Some((mid, cp));
                    lo = mid + 1;
                }
                _ => hi = mid - 1,
            }
        }
        Ok(found)
    }

    /// The holds a checkpoint carries, from its event: in `tail` when it is there, else read
    /// from the checkpoint stream (it was found by a search below the tail).
    pub async fn checkpoint_holds(
        &self,
        account: AccountId,
        tail: Option<&Tail>,
        cp: &Checkpoint,
    ) -> Result<Option<HoldBook>, StoreError> {
        if cp.holds_len == 0 {
            return Ok(Some(HoldBook::default()));
        }
        if let Some(tail) = tail
            && let Some(at) = tail.checkpoints.iter().position(|(_, c)| c == cp)
        {
            return Ok(cp.holds(&tail.events[at]));
        }
        let empty = Tail::default();
        let found = self
            .newest_checkpoint_where(account, tail.unwrap_or(&empty), |c| c.version <= cp.version)
            .await?;
        let Some((at, found)) = found.filter(|(_, c)| c == cp) else {
            return Ok(None);
        };
        let key = self.identity.checkpoint_key(account);
        let events = read_whole(self.log.as_ref(), key, at, at).await?;
        Ok(events
            .iter()
            .flat_map(|b| b.events.iter())
            .find(|e| Checkpoint::decode(e).as_ref() == Some(&found))
            .and_then(|e| found.holds(e)))
    }

    /// Checks `cp` against the account stream: reads the batch at its version.
    pub async fn check_checkpoint(
        &self,
        account: AccountId,
        cp: &Checkpoint,
    ) -> Result<Result<(), Mismatch>, StoreError> {
        let key = self.identity.key(account);
        match read_whole(self.log.as_ref(), key, cp.version, cp.version).await {
            Ok(batches) => Ok(batches
                .first()
                .map_or(Err(Mismatch::Missing), |b| cp.check(b))),
            Err(StoreError::Trimmed { .. }) => Ok(Err(Mismatch::Trimmed)),
            Err(StoreError::AggregateNotFound) => Ok(Err(Mismatch::Missing)),
            // The read did not show its version: past the tip (the store says so), or a read
            // served behind it (transient: never a verdict).
            Err(e @ StoreError::NotApplied { .. }) => match self.log.details(key).await {
                Ok(d) if d.max_version >= cp.version => Err(e),
                Ok(_) | Err(StoreError::AggregateNotFound) => Ok(Err(Mismatch::Missing)),
                Err(other) => Err(other),
            },
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn batch(version: u64, ts: u64, seq: u64) -> Batch {
        Batch {
            version,
            client_id: 7,
            server_timestamp_ms: ts,
            events: Arc::from(vec![Event {
                client_seq: seq,
                event_id: Some(u128::from(seq)),
                event_type: EventType { major: 1, minor: 0 },
                payload: Bytes::from_static(b"x"),
                timestamp_ms: 0,
            }]),
        }
    }

    #[test]
    fn a_checkpoint_round_trips_through_its_event() {
        let cp = Checkpoint::at(&batch(9, 1_000, 4), -25, 4);
        assert_eq!(Checkpoint::decode(&cp.event()), Some(cp));
        let mut other = cp.event();
        other.event_type.minor = 1;
        assert_eq!(Checkpoint::decode(&other), None);
        let mut short = cp.event();
        short.payload = short.payload.slice(1..);
        assert_eq!(Checkpoint::decode(&short), None);
    }

    /// Rule: a cold fold uses the newest checkpoint at least one window older than the
    /// server's now, never one inside the window (its events would not be indexed).
    #[test]
    fn the_pick_is_the_newest_checkpoint_at_least_a_window_old() {
        let cps: Vec<Checkpoint> = [(10, 1_000), (20, 5_000), (30, 9_500)]
            .iter()
            .map(|&(v, ts)| Checkpoint::at(&batch(v, ts, v), 0, v))
            .collect();
        assert_eq!(pick(&cps, 10_000, 5_000).map(|c| c.version), Some(20));
        assert_eq!(pick(&cps, 10_000, 5_001).map(|c| c.version), Some(10));
        assert_eq!(pick(&cps, 10_000, 9_001), None);
        // No server time observed yet: nothing is old enough.
        assert_eq!(pick(&cps, 0, 0), None);
    }

    /// Rule: a checkpoint is checked against the batch at its version: another commit time
    /// or another batch there (a store restored from an older copy) rejects it.
    #[test]
    fn a_checkpoint_that_contradicts_its_batch_is_rejected() {
        let b = batch(9, 1_000, 4);
        let cp = Checkpoint::at(&b, 3, 4);
        assert_eq!(cp.check(&b), Ok(()));
        assert_eq!(cp.check(&batch(9, 1_001, 4)), Err(Mismatch::OtherBatch));
        assert_eq!(cp.check(&batch(9, 1_000, 5)), Err(Mismatch::OtherBatch));
        assert_eq!(cp.check(&batch(8, 1_000, 4)), Err(Mismatch::Missing));
    }

    /// Rule: a checkpoint of an account with holds carries its open holds and remembered
    /// resolutions, exact and lower-bound commit times alike, and its keys still read after
    /// them; one without holds keeps the keyed layout.
    #[test]
    fn a_checkpoint_carries_the_holds_and_the_keys_after_them() {
        use crate::account::holds::HoldChange;
        let id = |n| HoldId(Uuid::from_u128(n));
        let mut book = HoldBook::default();
        for (n, placed) in [
            (1, Commit::Known(5)),
            (2, Commit::AtLeast(7)),
            (3, Commit::Known(9)),
        ] {
            book.apply(HoldChange::Placed {
                hold: id(n),
                amount: 10 * n as i64,
                to: (n == 2).then(|| AccountId(Uuid::from_u128(77))),
                expires_in_secs: NonZeroU32::new(n as u32 * 60),
                version: n as u64,
                placed,
            })
            .unwrap();
        }
        book.apply(HoldChange::Resolved {
            hold: id(3),
            how: Resolution::Posted,
            posted: 12,
        })
        .unwrap();
        let mut m = super::super::keys::KeyMemory::default();
        m.push(5, 8, 1, 1_000);
        let segment = m.segment(0, 0, 9).expect("a segment");
        let (cp, payload) = Checkpoint::at(&batch(9, 1_000, 4), 3, 4).keyed(&segment, Some(&book));
        let event = Checkpoint::event_of(payload);
        let read = Checkpoint::decode(&event).expect("decodes");
        assert_eq!(read, cp);
        assert_eq!(read.holds(&event), Some(book));
        assert_eq!(read.segment(&event), Some(segment.clone()));
        let (bare, payload) =
            Checkpoint::at(&batch(9, 1_000, 4), 3, 4).keyed(&segment, Some(&HoldBook::default()));
        assert_eq!(bare.holds_len, 0);
        assert_eq!(payload[0], FORMAT_KEYED);
    }
}
