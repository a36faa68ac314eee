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

use super::error::WriteError;
use super::{Answer, WriteRequest};
use crate::account::{AccountId, Operation};
use crate::metrics::Metrics;

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

type LeaderMap = DashMap<CoalesceKey, Arc<Leader>, foldhash::fast::RandomState>;

fn coalesce_key(req: &WriteRequest) -> CoalesceKey {
    (req.event_id, req.op.legs().as_slice()[0].account)
}

/// The first request of every key being written on this replica.
#[derive(Default)]
pub(super) struct Coalescer {
    pub(super) leaders: LeaderMap,
}

/// A request's part among the requests of its key on this replica.
pub(super) enum Role<'a> {
    /// The first: it runs, and shares its answer ([`First::share`]).
    First(First<'a>),
    /// A duplicate of a first already running: it waits for that one ([`Leader::follow`]).
    Duplicate(Arc<Leader>),
}

/// What a duplicate takes from the first request of its key.
pub(super) enum Followed {
    /// The first's answer, as this request's own.
    Shared(Answer),
    /// Nothing: this request is decided on its own.
    OnItsOwn,
}

impl Coalescer {
    /// Makes `req` the first of its key, or a duplicate of the first already running.
    pub fn join(&self, req: &WriteRequest, arrived: Instant) -> Role<'_> {
        let key = coalesce_key(req);
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
            Role::First(First {
                map: &self.leaders,
                key,
                entry,
                tx,
            })
        } else {
            Role::Duplicate(entry)
        }
    }

    /// Whether a request under `event_id` that writes to `account` (on any of its legs) is
    /// running here: a transfer is listed under its source only, so its destination is
    /// looked for among every running request.
    pub fn writing(&self, event_id: u128, account: AccountId) -> bool {
        self.leaders.contains_key(&(event_id, account))
            || self.leaders.iter().any(|e| {
                e.key().0 == event_id && e.op.legs().as_slice().iter().any(|l| l.account == account)
            })
    }

    /// When the first request of `req`'s key arrived, if one is running here.
    pub fn running_since(&self, req: &WriteRequest) -> Option<Instant> {
        self.leaders.get(&coalesce_key(req)).map(|l| l.arrived)
    }

    /// Takes out `leader`'s entry, if it is still listed. The first request's entry may
    /// outlive its answer for a moment (its [`First`] drops after it shares), and a request
    /// decided on its own must not wait on it again.
    pub fn forget(&self, req: &WriteRequest, leader: &Arc<Leader>) {
        self.leaders
            .remove_if(&coalesce_key(req), |_, e| Arc::ptr_eq(e, leader));
    }
}

/// The first request of a key. Its entry is removed however its future ends, so followers
/// never wait on a first that is gone.
pub(super) struct First<'a> {
    map: &'a LeaderMap,
    key: CoalesceKey,
    entry: Arc<Leader>,
    tx: watch::Sender<Option<Answer>>,
}

impl First<'_> {
    /// Gives the first's answer to every duplicate waiting on it.
    pub fn share(self, answer: &Answer) {
        let _ = self.tx.send(Some(answer.clone()));
    }
}

impl Drop for First<'_> {
    fn drop(&mut self) {
        self.map
            .remove_if(&self.key, |_, e| Arc::ptr_eq(e, &self.entry));
    }
}

impl Leader {
    /// Waits for this first request's answer and shares it with `req`, unless `req` must be
    /// decided on its own (the first did not land here, or ended unanswered).
    pub async fn follow(&self, req: &WriteRequest, metrics: &Metrics) -> Followed {
        metrics.idem_coalesced.inc();
        let mut rx = self.answer.clone();
        let answer = match rx.wait_for(Option::is_some).await {
            Ok(answer) => answer.clone(),
            // The first request's task ended without an answer: run this one ourselves.
            Err(_) => None,
        };
        match answer {
            // The key landed with another payload: the same answer the index gives later.
            Some(Ok(_)) if self.op != req.op => {
                metrics.idem_key_reuse.inc();
                Followed::Shared(Err(WriteError::KeyReused))
            }
            Some(Ok(mut outcome)) => {
                outcome.replayed = true;
                Followed::Shared(Ok(outcome))
            }
            Some(Err(e)) if self.op == req.op => Followed::Shared(Err(e)),
            // The first request under this key did not land here (a refusal, or an outcome
            // this replica still has to settle): nothing the key names is known, so this
            // request is decided on its own, exactly as if it had come after. Reusing the key
            // is only proven once the first payload is found in the stream.
            Some(Err(_)) | None => Followed::OnItsOwn,
        }
    }
}
