//! One typed configuration, from flags and environment, validated at start.
//!
//! Each concern's flags are flattened in here, and each is one heading of `tally --help`:
//! - [`HttpConfig`] (listening and limits), in [`http`] here;
//! - [`StoreFlags`] (with Celeriant's), [`ProjectionFlags`], [`AuthConfig`], [`WatchConfig`]
//!   and [`WriteFlags`], each beside the module that owns it.
//!
//! The HTTP edge's flags live here, not in `crate::http`. The edge sits above the
//! configuration (it reads it through `App`), and a layer uses only the layers below it.
//!
//! A flag's range is its parser's ([`crate::flag::count`], or clap's own ranged parsers).
//! [`Config::validate`] checks only what no single flag can: settings that do not fit
//! together, and what a replica must have before it serves.

pub mod http;

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::account::{AccountsMode, Identity};
use crate::auth::{AuthConfig, Authenticator};
use crate::flag::count;
use crate::projection::ProjectionConfig;
use crate::projection::config::{ProjectionFlags, ProjectionKind};
use crate::store::combine::CombineConfig;
use crate::store::config::{StoreFlags, StoreKind};
use crate::watch::WatchConfig;
use crate::write_loop::WriteConfig;
use crate::write_loop::config::WriteFlags;
use http::{HttpConfig, MAX_ACTIVE_REQUESTS};

/// The longest idempotency window accepted, in seconds (one day).
pub const MAX_WINDOW_SECS: u64 = 86_400;
/// The longest idempotency retention accepted, in seconds (thirty days).
pub const MAX_RETENTION_SECS: u64 = 30 * 86_400;
/// How long a landed write's key is remembered, unless configured (a day).
pub const DEFAULT_RETENTION_SECS: u64 = 86_400;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// Tally: idempotent account writes over the Celeriant event store.
#[derive(Clone, Debug, Parser)]
#[command(name = "tally", version, about)]
pub struct Config {
    /// Where clients reach this replica, and how much it takes on at once.
    #[command(flatten)]
    pub http: HttpConfig,

    /// Which event store, where, and as which service.
    #[command(flatten)]
    pub store: StoreFlags,

    /// Whether a first write creates an account (`implicit`) or needs it opened (`explicit`).
    #[arg(help_heading = "Accounts", long = "accounts", env = "TALLY_ACCOUNTS", value_enum, value_parser = crate::flag::named::<AccountsMode>(), default_value_t = AccountsMode::Implicit)]
    pub accounts: AccountsMode,

    /// Holds: reserve money, then post, void or let it expire (`/api/accounts/{id}/holds`).
    /// A fleet with holds is Tally-only: the replaced service cannot fold hold events.
    /// Off, a replica refuses an account whose stream holds one (503 `HOLDS_OFF`).
    #[arg(help_heading = "Accounts", long, env = "TALLY_HOLDS", action = clap::ArgAction::Set, default_value_t = false)]
    pub holds: bool,

    /// How often the hold sweeper looks for due holds, in milliseconds.
    #[arg(help_heading = "Accounts", long, env = "TALLY_HOLD_SWEEP_INTERVAL_MS", default_value_t = crate::write_loop::sweeper::DEFAULT_HOLD_SWEEP_INTERVAL.as_millis() as u64, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub hold_sweep_interval_ms: u64,

    /// The most accounts one hold-sweeper pass expires holds on.
    #[arg(help_heading = "Accounts", long, env = "TALLY_HOLD_SWEEP_BUDGET", default_value_t = crate::write_loop::sweeper::DEFAULT_HOLD_SWEEP_BUDGET, value_parser = crate::flag::usize_in(1..=100_000))]
    pub hold_sweep_budget: usize,

    /// Seed the demo accounts (Alice, Bob, Charlie) at start. Default: on the memory store only.
    #[arg(help_heading = "Accounts", long, env = "TALLY_SEED_DEMO_ACCOUNTS")]
    pub seed_demo_accounts: Option<bool>,

    /// The most one device sync run may withdraw in total, in cents (0: no limit).
    #[arg(help_heading = "Accounts", long, env = "TALLY_DEVICE_MAX_RUN_WITHDRAWAL_CENTS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=crate::account::MAX_AMOUNT_CENTS as u64))]
    pub device_max_run_withdrawal_cents: u64,

