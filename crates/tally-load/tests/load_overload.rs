//! `tally-load`'s overload mode and first-touch scenario: the `--on-503` client policies,
//! goodput and refusal rates, latency of admitted requests, `--server-pid` sampling, and the
//! exactly-once verdict across re-sends. Driven against a small in-process fake that refuses
//! each key's first attempts with 503 (so every count is known in advance), and once against
//! a real Tally whose in-flight limit is tiny.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use uuid::Uuid;

use tally_load::audit::{Verdict, ViolationKind};
use tally_load::{Options, Report};

/// Longest any single generator run may take in these tests.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// Largest request body the fake reads.
const MAX_FAKE_BODY: usize = 64 * 1024;
/// The fake's three listed accounts (the hot scenario's targets).
const LISTED: [u128; 3] = [0xA, 0xB, 0xC];
/// hdrhistogram keeps 3 significant digits: a recorded value may read back this much lower.
const HISTOGRAM_SLACK_US: u64 = 2_000;

/// How the fake refuses.
#[derive(Clone, Copy, Default)]
struct Refusals {
    /// Answer the first this-many attempts of every key 503 without applying them.
    first_attempts: u32,
    /// Retry-After sent with each 503, in seconds.
    retry_after_secs: u64,
    /// Apply a refused attempt anyway (a server that answers 503 after writing): re-sends
    /// then land the key twice, which the verifier must catch.
    apply_refused: bool,
}

#[derive(Default)]
struct State {
    streams: HashMap<Uuid, Vec<Value>>,
    /// First answer per key, replayed to re-sends.
    answers: HashMap<String, String>,
    attempts: HashMap<String, u32>,
}

/// Deposits only, with idempotency keys, a one-page history, and 503s on demand.
struct Fake {
    refusals: Refusals,
    state: Mutex<State>,
    /// Requests other than history reads: what the generator's counters cover.
    load_requests: AtomicU64,
}

impl Fake {
    fn new(refusals: Refusals) -> Arc<Self> {
        Arc::new(Fake {
            refusals,
            state: Mutex::new(State::default()),
            load_requests: AtomicU64::new(0),
        })
    }

    /// Accounts with at least one deposit.
    fn accounts(&self) -> usize {
        self.state.lock().unwrap().streams.len()
    }

    fn route(&self, method: &Method, path: &str, key: Option<&str>, body: &[u8]) -> (u16, Value) {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method, parts.as_slice()) {
            (&Method::GET, ["api", "accounts"]) => {
                self.load_requests.fetch_add(1, Ordering::Relaxed);
                let list: Vec<Value> = LISTED
                    .iter()
                    .map(|id| json!({ "id": Uuid::from_u128(*id).to_string() }))
                    .collect();
                (200, json!({ "accounts": list }))
            }
            (&Method::GET, ["api", "accounts", id, "history"]) => {
                let account = Uuid::parse_str(id).unwrap_or_default();
                let state = self.state.lock().unwrap();
                let events = state.streams.get(&account).cloned().unwrap_or_default();
                (200, json!({ "events": events }))
            }
            (&Method::POST, ["api", "accounts", id, "deposit"]) => {
                self.load_requests.fetch_add(1, Ordering::Relaxed);
                self.deposit(id, key, body)
            }
            _ => (404, json!({ "error": "NOT_FOUND" })),
        }
    }

    fn deposit(&self, id: &str, key: Option<&str>, body: &[u8]) -> (u16, Value) {
        let invalid = (422, json!({ "error": "VALIDATION_ERROR" }));
        let (Ok(account), Some(key)) = (Uuid::parse_str(id), key) else {
            return invalid;
        };
        let Some(amount) = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v["amountCents"].as_i64())
        else {
            return invalid;
        };
        let mut state = self.state.lock().unwrap();
        let attempt = state.attempts.entry(key.to_string()).or_default();
        *attempt += 1;
        let refused = *attempt <= self.refusals.first_attempts;
        if refused && !self.refusals.apply_refused {
            return (503, json!({ "error": "SERVICE_UNAVAILABLE" }));
        }
        if !refused && let Some(first) = state.answers.get(key) {
            return (200, serde_json::from_str(first).unwrap_or_default());
        }
        let stream = state.streams.entry(account).or_default();
        stream.push(json!({
            "aggregateVersion": stream.len() + 1,
            "type": "Deposited",
            "amountCents": amount,
            "eventId": key,
        }));
        let balance: i64 = stream
            .iter()
            .filter_map(|e| e["amountCents"].as_i64())
            .sum();
        let answer = json!({ "balanceCents": balance, "aggregateVersion": stream.len() });
        if refused {
            return (503, json!({ "error": "SERVICE_UNAVAILABLE" }));
        }
        state.answers.insert(key.to_string(), answer.to_string());
        (200, answer)
    }
}

