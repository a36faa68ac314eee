//! The one write loop, shared by every operation (deposit, withdraw, transfer, and batches of
//! single-account operations on a hot account).
//!
//! Each attempt: get fresh state (catch up; on the first attempt of a warm account, the
//! local fold, trusting the version guard to bounce a stale decision), answer from the
//! recent-writes index if the request already landed, decide on that state, then append
//! with `expected_version` + `client_seq` + `event_id`, and classify the outcome:
//!
//! | outcome | what it means | next |
//! |---|---|---|
//! | success | landed | index it, bump the cursor, answer |
//! | `Conflict` (2003) | rejected; the world changed | catch up, re-decide, fresh sequence |
//! | `OutcomeUnknown` | may have landed | hold the sequence; catch up (refreshing the version and checking the index) before writing again |
//! | `InflightDuplicate` (2013) | an earlier attempt is not yet durable | hold, back off, retry |
//! | `IdempotencyViolation` (2002) | someone landed this sequence | point-read it: ours = landed; a sibling's = re-derive; nothing visible = refuse to guess |
//! | `NotApplied` | definitely not applied | retry as is after backoff |
//!
//! A sequence is re-derived only on fresh state, after a catch-up that checked the index:
//! never straight after an ambiguous failure. A business-rule rejection is final only on state
//! that reached the store's tip: a local fold or a lagging read may hide an earlier landing of
//! the very request being rejected.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use tokio::sync::{oneshot, watch};

use crate::account::rules::{Leg, Legs, decide_leg};
use crate::account::{AccountId, Operation, RuleError};
use crate::metrics::{Metrics, arm};
use crate::projection::{
    AccountSlot, Projection, ProjectionError, RecentWrite, RecordedWrite, Snapshot,
};
use crate::store::{AggregateWrite, Event, StoreError};
use crate::verify::{self, SeqOwnership};

/// Store writes one request may make before it gives up with a retryable error.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 12;
/// How long one request may spend in the loop before it gives up with a retryable error.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);
/// First backoff between attempts; doubles per attempt up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_millis(2);
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// The most single-account operations written together as one batch.
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct WriteConfig {
    pub max_attempts: u32,
    pub deadline: Duration,
    /// First attempt on a warm account writes at the local cursor without a catch-up read.
    pub one_round_trip: bool,
    /// Single-account operations on one account queue behind one writer and go together.
    pub batching: bool,
    pub max_batch_events: usize,
}

impl Default for WriteConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            deadline: DEFAULT_DEADLINE,
            one_round_trip: true,
            batching: true,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
        }
    }
}

/// One caller intent: an operation and the request's event id (its idempotency key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRequest {
    pub op: Operation,
    pub event_id: u128,
}

/// One account's part of a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LegResult {
    pub account: AccountId,
    pub balance: i64,
    pub version: u64,
}

/// A write that is proven to have landed, with the response it produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteOutcome {
    /// In the operation's leg order (a transfer: payer, then payee).
    pub legs: Vec<LegResult>,
    /// Answered from an earlier request's result, not from this request's own write.
    pub replayed: bool,
}

/// Why a write did not produce an outcome.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Rule(#[from] RuleError),
    #[error("this idempotency key was used for a different operation or payload")]
    KeyReused,
    /// Could not prove whether an earlier attempt landed. Retryable.
    #[error("the write's outcome could not be verified ({reason}); retry the request")]
    Unverifiable { reason: String },
    /// Attempts or deadline exhausted. Retryable.
    #[error("the write did not complete after {attempts} attempts ({last}); retry the request")]
    GaveUp { attempts: u32, last: String },
    #[error(transparent)]
    Account(#[from] ProjectionError),
    #[error(
        "the accounts of this transfer are on different store shards; route every account to one shard"
    )]
    CrossShard,
    #[error("store error: {0}")]
    Store(StoreError),
}

type Answer = Result<WriteOutcome, WriteError>;

/// A single-account operation waiting for its account's writer.
pub(crate) struct Queued {
    req: WriteRequest,
    reply: oneshot::Sender<Answer>,
}

/// A request being written on this replica; duplicates wait for its answer.
struct InFlight {
    op: Operation,
    answer: watch::Receiver<Option<Answer>>,
}

struct InFlightGuard<'a> {
    map: &'a DashMap<u128, Arc<InFlight>, foldhash::fast::RandomState>,
    event_id: u128,
    entry: Arc<InFlight>,
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.map
            .remove_if(&self.event_id, |_, e| Arc::ptr_eq(e, &self.entry));
    }
}