    /// Where the projection lives and how much of it a replica holds.
    #[command(flatten)]
    pub projection: ProjectionFlags,

    /// How long a write's response is replayed for a retry with its key, in seconds.
    #[arg(help_heading = "Idempotency", long, env = "TALLY_IDEMPOTENCY_WINDOW", default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=MAX_WINDOW_SECS))]
    pub idempotency_window: u64,

    /// How long a landed write's key is remembered on any replica, in seconds (at least the window).
    #[arg(help_heading = "Idempotency", long, env = "TALLY_IDEMPOTENCY_RETENTION", default_value_t = DEFAULT_RETENTION_SECS, value_parser = clap::value_parser!(u64).range(1..=MAX_RETENTION_SECS))]
    pub idempotency_retention: u64,

    /// Most keys one account remembers past the window; the oldest go first.
    #[arg(help_heading = "Idempotency", long, env = "TALLY_IDEMPOTENCY_MAX_KEYS_PER_ACCOUNT", default_value_t = crate::projection::DEFAULT_MAX_KEYS_PER_ACCOUNT, value_parser = count(crate::projection::MAX_KEYS))]
    pub idempotency_max_keys_per_account: usize,

    /// Most keys this replica remembers past the window, over all accounts; the oldest go first.
    #[arg(help_heading = "Idempotency", long, env = "TALLY_IDEMPOTENCY_MAX_KEYS", default_value_t = crate::projection::DEFAULT_MAX_KEYS, value_parser = count(crate::projection::MAX_KEYS))]
    pub idempotency_max_keys: usize,

    /// On an index miss, look for the write this many seconds back in the store (0: off).
    #[arg(help_heading = "Idempotency", long, env = "TALLY_IDEMPOTENCY_SCAN_WINDOW", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=MAX_WINDOW_SECS))]
    pub idempotency_scan_window: u64,

    /// How requests are authenticated and paced.
    #[command(flatten)]
    pub auth: AuthConfig,

    /// The watch stream's limits, `--watch-*`.
    #[command(flatten)]
    pub watch: WatchConfig,

    /// The write side's deadline, retries and queues.
    #[command(flatten)]
    pub write: WriteFlags,

    /// Log format; the level comes from RUST_LOG (default info).
    #[arg(help_heading = "Observability", long, env = "TALLY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,

    /// Serve `/metrics`, `/healthz` and `/readyz` on this address instead of the API's.
    #[arg(help_heading = "Observability", long, env = "TALLY_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

impl Config {
    /// A configuration with every default, for tests and embedding.
    pub fn defaults() -> Self {
        Self::parse_from(["tally"])
    }

    /// Checks what the flags' own parsers cannot: settings that are each in range but do not
    /// fit together, and the files and URLs a replica needs before it serves. Each flag's
    /// range is its parser's (see [`crate::flag::count`]): a value no replica could use is refused by
    /// clap, naming the flag, before this runs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_gate_floor_under_ceiling()?;
        self.check_time_relations()?;
        if self.http.allowed_hosts.len() > http::MAX_ALLOWED_HOSTS {
            return Err(ConfigError(format!(
                "--allowed-hosts takes at most {} names",
                http::MAX_ALLOWED_HOSTS
            )));
        }
        // A token must be checkable before the replica serves.
        Authenticator::new(&self.auth).map_err(ConfigError)?;
        if self.store.kind == StoreKind::Celeriant {
            self.store
                .celeriant
                .validate()
                .map_err(|e| ConfigError(e.to_string()))?;
        }
        self.check_postgres_has_a_url()?;
        Ok(())
    }

    /// The gate adapts between its floor and its ceiling, so the floor may not pass it.
    fn check_gate_floor_under_ceiling(&self) -> Result<(), ConfigError> {
        if self.http.min_active_requests > self.http.max_active_requests {
            return Err(ConfigError(format!(
                "--min-active-requests and --max-active-requests need 1 <= min <= max <= {MAX_ACTIVE_REQUESTS}"
            )));
        }
        Ok(())
    }

