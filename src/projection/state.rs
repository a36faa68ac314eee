//! One account's folded state and the fold itself: how a page of batches moves balance,
//! cursor, highest own sequence and recent-writes index together.

use crate::account::AccountEvent;
use crate::account::fold;
use crate::account::holds::{Commit, HoldBook, HoldChange, HoldId, Resolution};
use crate::store::Batch;

use super::index::{self, Bulk, RecentIndex, RecentWrite};
use super::keys::KeyMemory;

/// How many batches ahead of the one being folded the fold prefetches payloads (and twice
/// as far, events).
const FOLD_LOOKAHEAD: usize = 8;

/// Why a fold stopped; kept on the account so every later request answers the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Broken {
    Poisoned {
        version: u64,
        reason: String,
    },
    Trimmed {
        min_available: u64,
    },
    /// A hold event at `version`, on a replica with holds off: it could not state the
    /// balance a fleet with holds on folds, so it answers nothing for the account.
    HoldsOff {
        version: u64,
    },
}

/// The highest client sequence of ours a fold takes. Our sequences count our writes from 1,
/// so no replica comes near it (2^62 writes is one a nanosecond for 146 years); a stream
/// past it was written by something else under our client id, and deriving the next
/// sequence (`+ 1`, and more for a batch) could overflow. Such an account is poisoned.
pub const MAX_OWN_CLIENT_SEQ: u64 = 1 << 62;

/// A consistent view of one account at one version.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub balance: i64,
    pub version: u64,
    pub max_client_seq: u64,
    /// The sum of the open holds, and how many there are.
    pub held: i64,
    pub open_holds: usize,
    /// The fold generation it was taken from (`regress.rs`; 0 for a Postgres row): a write
    /// decided on it moves the cursor of that fold only, never of one dropped and read
    /// again meanwhile.
    pub generation: u64,
}

/// What the fold needs besides the batches.
#[derive(Clone, Copy, Debug)]
pub struct FoldContext {
    /// Only batches of this client id raise the account's max client sequence.
    pub client_id: u128,
    pub window_ms: u64,
    /// Batches younger than this (server time) have their keys remembered past the window.
    pub retention_ms: u64,
    /// The server's now as this replica estimates it ([`Projection::server_tip_ms`]).
    pub tip_ms: u64,
    /// Local monotonic now.
    pub now_ms: u64,
    /// Holds are on (`--holds`): off, a hold event stops the fold ([`Broken::HoldsOff`]).
    pub holds: bool,
}

/// One account's folded state.
#[derive(Default)]
pub struct AccountState {
    pub balance: i64,
    /// The stream cursor: the last version folded.
    pub version: u64,
    /// The highest client sequence of this service's own batches.
    pub max_client_seq: u64,
    /// Caught up from the store at least once since it was loaded.
    pub warm: bool,
    pub broken: Option<Box<Broken>>,
    pub recent: RecentIndex,
    /// Every key that landed within the retention, a few bytes each (`keys/`).
    pub keys: KeyMemory,
    /// The account's holds; `None` until it has any (most accounts never do).
    pub holds: Option<Box<HoldBook>>,
    pub last_touch_ms: u64,
    /// Postgres projection only: no warm copy of this account is built before this local
    /// time, because the last one had too many rows (see `postgres/warm.rs`).
    pub cold_until_ms: u64,
    /// How many times this fold was dropped in place because the store went backwards
    /// (`regress.rs`): a catch-up folds what it read only into the generation it read for.
    pub generation: u64,
    /// Where this account's checkpoints stand as this replica knows them
    /// (`checkpoint_writer.rs`).
    pub checkpoint: CheckpointMark,
}

/// This replica's knowledge of an account's checkpoint stream, and the progress since the
/// last checkpoint it knows of: what decides when the next one is due.
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckpointMark {
    /// The checkpoint stream's version, the next write's guard; `None` when unknown (read
    /// it first).
    pub stream_version: Option<u64>,
    /// The account version of the newest checkpoint known (0: none).
    pub covered_version: u64,
    /// Events folded or written past it.
    pub events_since: u64,
    /// Local monotonic time of the last checkpoint written or loaded here (0: never).
    pub last_ms: u64,
    /// One is queued or being written for this account.
    pub pending: bool,
    /// The newest checkpoint in the stream as this replica last read or wrote it: where the
    /// next one's keys start. `None`: not known exactly (another replica wrote one, or a
    /// write's outcome is unknown): read it first.
    pub keys_from: Option<NewestCheckpoint>,
}

