//! Core of `tally-load`, a bounded load generator for the Tally account API that ends with
//! an exactly-once check of every idempotency key it sent. The binary is a thin shell over
//! [`run`]; tests include this module directly.

pub mod cli;
pub mod http;
pub mod ledger;
pub mod report;
pub mod rng;
pub mod runner;
pub mod verify;
pub mod workload;

pub use cli::Options;
pub use report::Report;

use report::{Latency, SetupSummary};
use verify::ExactlyOnce;

/// Why a run could not produce a report.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// An option was out of range or a target was refused; nothing was sent.
    #[error("invalid option: {0}")]
    Config(String),
    /// Listing or pre-funding accounts failed.
    #[error("setup failed: {0}")]
    Setup(String),
    /// The measured phase broke down.
    #[error("run failed: {0}")]
    Run(String),
}

/// Validates `options`, sets up accounts, drives the load, verifies, and reports.
pub async fn run(options: Options) -> Result<Report, LoadError> {
    let config = options.validate()?;
    let client = http::client(config.connections, config.timeout);
    let setup = workload::prepare(&config, &client).await?;
    let accounts = setup.workload.accounts.len();
    let mut stats = runner::drive(&config, setup.workload, &client).await?;
    let exactly_once = if config.verify {
        let mut records = setup.records;
        records.append(&mut stats.records);
        verify::verify(&config, &client, &records).await
    } else {
        ExactlyOnce::skipped()
    };
    let secs = stats.elapsed.as_secs_f64();
    let h = &stats.latency;
    let latency_us = Latency {
        p50: h.value_at_quantile(0.50),
        p90: h.value_at_quantile(0.90),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        max: h.max(),
        mean: h.mean(),
        count: h.len(),
    };
    Ok(Report {
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
        requests: stats.requests,
        throughput: if secs > 0.0 {
            stats.requests as f64 / secs
        } else {
            0.0
        },
        latency_us,
        errors: stats.errors(),
        status_counts: stats.status_counts,
        replays: stats.replays,
        error_kinds: stats.error_kinds,
        error_samples: stats.error_samples,
        setup: SetupSummary {
            accounts,
            requests: setup.requests,
            elapsed_secs: setup.elapsed.as_secs_f64(),
        },
        exactly_once,
    })
}
