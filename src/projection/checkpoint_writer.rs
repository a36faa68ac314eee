//! Who writes a checkpoint, and when; and retention, which trims below one.
//!
//! - When: an account this replica folds or writes is due once [`CheckpointConfig::every_events`]
//!   events lie past its newest known checkpoint, or [`CheckpointConfig::interval`] has passed
//!   with at least [`CHECKPOINT_INTERVAL_MIN_EVENTS`] of them; never sooner than a quarter
//!   window after the last one it wrote or loaded ([`CHECKPOINTS_PER_WINDOW`]), unless
//!   [`HOT_CHECKPOINT_FACTOR`] thresholds lie past it (a cold fold reads what follows).
//! - Keyed: it carries the keys since the newest checkpoint in the stream, read first when
//!   this replica does not know it exactly (`keys_from`).
//!   Only an account that moves is ever checked: an idle one costs nothing.
//! - Off the write path: the fold and the write path only note the account in a bounded
//!   queue ([`CHECKPOINT_QUEUE`]); a background task ([`Projection::run_checkpoint_writer`])
//!   writes at most [`CheckpointConfig::in_flight`] at once, its own budget, never the client
//!   write limits. A full queue skips (counted): the next threshold tries again.
//! - Guarded: a checkpoint is written with the checkpoint stream's version as its guard, so
//!   two replicas never write two checkpoints at one position; a conflict means another
//!   replica wrote one, and is taken as done.
//! - Landed only: the writer reads the batch at the fold's version back from the store first
//!   (its commit time and fingerprint go into the checkpoint), so the state it records is at a
//!   version the store holds.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Semaphore, mpsc};

use super::checkpoint::Checkpoint;
use super::keys::{MAX_SEGMENT_KEYS, Segment};
use super::state::{AccountState, NewestCheckpoint};
use super::{AccountSlot, Projection, Snapshot};
use crate::account::AccountId;
use crate::account::holds::HoldBook;
use crate::metrics::{checkpoint_write, trim};
use crate::store::{AggregateWrite, StoreError, read_whole};

/// Events past the newest checkpoint that make the next one due, unless configured.
pub const DEFAULT_CHECKPOINT_EVERY_EVENTS: u64 = 1_000;
/// Time since the last checkpoint that makes the next one due (with at least
/// [`CHECKPOINT_INTERVAL_MIN_EVENTS`] events), unless configured.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(600);
/// The fewest events past a checkpoint for which time alone makes the next one due: an
/// account written a few times a year never gets one.
pub const CHECKPOINT_INTERVAL_MIN_EVENTS: u64 = 100;
/// Checkpoints one replica writes at once, unless configured.
pub const DEFAULT_CHECKPOINT_IN_FLIGHT: usize = 2;
/// Accounts waiting for the checkpoint writer; beyond it a due account is skipped.
pub const CHECKPOINT_QUEUE: usize = 1_024;
/// At most this many checkpoints per window from one replica's view (spacing: a window over
/// this).
pub const CHECKPOINTS_PER_WINDOW: u64 = 4;

/// An account this many times `--checkpoint-every-events` past its checkpoint gets the next
/// at once, however recent the last: so a cold fold of an account written right now reads
/// at most about this many thresholds of events.
pub const HOT_CHECKPOINT_FACTOR: u64 = 4;

/// When checkpoints are written and what retention keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Events past the newest checkpoint that make the next one due; 0 turns writing off
    /// (cold folds still use the checkpoints they find).
    pub every_events: u64,
    pub interval: Duration,
    pub in_flight: usize,
    /// `--retain-history-secs`: after each checkpoint it writes, a replica trims the account
    /// below its newest checkpoint older than the window and this. `None`: never trims.
    pub retain_history: Option<Duration>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every_events: DEFAULT_CHECKPOINT_EVERY_EVENTS,
            interval: DEFAULT_CHECKPOINT_INTERVAL,
            in_flight: DEFAULT_CHECKPOINT_IN_FLIGHT,
            retain_history: None,
        }
    }
}

/// The queue between the fold (which notes due accounts) and the writer task.
pub struct Queue {
    tx: mpsc::Sender<AccountId>,
    rx: Mutex<Option<mpsc::Receiver<AccountId>>>,
}

impl Default for Queue {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(CHECKPOINT_QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }
}

