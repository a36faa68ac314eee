//! One store decorator for the suites that watch or steer the store a replica writes through
//! (`write_loop`, `fleet`, `simulation`): [`HookedLog`].
//!
//! A call that reaches it, in order:
//! 1. If the bypass names one of its keys, it goes straight to the bypass store: no hooks, no
//!    script, no record (the simulation's server-clock probe).
//! 2. A write runs [`Around::before_write`], then takes the next scripted [`Step`] if one is
//!    queued (answer an error, forward and run a hook, detach), else forwards; then runs
//!    [`Around::after_write`] with the answer, and is recorded with it ([`WriteRecord`]).
//! 3. A read runs [`Around::before_read`], then forwards. `details`, `leader_tip` and `trim_start` forward;
//!    `ping` keeps the trait's default.
//!
//! The log adds no yield of its own: a hook that does nothing completes without yielding, so
//! a seeded, paused-time run (the simulation, whose trace hashes pin its schedule) is polled
//! exactly where its hooks sleep or yield.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tally::store::faults::HoldHandle;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreError, StoreResult,
};
use tokio::task::JoinHandle;

/// Something a scripted step runs once, and awaits, before its write's caller sees the answer.
pub type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

pub fn hook<F: Future<Output = ()> + Send + 'static>(f: F) -> Hook {
    Box::new(move || Box::pin(f))
}

/// What the log does with one write. Writes with no step queued pass through.
pub enum Step {
    /// Forwards the write, then runs the hook before the caller sees the answer (something
    /// that happened "meanwhile").
    After(Hook),
    /// Answers with this error without forwarding anything.
    Reject(StoreError),
    /// Forwards the write on a detached task that the inner `FaultyLog` holds in flight (the
    /// handle is the hold it queued), and answers `OutcomeUnknown` once it is held: a client
    /// that timed out on a write the server still has.
    Detach(HoldHandle),
}

/// What a suite does around every call that reaches the store (not bypassed). Each method
/// does nothing unless the suite overrides it; `()` overrides none.
#[async_trait]
pub trait Around: Send + Sync + 'static {
    /// Before a write is forwarded (or answered by its scripted step).
    async fn before_write(&self) {}
    /// After a write is answered, before the answer is recorded and returned.
    async fn after_write(&self, _result: &StoreResult<Vec<u64>>) {}
    /// Before a read is forwarded.
    async fn before_read(&self) {}
}

impl Around for () {}

/// One aggregate's part of a recorded write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegRecord {
    pub key: AggregateKey,
    pub expected_version: Option<u64>,
    pub seqs: Vec<u64>,
    pub event_ids: Vec<Option<u128>>,
    /// Whether the write may create the aggregate.
    pub allow_create: bool,
}

/// A write a replica sent, with what it got back.
#[derive(Clone, Debug)]
pub struct WriteRecord {
    pub legs: Vec<LegRecord>,
    pub result: StoreResult<Vec<u64>>,
}

/// A write the server holds while its caller has been told `OutcomeUnknown`.
type Detached = (JoinHandle<StoreResult<Vec<u64>>>, HoldHandle);

/// Calls on the keys `applies` names go to `store` instead, untouched.
struct Bypass {
    store: SharedLog,
    applies: fn(&AggregateKey) -> bool,
}

/// The hooked, scripted, recording decorator; see the module doc for what a call goes
/// through.
pub struct HookedLog<A: Around = ()> {
    inner: SharedLog,
    around: A,
    bypass: Option<Bypass>,
    script: Mutex<VecDeque<Step>>,
    records: Mutex<Vec<WriteRecord>>,
    detached: Mutex<Option<Detached>>,
}

impl HookedLog {
    /// `inner` with no hooks: only the script and the record.
    pub fn new(inner: SharedLog) -> Self {
        Self::around(inner, ())
    }
}

