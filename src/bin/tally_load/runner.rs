//! The measured phase: `--connections` workers pulling numbered tickets, closed loop or paced
//! to an open-loop schedule, each with its own latency histogram and counters.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use super::LoadError;
use super::cli::Config;
use super::http::{Client, Outcome};
use super::ledger::KeyRecord;
use super::rng::Rng;
use super::workload::{Workload, send_op};

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

/// Counters and latencies of the measured phase.
#[derive(Debug)]
pub struct Stats {
    /// Latency of every answered request, in microseconds.
    pub latency: Histogram<u64>,
    pub status_counts: BTreeMap<u16, u64>,
    pub replays: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub error_samples: Vec<String>,
    /// Operations issued (one per ticket).
    pub operations: u64,
    /// Re-sends with the same key.
    pub retries: u64,
    /// Every request sent: operations plus retries.
    pub requests: u64,
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
            latency: histogram()?,
            status_counts: BTreeMap::new(),
            replays: 0,
            error_kinds: BTreeMap::new(),
            error_samples: Vec::new(),
            operations: 0,
            retries: 0,
            requests: 0,
            records: Vec::new(),
            elapsed: Duration::ZERO,
        })
    }

    /// Total transport errors.
    pub fn errors(&self) -> u64 {
        self.error_kinds.values().sum()
    }

    fn note(&mut self, latency: &Mutex<Histogram<u64>>, since: Instant, outcome: &Outcome) {
        self.requests += 1;
        match outcome {
            Ok(answer) => {
                let micros = since.elapsed().as_micros();
                let micros = u64::try_from(micros).unwrap_or(u64::MAX).max(1);
                latency.lock().saturating_record(micros);
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
        self.requests += other.requests;
        self.records.extend(other.records);
    }
}

struct Shared {
    config: Config,
    workload: Workload,
    client: Client,
    next_ticket: AtomicU64,
    histograms: Vec<Mutex<Histogram<u64>>>,
    start: Instant,
    deadline: Instant,
}

/// Runs the measured phase to its request count or deadline and merges the workers' stats.
pub async fn drive(
    config: &Config,
    workload: Workload,
    client: &Client,
) -> Result<Stats, LoadError> {
    let shards = config.connections.min(MAX_HISTOGRAM_SHARDS);
    let histograms = (0..shards)
        .map(|_| histogram().map(Mutex::new))
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let shared = Arc::new(Shared {
        config: config.clone(),
        workload,
        client: client.clone(),
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
        // All shards share the bounds, so adding cannot fail.
        let _ = total.latency.add(&*shard.lock());
    }
    Ok(total)
}

/// The intended send time of `ticket` under an open-loop `rate`, if it fits the schedule.
fn scheduled(start: Instant, rate: f64, ticket: u64) -> Option<Instant> {
    let offset = Duration::try_from_secs_f64(ticket as f64 / rate).ok()?;
    start.checked_add(offset)
}

async fn worker(shared: Arc<Shared>, index: usize, mut stats: Stats) -> Stats {
    let config = &shared.config;
    let targets = &config.targets;
    let latency = &shared.histograms[index % shared.histograms.len()];
    loop {
        let ticket = shared.next_ticket.fetch_add(1, Ordering::Relaxed);
        if config.max_ops.is_some_and(|max| ticket >= max) || Instant::now() >= shared.deadline {
            break;
        }
        // Open loop: latency counts from the intended send time, so a stalled server is
        // charged for the requests it delayed (no coordinated omission).
        let intended = match config.rate {
            Some(rate) => match scheduled(shared.start, rate, ticket) {
                Some(at) if at < shared.deadline => {
                    tokio::time::sleep_until(at).await;
                    at
                }
                _ => break,
            },
            None => Instant::now(),
        };
        let mut rng = Rng::derive(config.seed, ticket);
        let op = shared.workload.next_op(&mut rng);
        let first = (ticket % targets.len() as u64) as usize;
        let key = op.is_write().then(Uuid::new_v4);
        let outcome = send_op(&shared.client, &targets[first], &op, key, config.timeout).await;
        stats.operations += 1;
        stats.note(latency, intended, &outcome);
        let Some(key) = key else { continue };
        let mut record = KeyRecord::new(key, op);
        record.observe(&outcome);
        if rng.unit() < config.retry_ratio {
            let again = if targets.len() > 1 && rng.unit() < RETRY_ELSEWHERE_SHARE {
                (first + 1 + rng.below(targets.len() as u64 - 1) as usize) % targets.len()
            } else {
                first
            };
            let sent = Instant::now();
            let outcome = send_op(
                &shared.client,
                &targets[again],
                &op,
                Some(key),
                config.timeout,
            )
            .await;
            stats.retries += 1;
            stats.note(latency, sent, &outcome);
            record.observe(&outcome);
        }
        stats.records.push(record);
    }
    stats
}
