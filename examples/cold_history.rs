//! Long account histories for the cold-account measurements (BENCHMARKS.md, "Cold accounts";
//! `scripts/bench-cold.sh` drives it):
//!
//! - `fill`: writes account histories to a real Celeriant server fast, many events per store
//!   write, exactly as Tally's own batched deposits look on the stream (our client id, one
//!   event id and client sequence per event, `{"AmountCents":100}`), each write guarded on
//!   the version it extends;
//! - `trim`: trims one account with the store's own trim (`EventLog::trim_start`);
//! - `embedded`: the same measurements on the embedded store. That store lives inside one
//!   process, so a fresh replica cannot be another process: here it is a fresh [`App`] (its
//!   own projection, write service and HTTP listener) over the one `MemoryLog`, which is how
//!   the test suites form a fleet in one process. Each figure is one HTTP request to it, as
//!   `curl` sends one to a `tally` process on Celeriant. The store's clock is a manual one:
//!   "older than the window" is the store's clock moved past it, not a wait.
//!
//! Every figure is printed as one line `<what> key=value ...` so a script can collect them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tally::account::{AccountEvent, AccountId, Identity};
use tally::app::App;
use tally::config::Config;
use tally::store::celeriant::{CeleriantConfig, CeleriantLog};
use tally::store::memory::{MemoryLog, MemoryOptions, ServerClock};
use tally::store::{
    AggregateWrite, EventLog, ReadFilter, SharedLog, StoreError, StoreResult, wall_clock_ms,
};
use tokio::task::JoinSet;
use uuid::Uuid;

/// Events per store write unless `--batch-events` says otherwise: Tally's own
/// `--max-batch-events` default, the densest stream Tally itself writes (a hot account's
/// queue goes out in batches of at most this many).
const DEFAULT_BATCH_EVENTS: usize = 64;
/// The most events one store write may carry here: Tally's own `--max-batch-events` limit.
const MAX_BATCH_EVENTS: usize = tally::write_loop::config::MAX_BATCH_EVENTS;
/// Every history event deposits this much, so a fold's balance is checkable: 100 x events.
const AMOUNT_CENTS: i64 = 100;
/// The most accounts `fill` writes at once: the store client's default pool size.
const MAX_FILL_CONCURRENCY: usize = 64;
/// How long one measured request may take before the run fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Parser)]
#[command(about = "Account histories for the cold-account measurements")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write histories to a Celeriant server: each ACCOUNT=EVENTS appends EVENTS deposits to
    /// ACCOUNT (a UUID), after whatever it holds; the accounts are written concurrently.
    Fill(FillArgs),
    /// Trim an account on a Celeriant server with the store's trim.
    Trim(TrimArgs),
    /// Cold-account figures on the embedded store, in this process.
    Embedded(EmbeddedArgs),
    /// Spread deposits over ACCOUNTS from the moment replicas start, reporting p99 per
    /// second and when it is back under the objective: the fleet-restart figure.
    Restart(RestartArgs),
}

#[derive(Args)]
struct FillArgs {
    #[command(flatten)]
    celeriant: CeleriantConfig,
    #[arg(long, default_value_t = DEFAULT_BATCH_EVENTS, value_parser = tally::flag::count(MAX_BATCH_EVENTS))]
    batch_events: usize,
    /// Seed of the event ids.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Accounts written at once (each one write at a time); below the store client's pool
    /// size, whose connections are waited for only so long.
    #[arg(long, default_value_t = 16, value_parser = tally::flag::count(MAX_FILL_CONCURRENCY))]
    concurrency: usize,
    /// ACCOUNT=EVENTS pairs.
    #[arg(required = true, value_parser = parse_fill)]
    accounts: Vec<(Uuid, u64)>,
}

#[derive(Args)]
struct TrimArgs {
    #[command(flatten)]
    celeriant: CeleriantConfig,
    account: Uuid,
    /// First version kept; default the newest (the store never trims its newest batch).
    #[arg(long)]
    keep_from: Option<u64>,
}