    /// The longest a write can live: its deadline, and the last store request it may still
    /// have out when the deadline passes.
    pub fn write_life(&self) -> Duration {
        Duration::from_millis(self.write.write_deadline_ms) + self.store_request_timeout()
    }

    /// A write's life as a refusal names it: the flags it is made of, each with its value.
    /// The embedded store has no request timeout, so only the deadline is named there.
    fn write_life_shown(&self) -> String {
        let deadline = self.write.write_deadline_ms;
        match self.store.kind {
            StoreKind::Memory => format!("--write-deadline-ms ({deadline} ms)"),
            StoreKind::Celeriant => format!(
                "--write-deadline-ms ({deadline} ms) plus --celeriant-request-timeout-ms ({} ms), {} ms in all",
                self.store.celeriant.request_timeout_ms,
                self.write_life().as_millis()
            ),
        }
    }

    /// The longest one store request may take (0 on the embedded store, which answers in
    /// process).
    pub fn store_request_timeout(&self) -> Duration {
        match self.store.kind {
            StoreKind::Celeriant => Duration::from_millis(self.store.celeriant.request_timeout_ms),
            StoreKind::Memory => Duration::ZERO,
        }
    }

    /// How long after a retry is sent it may still look for an earlier landing: its waits
    /// before it is read (at the gate, for an in-flight slot, again after a slow body, each
    /// at most `--max-queue-wait-ms`), a stall too short to be fenced, then a write's life
    /// (its last look is a catch-up before its deadline, and a store call may be out).
    pub fn retry_lookup_room(&self) -> Duration {
        self.http.max_queue_wait() * 3 + crate::stall::THRESHOLD + self.write_life()
    }

    /// Retention never trims what a remembered key points at: history is kept for the window
    /// and `--retain-history-secs` (0 when unset, as `tally trim` takes it), and that must
    /// reach back as far as `--idempotency-retention`.
    pub fn check_trim_keeps_keys(&self) -> Result<(), ConfigError> {
        let retain = self.projection.retain_history_secs.unwrap_or(0);
        let kept = self.idempotency_window.saturating_add(retain);
        if kept < self.idempotency_retention {
            return Err(ConfigError(format!(
                "--retain-history-secs ({retain} s) plus --idempotency-window ({} s) keeps {kept} s of history, less than --idempotency-retention ({} s): a retry of a remembered key would find its write trimmed away. Set --retain-history-secs to at least {} s, or shorten the retention.",
                self.idempotency_window,
                self.idempotency_retention,
                self.idempotency_retention - self.idempotency_window,
            )));
        }
        Ok(())
    }

    /// Settings that are each in range but do not fit together.
    fn check_time_relations(&self) -> Result<(), ConfigError> {
        if self.projection.retain_history_secs.is_some() {
            self.check_trim_keeps_keys()?;
        }
        // A write's whole life (its deadline, and the last store request it may still have
        // out when the deadline passes) fits in the window: what it wrote is in the
        // recent-writes index for as long as the write itself can look for it there.
        let life_ms = u64::try_from(self.write_life().as_millis()).unwrap_or(u64::MAX);
        if life_ms >= self.idempotency_window.saturating_mul(1000) {
            return Err(ConfigError(format!(
                "--idempotency-window ({} s) must be longer than {}",
                self.idempotency_window,
                self.write_life_shown()
            )));
        }
        // The window is the part of the retention answered from memory alone: a key is
        // never forgotten while its full entry still answers.
        if self.idempotency_retention < self.idempotency_window {
            return Err(ConfigError(format!(
                "--idempotency-retention ({} s) must be at least --idempotency-window ({} s)",
                self.idempotency_retention, self.idempotency_window
            )));
        }
        // A stalled event stream ends itself first, so it can still tell its client why.
        if self.http.write_stall_secs <= self.watch.stall_limit().as_secs() {
            return Err(ConfigError(format!(
                "--write-stall-secs must be longer than {} x --watch-keepalive-secs ({} s)",
                crate::watch::STALL_KEEPALIVES,
                self.watch.stall_limit().as_secs()
            )));
        }
        Ok(())
    }

