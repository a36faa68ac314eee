//! A cold fold's keys: the keyed checkpoints' segments, newest first, back through the
//! retention, so a cold replica loads the keys instead of folding the retention's events.
//!
//! The rule (docs/architecture.md, "Checkpoints and retention"): each keyed checkpoint
//! carries the keys of the versions since the checkpoint before it in the stream
//! ([`super::keys::Segment`]; written by `write_checkpoint`, which reads where the stream
//! stands first). So the segments of consecutive checkpoints are contiguous. The chain is
//! whole when it reaches the stream's start, or a segment whose start was committed before
//! the retention; it is capped when it holds the account's key cap, or at a segment whose
//! writer had forgotten the keys below it; it is broken at an
//! unkeyed checkpoint, a gap, or a checkpoint the stream no longer has. A broken chain is
//! never guessed across: the fold starts from a checkpoint a retention old instead.

use super::checkpoint::{Checkpoint, Tail};
use super::keys::Segment;
use super::{AccountState, Projection};
use crate::account::AccountId;
use crate::store::{Event, StoreError, read_whole};

/// Checkpoints read at once while walking the chain back past the tail.
pub const CHAIN_PAGE: u64 = 64;

/// Where a walk back along the segments ended.
#[derive(Debug)]
pub enum Chain {
    /// Every key within the retention: each segment with its checkpoint's commit time,
    /// newest first.
    Whole(Vec<(Segment, u64)>),
    /// The newest keys up to the account's cap; those below the last segment are forgotten.
    Capped(Vec<(Segment, u64)>),
    /// Keys within the retention that no segment carries.
    Broken,
    /// No chain: the fold starts at a checkpoint younger than the retention, and the keys
    /// below it are forgotten (`start_without_chain`).
    Forgotten,
}

impl Projection {
    /// Walks back from the checkpoint at `at` of `tail` (a keyed one) along the segments.
    pub(super) async fn key_chain(
        &self,
        account: AccountId,
        tail: &Tail,
        at: usize,
    ) -> Result<Chain, StoreError> {
        let oldest_ms = self.server_tip_ms().saturating_sub(self.retention_ms());
        let max = self.config.max_keys_per_account;
        let mut older: Vec<(u64, Checkpoint, Event)> = tail.checkpoints[..at]
            .iter()
            .zip(&tail.events)
            .map(|(&(pos, cp), e)| (pos, cp, e.clone()))
            .collect();
        let (mut pos, mut cp) = tail.checkpoints[at];
        let mut event = tail.events[at].clone();
        let mut need = cp.version;
        let (mut segments, mut keys) = (Vec::new(), 0usize);
        loop {
            let Some(mut seg) = cp.segment(&event) else {
                return Ok(Chain::Broken);
            };
            seg.keys.retain(|k| k.version <= need);
            keys += seg.keys.len();
            let (after, after_ms, forgotten) = (seg.after, seg.after_ms, seg.forgotten);
            segments.push((seg, cp.commit_ms));
            if after == 0 || after_ms < oldest_ms {
                return Ok(Chain::Whole(segments));
            }
            if keys >= max || forgotten {
                return Ok(Chain::Capped(segments));
            }
            need = after;
            if older.is_empty() {
                older = self.checkpoints_before(account, pos).await?;
            }
            let Some((p, c, e)) = older.pop() else {
                return Ok(Chain::Broken);
            };
            if p + 1 != pos || c.version < need {
                return Ok(Chain::Broken);
            }
            (pos, cp, event) = (p, c, e);
        }
    }

    /// Up to [`CHAIN_PAGE`] checkpoints just below position `pos`, oldest first (fewer at
    /// the stream's start or its trim).
    async fn checkpoints_before(
        &self,
        account: AccountId,
        pos: u64,
    ) -> Result<Vec<(u64, Checkpoint, Event)>, StoreError> {
        if pos <= 1 {
            return Ok(Vec::new());
        }
        let key = self.identity.checkpoint_key(account);
        let from = pos.saturating_sub(CHAIN_PAGE).max(1);
        let batches = match read_whole(self.log.as_ref(), key, from, pos - 1).await {
            Ok(b) => b,
            Err(StoreError::Trimmed { min_available }) if min_available < pos => {
                read_whole(self.log.as_ref(), key, min_available, pos - 1).await?
            }
            Err(StoreError::Trimmed { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for b in &batches {
            for e in b.events.iter() {
                if let Some(cp) = Checkpoint::decode(e) {
                    out.push((b.version, cp, e.clone()));
                }
            }
        }
        Ok(out)
    }

    /// Loads a whole or capped chain's keys into a cold state (oldest segment first), each
    /// segment dropped once loaded.
    pub(super) fn load_chain(&self, st: &mut AccountState, chain: Chain) {
        let (segments, capped) = match chain {
            Chain::Whole(s) => (s, false),
            Chain::Capped(s) => (s, true),
            Chain::Broken | Chain::Forgotten => return,
        };
        let before = st.keys.len();
        let below = segments.last().map(|(last, _)| (last.after, last.after_ms));
        st.keys.load_chain(segments.into_iter().rev());
        if capped && let Some((after, after_ms)) = below {
            st.keys.forget_below(after, after_ms);
        }
        self.keys_changed(st, before);
    }
}
