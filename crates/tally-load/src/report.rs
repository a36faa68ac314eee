//! The run report: serialisable as one JSON object, printable as text.

use std::collections::BTreeMap;
use std::fmt;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::audit::{ExactlyOnce, Verdict};
use crate::cli::{Config, On503, Scenario};
use crate::runner::Stats;
use crate::server::ServerUsage;
use crate::store_metrics::StoreRequests;

/// Most violations printed in the text report (the JSON report lists more).
pub const MAX_PRINTED_VIOLATIONS: usize = 10;

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
    /// Answers measured (transport errors are not).
    pub count: u64,
}

impl Latency {
    /// The percentiles of `h` (all zero when it is empty).
    pub fn of(h: &Histogram<u64>) -> Self {
        Latency {
            p50: h.value_at_quantile(0.50),
            p90: h.value_at_quantile(0.90),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
            count: h.len(),
        }
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  mean {:.0}",
            self.p50, self.p90, self.p99, self.p999, self.max, self.mean
        )
    }
}

/// `--batch`: what the batch requests carried and how their items were answered. The
/// report's request latencies are per batch request.
#[derive(Debug, Clone, Serialize)]
pub struct BatchSummary {
    /// Items per batch request asked for (the last one may carry fewer).
    pub size: usize,
    /// Batch requests issued (first sends).
    pub batches: u64,
    /// Items carried by every send, re-sends included.
    pub items_sent: u64,
    /// Item results 2xx per second of the measured phase.
    pub items_per_sec: f64,
    /// Each item's status per send that carried it (0: no answer, or one that could not be
    /// matched to the items).
    pub item_status_counts: BTreeMap<u16, u64>,
    pub item_replays: u64,
}

/// The setup phase in brief.
#[derive(Debug, Clone, Serialize)]
pub struct SetupSummary {
    pub accounts: usize,
    pub requests: u64,
    pub elapsed_secs: f64,
}

/// What the measured phase cost, each part when it could be measured.
#[derive(Debug, Clone)]
pub struct Usage {
    /// The server's memory and CPU (`--server-pid`).
    pub server: Option<ServerUsage>,
    /// CPU seconds this generator used (Linux).
    pub client_cpu_secs: Option<f64>,
    /// The store requests of the measured phase (`--metrics`), or why they could not be
    /// read at its end.
    pub store: Option<Result<StoreRequests, String>>,
}

/// Everything one run measured and concluded.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: Scenario,
    /// `closed-loop` or `open-loop`.
    pub mode: &'static str,
    pub seed: u64,
    pub targets: Vec<String>,
    pub connections: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_rate: Option<f64>,
    pub elapsed_secs: f64,
    pub operations: u64,
    pub retries: u64,
    /// Connections the workers opened in the measured phase (one each per target, plus one
    /// for every connection the server closed or a transport error ended).
    pub connects: u64,
    /// The `--on-503` policy, when one was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_503: Option<On503>,
    /// Re-sends of requests answered 503, under `--on-503`.
    pub resends: u64,
    /// Re-sends to another target after no answer, under `--failover`.
    pub failovers: u64,
    pub requests: u64,
    /// Requests (answered or not) per second of the measured phase.
    pub throughput: f64,
    /// 2xx answers per second of the measured phase.
    pub goodput: f64,
    /// Every other answer per second of the measured phase, by status.
    pub refusals_per_sec: BTreeMap<u16, f64>,
    /// Every answered request, from its own send (open loop: from its intended send).
    pub latency_us: Latency,
    /// Requests answered 2xx, from their own send.
    pub admitted_latency_us: Latency,
    /// Operations that ended 2xx, from their first send: waits and re-sends included.
    pub settled_latency_us: Latency,
    /// First-touch scenario: 2xx answers that created their account.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_touch_latency_us: Option<Latency>,
    /// First-touch scenario: 2xx answers on accounts that already existed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub existing_account_latency_us: Option<Latency>,
    /// `--batch`: the items, their answers and their rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSummary>,
    /// The server's memory and CPU over the measured phase (`--server-pid`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerUsage>,
    /// CPU seconds this generator used in the measured phase (Linux; absent elsewhere).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_secs: Option<f64>,
    /// The store requests of the measured phase, from the replicas' `/metrics` (`--metrics`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_requests: Option<StoreRequests>,
    /// Why `--metrics` could not be read at the end of the measured phase.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_requests_error: Option<String>,
    pub status_counts: BTreeMap<u16, u64>,
    pub replays: u64,
    /// Transport errors (no answer).
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub error_samples: Vec<String>,
    pub setup: SetupSummary,
    pub exactly_once: ExactlyOnce,
}

