//! The measured phase: `--connections` workers pulling numbered tickets, closed loop or paced
//! to an open-loop schedule, each with its own counters and a share of the latency histograms.
//! With `--on-503` a worker keeps re-sending a refused request (same key) at once or after
//! its Retry-After, as overloaded services' clients do.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use crate::LoadError;
use crate::cli::{Config, On503, Scenario};
use crate::conn::WorkerConn;
use crate::http::{Answer, Outcome};
use crate::ledger::KeyRecord;
use crate::op::{Op, send_op_on};
use crate::rng::Rng;
use crate::workload::Workload;

mod batch;
use batch::BatchSends;

/// Highest latency the histogram tracks, in microseconds; larger values are clamped.
pub const MAX_TRACKED_LATENCY_US: u64 = 3_600_000_000;
/// Significant decimal digits kept by the histogram.
pub const HISTOGRAM_SIGFIG: u8 = 3;
/// Most latency histograms kept (workers share them round-robin, bounding memory).
pub const MAX_HISTOGRAM_SHARDS: usize = 16;
/// Transport error messages kept as samples for the report.
pub const MAX_ERROR_SAMPLES: usize = 5;
/// Chance that a retry goes to another target when there are several.
pub const RETRY_ELSEWHERE_SHARE: f64 = 0.5;
/// Wait under `--on-503 retry-after` when a 503 names no Retry-After.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Longest Retry-After honoured under `--on-503 retry-after`.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);
/// The status the `--on-503` policies re-send on: the server refusing under load.
pub const REFUSED: u16 = 503;

/// Latency histograms, in microseconds, kept per shard and merged at the end.
#[derive(Debug)]
pub struct Latencies {
    /// Every answered request, from its own send (open loop: from its intended send).
    pub all: Histogram<u64>,
    /// Requests answered 2xx ("admitted"), from their own send.
    pub admitted: Histogram<u64>,
    /// Operations that ended 2xx, from their first send to that answer: waits and re-sends
    /// after 503s included.
    pub settled: Histogram<u64>,
    /// 2xx answers that created their account (first-touch scenario).
    pub first_touch: Histogram<u64>,
    /// 2xx answers on accounts that already existed (first-touch scenario).
    pub existing: Histogram<u64>,
}

impl Latencies {
    fn new() -> Result<Self, LoadError> {
        Ok(Latencies {
            all: histogram()?,
            admitted: histogram()?,
            settled: histogram()?,
            first_touch: histogram()?,
            existing: histogram()?,
        })
    }

    fn add(&mut self, other: &Latencies) {
        // All histograms share the bounds, so adding cannot fail.
        let _ = self.all.add(&other.all);
        let _ = self.admitted.add(&other.admitted);
        let _ = self.settled.add(&other.settled);
        let _ = self.first_touch.add(&other.first_touch);
        let _ = self.existing.add(&other.existing);
    }
}

