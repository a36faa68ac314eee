//! The write side's entry point, one per replica: [`WriteService::execute`] runs a request
//! to a proven outcome or a typed error. A request goes down this file, top to bottom:
//! `execute` → coalescing → its account's lane → the run.
//!
//! Three things happen before the loop itself ([`super::run`]):
//! - **admission**: a request holds one of [`WriteConfig::max_live_writes`] permits for as
//!   long as it lives on the write side (the HTTP layer runs it on a detached task, so this,
//!   not the HTTP limit, bounds what really runs); none left is a 503 at once;
//! - **coalescing** ([`super::coalesce`]): a duplicate of a key already being written on this
//!   replica, on the same account, waits for the first and shares its answer, marked
//!   replayed;
//! - **batching** ([`super::lanes`]): a single-account request queues in its account's lane (at most
//!   [`WriteConfig::max_queued_per_account`] deep: beyond it a request waits for a place,
//!   never past its deadline); whoever holds the lane's gate writes everything queued, in
//!   arrival order, as one batch. A request whose deadline (counted from its arrival) passed
//!   while it queued is answered without being sent.

use std::sync::Arc;
use tokio::time::Instant;

use tokio::sync::Semaphore;

use super::coalesce::{AnsweringAttempt, Coalescer, Followed, Role};
use super::error::{WriteError, invariant};
use super::lanes::{Lanes, NoPlace, QueuedWrite, Turn};
use super::run::{Run, RunContext};
use super::{Answer, LegResult, WriteConfig, WriteOutcome, WriteRequest};
use crate::account::AccountId;
use crate::metrics::{Metrics, refused};
use crate::projection::Projection;
use crate::store::SharedLog;
use crate::store::health::StoreHealth;

/// Counts a request on the live-writes gauge for as long as it lives on the write side.
struct LiveGauge<'a>(&'a prometheus::IntGauge);

