//! Black-box helpers: spawn Tally instances on port 0 (alone, or as a fleet over one shared
//! store), talk to them over HTTP and check their answers.
//!
//! - this file: the harness ([`spawn`], [`TestApp`]), whole replies ([`Reply`]), metric
//!   samples, and the checks and shortcuts the API suites share ([`assert_error`],
//!   [`observe`], [`funded`], ...);
//! - [`raw_http`]: requests a well-behaved client cannot send (raw headers and bodies, raw
//!   bytes over one TCP connection);
//! - [`hand_clocks`]: an embedded store on a server clock the test moves, and replicas on
//!   local clocks it moves, for the rules that age writes;
//! - [`hooked_log`]: one store decorator that hooks, scripts and records a replica's store
//!   calls, for the suites that steer the store from inside;
//! - [`fleet_script`]: `deploy/fleet.sh` as a child process, read line by line;
//! - [`windowed_log`]: a store decorator that pages reads in Celeriant's version windows and
//!   counts them, for the suites that bound a read's cost;
//! - [`workspace_bin`]: the binaries of the other workspace members (`tally-load`).
//!
//! Every suite compiles this module whole and uses part of it, hence `dead_code` is allowed.
#![allow(dead_code)]

pub mod fleet_script;
pub mod hand_clocks;
pub mod hooked_log;
pub mod pg;
pub mod raw_http;
pub mod remote;
pub mod required;
pub mod sse;
pub mod test_dir;
pub mod windowed_log;
pub mod workspace_bin;

use std::net::SocketAddr;
use std::sync::Arc;

use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::Value;
use tally::app::App;
use tally::config::Config;
use tally::projection::Clock;
use tally::projection::config::ProjectionKind;
use tally::store::SharedLog;
use tally::store::faults::FaultyLog;
use tally::store::memory::MemoryLog;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One running instance.
pub struct TestApp {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

/// A configuration for tests: loopback, port 0, no demo accounts unless asked.
pub fn test_config(extra: &[&str]) -> Config {
    use clap::Parser;
    let mut args = vec![
        "tally",
        "--listen",
        "127.0.0.1:0",
        "--seed-demo-accounts",
        "false",
    ];
    args.extend_from_slice(extra);
    // The suites run with authentication on when asked (and when the test does
    // not configure authentication itself).
    if test_auth::on() && !extra.contains(&"--auth") {
        args.extend(test_auth::flags(&test_auth::secret_file()));
    }
    Config::parse_from(args)
}

/// `TALLY_TEST_AUTH=jwt` runs every suite built on this harness (the fleet and
/// simulation suites among them) with `--auth jwt`: each replica checks an HS256 token, and
/// each harness client sends one granting every account scope (as caller `harness`), with
/// rate limits off so the suites' bursts are not paced.
pub mod test_auth {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// The switch.
    pub const ENV: &str = "TALLY_TEST_AUTH";
    /// The shared secret the harness's replicas and tokens use.
    pub const SECRET: &str = "tally-test-secret-0123456789abcdef-not-for-production";
    pub const ISSUER: &str = "tally-dev";
    pub const AUDIENCE: &str = "tally";

    pub fn on() -> bool {
        std::env::var(ENV).is_ok_and(|v| v == "jwt")
    }

    /// A file holding [`SECRET`], written once per test process.
    pub fn secret_file() -> String {
        static PATH: OnceLock<PathBuf> = OnceLock::new();
        PATH.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("tally-test-auth-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let path = dir.join("secret");
            std::fs::write(&path, SECRET).expect("secret written");
            path
        })
        .to_string_lossy()
        .into_owned()
    }

    pub fn flags(secret_file: &str) -> Vec<&'static str> {
        // Leaked once per call: a handful of short strings per test process.
        let secret: &'static str = Box::leak(secret_file.to_owned().into_boxed_str());
        vec![
            "--auth",
            "jwt",
            "--auth-secret-file",
            secret,
            "--rate-limit-per-caller",
            "0",
        ]
    }

    /// An HS256 token over [`SECRET`] with these claims added to a valid set (sub
    /// `harness`, every account scope, an hour to live).
    pub fn token(extra: serde_json::Value) -> String {
        let now = jsonwebtoken::get_current_timestamp();
        let mut claims = serde_json::json!({
            "sub": CALLER, "scope": "accounts:read accounts:write",
            "iss": ISSUER, "aud": AUDIENCE, "exp": now + 3600,
        });
        if let (Some(c), Some(e)) = (claims.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).expect("secret"),
        )
        .expect("token signed")
    }

    /// The caller the harness's token names.
    pub const CALLER: &str = "harness";

    /// The event id the harness's client's write with this key gets: with authentication on,
    /// keys belong to their caller, so even a UUID key is not the event id as is.
    pub fn event_id(key: &str) -> String {
        let caller = on().then_some(CALLER);
        tally::http::idempotency::IdempotencyKey::parse(key, caller)
            .expect("a valid key")
            .event_id
            .to_string()
    }

    /// A client that sends the harness's token on every request.
    pub fn client() -> reqwest::Client {
        let mut headers = reqwest::header::HeaderMap::new();
        let value = format!("Bearer {}", token(serde_json::json!({})));
        headers.insert(
            reqwest::header::AUTHORIZATION,
            value.parse().expect("header value"),
        );
        reqwest::Client::builder()
            .default_headers(headers)
            .build()
            .expect("client")
    }
}

