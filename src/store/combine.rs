//! Group commit: writes that different runs send at about the same time share one store
//! request.
//!
//! Why: every store request costs the server a round of work whatever it carries, so one
//! request per account write caps a replica at the server's single-write rate. A write
//! request carries many aggregates, each with its own guard and sequences, applied all or
//! nothing, each member judged by its own marks (the port's contract, pinned by the
//! conformance rules on multi-aggregate writes). So writes of different accounts can travel
//! together without changing what any of them means.
//!
//! How: [`CombiningLog`] decorates the port. A write joins a queue; while fewer than
//! `max_in_flight` store writes are out, a sender takes everything queued that fits one
//! request and sends it. There is no timer: a lone write goes out at once, and under load the
//! queue fills while earlier requests are in flight.
//!
//! What each member is answered ([`Combined::settle`]):
//! - applied: its own versions;
//! - outcome unknown, or not applied: the request applied to every member or to none, so each
//!   gets that answer and settles it as if it had written alone (it keeps its sequences, and
//!   its own retry is judged by its own marks). Not one read for all: finding a member's
//!   batch in its stream does not prove this request landed, since the same write sent again
//!   on another replica (same key, same sequence derived from the same fold, same payload)
//!   leaves the same batch while this request failed on its guard; only each member's own
//!   read of its own stream settles its own write;
//! - refused (a conflict, a sequence already used or in flight, a missing aggregate, any
//!   other error): the server never names the member, so each member is sent again alone, at
//!   once and unchanged, and gets the answer its own write earns. The members that were only
//!   collateral pay one round trip, never a new decision;
//! - aggregates on different shards (9001): the store routes accounts apart, so combining
//!   stops for the life of the process (logged once) and each member is sent alone.
//!
//! What may share a request ([`Group::admits`]): writes of one client id, every aggregate of
//! one aggregate type (a store routed by type keeps a type on one shard), no aggregate twice
//! (a replica writes an account from one run at a time; a second write of one aggregate
//! waits for the next request), within [`CombineConfig::max_aggregates`] and
//! [`MAX_COMBINED_BYTES`].

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinSet;

use super::metered::result_label;
use super::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreError, StoreResult, WatchFeed, WatchFilter,
};
use crate::metrics::Metrics;

/// Store writes a replica keeps in flight at once while combining; writes beyond them wait
/// and go together in the next request. Chosen by measurement (BENCHMARKS.md, "Group
/// commit"): Celeriant commits every request in flight in one cycle of a few milliseconds,
/// so below this many concurrent writes a request each costs nothing in throughput, and
/// holding writes back to fill a request only adds latency (4 in flight lost about 30% of
/// deposits/s at 64 connections); above it, combining is what lets the store take more
/// account writes per cycle than requests (256 connections: 1.6x the store's single-write
/// rate).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;
/// The most `--combine-max-in-flight` accepts.
pub const MAX_IN_FLIGHT: usize = 1024;
/// The most aggregates one combined request carries.
pub const DEFAULT_MAX_AGGREGATES: usize = 256;
/// The most `--combine-max-aggregates` accepts.
pub const MAX_AGGREGATES: usize = 4096;
/// The most payload one combined request carries, far below the client's request limit: a
/// write that alone is larger still goes out, alone.
pub const MAX_COMBINED_BYTES: usize = 1 << 20;
/// What an aggregate and an event add to a request besides payloads (keys, guards, ids).
const AGGREGATE_OVERHEAD_BYTES: usize = 64;
const EVENT_OVERHEAD_BYTES: usize = 64;
/// How far into the queue a sender looks for writes that fit: bounds the work under the
/// queue's lock when many queued writes cannot join (one account's, another client's).
const MAX_SCAN: usize = 4 * MAX_AGGREGATES;

/// How writes are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineConfig {
    /// Off: every write is its own request, as without this layer.
    pub enabled: bool,
    pub max_in_flight: usize,
    pub max_aggregates: usize,
}

impl Default for CombineConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_aggregates: DEFAULT_MAX_AGGREGATES,
        }
    }
}

/// The port, with writes sent at about the same time combined into one request.
pub struct CombiningLog {
    shared: Arc<Shared>,
}

struct Shared {
    inner: SharedLog,
    max_aggregates: usize,
    queue: Mutex<VecDeque<Pending>>,
    /// One permit per store write in flight.
    senders: Arc<Semaphore>,
    /// Cleared for good when the store says aggregates of one request sit on different shards.
    combining: AtomicBool,
    metrics: Arc<Metrics>,
}

/// Where a caller waits for its write's answer.
type Reply = oneshot::Sender<StoreResult<Vec<u64>>>;

/// One caller's write, waiting for a sender.
struct Pending {
    client_id: ClientId,
    writes: Vec<AggregateWrite>,
    /// The one aggregate type of every aggregate it writes, `None` when they differ.
    aggregate_type: Option<u128>,
    bytes: usize,
    reply: Reply,
}