impl Report {
    /// The report of a run under `config` that measured `stats`.
    pub fn new(
        config: &Config,
        stats: Stats,
        setup: SetupSummary,
        usage: Usage,
        exactly_once: ExactlyOnce,
    ) -> Self {
        let secs = stats.elapsed.as_secs_f64();
        let per_sec = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let admitted: u64 = stats
            .status_counts
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum();
        let refusals_per_sec: BTreeMap<u16, f64> = stats
            .status_counts
            .iter()
            .filter(|(s, _)| !(200..300).contains(*s))
            .map(|(&s, &n)| (s, per_sec(n)))
            .collect();
        let h = &stats.latency;
        // A batch mixes first touches and existing accounts: no split per request.
        let first_touch = config.scenario == Scenario::FirstTouch && config.batch.is_none();
        let batch = config.batch.map(|size| {
            let items_ok: u64 = stats
                .item_status_counts
                .iter()
                .filter(|(s, _)| (200..300).contains(*s))
                .map(|(_, n)| n)
                .sum();
            BatchSummary {
                size,
                batches: stats.batches,
                items_sent: stats.items_sent,
                items_per_sec: per_sec(items_ok),
                item_status_counts: stats.item_status_counts.clone(),
                item_replays: stats.item_replays,
            }
        });
        Report {
            scenario: config.scenario,
            mode: if config.rate.is_some() {
                "open-loop"
            } else {
                "closed-loop"
            },
            seed: config.seed,
            targets: config
                .targets
                .iter()
                .map(|t| t.as_str().to_string())
                .collect(),
            connections: config.connections,
            target_rate: config.rate,
            elapsed_secs: secs,
            operations: stats.operations,
            retries: stats.retries,
            connects: stats.connects,
            on_503: config.on_503,
            resends: stats.resends,
            failovers: stats.failovers,
            requests: stats.requests,
            throughput: per_sec(stats.requests),
            goodput: per_sec(admitted),
            refusals_per_sec,
            latency_us: Latency::of(&h.all),
            admitted_latency_us: Latency::of(&h.admitted),
            settled_latency_us: Latency::of(&h.settled),
            first_touch_latency_us: first_touch.then(|| Latency::of(&h.first_touch)),
            existing_account_latency_us: first_touch.then(|| Latency::of(&h.existing)),
            batch,
            server: usage.server,
            client_cpu_secs: usage.client_cpu_secs,
            store_requests: usage.store.clone().and_then(Result::ok),
            store_requests_error: usage.store.and_then(Result::err),
            errors: stats.errors(),
            status_counts: stats.status_counts,
            replays: stats.replays,
            error_kinds: stats.error_kinds,
            error_samples: stats.error_samples,
            setup,
            exactly_once,
        }
    }

    /// True unless the verifier failed or could not finish.
    pub fn passed(&self) -> bool {
        matches!(self.exactly_once.verdict, Verdict::Pass | Verdict::Skipped)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_run(f)?;
        self.write_batch(f)?;
        self.write_latency(f)?;
        self.write_usage(f)?;
        self.write_answers(f)?;
        write_exactly_once(f, &self.exactly_once)
    }
}

