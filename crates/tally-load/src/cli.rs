//! Command-line options (clap, every flag also readable from a `TALLY_LOAD_*` variable) and
//! their validation into a [`Config`] the run can trust.

use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};
use serde::Serialize;

use crate::LoadError;
use crate::http::Target;

/// Target used when no `--target` is given.
pub const DEFAULT_TARGET: &str = "http://127.0.0.1:8080";
/// Most targets one run may address.
pub const MAX_TARGETS: usize = 64;
/// Most concurrent workers.
pub const MAX_CONNECTIONS: usize = 4096;
/// Run length when neither `--duration` nor `--requests` is given.
pub const DEFAULT_DURATION_SECS: u64 = 10;
/// Hard ceiling on the measured phase, whatever else is asked.
pub const MAX_DURATION_SECS: u64 = 3600;
/// Most operations (tickets) one run may issue.
pub const MAX_REQUESTS: u64 = 5_000_000;
/// Highest open-loop rate, requests per second.
pub const MAX_RATE: f64 = 1_000_000.0;
/// Most accounts a scenario may spread over.
pub const MAX_ACCOUNTS: usize = 100_000;
/// Largest single amount, in cents.
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000_000;
/// Longest per-request timeout.
pub const MAX_TIMEOUT_MS: u64 = 120_000;
/// Most items one `--batch` request may carry (the server's own cap, 1,000 unless its
/// `--batch-max-items` says, refuses a larger batch whole with 413).
pub const MAX_BATCH_ITEMS: usize = 10_000;
/// Share of first-touch requests that go to a brand-new account unless `--fresh-ratio` says.
pub const DEFAULT_FRESH_RATIO: f64 = 1.0;

/// The traffic shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Deposits over `--accounts` fresh, pre-funded accounts.
    Spread,
    /// Deposits over three accounts (the server's demo accounts when it lists them).
    Hot,
    /// Deposits, withdrawals and transfers among `--accounts` generously pre-funded accounts.
    Mixed,
    /// `GET balance` over `--accounts` fresh, pre-funded accounts.
    Balance,
    /// Deposits whose measured phase creates accounts: each goes to a brand-new account
    /// with probability `--fresh-ratio`, otherwise to one of `--accounts` pre-funded ones.
    FirstTouch,
}

/// What a worker does with a 503 (the server refusing under load).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum On503 {
    /// Re-send the same request (same Idempotency-Key) at once: the client that keeps
    /// hammering an overloaded server.
    Resend,
    /// Wait as long as the answer's Retry-After says, then re-send it with the same key.
    RetryAfter,
}

