//! Start-up that finishes: each start-up step (the server-clock anchor, each demo account's
//! create-only seed) retries on its own, so a faulty store delays readiness instead of
//! stalling it; `/readyz` says what it waits for; the periodic re-anchor never flaps
//! readiness.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use clap::Parser;
use parking_lot::Mutex;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::{AccountId, AmountCents, Identity, Operation};
use tally::app::App;
use tally::config::{Config, DEMO_ACCOUNTS, demo_account_id};
use tally::projection::SERVER_CLOCK_RESYNC;
use tally::startup::seed::DemoSeed;
use tally::startup::{STEP_RETRY_MAX, seed_step_name};
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreError, StoreResult,
};
use tally::write_loop::WriteRequest;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The fault rates of the issue: at these, redoing all of start-up after any failure almost
/// never finished.
const ISSUE_FAULTS: &str = "lost-ack=0.15,lost-request=0.1,refused=0.1,inflight=0.1,read-lag=0.2";
/// How long a replica may take to be ready under [`ISSUE_FAULTS`].
const READY_WITHIN: Duration = Duration::from_secs(5);
/// Fault seeds tried, and how many must be ready within [`READY_WITHIN`].
const SEEDS: u64 = 100;
const MUST_BE_READY: usize = 99;

fn config(extra: &[&str]) -> Config {
    let mut args = vec!["tally", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Config::parse_from(args)
}

fn seeding_config() -> Config {
    config(&["--seed-demo-accounts", "true"])
}

fn demo_key(name: &str) -> AggregateKey {
    Identity::default().key(AccountId(demo_account_id(name)))
}

/// Every demo account holds exactly one batch, at version 1: its seed, with its event id,
/// from our client id.
async fn assert_each_demo_account_seeded_exactly_once(mem: &MemoryLog, context: &str) {
    for (name, _) in DEMO_ACCOUNTS {
        let key = demo_key(name);
        let details = mem.details(key).await.expect("demo account exists");
        assert_eq!(details.max_version, 1, "{context}: {name} written once");
        let page = mem
            .read(key, &ReadFilter::from_version(1))
            .await
            .expect("read");
        let batch = &page.batches[0];
        assert_eq!(batch.client_id, Identity::default().client());
        assert_eq!(
            batch.events[0].event_id,
            Some(DemoSeed::event_id(name)),
            "{context}: {name} holds its seed"
        );
    }
}

/// Rule: under the issue's fault rates, a replica is ready within 5 s (virtual time) in at
/// least 99 of 100 fault seeds, with every demo account seeded exactly once.
#[tokio::test(start_paused = true)]
async fn a_replica_is_ready_within_five_seconds_under_heavy_faults_in_99_of_100_seeds() {
    let mut late = Vec::new();
    let mut times = Vec::new();
    let mut found = 0;
    let mut lost_acks = 0;
    for seed in 0..SEEDS {
        let spec = format!("{ISSUE_FAULTS},seed={seed}");
        let mem = Arc::new(MemoryLog::new());
        let t0 = Instant::now();
        let app = App::builder(config(&["--seed-demo-accounts", "true", "--faults", &spec]))
            .store(mem.clone())
            .build()
            .await
            .expect("builds");
        let ready = tokio::time::timeout_at(t0 + READY_WITHIN, app.started())
            .await
            .is_ok();
        if !ready {
            late.push((seed, app.startup_waiting()));
            continue;
        }
        times.push(t0.elapsed());
        assert!(app.projection.server_tip_ms() > 0, "seed {seed}: anchored");
        assert_each_demo_account_seeded_exactly_once(&mem, &format!("fault seed {seed}")).await;
        found += app
            .metrics
            .startup_seed_outcomes
            .with_label_values(&["found"])
            .get();
        lost_acks += app.faults.as_ref().expect("faults on").counts().lost_ack;
    }
    times.sort();
    eprintln!(
        "ready: {} of {SEEDS}; median {:?}, slowest {:?}; seeds found landed after a lost ack: {found}",
        times.len(),
        times.get(times.len() / 2),
        times.last()
    );
    assert!(
        late.len() <= (SEEDS as usize - MUST_BE_READY),
        "not ready within {READY_WITHIN:?} (fault seed, steps still pending): {late:?}"
    );
    // The faults were real: acks were lost, and some seed was recognised as landed.
    assert!(
        lost_acks > 0 && found > 0,
        "lost acks {lost_acks}, found {found}"
    );
}

// --- A store that refuses chosen keys, for scripted start-up failures ---

/// The embedded store, except that writes to chosen keys are refused (`NotApplied`) while
/// they are closed. Counts writes per key.
struct Gate {
    inner: Arc<MemoryLog>,
    closed: Mutex<HashSet<AggregateKey>>,
    writes: Mutex<HashMap<AggregateKey, u32>>,
}

impl Gate {
    fn new(inner: Arc<MemoryLog>, closed: &[AggregateKey]) -> Arc<Self> {
        Arc::new(Self {
            inner,
            closed: Mutex::new(closed.iter().copied().collect()),
            writes: Mutex::new(HashMap::new()),
        })
    }

    fn close(&self, key: AggregateKey) {
        self.closed.lock().insert(key);
    }

    fn open(&self, key: AggregateKey) {
        self.closed.lock().remove(&key);
    }

    fn writes_to(&self, key: AggregateKey) -> u32 {
        self.writes.lock().get(&key).copied().unwrap_or(0)
    }
}

#[async_trait]
impl EventLog for Gate {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        for w in &writes {
            *self.writes.lock().entry(w.key).or_default() += 1;
        }
        if writes.iter().any(|w| self.closed.lock().contains(&w.key)) {
            return Err(StoreError::shed("test gate closed"));
        }
        self.inner.write(client, writes).await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.inner.read(key, filter).await
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// A served app on port 0 and a client for it; stops the server on drop.
struct Served {
    app: Arc<App>,
    base: String,
    client: reqwest::Client,
    _stop: oneshot::Sender<()>,
}

async fn serve(app: Arc<App>) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(tally::http::serve(app.clone(), listener, async {
        let _ = stopped.await;
    }));
    Served {
        app,
        base,
        client: reqwest::Client::new(),
        _stop: stop,
    }
}

impl Served {
    async fn get(&self, path: &str) -> (StatusCode, Option<String>, Value) {
        let r = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("request sent");
        let status = r.status();
        let retry_after = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap_or("").to_string());
        let body = r.json().await.unwrap_or(Value::Null);
        (status, retry_after, body)
    }

    fn metric(&self, line: &str) -> bool {
        self.app.metrics.render().lines().any(|l| l == line)
    }
}

