//! Seeded, deterministic fault injection around any [`EventLog`].
//!
//! [`FaultyLog`] draws one number from a ChaCha8 generator per write and one per read, so the
//! same seed and the same sequence of calls give the same faults. Tests that need a precise
//! fault instead queue one with [`FaultyLog::fail_next_write`], [`FaultyLog::hold_next_write`]
//! or [`FaultyLog::lag_next_read`]; a queued fault replaces the drawn one (the draw still
//! happens, so queued faults never shift the seeded sequence).
//!
//! Write faults, as the caller sees them:
//! - lost request: `OutcomeUnknown`, nothing applied;
//! - refused: `NotApplied`, nothing applied;
//! - lost ack: the write reaches the inner log, then `OutcomeUnknown` whatever it answered;
//! - in flight: the write is held before it reaches the inner log, then applied, and the
//!   caller gets the inner log's answer. While it is held, an enforced write from the same
//!   client id to the same aggregate whose sequences overlap the held write's range gets
//!   `InflightDuplicate` (the server's 2013). A held write whose caller drops the future is
//!   never applied.
//!
//! Read lag: a read hides the aggregate's newest N batches (the tip comes from the inner
//! log's `details`); `details` itself is never lagged.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::oneshot;

use super::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    StoreError, StoreResult, WatchFeed, WatchFilter,
};

/// Batches a lagging read hides unless the spec says otherwise.
pub const DEFAULT_READ_LAG_BATCHES: u64 = 1;
/// How long a probability-driven in-flight write is held unless the spec says otherwise.
pub const DEFAULT_INFLIGHT_HOLD: Duration = Duration::from_millis(50);

/// Probabilities and parameters of the injected faults.
///
/// The four write probabilities partition one draw, so their sum must not exceed 1.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultConfig {
    /// Apply the write, then report `OutcomeUnknown`.
    pub lost_ack: f64,
    /// Report `OutcomeUnknown` without applying.
    pub lost_request: f64,
    /// Report `NotApplied` without applying.
    pub refused: f64,
    /// Hold the write in flight for `inflight_hold`, then apply it.
    pub inflight: f64,
    /// Hide the newest `read_lag_batches` batches from a read.
    pub read_lag: f64,
    pub read_lag_batches: u64,
    /// Seed of the fault generator.
    pub seed: u64,
    pub inflight_hold: Duration,
}

impl Default for FaultConfig {
    /// No faults.
    fn default() -> Self {
        Self {
            lost_ack: 0.0,
            lost_request: 0.0,
            refused: 0.0,
            inflight: 0.0,
            read_lag: 0.0,
            read_lag_batches: DEFAULT_READ_LAG_BATCHES,
            seed: 0,
            inflight_hold: DEFAULT_INFLIGHT_HOLD,
        }
    }
}

/// Why a fault spec was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid fault spec: {0}")]
pub struct FaultSpecError(String);