#[derive(Args)]
struct EmbeddedArgs {
    /// History sizes, in events.
    #[arg(long, value_delimiter = ',', default_value = "10,10000,100000,1000000")]
    sizes: Vec<u64>,
    /// Fresh replicas per figure.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = DEFAULT_BATCH_EVENTS, value_parser = tally::flag::count(MAX_BATCH_EVENTS))]
    batch_events: usize,
    /// The replicas' `--idempotency-window`, in seconds.
    #[arg(long, default_value_t = 90)]
    window_secs: u64,
    /// The hot accounts: this much history older than the window (one account each)...
    #[arg(long, value_delimiter = ',', default_value = "10,100000")]
    hot_history: Vec<u64>,
    /// ...and then this many events inside it.
    #[arg(long, default_value_t = 10_000)]
    hot_window_events: u64,
    /// Events of the account that is trimmed (to its newest batch) before it is read cold.
    #[arg(long, default_value_t = 100_000)]
    trimmed_events: u64,
    /// After the fill, one replica reads every account once, as a replica serving them would
    /// have (whatever a fold leaves behind for later replicas is then there), and stays up
    /// `--prime-wait-secs` after.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prime: bool,
    #[arg(long, default_value_t = 5)]
    prime_wait_secs: u64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Args)]
struct RestartArgs {
    /// The replicas' base URLs, comma-separated; connections go round them.
    #[arg(long, value_delimiter = ',', required = true)]
    targets: Vec<String>,
    /// A file with one account id per line: the deposits spread over these.
    #[arg(long)]
    accounts: std::path::PathBuf,
    #[arg(long, default_value_t = 64)]
    connections: usize,
    #[arg(long, default_value_t = 30)]
    duration_secs: u64,
    /// The latency objective p99 must be back under, in ms.
    #[arg(long, default_value_t = 50.0)]
    objective_ms: f64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn parse_fill(s: &str) -> Result<(Uuid, u64), String> {
    let (id, n) = s.split_once('=').ok_or("expected ACCOUNT=EVENTS")?;
    let id = Uuid::parse_str(id).map_err(|e| format!("account {id:?}: {e}"))?;
    let n = n.parse().map_err(|e| format!("events {n:?}: {e}"))?;
    Ok((id, n))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match Cli::parse().cmd {
        Cmd::Fill(args) => fill_celeriant(args).await,
        Cmd::Trim(args) => trim_celeriant(args).await,
        Cmd::Embedded(args) => embedded(args).await,
        Cmd::Restart(args) => restart(args).await,
    }
}

/// What one account's fill did.
struct Filled {
    events: u64,
    writes: u64,
    tip: u64,
    elapsed: Duration,
}

/// Where an account's stream ends: its version and our client id's highest sequence there.
async fn stream_end(
    log: &dyn EventLog,
    identity: &Identity,
    account: AccountId,
) -> StoreResult<(u64, u64)> {
    let key = identity.key(account);
    let tip = match log.details(key).await {
        Ok(d) => d.max_version,
        Err(StoreError::AggregateNotFound) => return Ok((0, 0)),
        Err(e) => return Err(e),
    };
    if tip == 0 {
        return Ok((0, 0));
    }
    // Our sequences only ever rise along the stream, so the newest batch of ours holds the
    // highest; another writer's batch on top would hide it, which this tool never meets.
    let page = log.read(key, &ReadFilter::from_version(tip)).await?;
    let seq = page
        .batches
        .iter()
        .filter(|b| b.client_id == identity.client())
        .map(|b| b.max_client_seq())
        .max()
        .unwrap_or(0);
    Ok((tip, seq))
}

/// Appends `events` deposits to `account`, `batch` per store write, each write guarded on
/// the version before it (as Tally writes) so nothing lands twice or out of order.
async fn fill(
    log: &dyn EventLog,
    identity: &Identity,
    account: AccountId,
    events: u64,
    batch: usize,
    rng: &mut ChaCha8Rng,
) -> StoreResult<Filled> {
    let started = Instant::now();
    let (mut version, mut seq) = stream_end(log, identity, account).await?;
    let deposit = AccountEvent::Deposited {
        amount: AMOUNT_CENTS,
    };
    let payload: Bytes = deposit.encode();
    let (mut written, mut writes) = (0, 0);
    while written < events {
        let n = (events - written).min(batch as u64);
        let now = wall_clock_ms();
        let batch_events = (0..n)
            .map(|i| tally::store::Event {
                client_seq: seq + 1 + i,
                event_id: Some(u128::from(rng.next_u64()) << 64 | u128::from(rng.next_u64())),
                event_type: deposit.event_type(),
                payload: payload.clone(),
                timestamp_ms: now,
            })
            .collect();
        let write = AggregateWrite {
            key: identity.key(account),
            events: batch_events,
            expected_version: Some(version),
            allow_create: true,
            enforce_client_idempotency: true,
        };
        version = log.write(identity.client(), vec![write]).await?[0];
        seq += n;
        written += n;
        writes += 1;
    }
    Ok(Filled {
        events,
        writes,
        tip: version,
        elapsed: started.elapsed(),
    })
}

fn celeriant(cfg: &CeleriantConfig) -> Result<SharedLog, Box<dyn std::error::Error>> {
    Ok(Arc::new(CeleriantLog::connect(cfg)?))
}

async fn fill_celeriant(args: FillArgs) -> Result<(), Box<dyn std::error::Error>> {
    let log = celeriant(&args.celeriant)?;
    let identity = Identity::default();
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    for (i, (id, events)) in args.accounts.iter().copied().enumerate() {
        let (log, permits) = (log.clone(), permits.clone());
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ (i as u64) << 32 ^ id.as_u128() as u64);
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            let filled = fill(
                log.as_ref(),
                &identity,
                AccountId(id),
                events,
                args.batch_events,
                &mut rng,
            )
            .await;
            (id, filled)
        });
    }
    let mut total = 0;
    while let Some(joined) = tasks.join_next().await {
        let (id, filled) = joined?;
        let f = filled.map_err(|e| format!("fill of {id}: {e}"))?;
        total += f.events;
        println!(
            "fill account={id} events={} writes={} tip_version={} secs={:.2} events_per_sec={:.0}",
            f.events,
            f.writes,
            f.tip,
            f.elapsed.as_secs_f64(),
            f.events as f64 / f.elapsed.as_secs_f64().max(1e-9)
        );
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "fill-total events={total} batch_events={} secs={secs:.2} events_per_sec={:.0}",
        args.batch_events,
        total as f64 / secs.max(1e-9)
    );
    Ok(())
}

