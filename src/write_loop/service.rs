//! The write side's entry point, one per replica: [`WriteService::execute`] runs a request
//! to a proven outcome or a typed error.
//!
//! Two things happen before the loop itself ([`super::run`]):
//! - **coalescing**: a duplicate of a key already being written on this replica waits for the
//!   first and shares its answer, marked replayed (a different operation under the key is a
//!   reused key);
//! - **batching**: a single-account request queues in its account's lane; whoever holds the
//!   lane's gate writes everything queued, in arrival order, as one batch.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{oneshot, watch};

use super::lanes::{Lanes, QueuedWrite};
use super::run::Run;
use super::{Answer, WriteConfig, WriteError, WriteRequest};
use crate::account::{AccountId, Operation};
use crate::metrics::Metrics;
use crate::projection::Projection;

/// First backoff between attempts; doubles per attempt up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_millis(2);
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// The first request of a key being written on this replica; duplicates wait for its answer.
struct Leader {
    op: Operation,
    answer: watch::Receiver<Option<Answer>>,
}

type LeaderMap = DashMap<u128, Arc<Leader>, foldhash::fast::RandomState>;

/// Removes a leader's entry however its future ends, so followers never wait on a leader
/// that is gone.
struct LeaderGuard<'a> {
    map: &'a LeaderMap,
    event_id: u128,
    entry: Arc<Leader>,
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        self.map
            .remove_if(&self.event_id, |_, e| Arc::ptr_eq(e, &self.entry));
    }
}

/// The write side of Tally: one instance per replica.
pub struct WriteService {
    pub(super) projection: Arc<Projection>,
    pub(super) config: WriteConfig,
    leaders: LeaderMap,
    lanes: Lanes,
}

impl WriteService {
    pub fn new(projection: Arc<Projection>, config: WriteConfig) -> Self {
        Self {
            projection,
            config,
            leaders: DashMap::default(),
            lanes: Lanes::default(),
        }
    }

    pub fn projection(&self) -> &Arc<Projection> {
        &self.projection
    }

    pub(super) fn metrics(&self) -> &Metrics {
        self.projection.metrics()
    }

    /// Runs one request to a proven outcome or a typed error. Concurrent duplicates of the
    /// same event id on this replica wait for the first and share its answer.
    pub async fn execute(&self, req: WriteRequest) -> Answer {
        let (tx, leader_rx) = watch::channel(None);
        let entry = self
            .leaders
            .entry(req.event_id)
            .or_insert_with(|| {
                Arc::new(Leader {
                    op: req.op,
                    answer: leader_rx,
                })
            })
            .clone();
        if !entry.answer.same_channel(&tx.subscribe()) {
            return self.follow(&entry, req).await;
        }
        let _guard = LeaderGuard {
            map: &self.leaders,
            event_id: req.event_id,
            entry,
        };
        let answer = self.execute_uncoalesced(req).await;
        let _ = tx.send(Some(answer.clone()));
        answer
    }

    async fn follow(&self, leader: &Leader, req: WriteRequest) -> Answer {
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

    /// Queues a single-account request in its account's lane on this replica. Whoever holds
    /// the lane's gate writes everything queued, in arrival order, as one batch.
    async fn submit_batched(&self, account: AccountId, req: WriteRequest) -> Answer {
        let lane = self.lanes.enter(account);
        let (reply, mut rx) = oneshot::channel();
        lane.queue.lock().push(QueuedWrite { req, reply });
        let _gate = lane.gate.lock().await;
        loop {
            if let Ok(answer) = rx.try_recv() {
                return answer;
            }
            let batch: Vec<QueuedWrite> = {
                let mut q = lane.queue.lock();
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

    /// Sleeps before attempt `attempt` (the second and later), growing per attempt.
    pub(super) async fn backoff(&self, attempt: u32, salt: u128) {
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
