//! One run of the write loop, over one request or a batch of single-account requests on one
//! account. Each request of the run is a [`Member`] in one [`Phase`]; [`Run::drive`] owns
//! every branch, one attempt per turn:
//!
//! 1. state (`load`): the local fold on a warm account's first attempt, else a catch-up;
//! 2. read-back (`readback`): answer what the recent-writes index (or a proven landing)
//!    shows as done;
//! 3. decide ([`super::decide`]) on that state; a refusal only on state known to be current;
//! 4. sequences (`seqs`): held ones stay ([`SeqHold`]), otherwise fresh from the fold just
//!    read;
//! 5. append and classify (`append`, [`super::classify`]); a 2002 settles by point read
//!    ([`super::verify`]).
//!
//! What a member is and holds lives in `member`.

mod append;
mod backoff;
mod load;
mod member;
mod readback;
mod seqs;

use tokio::time::Instant;

use self::load::{LoadFailure, StateFrom};
use self::member::{Member, Phase, SeqHold};
use self::readback::Scanned;
use super::arm::Arm;
use super::classify::{Cause, Failure};
use super::decide::{self, Candidate, Freshness, Landing, Members, NeedsCurrentState, Verdict};
use super::error::{WriteError, invariant};
use super::{Answer, WriteConfig, WriteRequest};
use crate::account::holds::{HoldId, HoldStatus};
use crate::account::{AccountId, Identity, Standing};
use crate::metrics::Metrics;
use crate::projection::{AccountView, Projection, Snapshot};
use crate::request_note::{RequestNote, RunNote};
use crate::store::SharedLog;
use crate::store::health::StoreHealth;

/// One account touched by a run, with its state for the current attempt.
struct Touched {
    account: AccountId,
    /// Where this attempt's index lookups are answered from (set by every load).
    view: Option<AccountView>,
    snap: Snapshot,
}

/// What the next attempt does after a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Backs off first: the usual case (a write that had nothing to say about when to retry).
    Backoff,
    /// Starts at once: a proven landing only needs a read-back.
    AtOnce,
    /// Starts at once, and this attempt does not count: it was a first touch, which stood in
    /// for the read it skipped (the store's answer showed the account exists).
    AtOnceUncounted,
}

/// Where a run stands with its one first touch (an account taken as empty without a read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FirstTouch {
    /// Not taken: an attempt may take it.
    Unused,
    /// This attempt's state is a first touch's: a conflict means only that the account
    /// exists, so the catch-up follows at once, and the attempt does not count (a run with
    /// one attempt still reads back a landed retry).
    ThisAttempt,
    /// Taken on an earlier attempt: a run takes at most one.
    Spent,
}

/// Whether a run's members land together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Linkage {
    /// Each member is answered on its own (a lane's batch, a lone request).
    Independent,
    /// A linked group: every member goes out in one store write, or none does; a final
    /// refusal of one answers the others `LinkedItemFailed`, a retryable answer of one is
    /// every member's.
    Linked,
}

/// What the run knows of the replica's copies of its accounts, for a give-up
/// ([`Run::refresh_unread_copies`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copies {
    /// Not read from the store by this run, and not known to be behind it.
    Unread,
    /// Not read from the store by this run, and known or suspected to be behind it: a write
    /// bounced off the version guard (2003: the store answered, and the state it was decided
    /// on is behind), or a rule refused a request on the copy, which cannot make a refusal
    /// final (only a read of the store can, and the copy may be behind it).
    UnreadBehind,
    /// An attempt of this run read its state from the store (a catch-up).
    Read,
}

impl Copies {
    /// Notes that the copies are behind the store, unless this run has read it since.
    fn behind(&mut self) {
        if *self == Copies::Unread {
            *self = Copies::UnreadBehind;
        }
    }
}

/// What a run needs of its replica, and no more: the write side's queues, lanes and
/// coalescing are none of its business.
#[derive(Clone, Copy)]
pub(super) struct RunContext<'a> {
    /// The replica's state of each account: loads, the index, recording a landed write.
    pub projection: &'a Projection,
    /// The store, for the writes themselves, tip checks and point reads.
    pub log: &'a SharedLog,
    /// The service's client id and how an account maps to its stream.
    pub identity: Identity,
    pub metrics: &'a Metrics,
    /// Whether the store answers: a write that cannot reach a store known to be lost is
    /// answered at once.
    pub health: &'a StoreHealth,
    pub config: WriteConfig,
}