async fn handle(
    fake: Arc<Fake>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = Limited::new(request.into_body(), MAX_FAKE_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let (status, reply) = fake.route(&method, &path, key.as_deref(), &body);
    let mut response = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    if status == 503 {
        response = response.header("retry-after", fake.refusals.retry_after_secs);
    }
    Ok(response
        .body(Full::new(Bytes::from(reply.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
}

/// Serves `fake` on a fresh loopback port; the listener is bound before this returns.
async fn serve(fake: Arc<Fake>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let fake = fake.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| handle(fake.clone(), req));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Runs the generator core against `addr` with `command_line` (flags separated by spaces).
async fn run_generator(addr: SocketAddr, command_line: &str) -> Report {
    let target = format!("--target http://{addr}");
    let argv = ["tally-load"]
        .into_iter()
        .chain(target.split_whitespace())
        .chain(command_line.split_whitespace());
    let options = Options::try_parse_from(argv).expect("options parse");
    tokio::time::timeout(RUN_LIMIT, tally_load::run(options))
        .await
        .expect("generator finished in time")
        .expect("generator ran")
}

fn count(report: &Report, status: u16) -> u64 {
    report.status_counts.get(&status).copied().unwrap_or(0)
}

/// The counts every report must satisfy, and the rates derived from them.
fn assert_counts_add_up(report: &Report, fake: &Fake) {
    let answered: u64 = report.status_counts.values().sum();
    assert_eq!(
        report.requests,
        report.operations + report.retries + report.resends
    );
    assert_eq!(answered + report.errors, report.requests);
    assert_eq!(report.latency_us.count, answered);
    assert_eq!(report.admitted_latency_us.count, count(report, 200));
    assert_eq!(
        fake.load_requests.load(Ordering::Relaxed),
        report.requests + report.setup.requests,
        "the fake saw exactly the requests the generator counted"
    );
    let per_sec = |n: u64| n as f64 / report.elapsed_secs;
    assert!((report.goodput - per_sec(count(report, 200))).abs() < 1e-6);
    let refused = report.refusals_per_sec.get(&503).copied().unwrap_or(0.0);
    assert!((refused - per_sec(count(report, 503))).abs() < 1e-6);
    assert!(!report.refusals_per_sec.contains_key(&200));
}

/// Rule: under `--on-503 resend` a refused request is re-sent at once with the same key until
/// it is answered otherwise; each re-send is counted, goodput counts only 2xx, and the
/// verifier checks every key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resend_policy_re_sends_refused_keys_at_once() {
    let fake = Fake::new(Refusals {
        first_attempts: 2,
        ..Refusals::default()
    });
    let addr = serve(fake.clone()).await;
    let report = run_generator(
        addr,
        "--scenario spread --accounts 5 --requests 120 --connections 6 --on-503 resend --seed 1",
    )
    .await;
    print!("{report}");
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.on_503, Some(tally_load::cli::On503::Resend));
    assert_eq!(report.operations, 120);
    assert_eq!(report.connects, 6, "one keep-alive connection per worker");
    assert_eq!(report.resends, 240, "two refusals per key, each re-sent");
    assert_eq!((count(&report, 200), count(&report, 503)), (120, 240));
    assert_eq!(report.settled_latency_us.count, 120);
    assert!(report.settled_latency_us.max >= report.admitted_latency_us.max);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.checked, e.succeeded, e.unknown), (125, 125, 0));
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["on_503"], "resend");
    assert!(json["refusals_per_sec"]["503"].as_f64().unwrap() > 0.0);
    for field in ["goodput", "admitted_latency_us", "settled_latency_us"] {
        assert!(json.get(field).is_some(), "{field}");
    }
    let text = report.to_string();
    assert!(text.contains("goodput:") && text.contains("503="), "{text}");
}