impl CombiningLog {
    pub fn new(inner: SharedLog, config: CombineConfig, metrics: Arc<Metrics>) -> Self {
        assert!(config.max_in_flight >= 1 && config.max_aggregates >= 1);
        Self {
            shared: Arc::new(Shared {
                inner,
                max_aggregates: config.max_aggregates,
                queue: Mutex::new(VecDeque::new()),
                senders: Arc::new(Semaphore::new(config.max_in_flight)),
                combining: AtomicBool::new(config.enabled),
                metrics,
            }),
        }
    }

    /// Whether writes are still combined (false once the store refused a combined write for
    /// spanning shards, or when configured off).
    pub fn is_combining(&self) -> bool {
        self.shared.combining.load(Ordering::Relaxed)
    }
}

impl Shared {
    /// Starts a sender if a store write may go out now; else a sender that is busy takes the
    /// queue when its write returns.
    fn wake(self: &Arc<Self>) {
        if let Ok(permit) = self.senders.clone().try_acquire_owned() {
            tokio::spawn(self.clone().send_while_queued(permit));
        }
    }

    /// Sends the queue, one request at a time, until it is empty. Runs on its own task, so a
    /// caller that stops waiting never cancels a request other callers share.
    async fn send_while_queued(self: Arc<Self>, permit: OwnedSemaphorePermit) {
        loop {
            let group = self.take_group();
            if group.is_empty() {
                break;
            }
            self.send(group).await;
        }
        drop(permit);
        // A write queued after the last look, while every sender was busy, found no permit:
        // look once more now that this one is free.
        if !self.queue.lock().is_empty() {
            self.wake();
        }
    }

    /// Takes the oldest queued write and every later one that may share its request.
    fn take_group(&self) -> Vec<Pending> {
        let mut queue = self.queue.lock();
        let mut group = Group::default();
        let mut i = 0;
        while i < queue.len() && i < MAX_SCAN && group.aggregates < self.max_aggregates {
            // A caller that stopped waiting gets nothing sent: it cannot have landed.
            if queue[i].reply.is_closed() {
                queue.remove(i);
                continue;
            }
            let combining = self.combining.load(Ordering::Relaxed);
            if group.members.is_empty() || (combining && group.admits(&queue[i], self)) {
                let p = queue.remove(i).expect("index is inside the queue");
                group.add(p);
                if !combining {
                    break;
                }
            } else {
                i += 1;
            }
        }
        group.members
    }

    /// Sends one group as one request and answers each member.
    async fn send(&self, mut group: Vec<Pending>) {
        if group.len() == 1 {
            let p = group.pop().expect("one member");
            self.observe(1, p.writes.len());
            let result = self.inner.write(p.client_id, p.writes).await;
            let _ = p.reply.send(result);
            return;
        }
        let combined = Combined::new(group);
        self.observe(combined.members.len(), combined.writes.len());
        let result = self
            .inner
            .write_combined(combined.client_id, combined.writes.clone())
            .await;
        let client_id = combined.client_id;
        if let Some(alone) = combined.settle(result, self) {
            self.send_alone(client_id, alone).await;
        }
    }

    /// Sends each write as its own request, all at once, and answers each with its own result.
    async fn send_alone(&self, client_id: ClientId, members: Vec<(Reply, Vec<AggregateWrite>)>) {
        let mut set = JoinSet::new();
        for (reply, writes) in members {
            let inner = self.inner.clone();
            self.observe(1, writes.len());
            set.spawn(async move {
                let result = inner.write(client_id, writes).await;
                let _ = reply.send(result);
            });
        }
        while set.join_next().await.is_some() {}
    }

    fn observe(&self, writes: usize, aggregates: usize) {
        self.metrics.store_write_group.observe(writes as f64);
        self.metrics
            .store_write_aggregates
            .observe(aggregates as f64);
    }

    /// The store refused a request for spanning shards: every later write goes alone.
    fn stop_combining(&self) {
        if self.combining.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "the store refused a combined write whose accounts sit on different shards: \
                 combining is off for this process (start the store with --routing-rule \
                 aggregate_type_id to combine)"
            );
        }
    }
}

/// The writes taken for one request so far.
#[derive(Default)]
struct Group {
    members: Vec<Pending>,
    keys: HashSet<AggregateKey>,
    aggregates: usize,
    bytes: usize,
}

impl Group {
    fn add(&mut self, p: Pending) {
        self.keys.extend(p.writes.iter().map(|w| w.key));
        self.aggregates += p.writes.len();
        self.bytes += p.bytes;
        self.members.push(p);
    }

