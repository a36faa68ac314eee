//! `--batch N`: one request is one `POST /api/batch` carrying the next N of the scenario's
//! operations, each under its own key. Each item's answer goes to its key's record, so the
//! audit holds every item to exactly once as it holds a single write.
//!
//! What an item is noted as, per send that carried it:
//! - its own result's status and body, when the batch was answered 2xx with one result per
//!   item;
//! - the whole answer's status, when the batch was refused or shed as a whole (a 413 or a
//!   400 wrote nothing; a 503 is retryable);
//! - no answer, when none came or its results could not be matched to the items: each item
//!   may then have landed, and the audit allows it at most once.
//!
//! The options act per item where they can: `--on-503` re-sends only the items answered 503
//! (or all of them after a whole 503); `--failover` re-sends the unanswered batch to the next
//! target; `--retry-ratio` re-sends the whole batch, every item under its key.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use hyper::Method;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;
use uuid::Uuid;

use super::{
    Latencies, REFUSED, RETRY_ELSEWHERE_SHARE, Shared, Stats, is_success, micros_since, next_up,
    wait_before_resend,
};
use crate::conn::WorkerConn;
use crate::http::{Answer, Outcome, TransportError};
use crate::ledger::{KeyRecord, NO_ANSWER};
use crate::rng::Rng;

/// The batch endpoint.
pub const BATCH_PATH: &str = "/api/batch";
/// Error kind an item is noted with when its batch's 2xx answer cannot be matched to it.
const UNREADABLE: &str = "unreadable batch answer";

#[derive(Deserialize)]
struct BatchAnswer<'a> {
    #[serde(borrow)]
    results: Vec<ItemAnswer<'a>>,
}

/// One item's result: the single route's status and body, and whether it is a replay.
/// Borrowed from the answer: an item's body is kept as the bytes the server sent, never
/// parsed into a tree and written out again (that cost the generator CPU the server
/// under test then did not get).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ItemAnswer<'a> {
    status: u16,
    /// None when absent or `null`.
    #[serde(borrow, default)]
    body: Option<&'a RawValue>,
    #[serde(default)]
    replayed: bool,
    #[serde(borrow)]
    idempotency_key: Option<Cow<'a, str>>,
}

/// One operation of the batch.
struct Item {
    /// The item as the batch body carries it, written once for every send of it.
    wire: Bytes,
    key: Uuid,
    record: KeyRecord,
    /// The status its last send got it ([`NO_ANSWER`] for none).
    last: u16,
}

/// The sends of one batch, each counted in the stats and noted in its items' records.
pub(super) struct BatchSends<'a> {
    shared: &'a Shared,
    /// The stream of the batch's first operation, continued: whether and where it is
    /// retried.
    rng: Rng,
    first: usize,
    conns: &'a mut [WorkerConn],
    latency: &'a Mutex<Latencies>,
    items: Vec<Item>,
}

impl<'a> BatchSends<'a> {
    /// Draws the operations numbered `ops` (each from its own stream, as without `--batch`),
    /// and a key for each.
    pub(super) fn draw(
        shared: &'a Shared,
        conns: &'a mut [WorkerConn],
        latency: &'a Mutex<Latencies>,
        ops: Range<u64>,
    ) -> Self {
        let config = &shared.config;
        let mut rng = Rng::derive(config.seed, ops.start);
        let mut items = Vec::with_capacity((ops.end - ops.start) as usize);
        for ticket in ops.clone() {
            let mut own = Rng::derive(config.seed, ticket);
            let op = shared.workload.next_draw(&mut own).op;
            if ticket == ops.start {
                rng = own;
            }
            let key = Uuid::new_v4();
            // Every scenario `--batch` accepts draws writes only (cli refuses balance).
            let Some(wire) = op.batch_item(key) else {
                continue;
            };
            let wire = Bytes::from(wire.to_string());
            items.push(Item {
                wire,
                key,
                record: KeyRecord::new(key, op),
                last: NO_ANSWER,
            });
        }
        let first = next_up(conns, (ops.start % config.targets.len() as u64) as usize);
        BatchSends {
            shared,
            rng,
            first,
            conns,
            latency,
            items,
        }
    }

    /// Items in the batch.
    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    /// Sends the batch, then fails over, re-sends 503 items and retries as the options say;
    /// keeps each item's record. False when a re-send would start after the run's end.
    pub(super) async fn run(mut self, stats: &mut Stats, intended: Instant) -> bool {
        let config = &self.shared.config;
        let all: Vec<usize> = (0..self.items.len()).collect();
        let mut at = self.first;
        let mut outcome = self.send(stats, at, &all, intended).await;
        if config.failover {
            (at, outcome) = self.fail_over(stats, at, &all, outcome).await;
        }
        let mut in_time = true;
        if let Some(policy) = config.on_503 {
            loop {
                let refused: Vec<usize> = (0..self.items.len())
                    .filter(|&i| self.items[i].last == REFUSED)
                    .collect();
                let Ok(answer) = &outcome else { break };
                if refused.is_empty() {
                    break;
                }
                if !wait_before_resend(policy, answer, self.shared.deadline).await {
                    in_time = false;
                    break;
                }
                stats.resends += 1;
                outcome = self.send(stats, at, &refused, Instant::now()).await;
                if config.failover {
                    (at, outcome) = self.fail_over(stats, at, &refused, outcome).await;
                }
            }
        }
        if outcome.as_ref().is_ok_and(|a| is_success(a.status)) {
            self.latency
                .lock()
                .settled
                .saturating_record(micros_since(intended));
        }
        if in_time && !self.items.is_empty() && self.rng.unit() < config.retry_ratio {
            self.retry(stats, at, &all).await;
        }
        stats
            .records
            .extend(self.items.into_iter().map(|item| item.record));
        in_time
    }