/// Microseconds since `since`, at least 1 (the histograms' lowest value).
fn micros_since(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// Counters and latencies of the measured phase.
#[derive(Debug)]
pub struct Stats {
    pub latency: Latencies,
    pub status_counts: BTreeMap<u16, u64>,
    pub replays: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub error_samples: Vec<String>,
    /// Operations issued (one per ticket).
    pub operations: u64,
    /// Re-sends with the same key after an answer (`--retry-ratio`).
    pub retries: u64,
    /// Re-sends with the same key after a 503 (`--on-503`).
    pub resends: u64,
    /// Re-sends with the same key to another target after no answer (`--failover`).
    pub failovers: u64,
    /// Every request sent: operations (or, with `--batch`, batches) plus retries, resends
    /// and failovers.
    pub requests: u64,
    /// `--batch`: batch requests issued (first sends; their re-sends are counted apart).
    pub batches: u64,
    /// `--batch`: items carried, every send counted (a re-sent item again).
    pub items_sent: u64,
    /// `--batch`: each item's status per send that carried it: its own result's, or the
    /// whole answer's when the batch got no results ([`NO_ANSWER`](crate::ledger::NO_ANSWER)
    /// when none came or they could not be read).
    pub item_status_counts: BTreeMap<u16, u64>,
    /// `--batch`: item results flagged as replays.
    pub item_replays: u64,
    /// Connections opened by the workers.
    pub connects: u64,
    pub records: Vec<KeyRecord>,
    pub elapsed: Duration,
}

fn histogram() -> Result<Histogram<u64>, LoadError> {
    Histogram::new_with_bounds(1, MAX_TRACKED_LATENCY_US, HISTOGRAM_SIGFIG)
        .map_err(|e| LoadError::Run(format!("histogram: {e}")))
}

impl Stats {
    fn new() -> Result<Self, LoadError> {
        Ok(Stats {
            latency: Latencies::new()?,
            status_counts: BTreeMap::new(),
            replays: 0,
            error_kinds: BTreeMap::new(),
            error_samples: Vec::new(),
            operations: 0,
            retries: 0,
            resends: 0,
            failovers: 0,
            requests: 0,
            batches: 0,
            items_sent: 0,
            item_status_counts: BTreeMap::new(),
            item_replays: 0,
            connects: 0,
            records: Vec::new(),
            elapsed: Duration::ZERO,
        })
    }

    /// Total transport errors.
    pub fn errors(&self) -> u64 {
        self.error_kinds.values().sum()
    }

    /// Counts one request sent at `since`; `first_touch` says which first-touch histogram a
    /// 2xx belongs in (`None` outside that scenario).
    fn note(
        &mut self,
        latency: &Mutex<Latencies>,
        since: Instant,
        outcome: &Outcome,
        first_touch: Option<bool>,
    ) {
        self.requests += 1;
        match outcome {
            Ok(answer) => {
                let micros = micros_since(since);
                let mut h = latency.lock();
                h.all.saturating_record(micros);
                if is_success(answer.status) {
                    h.admitted.saturating_record(micros);
                    match first_touch {
                        Some(true) => h.first_touch.saturating_record(micros),
                        Some(false) => h.existing.saturating_record(micros),
                        None => {}
                    }
                }
                drop(h);
                *self.status_counts.entry(answer.status).or_default() += 1;
                self.replays += u64::from(answer.replayed);
            }
            Err(e) => {
                *self.error_kinds.entry(e.kind.to_string()).or_default() += 1;
                if self.error_samples.len() < MAX_ERROR_SAMPLES {
                    self.error_samples.push(format!("{}: {}", e.kind, e.detail));
                }
            }
        }
    }

    /// 2xx answers: of the items when `items`, else of the requests.
    pub fn successes(&self, items: bool) -> u64 {
        let counts = if items {
            &self.item_status_counts
        } else {
            &self.status_counts
        };
        counts
            .iter()
            .filter(|(s, _)| is_success(**s))
            .map(|(_, n)| n)
            .sum()
    }

    /// Counts one item of a batch send, with the status it got.
    fn note_item(&mut self, status: u16, replayed: bool) {
        self.items_sent += 1;
        *self.item_status_counts.entry(status).or_default() += 1;
        self.item_replays += u64::from(replayed);
    }

    fn merge(&mut self, other: Stats) {
        for (status, n) in other.status_counts {
            *self.status_counts.entry(status).or_default() += n;
        }
        for (kind, n) in other.error_kinds {
            *self.error_kinds.entry(kind).or_default() += n;
        }
        let room = MAX_ERROR_SAMPLES.saturating_sub(self.error_samples.len());
        self.error_samples
            .extend(other.error_samples.into_iter().take(room));
        self.replays += other.replays;
        self.operations += other.operations;
        self.retries += other.retries;
        self.resends += other.resends;
        self.failovers += other.failovers;
        self.connects += other.connects;
        self.requests += other.requests;
        self.batches += other.batches;
        self.items_sent += other.items_sent;
        for (status, n) in other.item_status_counts {
            *self.item_status_counts.entry(status).or_default() += n;
        }
        self.item_replays += other.item_replays;
        self.records.extend(other.records);
    }
}

struct Shared {
    config: Config,
    workload: Workload,
    next_ticket: AtomicU64,
    histograms: Vec<Mutex<Latencies>>,
    start: Instant,
    deadline: Instant,
}

/// Runs the measured phase to its request count or deadline and merges the workers' stats.
pub async fn drive(config: &Config, workload: Workload) -> Result<Stats, LoadError> {
    let shards = config.connections.min(MAX_HISTOGRAM_SHARDS);
    let histograms = (0..shards)
        .map(|_| Latencies::new().map(Mutex::new))
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let shared = Arc::new(Shared {
        config: config.clone(),
        workload,
        next_ticket: AtomicU64::new(0),
        histograms,
        start,
        deadline: start + config.duration,
    });
    let mut tasks = JoinSet::new();
    for index in 0..config.connections {
        tasks.spawn(worker(shared.clone(), index, Stats::new()?));
    }
    let mut total = Stats::new()?;
    while let Some(joined) = tasks.join_next().await {
        let stats = joined.map_err(|e| LoadError::Run(format!("worker failed: {e}")))?;
        total.merge(stats);
    }
    total.elapsed = start.elapsed();
    for shard in &shared.histograms {
        total.latency.add(&shard.lock());
    }
    Ok(total)
}

/// The intended send time of `ticket` under an open-loop `rate`, if it fits the schedule.
fn scheduled(start: Instant, rate: f64, ticket: u64) -> Option<Instant> {
    let offset = Duration::try_from_secs_f64(ticket as f64 / rate).ok()?;
    start.checked_add(offset)
}

/// One worker: takes tickets and runs their operations until the run's count or end.
async fn worker(shared: Arc<Shared>, index: usize, mut stats: Stats) -> Stats {
    let config = &shared.config;
    let latency = &shared.histograms[index % shared.histograms.len()];
    // One connection per target, opened on first use.
    let mut conns: Vec<WorkerConn> = config
        .targets
        .iter()
        .cloned()
        .map(WorkerConn::new)
        .collect();
    loop {
        // Every target refused a connection just now: wait for the first to be tried again,
        // rather than spin on refusals.
        if let Some(until) = all_down_until(&conns) {
            if until >= shared.deadline {
                break;
            }
            tokio::time::sleep_until(until).await;
        }
        // A ticket is one request: one operation, or with `--batch` the next N of them.
        let per_ticket = config.batch.unwrap_or(1) as u64;
        let ticket = shared.next_ticket.fetch_add(1, Ordering::Relaxed);
        let first_op = ticket.saturating_mul(per_ticket);
        if config.max_ops.is_some_and(|max| first_op >= max) || Instant::now() >= shared.deadline {
            break;
        }
        let Some(intended) = intended_send(&shared, first_op).await else {
            break;
        };
        let in_time = if config.batch.is_some() {
            let end = first_op.saturating_add(per_ticket);
            let ops = first_op..config.max_ops.map_or(end, |max| end.min(max));
            let sends = BatchSends::draw(&shared, &mut conns, latency, ops);
            stats.operations += sends.len() as u64;
            stats.batches += 1;
            sends.run(&mut stats, intended).await
        } else {
            let sends = OpSends::draw(&shared, &mut conns, latency, ticket);
            stats.operations += 1;
            sends.run(&mut stats, intended).await
        };
        if !in_time {
            break;
        }
    }
    stats.connects = conns.iter().map(|c| c.connects).sum();
    stats
}

/// When the request whose first operation is `ticket` is to be sent: now in a closed loop;
/// in an open loop that operation's slot in the schedule, waited for. Latency counts from then, so a stalled server is charged for the
/// requests it delayed (no coordinated omission). None when the slot is past the run's end.
async fn intended_send(shared: &Shared, ticket: u64) -> Option<Instant> {
    let Some(rate) = shared.config.rate else {
        return Some(Instant::now());
    };
    let at = scheduled(shared.start, rate, ticket).filter(|&at| at < shared.deadline)?;
    tokio::time::sleep_until(at).await;
    Some(at)
}

/// `preferred`, or the next target after it that has not just refused a connection (itself
/// when every target has).
fn next_up(conns: &[WorkerConn], preferred: usize) -> usize {
    let now = Instant::now();
    (0..conns.len())
        .map(|i| (preferred + i) % conns.len())
        .find(|&i| conns[i].down_until(now).is_none())
        .unwrap_or(preferred)
}

/// When every target has just refused a connection: the earliest it will be tried again.
fn all_down_until(conns: &[WorkerConn]) -> Option<Instant> {
    let now = Instant::now();
    let mut earliest: Option<Instant> = None;
    for conn in conns {
        let until = conn.down_until(now)?;
        earliest = Some(earliest.map_or(until, |e| e.min(until)));
    }
    earliest
}

/// The sends of one operation, each counted in the stats and noted in the key's record.
struct OpSends<'a> {
    shared: &'a Shared,
    /// The ticket's own stream: the operation, then whether and where it is retried.
    rng: Rng,
    /// The target the ticket goes to first.
    first: usize,
    /// The worker's connections, one per target.
    conns: &'a mut [WorkerConn],
    latency: &'a Mutex<Latencies>,
    op: Op,
    key: Option<Uuid>,
    /// Which first-touch histogram a 2xx belongs in (`None` outside that scenario).
    first_touch: Option<bool>,
    /// What was seen for the key (writes only).
    record: Option<KeyRecord>,
}

