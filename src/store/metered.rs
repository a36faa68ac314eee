//! A decorator that counts and times every store request, by operation and result.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use super::health::StoreHealth;
use super::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    StoreError, StoreResult, WatchFeed, WatchFilter,
};
use crate::metrics::Metrics;

pub struct MeteredLog {
    inner: Arc<dyn EventLog>,
    metrics: Arc<Metrics>,
    /// Told what every call found, so the replica knows whether its store answers.
    health: Arc<StoreHealth>,
}

impl MeteredLog {
    pub fn new(inner: Arc<dyn EventLog>, metrics: Arc<Metrics>, health: Arc<StoreHealth>) -> Self {
        Self {
            inner,
            metrics,
            health,
        }
    }

    fn observe<T>(&self, op: &str, started: Instant, result: &StoreResult<T>) {
        self.health.observe(result);
        self.metrics
            .store_duration
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .store_requests
            .with_label_values(&[op, result_label(result)])
            .inc();
    }
}

/// A bounded label for a store result.
pub(super) fn result_label<T>(result: &StoreResult<T>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(StoreError::Conflict { .. }) => "conflict",
        Err(StoreError::IdempotencyViolation { .. }) => "idempotency_violation",
        Err(StoreError::InflightDuplicate) => "inflight_duplicate",
        Err(StoreError::OutcomeUnknown { .. }) => "outcome_unknown",
        Err(StoreError::NotApplied { .. }) => "not_applied",
        Err(StoreError::AggregateNotFound) => "not_found",
        Err(StoreError::Trimmed { .. }) => "trimmed",
        Err(StoreError::CrossShard) => "cross_shard",
        Err(StoreError::Other { .. }) => "other",
    }
}

#[async_trait]
impl EventLog for MeteredLog {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        let t = Instant::now();
        let r = self.inner.write(client_id, writes).await;
        self.observe("write", t, &r);
        r
    }

    async fn write_combined(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        let t = Instant::now();
        let r = self.inner.write_combined(client_id, writes).await;
        self.observe("write", t, &r);
        r
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let t = Instant::now();
        let r = self.inner.read(key, filter).await;
        self.observe("read", t, &r);
        r
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let t = Instant::now();
        let r = self.inner.details(key).await;
        self.observe("details", t, &r);
        r
    }

    /// Counted as its own operation: its refusal is the answer, not a write's conflict.
    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        let t = Instant::now();
        let r = self.inner.leader_tip(client_id, key).await;
        self.observe("leader_tip", t, &r);
        r
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        let t = Instant::now();
        let r = self.inner.trim_start(key, keep_from_version).await;
        self.observe("trim_start", t, &r);
        r
    }

    async fn ping(&self) -> StoreResult<()> {
        let t = Instant::now();
        let r = self.inner.ping().await;
        self.observe("ping", t, &r);
        r
    }

    /// Opening a watch is counted and timed; the notifications it then yields are not
    /// requests.
    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        let t = Instant::now();
        let r = self.inner.watch(filter).await;
        self.observe("watch", t, &r);
        r
    }
}