async fn trim_celeriant(args: TrimArgs) -> Result<(), Box<dyn std::error::Error>> {
    let log = celeriant(&args.celeriant)?;
    let key = Identity::default().key(AccountId(args.account));
    let before = log.details(key).await?;
    let keep_from = args.keep_from.unwrap_or(before.max_version);
    log.trim_start(key, keep_from).await?;
    let after = log.details(key).await?;
    println!(
        "trim account={} keep_from={keep_from} min_available_before={} min_available_after={} tip_version={}",
        args.account, before.min_available_version, after.min_available_version, after.max_version
    );
    Ok(())
}

/// One fresh replica over the embedded store: a new [`App`] and its HTTP listener.
struct Replica {
    app: Arc<App>,
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Replica {
    async fn start(log: SharedLog, window_secs: u64) -> Result<Self, Box<dyn std::error::Error>> {
        let window = window_secs.to_string();
        let config = Config::try_parse_from([
            "tally",
            "--seed-demo-accounts",
            "false",
            "--idempotency-window",
            &window,
        ])?;
        let app = App::builder(config).store(log).build().await?;
        app.started().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tally::http::serve(app.clone(), listener, async {
            let _ = rx.await;
        }));
        Ok(Self {
            app,
            base,
            stop: Some(tx),
            server,
        })
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.server).await;
        drop(self.app);
    }
}