/// What a trim did to one account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrimReport {
    /// The checkpoint trimmed at (the stream now starts at its version), or `None` when no
    /// checkpoint was old enough (or it did not check against the stream).
    pub trimmed_at: Option<u64>,
    /// The account stream's first available version after the call.
    pub first_available: u64,
}

/// Whether an account with this mark, at `version`, is due a checkpoint at local `now_ms`.
pub fn due(
    cfg: &CheckpointConfig,
    mark: &super::CheckpointMark,
    version: u64,
    now_ms: u64,
    window_ms: u64,
) -> bool {
    if cfg.every_events == 0 || mark.pending || version <= mark.covered_version {
        return false;
    }
    let since = now_ms.saturating_sub(mark.last_ms);
    // A hot account is not held to the spacing: a cold fold reads every event past the
    // newest checkpoint, and a checkpoint's keys must fit one segment.
    let hot = mark.events_since >= cfg.every_events.saturating_mul(HOT_CHECKPOINT_FACTOR);
    let spaced = mark.last_ms == 0 || since >= window_ms / CHECKPOINTS_PER_WINDOW || hot;
    let interval_ms = u64::try_from(cfg.interval.as_millis()).unwrap_or(u64::MAX);
    let by_events = mark.events_since >= cfg.every_events;
    let by_time = mark.events_since >= CHECKPOINT_INTERVAL_MIN_EVENTS && since >= interval_ms;
    spaced && (by_events || by_time)
}

/// How a checkpoint write ended.
enum Wrote {
    /// Landed at this position of the checkpoint stream, covering this account version,
    /// committed then.
    Landed {
        stream_version: u64,
        covered: u64,
        commit_ms: u64,
    },
    /// Another replica wrote one at that position; the stream is at `current`.
    Conflict { current: u64 },
}

impl Projection {
    /// Counts `events` folded or written past the account's checkpoint, and queues the
    /// account for the writer when a checkpoint is due. Called under the account's lock.
    pub(super) fn note_progress(&self, account: AccountId, st: &mut AccountState, events: u64) {
        st.checkpoint.events_since = st.checkpoint.events_since.saturating_add(events);
        let cfg = &self.config.checkpoints;
        if st.broken.is_some()
            || !due(
                cfg,
                &st.checkpoint,
                st.version,
                self.now_ms(),
                self.window_ms(),
            )
        {
            return;
        }
        if self.checkpoint_queue.tx.try_send(account).is_ok() {
            st.checkpoint.pending = true;
        } else {
            self.metrics
                .checkpoint_writes
                .with_label_values(&[checkpoint_write::SKIPPED])
                .inc();
        }
    }

    /// Writes the checkpoints the fold queues, at most `in_flight` at once, until the queue
    /// closes (never, while the projection lives) or the task is aborted. Only one writer
    /// runs per projection: a second call returns at once.
    pub async fn run_checkpoint_writer(self: Arc<Self>) {
        let Some(mut rx) = self.checkpoint_queue.rx.lock().take() else {
            return;
        };
        let budget = Arc::new(Semaphore::new(self.config.checkpoints.in_flight.max(1)));
        while let Some(account) = rx.recv().await {
            let Ok(permit) = budget.clone().acquire_owned().await else {
                return;
            };
            let projection = self.clone();
            tokio::spawn(async move {
                projection.write_checkpoint(account).await;
                drop(permit);
            });
        }
    }

    /// Writes one checkpoint of a resident account at its current state, carrying the keys
    /// the fold took since the newest checkpoint in the stream, and trims it when retention
    /// is on. Every outcome is counted; none is an error to anyone.
    pub async fn write_checkpoint(&self, account: AccountId) {
        let Some(slot) = self.resident_slot(account) else {
            return self.count_write(checkpoint_write::SKIPPED);
        };
        let known = {
            let st = slot.state.lock();
            st.checkpoint.stream_version.zip(st.checkpoint.keys_from)
        };
        // Where the stream stands: known here, or read (the keys start at its newest).
        let (stream_version, keys_from) = match known {
            Some((v, from)) => (v, Some(from)),
            None => match self.newest_checkpoint(account).await {
                Ok((v, newest)) => (v, newest.map(|c| NewestCheckpoint::of(&c))),
                Err(e) => {
                    tracing::debug!(%account, error = %e, "checkpoint stream unreadable; the next threshold tries again");
                    slot.state.lock().checkpoint.pending = false;
                    return self.count_write(checkpoint_write::FAILED);
                }
            },
        };
        let (snap, keys) = {
            let mut st = slot.state.lock();
            let covered = keys_from.map_or(0, |c| c.version);
            if st.broken.is_some() || !st.warm || st.version == 0 || st.version <= covered {
                st.checkpoint.pending = false;
                drop(st);
                return self.count_write(checkpoint_write::SKIPPED);
            }
            let holds = st.holds.as_deref().cloned();
            (st.snapshot(), (segment_since(&st, keys_from), holds))
        };
        let (keys, holds) = keys;
        let result = self
            .try_write_checkpoint(account, snap, stream_version, (&keys, holds.as_ref()))
            .await;
        let outcome = self.finish_checkpoint(account, &slot, snap, result);
        self.count_write(outcome);
        if outcome == checkpoint_write::WRITTEN
            && let Some(retain) = self.config.checkpoints.retain_history
        {
            let _ = self.trim_account(account, retain).await;
        }
    }