    // The Postgres projection.
    fn check_postgres_has_a_url(&self) -> Result<(), ConfigError> {
        // Its rows carry a balance, not an account's open holds.
        if self.projection.kind == ProjectionKind::Postgres && self.holds {
            return Err(ConfigError(
                "--holds true needs the memory projection: the Postgres projection does not carry holds".into(),
            ));
        }
        if self.projection.kind == ProjectionKind::Postgres
            && self
                .projection
                .postgres_url
                .as_deref()
                .is_none_or(str::is_empty)
        {
            return Err(ConfigError(
                "--projection postgres needs --postgres-url (or DATABASE_URL)".into(),
            ));
        }
        Ok(())
    }

    /// The Postgres projection's settings, when `--projection postgres`.
    pub fn postgres(&self) -> Option<crate::projection::PostgresSettings> {
        (self.projection.kind == ProjectionKind::Postgres).then(|| {
            crate::projection::PostgresSettings {
                url: self.projection.postgres_url.clone().unwrap_or_default(),
                pool_size: self.projection.postgres_pool_size,
                statement_timeout: Duration::from_millis(
                    self.projection.postgres_statement_timeout_ms,
                ),
            }
        })
    }

    /// The store, as a person starting a replica needs to see it: which backend and where
    /// (the embedded one is this process's own, shared with no other replica).
    pub fn store_description(&self) -> String {
        match self.store.kind {
            StoreKind::Memory => "memory (embedded in this process, shared with no other)".into(),
            StoreKind::Celeriant => format!("celeriant at {}", self.store.celeriant.address),
        }
    }

    /// The projection, likewise: `memory`, or `postgres` with the database's place (never its
    /// credentials).
    pub fn projection_description(&self) -> String {
        match self.projection.kind {
            ProjectionKind::Memory => "memory".into(),
            ProjectionKind::Postgres => format!(
                "postgres at {}",
                crate::projection::postgres::database_place(
                    self.projection.postgres_url.as_deref().unwrap_or_default()
                )
            ),
        }
    }

    pub fn identity(&self) -> Identity {
        let d = Identity::default();
        Identity {
            org_id: self.store.org_id.unwrap_or(d.org_id),
            account_type_id: self.store.account_type_id.unwrap_or(d.account_type_id),
            client_id: self.store.client_id.unwrap_or(d.client_id),
        }
    }

    pub fn seeds_demo_accounts(&self) -> bool {
        self.seed_demo_accounts
            .unwrap_or(self.store.kind == StoreKind::Memory)
    }

    pub fn window(&self) -> Duration {
        Duration::from_secs(self.idempotency_window)
    }

    pub fn hold_sweep_interval(&self) -> Duration {
        Duration::from_millis(self.hold_sweep_interval_ms)
    }

    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.idempotency_retention)
    }

    pub fn projection(&self) -> ProjectionConfig {
        ProjectionConfig {
            window: self.window(),
            retention: self.retention(),
            max_keys_per_account: self.idempotency_max_keys_per_account,
            max_keys: self.idempotency_max_keys,
            max_resident_accounts: self.projection.max_resident_accounts,
            idle_timeout: Duration::from_secs(self.projection.idle_timeout_secs),
            max_index_entries: self.projection.max_index_entries,
            scan_window: (self.idempotency_scan_window > 0)
                .then(|| Duration::from_secs(self.idempotency_scan_window)),
            checkpoints: self.projection.checkpoints(),
            holds: self.holds,
        }
    }

    pub fn combine(&self) -> CombineConfig {
        CombineConfig {
            enabled: self.write.combine_writes,
            max_in_flight: self.write.combine_max_in_flight,
            max_aggregates: self.write.combine_max_aggregates,
        }
    }

    pub fn write(&self) -> WriteConfig {
        WriteConfig {
            max_attempts: self.write.write_max_attempts,
            deadline: Duration::from_millis(self.write.write_deadline_ms),
            one_round_trip: self.write.one_round_trip,
            batching: self.write.batching,
            max_batch_events: self.write.max_batch_events,
            max_live_writes: self.write.max_live_writes,
            max_queued_per_account: self.write.max_queued_writes_per_account,
            accounts: self.accounts,
        }
    }
}

