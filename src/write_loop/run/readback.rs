//! Step 2 of an attempt, the read-back: answering members that the recent-writes index (or a
//! proven landing) shows as done, so a request that already landed is never written again.

use super::Run;
use super::member::{EarlierAttempts, Phase, SeqHold};
use crate::account::rules::Leg;
use crate::projection::{RecentWrite, ScanHit};
use crate::write_loop::arm::Arm;
use crate::write_loop::classify::Failure;
use crate::write_loop::error::WriteError;
use crate::write_loop::{LegResult, WriteOutcome};

/// Whether an attempt's looks past the index (a remembered key's read, a scan on miss)
/// looked everywhere they had to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scanned {
    /// Every look answered (or there was nothing to look at): the attempt goes on.
    Complete,
    /// A look failed: the attempt must not write on a guess.
    Failed,
}

impl Run<'_> {
    /// Answers every unanswered member that the index, the key memory past the window (or a
    /// proven landing) shows as done.
    /// An index hit on any leg proves the whole request landed (writes are all or nothing);
    /// a leg without a hit is rebuilt from current state, but only once that state is known
    /// to hold the write: its fold is past the proven landing, or at the store's tip (then
    /// the leg's entry has expired). Until then the member is [`Phase::Proven`], never
    /// written again, and answered after a later catch-up. A hit for a different operation
    /// is a reused key.
    pub(super) async fn answer_from_index(&mut self) -> Scanned {
        let mut replays = 0u64;
        for mi in 0..self.members.len() {
            if self.members[mi].is_done() {
                continue;
            }
            let Some(hits) = self.look_up_legs(mi).await else {
                return Scanned::Failed;
            };
            let m = &self.members[mi];
            let proven_at = m.proven_at();
            let legs = m.legs;
            let legs = legs.as_slice();
            let replayed = match &m.earlier {
                EarlierAttempts::SentUnknown { tags } => landed_by_another(&hits, tags),
                _ => true,
            };
            let landed_visible = proven_at.iter().zip(legs).any(|(v, _)| v.is_some())
                && proven_at
                    .iter()
                    .enumerate()
                    .take(legs.len())
                    .all(|(li, v)| {
                        v.is_none_or(|v| self.accounts[m.accounts[li]].snap.version >= v)
                    });
            if hits.iter().all(Option::is_none) && !landed_visible {
                continue;
            }
            let reused = hits
                .iter()
                .zip(legs)
                .any(|(h, leg)| h.is_some_and(|h| h.event != leg.event));
            if !reused && !self.rebuildable(mi, &hits).await {
                // Landed, but a leg's fold may not have reached it yet (a stale local fold, a
                // lagging read): its current state would not be this write's answer.
                let m = &mut self.members[mi];
                for (li, hit) in hits.iter().enumerate() {
                    if let Some(h) = hit {
                        m.mark_proven(li, h.version);
                    }
                }
                continue;
            }
            let answer = if reused {
                self.cx.metrics.idem_key_reuse.inc();
                Err(WriteError::KeyReused)
            } else {
                if replayed {
                    replays += 1;
                }
                Ok(WriteOutcome {
                    legs: self.rebuilt_legs(mi, &hits),
                    replayed,
                })
            };
            self.members[mi].phase = Phase::Done(answer);
        }
        if replays > 0 {
            self.cx.metrics.idem_replays.inc_by(replays);
            self.arm(Arm::Replayed);
        }
        Scanned::Complete
    }

    /// Member `mi`'s entry on each leg: the window's index entry, or past the window a key
    /// the account remembers, confirmed by one read of the batch it points at. `None` when
    /// such a read failed: the attempt must not write on a guess.
    async fn look_up_legs(&mut self, mi: usize) -> Option<Vec<Option<RecentWrite>>> {
        let projection = self.cx.projection;
        let m = &self.members[mi];
        let (legs, accounts, event_id) = (m.legs, m.accounts, m.req.event_id);
        let mut hits = Vec::with_capacity(legs.as_slice().len());
        for &at in accounts.iter().take(legs.as_slice().len()) {
            let t = &self.accounts[at];
            let Some(view) = t.view.as_ref() else {
                hits.push(None);
                continue;
            };
            if let Some(hit) = projection.lookup(view, event_id) {
                hits.push(Some(hit));
                continue;
            }
            match projection.remembered(t.account, view, event_id).await {
                Ok(hit) => hits.push(hit),
                Err(e) => {
                    self.last_failure = Failure::store("a remembered key: ", &e);
                    return None;
                }
            }
        }
        Some(hits)
    }

    /// A landed member's answer, leg by leg: the index entry's, or, for a leg without one,
    /// the state just loaded (which [`Run::rebuildable`] vouched holds the write).
    fn rebuilt_legs(&self, mi: usize, hits: &[Option<RecentWrite>]) -> Vec<LegResult> {
        let m = &self.members[mi];
        m.legs
            .as_slice()
            .iter()
            .zip(hits)
            .enumerate()
            .map(|(li, (leg, hit))| match hit {
                Some(h) => LegResult {
                    account: leg.account,
                    balance: h.balance,
                    version: h.version,
                },
                None => {
                    let snap = self.accounts[m.accounts[li]].snap;
                    LegResult {
                        account: leg.account,
                        balance: snap.balance,
                        version: snap.version,
                    }
                }
            })
            .collect()
    }

    /// Whether every leg of a landed member without an index hit can be rebuilt from the
    /// state just loaded: that state is past the leg's proven landing, or at the store's tip
    /// (so the write is behind the cursor and its entry expired).
    async fn rebuildable(&mut self, mi: usize, hits: &[Option<RecentWrite>]) -> bool {
        let cx = self.cx;
        let (legs, accounts, proven_at) = {
            let m = &self.members[mi];
            (m.legs, m.accounts, m.proven_at())
        };
        for (li, leg) in legs.as_slice().iter().enumerate() {
            if hits[li].is_some() {
                continue;
            }
            let snap = self.accounts[accounts[li]].snap;
            match proven_at[li] {
                Some(v) if snap.version >= v => continue,
                // Below the proven landing this state cannot hold the write, whatever the
                // tip says: a tip from a node that lags would vouch for it.
                Some(_) => return false,
                None => {}
            }
            self.round_trips += 1;
            // The leader's tip: a follower's would vouch for a state behind an acknowledged
            // write, and the answer rebuilt from it would be wrong.
            match cx.projection.store_version(leg.account).await {
                Ok(tip) if snap.version >= tip => {}
                _ => return false,
            }
        }
        true
    }
}