/// One timed request's answer.
struct Timed {
    status: u16,
    body: String,
    ms: f64,
}

/// Sends one request on a new connection (as `curl` does on Celeriant) and times it whole.
async fn timed(req: reqwest::RequestBuilder) -> Result<Timed, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let resp = req.timeout(REQUEST_TIMEOUT).send().await?;
    let status = resp.status().as_u16();
    let body = resp.text().await?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(Timed { status, body, ms })
}

async fn balance(
    client: &reqwest::Client,
    base: &str,
    account: Uuid,
) -> Result<Timed, Box<dyn std::error::Error>> {
    timed(client.get(format!("{base}/api/accounts/{account}/balance"))).await
}

async fn deposit(
    client: &reqwest::Client,
    base: &str,
    account: Uuid,
) -> Result<Timed, Box<dyn std::error::Error>> {
    let req = client
        .post(format!("{base}/api/accounts/{account}/deposit"))
        .header("idempotency-key", Uuid::new_v4().to_string())
        .header("content-type", "application/json")
        .body(r#"{"amountCents":1}"#);
    timed(req).await
}

/// The balance field of a 200 balance answer.
fn balance_of(body: &str) -> Option<i64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get("balanceCents").and_then(serde_json::Value::as_i64)
}

/// The error code of an error answer (or the body's start when it has none).
fn code_of(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|c| c.as_str().map(str::to_owned)))
        .unwrap_or_else(|| body.chars().take(80).collect())
}

/// The embedded-store figures: one store, one account per shape, fresh replicas over it.
struct Embedded {
    log: SharedLog,
    clock: Arc<ServerClock>,
    identity: Identity,
    client: reqwest::Client,
    args: EmbeddedArgs,
    rng: ChaCha8Rng,
    /// Deposits made by the measurements, per account, so the balance check knows them.
    extra: std::collections::HashMap<Uuid, i64>,
}

impl Embedded {
    async fn build(
        &mut self,
        label: &str,
        events: u64,
    ) -> Result<Uuid, Box<dyn std::error::Error>> {
        let id = Uuid::from_u128(
            u128::from(self.rng.next_u64()) << 64 | u128::from(self.rng.next_u64()),
        );
        self.add(label, id, events).await?;
        Ok(id)
    }

    async fn add(
        &mut self,
        label: &str,
        id: Uuid,
        events: u64,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let f = fill(
            self.log.as_ref(),
            &self.identity,
            AccountId(id),
            events,
            self.args.batch_events,
            &mut self.rng,
        )
        .await?;
        println!(
            "embedded-fill shape={label} account={id} events={} writes={} tip_version={} secs={:.2} events_per_sec={:.0}",
            f.events,
            f.writes,
            f.tip,
            f.elapsed.as_secs_f64(),
            f.events as f64 / f.elapsed.as_secs_f64().max(1e-9)
        );
        Ok(())
    }

    /// Moves the store's clock past the window: everything written so far is older than it.
    fn age_past_window(&self) {
        self.clock.advance(self.args.window_secs * 1000 + 1000);
    }

    /// `runs` fresh replicas each for the first balance read and the first deposit.
    async fn cold(
        &mut self,
        shape: &str,
        id: Uuid,
        expect_events: u64,
    ) -> Result<(), Box<dyn std::error::Error>> {
        for run in 1..=self.args.runs {
            let r = Replica::start(self.log.clone(), self.args.window_secs).await?;
            let t = balance(&self.client, &r.base, id).await?;
            r.stop().await;
            let want =
                expect_events as i64 * AMOUNT_CENTS + self.extra.get(&id).copied().unwrap_or(0);
            let check = match (t.status, balance_of(&t.body)) {
                (200, Some(b)) if b == want => "ok".to_owned(),
                (200, got) => {
                    return Err(format!("{shape}: balance {got:?}, expected {want}").into());
                }
                (s, _) => format!("status_{s}_{}", code_of(&t.body)),
            };
            println!(
                "embedded-cold shape={shape} op=balance run={run} ms={:.2} answer={check}",
                t.ms
            );
            let r = Replica::start(self.log.clone(), self.args.window_secs).await?;
            let t = deposit(&self.client, &r.base, id).await?;
            r.stop().await;
            let check = if t.status == 200 {
                *self.extra.entry(id).or_default() += 1;
                "ok".to_owned()
            } else {
                format!("status_{}_{}", t.status, code_of(&t.body))
            };
            println!(
                "embedded-cold shape={shape} op=deposit run={run} ms={:.2} answer={check}",
                t.ms
            );
        }
        Ok(())
    }