    /// Moves the account's checkpoint mark by how the write ended; returns the outcome.
    fn finish_checkpoint(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        snap: Snapshot,
        result: Result<Wrote, StoreError>,
    ) -> &'static str {
        let mut st = slot.state.lock();
        st.checkpoint.pending = false;
        let same = st.generation == snap.generation;
        match result {
            Ok(Wrote::Landed {
                stream_version,
                covered,
                commit_ms,
            }) => {
                if same {
                    self.mark_covered(&mut st, Some(stream_version), covered, snap.version);
                    st.checkpoint.keys_from = Some(NewestCheckpoint {
                        version: covered,
                        commit_ms,
                        keyed: true,
                    });
                }
                checkpoint_write::WRITTEN
            }
            Ok(Wrote::Conflict { current }) => {
                if same {
                    // Another replica wrote one, at a version this replica does not know:
                    // taken as covering this state (the next threshold counts from here);
                    // the next one's keys start where the stream says.
                    self.mark_covered(&mut st, Some(current), snap.version, snap.version);
                    st.checkpoint.keys_from = None;
                }
                checkpoint_write::CONFLICT
            }
            Err(e) => {
                // An unknown outcome may have moved the stream: read its version next time.
                st.checkpoint.stream_version = None;
                st.checkpoint.keys_from = None;
                tracing::debug!(%account, error = %e, "checkpoint write failed; the next threshold tries again");
                checkpoint_write::FAILED
            }
        }
    }

    fn mark_covered(&self, st: &mut AccountState, stream: Option<u64>, covered: u64, at: u64) {
        let mark = &mut st.checkpoint;
        mark.stream_version = stream;
        mark.covered_version = mark.covered_version.max(covered);
        // Events the fold took past the checkpointed version stay counted (roughly: one
        // event per version).
        mark.events_since = st.version.saturating_sub(at);
        mark.last_ms = self.now_ms();
    }

    fn count_write(&self, outcome: &str) {
        self.metrics
            .checkpoint_writes
            .with_label_values(&[outcome])
            .inc();
    }

    /// Reads the batch at the state's version back (the state is at a landed version), then
    /// writes the checkpoint, with `keys`, guarded on the checkpoint stream's version.
    async fn try_write_checkpoint(
        &self,
        account: AccountId,
        snap: Snapshot,
        expected: u64,
        (keys, holds): (&Segment, Option<&HoldBook>),
    ) -> Result<Wrote, StoreError> {
        let key = self.identity.key(account);
        let batches = read_whole(self.log.as_ref(), key, snap.version, snap.version).await?;
        let batch = batches
            .first()
            .ok_or_else(|| StoreError::shed("the checkpointed version was not read back"))?;
        let (cp, payload) =
            Checkpoint::at(batch, snap.balance, snap.max_client_seq).keyed(keys, holds);
        let write = AggregateWrite {
            key: self.identity.checkpoint_key(account),
            events: vec![Checkpoint::event_of(payload)],
            expected_version: Some(expected),
            allow_create: true,
            enforce_client_idempotency: false,
        };
        match self.log.write(self.identity.client(), vec![write]).await {
            Ok(versions) => Ok(Wrote::Landed {
                stream_version: versions.first().copied().unwrap_or(expected + 1),
                covered: cp.version,
                commit_ms: cp.commit_ms,
            }),
            Err(StoreError::Conflict { current, .. }) => Ok(Wrote::Conflict { current }),
            Err(e) => Err(e),
        }
    }

    /// Retention: trims the account stream below its newest checkpoint whose commit is older
    /// than the window and `retain` together, once that checkpoint checks against the stream.
    /// The checkpoint's own version stays readable (a cold fold checks it there), and the
    /// checkpoint stream is trimmed below that checkpoint's position too. Counted.
    pub async fn trim_account(
        &self,
        account: AccountId,
        retain: Duration,
    ) -> Result<TrimReport, StoreError> {
        let result = self.try_trim(account, retain).await;
        let outcome = match &result {
            Ok(TrimReport {
                trimmed_at: Some(_),
                ..
            }) => trim::TRIMMED,
            Ok(_) => trim::KEPT,
            Err(_) => trim::FAILED,
        };
        self.metrics.trims.with_label_values(&[outcome]).inc();
        result
    }

    async fn try_trim(
        &self,
        account: AccountId,
        retain: Duration,
    ) -> Result<TrimReport, StoreError> {
        let key = self.identity.key(account);
        let first_available = self.log.details(key).await?.min_available_version;
        let kept = TrimReport {
            trimmed_at: None,
            first_available,
        };
        let tail = self.checkpoint_tail(account).await?;
        let retain_ms = u64::try_from(retain.as_millis()).unwrap_or(u64::MAX);
        // Never below the idempotency retention: every batch a remembered key points at
        // stays readable (configuration refuses less; this holds it whatever the caller).
        let age = self
            .window_ms()
            .saturating_add(retain_ms)
            .max(self.retention_ms());
        let Some((at, cp)) = self.checkpoint_older_than(account, &tail, age).await? else {
            return Ok(kept);
        };
        if let Err(mismatch) = self.check_checkpoint(account, &cp).await? {
            tracing::warn!(%account, version = cp.version, ?mismatch, "not trimming: the checkpoint contradicts the stream");
            return Ok(kept);
        }
        if cp.version <= first_available {
            return Ok(kept);
        }
        self.log.trim_start(key, cp.version).await?;
        if at > 1 {
            // Older checkpoints cover versions no longer readable: useless from now on.
            let ckpt_key = self.identity.checkpoint_key(account);
            if let Err(e) = self.log.trim_start(ckpt_key, at).await {
                tracing::debug!(%account, error = %e, "could not trim the checkpoint stream");
            }
        }
        Ok(TrimReport {
            trimmed_at: Some(cp.version),
            first_available: cp.version,
        })
    }
}

