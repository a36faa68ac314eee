//! Where a cold fold starts: the newest keyed checkpoint whose chain of keys is whole or
//! capped (`key_chain.rs`), else a checkpoint a retention old, or within the key cap
//! (docs/architecture.md, "Checkpoints and retention").

use super::checkpoint::{Checkpoint, Tail};
use super::key_chain::Chain;
use super::state::NewestCheckpoint;
use super::{AccountSlot, Projection};
use crate::account::AccountId;
use crate::account::holds::HoldBook;
use crate::metrics::checkpoint_load;
use crate::store::StoreError;

impl Projection {
    /// Where a fold starts without a whole chain of keys: the newest checkpoint a retention
    /// old, so every key the fold must hold lies after it. With `bounded` (the memory fold,
    /// whose key memory holds at most `--idempotency-max-keys-per-account`), never further
    /// back than that many versions below the newest checkpoint: a fold that started further
    /// back would forget those keys to its cap anyway. Then the keys below the start are
    /// forgotten ([`Chain::Forgotten`]), and the horizon the account's answers state says
    /// so. On a stream known trimmed, only at or above the trim: the lowest such when none
    /// qualifies.
    async fn start_without_chain(
        &self,
        account: AccountId,
        tail: &Tail,
        trimmed_at: Option<u64>,
        bounded: bool,
    ) -> Result<Option<(Checkpoint, Option<Chain>)>, StoreError> {
        let (tip, retention) = (self.server_tip_ms(), self.retention_ms());
        let cap = u64::try_from(self.config.max_keys_per_account).unwrap_or(u64::MAX);
        let cap_floor = if bounded {
            tail.newest_version.saturating_sub(cap)
        } else {
            0
        };
        let old_enough =
            |c: &Checkpoint| c.outside_window(tip, retention) || c.version <= cap_floor;
        let readable = |c: &Checkpoint| trimmed_at.is_none_or(|t| c.version >= t);
        let found = self
            .newest_checkpoint_where(account, tail, old_enough)
            .await?
            .map(|(_, cp)| cp)
            .filter(readable)
            .or_else(|| {
                trimmed_at?;
                tail.iter()
                    .filter(|c| readable(c))
                    .min_by_key(|c| c.version)
                    .copied()
            });
        Ok(found.map(|cp| {
            let forgets = !cp.outside_window(tip, retention);
            (cp, forgets.then_some(Chain::Forgotten))
        }))
    }

    /// A cold fold's start: the newest checkpoint outside the window, checked against the
    /// stream, seeded into the (still empty) state. Returns the version to read from: after
    /// the checkpoint, or 1 when there is none usable (the whole stream); and whether that
    /// is definitive. Never fails: a checkpoint stream that cannot be read (or a check that
    /// could not be made) only costs the whole fold, but then a trim met by that fold is
    /// not a verdict on the account (`catch_up` answers it retryably).
    pub(super) async fn start_from_checkpoint(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        trimmed_at: Option<u64>,
    ) -> (u64, bool) {
        let (result, tail, used, chain) = self.usable_checkpoint(account, trimmed_at, true).await;
        let (result, used, holds) = self
            .with_holds(account, tail.as_ref(), (result, used))
            .await;
        self.metrics
            .checkpoint_loads
            .with_label_values(&[result])
            .inc();
        let definitive = result != checkpoint_load::UNAVAILABLE;
        let mut st = slot.state.lock();
        if st.generation != generation || st.broken.is_some() {
            return (st.version + 1, definitive);
        }
        if let Some(tail) = tail {
            st.checkpoint.stream_version = Some(tail.stream_version);
            st.checkpoint.covered_version = st.checkpoint.covered_version.max(tail.newest_version);
            // The next checkpoint's keys start at the newest in the stream (by position).
            st.checkpoint.keys_from = Some(
                tail.checkpoints
                    .last()
                    .map_or_else(NewestCheckpoint::default, |(_, c)| NewestCheckpoint::of(c)),
            );
            // Spacing counts from a checkpoint known to exist; with none, the first is due
            // as soon as the events are.
            st.checkpoint.last_ms = if tail.newest_version > 0 {
                self.now_ms()
            } else {
                0
            };
        }
        match used {
            // Checked against the stream: it stands for the whole fold up to its version,
            // whatever this state held below it (a replica behind a trim).
            Some(cp) if cp.version > st.version => {
                st.balance = cp.balance;
                st.version = cp.version;
                st.max_client_seq = st.max_client_seq.max(cp.max_client_seq);
                st.holds = holds.filter(|b| !b.is_empty()).map(Box::new);
                // The keys at and below it come with it (a keyed chain), or are past the
                // retention (a checkpoint a retention old): none is folded.
                match chain.filter(|_| st.keys.is_empty()) {
                    Some(Chain::Forgotten) => st.keys.forget_below(cp.version, cp.commit_ms),
                    Some(chain) => self.load_chain(&mut st, chain),
                    None => st.keys.raise_floor(cp.version, cp.commit_ms),
                }
                (cp.version + 1, true)
            }
            // Another catch-up moved it past the checkpoint meanwhile: on from there.
            Some(_) => (st.version + 1, true),
            None => (st.version + 1, definitive),
        }
    }