    /// Whether `p` may join this group's request.
    fn admits(&self, p: &Pending, shared: &Shared) -> bool {
        let first = &self.members[0];
        first.client_id == p.client_id
            && first.aggregate_type.is_some()
            && first.aggregate_type == p.aggregate_type
            && self.aggregates + p.writes.len() <= shared.max_aggregates
            && self.bytes + p.bytes <= MAX_COMBINED_BYTES
            && p.writes.iter().all(|w| !self.keys.contains(&w.key))
    }
}

/// A request of several callers' writes, laid end to end.
struct Combined {
    client_id: ClientId,
    writes: Vec<AggregateWrite>,
    /// Each caller, with how many of `writes` are its own (in order).
    members: Vec<(Reply, usize)>,
}

impl Combined {
    fn new(group: Vec<Pending>) -> Self {
        let client_id = group[0].client_id;
        let mut writes = Vec::with_capacity(group.iter().map(|p| p.writes.len()).sum());
        let mut members = Vec::with_capacity(group.len());
        for p in group {
            members.push((p.reply, p.writes.len()));
            writes.extend(p.writes);
        }
        Self {
            client_id,
            writes,
            members,
        }
    }

    /// Answers every member from the combined request's result, or hands back the members to
    /// send again alone when the store refused the request without naming the member.
    fn settle(
        self,
        result: StoreResult<Vec<u64>>,
        shared: &Shared,
    ) -> Option<Vec<(Reply, Vec<AggregateWrite>)>> {
        match result {
            Ok(versions) => {
                self.answer_versions(versions);
                None
            }
            Err(e @ (StoreError::OutcomeUnknown { .. } | StoreError::NotApplied { .. })) => {
                for (reply, _) in self.members {
                    let _ = reply.send(Err(e.clone()));
                }
                None
            }
            Err(e) => {
                if e == StoreError::CrossShard {
                    shared.stop_combining();
                }
                shared
                    .metrics
                    .store_write_splits
                    .with_label_values(&[result_label::<()>(&Err(e))])
                    .inc();
                Some(self.split())
            }
        }
    }

    /// Each member's own versions, in the order its writes were laid in.
    fn answer_versions(self, versions: Vec<u64>) {
        if versions.len() != self.writes.len() {
            // It landed, but no member can be told where: an empty list is what the member's
            // own check refuses as misplaced (landed, never sent again, not a success).
            tracing::error!(
                expected = self.writes.len(),
                got = versions.len(),
                "the store acknowledged a combined write without one version per aggregate"
            );
            for (reply, _) in self.members {
                let _ = reply.send(Ok(Vec::new()));
            }
            return;
        }
        let mut rest = versions.as_slice();
        for (reply, n) in self.members {
            let (own, later) = rest.split_at(n);
            let _ = reply.send(Ok(own.to_vec()));
            rest = later;
        }
    }

    /// Back into one write per member, unchanged.
    fn split(self) -> Vec<(Reply, Vec<AggregateWrite>)> {
        let mut writes = self.writes.into_iter();
        self.members
            .into_iter()
            .map(|(reply, n)| (reply, writes.by_ref().take(n).collect()))
            .collect()
    }
}

fn aggregate_type(writes: &[AggregateWrite]) -> Option<u128> {
    let first = writes.first()?.key.aggregate_type_id;
    writes
        .iter()
        .all(|w| w.key.aggregate_type_id == first)
        .then_some(first)
}

fn request_bytes(writes: &[AggregateWrite]) -> usize {
    writes
        .iter()
        .map(|w| {
            AGGREGATE_OVERHEAD_BYTES
                + w.events
                    .iter()
                    .map(|e| e.payload.len() + EVENT_OVERHEAD_BYTES)
                    .sum::<usize>()
        })
        .sum()
}

#[async_trait]
impl EventLog for CombiningLog {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        if !self.is_combining() {
            self.shared.observe(1, writes.len());
            return self.shared.inner.write(client_id, writes).await;
        }
        let (reply, answer) = oneshot::channel();
        self.shared.queue.lock().push_back(Pending {
            client_id,
            aggregate_type: aggregate_type(&writes),
            bytes: request_bytes(&writes),
            writes,
            reply,
        });
        self.shared.wake();
        answer.await.unwrap_or_else(|_| {
            // Only a sender task that died (a panic, or the runtime shutting down) drops a
            // reply unanswered, possibly after sending.
            Err(StoreError::OutcomeUnknown {
                reason: "the sender of a combined write stopped".into(),
            })
        })
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.shared.inner.read(key, filter).await
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.shared.inner.details(key).await
    }

    /// Never combined: the probe must be refused alone, and its refusal is its answer.
    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        self.shared.inner.leader_tip(client_id, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.shared.inner.trim_start(key, keep_from_version).await
    }

    async fn ping(&self) -> StoreResult<()> {
        self.shared.inner.ping().await
    }

    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        self.shared.inner.watch(filter).await
    }
}
