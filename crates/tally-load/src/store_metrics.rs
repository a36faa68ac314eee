//! `--metrics`: what the measured phase cost the event store, read from each replica's
//! `/metrics` (`tally_store_requests_total`) just before and just after it. Per 2xx answer
//! (per 2xx item with `--batch`) it shows how well group commit packs writes into store
//! requests. The 2xx answers are the denominator because a shed or refused operation costs
//! little or nothing, and would flatter the figure.

use std::collections::BTreeMap;
use std::time::Duration;

use hyper::Method;
use serde::Serialize;

use crate::http::{Client, Target, exchange};
use crate::workload::quote;

/// The counter read: store requests by operation and result.
pub const STORE_REQUESTS: &str = "tally_store_requests_total";
/// The operation label of store writes.
const WRITE: &str = "write";

/// Store requests by operation, summed over the replicas read.
pub type Counts = BTreeMap<String, f64>;

/// The store requests of the measured phase.
#[derive(Debug, Clone, Serialize)]
pub struct StoreRequests {
    /// By operation (`write`, `read`, ...), every result counted.
    pub by_operation: BTreeMap<String, u64>,
    pub total: u64,
    /// 2xx answers of the measured phase (2xx item results with `--batch`), replays
    /// included: the denominator of the two rates.
    pub successes: u64,
    /// `total` per 2xx answer.
    pub per_success: f64,
    /// Store writes per 2xx answer.
    pub writes_per_success: f64,
}

impl StoreRequests {
    /// What the counters moved by between `before` and `after`, over `successes`.
    pub fn between(before: &Counts, after: &Counts, successes: u64) -> Self {
        let by_operation: BTreeMap<String, u64> = after
            .iter()
            .map(|(op, &n)| {
                let moved = (n - before.get(op).copied().unwrap_or(0.0)).max(0.0);
                (op.clone(), moved.round() as u64)
            })
            .collect();
        let total = by_operation.values().sum();
        let per = |n: u64| {
            if successes > 0 {
                n as f64 / successes as f64
            } else {
                0.0
            }
        };
        StoreRequests {
            writes_per_success: per(by_operation.get(WRITE).copied().unwrap_or(0)),
            per_success: per(total),
            total,
            successes,
            by_operation,
        }
    }
}

/// The counters of every replica in `bases`, summed.
pub async fn read(client: &Client, bases: &[Target], timeout: Duration) -> Result<Counts, String> {
    let mut sum = Counts::new();
    for base in bases {
        let uri = base.uri("/metrics")?;
        let fail = |why: String| format!("GET {}/metrics: {why}", base.as_str());
        let answer = exchange(client, Method::GET, uri, None, None, timeout)
            .await
            .map_err(|e| fail(format!("{}: {}", e.kind, e.detail)))?;
        if !(200..300).contains(&answer.status) {
            return Err(fail(format!(
                "status {}: {}",
                answer.status,
                quote(&answer.body)
            )));
        }
        let text = String::from_utf8_lossy(&answer.body);
        for (op, n) in parse(&text) {
            *sum.entry(op).or_default() += n;
        }
    }
    Ok(sum)
}

/// [`STORE_REQUESTS`] by its `operation` label, from Prometheus' text format.
pub fn parse(text: &str) -> Counts {
    let mut counts = Counts::new();
    let prefix = format!("{STORE_REQUESTS}{{");
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let op = labels
            .split(',')
            .find_map(|l| l.trim().strip_prefix("operation=\""))
            .and_then(|v| v.strip_suffix('"'));
        let n = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let (Some(op), Some(n)) = (op, n) {
            *counts.entry(op.to_string()).or_default() += n;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_requests_are_summed_by_operation_across_results() {
        let text = "# HELP tally_store_requests_total Store requests.\n\
            # TYPE tally_store_requests_total counter\n\
            tally_store_requests_total{operation=\"write\",result=\"ok\"} 40\n\
            tally_store_requests_total{operation=\"write\",result=\"conflict\"} 2\n\
            tally_store_requests_total{operation=\"read\",result=\"ok\"} 7\n\
            tally_store_requests_totally{operation=\"write\",result=\"ok\"} 999\n\
            tally_store_request_duration_seconds_count{operation=\"write\"} 42\n";
        let before = parse(text);
        assert_eq!(before.get("write"), Some(&42.0));
        assert_eq!(before.get("read"), Some(&7.0));
        assert_eq!(before.len(), 2);
        let mut after = before.clone();
        after.insert("write".into(), 52.0);
        after.insert("leader_tip".into(), 3.0);
        let moved = StoreRequests::between(&before, &after, 100);
        assert_eq!(moved.total, 13);
        assert_eq!(moved.by_operation.get("read"), Some(&0));
        assert_eq!(moved.by_operation.get("leader_tip"), Some(&3));
        assert!((moved.writes_per_success - 0.1).abs() < 1e-9);
        assert!((moved.per_success - 0.13).abs() < 1e-9);
    }
}
