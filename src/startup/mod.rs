//! The work a replica does before it serves, and the clock upkeep it does while it runs.
//!
//! Start-up is a set of independent steps: anchoring the replica's estimate of the server's
//! now (which ages the recent-writes index), on the Postgres projection its migrations, and,
//! when asked, one create-only seed per demo account (see [`seed`]). Each step runs in its own task and retries on its own, with a
//! capped, deterministically jittered backoff: a step that succeeded is never redone, and
//! one step's failure never restarts another. Every step needs only its own store calls to
//! succeed, so a faulty store slows start-up down instead of stalling it.
//!
//! The replica serves the API once every step is done; until then `/readyz` lists the steps
//! still pending, and `tally_startup_steps_pending` counts them. Once anchored, the clock
//! step re-anchors every [`SERVER_CLOCK_RESYNC`]; a failed re-anchor keeps the old anchor
//! and retries with the same short backoff, and never touches readiness.

pub mod seed;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::backoff::Backoff;
use crate::metrics::Metrics;
use crate::projection::postgres::PgError;
use crate::projection::{Backend, Projection, SERVER_CLOCK_RESYNC};
use crate::store::StoreError;
use seed::{DEMO_ACCOUNTS, DemoSeed, SeedOutcome, SeedPending};

/// First wait before a failed step is tried again; doubles per attempt up to
/// [`STEP_RETRY_MAX`]. Each wait is jittered within its upper half.
pub const STEP_RETRY_BASE: Duration = Duration::from_millis(50);
/// The longest wait between two attempts of one step (start-up or re-anchor). Bounds how
/// long a replica stays unready after the store recovers, and how often each step knocks on
/// a store that is down.
pub const STEP_RETRY_MAX: Duration = Duration::from_secs(1);
/// The waits between two attempts of one step (see [`retry_delay`]).
const STEP_RETRY: Backoff = Backoff::new(STEP_RETRY_BASE, STEP_RETRY_MAX);
/// How long a replica waits for its steps' first attempts before it listens anyway (not
/// ready): a healthy store answers far sooner, and a store that holds every call must not
/// keep `/healthz` and `/readyz` from answering.
pub const FIRST_ATTEMPTS_WAIT: Duration = Duration::from_secs(2);
/// The name of the server-clock step, in `/readyz` and the metrics' `step` label.
pub const SERVER_CLOCK_STEP: &str = "serverClock";
/// The name of the Postgres projection's migration step.
pub const MIGRATIONS_STEP: &str = "postgresMigrations";

/// The name of a demo account's seed step: `seed:<name>`, from the fixed demo list.
pub fn seed_step_name(account: &str) -> String {
    format!("seed:{account}")
}

/// Where start-up stands.
#[derive(Clone, Debug, Default)]
struct Progress {
    /// Steps not done yet, in plan order. Empty: started.
    pending: Vec<String>,
    /// Steps that have not finished their first attempt yet.
    untried: usize,
    /// The store checks' first run (`projection/regress.rs`) is still to come after a
    /// first server-clock attempt that succeeded; `begin` waits for it within its bound.
    first_check_due: bool,
}

/// The start-up steps of one replica: their progress, and the tasks running them (aborted
/// on drop).
pub struct Startup {
    progress: watch::Receiver<Progress>,
    tasks: Vec<JoinHandle<()>>,
}

impl Startup {
    /// Starts every step in its own task and returns once each has been tried once (and,
    /// when the clock's first try succeeded, the store checks have their baseline), so a
    /// healthy store starts ready; steps that failed go on retrying in the background.
    pub async fn begin(projection: Arc<Projection>, metrics: Arc<Metrics>, seed: bool) -> Self {
        let mut steps = vec![StartupStep::ServerClock];
        if projection.uses_database() {
            steps.push(StartupStep::Migrations);
        }
        if seed {
            steps.extend(DEMO_ACCOUNTS.iter().map(|&(name, cents)| {
                StartupStep::Seed(DemoSeed::new(projection.identity(), name, cents))
            }));
        }
        let names: Vec<String> = steps.iter().map(StartupStep::name).collect();
        let (tx, progress) = watch::channel(Progress {
            untried: names.len(),
            pending: names,
            first_check_due: true,
        });
        metrics.startup_steps_pending.set(steps.len() as i64);
        let tx = Arc::new(tx);
        let mut tasks: Vec<JoinHandle<()>> = steps
            .into_iter()
            .map(|step| {
                let runner = Runner {
                    name: step.name(),
                    projection: projection.clone(),
                    metrics: metrics.clone(),
                    progress: tx.clone(),
                };
                tokio::spawn(runner.run(step))
            })
            .collect();
        // Not a step (nothing waits for it): the checkpoint writer lives as long as the
        // replica, and goes with these tasks.
        tasks.push(tokio::spawn(projection.clone().run_checkpoint_writer()));
        // Owned before the wait, so a caller that gives up on `begin` aborts the tasks.
        let mut startup = Self { progress, tasks };
        // An error means every step's task is gone, which a running replica never sees; a
        // timeout, that a first attempt is still waiting on the store.
        let _ = tokio::time::timeout(
            FIRST_ATTEMPTS_WAIT,
            startup
                .progress
                .wait_for(|p| p.untried == 0 && !p.first_check_due),
        )
        .await;
        match startup.waiting().as_slice() {
            [] => tracing::info!("start-up done"),
            waiting => tracing::warn!(
                ?waiting,
                "start-up not done yet; retrying each pending step on its own, not serving until they are done"
            ),
        }
        startup
    }