#[cfg(test)]
impl Config {
    /// Why a replica with these flags would not start: clap's refusal of a value out of its
    /// flag's range, or else [`Config::validate`]'s.
    pub(crate) fn refusal(args: &[&str]) -> String {
        match Self::try_parse_from(std::iter::once(&"tally").chain(args)) {
            Err(e) => e.to_string(),
            Ok(c) => c.validate().expect_err("refused").to_string(),
        }
    }
}

/// The demo accounts, defined where they are seeded (`--seed-demo-accounts`).
pub use crate::startup::seed::{DEMO_ACCOUNTS, demo_account_id};

#[cfg(test)]
mod tests {
    use super::http::*;
    use super::*;
    use crate::account::named_id;
    use crate::auth::MAX_RATE_PER_CALLER;
    use crate::projection::DEFAULT_MAX_INDEX_ENTRIES;
    use crate::projection::config::*;
    use crate::store::faults::FaultConfig;
    use crate::watch::DEFAULT_KEEPALIVE_SECS;
    use crate::write_loop::config::*;

    #[test]
    fn defaults_are_valid_and_name_the_service() {
        let c = Config::defaults();
        c.validate().unwrap();
        assert_eq!(c.identity().client_id, named_id("Tally"));
        assert!(c.seeds_demo_accounts());
        assert_eq!(c.http.listen.to_string(), "127.0.0.1:8080");
    }

    #[test]
    fn out_of_range_settings_are_refused() {
        let e = Config::refusal(&["--idempotency-window", "0"]);
        assert!(e.contains("--idempotency-window"), "{e}");
        let c = Config::parse_from(["tally", "--store", "celeriant"]);
        assert!(!c.seeds_demo_accounts());
    }

    /// Rule: holds need the memory projection; a replica asked for both is refused at start.
    #[test]
    fn holds_with_the_postgres_projection_are_refused() {
        let e = Config::refusal(&[
            "--holds",
            "true",
            "--projection",
            "postgres",
            "--postgres-url",
            "postgres://x@localhost/x",
        ]);
        assert!(
            e.contains("--holds true needs the memory projection"),
            "{e}"
        );
        let c = Config::parse_from(["tally", "--holds", "true"]);
        c.validate().unwrap();
        assert!(c.projection().holds);
        assert!(!Config::defaults().projection().holds);
    }