/// The newest checkpoint in an account's checkpoint stream, as the next writer needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NewestCheckpoint {
    /// Its account version (0: the stream holds none).
    pub version: u64,
    /// Its commit time, server ms.
    pub commit_ms: u64,
    /// It carries keys: a chain through it can be whole.
    pub keyed: bool,
}

impl NewestCheckpoint {
    pub fn of(cp: &super::Checkpoint) -> Self {
        Self {
            version: cp.version,
            commit_ms: cp.commit_ms,
            keyed: cp.keys_after.is_some(),
        }
    }
}

impl AccountState {
    pub fn snapshot(&self) -> Snapshot {
        let book = self.holds.as_deref();
        Snapshot {
            balance: self.balance,
            version: self.version,
            max_client_seq: self.max_client_seq,
            held: book.map_or(0, HoldBook::held),
            open_holds: book.map_or(0, HoldBook::open_count),
            generation: self.generation,
        }
    }

    /// Folds `batches` in order, skipping any at or behind the cursor, and indexes every
    /// event of a batch younger than the window. A batch's age is measured in server time
    /// against the fold's tip; only the remaining lifetime runs on the local clock.
    /// Returns how many events were applied. On an event it cannot apply, the state stays
    /// at the last whole batch and the reason is returned.
    pub fn fold(&mut self, batches: &[Batch], ctx: &FoldContext) -> Result<u64, Broken> {
        // Server time never decreases along a stream, so the batches young enough to index
        // are a suffix: make room for them once instead of growing the index as it fills.
        let old = batches
            .partition_point(|b| ctx.tip_ms.saturating_sub(b.server_timestamp_ms) >= ctx.window_ms);
        if old < batches.len() {
            self.recent.reserve(batches.len() - old);
        }
        let mut applied = 0u64;
        let mut landed: Vec<(u128, i64)> = Vec::new();
        let mut changes: Vec<HoldChange> = Vec::new();
        // Records are appended as the fold goes and indexed in one pass when `index` drops,
        // on every return path.
        let mut index = self.recent.bulk();
        for (at, batch) in batches.iter().enumerate() {
            prefetch_ahead(batches, at);
            if batch.version <= self.version {
                continue;
            }
            if batch.version != self.version + 1 {
                return Err(Broken::Poisoned {
                    version: batch.version,
                    reason: format!(
                        "gap in the stream: expected version {}, read {}",
                        self.version + 1,
                        batch.version
                    ),
                });
            }
            let age = ctx.tip_ms.saturating_sub(batch.server_timestamp_ms);
            let expires = (age < ctx.window_ms).then(|| ctx.now_ms + (ctx.window_ms - age));
            let own = batch.client_id == ctx.client_id;
            // A batch folds whole or not at all: none of its index entries is kept unless
            // every event applied, or they would answer for events the state never took.
            let mark = index.mark();
            let start = (self.balance, self.max_client_seq);
            let remember = age < ctx.retention_ms;
            landed.clear();
            changes.clear();
            let keys = remember.then_some(&mut landed);
            let out = BatchOut {
                keys,
                holds: ctx.holds.then_some(&mut changes),
            };
            let folded = fold_batch(&mut index, batch, start, (expires, own), out)
                .and_then(|after| apply_holds(&mut self.holds, &changes).map(|()| after));
            let (balance, max_seq) = match folded {
                Ok(after) => after,
                Err(failure) => {
                    index.rollback(mark);
                    return Err(failure.at(batch.version));
                }
            };
            self.balance = balance;
            self.max_client_seq = max_seq;
            self.version = batch.version;
            for &(event_id, balance) in &landed {
                self.keys
                    .push(event_id, batch.version, balance, batch.server_timestamp_ms);
            }
            applied += batch.events.len() as u64;
        }
        Ok(applied)
    }
}

/// Applies one batch's hold changes, all or none.
pub(super) fn apply_holds(
    holds: &mut Option<Box<HoldBook>>,
    changes: &[HoldChange],
) -> Result<(), FoldFailure> {
    if changes.is_empty() {
        return Ok(());
    }
    let book = holds.get_or_insert_with(Box::default);
    book.apply_all(changes)
        .map_err(|e| FoldFailure::Poison(e.to_string()))
}

/// Why a batch did not fold, before the version it stopped at is known.
pub(super) enum FoldFailure {
    Poison(String),
    HoldsOff,
}