impl<'a> OpSends<'a> {
    /// Draws `ticket`'s operation, and a key for it when it writes.
    fn draw(
        shared: &'a Shared,
        conns: &'a mut [WorkerConn],
        latency: &'a Mutex<Latencies>,
        ticket: u64,
    ) -> Self {
        let config = &shared.config;
        let mut rng = Rng::derive(config.seed, ticket);
        let draw = shared.workload.next_draw(&mut rng);
        let first = next_up(conns, (ticket % config.targets.len() as u64) as usize);
        let key = draw.op.is_write().then(Uuid::new_v4);
        OpSends {
            shared,
            rng,
            first,
            conns,
            latency,
            op: draw.op,
            key,
            first_touch: (config.scenario == Scenario::FirstTouch).then_some(draw.first_touch),
            record: key.map(|key| KeyRecord::new(key, draw.op)),
        }
    }

    /// Sends the operation, then fails over, re-sends after 503s and retries as the options
    /// say; keeps the key's record. False when a re-send would start after the run's end:
    /// the worker is done, and the key is left unresolved (the audit allows it at most once).
    async fn run(mut self, stats: &mut Stats, intended: Instant) -> bool {
        let config = &self.shared.config;
        let outcome = self.send(stats, self.first, intended).await;
        let (at, outcome, in_time) = self.follow_up(stats, outcome).await;
        if outcome.as_ref().is_ok_and(|a| is_success(a.status)) {
            self.latency
                .lock()
                .settled
                .saturating_record(micros_since(intended));
        }
        if in_time && self.record.is_some() && self.rng.unit() < config.retry_ratio {
            self.retry(stats, at).await;
        }
        if let Some(record) = self.record {
            stats.records.push(record);
        }
        in_time
    }