    /// Every step is done.
    pub fn is_done(&self) -> bool {
        self.progress.borrow().pending.is_empty()
    }

    /// The steps not done yet, in plan order (`serverClock`, then `seed:<name>` per demo
    /// account).
    pub fn waiting(&self) -> Vec<String> {
        self.progress.borrow().pending.clone()
    }

    /// Resolves once every step is done.
    pub async fn done(&self) {
        let mut progress = self.progress.clone();
        // An error means the steps' tasks are gone without finishing: aborted with the app.
        let _ = progress.wait_for(|p| p.pending.is_empty()).await;
    }
}

impl Drop for Startup {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// One piece of start-up work.
enum StartupStep {
    ServerClock,
    /// The Postgres projection's migrations: nothing is served before its tables
    /// exist.
    Migrations,
    Seed(DemoSeed),
}

impl StartupStep {
    fn name(&self) -> String {
        match self {
            StartupStep::ServerClock => SERVER_CLOCK_STEP.to_string(),
            StartupStep::Migrations => MIGRATIONS_STEP.to_string(),
            StartupStep::Seed(seed) => seed_step_name(seed.name()),
        }
    }
}

/// Why a step is not done yet.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Seed(#[from] SeedPending),
    #[error(transparent)]
    Projection(#[from] PgError),
}

/// Runs one step to completion, then (for the clock) keeps the anchor fresh.
struct Runner {
    name: String,
    projection: Arc<Projection>,
    metrics: Arc<Metrics>,
    progress: Arc<watch::Sender<Progress>>,
}

impl Runner {
    async fn run(self, mut step: StartupStep) {
        let salt = jitter_salt(&self.name);
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            let result = self.attempt(&mut step).await;
            let first = attempt == 1;
            let done = result.is_ok();
            let label = if done { "done" } else { "failed" };
            self.metrics
                .startup_step_attempts
                .with_label_values(&[&self.name, label])
                .inc();
            if let Err(e) = &result {
                tracing::warn!(step = %self.name, attempt, error = %e, "start-up step not done yet; retrying it");
            }
            let mut pending = 0;
            let server_clock = matches!(step, StartupStep::ServerClock);
            self.progress.send_modify(|p| {
                if first {
                    p.untried -= 1;
                    // Failed, the clock's step leaves the first check to its later success,
                    // which `begin` does not wait for.
                    if server_clock && !done {
                        p.first_check_due = false;
                    }
                }
                if done {
                    p.pending.retain(|s| *s != self.name);
                    // Set under the channel's lock, so concurrent steps never leave it stale.
                    self.metrics
                        .startup_steps_pending
                        .set(p.pending.len() as i64);
                }
                pending = p.pending.len();
            });
            if done {
                tracing::info!(step = %self.name, attempt, pending, "start-up step done");
                break;
            }
            tokio::time::sleep(retry_delay(attempt, salt)).await;
        }
        if matches!(step, StartupStep::ServerClock) {
            self.keep_server_clock_anchored(salt).await;
        }
    }

    async fn attempt(&self, step: &mut StartupStep) -> Result<(), StepError> {
        match step {
            StartupStep::ServerClock => Ok(self.anchor().await.map(|_| ())?),
            StartupStep::Migrations => match self.projection.backend() {
                Backend::Postgres(pg) => {
                    pg.migrate().await?;
                    // The rows' store before serving them (`projection/regress.rs`): a
                    // replica started on a store replaced under them must not serve them.
                    // An answer that proves nothing is left for the first re-anchor.
                    self.projection.check_store().await;
                    Ok(())
                }
                Backend::Memory => Ok(()),
            },
            StartupStep::Seed(seed) => {
                let outcome = seed.attempt(self.projection.log().as_ref()).await?;
                self.metrics
                    .startup_seed_outcomes
                    .with_label_values(&[outcome.label()])
                    .inc();
                if outcome == SeedOutcome::Found {
                    tracing::info!(
                        account = seed.name(),
                        "demo account seed found landed (an earlier attempt or a sibling wrote it)"
                    );
                }
                // Every outcome means the account exists. Known so, its first write reads
                // it first; unknown, that write would take it as new and bounce off the
                // version guard (a wasted round trip, counted apart from contention as a
                // first touch's bounce).
                self.projection.remember_existing(seed.account());
                Ok(())
            }
        }
    }