/// The keys a checkpoint of `st` carries: those since the newest checkpoint in the stream
/// (`keys_from`), or since the key memory's floor when it does not reach that far back, or
/// when that checkpoint carries no keys (written by an older release: a chain through it is
/// broken, so this one carries all the memory holds and starts a whole chain); at most
/// [`MAX_SEGMENT_KEYS`], the newest (the loader then finds the chain broken below them and
/// folds instead).
fn segment_since(st: &AccountState, keys_from: Option<NewestCheckpoint>) -> Segment {
    let from_floor = || {
        st.keys
            .segment(st.keys.floor(), st.keys.floor_ms(), st.version)
    };
    let mut seg = match keys_from {
        Some(c) if c.keyed || c.version == 0 => st
            .keys
            .segment(c.version, c.commit_ms, st.version)
            .or_else(from_floor),
        Some(_) => from_floor(),
        None => st.keys.segment(0, 0, st.version).or_else(from_floor),
    }
    .unwrap_or_default();
    if seg.keys.len() > MAX_SEGMENT_KEYS {
        // More keys than one segment carries (a history folded at once): the newest go, and
        // the rest are forgotten, as a cap forgets. A cold replica then loads these and
        // states the shorter horizon, rather than fold the whole history.
        let cut = seg.keys[seg.keys.len() - MAX_SEGMENT_KEYS - 1].version;
        seg.keys.retain(|k| k.version > cut);
        seg.after = cut;
        seg.after_ms = st.keys.commit_ms_through(cut);
        seg.forgotten = true;
    }
    if st.keys.forgotten_ms() > 0 && seg.after == st.keys.floor() {
        // The memory forgot keys below its floor to a cap: so does the chain.
        seg.forgotten = true;
        seg.after_ms = seg.after_ms.max(st.keys.forgotten_ms());
    }
    seg
}