    /// `--retry-ratio`: the whole batch once more, every item under its key, to `at` or, with
    /// several targets, as often as not to another one.
    async fn retry(&mut self, stats: &mut Stats, at: usize, all: &[usize]) {
        let targets = self.conns.len();
        let again = if targets > 1 && self.rng.unit() < RETRY_ELSEWHERE_SHARE {
            let other = (at + 1 + self.rng.below(targets as u64 - 1) as usize) % targets;
            next_up(self.conns, other)
        } else {
            at
        };
        stats.retries += 1;
        // Counted and recorded by `send`; nothing more to do with this answer.
        let _ = self.send(stats, again, all, Instant::now()).await;
    }

    /// `--failover`: while `outcome` is no answer, re-sends the same items to the next other
    /// target that is up, at most once per other target and never past the run's end.
    async fn fail_over(
        &mut self,
        stats: &mut Stats,
        mut at: usize,
        which: &[usize],
        mut outcome: Outcome,
    ) -> (usize, Outcome) {
        let targets = self.conns.len();
        for _ in 1..targets {
            if outcome.is_ok() || Instant::now() >= self.shared.deadline {
                break;
            }
            let next = next_up(self.conns, (at + 1) % targets);
            if next == at {
                break;
            }
            at = next;
            stats.failovers += 1;
            outcome = self.send(stats, at, which, Instant::now()).await;
        }
        (at, outcome)
    }

    /// Sends the items `which` to target `target` once, as one batch; latency counts from
    /// `since`. Notes each item's outcome in its record and the stats.
    async fn send(
        &mut self,
        stats: &mut Stats,
        target: usize,
        which: &[usize],
        since: Instant,
    ) -> Outcome {
        let body = self.body_of(which);
        let timeout = self.shared.config.timeout;
        let outcome = self.conns[target]
            .exchange(Method::POST, BATCH_PATH, None, Some(body), timeout)
            .await;
        stats.note(self.latency, since, &outcome, None);
        match &outcome {
            Ok(answer) if is_success(answer.status) => match self.results(which, answer) {
                Ok(results) => {
                    for (&i, result) in which.iter().zip(results) {
                        let body = match result.body {
                            Some(raw) => answer.body.slice_ref(raw.get().as_bytes()),
                            None => Bytes::from_static(b"null"),
                        };
                        let item = Answer {
                            status: result.status,
                            replayed: result.replayed,
                            retry_after: answer.retry_after,
                            body,
                        };
                        self.note(stats, i, &Ok(item));
                    }
                }
                Err(detail) => {
                    let unreadable = Err(TransportError {
                        kind: UNREADABLE,
                        detail,
                    });
                    for &i in which {
                        self.note(stats, i, &unreadable);
                    }
                }
            },
            // Refused, shed or unanswered as a whole: every item it carried shares that.
            _ => {
                for &i in which {
                    self.note(stats, i, &outcome);
                }
            }
        }
        outcome
    }

    /// `{"items":[...]}` of the items `which`, each as written when it was drawn.
    fn body_of(&self, which: &[usize]) -> Bytes {
        let items: usize = which.iter().map(|&i| self.items[i].wire.len() + 1).sum();
        let mut body = Vec::with_capacity(items + 16);
        body.extend_from_slice(b"{\"items\":[");
        for (n, &i) in which.iter().enumerate() {
            if n > 0 {
                body.push(b',');
            }
            body.extend_from_slice(&self.items[i].wire);
        }
        body.extend_from_slice(b"]}");
        Bytes::from(body)
    }

    fn note(&mut self, stats: &mut Stats, index: usize, outcome: &Outcome) {
        let item = &mut self.items[index];
        item.record.observe(outcome);
        let (status, replayed) = match outcome {
            Ok(answer) => (answer.status, answer.replayed),
            Err(_) => (NO_ANSWER, false),
        };
        item.last = status;
        stats.note_item(status, replayed);
    }

    /// The answer's results, one per item sent, each naming its item's key when it names
    /// one; why not, when they cannot be matched.
    fn results<'b>(
        &self,
        which: &[usize],
        answer: &'b Answer,
    ) -> Result<Vec<ItemAnswer<'b>>, String> {
        let parsed: BatchAnswer =
            serde_json::from_slice(&answer.body).map_err(|e| format!("not a batch answer: {e}"))?;
        if parsed.results.len() != which.len() {
            return Err(format!(
                "{} results for {} items",
                parsed.results.len(),
                which.len()
            ));
        }
        for (&i, result) in which.iter().zip(&parsed.results) {
            let expected = self.items[i].key.to_string();
            if result
                .idempotency_key
                .as_ref()
                .is_some_and(|k| *k != expected)
            {
                return Err(format!(
                    "a result names another key than its item's ({expected})"
                ));
            }
        }
        Ok(parsed.results)
    }
}
