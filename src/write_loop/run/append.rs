//! Step 5 of an attempt: append one write for the batch, and apply what its outcome means
//! (classified by [`crate::write_loop::classify`]), including the 2002 arm's point read.

use super::{Member, Phase, Run};
use crate::account::rules::Leg;
use crate::account::{AccountEvent, AccountsMode};
use crate::metrics::arm;
use crate::projection::RecordedWrite;
use crate::projection::index::write_tag;
use crate::store::{AggregateWrite, Event};
use crate::write_loop::classify::{self, Settlement, Step};
use crate::write_loop::service::invariant;
use crate::write_loop::verify::{self, SeqOwnership};
use crate::write_loop::{LegResult, WriteOutcome};

impl Run<'_> {
    /// Sends one write for `batch` and applies what its outcome means. Returns true when the
    /// next attempt should not back off (a proven landing only needs a read-back).
    pub(super) async fn write(&mut self, batch: &[usize]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let now_ms = svc.projection.event_time_ms();
        let implicit = svc.config.accounts == AccountsMode::Implicit;
        let writes: Vec<AggregateWrite> = (0..self.accounts.len())
            .map(|ai| AggregateWrite {
                key: identity.key(self.accounts[ai].account),
                events: self
                    .legs_on(batch, ai)
                    .map(|(_, m, li, leg)| Event {
                        client_seq: Self::seq(m, li),
                        event_id: Some(m.req.event_id),
                        event_type: leg.event.event_type(),
                        payload: leg.event.encode(),
                        timestamp_ms: now_ms,
                    })
                    .collect(),
                expected_version: Some(self.accounts[ai].snap.version),
                // With explicit accounts only an open creates a stream: the store itself
                // refuses any other write to an account that does not exist, whatever
                // state this replica decided on.
                allow_create: implicit
                    || self
                        .legs_on(batch, ai)
                        .any(|(_, _, _, leg)| leg.event == AccountEvent::Opened),
                enforce_client_idempotency: true,
            })
            .collect();
        let events: usize = writes.iter().map(|w| w.events.len()).sum();
        svc.metrics().write_batch_events.observe(events as f64);
        self.round_trips += 1;
        let result = svc.projection.log().write(identity.client(), writes).await;
        match classify::classify(result) {
            Step::Landed { versions } => {
                self.record_success(batch, &versions).await;
                false
            }
            Step::Rejected {
                arm,
                failure,
                store_behind,
            } => {
                self.arm(arm);
                self.bounced |= arm == arm::CONFLICT;
                self.last_failure = failure;
                if let Some(behind) = store_behind {
                    self.fold_again_where_the_store_is_behind(behind);
                }
                // This write did not land, but an earlier one under a held sequence may have:
                // that sequence stays held until a 2002 and the point read settle it.
                self.release_seqs_of_answered();
                // A first touch bounced: the account exists, nobody is contending.
                self.first_touch
            }
            Step::Hold {
                arm,
                failure,
                sent_unknown,
            } => {
                self.arm(arm);
                self.last_failure = failure;
                for &mi in batch {
                    let m = &mut self.members[mi];
                    m.may_have_landed = true;
                    if sent_unknown {
                        m.sent_unknown = true;
                        m.seq_unanswered = true;
                        if let Some([s0, s1]) = m.seqs {
                            let tags = [write_tag(s0, now_ms), write_tag(s1, now_ms)];
                            if !m.unknown_tags.contains(&tags) {
                                m.unknown_tags.push(tags);
                            }
                        }
                    }
                }
                false
            }
            Step::Retry { arm, failure } => {
                self.arm(arm);
                self.last_failure = failure;
                false
            }
            Step::Contested => self.settle_violation(batch).await,
            Step::Fail { arm, error } => {
                self.arm(arm);
                self.answer_unanswered(error);
                false
            }
        }
    }

    /// The legs of `batch` that write to account `ai`, in write order:
    /// (member index, member, leg index, leg).
    fn legs_on<'b>(
        &'b self,
        batch: &'b [usize],
        ai: usize,
    ) -> impl Iterator<Item = (usize, &'b Member, usize, &'b Leg)> + 'b {
        batch.iter().flat_map(move |&mi| {
            let m = &self.members[mi];
            m.legs
                .as_slice()
                .iter()
                .enumerate()
                .filter(move |&(li, _)| m.accounts[li] == ai)
                .map(move |(li, leg)| (mi, m, li, leg))
        })
    }

    async fn record_success(&mut self, batch: &[usize], versions: &[u64]) {
        let broken = if versions.len() != self.accounts.len() {
            Some("the store acknowledged a write without one version per aggregate")
        } else if (self.accounts.iter().zip(versions)).any(|(t, &v)| v != t.snap.version + 1) {
            // Recording it would move the cursor past versions never folded.
            Some("the store acknowledged a guarded write at a version other than the next")
        } else {
            None
        };
        if let Some(what) = broken {
            // The store says it applied the write but not at the versions it must have: it
            // landed, so never send it again, and never answer it as a success without its
            // versions. A retry with the same key finds it once a catch-up folds it.
            let err = invariant(what);
            for &mi in batch {
                self.members[mi].phase = Phase::Done(Err(err.clone()));
            }
            self.release_seqs();
            return;
        }
        let svc = self.svc;
        let projection = &svc.projection;
        // (account index, the events on it, the account's highest sequence, balance after).
        let mut per_account = Vec::with_capacity(self.accounts.len());
        for (ai, t) in self.accounts.iter().enumerate() {
            let mut events = Vec::with_capacity(batch.len());
            let mut max_seq = 0;
            let mut balance_after = t.snap.balance;
            for (_, m, li, leg) in self.legs_on(batch, ai) {
                events.push((m.req.event_id, m.balances[li], leg.event));
                max_seq = max_seq.max(Self::seq(m, li));
                balance_after = m.balances[li];
            }
            per_account.push((ai, events, max_seq, balance_after));
        }
        let writes: Vec<_> = per_account
            .iter()
            .filter_map(|(ai, events, max_seq, balance_after)| {
                let t = &self.accounts[*ai];
                let view = t.view.as_ref()?;
                Some((
                    t.account,
                    view,
                    RecordedWrite {
                        expected_version: t.snap.version,
                        generation: t.snap.generation,
                        new_version: versions[*ai],
                        balance_after: *balance_after,
                        max_client_seq: *max_seq,
                        events,
                    },
                ))
            })
            .collect();
        let recorded = projection.record(&writes).await;
        drop(writes);
        self.db_round_trips += recorded.statements;
        // A shared row found behind (the database lost a commit, or another statement got
        // there first) is caught up before the answer: rare, and the SQL read model is then
        // current at once rather than at the account's next write (found black-box). A
        // failure here is left to the next catch-up; the write landed either way.
        for account in recorded.rows_behind {
            self.round_trips += 1;
            if let Ok(caught_up) = projection.refresh(account, &[]).await {
                self.db_round_trips += caught_up.db_statements;
            }
        }
        for &mi in batch {
            let m = &self.members[mi];
            let legs = m
                .legs
                .as_slice()
                .iter()
                .enumerate()
                .map(|(li, leg)| LegResult {
                    account: leg.account,
                    balance: m.balances[li],
                    version: versions[m.accounts[li]],
                })
                .collect();
            self.members[mi].phase = Phase::Done(Ok(WriteOutcome {
                legs,
                replayed: false,
            }));
        }
        // The batch's sequences are used; a member still open takes fresh ones.
        self.release_seqs();
        self.arm(arm::SUCCESS);
    }

    /// 2002: point-read the contested sequences. The batch was one all-or-nothing write, so
    /// one settlement covers it.
    async fn settle_violation(&mut self, batch: &[usize]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let mut verdicts: Vec<(usize, usize, SeqOwnership)> = Vec::new();
        for ai in 0..self.accounts.len() {
            let seqs: Vec<(usize, usize, u64)> = self
                .legs_on(batch, ai)
                .map(|(mi, m, li, _)| (mi, li, Self::seq(m, li)))
                .collect();
            let floor = self
                .legs_on(batch, ai)
                .map(|(_, m, li, _)| m.seq_floor[li])
                .min()
                .unwrap_or(1);
            let (Some(first), Some(last)) = (
                seqs.iter().map(|s| s.2).min(),
                seqs.iter().map(|s| s.2).max(),
            ) else {
                continue;
            };
            self.round_trips += 1;
            let owners = match verify::read_seq_owners_from(
                svc.projection.log().as_ref(),
                identity.key(self.accounts[ai].account),
                identity.client(),
                first,
                last,
                floor,
            )
            .await
            {
                Ok(owners) => owners,
                Err(e) => {
                    // Could not look: hold everything and try again after a catch-up.
                    self.last_failure = format!("ownership read: {e}");
                    for &mi in batch {
                        self.members[mi].may_have_landed = true;
                    }
                    return false;
                }
            };
            for (mi, li, seq) in seqs {
                let v = verify::ownership(&owners, seq, self.members[mi].req.event_id);
                verdicts.push((mi, li, v));
            }
        }
        match classify::settle(verify::combine(verdicts.iter().map(|v| v.2))) {
            Settlement::Ours => {
                self.arm(arm::SEQ_OURS);
                for &(mi, li, v) in &verdicts {
                    if let SeqOwnership::Ours { version } = v {
                        self.members[mi].mark_landed(li, version);
                    }
                }
                for &mi in batch {
                    self.members[mi].may_have_landed = true;
                }
                true
            }
            Settlement::Sibling { failure } => {
                self.arm(arm::SEQ_SIBLING);
                self.last_failure = failure;
                self.release_seqs();
                false
            }
            Settlement::Unverifiable { error } => {
                self.arm(arm::UNVERIFIABLE);
                for &mi in batch {
                    self.members[mi].phase = Phase::Done(Err(error.clone()));
                }
                false
            }
        }
    }
}
