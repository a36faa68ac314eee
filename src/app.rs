//! One running Tally instance: its store, fold, write service and metrics, wired from the
//! configuration. Tests build several over one shared store to form a fleet in one process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::account::{AccountId, Identity};
use crate::auth::Authenticator;
use crate::config::{Config, ConfigError, DEMO_ACCOUNTS, demo_account_id};
use crate::device::ingest::DeviceSync;
use crate::metrics::Metrics;
use crate::projection::{Clock, MonotonicClock, PgProjection, Projection};
use crate::reader::AccountReader;
use crate::stall::StallWatch;
use crate::startup::Startup;
use crate::store::celeriant::CeleriantLog;
use crate::store::combine::CombiningLog;
use crate::store::config::StoreKind;
use crate::store::faults::FaultyLog;
use crate::store::health::StoreHealth;
use crate::store::memory::MemoryLog;
use crate::store::metered::MeteredLog;
use crate::store::probe::SharedPing;
use crate::store::{EventLog, SharedLog};
use crate::watch::{Hub, NoVersion};
use crate::write_loop::WriteService;

/// How often resident accounts are swept for expired index entries and idle accounts.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("could not connect to the store: {0}")]
    Store(String),
    /// The Postgres projection's database.
    #[error("could not open the Postgres projection: {0}")]
    Projection(String),
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
    /// Offline devices' runs: the one path by which a device's client id reaches the store.
    pub devices: DeviceSync,
    /// Who may call, and how often; lets everything through with `--auth none`.
    pub auth: Arc<Authenticator>,
    /// The watch streams: every committed event, from any replica, as it lands.
    pub watch: Arc<Hub>,
    /// The store's liveness for `/readyz`, one ping shared by the probes of a second.
    pub store_ping: SharedPing,
    /// Whether the replica stood still recently: keyed writes read then are refused.
    pub stall: Arc<StallWatch>,
    pub(crate) limiter: Arc<Semaphore>,
    shutting_down: AtomicBool,
    /// The start-up steps (server clock, demo accounts): until every one is done, API
    /// routes answer 503 and `/readyz` lists the pending ones. Its clock task then keeps the
    /// server-clock anchor fresh.
    startup: Startup,
    sweeper: JoinHandle<()>,
    /// The hold sweeper, with `--holds true`.
    hold_sweeper: Option<JoinHandle<()>>,
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
        warn_of_allowed_risks(&config);
        let metrics = Arc::new(Metrics::new());
        // The key files are read before anything is served.
        let auth = Arc::new(Authenticator::new(&config.auth).map_err(ConfigError)?);
        crate::auth::announce_and_maintain(&auth);
        // Only the embedded store this replica opened itself is known to show every create.
        let no_version = if self.store.is_none() && config.store.kind == StoreKind::Memory {
            NoVersion::Proven
        } else {
            NoVersion::Unproven
        };
        let base: SharedLog = match self.store {
            Some(log) => log,
            None => open_store(&config).await?,
        };
        let (log, faults, health) = layer_store(base, &config, &metrics);
        let clock = self
            .clock
            .unwrap_or_else(|| Arc::new(MonotonicClock::new()));
        let projection = Arc::new(open_projection(&config, &log, identity, clock, &metrics)?);
        // Group commit sits between the runs and the store, above the meter (so the store's
        // request counts are requests sent); nothing else writes through it.
        let combined: SharedLog = Arc::new(CombiningLog::new(
            log.clone(),
            config.combine(),
            metrics.clone(),
        ));
        let writes = Arc::new(
            WriteService::new(projection.clone(), config.write())
                .with_log(combined)
                .with_health(health),
        );
        let reader = AccountReader::new(projection.clone()).with_accounts(config.accounts);
        let devices = DeviceSync::new(log.clone(), identity).with_accounts(config.accounts);
        let watch = Hub::new(
            projection.clone(),
            metrics.clone(),
            config.watch.clone(),
            no_version,
        );
        // Each step is tried once before this returns (or for `FIRST_ATTEMPTS_WAIT`), so a
        // healthy store starts ready; a store that is down, faulty or slow at boot does not
        // stop the replica: each pending step is retried on its own in the background.
        let startup = Startup::begin(
            projection.clone(),
            metrics.clone(),
            config.seeds_demo_accounts(),
        )
        .await;
        let sweeper = tokio::spawn(
            projection
                .clone()
                .run_sweeper(SWEEP_INTERVAL, std::future::pending()),
        );
        let hold_sweeper = config.holds.then(|| {
            tokio::spawn(
                writes
                    .clone()
                    .run_hold_sweeper(config.hold_sweep_interval(), config.hold_sweep_budget),
            )
        });
        Ok(Arc::new(App {
            store_ping: SharedPing::default(),
            stall: StallWatch::start(metrics.clone(), config.http.max_queue_wait()),
            limiter: Arc::new(Semaphore::new(config.http.max_concurrent_requests)),
            config,
            identity,
            metrics,
            log,
            faults,
            projection,
            writes,
            reader,
            devices,
            auth,
            watch,
            shutting_down: AtomicBool::new(false),
            startup,
            sweeper,
            hold_sweeper,
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
        // Watch streams never end by themselves: end them, so connections can drain.
        self.watch.shutdown();
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Every start-up step (server clock, demo accounts) is done.
    pub fn is_started(&self) -> bool {
        self.startup.is_done()
    }

    /// The start-up steps not done yet, by their fixed names (`serverClock`,
    /// `seed:<demo name>`); empty once started.
    pub fn startup_waiting(&self) -> Vec<String> {
        self.startup.waiting()
    }

    /// Resolves once every start-up step is done.
    pub async fn started(&self) {
        self.startup.done().await;
    }
}

impl Drop for App {
    fn drop(&mut self) {
        // The start-up tasks are aborted when `startup` drops.
        self.sweeper.abort();
        if let Some(hold_sweeper) = &self.hold_sweeper {
            hold_sweeper.abort();
        }
        self.watch.shutdown();
    }
}

/// Warns of settings that are allowed but leave something without room.
fn warn_of_allowed_risks(config: &Config) {
    // Allowed (a write's life fits the window, which `validate` checks), but a retry
    // after a 409, 503 or 500 from the write side has no time it is known safe in: those
    // answers say `Idempotency-Window: 0` (`http/writes.rs`).
    let retry_room = config.write_life() + config.retry_lookup_room() + Duration::from_secs(1);
    if Duration::from_secs(config.idempotency_window) < retry_room {
        tracing::warn!(
            window_secs = config.idempotency_window,
            needed_ms = retry_room.as_millis() as u64,
            "the idempotency window leaves a retry no time it is known safe in: a non-final write answer says Idempotency-Window: 0"
        );
    }
    // Allowed (small caps in tests and demos), but each watch stream holds a connection
    // for as long as it lasts: at the connection cap watchers alone would leave no room
    // for requests on the API address.
    if config.watch.max_subscribers >= config.http.max_connections {
        tracing::warn!(
            watch_max_subscribers = config.watch.max_subscribers,
            max_connections = config.http.max_connections,
            "--watch-max-subscribers is not below --max-connections: watch streams alone can hold every API connection"
        );
    }
}

/// The store as the rest of Tally sees it: `base`, behind fault injection when the
/// configuration asks for it, then metered. Returns it, the fault layer, if any, and the
/// store's health as its calls find it.
fn layer_store(
    base: SharedLog,
    config: &Config,
    metrics: &Arc<Metrics>,
) -> (SharedLog, Option<Arc<FaultyLog>>, Arc<StoreHealth>) {
    let (inner, faults): (SharedLog, _) = match &config.store.faults {
        Some(fc) => {
            tracing::warn!(spec = ?fc, "FAULT INJECTION IS ON: the store will lose acks, drop requests and lag reads on purpose");
            let f = Arc::new(FaultyLog::new(base, fc.clone()));
            (f.clone(), Some(f))
        }
        None => (base, None),
    };
    // The console's fault panel shows when this is 1.
    metrics
        .fault_injection_enabled
        .set(i64::from(faults.is_some()));
    let health = Arc::new(StoreHealth::new(
        config.store.describe(),
        Some(metrics.clone()),
    ));
    let log: SharedLog = Arc::new(MeteredLog::new(inner, metrics.clone(), health.clone()));
    (log, faults, health)
}

/// The projection the configuration names, over `log`.
fn open_projection(
    config: &Config,
    log: &SharedLog,
    identity: Identity,
    clock: Arc<dyn Clock>,
    metrics: &Arc<Metrics>,
) -> Result<Projection, StartError> {
    Ok(match config.postgres() {
        None => Projection::new(
            log.clone(),
            identity,
            config.projection(),
            clock,
            metrics.clone(),
        ),
        // The Postgres projection: the pool now (a bad URL is fatal), the
        // migrations as a start-up step (a database that is down at boot is not).
        Some(settings) => {
            let pg = PgProjection::new(&settings, metrics.clone())
                .map_err(|e| StartError::Projection(e.to_string()))?;
            Projection::with_postgres(
                log.clone(),
                identity,
                config.projection(),
                clock,
                metrics.clone(),
                pg,
            )
        }
    })
}

async fn open_store(config: &Config) -> Result<SharedLog, StartError> {
    match config.store.kind {
        StoreKind::Memory => Ok(Arc::new(MemoryLog::new())),
        StoreKind::Celeriant => {
            let log = Arc::new(
                CeleriantLog::connect(&config.store.celeriant)
                    .map_err(|e| StartError::Store(e.to_string()))?,
            );
            // A store that is down at boot is not fatal: the replica starts not ready
            // (`/readyz` answers 503) and recovers when the store does, instead of
            // crash-looping through a transient outage. The first ping only tells the log,
            // so it runs beside start-up: a store that accepts connections and never answers
            // held it for two request timeouts, and the replica did not listen until then.
            let (ping, address) = (log.clone(), config.store.celeriant.address.clone());
            tokio::spawn(async move {
                if let Err(e) = ping.ping().await {
                    tracing::warn!(%address, error = %e, "Celeriant does not answer yet; not ready until it does");
                }
            });
            Ok(log)
        }
    }
}