impl FoldFailure {
    fn at(self, version: u64) -> Broken {
        match self {
            FoldFailure::Poison(reason) => Broken::Poisoned { version, reason },
            FoldFailure::HoldsOff => Broken::HoldsOff { version },
        }
    }
}

/// What a batch's fold hands back besides the balance: each keyed event's id and balance
/// when the batch is younger than the retention, and its hold changes when holds are on
/// (`None`: a hold event stops the fold).
struct BatchOut<'a> {
    keys: Option<&'a mut Vec<(u128, i64)>>,
    holds: Option<&'a mut Vec<HoldChange>>,
}

/// The book's change for one hold event landed at `version` and committed at `placed`.
pub(super) fn hold_change(
    event: &AccountEvent,
    event_id: Option<u128>,
    (version, placed): (u64, Commit),
) -> Result<Option<HoldChange>, String> {
    let resolved = |hold, how, posted| HoldChange::Resolved { hold, how, posted };
    Ok(Some(match *event {
        AccountEvent::HoldPlaced {
            amount,
            to,
            expires_in_secs,
        } => {
            let id = event_id.ok_or("a hold placed by an event without an id")?;
            HoldChange::Placed {
                hold: HoldId(uuid::Uuid::from_u128(id)),
                amount,
                to,
                expires_in_secs,
                version,
                placed,
            }
        }
        AccountEvent::HoldPosted { hold, amount } => resolved(hold, Resolution::Posted, amount),
        AccountEvent::HoldVoided { hold } => resolved(hold, Resolution::Voided, 0),
        AccountEvent::HoldExpired { hold } => resolved(hold, Resolution::Expired, 0),
        _ => return Ok(None),
    }))
}

/// Each batch's events sit in their own allocation, and each payload in another: prefetch
/// them a few batches ahead of the one at `at`, so the fold does not wait on a cache miss or
/// two per batch.
#[inline]
fn prefetch_ahead(batches: &[Batch], at: usize) {
    if let Some(b) = batches.get(at + 2 * FOLD_LOOKAHEAD) {
        // An event spans two cache lines; its allocation need not start on one.
        let first = b.events.as_ptr().cast::<u8>();
        index::prefetch(first);
        index::prefetch(first.wrapping_add(64));
    }
    if let Some(e) = batches
        .get(at + FOLD_LOOKAHEAD)
        .and_then(|b| b.events.first())
    {
        index::prefetch(e.payload.as_ptr());
    }
}

/// Applies one batch's events on top of `(balance, highest own sequence)` and appends an
/// index record for each when the batch `expires` at all (it is younger than the window),
/// and what `out` asks for (`BatchOut`). Returns the pair after the batch, or why one of
/// its events cannot be applied; the records appended before that event are the caller's
/// to roll back.
#[inline]
fn fold_batch(
    index: &mut Bulk<'_>,
    batch: &Batch,
    (mut balance, mut max_seq): (i64, u64),
    (expires, own): (Option<u64>, bool),
    out: BatchOut<'_>,
) -> Result<(i64, u64), FoldFailure> {
    let BatchOut {
        mut keys,
        mut holds,
    } = out;
    let poison = |reason: String| FoldFailure::Poison(reason);
    for e in batch.events.iter() {
        let event = AccountEvent::decode(e.event_type, &e.payload)
            .map_err(|err| poison(err.to_string()))?;
        if event.is_hold() {
            let Some(holds) = holds.as_deref_mut() else {
                return Err(FoldFailure::HoldsOff);
            };
            let at = (batch.version, Commit::Known(batch.server_timestamp_ms));
            holds.extend(hold_change(&event, e.event_id, at).map_err(poison)?);
        }
        balance = fold::apply(balance, &event).map_err(|err| poison(err.to_string()))?;
        if own && e.client_seq > MAX_OWN_CLIENT_SEQ {
            return Err(poison(format!(
                "client sequence {} of ours is past {MAX_OWN_CLIENT_SEQ}: no next one can be derived",
                e.client_seq
            )));
        }
        if own && e.client_seq > max_seq {
            max_seq = e.client_seq;
        }
        if let (Some(keys), Some(eid)) = (keys.as_deref_mut(), e.event_id) {
            keys.push((eid, balance));
        }
        if let (Some(expires_at_ms), Some(eid)) = (expires, e.event_id) {
            index.push(
                eid,
                RecentWrite {
                    balance,
                    version: batch.version,
                    expires_at_ms,
                    event,
                    write_tag: own.then(|| index::write_tag(e.client_seq, e.timestamp_ms)),
                },
            );
        }
    }
    Ok((balance, max_seq))
}
