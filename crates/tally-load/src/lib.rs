//! Core of `tally-load`, a bounded load generator for the Tally account API that ends with
//! an exactly-once check of every idempotency key it sent. The binary is a thin shell over
//! [`run`]; the tests drive [`run`] in-process.

pub mod audit;
pub mod cli;
pub mod conn;
pub mod http;
pub mod ledger;
pub mod report;
pub mod rng;
pub mod runner;
pub mod server;
pub mod workload;

pub use cli::Options;
pub use report::Report;

use std::collections::BTreeMap;

use audit::ExactlyOnce;
use cli::Scenario;
use report::{Latency, SetupSummary};

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
    let accounts = setup.workload.accounts.len();
    let sampler = match config.server_pid {
        Some(pid) => Some(server::Sampler::start(pid).ok_or_else(|| {
            LoadError::Setup(format!("--server-pid {pid}: cannot read /proc/{pid}"))
        })?),
        None => None,
    };
    let own_cpu_start = server::cpu_secs(std::process::id());
    let mut stats = runner::drive(&config, setup.workload).await?;
    let server = sampler.and_then(|s| s.finish(stats.requests));
    // On one machine the generator competes with the server for CPU: report its share.
    let client_cpu_secs = own_cpu_start
        .zip(server::cpu_secs(std::process::id()))
        .map(|(start, end)| (end - start).max(0.0));
    let exactly_once = if config.verify {
        let mut records = setup.records;
        records.append(&mut stats.records);
        let client = http::client(config.connections, config.timeout);
        audit::audit(&config, &client, &records).await
    } else {
        ExactlyOnce::skipped()
    };
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
    let first_touch = config.scenario == Scenario::FirstTouch;
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
        server,
        client_cpu_secs,
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