/// Rule: `/readyz` names the start-up steps still pending, as a JSON body with a 503, and
/// the metrics count them; once they are done it answers 200 `{"status":"ready"}`, and the
/// steps that had succeeded were never redone.
#[tokio::test]
async fn readyz_lists_the_pending_start_up_steps_until_they_are_done() {
    let mem = Arc::new(MemoryLog::new());
    let clock = Identity::default().server_clock_key();
    let alice = demo_key("Alice");
    let gate = Gate::new(mem.clone(), &[clock, alice]);
    let t = serve(
        App::builder(seeding_config())
            .store(gate.clone())
            .build()
            .await
            .expect("builds"),
    )
    .await;

    let (status, retry_after, body) = t.get("/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(body["status"], "starting", "{body}");
    assert_eq!(body["error"], "SERVICE_UNAVAILABLE", "{body}");
    assert_eq!(
        body["waiting"],
        json!([SERVER_CLOCK_STEP_NAME, seed_step_name("Alice")]),
        "{body}"
    );
    assert!(t.metric("tally_startup_steps_pending 2"));
    // The API says the same, and names the steps.
    let (status, _, body) = t.get("/api/accounts").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let message = body["message"].as_str().unwrap_or("");
    assert!(message.contains("seed:Alice"), "{body}");

    gate.open(clock);
    gate.open(alice);
    tokio::time::timeout(Duration::from_secs(10), t.app.started())
        .await
        .expect("ready once the store takes the writes");
    let (status, _, body) = t.get("/readyz").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({ "status": "ready" }));
    assert!(t.metric("tally_startup_steps_pending 0"));
    // Bob and Charlie were seeded by their first attempts, and never attempted again.
    for name in ["Bob", "Charlie"] {
        assert_eq!(gate.writes_to(demo_key(name)), 1, "{name}");
        let step = seed_step_name(name);
        assert!(t.metric(&format!(
            "tally_startup_step_attempts_total{{result=\"done\",step=\"{step}\"}} 1"
        )));
    }
    assert!(gate.writes_to(alice) >= 2, "Alice retried");
    assert_each_demo_account_seeded_exactly_once(&mem, "gate").await;
}