impl<'a> LiveGauge<'a> {
    fn enter(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for LiveGauge<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The write side of Tally: one instance per replica.
pub struct WriteService {
    projection: Arc<Projection>,
    /// The store the runs write through: the projection's, or a combining layer over it
    /// ([`WriteService::with_log`]). Catch-ups, start-up and checkpoints use the projection's.
    log: SharedLog,
    config: WriteConfig,
    pub(super) coalescer: Coalescer,
    lanes: Lanes,
    /// One permit per live request; see [`WriteConfig::max_live_writes`].
    live: Semaphore,
    /// The share of `live` batch items may hold together: half, so single requests always
    /// have the other half ([`WriteService::execute_batch_item`]).
    batch_share: Semaphore,
    /// Whether the store answers, as the replica's store calls find it.
    health: Arc<StoreHealth>,
}

impl WriteService {
    pub fn new(projection: Arc<Projection>, config: WriteConfig) -> Self {
        Self {
            log: projection.log().clone(),
            projection,
            config,
            coalescer: Coalescer::default(),
            lanes: Lanes::new(config.max_queued_per_account),
            live: Semaphore::new(config.max_live_writes.max(1)),
            batch_share: Semaphore::new((config.max_live_writes / 2).max(1)),
            health: Arc::default(),
        }
    }

    /// Reads the store's reach from `health` (the one its store calls feed: `MeteredLog`).
    pub fn with_health(mut self, health: Arc<StoreHealth>) -> Self {
        self.health = health;
        self
    }

    /// Runs write through `log` (it must front the projection's store: group commit).
    pub fn with_log(mut self, log: SharedLog) -> Self {
        self.log = log;
        self
    }

    pub fn projection(&self) -> &Arc<Projection> {
        &self.projection
    }

    /// Whether more than half of the live-write permits are in use: background writes (the
    /// hold sweeper) wait.
    pub(super) fn busy(&self) -> bool {
        self.live.available_permits() < self.config.max_live_writes.max(1) / 2
    }

    pub(super) fn metrics(&self) -> &Metrics {
        self.projection.metrics()
    }

    /// Runs one request to a proven outcome or a typed error. Concurrent duplicates of the
    /// same event id on the same account on this replica wait for the first and share its
    /// answer.
    pub async fn execute(&self, req: WriteRequest) -> Answer {
        self.execute_tracked(req, &AnsweringAttempt::default())
            .await
    }

    /// [`Self::execute`], noting in `attempt`, as it goes, when the attempt its answer will
    /// come from arrived (readable while it runs: an answer cut off by the caller's own
    /// deadline still knows it).
    pub async fn execute_tracked(&self, req: WriteRequest, attempt: &AnsweringAttempt) -> Answer {
        let arrived = Instant::now();
        attempt.note(arrived);
        // Held until this request leaves the write side, however its future ends.
        let Ok(_permit) = self.live.try_acquire() else {
            // A retry of a write that landed costs no store call: answer it from memory
            // rather than refuse it, so a full replica still gives retries their answer.
            if let Some(answer) = self.replay_from_memory(&req) {
                return answer;
            }
            // The refusal speaks for a duplicate already running here too, if there is one.
            if let Some(running) = self.coalescer.running_since(&req) {
                attempt.note(running);
            }
            return Err(self.refuse(refused::LIVE_WRITES, "too many writes in flight"));
        };
        let _live = LiveGauge::enter(&self.metrics().write_live);
        self.execute_admitted(req, arrived, attempt).await
    }

    /// A batch's item: as [`Self::execute_tracked`], once the item holds a place in the batch
    /// share (half the live-write permits, over all batches). An item waits for that place
    /// instead of being refused, since its batch was admitted whole, but no longer than
    /// `wait`: then it is refused, with nothing sent. So batch items never hold more than
    /// half the permits, and single requests are never starved by batches.
    pub async fn execute_batch_item(
        &self,
        req: WriteRequest,
        attempt: &AnsweringAttempt,
        wait: std::time::Duration,
    ) -> Answer {
        let Ok(Ok(_place)) = tokio::time::timeout(wait, self.batch_share.acquire()).await else {
            return Err(self.refuse(
                refused::LIVE_WRITES,
                "too many batch items in flight on this replica; resend the item",
            ));
        };
        self.execute_tracked(req, attempt).await
    }

    /// A linked group of a batch: one run whose members land in one store write, or none
    /// does ([`Run::linked`]). Each member holds a place in the batch share and a live-write
    /// permit, as a batch item does, waiting up to `wait` for the share. Its members are not
    /// coalesced with duplicates running here: the store's guards keep a key from landing
    /// twice, and the loser's read-back answers it.
    pub async fn execute_linked(
        &self,
        reqs: Vec<WriteRequest>,
        wait: std::time::Duration,
    ) -> Vec<Answer> {
        let n = u32::try_from(reqs.len()).unwrap_or(u32::MAX);
        let refused = |why: &str| {
            let err = self.refuse(refused::LIVE_WRITES, why);
            reqs.iter().map(|_| Err(err.clone())).collect()
        };
        let Ok(Ok(_places)) = tokio::time::timeout(wait, self.batch_share.acquire_many(n)).await
        else {
            return refused("too many batch items in flight on this replica; resend the group");
        };
        let Ok(_permits) = self.live.try_acquire_many(n) else {
            return refused("too many writes in flight; resend the group");
        };
        let _live = LiveGauge::enter(&self.metrics().write_live);
        let started = Instant::now();
        let n = reqs.len();
        let mut run = Run::linked(self.run_context(), reqs);
        run.drive(started + self.config.deadline).await;
        let answers = run.finish();
        debug_assert_eq!(answers.len(), n, "one answer per request");
        answers
    }

    /// What a run needs of this replica.
    fn run_context(&self) -> RunContext<'_> {
        RunContext {
            projection: &self.projection,
            log: &self.log,
            identity: *self.projection.identity(),
            metrics: self.metrics(),
            health: &self.health,
            config: self.config,
        }
    }

    /// Coalescing: runs the request as the first of its key on this replica, or waits for
    /// the first already running and shares its answer.
    async fn execute_admitted(
        &self,
        req: WriteRequest,
        arrived: Instant,
        attempt: &AnsweringAttempt,
    ) -> Answer {
        // Each round waits for a first request to end, so the rounds are as many as the
        // requests racing under this key at most; a loop, not a recursion, so no number of
        // them can grow the stack.
        loop {
            match self.coalescer.join(&req, arrived) {
                Role::First(first) => {
                    let answer = self.execute_uncoalesced(req, arrived).await;
                    first.share(&answer);
                    return answer;
                }
                Role::Duplicate(running) => {
                    // Before waiting: the first may run on past any deadline of ours.
                    attempt.note(running.arrived);
                    match running.follow(&req, self.metrics()).await {
                        Followed::Shared(answer) => return answer,
                        Followed::OnItsOwn => self.coalescer.forget(&req, &running),
                    }
                }
            }
        }
    }

    /// A single-account request goes through its account's lane when batching is on; any
    /// other request runs alone.
    async fn execute_uncoalesced(&self, req: WriteRequest, arrived: Instant) -> Answer {
        match req.op.lane_account() {
            Some(account) if self.config.batching => {
                self.submit_batched(account, req, arrived).await
            }
            _ => match self.run(vec![req], arrived).await.pop() {
                Some(answer) => answer,
                None => Err(invariant("a run of one request gave no answer")),
            },
        }
    }

    /// Queues a single-account request in its account's lane on this replica. Whoever holds
    /// the lane's gate writes everything queued, in arrival order, as one batch.
    async fn submit_batched(
        &self,
        account: AccountId,
        req: WriteRequest,
        arrived: Instant,
    ) -> Answer {
        let lane = self.lanes.enter(account);
        let deadline = arrived + self.config.deadline;
        let mut queued = match lane.join(req, arrived, deadline).await {
            Ok(queued) => queued,
            Err(NoPlace::RoomClosed) => {
                return Err(invariant("a lane's room semaphore was closed"));
            }
            Err(NoPlace::DeadlinePassed) => {
                return Err(self.refuse(
                    refused::ACCOUNT_QUEUE,
                    "the write waited its whole deadline for room in the account's queue",
                ));
            }
        };
        loop {
            let _gate = match lane.turn(&mut queued).await {
                Turn::Answered(answer) => return answer,
                Turn::Write(gate) => gate,
            };
            let taken = lane.take_batch(self.config.max_batch_events, self.config.deadline);
            for expired in taken.expired {
                let err = self.refuse(
                    refused::QUEUED_PAST_DEADLINE,
                    "the write waited its whole deadline in the account's queue",
                );
                let _ = expired.reply.send(Err(err));
            }
            if taken.batch.is_empty() {
                // Our request was taken by a writer that has not answered yet: its answer
                // comes to us (or the writer's task ended before sending anything of ours).
                return queued.answer().await;
            }
            self.write_batch(taken.batch, arrived).await;
        }
    }

    /// Runs a batch taken out of a lane, within the deadline of its earliest arrival, and
    /// answers each request of it.
    async fn write_batch(&self, batch: Vec<QueuedWrite>, arrived: Instant) {
        let started = batch.iter().map(|q| q.arrived).min().unwrap_or(arrived);
        let (reqs, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|q| (q.req, q.reply)).unzip();
        let answers = self.run(reqs, started).await;
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
    }

    /// The loop itself, over one or more requests written together (one request, or several
    /// single-account requests on one account), within the deadline counted from `started`
    /// (the earliest arrival among them). Returns one answer per request, in order.
    async fn run(&self, reqs: Vec<WriteRequest>, started: Instant) -> Vec<Answer> {
        let n = reqs.len();
        let mut run = Run::new(self.run_context(), reqs);
        run.drive(started + self.config.deadline).await;
        let answers = run.finish();
        debug_assert_eq!(answers.len(), n, "one answer per request");
        answers
    }

    /// The answer the recent-writes index already holds for this request, looked up in
    /// memory only: a replay when every leg's entry is this request's event, a reused key
    /// when any leg's entry is another event. `None` otherwise (not warm here, no entry on
    /// some leg): only the write loop can decide such a request. An entry is only ever made
    /// for an event the store holds, so a hit proves the landing, as it does in the loop's
    /// own read-back.
    fn replay_from_memory(&self, req: &WriteRequest) -> Option<Answer> {
        let projection = &self.projection;
        let legs = req.op.legs();
        let mut results = Vec::with_capacity(2);
        let mut reused = false;
        for leg in legs.as_slice() {
            let hit = projection.warm_lookup(leg.account, req.event_id);
            match hit {
                Some(h) if h.event == leg.event => results.push(LegResult {
                    account: leg.account,
                    balance: h.balance,
                    version: h.version,
                }),
                Some(_) => reused = true,
                None => {}
            }
        }
        if reused {
            self.metrics().idem_key_reuse.inc();
            return Some(Err(WriteError::KeyReused));
        }
        if results.len() != legs.as_slice().len() {
            return None;
        }
        self.metrics().idem_replays.inc();
        Some(Ok(WriteOutcome {
            legs: results,
            replayed: true,
        }))
    }

    fn refuse(&self, reason: &'static str, message: &str) -> WriteError {
        self.metrics()
            .write_refused
            .with_label_values(&[reason])
            .inc();
        WriteError::Overloaded {
            reason: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::watch;

    use super::super::coalesce::Leader;
    use super::*;
    use crate::account::Operation;
    use crate::account::{AmountCents, Identity};
    use crate::projection::{ManualClock, ProjectionConfig};
    use crate::store::memory::MemoryLog;

    fn service() -> WriteService {
        let projection = Arc::new(Projection::new(
            Arc::new(MemoryLog::new()),
            Identity::default(),
            ProjectionConfig::default(),
            Arc::new(ManualClock::new(0)),
            Arc::new(Metrics::new()),
        ));
        WriteService::new(projection, WriteConfig::default())
    }

    fn amount(cents: i64) -> AmountCents {
        AmountCents::new(cents).expect("a positive amount")
    }

    /// Rule: a retry of a write that landed gets its original answer even when no write may
    /// start (every live-write permit is taken), because the index answers it from memory;
    /// a new write is still refused, and the key under another payload is a reused key.
    #[tokio::test]
    async fn a_retry_of_a_landed_write_is_answered_when_no_write_may_start() {
        let svc = service();
        let account = AccountId(uuid::Uuid::from_u128(7));
        let deposit = |cents| Operation::Deposit {
            account,
            amount: amount(cents),
        };
        let first = svc
            .execute(WriteRequest {
                op: deposit(30),
                event_id: 5,
            })
            .await
            .expect("the first write lands");
        let all = u32::try_from(svc.live.available_permits()).expect("a small count");
        let _taken = svc.live.try_acquire_many(all).expect("every permit");

        let retry = svc
            .execute(WriteRequest {
                op: deposit(30),
                event_id: 5,
            })
            .await
            .expect("the retry is answered from the index");
        assert!(retry.replayed);
        assert_eq!(retry.legs, first.legs);

        let other = svc
            .execute(WriteRequest {
                op: deposit(31),
                event_id: 5,
            })
            .await;
        assert_eq!(other, Err(WriteError::KeyReused));

        let fresh = svc
            .execute(WriteRequest {
                op: deposit(30),
                event_id: 6,
            })
            .await;
        assert!(
            matches!(fresh, Err(WriteError::Overloaded { .. })),
            "a new write still waits for room: {fresh:?}"
        );
    }

    /// Rule: a first request that was refused, answered, and is still listed for a moment
    /// (its entry leaves after it answers) is not followed again: the request waiting on it
    /// is decided on its own: following it again would loop on the same answer without end
    /// (a race of refused withdrawals under one key).
    #[tokio::test]
    async fn a_refused_first_still_listed_is_not_followed_again() {
        let svc = service();
        let account = AccountId(uuid::Uuid::from_u128(7));
        let (_first, answered) = watch::channel(Some(Err(WriteError::Overloaded {
            reason: "refused".into(),
        })));
        let first = Operation::Withdraw {
            account,
            amount: amount(500),
        };
        svc.coalescer.leaders.insert(
            (9, account),
            Arc::new(Leader {
                op: first,
                arrived: Instant::now(),
                answer: answered,
            }),
        );
        let deposit = Operation::Deposit {
            account,
            amount: amount(30),
        };
        let answer = svc
            .execute(WriteRequest {
                op: deposit,
                event_id: 9,
            })
            .await
            .expect("decided on its own, and landed");
        assert_eq!(answer.legs[0].balance, 30);
        assert!(!answer.replayed);
        assert!(
            svc.coalescer.leaders.is_empty(),
            "the stale entry was taken out"
        );
    }

    /// A first request under `event_id` running on `svc` now, unanswered: where its answer
    /// goes, and when it arrived.
    fn running_first(
        svc: &WriteService,
        event_id: u128,
        op: Operation,
    ) -> (watch::Sender<Option<Answer>>, Instant) {
        let (answer, running) = watch::channel(None);
        let arrived = Instant::now();
        let first = Leader {
            op,
            arrived,
            answer: running,
        };
        let account = op.legs().as_slice()[0].account;
        svc.coalescer
            .leaders
            .insert((event_id, account), Arc::new(first));
        (answer, arrived)
    }

    /// Rule: a duplicate that waits on an attempt already running notes that attempt's
    /// arrival, not its own, as soon as it starts waiting (its caller may have to answer
    /// before the first does): what the first wrote may have landed from then on, and an
    /// answer that leaves the outcome open counts its window from there.
    #[tokio::test(start_paused = true)]
    async fn a_coalesced_duplicate_notes_when_the_attempt_it_waits_on_arrived() {
        let svc = Arc::new(service());
        let account = AccountId(uuid::Uuid::from_u128(8));
        let op = Operation::Deposit {
            account,
            amount: amount(30),
        };
        let (answer, first_arrived) = running_first(&svc, 11, op);
        tokio::time::advance(Duration::from_secs(3)).await;
        let attempt = Arc::new(AnsweringAttempt::default());
        let follower = tokio::spawn({
            let (svc, attempt) = (svc.clone(), attempt.clone());
            async move {
                svc.execute_tracked(WriteRequest { op, event_id: 11 }, &attempt)
                    .await
            }
        });
        tokio::task::yield_now().await;
        // Still waiting, with nothing answered: already the first's arrival, 3 s earlier.
        assert_eq!(attempt.arrived(), Some(first_arrived));
        answer
            .send(Some(Err(WriteError::Unverifiable {
                reason: "no answer".into(),
            })))
            .expect("the duplicate is waiting");
        let shared = follower.await.expect("the duplicate's task");
        assert!(
            matches!(shared, Err(WriteError::Unverifiable { .. })),
            "{shared:?}"
        );
        assert_eq!(attempt.arrived(), Some(first_arrived));
        // On its own, a request notes its own arrival.
        let own_arrival = Instant::now();
        let own = AnsweringAttempt::default();
        let other = Operation::Deposit {
            account,
            amount: amount(5),
        };
        let landed = svc
            .execute_tracked(
                WriteRequest {
                    op: other,
                    event_id: 12,
                },
                &own,
            )
            .await;
        assert!(landed.is_ok(), "{landed:?}");
        assert_eq!(own.arrived(), Some(own_arrival));
    }

    /// Rule: a request refused at the live-writes limit while a duplicate of it runs on this
    /// replica speaks for that duplicate too: its answer's window counts from the running
    /// one's arrival, not from its own.
    #[tokio::test(start_paused = true)]
    async fn a_refused_duplicate_notes_the_running_attempts_arrival() {
        let svc = service();
        let account = AccountId(uuid::Uuid::from_u128(9));
        let op = Operation::Deposit {
            account,
            amount: amount(30),
        };
        let (_answer, first_arrived) = running_first(&svc, 13, op);
        tokio::time::advance(Duration::from_secs(2)).await;
        let _full = svc
            .live
            .try_acquire_many(svc.live.available_permits() as u32)
            .expect("every live-write permit");
        let attempt = AnsweringAttempt::default();
        let refused = svc
            .execute_tracked(WriteRequest { op, event_id: 13 }, &attempt)
            .await;
        assert!(
            matches!(refused, Err(WriteError::Overloaded { .. })),
            "{refused:?}"
        );
        assert_eq!(attempt.arrived(), Some(first_arrived));
    }

    /// Rule: batch items together hold at most half the live-write permits. An item waits
    /// for its share and is refused, with nothing sent, only past its wait; a single request
    /// meanwhile still lands on the other half.
    #[tokio::test(start_paused = true)]
    async fn batch_items_hold_at_most_half_the_permits_and_singles_keep_the_rest() {
        let svc = service();
        let total = svc.live.available_permits();
        assert_eq!(svc.batch_share.available_permits(), total / 2);
        let _batches = svc
            .batch_share
            .try_acquire_many(svc.batch_share.available_permits() as u32)
            .expect("the whole batch share");
        let account = AccountId(uuid::Uuid::from_u128(21));
        let op = Operation::Deposit {
            account,
            amount: amount(5),
        };
        let attempt = AnsweringAttempt::default();
        let item = svc.execute_batch_item(
            WriteRequest { op, event_id: 21 },
            &attempt,
            Duration::from_millis(50),
        );
        let refused = item.await;
        assert!(
            matches!(refused, Err(WriteError::Overloaded { .. })),
            "{refused:?}"
        );
        let single = svc.execute(WriteRequest { op, event_id: 22 }).await;
        assert!(single.is_ok(), "{single:?}");
        let snap = svc.projection.current(account, &[]).await;
        let version = snap.ok().flatten().map(|l| l.snap.version);
        assert_eq!(version, Some(1), "only the single request wrote");
    }
}