    /// One replica reads every account once, then stays up a while before it stops.
    async fn prime(&mut self, ids: &[Uuid]) -> Result<(), Box<dyn std::error::Error>> {
        if !self.args.prime {
            return Ok(());
        }
        let started = Instant::now();
        let r = Replica::start(self.log.clone(), self.args.window_secs).await?;
        for &id in ids {
            let t = balance(&self.client, &r.base, id).await?;
            if t.status != 200 {
                return Err(format!("priming {id}: status {}", t.status).into());
            }
        }
        // No signal yet says a replica has nothing left to write in the background.
        tokio::time::sleep(Duration::from_secs(self.args.prime_wait_secs)).await;
        r.stop().await;
        println!(
            "embedded-prime accounts={} secs={:.1}",
            ids.len(),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// The floor: a balance read and a deposit on an account this replica already holds warm.
    async fn floor(&mut self, size: u64, id: Uuid) -> Result<(), Box<dyn std::error::Error>> {
        let r = Replica::start(self.log.clone(), self.args.window_secs).await?;
        balance(&self.client, &r.base, id).await?;
        for run in 1..=self.args.runs {
            let b = balance(&self.client, &r.base, id).await?;
            let d = deposit(&self.client, &r.base, id).await?;
            if b.status != 200 || d.status != 200 {
                return Err(format!("floor: status {} / {}", b.status, d.status).into());
            }
            *self.extra.entry(id).or_default() += 1;
            println!(
                "embedded-floor shape=warm-{size} op=balance run={run} ms={:.2}",
                b.ms
            );
            println!(
                "embedded-floor shape=warm-{size} op=deposit run={run} ms={:.2}",
                d.ms
            );
        }
        r.stop().await;
        Ok(())
    }
}

async fn embedded(args: EmbeddedArgs) -> Result<(), Box<dyn std::error::Error>> {
    let clock = Arc::new(ServerClock::new(wall_clock_ms()));
    let log: SharedLog = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: clock.clone(),
        ..MemoryOptions::default()
    }));
    // No pooled connection: every timed request opens its own, as on Celeriant.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut e = Embedded {
        log,
        clock,
        identity: Identity::default(),
        client,
        args,
        rng,
        extra: Default::default(),
    };
    let sizes = e.args.sizes.clone();
    let mut cold = Vec::new();
    for &n in &sizes {
        cold.push((n, e.build(&format!("cold-{n}"), n).await?));
    }
    let hot_history = e.args.hot_history.clone();
    let mut hot = Vec::new();
    for &n in &hot_history {
        hot.push((n, e.build(&format!("hot-{n}"), n).await?));
    }
    let trimmed_events = e.args.trimmed_events;
    let trimmed = e.build("trimmed", trimmed_events).await?;
    let everyone: Vec<Uuid> = cold
        .iter()
        .chain(&hot)
        .map(|&(_, id)| id)
        .chain([trimmed])
        .collect();
    e.prime(&everyone).await?;
    e.age_past_window();
    let w = e.args.hot_window_events;
    for &(n, id) in &hot {
        e.add(&format!("hot-{n}+{w}"), id, w).await?;
    }
    let key = e.identity.key(AccountId(trimmed));
    let tip = e.log.details(key).await?.max_version;
    e.log.trim_start(key, tip).await?;
    println!("embedded-trim account={trimmed} keep_from={tip}");

    if let Some(&(size, smallest)) = cold.first() {
        e.floor(size, smallest).await?;
    }
    for &(n, id) in &cold {
        e.cold(&format!("cold-{n}"), id, n).await?;
    }
    for &(n, id) in &hot {
        e.cold(&format!("hot-{n}+{w}"), id, n + w).await?;
    }
    e.cold(
        &format!("trimmed-{trimmed_events}"),
        trimmed,
        trimmed_events,
    )
    .await?;
    Ok(())
}