impl FaultConfig {
    /// Parses the CLI form, e.g. `lost-ack=0.1,lost-request=0.05,refused=0.05,inflight=0.1,
    /// read-lag=0.2,seed=42`. Also accepts `read-lag-batches=N` and `inflight-hold-ms=N`.
    /// Unset keys keep their defaults; an empty spec means no faults.
    pub fn parse(spec: &str) -> Result<Self, FaultSpecError> {
        let mut config = Self::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| FaultSpecError(format!("`{item}` is not key=value")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "lost-ack" => config.lost_ack = probability(key, value)?,
                "lost-request" => config.lost_request = probability(key, value)?,
                "refused" => config.refused = probability(key, value)?,
                "inflight" => config.inflight = probability(key, value)?,
                "read-lag" => config.read_lag = probability(key, value)?,
                "read-lag-batches" => config.read_lag_batches = integer(key, value)?,
                "seed" => config.seed = integer(key, value)?,
                "inflight-hold-ms" => {
                    config.inflight_hold = Duration::from_millis(integer(key, value)?)
                }
                _ => {
                    return Err(FaultSpecError(format!(
                        "unknown key `{key}` (expected lost-ack, lost-request, refused, \
                         inflight, read-lag, read-lag-batches, seed, inflight-hold-ms)"
                    )));
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every probability is in [0, 1] and the write probabilities sum to at most 1.
    pub fn validate(&self) -> Result<(), FaultSpecError> {
        let named = [
            ("lost-ack", self.lost_ack),
            ("lost-request", self.lost_request),
            ("refused", self.refused),
            ("inflight", self.inflight),
            ("read-lag", self.read_lag),
        ];
        for (key, p) in named {
            if !(0.0..=1.0).contains(&p) {
                return Err(FaultSpecError(format!(
                    "{key}={p} is not a probability in [0, 1]"
                )));
            }
        }
        let sum = self.lost_ack + self.lost_request + self.refused + self.inflight;
        if sum > 1.0 + f64::EPSILON {
            return Err(FaultSpecError(format!(
                "write fault probabilities sum to {sum}, more than 1"
            )));
        }
        Ok(())
    }
}

impl FromStr for FaultConfig {
    type Err = FaultSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn probability(key: &str, value: &str) -> Result<f64, FaultSpecError> {
    let p: f64 = value
        .parse()
        .map_err(|_| FaultSpecError(format!("{key}={value} is not a number")))?;
    if !(0.0..=1.0).contains(&p) {
        return Err(FaultSpecError(format!(
            "{key}={value} is not a probability in [0, 1]"
        )));
    }
    Ok(p)
}

fn integer(key: &str, value: &str) -> Result<u64, FaultSpecError> {
    value
        .parse()
        .map_err(|_| FaultSpecError(format!("{key}={value} is not a non-negative integer")))
}

/// A write fault that can be queued for the next write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    LostAck,
    LostRequest,
    Refused,
    /// Hold the write for the configured `inflight_hold`, then apply it.
    Inflight,
}

/// How many faults of each kind were injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub lost_ack: u64,
    pub lost_request: u64,
    pub refused: u64,
    /// Writes held in flight (drawn, queued or explicit holds).
    pub inflight: u64,
    /// Writes rejected with `InflightDuplicate` because a held write overlapped them.
    pub inflight_duplicate: u64,
    /// Reads that hid batches (or would have, on a short aggregate).
    pub read_lag: u64,
}

#[derive(Default)]
struct Counters {
    lost_ack: AtomicU64,
    lost_request: AtomicU64,
    refused: AtomicU64,
    inflight: AtomicU64,
    inflight_duplicate: AtomicU64,
    read_lag: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Controls one write held by [`FaultyLog::hold_next_write`]. Dropping it releases the write.
pub struct HoldHandle {
    release: Option<oneshot::Sender<()>>,
    held: Option<oneshot::Receiver<()>>,
}

impl HoldHandle {
    /// Waits until a write is actually held. Returns false if the log was dropped first.
    pub async fn held(&mut self) -> bool {
        match self.held.take() {
            Some(rx) => rx.await.is_ok(),
            None => true,
        }
    }

    /// Lets the held write (or the next one, if none is held yet) go through.
    pub fn release(mut self) {
        if let Some(tx) = self.release.take() {
            let _ = tx.send(());
        }
    }
}

/// The far side of a [`HoldHandle`].
struct HoldSlot {
    release: oneshot::Receiver<()>,
    held: oneshot::Sender<()>,
}

enum Queued {
    Fault(Fault),
    Hold(HoldSlot),
}

/// What was decided for one write.
enum WritePlan {
    Pass,
    LostAck,
    LostRequest,
    Refused,
    HoldFor(Duration),
    HoldUntil(HoldSlot),
}

/// The sequence range one held write occupies on one aggregate.
#[derive(Clone, Copy, PartialEq, Eq)]
struct InflightRange {
    id: u64,
    key: AggregateKey,
    client_id: ClientId,
    low: u64,
    high: u64,
}

/// Removes a held write's ranges when it completes or its caller gives up.
struct InflightGuard<'a> {
    table: &'a Mutex<Vec<InflightRange>>,
    id: u64,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.table.lock().retain(|r| r.id != self.id);
    }
}

/// An [`EventLog`] decorator injecting seeded faults. See the module docs for each fault.
pub struct FaultyLog<L: ?Sized = dyn EventLog> {
    inner: Arc<L>,
    config: FaultConfig,
    rng: Mutex<ChaCha8Rng>,
    queued_writes: Mutex<VecDeque<Queued>>,
    queued_read_lags: Mutex<VecDeque<u64>>,
    inflight: Mutex<Vec<InflightRange>>,
    next_inflight_id: AtomicU64,
    counters: Counters,
}

impl<L: EventLog + ?Sized> FaultyLog<L> {
    /// Wraps `inner`. The config is used as given; [`FaultConfig::parse`] validates specs.
    pub fn new(inner: Arc<L>, config: FaultConfig) -> Self {
        Self {
            inner,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(config.seed)),
            config,
            queued_writes: Mutex::new(VecDeque::new()),
            queued_read_lags: Mutex::new(VecDeque::new()),
            inflight: Mutex::new(Vec::new()),
            next_inflight_id: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    /// The decorated log.
    pub fn inner(&self) -> &Arc<L> {
        &self.inner
    }

    /// The configuration in force.
    pub fn config(&self) -> &FaultConfig {
        &self.config
    }

    /// Queues `fault` for the next write that has no earlier queued fault.
    pub fn fail_next_write(&self, fault: Fault) {
        self.queued_writes.lock().push_back(Queued::Fault(fault));
    }

    /// Queues an in-flight hold for the next write, held until the handle releases it.
    pub fn hold_next_write(&self) -> HoldHandle {
        let (release_tx, release_rx) = oneshot::channel();
        let (held_tx, held_rx) = oneshot::channel();
        self.queued_writes.lock().push_back(Queued::Hold(HoldSlot {
            release: release_rx,
            held: held_tx,
        }));
        HoldHandle {
            release: Some(release_tx),
            held: Some(held_rx),
        }
    }

    /// Makes the next read hide the newest `batches` batches.
    pub fn lag_next_read(&self, batches: u64) {
        self.queued_read_lags.lock().push_back(batches);
    }

    /// Faults injected so far, per kind.
    pub fn counts(&self) -> FaultCounts {
        let c = &self.counters;
        FaultCounts {
            lost_ack: c.lost_ack.load(Ordering::Relaxed),
            lost_request: c.lost_request.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            inflight: c.inflight.load(Ordering::Relaxed),
            inflight_duplicate: c.inflight_duplicate.load(Ordering::Relaxed),
            read_lag: c.read_lag.load(Ordering::Relaxed),
        }
    }

    fn plan_write(&self) -> WritePlan {
        let draw: f64 = self.rng.lock().r#gen();
        if let Some(queued) = self.queued_writes.lock().pop_front() {
            return match queued {
                Queued::Fault(Fault::LostAck) => WritePlan::LostAck,
                Queued::Fault(Fault::LostRequest) => WritePlan::LostRequest,
                Queued::Fault(Fault::Refused) => WritePlan::Refused,
                Queued::Fault(Fault::Inflight) => WritePlan::HoldFor(self.config.inflight_hold),
                Queued::Hold(slot) => WritePlan::HoldUntil(slot),
            };
        }
        let c = &self.config;
        let mut edge = c.lost_ack;
        if draw < edge {
            return WritePlan::LostAck;
        }
        edge += c.lost_request;
        if draw < edge {
            return WritePlan::LostRequest;
        }
        edge += c.refused;
        if draw < edge {
            return WritePlan::Refused;
        }
        edge += c.inflight;
        if draw < edge {
            return WritePlan::HoldFor(c.inflight_hold);
        }
        WritePlan::Pass
    }

    /// The lag to apply to the next read, if any.
    fn plan_read(&self) -> Option<u64> {
        let draw: f64 = self.rng.lock().r#gen();
        if let Some(batches) = self.queued_read_lags.lock().pop_front() {
            return Some(batches);
        }
        (draw < self.config.read_lag).then_some(self.config.read_lag_batches)
    }

    /// Whether an enforced leg of `writes` overlaps a held write's range.
    fn overlaps_inflight(
        table: &[InflightRange],
        client_id: ClientId,
        writes: &[AggregateWrite],
    ) -> bool {
        writes
            .iter()
            .filter(|w| w.enforce_client_idempotency)
            .filter_map(|w| Some((w.key, w.lowest_client_seq()?, w.highest_client_seq()?)))
            .any(|(key, low, high)| {
                table.iter().any(|r| {
                    r.key == key && r.client_id == client_id && low <= r.high && r.low <= high
                })
            })
    }

    /// What the inner log would answer before it reached the in-flight sequence: a missing
    /// aggregate the write may not create (on any leg, guarded or not), else the first leg in
    /// request order whose version guard fails, as the 2003 it would answer; `None` when
    /// both checks pass or one cannot be made. The port's order, which Celeriant's adapter
    /// restores for a server that checks one leg at a time (`check_order`).
    async fn earlier_check_fails(&self, writes: &[AggregateWrite]) -> Option<StoreError> {
        let mut current = Vec::with_capacity(writes.len());
        for w in writes {
            if w.allow_create && w.expected_version.is_none() {
                // Neither check can fail on this leg.
                current.push(None);
                continue;
            }
            match self.inner.details(w.key).await {
                Ok(d) => current.push(Some(d.max_version)),
                Err(StoreError::AggregateNotFound) if !w.allow_create => {
                    return Some(StoreError::AggregateNotFound);
                }
                Err(StoreError::AggregateNotFound) => current.push(Some(0)),
                Err(_) => return None,
            }
        }
        writes.iter().zip(current).find_map(|(w, current)| {
            let (expected, current) = (w.expected_version?, current?);
            (current != expected).then_some(StoreError::Conflict { expected, current })
        })
    }

    /// The server side: the guard and in-flight checks, the optional hold, then the inner
    /// log.
    async fn serve(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
        hold: Option<Hold>,
    ) -> StoreResult<Vec<u64>> {
        if Self::overlaps_inflight(&self.inflight.lock(), client_id, &writes) {
            // Existence and the version guard come before idempotency: a write that fails
            // either is answered so even while its sequence is in flight (the injector once
            // answered 2013 first, a kinder order than the real store's).
            if let Some(earlier) = self.earlier_check_fails(&writes).await {
                return Err(earlier);
            }
            bump(&self.counters.inflight_duplicate);
            return Err(StoreError::InflightDuplicate);
        }
        let guard = {
            let mut table = self.inflight.lock();
            // A held write registered since the check above: refused as one would be.
            if Self::overlaps_inflight(&table, client_id, &writes) {
                bump(&self.counters.inflight_duplicate);
                return Err(StoreError::InflightDuplicate);
            }
            match hold {
                None => None,
                Some(_) => {
                    let id = self.next_inflight_id.fetch_add(1, Ordering::Relaxed);
                    table.extend(writes.iter().filter_map(|w| {
                        Some(InflightRange {
                            id,
                            key: w.key,
                            client_id,
                            low: w.lowest_client_seq()?,
                            high: w.highest_client_seq()?,
                        })
                    }));
                    Some(InflightGuard {
                        table: &self.inflight,
                        id,
                    })
                }
            }
        };
        match hold {
            None => {}
            Some(Hold::For(duration)) => {
                bump(&self.counters.inflight);
                tokio::time::sleep(duration).await;
            }
            Some(Hold::Until(slot)) => {
                bump(&self.counters.inflight);
                let _ = slot.held.send(());
                // A dropped handle releases the write too.
                let _ = slot.release.await;
            }
        }
        let result = self.inner.write(client_id, writes).await;
        drop(guard);
        result
    }
}

enum Hold {
    For(Duration),
    Until(HoldSlot),
}

#[async_trait]
impl<L: EventLog + ?Sized> EventLog for FaultyLog<L> {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        match self.plan_write() {
            WritePlan::LostRequest => {
                bump(&self.counters.lost_request);
                Err(StoreError::OutcomeUnknown {
                    reason: "injected fault: request lost before the server".into(),
                })
            }
            WritePlan::Refused => {
                bump(&self.counters.refused);
                Err(StoreError::shed("injected fault: refused before sending"))
            }
            WritePlan::LostAck => {
                bump(&self.counters.lost_ack);
                let _ = self.serve(client_id, writes, None).await;
                Err(StoreError::OutcomeUnknown {
                    reason: "injected fault: reply lost after the server applied it".into(),
                })
            }
            WritePlan::Pass => self.serve(client_id, writes, None).await,
            WritePlan::HoldFor(d) => self.serve(client_id, writes, Some(Hold::For(d))).await,
            WritePlan::HoldUntil(slot) => {
                self.serve(client_id, writes, Some(Hold::Until(slot))).await
            }
        }
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let Some(lag) = self.plan_read() else {
            return self.inner.read(key, filter).await;
        };
        bump(&self.counters.read_lag);
        let tip = self.inner.details(key).await?.max_version;
        let visible_tip = tip.saturating_sub(lag);
        let mut lagged = filter.clone();
        lagged.to_version = Some(
            filter
                .to_version
                .map_or(visible_tip, |t| t.min(visible_tip)),
        );
        let mut page = self.inner.read(key, &lagged).await?;
        // A lagging replica knows nothing past its tip, so it has no next page there.
        if page.next_version.is_some_and(|v| v > visible_tip) {
            page.next_version = None;
        }
        Ok(page)
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }

    async fn ping(&self) -> StoreResult<()> {
        self.inner.ping().await
    }

    /// Passed through: the faults are the write path's and reads' (a watcher still sees a
    /// lagging read after a notification, and must retry it).
    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        self.inner.watch(filter).await
    }
}

impl<L: EventLog + ?Sized> fmt::Debug for FaultyLog<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyLog")
            .field("config", &self.config)
            .field("counts", &self.counts())
            .finish_non_exhaustive()
    }
}