const SERVER_CLOCK_STEP_NAME: &str = tally::startup::SERVER_CLOCK_STEP;

/// Rule: `/readyz` keeps telling shutting down from starting, with a JSON body that says
/// which.
#[tokio::test]
async fn readyz_while_shutting_down_says_so() {
    let t = serve(App::builder(config(&[])).build().await.expect("builds")).await;
    assert_eq!(t.get("/readyz").await.0, StatusCode::OK);
    t.app.begin_shutdown();
    let (status, retry_after, body) = t.get("/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(body["status"], "shuttingDown", "{body}");
    assert_eq!(body["error"], "SERVICE_UNAVAILABLE", "{body}");
}

/// Rule: a failed periodic re-anchor keeps the old anchor, is retried with the short
/// start-up backoff (not a whole resync period later), never flips readiness, and does not
/// hold up writes.
#[tokio::test(start_paused = true)]
async fn a_failing_re_anchor_retries_shortly_and_never_flips_readiness() {
    let mem = Arc::new(MemoryLog::new());
    let clock = Identity::default().server_clock_key();
    let gate = Gate::new(mem.clone(), &[]);
    let log: SharedLog = gate.clone();
    let app = App::builder(config(&[]))
        .store(log)
        .build()
        .await
        .expect("builds");
    assert!(app.is_started());
    let anchors = |result: &str| {
        app.metrics
            .server_clock_anchors
            .with_label_values(&[result])
            .get()
    };
    assert_eq!((anchors("ok"), anchors("failed")), (1, 0));
    let anchored_tip = app.projection.server_tip_ms();
    assert!(anchored_tip > 0);

    gate.close(clock);
    tokio::time::sleep(SERVER_CLOCK_RESYNC).await;
    // Failing re-anchors for a while: readiness holds, the old anchor holds, and a write
    // goes through.
    let failing_for = 4 * STEP_RETRY_MAX;
    let until = Instant::now() + failing_for;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(app.is_started() && app.startup_waiting().is_empty());
        assert!(
            app.projection.server_tip_ms() >= anchored_tip,
            "old anchor kept"
        );
    }
    let failed = anchors("failed");
    assert!(
        failed >= 4,
        "retried with the short backoff, not once a period: {failed} attempts"
    );
    let account = AccountId(uuid::Uuid::new_v4());
    let write = app.writes.execute(WriteRequest {
        op: Operation::Deposit {
            account,
            amount: AmountCents::new(100).expect("amount"),
        },
        event_id: 42,
    });
    let answer = tokio::time::timeout(Duration::from_secs(1), write)
        .await
        .expect("a write is not held up by the re-anchor");
    assert_eq!(answer.expect("deposit lands").legs[0].balance, 100);

    gate.open(clock);
    tokio::time::sleep(STEP_RETRY_MAX).await;
    assert_eq!(
        anchors("ok"),
        2,
        "re-anchored once the store takes the probe"
    );
    // And then quiet until the next period.
    let failed = anchors("failed");
    tokio::time::sleep(SERVER_CLOCK_RESYNC / 2).await;
    assert_eq!((anchors("ok"), anchors("failed")), (2, failed));
    assert!(app.is_started());
}