/// A scanned member's answer, when the scan found it on every leg.
fn found_on_every_leg(legs: &[Leg], hits: &[Option<ScanHit>]) -> Option<Vec<LegResult>> {
    legs.iter()
        .zip(hits)
        .map(|(leg, hit)| {
            let h = (*hit)?;
            Some(LegResult {
                account: leg.account,
                balance: h.balance,
                version: h.version,
            })
        })
        .collect()
}

/// Whether the index shows the landing as a write this run never sent with an unknown
/// outcome (another write tag: another replica's, or an earlier request's): then the answer
/// is a replay. Only when every hit's tag is known; otherwise the landing may be this run's
/// own, and it is not called a replay.
fn landed_by_another(hits: &[Option<RecentWrite>], unknown_tags: &[[u32; 2]]) -> bool {
    hits.iter().any(Option::is_some)
        && hits.iter().enumerate().all(|(li, hit)| match hit {
            None => true,
            Some(h) => h
                .write_tag
                .is_some_and(|tag| unknown_tags.iter().all(|t| t[li] != tag)),
        })
}

impl Run<'_> {
    /// Step 2b, scan on miss (opt-in, `--idempotency-scan-window`): a request the index
    /// missed and this run never sent is looked for in each leg's account's own recent
    /// batches. Found on every leg: answered like any replay, with the balance right after
    /// it (read from the state, below or above it); found on some legs only:
    /// [`Phase::Proven`], answered after a later catch-up; found under a different operation:
    /// a reused key. [`Scanned::Failed`] when a scan failed: the attempt must not write on a
    /// guess (the caller tries again).
    pub(super) async fn scan_misses(&mut self) -> Scanned {
        let cx = self.cx;
        if cx.projection.config().scan_window.is_none() {
            return Scanned::Complete;
        }
        let mut replays = 0u64;
        for mi in 0..self.members.len() {
            let m = &self.members[mi];
            let sent = m.hold != SeqHold::Free || m.earlier.may_have_landed();
            if !matches!(m.phase, Phase::Open) || sent {
                continue;
            }
            let legs = m.legs;
            let legs = legs.as_slice();
            let Some(hits) = self.scan_member(mi).await else {
                return Scanned::Failed;
            };
            if hits.iter().all(Option::is_none) {
                continue;
            }
            let reused = hits
                .iter()
                .zip(legs)
                .any(|(h, leg)| h.is_some_and(|h| h.event != leg.event));
            let m = &mut self.members[mi];
            if reused {
                cx.metrics.idem_key_reuse.inc();
                m.phase = Phase::Done(Err(WriteError::KeyReused));
                continue;
            }
            match found_on_every_leg(legs, &hits) {
                Some(legs) => {
                    replays += 1;
                    m.phase = Phase::Done(Ok(WriteOutcome {
                        legs,
                        replayed: true,
                    }));
                }
                None => {
                    for (li, hit) in hits.iter().enumerate() {
                        if let Some(h) = hit {
                            m.mark_proven(li, h.version);
                        }
                    }
                }
            }
        }
        if replays > 0 {
            cx.metrics.idem_replays.inc_by(replays);
            self.arm(Arm::Replayed);
        }
        Scanned::Complete
    }

    /// Scans each leg's account for member `mi`'s event. `None` when a scan failed.
    async fn scan_member(&mut self, mi: usize) -> Option<[Option<ScanHit>; 2]> {
        let cx = self.cx;
        let m = &self.members[mi];
        let (legs, accounts, event_id) = (m.legs, m.accounts, m.req.event_id);
        let mut hits: [Option<ScanHit>; 2] = [None; 2];
        for li in 0..legs.as_slice().len() {
            let t = &self.accounts[accounts[li]];
            let (account, snap) = (t.account, t.snap);
            self.round_trips += 1;
            match cx.projection.scan_for(account, event_id, snap).await {
                Ok(hit) => {
                    if hit.is_some() {
                        self.round_trips += 1;
                    }
                    hits[li] = hit;
                }
                Err(e) => {
                    cx.metrics.idem_scans.with_label_values(&["error"]).inc();
                    self.last_failure = Failure::store("scan on miss: ", &e);
                    return None;
                }
            }
        }
        Some(hits)
    }
}
