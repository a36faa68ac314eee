//! One running Tally instance: its store, fold, write service and metrics, wired from the
//! configuration. Tests build several over one shared store to form a fleet in one process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::account::{AccountEvent, AccountId, Identity};
use crate::config::{Config, ConfigError, DEMO_ACCOUNTS, StoreKind, demo_account_id};
use crate::metrics::Metrics;
use crate::projection::{Clock, MonotonicClock, Projection, SERVER_CLOCK_RESYNC};
use crate::reader::AccountReader;
use crate::store::EventLog;
use crate::store::celeriant::CeleriantLog;
use crate::store::faults::FaultyLog;
use crate::store::memory::MemoryLog;
use crate::store::metered::MeteredLog;
use crate::store::{AggregateWrite, Event, SharedLog, StoreError};
use crate::write_loop::WriteService;

/// How often resident accounts are swept for expired index entries and idle accounts.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// The client sequence of a demo account's opening deposit: its stream's first own event.
const SEED_CLIENT_SEQ: u64 = 1;
/// First wait before the start-up work (server clock, demo accounts) is tried again when the
/// store did not take it; doubles per attempt up to [`STARTUP_RETRY_MAX`].
const STARTUP_RETRY_BASE: Duration = Duration::from_millis(200);
const STARTUP_RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("could not connect to the store: {0}")]
    Store(String),
}

pub struct App {
    pub config: Config,
    pub identity: Identity,
    pub metrics: Arc<Metrics>,
    /// The store as the rest of Tally sees it (metered, and fault-injected when asked).
    pub log: SharedLog,
    pub faults: Option<Arc<FaultyLog>>,
    pub projection: Arc<Projection>,
    pub writes: Arc<WriteService>,
    /// Balance and history reads.
    pub reader: AccountReader,
    pub(crate) limiter: Arc<Semaphore>,
    shutting_down: AtomicBool,
    /// The start-up work is done: the server clock anchored and the demo accounts seeded
    /// (when asked). Until then API routes answer 503 and `/readyz` says not ready.
    started: watch::Receiver<bool>,
    sweeper: JoinHandle<()>,
    /// Finishes the start-up work if it failed at first, then re-anchors the server clock
    /// every [`SERVER_CLOCK_RESYNC`].
    clock_task: JoinHandle<()>,
}

/// Builds an [`App`]; the store and clock can be supplied (tests, in-process fleets).
pub struct AppBuilder {
    config: Config,
    store: Option<SharedLog>,
    clock: Option<Arc<dyn Clock>>,
}

impl AppBuilder {
    /// Use this store instead of the one the configuration names.
    pub fn store(mut self, log: SharedLog) -> Self {
        self.store = Some(log);
        self
    }

    /// Use this clock for index lifetimes instead of the process's monotonic clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    pub async fn build(self) -> Result<Arc<App>, StartError> {
        let config = self.config;
        config.validate()?;
        let identity = config.identity();
        let metrics = Arc::new(Metrics::new());
        let base: SharedLog = match self.store {
            Some(log) => log,
            None => open_store(&config).await?,
        };
        let (inner, faults): (SharedLog, _) = match &config.faults {
            Some(fc) => {
                tracing::warn!(spec = ?fc, "FAULT INJECTION IS ON: the store will lose acks, drop requests and lag reads on purpose");
                let f = Arc::new(FaultyLog::new(base, fc.clone()));
                (f.clone(), Some(f))
            }
            None => (base, None),
        };
        let log: SharedLog = Arc::new(MeteredLog::new(inner, metrics.clone()));
        let clock = self
            .clock
            .unwrap_or_else(|| Arc::new(MonotonicClock::new()));
        let projection = Arc::new(Projection::new(
            log.clone(),
            identity,
            config.projection(),
            clock,
            metrics.clone(),
        ));
        let writes = Arc::new(WriteService::new(projection.clone(), config.write()));
        let reader = AccountReader::new(projection.clone());
        // Tried once now, so a healthy store starts ready; a store that is down or faulty at
        // boot does not stop the replica: the work is retried in the background.
        let (started_tx, started) = watch::channel(false);
        let seed = config.seeds_demo_accounts();
        let first = start_up(&projection, seed).await;
        if let Err(e) = &first {
            tracing::warn!(error = %e, "start-up work not done yet (server clock, demo accounts); retrying in the background, not serving until it is");
        } else {
            started_tx.send_replace(true);
        }
        let clock_task = {
            let projection = projection.clone();
            tokio::spawn(async move {
                if first.is_err() {
                    retry_start_up(&projection, seed).await;
                    started_tx.send_replace(true);
                }
                resync_server_clock(&projection).await;
            })
        };
        let sweeper = tokio::spawn(
            projection
                .clone()
                .run_sweeper(SWEEP_INTERVAL, std::future::pending()),
        );
        Ok(Arc::new(App {
            limiter: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            config,
            identity,
            metrics,
            log,
            faults,
            projection,
            writes,
            reader,
            shutting_down: AtomicBool::new(false),
            started,
            sweeper,
            clock_task,
        }))
    }
}