/// Load generator for the Tally account API, with an exactly-once verifier.
#[derive(Debug, Clone, Parser)]
#[command(name = "tally-load", version)]
pub struct Options {
    /// Base URL of a Tally node; repeat (or comma-separate) for a fleet. Loopback only
    /// unless `--allow-remote`.
    #[arg(long = "target", env = "TALLY_LOAD_TARGETS", value_delimiter = ',', default_value = DEFAULT_TARGET)]
    pub targets: Vec<String>,
    /// Traffic shape.
    #[arg(long, env = "TALLY_LOAD_SCENARIO", value_enum, default_value_t = Scenario::Spread)]
    pub scenario: Scenario,
    /// Concurrent workers (closed loop) or most requests in flight (open loop).
    #[arg(long, env = "TALLY_LOAD_CONNECTIONS", default_value_t = 64)]
    pub connections: usize,
    /// Length of the measured phase in seconds (default 10 without `--requests`).
    #[arg(long, env = "TALLY_LOAD_DURATION")]
    pub duration: Option<u64>,
    /// Number of operations to issue (retries come on top).
    #[arg(long, env = "TALLY_LOAD_REQUESTS")]
    pub requests: Option<u64>,
    /// Open loop at this many operations per second; closed loop without it.
    #[arg(long, env = "TALLY_LOAD_RATE")]
    pub rate: Option<f64>,
    /// Accounts for spread, mixed and balance (hot always uses 3).
    #[arg(long, env = "TALLY_LOAD_ACCOUNTS", default_value_t = 100)]
    pub accounts: usize,
    /// Share of writes re-sent with the same Idempotency-Key after the first answer.
    #[arg(long, env = "TALLY_LOAD_RETRY_RATIO", default_value_t = 0.0)]
    pub retry_ratio: f64,
    /// Seed for account ids and the operation mix (random when absent; always reported).
    #[arg(long, env = "TALLY_LOAD_SEED")]
    pub seed: Option<u64>,
    /// Print one JSON object instead of text.
    #[arg(long, env = "TALLY_LOAD_JSON")]
    pub json: bool,
    /// Amount of each write, in cents.
    #[arg(long, env = "TALLY_LOAD_AMOUNT_CENTS", default_value_t = 100)]
    pub amount_cents: i64,
    /// Read back every touched account's history and check exactly-once.
    #[arg(long, env = "TALLY_LOAD_VERIFY", default_value_t = true, action = ArgAction::Set)]
    pub verify: bool,
    /// Per-request timeout in milliseconds.
    #[arg(long, env = "TALLY_LOAD_TIMEOUT_MS", default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Permit targets that are not loopback addresses.
    #[arg(long, env = "TALLY_LOAD_ALLOW_REMOTE")]
    pub allow_remote: bool,
    /// Keep re-sending a request answered 503 (same key) until it gets another answer or
    /// the run ends, at once or after its Retry-After. Without it a 503 is noted and the
    /// worker moves on to its next operation.
    #[arg(long = "on-503", env = "TALLY_LOAD_ON_503", value_enum)]
    pub on_503: Option<On503>,
    /// Re-send a request that got no answer (refused connection, reset, timeout) with the
    /// same key to the next target that is up, as a client behind a load balancer does when
    /// a replica dies; at most once per other target. Off: the outcome stays unknown and the
    /// verifier settles it.
    #[arg(long, env = "TALLY_LOAD_FAILOVER", default_value_t = false, action = ArgAction::Set)]
    pub failover: bool,
    /// First-touch only: share of requests that go to a brand-new account (default 1).
    #[arg(long, env = "TALLY_LOAD_FRESH_RATIO")]
    pub fresh_ratio: Option<f64>,
    /// Send the scenario's writes as `POST /api/batch` requests of this many items, each
    /// item under its own key (`--requests` still counts operations, i.e. items). Every
    /// scenario but balance, whose reads the batch endpoint does not take.
    #[arg(long, env = "TALLY_LOAD_BATCH")]
    pub batch: Option<usize>,
    /// Read `tally_store_requests_total` from `URL/metrics` before and after the measured
    /// phase, and report the store requests it cost per operation (per item with `--batch`).
    /// Give each replica's base URL (or its `--admin-listen` address); repeat or
    /// comma-separate for a fleet. Loopback only unless `--allow-remote`.
    #[arg(long = "metrics", env = "TALLY_LOAD_METRICS", value_delimiter = ',')]
    pub metrics: Vec<String>,
    /// Sample this local process (the server under test) from /proc: resident memory at the
    /// start and end of the measured phase (and its peak, sampled), and CPU time used.
    #[arg(long, env = "TALLY_LOAD_SERVER_PID")]
    pub server_pid: Option<u32>,
}

/// Validated run settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub targets: Vec<Target>,
    pub scenario: Scenario,
    pub connections: usize,
    pub duration: Duration,
    pub max_ops: Option<u64>,
    pub rate: Option<f64>,
    pub accounts: usize,
    pub retry_ratio: f64,
    pub seed: u64,
    pub amount_cents: i64,
    pub verify: bool,
    pub timeout: Duration,
    pub on_503: Option<On503>,
    pub failover: bool,
    /// Share of brand-new accounts; 0 for every scenario but first-touch.
    pub fresh_ratio: f64,
    /// Items per request (`--batch`); None sends one operation per request.
    pub batch: Option<usize>,
    /// Where to read the store's request counters (`--metrics`); empty: not read.
    pub metrics: Vec<Target>,
    pub server_pid: Option<u32>,
}

fn bad(msg: impl Into<String>) -> LoadError {
    LoadError::Config(msg.into())
}