    /// `--failover` after no answer, and `--on-503`'s re-sends to the target that last
    /// answered. Returns that target, the last outcome, and false when a re-send would start
    /// after the run's end.
    async fn follow_up(
        &mut self,
        stats: &mut Stats,
        mut outcome: Outcome,
    ) -> (usize, Outcome, bool) {
        let config = &self.shared.config;
        // The target that last answered, or was last tried: re-sends go there.
        let mut at = self.first;
        if config.failover {
            (at, outcome) = self.fail_over(stats, at, outcome).await;
        }
        let Some(policy) = config.on_503 else {
            return (at, outcome, true);
        };
        while let Ok(answer) = &outcome
            && answer.status == REFUSED
        {
            if !wait_before_resend(policy, answer, self.shared.deadline).await {
                return (at, outcome, false);
            }
            stats.resends += 1;
            outcome = self.send(stats, at, Instant::now()).await;
            if config.failover {
                (at, outcome) = self.fail_over(stats, at, outcome).await;
            }
        }
        (at, outcome, true)
    }

    /// `--retry-ratio`: the same key once more, to `at` or, with several targets, as often
    /// as not to another one.
    async fn retry(&mut self, stats: &mut Stats, at: usize) {
        let targets = self.conns.len();
        let again = if targets > 1 && self.rng.unit() < RETRY_ELSEWHERE_SHARE {
            let other = (at + 1 + self.rng.below(targets as u64 - 1) as usize) % targets;
            next_up(self.conns, other)
        } else {
            at
        };
        stats.retries += 1;
        // Counted and recorded by `send`; nothing more to do with this answer.
        let _ = self.send(stats, again, Instant::now()).await;
    }

    /// Sends the operation to target `target` once; latency counts from `since`.
    async fn send(&mut self, stats: &mut Stats, target: usize, since: Instant) -> Outcome {
        let timeout = self.shared.config.timeout;
        let conn = &mut self.conns[target];
        let outcome = send_op_on(conn, &self.op, self.key, timeout).await;
        stats.note(self.latency, since, &outcome, self.first_touch);
        if let Some(record) = &mut self.record {
            record.observe(&outcome);
        }
        outcome
    }

    /// `--failover`: while `outcome` is no answer, re-sends the same key to the next other
    /// target that is up, at most once per other target and never past the run's end.
    /// Returns the target last tried and its outcome.
    async fn fail_over(
        &mut self,
        stats: &mut Stats,
        mut at: usize,
        mut outcome: Outcome,
    ) -> (usize, Outcome) {
        let targets = self.conns.len();
        for _ in 1..targets {
            if outcome.is_ok() || Instant::now() >= self.shared.deadline {
                break;
            }
            let next = next_up(self.conns, (at + 1) % targets);
            if next == at {
                // Every other target refused a connection just now.
                break;
            }
            at = next;
            stats.failovers += 1;
            outcome = self.send(stats, at, Instant::now()).await;
        }
        (at, outcome)
    }
}

/// Waits as `policy` says before re-sending a request refused with `answer`. False when the
/// re-send would start at or after the end of the run.
async fn wait_before_resend(policy: On503, answer: &Answer, deadline: Instant) -> bool {
    let at = match policy {
        On503::Resend => Instant::now(),
        On503::RetryAfter => {
            let wait = answer
                .retry_after
                .unwrap_or(DEFAULT_RETRY_AFTER)
                .min(MAX_RETRY_AFTER);
            Instant::now() + wait
        }
    };
    if at >= deadline {
        return false;
    }
    tokio::time::sleep_until(at).await;
    true
}