impl App {
    pub fn builder(config: Config) -> AppBuilder {
        AppBuilder {
            config,
            store: None,
            clock: None,
        }
    }

    /// The demo accounts this instance serves in `GET /api/accounts`.
    pub fn demo_accounts(&self) -> Vec<(AccountId, &'static str)> {
        if !self.config.seeds_demo_accounts() {
            return Vec::new();
        }
        DEMO_ACCOUNTS
            .iter()
            .map(|(name, _)| (AccountId(demo_account_id(name)), *name))
            .collect()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// The start-up work (server clock, demo accounts) is done.
    pub fn is_started(&self) -> bool {
        *self.started.borrow()
    }

    /// Resolves once the start-up work is done.
    pub async fn started(&self) {
        let mut started = self.started.clone();
        // An error means the task ended without finishing: it was aborted with the app.
        let _ = started.wait_for(|done| *done).await;
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.sweeper.abort();
        self.clock_task.abort();
    }
}

/// What a replica does once before it serves: anchor its estimate of the server's now, which
/// ages the recent-writes index, then seed the demo accounts (when asked).
async fn start_up(projection: &Projection, seed: bool) -> Result<(), StoreError> {
    let server_ms = projection.sync_server_clock().await?;
    tracing::debug!(server_ms, "server clock anchored");
    if seed {
        seed_demo_accounts(projection.log(), projection.identity()).await?;
    }
    Ok(())
}

/// Re-anchors the estimate of the server's now, for the replica's lifetime. A failed probe
/// keeps the old anchor (reads still raise it) and is tried again next period.
async fn resync_server_clock(projection: &Projection) {
    loop {
        tokio::time::sleep(SERVER_CLOCK_RESYNC).await;
        if let Err(e) = projection.sync_server_clock().await {
            tracing::warn!(error = %e, "could not re-anchor the server clock; keeping the last anchor");
        }
    }
}

async fn retry_start_up(projection: &Projection, seed: bool) {
    let mut wait = STARTUP_RETRY_BASE;
    loop {
        tokio::time::sleep(wait).await;
        match start_up(projection, seed).await {
            Ok(()) => {
                tracing::info!("start-up work done (server clock, demo accounts)");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "start-up work failed; retrying");
                wait = (wait * 2).min(STARTUP_RETRY_MAX);
            }
        }
    }
}

async fn open_store(config: &Config) -> Result<SharedLog, StartError> {
    match config.store {
        StoreKind::Memory => Ok(Arc::new(MemoryLog::new())),
        StoreKind::Celeriant => {
            let log = CeleriantLog::connect(&config.celeriant)
                .map_err(|e| StartError::Store(e.to_string()))?;
            // A store that is down at boot is not fatal: the replica starts not ready
            // (`/readyz` answers 503) and recovers when the store does, instead of
            // crash-looping through a transient outage.
            if let Err(e) = log.ping().await {
                tracing::warn!(address = %config.celeriant.address, error = %e, "Celeriant does not answer yet; not ready until it does");
            }
            Ok(Arc::new(log))
        }
    }
}

/// Seeds each demo account with its opening deposit, create-only (expected version 0), so a
/// fleet of replicas seeds each account exactly once.
async fn seed_demo_accounts(log: &SharedLog, identity: &Identity) -> Result<(), StoreError> {
    for (name, cents) in DEMO_ACCOUNTS {
        let account = AccountId(demo_account_id(name));
        let event = AccountEvent::Deposited { amount: cents };
        let write = AggregateWrite {
            key: identity.key(account),
            events: vec![Event {
                client_seq: SEED_CLIENT_SEQ,
                event_id: Some(demo_account_id(&format!("seed:{name}")).as_u128()),
                event_type: event.event_type(),
                payload: event.encode(),
                timestamp_ms: 0,
            }],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: true,
        };
        match log.write(identity.client(), vec![write]).await {
            // Already there (a sibling replica, or an earlier run on a durable store).
            Ok(_) | Err(StoreError::Conflict { .. } | StoreError::IdempotencyViolation { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
