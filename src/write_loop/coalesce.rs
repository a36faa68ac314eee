//! Coalescing: a duplicate of a key already being written on this replica, on the same
//! account, waits for the first and shares its answer, marked replayed. A different operation
//! under the key is a reused key if the first landed, and is decided on its own if the first
//! did not, as it would be had it come later. The key of a request is (event id, first
//! account), the same scope as the recent-writes index, so an overlapping duplicate and a
//! later one are answered by the same rule.

use std::sync::Arc;
use tokio::time::Instant;

use dashmap::DashMap;
use tokio::sync::watch;

use super::service::WriteService;
use super::{Answer, WriteError, WriteRequest};
use crate::account::{AccountId, Operation};

/// The first request of a key being written on this replica; duplicates wait for its answer.
pub(super) struct Leader {
    pub op: Operation,
    /// When the first request arrived: nothing it wrote landed earlier.
    pub arrived: Instant,
    pub answer: watch::Receiver<Option<Answer>>,
}

/// When the attempt a request's answer comes from arrived: the request's own arrival, or,
/// once it waits on a duplicate already running on this replica, that one's (the earliest,
/// over rounds). Nothing that attempt wrote landed before it, however long it runs: an
/// answer that leaves the outcome open counts its client's safe retry time from there
/// (`http/writes.rs`).
#[derive(Debug, Default)]
pub struct AnsweringAttempt(parking_lot::Mutex<Option<Instant>>);

impl AnsweringAttempt {
    pub(super) fn note(&self, arrived: Instant) {
        let mut earliest = self.0.lock();
        *earliest = Some(earliest.map_or(arrived, |e| e.min(arrived)));
    }

    /// `None` until the request reached the write side.
    pub fn arrived(&self) -> Option<Instant> {
        *self.0.lock()
    }
}

/// A request's coalescing key: its event id on its first account (the index's scope).
type CoalesceKey = (u128, AccountId);

pub(super) type LeaderMap = DashMap<CoalesceKey, Arc<Leader>, foldhash::fast::RandomState>;

pub(super) fn coalesce_key(req: &WriteRequest) -> CoalesceKey {
    (req.event_id, req.op.legs().as_slice()[0].account)
}

/// Removes a leader's entry however its future ends, so followers never wait on a leader
/// that is gone.
struct LeaderGuard<'a> {
    map: &'a LeaderMap,
    key: CoalesceKey,
    entry: Arc<Leader>,
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        self.map
            .remove_if(&self.key, |_, e| Arc::ptr_eq(e, &self.entry));
    }
}

impl WriteService {
    pub(super) async fn execute_admitted(
        &self,
        req: WriteRequest,
        arrived: Instant,
        attempt: &AnsweringAttempt,
    ) -> Answer {
        let key = coalesce_key(&req);
        // Each round waits for a first request to end, so the rounds are as many as the
        // requests racing under this key at most; a loop, not a recursion, so no number of
        // them can grow the stack.
        loop {
            let (tx, leader_rx) = watch::channel(None);
            let entry = self
                .leaders
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(Leader {
                        op: req.op,
                        arrived,
                        answer: leader_rx,
                    })
                })
                .clone();
            if entry.answer.same_channel(&tx.subscribe()) {
                let _guard = LeaderGuard {
                    map: &self.leaders,
                    key,
                    entry,
                };
                let answer = self.execute_uncoalesced(req, arrived).await;
                let _ = tx.send(Some(answer.clone()));
                return answer;
            }
            // Before waiting: the first may run on past any deadline of ours.
            attempt.note(entry.arrived);
            if let Some(answer) = self.follow(&entry, &req).await {
                return answer;
            }
            // Decided on its own: the first request's entry may outlive its answer for a
            // moment (its guard drops after it sends), and must not be waited on again.
            self.leaders.remove_if(&key, |_, e| Arc::ptr_eq(e, &entry));
        }
    }

    /// Waits for the first request under this key and shares its answer; `None` when this
    /// request must be decided on its own (the first did not land here, or ended unanswered).
    async fn follow(&self, leader: &Leader, req: &WriteRequest) -> Option<Answer> {
        self.metrics().idem_coalesced.inc();
        let mut rx = leader.answer.clone();
        let answer = match rx.wait_for(Option::is_some).await {
            Ok(answer) => answer.clone(),
            // The first request's task ended without an answer: run this one ourselves.
            Err(_) => None,
        };
        match answer {
            // The key landed with another payload: the same answer the index gives later.
            Some(Ok(_)) if leader.op != req.op => {
                self.metrics().idem_key_reuse.inc();
                Some(Err(WriteError::KeyReused))
            }
            Some(Ok(mut outcome)) => {
                outcome.replayed = true;
                Some(Ok(outcome))
            }
            Some(Err(e)) if leader.op == req.op => Some(Err(e)),
            // The first request under this key did not land here (a refusal, or an outcome
            // this replica still has to settle): nothing the key names is known, so this
            // request is decided on its own, exactly as if it had come after. Reusing the key
            // is only proven once the first payload is found in the stream.
            Some(Err(_)) | None => None,
        }
    }
}