impl Options {
    /// Checks every option against its limit; nothing is sent before this passes.
    pub fn validate(&self) -> Result<Config, LoadError> {
        let targets = self.checked_targets()?;
        let duration_secs = self.checked_pace()?;
        let fresh_ratio = self.checked_workload()?;
        if let Some(pid) = self.server_pid
            && !super::server::exists(pid)
        {
            return Err(bad(format!("--server-pid {pid}: no such local process")));
        }
        if !(1..=MAX_AMOUNT_CENTS).contains(&self.amount_cents) {
            return Err(bad(format!(
                "--amount-cents must be 1..={MAX_AMOUNT_CENTS}"
            )));
        }
        if !(1..=MAX_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(bad(format!("--timeout-ms must be 1..={MAX_TIMEOUT_MS}")));
        }
        let seed = self
            .seed
            .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0);
        Ok(Config {
            targets,
            scenario: self.scenario,
            connections: self.connections,
            duration: Duration::from_secs(duration_secs),
            max_ops: self.requests,
            rate: self.rate,
            accounts: self.accounts,
            retry_ratio: self.retry_ratio,
            seed,
            amount_cents: self.amount_cents,
            verify: self.verify,
            timeout: Duration::from_millis(self.timeout_ms),
            on_503: self.on_503,
            failover: self.failover,
            fresh_ratio,
            batch: self.checked_batch()?,
            metrics: self.checked_metrics()?,
            server_pid: self.server_pid,
        })
    }

    /// The targets, parsed: at least one, at most [`MAX_TARGETS`].
    fn checked_targets(&self) -> Result<Vec<Target>, LoadError> {
        if self.targets.is_empty() {
            return Err(bad("at least one --target is required"));
        }
        if self.targets.len() > MAX_TARGETS {
            return Err(bad(format!("at most {MAX_TARGETS} targets")));
        }
        self.targets
            .iter()
            .map(|t| Target::parse(t, self.allow_remote))
            .collect()
    }

    /// How hard and how long the run goes: connections, duration, requests and rate.
    /// Returns the measured phase's length in seconds.
    fn checked_pace(&self) -> Result<u64, LoadError> {
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(bad(format!("--connections must be 1..={MAX_CONNECTIONS}")));
        }
        let duration_secs = duration_secs(self.duration, self.requests);
        if !(1..=MAX_DURATION_SECS).contains(&duration_secs) {
            return Err(bad(format!(
                "--duration must be 1..={MAX_DURATION_SECS} seconds"
            )));
        }
        if let Some(n) = self.requests
            && !(1..=MAX_REQUESTS).contains(&n)
        {
            return Err(bad(format!("--requests must be 1..={MAX_REQUESTS}")));
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0 && r <= MAX_RATE)
        {
            return Err(bad(format!("--rate must be > 0 and <= {MAX_RATE}")));
        }
        Ok(duration_secs)
    }

    /// What the operations look like: accounts, retries and brand-new accounts. Returns the
    /// share of brand-new accounts.
    fn checked_workload(&self) -> Result<f64, LoadError> {
        if !(1..=MAX_ACCOUNTS).contains(&self.accounts) {
            return Err(bad(format!("--accounts must be 1..={MAX_ACCOUNTS}")));
        }
        if self.scenario == Scenario::Mixed && self.accounts < 2 {
            return Err(bad("--scenario mixed needs --accounts >= 2 for transfers"));
        }
        if !(0.0..=1.0).contains(&self.retry_ratio) {
            return Err(bad("--retry-ratio must be within 0..=1"));
        }
        let fresh_ratio = match (self.scenario, self.fresh_ratio) {
            (Scenario::FirstTouch, ratio) => ratio.unwrap_or(DEFAULT_FRESH_RATIO),
            (_, None) => 0.0,
            (_, Some(_)) => return Err(bad("--fresh-ratio applies to --scenario first-touch")),
        };
        if !(0.0..=1.0).contains(&fresh_ratio) {
            return Err(bad("--fresh-ratio must be within 0..=1"));
        }
        Ok(fresh_ratio)
    }
}

impl Options {
    /// The `/metrics` bases, parsed as targets are: at most [`MAX_TARGETS`].
    fn checked_metrics(&self) -> Result<Vec<Target>, LoadError> {
        if self.metrics.len() > MAX_TARGETS {
            return Err(bad(format!("at most {MAX_TARGETS} --metrics URLs")));
        }
        self.metrics
            .iter()
            .map(|t| Target::parse(t, self.allow_remote))
            .collect()
    }

    /// Items per batch request, when asked for: 1 to [`MAX_BATCH_ITEMS`], writes only.
    fn checked_batch(&self) -> Result<Option<usize>, LoadError> {
        let Some(n) = self.batch else {
            return Ok(None);
        };
        if !(1..=MAX_BATCH_ITEMS).contains(&n) {
            return Err(bad(format!("--batch must be 1..={MAX_BATCH_ITEMS}")));
        }
        if self.scenario == Scenario::Balance {
            return Err(bad(
                "--batch takes writes; --scenario balance reads, which the batch endpoint does not take",
            ));
        }
        Ok(Some(n))
    }
}