pub(super) struct Run<'a> {
    cx: RunContext<'a>,
    op_label: &'static str,
    members: Vec<Member>,
    accounts: Vec<Touched>,
    attempt: u32,
    round_trips: u32,
    /// Projection database statements this run sent (Postgres backend only).
    db_round_trips: u32,
    last_failure: Failure,
    /// Each account's tip as the store reported it during this run: any state read later
    /// that reaches it folds everything that landed before this run started.
    tips: Option<Vec<u64>>,
    first_touch: FirstTouch,
    copies: Copies,
    linkage: Linkage,
}

impl<'a> Run<'a> {
    /// A run of a linked group: see [`Linkage::Linked`].
    pub(super) fn linked(cx: RunContext<'a>, reqs: Vec<WriteRequest>) -> Self {
        Self {
            op_label: "linked",
            linkage: Linkage::Linked,
            ..Self::new(cx, reqs)
        }
    }

    pub(super) fn new(cx: RunContext<'a>, reqs: Vec<WriteRequest>) -> Self {
        let op_label = match reqs.as_slice() {
            [one] => one.op.name(),
            _ => "batch",
        };
        let mut accounts: Vec<Touched> = Vec::with_capacity(2);
        let members = reqs
            .into_iter()
            .map(|req| {
                let legs = req.op.legs();
                let mut idx = [0; 2];
                for (li, leg) in legs.as_slice().iter().enumerate() {
                    idx[li] = match accounts.iter().position(|t| t.account == leg.account) {
                        Some(ai) => ai,
                        None => {
                            accounts.push(Touched {
                                account: leg.account,
                                view: None,
                                snap: Snapshot::default(),
                            });
                            accounts.len() - 1
                        }
                    };
                }
                Member::new(req, idx)
            })
            .collect();
        Self {
            cx,
            op_label,
            members,
            accounts,
            attempt: 0,
            round_trips: 0,
            db_round_trips: 0,
            last_failure: Failure::default(),
            tips: None,
            first_touch: FirstTouch::Unused,
            copies: Copies::Unread,
            linkage: Linkage::Independent,
        }
    }

    fn arm(&self, arm: Arm) {
        self.cx.metrics.arm(self.op_label, arm.label());
    }