    #[test]
    fn admission_flags_are_checked() {
        let c = Config::defaults();
        assert_eq!(c.http.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(
            c.http.max_queue_wait(),
            Duration::from_millis(DEFAULT_MAX_QUEUE_WAIT_MS)
        );
        let c = Config::parse_from(["tally", "--max-queue-wait-ms", "0"]);
        c.validate().unwrap();
        assert!(c.http.max_queue_wait().is_zero());
        assert_eq!(
            (c.http.min_active_requests, c.http.max_active_requests),
            (DEFAULT_MIN_ACTIVE_REQUESTS, DEFAULT_MAX_ACTIVE_REQUESTS)
        );
        for bad in [
            ["--max-connections", "0"],
            ["--max-queue-wait-ms", "10001"],
            ["--min-active-requests", "0"],
            ["--min-active-requests", "257"],
            ["--max-active-requests", "65537"],
            ["--worker-threads", "0"],
            ["--worker-threads", "257"],
        ] {
            let e = Config::refusal(&bad);
            assert!(e.contains(bad[0]), "{e}");
        }
    }

    #[test]
    fn watch_flags_reach_the_config_and_are_refused_out_of_range_by_name() {
        let d = Config::defaults();
        assert_eq!(
            d.watch.keepalive(),
            Duration::from_secs(DEFAULT_KEEPALIVE_SECS)
        );
        let c = Config::parse_from([
            "tally",
            "--watch-buffer",
            "7",
            "--watch-max-per-account",
            "3",
            "--watch-max-replay",
            "9",
            "--watch-max-per-caller",
            "4",
        ]);
        assert_eq!((c.watch.buffer, c.watch.max_per_account), (7, 3));
        assert_eq!(c.watch.max_per_caller, 4);
        assert_eq!(c.watch.max_replay, 9);
        for bad in [
            ["--watch-max-subscribers", "0"],
            ["--watch-max-per-account", "0"],
            ["--watch-max-per-caller", "0"],
            ["--watch-buffer", "0"],
            ["--watch-max-replay", "0"],
            ["--watch-keepalive-secs", "0"],
            ["--watch-keepalive-secs", "301"],
        ] {
            let e = Config::refusal(&bad);
            assert!(e.contains(bad[0]), "{e}");
        }
    }

    #[test]
    fn the_bounds_flags_reach_their_configs_and_are_refused_out_of_range() {
        let c = Config::parse_from([
            "tally",
            "--max-index-entries",
            "7",
            "--max-header-bytes",
            "4096",
        ]);
        c.validate().unwrap();
        assert_eq!(c.projection().max_index_entries, 7);
        assert_eq!(c.http.max_header_bytes, 4096);
        let d = Config::defaults();
        assert_eq!(
            (d.projection().max_index_entries, d.http.max_header_bytes),
            (DEFAULT_MAX_INDEX_ENTRIES, DEFAULT_MAX_HEADER_BYTES)
        );
        for bad in [
            ["--max-index-entries", "0"],
            ["--max-header-bytes", "1023"],
            ["--max-header-bytes", "262145"],
        ] {
            let e = Config::refusal(&bad);
            assert!(e.contains(bad[0]), "{e}");
        }
    }

    /// Rule: every count and time flag has a named upper bound, refused by name past it
    /// (several size a semaphore, which would panic at start).
    #[test]
    fn every_count_and_time_flag_is_refused_past_its_bound_by_name() {
        let past = |n: u64| (n + 1).to_string();
        for (flag, value) in [
            (
                "--max-concurrent-requests",
                past(MAX_ACTIVE_REQUESTS as u64),
            ),
            ("--max-connections", past(MAX_CONNECTIONS as u64)),
            ("--max-connections", u64::MAX.to_string()),
            ("--max-live-writes", past(MAX_LIVE_WRITES as u64)),
            ("--max-live-writes", "0".into()),
            (
                "--max-queued-writes-per-account",
                past(MAX_QUEUED_WRITES_PER_ACCOUNT as u64),
            ),
            ("--max-batch-events", past(MAX_BATCH_EVENTS as u64)),
            (
                "--max-resident-accounts",
                past(MAX_RESIDENT_ACCOUNTS as u64),
            ),
            ("--max-index-entries", past(MAX_INDEX_ENTRIES as u64)),
            ("--write-deadline-ms", past(MAX_WRITE_DEADLINE_MS)),
            ("--write-deadline-ms", "0".into()),
            ("--write-max-attempts", past(MAX_WRITE_ATTEMPTS)),
            ("--idle-timeout-secs", past(MAX_IDLE_TIMEOUT_SECS)),
            ("--shutdown-grace-secs", past(MAX_SHUTDOWN_GRACE_SECS)),
            ("--watch-keepalive-secs", u64::MAX.to_string()),
            ("--rate-limit-per-caller", past(MAX_RATE_PER_CALLER.into())),
            ("--rate-limit-burst", u32::MAX.to_string()),
        ] {
            let e = Config::refusal(&[flag, &value, "--idempotency-window", "86400"]);
            assert!(e.contains(flag), "{flag} {value}: {e}");
        }
        let at_the_bounds = Config::parse_from([
            "tally",
            "--max-connections",
            &MAX_CONNECTIONS.to_string(),
            "--max-batch-events",
            &MAX_BATCH_EVENTS.to_string(),
            "--write-max-attempts",
            &MAX_WRITE_ATTEMPTS.to_string(),
            "--rate-limit-per-caller",
            &MAX_RATE_PER_CALLER.to_string(),
            "--rate-limit-burst",
            &MAX_RATE_PER_CALLER.to_string(),
        ]);
        at_the_bounds.validate().unwrap();
    }

    /// Rule: a write's whole life (deadline, plus the store request it may still have out)
    /// fits in the idempotency window, so what it wrote stays in the index while it looks.
    #[test]
    fn a_window_no_longer_than_a_writes_life_is_refused() {
        let c = Config::parse_from(["tally", "--idempotency-window", "5"]);
        let e = c.validate().expect_err("5 s window, 5 s deadline");
        assert!(e.to_string().contains("--idempotency-window"), "{e}");
        // The embedded store has no request timeout: the refusal names only what applies.
        assert!(
            e.to_string()
                .ends_with("must be longer than --write-deadline-ms (5000 ms)"),
            "{e}"
        );
        assert!(!e.to_string().contains("request timeout"), "{e}");
        Config::parse_from(["tally", "--idempotency-window", "6"])
            .validate()
            .unwrap();
        // On Celeriant a last request may still be out for its own timeout (5 s).
        let celeriant = ["tally", "--store", "celeriant", "--idempotency-window"];
        let c = Config::parse_from([&celeriant[..], &["10"]].concat());
        let e = c
            .validate()
            .expect_err("5 s deadline + 5 s request timeout");
        assert!(
            e.to_string().contains(
                "--write-deadline-ms (5000 ms) plus --celeriant-request-timeout-ms (5000 ms), 10000 ms in all"
            ),
            "{e}"
        );
        Config::parse_from([&celeriant[..], &["11"]].concat())
            .validate()
            .unwrap();
    }

    /// Rule: a stalled event stream ends itself (with a final event naming why) before the
    /// connection's write-stall limit closes it silently.
    #[test]
    fn a_write_stall_within_a_streams_own_stall_limit_is_refused() {
        let c = Config::parse_from(["tally", "--write-stall-secs", "30"]);
        let e = c.validate().expect_err("30 s is 2 x the 15 s keep-alive");
        assert!(e.to_string().contains("--write-stall-secs"), "{e}");
        Config::parse_from(["tally", "--write-stall-secs", "31"])
            .validate()
            .unwrap();
        Config::parse_from([
            "tally",
            "--write-stall-secs",
            "3",
            "--watch-keepalive-secs",
            "1",
        ])
        .validate()
        .unwrap();
    }

    /// Rule: the Postgres projection needs its URL and sane pool settings; cursor
    /// and index are one setting, so no flag can split them.
    #[test]
    fn the_postgres_projection_flags_are_checked() {
        let ok = Config::parse_from([
            "tally",
            "--projection",
            "postgres",
            "--postgres-url",
            "postgres://h/db",
        ]);
        assert!(ok.validate().is_ok());
        let settings = ok.postgres().expect("postgres settings");
        assert_eq!(
            settings.pool_size,
            crate::projection::postgres::DEFAULT_POOL_SIZE
        );
        assert!(Config::defaults().postgres().is_none(), "memory by default");
        // On Postgres with a URL, one more flag and its value.
        let pg = |flag, value| {
            vec![
                "tally",
                "--projection",
                "postgres",
                "--postgres-url",
                "x",
                flag,
                value,
            ]
        };
        for bad in [
            vec!["tally", "--projection", "postgres"],
            vec!["tally", "--projection", "postgres", "--postgres-url", ""],
            pg("--postgres-pool-size", "0"),
            pg("--postgres-statement-timeout-ms", "0"),
            pg("--postgres-statement-timeout-ms", "2147483648"),
            vec!["tally", "--idempotency-scan-window", "86401"],
        ] {
            let e = Config::refusal(&bad[1..]);
            assert!(e.contains("--"), "{bad:?}: {e}");
        }
        let scan = Config::parse_from(["tally", "--idempotency-scan-window", "600"]);
        assert_eq!(
            scan.projection().scan_window,
            Some(Duration::from_secs(600))
        );
        assert_eq!(Config::defaults().projection().scan_window, None);
    }

    #[test]
    fn a_bad_fault_spec_is_refused_when_the_flags_are_parsed() {
        let e = Config::try_parse_from(["tally", "--faults", "lost-ack=2"])
            .expect_err("a probability above 1");
        let message = e.to_string();
        assert!(message.contains("--faults"), "{message}");
        assert!(message.contains("lost-ack=2"), "{message}");
    }

    #[test]
    fn a_fault_spec_is_parsed_once_into_its_config() {
        let c = Config::parse_from(["tally", "--faults", "refused=0.5,seed=7"]);
        let expected = FaultConfig {
            refused: 0.5,
            seed: 7,
            ..FaultConfig::default()
        };
        assert_eq!(c.store.faults, Some(expected));
    }
}
