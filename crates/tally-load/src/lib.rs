//! Core of `tally-load`, a bounded load generator for the Tally account API that ends with
//! an exactly-once check of every idempotency key it sent. The binary is a thin shell over
//! [`run`]; the tests drive [`run`] in-process.

pub mod audit;
pub mod cli;
pub mod conn;
pub mod http;
pub mod ledger;
pub mod op;
pub mod report;
pub mod rng;
pub mod runner;
pub mod server;
pub mod store_metrics;
pub mod workload;

pub use cli::Options;
pub use report::Report;

use audit::ExactlyOnce;
use cli::Config;
use report::{SetupSummary, Usage};
use runner::Stats;
use store_metrics::StoreRequests;
use workload::Workload;

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
    let setup = {
        // Dropped before the measured phase so that its idle pooled connections close: the
        // server sees only the workers' connections (which count against its cap).
        let client = http::client(config.connections, config.timeout);
        workload::prepare(&config, &client).await?
    };
    let summary = SetupSummary {
        accounts: setup.workload.accounts.len(),
        requests: setup.requests,
        elapsed_secs: setup.elapsed.as_secs_f64(),
    };
    let (mut stats, usage) = measure(&config, setup.workload).await?;
    let exactly_once = if config.verify {
        let mut records = setup.records;
        records.append(&mut stats.records);
        let client = http::client(config.connections, config.timeout);
        audit::audit(&config, &client, &records).await
    } else {
        ExactlyOnce::skipped()
    };
    Ok(Report::new(&config, stats, summary, usage, exactly_once))
}

/// Drives the measured phase, sampling the server (`--server-pid`) and this process over it.
async fn measure(config: &Config, workload: Workload) -> Result<(Stats, Usage), LoadError> {
    let sampler = match config.server_pid {
        Some(pid) => Some(server::Sampler::start(pid).ok_or_else(|| {
            LoadError::Setup(format!("--server-pid {pid}: cannot read /proc/{pid}"))
        })?),
        None => None,
    };
    let metrics_client = http::client(config.metrics.len().max(1), config.timeout);
    let store_before = if config.metrics.is_empty() {
        None
    } else {
        let read = store_metrics::read(&metrics_client, &config.metrics, config.timeout).await;
        Some(read.map_err(|e| LoadError::Setup(format!("--metrics: {e}")))?)
    };
    let own_cpu_start = server::cpu_secs(std::process::id());
    let stats = runner::drive(config, workload).await?;
    let server = sampler.and_then(|s| s.finish(stats.requests));
    // Read before the audit, whose history reads are not the run's cost.
    let store = match store_before {
        None => None,
        Some(before) => Some(
            store_metrics::read(&metrics_client, &config.metrics, config.timeout)
                .await
                .map(|after| {
                    let successes = stats.successes(config.batch.is_some());
                    StoreRequests::between(&before, &after, successes)
                }),
        ),
    };
    // On one machine the generator competes with the server for CPU: report its share.
    let client_cpu_secs = own_cpu_start
        .zip(server::cpu_secs(std::process::id()))
        .map(|(start, end)| (end - start).max(0.0));
    let usage = Usage {
        server,
        client_cpu_secs,
        store,
    };
    Ok((stats, usage))
}
