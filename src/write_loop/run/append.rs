//! Step 5 of an attempt: append one write for the batch, and apply what its outcome means
//! (classified by [`crate::write_loop::classify`]), including the 2002 arm's point read.

use super::member::{Member, Phase};
use super::{FirstTouch, Next, Run};
use crate::account::rules::Leg;
use crate::account::{AccountEvent, AccountsMode};
use crate::projection::RecordedWrite;
use crate::store::{AggregateWrite, Event};
use crate::write_loop::arm::Arm;
use crate::write_loop::classify::{self, Behind, Failure, Settlement, Step, ThisWrite};
use crate::write_loop::error::invariant;
use crate::write_loop::verify::{self, SeqOwnership};
use crate::write_loop::{LegResult, WriteOutcome};

impl Run<'_> {
    /// Sends one write for `batch` and applies what its outcome means. Returns what the next
    /// attempt does.
    pub(super) async fn write(&mut self, batch: &[usize]) -> Next {
        let cx = self.cx;
        let now_ms = cx.projection.event_time_ms();
        let writes = self.aggregate_writes(batch, now_ms);
        let events: usize = writes.iter().map(|w| w.events.len()).sum();
        cx.metrics.write_batch_events.observe(events as f64);
        self.round_trips += 1;
        let result = cx.log.write(cx.identity.client(), writes).await;
        match classify::classify(result) {
            Step::Applied { versions } => {
                self.record_success(batch, &versions).await;
                Next::Backoff
            }
            Step::Rejected {
                arm,
                failure,
                store_behind,
            } => self.rejected(arm, failure, store_behind),
            Step::Hold {
                arm,
                failure,
                this_write,
            } => {
                self.arm(arm);
                self.last_failure = failure;
                self.hold(batch, this_write, now_ms);
                Next::Backoff
            }
            Step::Retry { arm, failure } => {
                self.arm(arm);
                self.last_failure = failure;
                Next::Backoff
            }
            Step::Contested => self.settle_violation(batch).await,
            Step::Fail { arm, error } => {
                self.arm(arm);
                self.answer_unanswered(error);
                Next::Backoff
            }
        }
    }

    /// One guarded, idempotent write per account of the run, carrying `batch`'s legs on it.
    fn aggregate_writes(&self, batch: &[usize], now_ms: u64) -> Vec<AggregateWrite> {
        let identity = self.cx.identity;
        let implicit = self.cx.config.accounts == AccountsMode::Implicit;
        (0..self.accounts.len())
            .map(|ai| AggregateWrite {
                key: identity.key(self.accounts[ai].account),
                events: self
                    .legs_on(batch, ai)
                    .map(|(_, m, li, leg)| Event {
                        client_seq: m.seq(li),
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
            .collect()
    }

    /// The write was rejected (nothing appended): release what it alone held.
    fn rejected(&mut self, arm: Arm, failure: Failure, store_behind: Option<Behind>) -> Next {
        let bounced = self.first_touch == FirstTouch::ThisAttempt;
        // A first touch's bounce says only that the account exists: not contention, so an
        // alert on the conflict rate does not count it.
        self.arm(match arm {
            Arm::Conflict if bounced => Arm::FirstTouchBounce,
            arm => arm,
        });
        if arm == Arm::Conflict {
            self.copies.behind();
        }
        self.last_failure = failure;
        if let Some(behind) = store_behind {
            self.fold_again_where_the_store_is_behind(behind);
        }
        // This write did not land, but an earlier one under a held sequence may have:
        // that sequence stays held until a 2002 and the point read settle it.
        self.release_seqs_of_answered();
        // A first touch bounced: the account exists, nobody is contending.
        if bounced {
            Next::AtOnceUncounted
        } else {
            Next::Backoff
        }
    }

    /// The write may have landed ([`ThisWrite::MayHaveLanded`]), or an earlier one is not
    /// durable yet: `batch` keeps its sequences, and a refusal on later state is no longer
    /// final.
    fn hold(&mut self, batch: &[usize], this_write: ThisWrite, now_ms: u64) {
        for &mi in batch {
            let m = &mut self.members[mi];
            m.earlier.note_may_have_landed();
            if this_write == ThisWrite::MayHaveLanded {
                m.sent_unknown(now_ms);
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

    /// The write applied at `versions`: record it in the projection, then answer `batch`.
    async fn record_success(&mut self, batch: &[usize], versions: &[u64]) {
        if let Some(what) = self.misplaced(versions) {
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
        self.record_in_projection(batch, versions).await;
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
        self.arm(Arm::Success);
    }

    /// What is wrong with an applied write's versions, if anything: one per aggregate, each
    /// the next after the version the write expected.
    fn misplaced(&self, versions: &[u64]) -> Option<&'static str> {
        if versions.len() != self.accounts.len() {
            Some("the store acknowledged a write without one version per aggregate")
        } else if (self.accounts.iter().zip(versions)).any(|(t, &v)| v != t.snap.version + 1) {
            // Recording it would move the cursor past versions never folded.
            Some("the store acknowledged a guarded write at a version other than the next")
        } else {
            None
        }
    }

    /// Records the applied write in each account's view (index entries, then the cursor).
    async fn record_in_projection(&mut self, batch: &[usize], versions: &[u64]) {
        let projection = self.cx.projection;
        // (account index, the events on it, the account's highest sequence, balance after).
        let mut per_account = Vec::with_capacity(self.accounts.len());
        for (ai, t) in self.accounts.iter().enumerate() {
            let mut events = Vec::with_capacity(batch.len());
            let mut max_seq = 0;
            let mut balance_after = t.snap.balance;
            for (_, m, li, leg) in self.legs_on(batch, ai) {
                events.push((m.req.event_id, m.balances[li], leg.event));
                max_seq = max_seq.max(m.seq(li));
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
        // current at once rather than at the account's next write. A failure here is left
        // to the next catch-up; the write landed either way.
        for account in recorded.rows_behind {
            self.round_trips += 1;
            if let Ok(caught_up) = projection.refresh(account, &[]).await {
                self.db_round_trips += caught_up.db_statements;
            }
        }
    }

    /// 2002: point-read the contested sequences. The batch was one all-or-nothing write, so
    /// one settlement covers it.
    async fn settle_violation(&mut self, batch: &[usize]) -> Next {
        let verdicts = match self.read_ownership(batch).await {
            Ok(verdicts) => verdicts,
            Err(failure) => {
                // Could not look: hold everything and try again after a catch-up.
                self.last_failure = failure;
                for &mi in batch {
                    self.members[mi].earlier.note_may_have_landed();
                }
                return Next::Backoff;
            }
        };
        match classify::settle(verify::combine(verdicts.iter().map(|v| v.2))) {
            Settlement::Ours => {
                self.arm(Arm::SeqOurs);
                for &(mi, li, v) in &verdicts {
                    if let SeqOwnership::Ours { version } = v {
                        self.members[mi].mark_proven(li, version);
                    }
                }
                for &mi in batch {
                    self.members[mi].earlier.note_may_have_landed();
                }
                // Read it back at once. A first touch's attempt does not count even so: it
                // stood in for the read it skipped.
                if self.first_touch == FirstTouch::ThisAttempt {
                    Next::AtOnceUncounted
                } else {
                    Next::AtOnce
                }
            }
            Settlement::Sibling { failure } => {
                self.arm(Arm::SeqSibling);
                self.last_failure = failure;
                self.release_seqs();
                Next::Backoff
            }
            Settlement::Unverifiable { error } => {
                self.arm(Arm::Unverifiable);
                for &mi in batch {
                    self.members[mi].phase = Phase::Done(Err(error.clone()));
                }
                Next::Backoff
            }
        }
    }

    /// Who holds each of `batch`'s sequences: (member index, leg index, verdict), read per
    /// account from the lowest floor of the sequences on it. `Err`: a read failed.
    async fn read_ownership(
        &mut self,
        batch: &[usize],
    ) -> Result<Vec<(usize, usize, SeqOwnership)>, Failure> {
        let cx = self.cx;
        let identity = cx.identity;
        let mut verdicts: Vec<(usize, usize, SeqOwnership)> = Vec::new();
        for ai in 0..self.accounts.len() {
            let seqs: Vec<(usize, usize, u64)> = self
                .legs_on(batch, ai)
                .map(|(mi, m, li, _)| (mi, li, m.seq(li)))
                .collect();
            let floor = self
                .legs_on(batch, ai)
                .map(|(_, m, li, _)| m.hold.floor(li))
                .min()
                .unwrap_or(1);
            let (Some(first), Some(last)) = (
                seqs.iter().map(|s| s.2).min(),
                seqs.iter().map(|s| s.2).max(),
            ) else {
                continue;
            };
            self.round_trips += 1;
            let owners = verify::read_seq_owners_from(
                cx.log.as_ref(),
                identity.key(self.accounts[ai].account),
                identity.client(),
                first,
                last,
                floor,
            )
            .await
            .map_err(|e| Failure::store("ownership read: ", &e))?;
            for (mi, li, seq) in seqs {
                let v = verify::ownership(&owners, seq, self.members[mi].req.event_id);
                verdicts.push((mi, li, v));
            }
        }
        Ok(verdicts)
    }
}