/// The write side of Tally: one instance per replica.
pub struct WriteService {
    projection: Arc<Projection>,
    config: WriteConfig,
    in_flight: DashMap<u128, Arc<InFlight>, foldhash::fast::RandomState>,
}

impl WriteService {
    pub fn new(projection: Arc<Projection>, config: WriteConfig) -> Self {
        Self {
            projection,
            config,
            in_flight: DashMap::default(),
        }
    }

    pub fn projection(&self) -> &Arc<Projection> {
        &self.projection
    }

    fn metrics(&self) -> &Metrics {
        self.projection.metrics()
    }

    /// Runs one request to a proven outcome or a typed error. Concurrent duplicates of the
    /// same event id on this replica wait for the first and share its answer.
    pub async fn execute(&self, req: WriteRequest) -> Answer {
        let (tx, leader_rx) = watch::channel(None);
        let entry = self
            .in_flight
            .entry(req.event_id)
            .or_insert_with(|| {
                Arc::new(InFlight {
                    op: req.op,
                    answer: leader_rx,
                })
            })
            .clone();
        if !entry.answer.same_channel(&tx.subscribe()) {
            return self.follow(&entry, req).await;
        }
        // Removes the entry however this future ends, so followers never wait on a leader
        // that is gone.
        let _guard = InFlightGuard {
            map: &self.in_flight,
            event_id: req.event_id,
            entry,
        };
        let answer = self.execute_uncoalesced(req).await;
        let _ = tx.send(Some(answer.clone()));
        answer
    }

    async fn follow(&self, leader: &InFlight, req: WriteRequest) -> Answer {
        self.metrics().idem_coalesced.inc();
        let mut rx = leader.answer.clone();
        let answer = match rx.wait_for(Option::is_some).await {
            Ok(answer) => answer.clone(),
            // The first request's task ended without an answer: run this one ourselves.
            Err(_) => None,
        };
        match answer {
            Some(_) if leader.op != req.op => {
                self.metrics().idem_key_reuse.inc();
                Err(WriteError::KeyReused)
            }
            Some(Ok(mut outcome)) => {
                outcome.replayed = true;
                Ok(outcome)
            }
            Some(Err(e)) => Err(e),
            None => Box::pin(self.execute(req)).await,
        }
    }

    async fn execute_uncoalesced(&self, req: WriteRequest) -> Answer {
        match req.op {
            Operation::Deposit { account, .. } | Operation::Withdraw { account, .. }
                if self.config.batching =>
            {
                self.submit_batched(account, req).await
            }
            _ => self.run(vec![req]).await.pop().unwrap_or_else(|| {
                Err(WriteError::GaveUp {
                    attempts: 0,
                    last: "no answer".into(),
                })
            }),
        }
    }

    /// Queues a single-account request behind its account's writer on this replica. Whoever
    /// holds the account's gate writes everything queued, in arrival order, as one batch.
    async fn submit_batched(&self, account: AccountId, req: WriteRequest) -> Answer {
        let slot = self.projection.slot(account);
        let (reply, mut rx) = oneshot::channel();
        slot.queue.lock().push(Queued { req, reply });
        let _gate = slot.gate.lock().await;
        loop {
            if let Ok(answer) = rx.try_recv() {
                return answer;
            }
            let batch: Vec<Queued> = {
                let mut q = slot.queue.lock();
                let n = q.len().min(self.config.max_batch_events.max(1));
                q.drain(..n).collect()
            };
            if batch.is_empty() {
                // Our request was answered by a writer that already released the gate.
                return rx.await.unwrap_or_else(|_| {
                    Err(WriteError::GaveUp {
                        attempts: 0,
                        last: "writer ended without an answer".into(),
                    })
                });
            }
            let (reqs, replies): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|q| (q.req, q.reply)).unzip();
            let answers = self.run(reqs).await;
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
    }

    /// The loop itself, over one or more requests written together (one request, or several
    /// single-account requests on one account). Returns one answer per request, in order.
    async fn run(&self, reqs: Vec<WriteRequest>) -> Vec<Answer> {
        let mut run = Run::new(self, reqs);
        run.drive().await;
        run.finish()
    }

    async fn backoff(&self, attempt: u32, salt: u128) {
        let exp = BASE_BACKOFF.saturating_mul(1u32 << attempt.saturating_sub(2).min(16));
        let cap = exp.min(MAX_BACKOFF);
        // Deterministic jitter in [cap/2, cap): spreads siblings apart without a global RNG.
        let mix = (salt as u64 ^ (salt >> 64) as u64 ^ u64::from(attempt))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let half = cap / 2;
        let jitter = Duration::from_nanos(mix % (half.as_nanos() as u64).max(1));
        tokio::time::sleep(half + jitter).await;
    }
}