    /// One anchor of the server clock, counted.
    async fn anchor(&self) -> Result<u64, StoreError> {
        let result = self.projection.sync_server_clock().await;
        let label = if result.is_ok() { "ok" } else { "failed" };
        self.metrics
            .server_clock_anchors
            .with_label_values(&[label])
            .inc();
        if let Ok(server_ms) = &result {
            tracing::debug!(server_ms, "server clock anchored");
        }
        result
    }

    /// Re-anchors every [`SERVER_CLOCK_RESYNC`], for the replica's lifetime. A failed anchor
    /// keeps the old one (reads still raise it) and is retried with the start-up backoff;
    /// readiness is not touched, and no request waits on it. After the start-up anchor and
    /// each re-anchor, the checks that the store did not go backwards
    /// (`projection/regress.rs`). The first runs at once, not a re-anchor later: its
    /// baseline is then the store this replica started on, so a store replaced in the
    /// replica's first minute is caught at its first re-anchor too.
    async fn keep_server_clock_anchored(&self, salt: u64) {
        self.projection.check_store().await;
        self.progress.send_modify(|p| p.first_check_due = false);
        loop {
            tokio::time::sleep(SERVER_CLOCK_RESYNC).await;
            let mut attempt: u32 = 0;
            loop {
                attempt += 1;
                match self.anchor().await {
                    Ok(_) => {
                        self.projection.check_store().await;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(attempt, error = %e, "could not re-anchor the server clock; keeping the last anchor and retrying");
                        tokio::time::sleep(retry_delay(attempt, salt)).await;
                    }
                }
            }
        }
    }
}

/// The wait after failed attempt `attempt` (1-based): [`STEP_RETRY_BASE`] doubled per
/// attempt, capped at [`STEP_RETRY_MAX`], then jittered into the upper half of that, from
/// `salt` and `attempt` alone, so a run is reproducible and steps do not retry in lockstep.
pub fn retry_delay(attempt: u32, salt: u64) -> Duration {
    STEP_RETRY.wait(attempt, mix64(salt ^ u64::from(attempt)))
}

/// A step's jitter salt: a hash of its fixed name (FNV-1a).
fn jitter_salt(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: the backoff doubles from the base, never exceeds the cap, and stays in the
    /// upper half of each step's bound (bounded, never zero).
    #[test]
    fn retry_delay_doubles_from_the_base_up_to_the_cap_within_its_upper_half() {
        let salt = jitter_salt(SERVER_CLOCK_STEP);
        for attempt in 1..=40 {
            let cap = STEP_RETRY_BASE
                .saturating_mul(1 << (attempt - 1).min(16))
                .min(STEP_RETRY_MAX);
            let d = retry_delay(attempt, salt);
            assert!(
                d >= cap / 2 && d < cap,
                "attempt {attempt}: {d:?} vs {cap:?}"
            );
        }
        assert!(retry_delay(1, salt) < STEP_RETRY_BASE);
        assert!(retry_delay(40, salt) >= STEP_RETRY_MAX / 2);
    }

    /// Rule: a step's waits are pinned: 50 ms doubling per attempt to 1 s, jittered into
    /// the upper half by the step's name and the attempt.
    #[test]
    fn retry_delays_are_pinned() {
        let salt = jitter_salt(SERVER_CLOCK_STEP);
        let waits: Vec<u128> = (1..=7).map(|a| retry_delay(a, salt).as_nanos()).collect();
        assert_eq!(
            waits,
            [
                36_786_148,
                71_235_853,
                169_572_958,
                219_138_660,
                509_408_173,
                816_293_184,
                825_186_238
            ]
        );
    }

    /// Rule: the jitter is a function of the step and the attempt: the same run twice waits
    /// the same, and two steps do not wait the same.
    #[test]
    fn retry_delay_is_deterministic_per_step_and_differs_between_steps() {
        let clock = jitter_salt(SERVER_CLOCK_STEP);
        let alice = jitter_salt(&seed_step_name("Alice"));
        let bob = jitter_salt(&seed_step_name("Bob"));
        let waits = |salt| (1..=8).map(|a| retry_delay(a, salt)).collect::<Vec<_>>();
        assert_eq!(waits(clock), waits(clock));
        assert_ne!(waits(clock), waits(alice));
        assert_ne!(waits(alice), waits(bob));
    }
}
