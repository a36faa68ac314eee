//! The run report: serialisable as one JSON object, printable as text.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::cli::Scenario;
use super::verify::{ExactlyOnce, Verdict};

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

/// The setup phase in brief.
#[derive(Debug, Clone, Serialize)]
pub struct SetupSummary {
    pub accounts: usize,
    pub requests: u64,
    pub elapsed_secs: f64,
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
    pub requests: u64,
    /// Requests (answered or not) per second of the measured phase.
    pub throughput: f64,
    pub latency_us: Latency,
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
    /// True unless the verifier failed or could not finish.
    pub fn passed(&self) -> bool {
        matches!(self.exactly_once.verdict, Verdict::Pass | Verdict::Skipped)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scenario = serde_json::to_value(self.scenario)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        write!(
            f,
            "tally-load: scenario {scenario}, {}, {} connections, seed {}",
            self.mode, self.connections, self.seed
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
        writeln!(
            f,
            "requests:    {} ({} operations + {} retries) in {:.2} s = {:.1} req/s",
            self.requests, self.operations, self.retries, self.elapsed_secs, self.throughput
        )?;
        let l = &self.latency_us;
        writeln!(
            f,
            "latency us:  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  mean {:.0}",
            l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        )?;
        let statuses: Vec<String> = self
            .status_counts
            .iter()
            .map(|(s, n)| format!("{s}={n}"))
            .collect();
        writeln!(f, "statuses:    {}", statuses.join("  "))?;
        writeln!(f, "replays:     {}", self.replays)?;
        let kinds: Vec<String> = self
            .error_kinds
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        if kinds.is_empty() {
            writeln!(f, "errors:      {}", self.errors)?;
        } else {
            writeln!(f, "errors:      {} ({})", self.errors, kinds.join("  "))?;
        }
        for sample in &self.error_samples {
            writeln!(f, "  e.g. {sample}")?;
        }
        let e = &self.exactly_once;
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
            let kind = serde_json::to_value(v.kind)
                .ok()
                .and_then(|k| k.as_str().map(str::to_string))
                .unwrap_or_default();
            writeln!(f, "  {kind} {}: {}", v.key, v.detail)?;
        }
        let printed = e.violations.len().min(MAX_PRINTED_VIOLATIONS) as u64;
        if e.violation_count > printed {
            writeln!(f, "  ... and {} more", e.violation_count - printed)?;
        }
        Ok(())
    }
}