/// One answered request of the restart load: when it ended (ms since the load began), how
/// long it took (ms), and whether it was a 200.
type Sample = (f64, f64, bool);

/// The most connections `restart` opens.
const MAX_RESTART_CONNECTIONS: usize = 4096;

async fn restart(args: RestartArgs) -> Result<(), Box<dyn std::error::Error>> {
    let accounts: Vec<Uuid> = std::fs::read_to_string(&args.accounts)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Uuid::parse_str(l.trim()))
        .collect::<Result<_, _>>()?;
    if accounts.is_empty() || args.targets.is_empty() {
        return Err("restart: no accounts or no targets".into());
    }
    if args.connections == 0 || args.connections > MAX_RESTART_CONNECTIONS {
        return Err(format!("restart: --connections 1..={MAX_RESTART_CONNECTIONS}").into());
    }
    let accounts = Arc::new(accounts);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.connections)
        .build()?;
    let started = Instant::now();
    let until = started + Duration::from_secs(args.duration_secs);
    let mut tasks = JoinSet::new();
    for c in 0..args.connections {
        let (client, accounts) = (client.clone(), accounts.clone());
        let base = args.targets[c % args.targets.len()].clone();
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ (c as u64) << 20);
        tasks.spawn(async move {
            let mut samples: Vec<Sample> = Vec::new();
            while Instant::now() < until {
                let account = accounts[(rng.next_u64() % accounts.len() as u64) as usize];
                let sent = Instant::now();
                let ok = match deposit(&client, &base, account).await {
                    Ok(t) => t.status == 200,
                    Err(_) => false,
                };
                let done = Instant::now();
                samples.push((
                    done.duration_since(started).as_secs_f64() * 1e3,
                    done.duration_since(sent).as_secs_f64() * 1e3,
                    ok,
                ));
            }
            samples
        });
    }
    let mut samples = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        samples.extend(joined?);
    }
    report_restart(&samples, args.duration_secs, args.objective_ms);
    Ok(())
}

/// p99 of each second, and the end of the last second whose p99 missed the objective.
fn report_restart(samples: &[Sample], secs: u64, objective_ms: f64) {
    let mut last_missed = None;
    for s in 0..secs {
        let (lo, hi) = (s as f64 * 1e3, (s + 1) as f64 * 1e3);
        let mut lat: Vec<f64> = samples
            .iter()
            .filter(|x| x.0 >= lo && x.0 < hi)
            .map(|x| x.1)
            .collect();
        let failed = samples
            .iter()
            .filter(|x| x.0 >= lo && x.0 < hi && !x.2)
            .count();
        lat.sort_by(f64::total_cmp);
        let p99 = lat
            .get(((lat.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied();
        if p99.is_none_or(|p| p >= objective_ms) {
            last_missed = Some(s + 1);
        }
        println!(
            "restart-second t={} requests={} failed={failed} p99_ms={}",
            s + 1,
            lat.len(),
            p99.map_or("none".into(), |p| format!("{p:.1}"))
        );
    }
    let ok = samples.iter().filter(|x| x.2).count();
    println!(
        "restart-recovered p99_under_{objective_ms}ms_from_secs={} requests={} ok={ok}",
        last_missed.map_or("0".into(), |s| if s >= secs {
            "never".into()
        } else {
            s.to_string()
        }),
        samples.len()
    );
}