/// Rule: under `--on-503 retry-after` a refused request waits the answer's Retry-After before
/// its re-send, and no re-send starts after the run's end (that key is left unknown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_policy_waits_as_told() {
    let fake = Fake::new(Refusals {
        first_attempts: 1,
        retry_after_secs: 1,
        ..Refusals::default()
    });
    let addr = serve(fake.clone()).await;
    let workers = 4;
    let secs = 3;
    let report = run_generator(
        addr,
        &format!("--scenario hot --connections {workers} --duration {secs} --on-503 retry-after"),
    )
    .await;
    print!("{report}");
    assert_counts_add_up(&report, &fake);
    let ok = count(&report, 200);
    assert!(ok > 0);
    assert!(
        ok <= workers * secs,
        "each operation waits 1 s for its 2xx: at most {} in {secs} s, got {ok}",
        workers * secs
    );
    assert_eq!(report.resends, ok, "one re-send per key that got its 2xx");
    assert_eq!(count(&report, 503), report.operations);
    assert!(
        report.operations <= ok + workers,
        "a worker stops at the first re-send that would start after the end: {} operations",
        report.operations
    );
    assert!(
        report.settled_latency_us.p50 + HISTOGRAM_SLACK_US >= 1_000_000,
        "settled latency includes the 1 s wait: {:?}",
        report.settled_latency_us
    );
    assert!(report.admitted_latency_us.p99 < 1_000_000);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.succeeded, e.unknown), (ok, report.operations - ok));
}

/// Rule: the verdict still catches a key applied twice when the client re-sent it after a
/// 503 (a server that wrote before refusing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_sends_after_a_503_that_wrote_fail_the_verdict() {
    let fake = Fake::new(Refusals {
        first_attempts: 1,
        apply_refused: true,
        ..Refusals::default()
    });
    let addr = serve(fake.clone()).await;
    let report = run_generator(
        addr,
        "--scenario first-touch --requests 40 --connections 4 --on-503 resend --seed 9",
    )
    .await;
    assert_counts_add_up(&report, &fake);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Fail);
    assert_eq!(e.violation_count, 40, "every key landed twice");
    assert!(
        e.violations
            .iter()
            .all(|v| v.kind == ViolationKind::Duplicate)
    );
}

/// Rule: in the first-touch scenario every request at `--fresh-ratio 1` creates an account,
/// and first-touch latency is reported apart from writes to existing accounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_touch_creates_an_account_per_request() {
    let fake = Fake::new(Refusals::default());
    let addr = serve(fake.clone()).await;
    let report = run_generator(
        addr,
        "--scenario first-touch --requests 200 --connections 8 --seed 4",
    )
    .await;
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.setup.accounts, 0, "nothing to pre-fund");
    assert_eq!(fake.accounts(), 200);
    let (fresh, existing) = (
        report.first_touch_latency_us.clone().unwrap(),
        report.existing_account_latency_us.clone().unwrap(),
    );
    assert_eq!((fresh.count, existing.count), (200, 0));
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.checked, e.accounts_read), (200, 200));
    assert!(report.to_string().contains("1st touch:"));

    let mixed = Fake::new(Refusals::default());
    let addr = serve(mixed.clone()).await;
    let report = run_generator(
        addr,
        "--scenario first-touch --fresh-ratio 0.5 --accounts 4 --requests 200 --connections 8 --seed 4",
    )
    .await;
    assert_counts_add_up(&report, &mixed);
    let (fresh, existing) = (
        report.first_touch_latency_us.clone().unwrap(),
        report.existing_account_latency_us.clone().unwrap(),
    );
    assert_eq!(fresh.count + existing.count, 200);
    assert!(fresh.count > 50 && existing.count > 50, "seed 4: {fresh:?}");
    assert_eq!(mixed.accounts() as u64, 4 + fresh.count);
    assert_eq!(report.exactly_once.verdict, Verdict::Pass);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["scenario"], "first-touch");
}