impl Report {
    /// What was run, against what, and how much of it: requests, goodput, connections.
    fn write_run(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tally-load: scenario {}, {}, {} connections, seed {}",
            json_name(self.scenario),
            self.mode,
            self.connections,
            self.seed
        )?;
        if let Some(rate) = self.target_rate {
            write!(f, ", target {rate} op/s")?;
        }
        writeln!(f)?;
        writeln!(f, "targets:     {}", self.targets.join(" "))?;
        writeln!(
            f,
            "setup:       {} accounts, {} requests in {:.2} s",
            self.setup.accounts, self.setup.requests, self.setup.elapsed_secs
        )?;
        // With `--batch` a first send carries many operations: count the batches.
        let first_sends = match &self.batch {
            Some(b) => format!("{} batches of {} operations", b.batches, self.operations),
            None => format!("{} operations", self.operations),
        };
        writeln!(
            f,
            "requests:    {} ({first_sends} + {} retries + {} re-sent after 503 + {} failed over) in {:.2} s = {:.1} req/s",
            self.requests,
            self.retries,
            self.resends,
            self.failovers,
            self.elapsed_secs,
            self.throughput
        )?;
        let refusals = joined(&self.refusals_per_sec, |s, r| format!("{s}={r:.1}"));
        writeln!(
            f,
            "goodput:     {:.1} 2xx/s; other answers/s: {}",
            self.goodput,
            if refusals.is_empty() {
                "none"
            } else {
                &refusals
            }
        )?;
        let connects_per_sec = if self.elapsed_secs > 0.0 {
            self.connects as f64 / self.elapsed_secs
        } else {
            0.0
        };
        writeln!(
            f,
            "connections: {} opened ({connects_per_sec:.1}/s)",
            self.connects
        )
    }

    /// `--batch`: items per request, items per second, and how the items were answered.
    fn write_batch(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(b) = &self.batch else {
            return Ok(());
        };
        writeln!(
            f,
            "batches:     {} of up to {} items; {} items sent; {:.1} items 2xx/s; latencies below are per batch request",
            b.batches, b.size, b.items_sent, b.items_per_sec
        )?;
        let statuses = joined(&b.item_status_counts, |s, n| format!("{s}={n}"));
        writeln!(f, "items:       {statuses}; {} replays", b.item_replays)
    }

    /// Every latency the run measured: all answers, 2xx, settled and first touch.
    fn write_latency(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "latency us:  {}", self.latency_us)?;
        writeln!(f, "  2xx:       {}", self.admitted_latency_us)?;
        if let Some(policy) = self.on_503 {
            writeln!(
                f,
                "  settled:   {} (first send to 2xx, --on-503 {})",
                self.settled_latency_us,
                json_name(policy)
            )?;
        }
        if let (Some(fresh), Some(existing)) = (
            &self.first_touch_latency_us,
            &self.existing_account_latency_us,
        ) {
            writeln!(f, "  1st touch: {fresh} ({} answers)", fresh.count)?;
            writeln!(f, "  existing:  {existing} ({} answers)", existing.count)?;
        }
        Ok(())
    }

    /// The CPU and memory of the generator and of the server, when they were measured.
    fn write_usage(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(cpu) = self.client_cpu_secs {
            writeln!(f, "generator:   CPU {cpu:.2} s")?;
        }
        if let Some(s) = &self.store_requests {
            let ops = joined(&s.by_operation, |op, n| format!("{op}={n}"));
            let per = if self.batch.is_some() {
                "2xx item"
            } else {
                "2xx answer"
            };
            writeln!(
                f,
                "store:       {} requests ({ops}) over {} {per}s = {:.3} per {per}, {:.3} writes per {per}",
                s.total, s.successes, s.per_success, s.writes_per_success
            )?;
        }
        if let Some(e) = &self.store_requests_error {
            writeln!(f, "store:       not read: {e}")?;
        }
        if let Some(s) = &self.server {
            writeln!(
                f,
                "server:      pid {}: RSS {:.1} -> {:.1} MiB (peak {:.1}); CPU {:.2} s = {:.1} us per request",
                s.pid,
                s.rss_start_kib as f64 / 1024.0,
                s.rss_end_kib as f64 / 1024.0,
                s.rss_max_kib as f64 / 1024.0,
                s.cpu_secs,
                s.cpu_us_per_request
            )?;
        }
        Ok(())
    }

    /// The answers by status, the replays, and the requests that got none.
    fn write_answers(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let statuses = joined(&self.status_counts, |s, n| format!("{s}={n}"));
        writeln!(f, "statuses:    {statuses}")?;
        writeln!(f, "replays:     {}", self.replays)?;
        let kinds = joined(&self.error_kinds, |k, n| format!("{k}={n}"));
        if kinds.is_empty() {
            writeln!(f, "errors:      {}", self.errors)?;
        } else {
            writeln!(f, "errors:      {} ({kinds})", self.errors)?;
        }
        for sample in &self.error_samples {
            writeln!(f, "  e.g. {sample}")?;
        }
        Ok(())
    }
}

/// The verdict with its counts, then the first violations.
fn write_exactly_once(f: &mut fmt::Formatter<'_>, e: &ExactlyOnce) -> fmt::Result {
    let verdict = match e.verdict {
        Verdict::Pass => "PASS",
        Verdict::Fail => "FAIL",
        Verdict::Incomplete => "INCOMPLETE",
        Verdict::Skipped => "SKIPPED",
    };
    writeln!(
        f,
        "exactly-once: {verdict}: {} keys checked ({} succeeded, {} rejected, {} unknown of which {} landed); {} accounts, {} events ({} foreign); {} violations",
        e.checked,
        e.succeeded,
        e.rejected,
        e.unknown,
        e.unknown_landed,
        e.accounts_read,
        e.events_read,
        e.foreign_events,
        e.violation_count
    )?;
    if let Some(error) = &e.error {
        writeln!(f, "  verification error: {error}")?;
    }
    for v in e.violations.iter().take(MAX_PRINTED_VIOLATIONS) {
        writeln!(f, "  {} {}: {}", json_name(v.kind), v.key, v.detail)?;
    }
    let printed = e.violations.len().min(MAX_PRINTED_VIOLATIONS) as u64;
    if e.violation_count > printed {
        writeln!(f, "  ... and {} more", e.violation_count - printed)?;
    }
    Ok(())
}

/// The name `value` goes by in the JSON report (for the options, as the flag spells it).
fn json_name(value: impl Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `map`'s entries, each as `entry` writes it, two spaces apart.
fn joined<K, V>(map: &BTreeMap<K, V>, entry: impl Fn(&K, &V) -> String) -> String {
    map.iter()
        .map(|(k, v)| entry(k, v))
        .collect::<Vec<_>>()
        .join("  ")
}
