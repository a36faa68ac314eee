//! Step 2 of an attempt, the read-back: answering members that the recent-writes index (or a
//! proven landing) shows as done, so a request that already landed is never written again.

use super::{Phase, Run};
use crate::metrics::arm;
use crate::projection::{RecentWrite, ScanHit};
use crate::write_loop::{LegResult, WriteError, WriteOutcome};

impl Run<'_> {
    /// Answers every unanswered member that the index (or a proven landing) shows as done.
    /// An index hit on any leg proves the whole request landed (writes are all or nothing);
    /// a leg without a hit is rebuilt from current state, but only once that state is known
    /// to hold the write: its fold is past the proven landing, or at the store's tip (then
    /// the leg's entry has expired). Until then the member is [`Phase::Landed`], never
    /// written again, and answered after a later catch-up. A hit for a different operation
    /// is a reused key.
    pub(super) async fn answer_from_index(&mut self) {
        let projection = &self.svc.projection;
        let mut replays = 0u64;
        for mi in 0..self.members.len() {
            let m = &self.members[mi];
            if m.is_done() {
                continue;
            }
            let landed_at = m.landed_at();
            let legs = m.legs;
            let legs = legs.as_slice();
            let hits: Vec<Option<RecentWrite>> = (0..legs.len())
                .map(|li| {
                    let t = &self.accounts[m.accounts[li]];
                    t.view
                        .as_ref()
                        .and_then(|v| projection.lookup(v, m.req.event_id))
                })
                .collect();
            let replayed = !m.sent_unknown || landed_by_another(&hits, &m.unknown_tags);
            let landed_visible = landed_at.iter().zip(legs).any(|(v, _)| v.is_some())
                && landed_at
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
                        m.mark_landed(li, h.version);
                    }
                }
                continue;
            }
            let answer = if reused {
                self.svc.metrics().idem_key_reuse.inc();
                Err(WriteError::KeyReused)
            } else {
                let m = &self.members[mi];
                let legs = legs
                    .iter()
                    .zip(&hits)
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
                    .collect();
                if replayed {
                    replays += 1;
                }
                Ok(WriteOutcome { legs, replayed })
            };
            self.members[mi].phase = Phase::Done(answer);
        }
        if replays > 0 {
            self.svc.metrics().idem_replays.inc_by(replays);
            self.arm(arm::REPLAYED);
        }
    }

    /// Whether every leg of a landed member without an index hit can be rebuilt from the
    /// state just loaded: that state is past the leg's proven landing, or at the store's tip
    /// (so the write is behind the cursor and its entry expired).
    async fn rebuildable(&mut self, mi: usize, hits: &[Option<RecentWrite>]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let (legs, accounts, landed_at) = {
            let m = &self.members[mi];
            (m.legs, m.accounts, m.landed_at())
        };
        for (li, leg) in legs.as_slice().iter().enumerate() {
            if hits[li].is_some() {
                continue;
            }
            let snap = self.accounts[accounts[li]].snap;
            match landed_at[li] {
                Some(v) if snap.version >= v => continue,
                // Below the proven landing this state cannot hold the write, whatever the
                // tip says: a tip from a node that lags would vouch for it (found in audit).
                Some(_) => return false,
                None => {}
            }
            self.round_trips += 1;
            match svc
                .projection
                .log()
                .details(identity.key(leg.account))
                .await
            {
                Ok(d) if snap.version >= d.max_version => {}
                _ => return false,
            }
        }
        true
    }
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
    /// it (read from the state, below or above it); found on some legs only: [`Phase::Landed`],
    /// answered after a later catch-up; found under a different operation: a reused key. Returns false when a scan failed: the attempt must not write
    /// on a guess (the caller tries again).
    pub(super) async fn scan_misses(&mut self) -> bool {
        let svc = self.svc;
        if svc.projection.config().scan_window.is_none() {
            return true;
        }
        let mut replays = 0u64;
        for mi in 0..self.members.len() {
            let m = &self.members[mi];
            if !matches!(m.phase, Phase::Open) || m.seqs.is_some() || m.may_have_landed {
                continue;
            }
            let (legs, accounts, event_id) = (m.legs, m.accounts, m.req.event_id);
            let legs = legs.as_slice();
            let mut hits: [Option<ScanHit>; 2] = [None; 2];
            for li in 0..legs.len() {
                let t = &self.accounts[accounts[li]];
                let (account, snap) = (t.account, t.snap);
                self.round_trips += 1;
                match svc.projection.scan_for(account, event_id, snap).await {
                    Ok(hit) => {
                        if hit.is_some() {
                            self.round_trips += 1;
                        }
                        hits[li] = hit;
                    }
                    Err(e) => {
                        svc.metrics().idem_scans.with_label_values(&["error"]).inc();
                        self.last_failure = format!("scan on miss: {e}");
                        return false;
                    }
                }
            }
            if hits.iter().all(Option::is_none) {
                continue;
            }
            let reused = hits
                .iter()
                .zip(legs)
                .any(|(h, leg)| h.is_some_and(|h| h.event != leg.event));
            let m = &mut self.members[mi];
            if reused {
                svc.metrics().idem_key_reuse.inc();
                m.phase = Phase::Done(Err(WriteError::KeyReused));
                continue;
            }
            let answered: Option<Vec<LegResult>> = legs
                .iter()
                .zip(&hits)
                .map(|(leg, hit)| {
                    let h = (*hit)?;
                    Some(LegResult {
                        account: leg.account,
                        balance: h.balance,
                        version: h.version,
                    })
                })
                .collect();
            match answered {
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
                            m.mark_landed(li, h.version);
                        }
                    }
                }
            }
        }
        if replays > 0 {
            svc.metrics().idem_replays.inc_by(replays);
            self.arm(arm::REPLAYED);
        }
        true
    }
}