/// One request inside a run.
struct Pending {
    req: WriteRequest,
    legs: Legs,
    /// Each leg's client sequence, while held.
    seqs: [u64; 2],
    /// `seqs` were assigned and still count (cleared when sequences are re-derived).
    has_seqs: bool,
    /// Each leg's balance after this request, as decided in the current attempt.
    balances: [i64; 2],
    /// An attempt may have landed: a rule failure on later state is not final.
    ambiguous: bool,
    /// A write of this request sent by this run may have been applied (its outcome was
    /// unknown). Only then can a landed write be this run's own; otherwise an answer found in
    /// the index is another request's result, a replay.
    sent_unknown: bool,
    /// This attempt's decision refused it on top of earlier requests of the batch that have
    /// not landed: not final, and not written; it is decided again on the state after them.
    deferred: bool,
    /// The point read found our event here: never write this request again.
    landed_at: [Option<u64>; 2],
    answer: Option<Answer>,
}

/// One account touched by a run, with its state for the current attempt.
struct Touched {
    account: AccountId,
    slot: Option<Arc<AccountSlot>>,
    snap: Snapshot,
}

struct Run<'a> {
    svc: &'a WriteService,
    op_label: &'static str,
    pending: Vec<Pending>,
    accounts: Vec<Touched>,
    attempt: u32,
    /// Sequences are assigned and must be kept (a write carrying them was sent and not
    /// refused by the version guard or proven a sibling's).
    held: bool,
    round_trips: u32,
    last_failure: String,
    /// Each account's tip as the store reported it during this run: any state read later
    /// that reaches it folds everything that landed before this run started.
    tips: Option<Vec<u64>>,
}

impl<'a> Run<'a> {
    fn new(svc: &'a WriteService, reqs: Vec<WriteRequest>) -> Self {
        let op_label = match reqs.as_slice() {
            [one] => one.op.name(),
            _ => "batch",
        };
        let mut accounts: Vec<Touched> = Vec::with_capacity(2);
        let pending = reqs
            .into_iter()
            .map(|req| {
                let legs = req.op.legs();
                for leg in legs.as_slice() {
                    if !accounts.iter().any(|t| t.account == leg.account) {
                        accounts.push(Touched {
                            account: leg.account,
                            slot: None,
                            snap: Snapshot {
                                balance: 0,
                                version: 0,
                                max_client_seq: 0,
                            },
                        });
                    }
                }
                Pending {
                    req,
                    legs,
                    seqs: [0; 2],
                    has_seqs: false,
                    balances: [0; 2],
                    ambiguous: false,
                    sent_unknown: false,
                    deferred: false,
                    landed_at: [None; 2],
                    answer: None,
                }
            })
            .collect();
        Self {
            svc,
            op_label,
            pending,
            accounts,
            attempt: 0,
            held: false,
            round_trips: 0,
            last_failure: String::new(),
            tips: None,
        }
    }

    fn arm(&self, arm: &str) {
        self.svc.metrics().arm(self.op_label, arm);
    }