/// Rule: `--server-pid` reports the process's resident memory at both ends of the measured
/// phase and the CPU it used (here the test process, which also hosts the fake).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_pid_reports_memory_and_cpu() {
    let fake = Fake::new(Refusals::default());
    let addr = serve(fake.clone()).await;
    let me = std::process::id();
    let report = run_generator(
        addr,
        &format!("--scenario spread --accounts 4 --requests 300 --connections 4 --server-pid {me}"),
    )
    .await;
    let server = report.server.clone().expect("sampled");
    assert_eq!(server.pid, me);
    assert!(server.rss_start_kib > 0 && server.rss_end_kib > 0);
    assert!(server.rss_max_kib >= server.rss_start_kib.max(server.rss_end_kib));
    assert!(server.cpu_secs >= 0.0);
    assert!(
        report
            .to_string()
            .contains(&format!("server:      pid {me}"))
    );
}

/// Rule: against a real Tally whose in-flight limit is far below the connections and which
/// refuses at once, re-sent keys still apply exactly once, goodput counts only the 2xx
/// answers, and each worker keeps its one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_tally_sheds_and_stays_exactly_once() {
    let server =
        RealTally::start(&["--max-concurrent-requests", "2", "--max-queue-wait-ms", "0"]).await;
    let workers = 32;
    let report = run_generator(
        server.addr,
        &format!(
            "--scenario spread --accounts 8 --requests 400 --connections {workers} --on-503 resend --seed 3"
        ),
    )
    .await;
    print!("{report}");
    assert_eq!(report.errors, 0);
    assert_eq!(count(&report, 200), 400, "every operation got its 2xx");
    assert!(
        count(&report, 503) > 0,
        "32 connections over 2 slots are shed"
    );
    assert_eq!(
        report.requests,
        report.operations + report.resends,
        "only 503s were re-sent"
    );
    assert_eq!(count(&report, 503), report.resends);
    assert_eq!(
        report.connects, workers,
        "below the connection cap a refusal keeps the connection"
    );
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(e.checked, 408);
}

/// Rule: against a real Tally, `--batch` sends every write scenario's operations as
/// `POST /api/batch` items; with whole batches retried and store acknowledgements lost,
/// the audit finds every item answered 2xx once, and no item more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_tally_takes_batches_exactly_once_per_item() {
    let server = RealTally::start(&[
        "--faults",
        "lost-ack=0.1,seed=5",
        "--write-max-attempts",
        "1",
    ])
    .await;
    let report = run_generator(
        server.addr,
        &format!(
            "--scenario mixed --accounts 12 --requests 600 --batch 50 --connections 4 --retry-ratio 0.3 --seed 8 --metrics http://{}",
            server.addr
        ),
    )
    .await;
    print!("{report}");
    assert_eq!(report.errors, 0);
    assert_eq!(
        count(&report, 200),
        report.requests,
        "every batch answered 200"
    );
    let batch = report.batch.as_ref().unwrap();
    assert_eq!(batch.batches, 12);
    assert_eq!(report.requests, 12 + report.retries);
    assert_eq!(batch.items_sent, 600 + 50 * report.retries);
    let items = |status| batch.item_status_counts.get(&status).copied().unwrap_or(0);
    assert!(items(409) > 0, "lost acknowledgements answer items 409");
    assert!(
        batch.item_replays > 0,
        "a batch resent whole replays its items"
    );
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(e.checked, 612);
    assert!(
        e.unknown > 0 && e.unknown_landed > 0,
        "a lost ack landed once"
    );
    // The replica's own counters: its store writes over the measured phase, per item.
    let store = report.store_requests.as_ref().expect("--metrics read");
    let writes = store.by_operation.get("write").copied().unwrap_or(0);
    assert!(writes > 0, "{store:?}");
    let items_ok = batch.item_status_counts.get(&200).copied().unwrap_or(0);
    assert_eq!(store.successes, items_ok);
    assert!((store.writes_per_success - writes as f64 / items_ok as f64).abs() < 1e-9);
}

/// A real Tally in this process, on its embedded store and port 0; stopped when dropped.
struct RealTally {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl RealTally {
    async fn start(flags: &[&str]) -> Self {
        let args = [
            "tally",
            "--listen",
            "127.0.0.1:0",
            "--seed-demo-accounts",
            "false",
        ];
        let config = tally::config::Config::parse_from(args.iter().chain(flags));
        let app = tally::app::App::builder(config)
            .build()
            .await
            .expect("app builds");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(tally::http::serve(app, listener, async {
            let _ = stopped.await;
        }));
        RealTally { addr, _stop: stop }
    }
}