impl<A: Around> HookedLog<A> {
    /// `inner` with `around`'s hooks.
    pub fn around(inner: SharedLog, around: A) -> Self {
        Self {
            inner,
            around,
            bypass: None,
            script: Mutex::new(VecDeque::new()),
            records: Mutex::new(Vec::new()),
            detached: Mutex::new(None),
        }
    }

    /// Calls on a key `applies` names go straight to `store`: a write if any of its keys is
    /// named, a read, `details` or `trim_start` if its key is.
    pub fn bypass(mut self, store: SharedLog, applies: fn(&AggregateKey) -> bool) -> Self {
        self.bypass = Some(Bypass { store, applies });
        self
    }

    /// Queues what the next write without a step does.
    pub fn push(&self, step: Step) {
        self.script.lock().push_back(step);
    }

    /// Every write that reached the log (not bypassed), in order, with its answer.
    pub fn records(&self) -> Vec<WriteRecord> {
        self.records.lock().clone()
    }

    /// The detached write is abandoned by the server before it becomes durable: it never
    /// applies.
    pub async fn roll_back_detached(&self) {
        let (task, hold) = self.detached.lock().take().expect("a detached write");
        task.abort();
        assert!(task.await.is_err_and(|e| e.is_cancelled()));
        // Only now: dropping the handle would otherwise release the write.
        drop(hold);
    }

    /// The detached write becomes durable; returns what the server answered it.
    pub async fn commit_detached(&self) -> StoreResult<Vec<u64>> {
        let (task, hold) = self.detached.lock().take().expect("a detached write");
        hold.release();
        task.await.expect("detached write task")
    }

    /// The bypass store, if the bypass names `key`.
    fn bypassed(&self, key: &AggregateKey) -> Option<&SharedLog> {
        self.bypass
            .as_ref()
            .filter(|b| (b.applies)(key))
            .map(|b| &b.store)
    }
}

#[async_trait]
impl<A: Around> EventLog for HookedLog<A> {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        if let Some(store) = writes.iter().find_map(|w| self.bypassed(&w.key)) {
            return store.write(client_id, writes).await;
        }
        let legs = writes
            .iter()
            .map(|w| LegRecord {
                key: w.key,
                expected_version: w.expected_version,
                seqs: w.events.iter().map(|e| e.client_seq).collect(),
                event_ids: w.events.iter().map(|e| e.event_id).collect(),
                allow_create: w.allow_create,
            })
            .collect();
        self.around.before_write().await;
        let step = self.script.lock().pop_front();
        let result = match step {
            None => self.inner.write(client_id, writes).await,
            Some(Step::Reject(e)) => Err(e),
            Some(Step::After(hook)) => {
                let result = self.inner.write(client_id, writes).await;
                hook().await;
                result
            }
            Some(Step::Detach(mut hold)) => {
                let inner = Arc::clone(&self.inner);
                let task = tokio::spawn(async move { inner.write(client_id, writes).await });
                assert!(
                    hold.held().await,
                    "the detached write must be held in flight"
                );
                *self.detached.lock() = Some((task, hold));
                Err(StoreError::OutcomeUnknown {
                    reason: "scripted: timed out while the server holds the write".into(),
                })
            }
        };
        self.around.after_write(&result).await;
        self.records.lock().push(WriteRecord {
            legs,
            result: result.clone(),
        });
        result
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        if let Some(store) = self.bypassed(&key) {
            return store.read(key, filter).await;
        }
        self.around.before_read().await;
        self.inner.read(key, filter).await
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        if let Some(store) = self.bypassed(&key) {
            return store.details(key).await;
        }
        self.inner.details(key).await
    }

    /// Forwarded like `details`: the probe asks where a stream ends and can never land, so
    /// it is no write of the suites' to script or record.
    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        if let Some(store) = self.bypassed(&key) {
            return store.leader_tip(client_id, key).await;
        }
        self.inner.leader_tip(client_id, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        if let Some(store) = self.bypassed(&key) {
            return store.trim_start(key, keep_from_version).await;
        }
        self.inner.trim_start(key, keep_from_version).await
    }
}