    /// Members not answered yet (open or landed), by index.
    fn unanswered(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.members.len()).filter(|&i| !self.members[i].is_done())
    }

    fn answer_unanswered(&mut self, err: WriteError) {
        for m in self.members.iter_mut().filter(|m| !m.is_done()) {
            m.phase = Phase::Done(Err(err.clone()));
        }
    }

    /// Drives the run until every member is answered, or attempts or time (`deadline`, from
    /// the earliest arrival among the members) run out.
    pub(super) async fn drive(&mut self, deadline: Instant) {
        let mut next = Next::Backoff;
        while self.unanswered().next().is_some() {
            if self.attempt >= self.cx.config.max_attempts || Instant::now() >= deadline {
                self.give_up(deadline).await;
                break;
            }
            self.attempt += 1;
            if self.attempt > 1 && next == Next::Backoff {
                let salt = self.members[0].req.event_id;
                backoff::sleep(self.attempt, salt).await;
            }
            if self.first_touch == FirstTouch::ThisAttempt {
                self.first_touch = FirstTouch::Spent;
            }
            // The cause is this attempt's; the words of the last failure stay for a give-up.
            self.last_failure.cause = Cause::Other;
            next = self.attempt_once(deadline).await;
            if next == Next::AtOnceUncounted {
                // The attempt stood in for a read; the read follows now and counts instead.
                self.attempt -= 1;
            }
            if self.last_failure.cause == Cause::StoreUnreachable
                && self.cx.health.known_lost()
                && self.unanswered().next().is_some()
            {
                // The replica already knows the store is gone: more attempts would only
                // spend the deadline against it.
                self.give_up(deadline).await;
                break;
            }
        }
        self.observe_run();
    }

    /// Answers every unanswered member with a give-up: the store's outage when the last
    /// attempt could not reach it, else the attempts or time spent, after bringing stale
    /// copies up to the store if that is due.
    async fn give_up(&mut self, deadline: Instant) {
        let failure = std::mem::take(&mut self.last_failure);
        if failure.cause == Cause::StoreUnreachable {
            // No catch-up either: it would only add a read to the outage.
            self.arm(Arm::StoreUnreachable);
            self.answer_unanswered(WriteError::StoreUnavailable);
            return;
        }
        self.refresh_unread_copies(deadline).await;
        self.arm(Arm::GaveUp);
        let err = WriteError::GaveUp {
            attempts: self.attempt,
            last: failure.what,
        };
        self.answer_unanswered(err);
    }

    /// One attempt's five steps. Every early end but a proven landing or a first touch's
    /// bounce backs off before the next attempt; a failure that cannot be retried answers
    /// every unanswered member, which ends the run.
    async fn attempt_once(&mut self, deadline: Instant) -> Next {
        // 1. State: the local fold on a warm account's first attempt, else a catch-up.
        let state = match self.load_state(self.load_from()).await {
            Ok(state) => {
                if state == StateFrom::CatchUp {
                    self.copies = Copies::Read;
                }
                state
            }
            Err(LoadFailure::Retry) => return Next::Backoff,
            Err(LoadFailure::Fail(err)) => {
                self.answer_unanswered(err);
                return Next::Backoff;
            }
        };
        // 2. Did it already land? (On a catch-up, this is the read-back.) Then, when
        // configured, scan the stream for what the index missed.
        if self.answer_from_index().await == Scanned::Failed
            || self.scan_misses().await == Scanned::Failed
        {
            return Next::Backoff;
        }
        // 3. Decide on this state.
        let Some(batch) = self.decide(state).await else {
            // A rule said no on the replica's copy, which cannot make a refusal final: the
            // read the copy stood in for follows at once and does not count, so a run of
            // one attempt still gives a final answer.
            if state == StateFrom::Copy {
                return Next::AtOnceUncounted;
            }
            return Next::Backoff;
        };
        let batch = self.admit_new(batch);
        let batch = self.hold_together(batch);
        if batch.is_empty() {
            return Next::Backoff;
        }
        // Nothing is sent past the deadline: a catch-up or scan that outlasted it ends
        // the run at the top of the loop (a retryable give-up). Sent later, the write
        // could land after its client was told to retry, and a retry decided elsewhere
        // in between (a final 422, say) would be contradicted.
        if Instant::now() >= deadline {
            self.last_failure = Failure::other("the deadline passed before the write was sent");
            return Next::Backoff;
        }
        // 4. Sequences: held ones stay; otherwise derived from the fold just read.
        if let Err(err) = self
            .check_seq_room()
            .and_then(|()| self.assign_seqs(&batch))
        {
            self.answer_unanswered(err);
            return Next::Backoff;
        }
        // 5. Append and classify.
        self.write(&batch).await
    }

    /// Records the run in its request's note (for the access log) and in the metrics.
    fn observe_run(&self) {
        RequestNote::run(RunNote {
            attempts: self.attempt,
            outcome: self.outcome_label(),
        });
        let m = self.cx.metrics;
        m.write_attempts
            .with_label_values(&[self.op_label])
            .observe(f64::from(self.attempt));
        m.store_round_trips_per_write
            .observe(f64::from(self.round_trips));
        if self.cx.projection.uses_database() {
            m.projection_db_round_trips_per_write
                .observe(f64::from(self.db_round_trips));
        }
    }

    /// Decides every unanswered member on this attempt's state and applies the verdicts.
    /// Returns the members to write, or `None` when a rule said no on a state not known to
    /// be current and it could not be made sure of (try again with a catch-up).
    async fn decide(&mut self, state: StateFrom) -> Option<Vec<usize>> {
        let open: Vec<usize> = self.unanswered().collect();
        let candidates = self.candidates(&open);
        let standings = self.standings();
        let mode = self.cx.config.accounts;
        let members = match self.linkage {
            Linkage::Independent => Members::Independent,
            Linkage::Linked => Members::Together,
        };
        let decide_on =
            |freshness| decide::decide(&standings, &candidates, freshness, mode, members);
        let verdicts = match decide_on(Freshness::MaybeBehind) {
            Ok(verdicts) => verdicts,
            Err(NeedsCurrentState) => {
                // Only a catch-up that reached the store's tip is current: not the local
                // fold, and not a read a lagging replica left behind (it may hide this very
                // request, landed by an earlier attempt).
                if state == StateFrom::Copy {
                    self.copies.behind();
                    return None;
                }
                if !self.reached_tip().await {
                    return None;
                }
                decide_on(Freshness::AtTip).ok()?
            }
        };
        Some(self.apply_verdicts(open, verdicts))
    }

    /// What [`decide::decide`] needs of each of the `open` members.
    fn candidates(&self, open: &[usize]) -> Vec<Candidate> {
        open.iter()
            .map(|&mi| {
                let m = &self.members[mi];
                Candidate {
                    legs: m.legs,
                    accounts: m.accounts,
                    landing: if matches!(m.phase, Phase::Proven { .. }) {
                        Landing::Proven
                    } else if m.earlier.may_have_landed() {
                        Landing::Possible
                    } else {
                        Landing::Impossible
                    },
                    hold: m.legs.as_slice()[0]
                        .event
                        .resolves()
                        .map(|id| self.hold_status(m.accounts[0], id)),
                }
            })
            .collect()
    }

    /// What this attempt's state of account `ai` shows of hold `id`. The view is the
    /// account's fold, read now: it may have moved past the snapshot, but only forward, and
    /// a write decided on an older snapshot bounces off the version guard.
    fn hold_status(&self, ai: usize, id: HoldId) -> HoldStatus {
        self.accounts[ai]
            .view
            .as_ref()
            .map_or(HoldStatus::Unknown, |view| {
                self.cx.projection.hold_status(view, id)
            })
    }

    /// Each account's standing in this attempt's state.
    fn standings(&self) -> Vec<Standing> {
        self.accounts
            .iter()
            .map(|t| Standing {
                balance: t.snap.balance,
                exists: t.snap.version > 0,
                held: t.snap.held,
                open_holds: t.snap.open_holds,
            })
            .collect()
    }

    /// Applies each `open` member's verdict; returns the members to write.
    fn apply_verdicts(&mut self, open: Vec<usize>, verdicts: Vec<Verdict>) -> Vec<usize> {
        let mut batch = Vec::with_capacity(open.len());
        for (mi, verdict) in open.into_iter().zip(verdicts) {
            let m = &mut self.members[mi];
            match verdict {
                Verdict::Write { balances } => {
                    m.balances = balances;
                    batch.push(mi);
                }
                Verdict::AlreadyLanded | Verdict::Deferred => {}
                Verdict::Unverifiable => {
                    m.phase = Phase::Done(Err(WriteError::Unverifiable {
                        reason: "an earlier attempt's outcome is unknown".into(),
                    }));
                }
                Verdict::Refused(e) => {
                    m.phase = Phase::Done(Err(WriteError::Rule(e)));
                    self.arm(Arm::Rejected);
                }
            }
        }
        batch
    }

    /// Keeps the recent-writes index within its cap: a member never sent before (no held
    /// sequence, no attempt that may have landed) is refused retryably while the index is
    /// full. This runs after the read-back, so a retry of a landed write is still replayed,
    /// and a member that may have landed goes on: it must be settled, not dropped.
    fn admit_new(&mut self, batch: Vec<usize>) -> Vec<usize> {
        let is_new = |m: &Member| m.hold == SeqHold::Free && !m.earlier.may_have_landed();
        if !batch.iter().any(|&mi| is_new(&self.members[mi])) {
            return batch;
        }
        let Err(full) = self.cx.projection.check_index_room() else {
            return batch;
        };
        let mut kept = Vec::with_capacity(batch.len());
        for mi in batch {
            let m = &mut self.members[mi];
            if is_new(m) {
                m.phase = Phase::Done(Err(WriteError::Overloaded {
                    reason: full.to_string(),
                }));
            } else {
                kept.push(mi);
            }
        }
        kept
    }

    /// A linked group goes out whole or not at all. A member answered on this attempt's
    /// state answers the others: a final refusal as `LinkedItemFailed`, a retryable answer
    /// as itself. A member that already landed (found by the read-back: the group's write
    /// landed) leaves the others unverifiable, their own keys no longer answering. A member
    /// held back for now holds the whole group back.
    fn hold_together(&mut self, batch: Vec<usize>) -> Vec<usize> {
        if self.linkage == Linkage::Independent {
            return batch;
        }
        let open = self.unanswered().count();
        let answered = self.members.iter().find_map(|m| match &m.phase {
            Phase::Done(answer) => Some(answer.clone()),
            _ => None,
        });
        let rest = match answered {
            None if batch.len() == open => return batch,
            None => return Vec::new(),
            Some(Err(e)) if e.is_retryable() => e,
            Some(Err(_)) => WriteError::LinkedItemFailed,
            Some(Ok(_)) => WriteError::Unverifiable {
                reason:
                    "its linked group's write landed, but this item's own key no longer answers"
                        .into(),
            },
        };
        self.answer_unanswered(rest);
        Vec::new()
    }

    /// A one-word summary of the run for the request span.
    fn outcome_label(&self) -> &'static str {
        let ok = self
            .members
            .iter()
            .filter(|m| matches!(m.phase, Phase::Done(Ok(_))))
            .count();
        match (ok, self.members.len() - ok) {
            (_, 0) => "ok",
            (0, _) => "failed",
            _ => "partial",
        }
    }

    /// Every member's answer, in order. `drive` answers every member before it returns.
    pub(super) fn finish(self) -> Vec<Answer> {
        self.members
            .into_iter()
            .map(|m| match m.phase {
                Phase::Done(answer) => answer,
                Phase::Open | Phase::Proven { .. } => {
                    Err(invariant("the run ended with a request unanswered"))
                }
            })
            .collect()
    }
}