pub async fn spawn(
    config: Config,
    store: Option<SharedLog>,
    clock: Option<Arc<dyn Clock>>,
) -> TestApp {
    // The suites on the Postgres projection: TALLY_TEST_PROJECTION=postgres puts
    // every instance a test did not place itself on the test cluster: instances over one
    // store share one schema, like a fleet shares its database.
    let mut config = config;
    if pg::suite_on_postgres() && config.projection.kind == ProjectionKind::Memory {
        config.projection.kind = ProjectionKind::Postgres;
        config.projection.postgres_url = pg::url_for_store(store.as_ref()).await;
        assert!(
            config.projection.postgres_url.is_some(),
            "{} needs {}",
            pg::PROJECTION_VAR,
            pg::URL_VAR
        );
    }
    let mut builder = App::builder(config);
    if let Some(s) = store {
        builder = builder.store(s);
    }
    if let Some(c) = clock {
        builder = builder.clock(c);
    }
    let app = builder.build().await.expect("app builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(tally::http::serve(app.clone(), listener, async {
        let _ = rx.await;
    }));
    TestApp {
        // With the harness's authentication on, its client sends a token.
        client: if test_auth::on()
            && app.config.auth.secret_file.as_deref()
                == Some(std::path::Path::new(&test_auth::secret_file()))
        {
            test_auth::client()
        } else {
            reqwest::Client::new()
        },
        addr,
        app,
        shutdown: Some(tx),
        server: Some(server),
    }
}

/// One instance over its own embedded store.
pub async fn spawn_default() -> TestApp {
    spawn(test_config(&[]), None, None).await
}

/// `n` instances sharing one store: a fleet in one process.
pub async fn spawn_fleet(n: usize, store: SharedLog, extra: &[&str]) -> Vec<TestApp> {
    let mut fleet = Vec::with_capacity(n);
    for _ in 0..n {
        fleet.push(spawn(test_config(extra), Some(store.clone()), None).await);
    }
    fleet
}