    /// The Postgres catch-up's start: as [`Projection::start_from_checkpoint`], on a state
    /// read from the shared row (or empty: a fresh or restored database). The checkpoint is
    /// taken only when it is newer than the row; the row otherwise (both stand for landed
    /// state, and the newer one reads less). Returns whether a trim met next is a verdict.
    pub(crate) async fn seed_from_checkpoint(
        &self,
        account: AccountId,
        st: &mut super::AccountState,
        trimmed_at: Option<u64>,
    ) -> bool {
        let (result, _, used, _) = self.usable_checkpoint(account, trimmed_at, false).await;
        self.metrics
            .checkpoint_loads
            .with_label_values(&[result])
            .inc();
        // Holds need the memory projection: a checkpoint that carries some is not this fold's
        // start, and the fold meets the hold events themselves.
        if let Some(cp) = used.filter(|cp| cp.version > st.version && cp.holds_len == 0) {
            st.balance = cp.balance;
            st.version = cp.version;
            st.max_client_seq = st.max_client_seq.max(cp.max_client_seq);
        }
        result != checkpoint_load::UNAVAILABLE
    }

    /// The holds of the checkpoint a fold starts from. With holds off, a checkpoint that
    /// carries some is not used: the fold meets the hold events and answers `HOLDS_OFF`.
    /// Holds that cannot be read make the checkpoint unusable, as any read that fails.
    async fn with_holds(
        &self,
        account: AccountId,
        tail: Option<&Tail>,
        (result, used): (&'static str, Option<Checkpoint>),
    ) -> (&'static str, Option<Checkpoint>, Option<HoldBook>) {
        let Some(cp) = used else {
            return (result, None, None);
        };
        if cp.holds_len == 0 {
            return (result, Some(cp), None);
        }
        if !self.config.holds {
            return (checkpoint_load::NONE, None, None);
        }
        match self.checkpoint_holds(account, tail, &cp).await {
            Ok(Some(book)) => (result, Some(cp), Some(book)),
            Ok(None) => {
                tracing::warn!(%account, version = cp.version,
                    "a checkpoint's holds do not decode; ignored, folding the whole stream");
                (checkpoint_load::REJECTED, None, None)
            }
            Err(e) => {
                tracing::debug!(%account, error = %e, "could not read a checkpoint's holds; folding the whole stream");
                (checkpoint_load::UNAVAILABLE, None, None)
            }
        }
    }

    /// What [`Projection::start_from_checkpoint`] starts from, and the metric's result.
    /// With `keyed` (the memory fold, which keeps keys from segments): the newest keyed
    /// checkpoint whose chain of keys is whole or capped, at any age. Otherwise, or when the
    /// chain is broken: the newest checkpoint a retention old (every key the fold must hold
    /// lies after it).
    async fn usable_checkpoint(
        &self,
        account: AccountId,
        trimmed_at: Option<u64>,
        keyed: bool,
    ) -> (
        &'static str,
        Option<Tail>,
        Option<Checkpoint>,
        Option<Chain>,
    ) {
        let tail = match self.checkpoint_tail(account).await {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(%account, error = %e, "checkpoint stream unreadable; folding the whole stream");
                return (checkpoint_load::UNAVAILABLE, None, None, None);
            }
        };
        let readable = |c: &Checkpoint| trimmed_at.is_none_or(|t| c.version >= t);
        let newest_keyed = tail
            .checkpoints
            .iter()
            .rposition(|(_, c)| c.keys_after.is_some() && readable(c))
            .filter(|_| keyed);
        let mut chain = None;
        let mut pick = None;
        if let Some(at) = newest_keyed {
            match self.key_chain(account, &tail, at).await {
                Ok(Chain::Broken) => {}
                Ok(c) => {
                    chain = Some(c);
                    pick = Some(tail.checkpoints[at].1);
                }
                Err(e) => {
                    tracing::debug!(%account, error = %e, "could not read the keys' checkpoints; folding the whole stream");
                    return (checkpoint_load::UNAVAILABLE, Some(tail), None, None);
                }
            }
        }
        let (cp, chain) = match pick {
            Some(cp) => (cp, chain),
            None => match self
                .start_without_chain(account, &tail, trimmed_at, keyed)
                .await
            {
                Ok(Some(start)) => start,
                Ok(None) => return (checkpoint_load::NONE, Some(tail), None, None),
                Err(e) => {
                    tracing::debug!(%account, error = %e, "could not search the checkpoints; folding the whole stream");
                    return (checkpoint_load::UNAVAILABLE, Some(tail), None, None);
                }
            },
        };
        match self.check_checkpoint(account, &cp).await {
            Ok(Ok(())) => (checkpoint_load::USED, Some(tail), Some(cp), chain),
            Ok(Err(mismatch)) => {
                tracing::warn!(%account, version = cp.version, ?mismatch,
                    "a checkpoint contradicts the account stream; ignored, folding the whole stream");
                (checkpoint_load::REJECTED, Some(tail), None, None)
            }
            Err(e) => {
                tracing::debug!(%account, error = %e, "could not check a checkpoint; folding the whole stream");
                (checkpoint_load::UNAVAILABLE, Some(tail), None, None)
            }
        }
    }
}