/// The measured phase's length: as asked; else, when `--requests` bounds the run, the
/// ceiling; else the default.
fn duration_secs(duration: Option<u64>, requests: Option<u64>) -> u64 {
    match (duration, requests) {
        (Some(d), _) => d,
        (None, Some(_)) => MAX_DURATION_SECS,
        (None, None) => DEFAULT_DURATION_SECS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, LoadError> {
        let mut all = vec!["tally-load"];
        all.extend_from_slice(args);
        Options::try_parse_from(all)
            .map_err(|e| bad(e.to_string()))?
            .validate()
    }

    #[test]
    fn defaults_are_valid() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.connections, 64);
        assert_eq!(c.duration, Duration::from_secs(DEFAULT_DURATION_SECS));
        assert!(c.verify);
    }

    #[test]
    fn limits_are_enforced() {
        assert!(parse(&["--connections", "0"]).is_err());
        assert!(parse(&["--retry-ratio", "1.5"]).is_err());
        assert!(parse(&["--rate", "NaN"]).is_err());
        assert!(parse(&["--rate", "-3"]).is_err());
        assert!(parse(&["--scenario", "mixed", "--accounts", "1"]).is_err());
        assert!(parse(&["--amount-cents", "0"]).is_err());
        assert!(parse(&["--verify", "maybe"]).is_err());
        assert!(!parse(&["--verify", "false"]).unwrap().verify);
        assert!(!parse(&[]).unwrap().failover);
        assert!(parse(&["--failover", "true"]).unwrap().failover);
        assert!(parse(&["--failover", "often"]).is_err());
    }

    #[test]
    fn overload_options_are_checked() {
        assert_eq!(parse(&[]).unwrap().on_503, None);
        let c = parse(&["--on-503", "retry-after", "--connections", "1500"]).unwrap();
        assert_eq!((c.on_503, c.connections), (Some(On503::RetryAfter), 1500));
        assert_eq!(
            parse(&["--on-503", "resend"]).unwrap().on_503,
            Some(On503::Resend)
        );
        assert!(parse(&["--on-503", "sometimes"]).is_err());
        let c = parse(&["--scenario", "first-touch"]).unwrap();
        assert_eq!(c.fresh_ratio, DEFAULT_FRESH_RATIO);
        let c = parse(&["--scenario", "first-touch", "--fresh-ratio", "0.25"]).unwrap();
        assert_eq!(c.fresh_ratio, 0.25);
        assert!(parse(&["--scenario", "first-touch", "--fresh-ratio", "1.5"]).is_err());
        assert!(parse(&["--scenario", "hot", "--fresh-ratio", "0.5"]).is_err());
        assert_eq!(parse(&["--scenario", "hot"]).unwrap().fresh_ratio, 0.0);
        let me = std::process::id().to_string();
        assert!(parse(&["--server-pid", &me]).unwrap().server_pid.is_some());
        assert!(parse(&["--server-pid", "0"]).is_err());
    }

    #[test]
    fn batch_sizes_are_checked_and_reads_are_refused() {
        assert_eq!(parse(&[]).unwrap().batch, None);
        assert_eq!(parse(&["--batch", "100"]).unwrap().batch, Some(100));
        assert_eq!(
            parse(&["--batch", "1", "--scenario", "mixed"])
                .unwrap()
                .batch,
            Some(1)
        );
        assert!(parse(&["--batch", "0"]).is_err());
        let over = (MAX_BATCH_ITEMS + 1).to_string();
        assert!(parse(&["--batch", &over]).is_err());
        assert!(parse(&["--batch", "10", "--scenario", "balance"]).is_err());
    }

    #[test]
    fn metrics_urls_are_checked_as_targets_are() {
        assert!(parse(&[]).unwrap().metrics.is_empty());
        let c = parse(&["--metrics", "http://127.0.0.1:9090,http://127.0.0.1:9091"]).unwrap();
        assert_eq!(c.metrics.len(), 2);
        assert!(parse(&["--metrics", "http://10.0.0.1:9090"]).is_err());
        assert!(parse(&["--metrics", "ftp://127.0.0.1"]).is_err());
    }
}