    fn open(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.pending.len()).filter(|&i| self.pending[i].answer.is_none())
    }

    fn acct_index(&self, account: AccountId) -> usize {
        self.accounts
            .iter()
            .position(|t| t.account == account)
            .unwrap_or(0)
    }

    fn resolve_open(&mut self, err: WriteError) {
        for p in self.pending.iter_mut().filter(|p| p.answer.is_none()) {
            p.answer = Some(Err(err.clone()));
        }
    }

    async fn drive(&mut self) {
        let cfg = self.svc.config;
        let deadline = Instant::now() + cfg.deadline;
        let mut skip_backoff = false;
        while self.open().next().is_some() {
            if self.attempt >= cfg.max_attempts || Instant::now() >= deadline {
                self.arm(arm::GAVE_UP);
                let err = WriteError::GaveUp {
                    attempts: self.attempt,
                    last: std::mem::take(&mut self.last_failure),
                };
                self.resolve_open(err);
                break;
            }
            self.attempt += 1;
            if self.attempt > 1 && !skip_backoff {
                let salt = self.pending[0].req.event_id;
                self.svc.backoff(self.attempt, salt).await;
            }
            skip_backoff = false;

            // 1. State: the local fold on a warm account's first attempt, else a catch-up.
            let fresh = match self
                .load_state(cfg.one_round_trip && self.attempt == 1)
                .await
            {
                Ok(fresh) => fresh,
                Err(None) => continue,
                Err(Some(err)) => {
                    self.resolve_open(err);
                    break;
                }
            };
            // 2. Did it already land? (On a catch-up, this is the read-back.)
            self.answer_from_index().await;
            // 3. Decide on this state. A rule rejection is final only on state known to be
            // current: not the local fold, and not a catch-up that a lagging read left behind
            // the store's tip (it may hide this very request, landed by an earlier attempt).
            if !self.decide(false) {
                if !fresh || !self.reached_tip().await {
                    continue;
                }
                self.decide(true);
            }
            let batch: Vec<usize> = self
                .open()
                .filter(|&i| {
                    let p = &self.pending[i];
                    p.landed_at.iter().all(Option::is_none) && !p.deferred
                })
                .collect();
            if batch.is_empty() {
                continue;
            }
            // 4. Sequences: held ones stay; otherwise derived from the fold just read.
            self.assign_seqs(&batch);
            // 5. Append and classify.
            skip_backoff = self.write(&batch).await;
        }
        let span = tracing::Span::current();
        span.record("attempts", self.attempt);
        span.record("outcome", self.outcome_label());
        let m = self.svc.metrics();
        m.write_attempts
            .with_label_values(&[self.op_label])
            .observe(f64::from(self.attempt));
        m.store_round_trips_per_write
            .observe(f64::from(self.round_trips));
    }

    /// Loads each account's state. `Ok(true)` when it came from a catch-up, `Ok(false)` from
    /// the local fold; `Err(None)` to retry the attempt; `Err(Some(e))` to give up with e.
    async fn load_state(&mut self, try_local: bool) -> Result<bool, Option<WriteError>> {
        let projection = &self.svc.projection;
        let local: Option<Vec<(Arc<AccountSlot>, Snapshot)>> = if try_local {
            self.accounts
                .iter()
                .map(|t| {
                    let slot = projection.resident_slot(t.account)?;
                    let st = slot.state.lock();
                    let usable = st.warm && st.broken.is_none();
                    let snap = st.snapshot();
                    drop(st);
                    usable.then_some((slot, snap))
                })
                .collect()
        } else {
            None
        };
        if let Some(local) = local {
            for (t, (slot, snap)) in self.accounts.iter_mut().zip(local) {
                t.slot = Some(slot);
                t.snap = snap;
            }
            return Ok(false);
        }
        for i in 0..self.accounts.len() {
            self.round_trips += 1;
            match projection.catch_up(self.accounts[i].account).await {
                Ok((slot, snap)) => {
                    self.accounts[i].slot = Some(slot);
                    self.accounts[i].snap = snap;
                }
                Err(ProjectionError::Store(e)) => {
                    self.last_failure = format!("catch-up: {e}");
                    return Err(None);
                }
                Err(e) => return Err(Some(WriteError::Account(e))),
            }
        }
        Ok(true)
    }

    /// Whether the caught-up state reaches each account's tip, so a rule rejection decided on
    /// it is final. Compared with tips the store reported earlier in this run if there are
    /// any; otherwise the tips are asked for now (one round trip per account, on the
    /// rejection path only) and remembered, and a state behind them is read again.
    async fn reached_tip(&mut self) -> bool {
        let reached = |tips: &[u64], accounts: &[Touched]| {
            accounts
                .iter()
                .zip(tips)
                .all(|(t, &tip)| t.snap.version >= tip)
        };
        if let Some(tips) = &self.tips {
            return reached(tips, &self.accounts);
        }
        let projection = &self.svc.projection;
        let mut tips = Vec::with_capacity(self.accounts.len());
        for t in &self.accounts {
            self.round_trips += 1;
            let key = projection.identity().key(t.account);
            match projection.log().details(key).await {
                Ok(d) => tips.push(d.max_version),
                Err(StoreError::AggregateNotFound) => tips.push(0),
                Err(e) => {
                    self.last_failure = format!("tip check: {e}");
                    return false;
                }
            }
        }
        let done = reached(&tips, &self.accounts);
        if !done {
            self.last_failure = "the state read lags behind the store's tip".into();
        }
        self.tips = Some(tips);
        done
    }

    /// Answers every open request that the index (or a proven landing) shows as done. An
    /// index hit on any leg proves the whole request landed (writes are all or nothing); a
    /// leg without a hit is rebuilt from current state, but only once that state is known to
    /// hold the write: its fold is past the proven landing, or at the store's tip (then the
    /// leg's entry has expired). Until then the request is held as landed, never written
    /// again, and answered after a later catch-up. A hit for a different operation is a
    /// reused key.
    async fn answer_from_index(&mut self) {
        let now = self.svc.projection.now_ms();
        let mut replays = 0u64;
        for pi in 0..self.pending.len() {
            if self.pending[pi].answer.is_some() {
                continue;
            }
            let p = &self.pending[pi];
            let replayed = !p.sent_unknown;
            let legs = p.legs;
            let legs = legs.as_slice();
            let hits: Vec<Option<RecentWrite>> = legs
                .iter()
                .map(|leg| {
                    let t = &self.accounts[self.acct_index(leg.account)];
                    t.slot
                        .as_ref()
                        .and_then(|s| s.state.lock().recent.get(p.req.event_id, now))
                })
                .collect();
            let landed_visible = p.landed_at.iter().zip(legs).any(|(v, _)| v.is_some())
                && p.landed_at.iter().zip(legs).all(|(v, leg)| {
                    v.is_none_or(|v| self.accounts[self.acct_index(leg.account)].snap.version >= v)
                });
            if hits.iter().all(Option::is_none) && !landed_visible {
                continue;
            }
            let reused = hits
                .iter()
                .zip(legs)
                .any(|(h, leg)| h.is_some_and(|h| h.event != leg.event));
            if !reused && !self.rebuildable(pi, &hits).await {
                // Landed, but a leg's fold may not have reached it yet (a stale local fold, a
                // lagging read): its current state would not be this write's answer.
                let p = &mut self.pending[pi];
                for (li, hit) in hits.iter().enumerate() {
                    if let Some(h) = hit {
                        p.landed_at[li] = Some(h.version);
                    }
                }
                continue;
            }
            let answer = if reused {
                self.svc.metrics().idem_key_reuse.inc();
                Err(WriteError::KeyReused)
            } else {
                let legs = legs
                    .iter()
                    .zip(&hits)
                    .map(|(leg, hit)| match hit {
                        Some(h) => LegResult {
                            account: leg.account,
                            balance: h.balance,
                            version: h.version,
                        },
                        None => {
                            let snap = self.accounts[self.acct_index(leg.account)].snap;
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
            self.pending[pi].answer = Some(answer);
        }
        if replays > 0 {
            self.svc.metrics().idem_replays.inc_by(replays);
            self.arm(arm::REPLAYED);
        }
    }

    /// Whether every leg of a landed request without an index hit can be rebuilt from the
    /// state just loaded: that state is past the leg's proven landing, or at the store's tip
    /// (so the write is behind the cursor and its entry expired).
    async fn rebuildable(&mut self, pi: usize, hits: &[Option<RecentWrite>]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let legs = self.pending[pi].legs;
        for (li, leg) in legs.as_slice().iter().enumerate() {
            if hits[li].is_some() {
                continue;
            }
            let snap = self.accounts[self.acct_index(leg.account)].snap;
            if self.pending[pi].landed_at[li].is_some_and(|v| snap.version >= v) {
                continue;
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

    /// Decides every open request in order on the loaded state, each on top of the ones
    /// before it. Returns false, answering nothing, when a rule said no and the state is not
    /// known to be `current`: the rule is only final on current state, so the caller makes
    /// sure of it (or retries with a catch-up) first. A refusal is final only on a state the
    /// account really had: one decided on top of earlier requests of this batch is deferred
    /// until they have landed.
    fn decide(&mut self, current: bool) -> bool {
        let mut running: Vec<i64> = self.accounts.iter().map(|t| t.snap.balance).collect();
        let open: Vec<usize> = self.open().collect();
        // `running` includes requests that have not landed (or not visibly).
        let mut speculative = false;
        for &pi in &open {
            self.pending[pi].deferred = false;
        }
        for pi in open {
            let mut next = running.clone();
            let mut broke: Option<RuleError> = None;
            let legs = self.pending[pi].legs;
            for (li, leg) in legs.as_slice().iter().enumerate() {
                let ai = self.acct_index(leg.account);
                match decide_leg(next[ai], &leg.event) {
                    Ok(b) => {
                        next[ai] = b;
                        self.pending[pi].balances[li] = b;
                    }
                    Err(e) => {
                        broke = Some(e);
                        break;
                    }
                }
            }
            let landed = self.pending[pi].landed_at.iter().any(Option::is_some);
            match broke {
                None => {
                    running = next;
                    speculative = true;
                }
                // Proven landed: no rule decides it now; a later fold answers it.
                Some(_) if landed => {}
                Some(_) if !current => return false,
                Some(_) if speculative => self.pending[pi].deferred = true,
                Some(_) if self.pending[pi].ambiguous => {
                    // An earlier attempt may yet land; a rule failure now is not the truth.
                    self.pending[pi].answer = Some(Err(WriteError::Unverifiable {
                        reason: "an earlier attempt's outcome is unknown".into(),
                    }));
                }
                Some(e) => {
                    self.arm(arm::REJECTED);
                    self.pending[pi].answer = Some(Err(WriteError::Rule(e)));
                }
            }
        }
        true
    }

    /// Sequences for this write. While sequences are held, a request that holds one keeps
    /// it; every other request of the batch (one that joins after a deferral) gets a fresh
    /// one above both the fold's highest and every sequence this run holds, so no event is
    /// ever sent without a sequence or with one another request of the run holds. Otherwise
    /// all are fresh: each account's events in write order get consecutive sequences above
    /// the highest this service has written there.
    fn assign_seqs(&mut self, batch: &[usize]) {
        let mut next: Vec<u64> = self
            .accounts
            .iter()
            .map(|t| t.snap.max_client_seq + 1)
            .collect();
        if self.held {
            for p in self.pending.iter().filter(|p| p.has_seqs) {
                for (li, leg) in p.legs.as_slice().iter().enumerate() {
                    let ai = self.acct_index(leg.account);
                    next[ai] = next[ai].max(p.seqs[li] + 1);
                }
            }
        } else {
            for p in &mut self.pending {
                p.has_seqs = false;
            }
        }
        for &pi in batch {
            if self.pending[pi].has_seqs {
                continue;
            }
            let legs = self.pending[pi].legs;
            for (li, leg) in legs.as_slice().iter().enumerate() {
                let ai = self.acct_index(leg.account);
                self.pending[pi].seqs[li] = next[ai];
                next[ai] += 1;
            }
            self.pending[pi].has_seqs = true;
        }
        debug_assert!(
            batch.iter().all(
                |&pi| self.pending[pi].seqs[..self.pending[pi].legs.as_slice().len()]
                    .iter()
                    .all(|&s| s > 0)
            ),
            "every event of a write carries a sequence"
        );
        self.held = true;
    }

    /// Sends one write for `batch` and classifies the outcome. Returns true when the next
    /// attempt should not back off (a proven landing only needs a read-back).
    async fn write(&mut self, batch: &[usize]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let now_ms = wall_clock_ms();
        let writes: Vec<AggregateWrite> = self
            .accounts
            .iter()
            .map(|t| AggregateWrite {
                key: identity.key(t.account),
                events: self
                    .legs_on(batch, t.account)
                    .map(|(_, p, li, leg)| Event {
                        client_seq: p.seqs[li],
                        event_id: Some(p.req.event_id),
                        event_type: leg.event.event_type(),
                        payload: leg.event.encode(),
                        timestamp_ms: now_ms,
                    })
                    .collect(),
                expected_version: Some(t.snap.version),
                allow_create: true,
                enforce_client_idempotency: true,
            })
            .collect();
        let events: usize = writes.iter().map(|w| w.events.len()).sum();
        svc.metrics().write_batch_events.observe(events as f64);
        self.round_trips += 1;
        match svc.projection.log().write(identity.client(), writes).await {
            Ok(versions) => {
                self.record_success(batch, &versions);
                false
            }
            Err(StoreError::Conflict { .. }) => {
                self.arm(arm::CONFLICT);
                self.last_failure = "version conflict".into();
                self.held = false;
                false
            }
            Err(StoreError::OutcomeUnknown { reason }) => {
                self.arm(arm::OUTCOME_UNKNOWN);
                self.last_failure = format!("outcome unknown: {reason}");
                self.mark_ambiguous(batch);
                for &pi in batch {
                    self.pending[pi].sent_unknown = true;
                }
                false
            }
            Err(StoreError::InflightDuplicate) => {
                self.arm(arm::INFLIGHT_DUPLICATE);
                self.last_failure = "an earlier attempt is still in flight".into();
                self.mark_ambiguous(batch);
                false
            }
            Err(StoreError::NotApplied { reason }) => {
                self.arm(arm::NOT_APPLIED);
                self.last_failure = format!("not applied: {reason}");
                false
            }
            Err(StoreError::IdempotencyViolation { .. }) => self.settle_violation(batch).await,
            Err(StoreError::CrossShard) => {
                self.arm(arm::STORE_ERROR);
                self.resolve_open(WriteError::CrossShard);
                false
            }
            Err(e) => {
                self.arm(arm::STORE_ERROR);
                self.resolve_open(WriteError::Store(e));
                false
            }
        }
    }

    /// The legs of `batch` that write to `account`, in write order:
    /// (request index, request, leg index, leg).
    fn legs_on<'b>(
        &'b self,
        batch: &'b [usize],
        account: AccountId,
    ) -> impl Iterator<Item = (usize, &'b Pending, usize, &'b Leg)> + 'b {
        batch.iter().flat_map(move |&pi| {
            let p = &self.pending[pi];
            p.legs
                .as_slice()
                .iter()
                .enumerate()
                .filter(move |(_, leg)| leg.account == account)
                .map(move |(li, leg)| (pi, p, li, leg))
        })
    }

    fn mark_ambiguous(&mut self, batch: &[usize]) {
        for &pi in batch {
            self.pending[pi].ambiguous = true;
        }
    }

    fn record_success(&mut self, batch: &[usize], versions: &[u64]) {
        // The batch's sequences are used; a request still open takes fresh ones.
        self.held = false;
        let projection = &self.svc.projection;
        for (ai, t) in self.accounts.iter().enumerate() {
            let Some(new_version) = versions.get(ai).copied() else {
                continue;
            };
            let mut events = Vec::with_capacity(batch.len());
            let mut max_seq = 0;
            let mut balance_after = t.snap.balance;
            for (_, p, li, leg) in self.legs_on(batch, t.account) {
                events.push((p.req.event_id, p.balances[li], leg.event));
                max_seq = max_seq.max(p.seqs[li]);
                balance_after = p.balances[li];
            }
            if let Some(slot) = &t.slot {
                projection.record_write(
                    slot,
                    &RecordedWrite {
                        expected_version: t.snap.version,
                        new_version,
                        balance_after,
                        max_client_seq: max_seq,
                        events: &events,
                    },
                );
            }
        }
        for &pi in batch {
            let p = &self.pending[pi];
            let legs = p
                .legs
                .as_slice()
                .iter()
                .enumerate()
                .map(|(li, leg)| LegResult {
                    account: leg.account,
                    balance: p.balances[li],
                    version: versions
                        .get(self.acct_index(leg.account))
                        .copied()
                        .unwrap_or(0),
                })
                .collect();
            self.pending[pi].answer = Some(Ok(WriteOutcome {
                legs,
                replayed: false,
            }));
        }
        self.arm(arm::SUCCESS);
    }

    /// 2002: point-read the contested sequences. The batch was one all-or-nothing write, so
    /// one verdict covers it: our id anywhere = it landed; a sibling = it did not (re-derive);
    /// nothing visible = refuse to guess (a retryable error).
    async fn settle_violation(&mut self, batch: &[usize]) -> bool {
        let svc = self.svc;
        let identity = *svc.projection.identity();
        let mut verdicts: Vec<(usize, usize, SeqOwnership)> = Vec::new();
        for t in &self.accounts {
            let seqs: Vec<(usize, usize, u64)> = self
                .legs_on(batch, t.account)
                .map(|(pi, p, li, _)| (pi, li, p.seqs[li]))
                .collect();
            let (Some(first), Some(last)) = (
                seqs.iter().map(|s| s.2).min(),
                seqs.iter().map(|s| s.2).max(),
            ) else {
                continue;
            };
            self.round_trips += 1;
            let owners = match verify::read_seq_owners(
                svc.projection.log().as_ref(),
                identity.key(t.account),
                identity.client(),
                first,
                last,
            )
            .await
            {
                Ok(owners) => owners,
                Err(e) => {
                    // Could not look: hold everything and try again after a catch-up.
                    self.last_failure = format!("ownership read: {e}");
                    self.mark_ambiguous(batch);
                    return false;
                }
            };
            for (pi, li, seq) in seqs {
                let v = verify::ownership(&owners, seq, self.pending[pi].req.event_id);
                verdicts.push((pi, li, v));
            }
        }
        match verify::combine(verdicts.iter().map(|v| v.2)) {
            SeqOwnership::Ours { .. } => {
                self.arm(arm::SEQ_OURS);
                for &(pi, li, v) in &verdicts {
                    if let SeqOwnership::Ours { version } = v {
                        self.pending[pi].landed_at[li] = Some(version);
                    }
                }
                self.mark_ambiguous(batch);
                true
            }
            SeqOwnership::Sibling => {
                self.arm(arm::SEQ_SIBLING);
                self.last_failure = "a sibling request holds the sequence".into();
                self.held = false;
                false
            }
            SeqOwnership::Unwritten => {
                self.arm(arm::UNVERIFIABLE);
                for &pi in batch {
                    self.pending[pi].answer = Some(Err(WriteError::Unverifiable {
                        reason: "the store reports the sequence used, but no event holds it".into(),
                    }));
                }
                false
            }
        }
    }

    /// A one-word summary of the run for the request span.
    fn outcome_label(&self) -> &'static str {
        let mut ok = 0;
        let mut failed = 0;
        for p in &self.pending {
            match &p.answer {
                Some(Ok(_)) => ok += 1,
                _ => failed += 1,
            }
        }
        match (ok, failed) {
            (_, 0) => "ok",
            (0, _) => "failed",
            _ => "partial",
        }
    }

    fn finish(self) -> Vec<Answer> {
        self.pending
            .into_iter()
            .map(|p| {
                p.answer.unwrap_or_else(|| {
                    Err(WriteError::GaveUp {
                        attempts: 0,
                        last: "no answer".into(),
                    })
                })
            })
            .collect()
    }
}

/// Client-side event timestamp: informational, so the wall clock is fine here.
fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;
    use crate::account::{AmountCents, Identity};
    use crate::projection::{ManualClock, ProjectionConfig};
    use crate::store::memory::MemoryLog;

    fn service() -> WriteService {
        let projection = Projection::new(
            Arc::new(MemoryLog::new()),
            Identity::default(),
            ProjectionConfig::default(),
            Arc::new(ManualClock::new(0)),
            Arc::new(Metrics::new()),
        );
        WriteService::new(Arc::new(projection), WriteConfig::default())
    }

    fn withdraw(account: AccountId, cents: i64, event_id: u128) -> WriteRequest {
        WriteRequest {
            op: Operation::Withdraw {
                account,
                amount: AmountCents::new(cents).expect("amount"),
            },
            event_id,
        }
    }

    /// Simulation seed 4197: on replica 0 a batch [withdraw 55, withdraw 28] was decided on
    /// a balance of 57. The 28 was refused on top of the 55 ("balance 2"), but the 55's write
    /// conflicted and never landed in that run; the account went 57, 104, 171, ... and never
    /// had 2. Such a refusal is deferred, not answered, and not written; it is decided again
    /// once the requests before it are settled.
    #[test]
    fn a_refusal_on_top_of_unlanded_batch_members_is_deferred_not_answered() {
        let svc = service();
        let account = AccountId(Uuid::from_u128(1));
        let mut run = Run::new(
            &svc,
            vec![withdraw(account, 55, 1), withdraw(account, 28, 2)],
        );
        run.accounts[0].snap = Snapshot {
            balance: 57,
            version: 3,
            max_client_seq: 3,
        };
        assert!(run.decide(true));
        assert_eq!(run.pending[0].balances[0], 2);
        assert!(run.pending[0].answer.is_none() && !run.pending[0].deferred);
        assert!(
            run.pending[1].answer.is_none(),
            "not final on a speculative balance"
        );
        assert!(run.pending[1].deferred, "and not written with the first");

        // The first gave up without landing; a deposit landed meanwhile. The second is
        // decided on the balance the account has, and goes through.
        run.pending[0].answer = Some(Err(WriteError::GaveUp {
            attempts: 3,
            last: "version conflict".into(),
        }));
        run.accounts[0].snap = Snapshot {
            balance: 104,
            version: 4,
            max_client_seq: 4,
        };
        assert!(run.decide(true));
        assert!(run.pending[1].answer.is_none() && !run.pending[1].deferred);
        assert_eq!(run.pending[1].balances[0], 76);
    }

    /// A refusal with nothing speculative before it is final at once.
    #[test]
    fn a_refusal_on_the_loaded_state_is_final() {
        let svc = service();
        let account = AccountId(Uuid::from_u128(1));
        let mut run = Run::new(
            &svc,
            vec![withdraw(account, 55, 1), withdraw(account, 18, 2)],
        );
        run.accounts[0].snap = Snapshot {
            balance: 26,
            version: 2,
            max_client_seq: 2,
        };
        assert!(run.decide(true));
        assert_eq!(
            run.pending[0].answer,
            Some(Err(WriteError::Rule(RuleError::InsufficientFunds {
                balance: 26
            })))
        );
        assert!(run.pending[1].answer.is_none() && !run.pending[1].deferred);
        assert_eq!(run.pending[1].balances[0], 8);
    }
}