/// `n` instances sharing one fresh embedded store.
pub async fn spawn_fleet_in_memory(n: usize, extra: &[&str]) -> Vec<TestApp> {
    spawn_fleet(n, Arc::new(MemoryLog::new()), extra).await
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub text: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn error_code(&self) -> &str {
        self.body["error"].as_str().unwrap_or("")
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn get(&self, path: &str) -> Reply {
        read(
            self.client
                .get(self.url(path))
                .send()
                .await
                .expect("GET sent"),
        )
        .await
    }

    /// POSTs JSON with an optional Idempotency-Key.
    pub async fn post(&self, path: &str, body: &Value, key: Option<&str>) -> Reply {
        let mut req = self.client.post(self.url(path)).json(body);
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        read(req.send().await.expect("POST sent")).await
    }

    pub async fn deposit(&self, account: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            &format!("/api/accounts/{account}/deposit"),
            &serde_json::json!({ "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn withdraw(&self, account: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            &format!("/api/accounts/{account}/withdraw"),
            &serde_json::json!({ "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn transfer(&self, from: &str, to: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            "/api/transfers",
            &serde_json::json!({ "fromAccountId": from, "toAccountId": to, "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn balance(&self, account: &str) -> (i64, u64) {
        let r = self.get(&format!("/api/accounts/{account}/balance")).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        (
            r.body["balanceCents"].as_i64().expect("balance"),
            r.body["aggregateVersion"].as_u64().expect("version"),
        )
    }

    /// Every event of the account's history, following pages.
    pub async fn history(&self, account: &str) -> Vec<Value> {
        let mut events = Vec::new();
        let mut from = 1u64;
        loop {
            let r = self
                .get(&format!(
                    "/api/accounts/{account}/history?fromVersion={from}&limit=1000"
                ))
                .await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            events.extend(r.body["events"].as_array().cloned().unwrap_or_default());
            match r.body["nextFromVersion"].as_u64() {
                Some(next) => from = next,
                None => return events,
            }
        }
    }

    /// Stops accepting and drains, as SIGTERM does; returns when the server has stopped.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("server task");
        }
    }
}

/// POSTs a deposit of `cents` under Idempotency-Key `key` to `url` (any server, the real
/// binary too), read whole.
pub async fn keyed_deposit(client: &reqwest::Client, url: &str, key: &str, cents: i64) -> Reply {
    read(
        client
            .post(url)
            .header("idempotency-key", key)
            .json(&serde_json::json!({ "amountCents": cents }))
            .send()
            .await
            .expect("the deposit is answered"),
    )
    .await
}

/// Reads a response whole.
pub async fn read(resp: reqwest::Response) -> Reply {
    let status = resp.status();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        body,
        text,
    }
}

/// A fresh random account id.
pub fn new_account() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Polls `{base}/readyz` on each base URL until it answers 200, every `interval`, and fails
/// the test once `bound` has passed since the call.
pub async fn wait_ready(
    http: &reqwest::Client,
    bases: &[&str],
    bound: std::time::Duration,
    interval: std::time::Duration,
) {
    let deadline = tokio::time::Instant::now() + bound;
    for base in bases {
        loop {
            let status = http
                .get(format!("{base}/readyz"))
                .send()
                .await
                .map(|r| r.status());
            if matches!(status, Ok(StatusCode::OK)) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{base} not ready within {bound:?}: {status:?}"
            );
            tokio::time::sleep(interval).await;
        }
    }
}

/// The value of the sample whose name and labels are exactly `series` (labels in the
/// exposition's order), or 0 when absent.
pub fn metric_sample(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// The value of an unlabelled metric, or the sum over every series of a labelled one.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// --- Checks and shortcuts the API suites share ---

/// Asserts an error answer: the status, a JSON content type, and a body
/// `{"error": code, "message": "<non-empty>"}` (never plain text).
#[track_caller]
pub fn assert_error(r: &Reply, status: u16, code: &str) {
    assert_eq!(r.status.as_u16(), status, "status; body: {}", r.text);
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "an error is JSON: {}",
        r.text
    );
    assert!(
        r.body.is_object(),
        "an error body is a JSON object: {:?}",
        r.text
    );
    assert_eq!(r.body["error"], code, "error code; body: {}", r.text);
    let message = r.body["message"].as_str().unwrap_or("");
    assert!(
        !message.is_empty(),
        "an error carries a message: {}",
        r.text
    );
}

pub fn deposit_path(account: &str) -> String {
    format!("/api/accounts/{account}/deposit")
}

pub fn withdraw_path(account: &str) -> String {
    format!("/api/accounts/{account}/withdraw")
}

pub fn account_transfer_path(account: &str) -> String {
    format!("/api/accounts/{account}/transfers")
}

/// What an account looks like from outside: balance, version and every history event.
pub async fn observe(t: &TestApp, account: &str) -> (i64, u64, Vec<Value>) {
    let (balance, version) = t.balance(account).await;
    (balance, version, t.history(account).await)
}

/// An account with one deposit of `cents`, so "unchanged" means more than "empty".
pub async fn funded(t: &TestApp, cents: i64) -> String {
    let account = new_account();
    let r = t.deposit(&account, cents, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    account
}

/// The `{balanceCents, aggregateVersion}` of a single-account answer (or of one leg).
pub fn leg(v: &Value) -> (i64, u64) {
    (
        v["balanceCents"].as_i64().expect("balanceCents"),
        v["aggregateVersion"].as_u64().expect("aggregateVersion"),
    )
}

/// The fault injector of an app started with `--faults`.
pub fn faults(t: &TestApp) -> &Arc<FaultyLog> {
    t.app.faults.as_ref().expect("started with --faults")
}

/// The embedded store behind a fault injector that injects only what a test scripts.
pub fn scripted_faults() -> Arc<FaultyLog<MemoryLog>> {
    Arc::new(FaultyLog::new(
        Arc::new(MemoryLog::new()),
        Default::default(),
    ))
}

/// An instance whose store injects only scripted faults, and whose writes get one attempt
/// each, starting with a catch-up read: a scripted fault ends the request, and its retry
/// reads the stream before it writes.
pub async fn spawn_one_attempt_with_scripted_faults() -> TestApp {
    spawn(
        test_config(&[
            "--faults",
            "seed=1",
            "--write-max-attempts",
            "1",
            "--one-round-trip",
            "false",
        ]),
        None,
        None,
    )
    .await
}
