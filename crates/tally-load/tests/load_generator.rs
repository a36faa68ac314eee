//! Drives the `tally-load` core against a small in-process fake of the Tally HTTP API
//! (in-memory accounts, idempotency-key dedup, optional faults) and checks its report.

use std::collections::HashMap;
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
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use uuid::Uuid;

use tally_load::audit::{Verdict, ViolationKind};
use tally_load::conn::TARGET_DOWN_PAUSE;
use tally_load::{Options, Report};

/// Longest any single generator run may take in these tests.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// Largest request body the fake reads (a batch of 100 transfers fits).
const MAX_FAKE_BODY: usize = 1024 * 1024;
/// Most items the fake takes in one batch; a larger one is refused whole with 413.
const MAX_FAKE_BATCH: usize = 50;
/// The fake's demo accounts and their opening balances.
const DEMO: [(u128, &str, i64); 3] = [
    (0xA11CE, "Alice", 50_000),
    (0xB0B, "Bob", 25_000),
    (0xCA201, "Carol", 10_000),
];

/// Misbehaviour the fake can be asked for.
#[derive(Clone, Copy, Default)]
struct Faults {
    /// Apply a retried key again instead of replaying it (the bug the verifier must catch).
    double_apply_retries: bool,
    /// Answer every Nth write 503 without applying it (0 = never).
    shed_every: u64,
    /// Apply every Nth fresh write but answer 503, as if the answer were lost (0 = never).
    lost_answer_every: u64,
    /// Apply every Nth fresh write, then close the connection without answering, as a
    /// replica killed after its write landed does (0 = never).
    hang_up_every: u64,
}

/// A stored first answer for an idempotency key.
struct Stored {
    fingerprint: String,
    status: u16,
    body: String,
}

#[derive(Default)]
struct State {
    streams: HashMap<Uuid, Vec<Value>>,
    balances: HashMap<Uuid, i64>,
    keys: HashMap<String, Stored>,
    writes: u64,
    fresh_writes: u64,
}

/// The fake server: one shared state behind any number of listeners (a "fleet").
struct Fake {
    faults: Faults,
    state: Mutex<State>,
    /// Requests other than history reads, i.e. what the generator's own counters cover.
    load_requests: AtomicU64,
}

/// A reply before it becomes an HTTP response.
struct Reply {
    status: u16,
    body: String,
    replayed: bool,
    retry_after: bool,
    /// Close the connection instead of answering.
    hang_up: bool,
}

impl Reply {
    fn new(status: u16, body: Value) -> Self {
        Reply {
            status,
            body: body.to_string(),
            replayed: false,
            retry_after: false,
            hang_up: false,
        }
    }

    fn error(status: u16, code: &str) -> Self {
        Reply::new(status, json!({ "error": { "code": code } }))
    }
}

impl Fake {
    fn new(faults: Faults) -> Arc<Self> {
        let fake = Fake {
            faults,
            state: Mutex::new(State::default()),
            load_requests: AtomicU64::new(0),
        };
        {
            let mut state = fake.state.lock().unwrap();
            for (id, _, cents) in DEMO {
                append(
                    &mut state,
                    Uuid::from_u128(id),
                    "Deposited",
                    cents,
                    None,
                    None,
                );
            }
        }
        Arc::new(fake)
    }

    fn route(
        &self,
        method: &Method,
        path: &str,
        query: &str,
        key: Option<&str>,
        body: &[u8],
    ) -> Reply {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let is_history = matches!(parts.as_slice(), ["api", "accounts", _, "history"]);
        if parts == ["metrics"] {
            // Not load: the store request counters `--metrics` reads, one store write per
            // write the fake took, and a fixed read count that never moves.
            let writes = self.state.lock().unwrap().writes;
            return Reply {
                body: format!(
                    "tally_store_requests_total{{operation=\"write\",result=\"ok\"}} {writes}\n\
                     tally_store_requests_total{{operation=\"read\",result=\"ok\"}} 7\n"
                ),
                ..Reply::new(200, Value::Null)
            };
        }
        if !is_history {
            self.load_requests.fetch_add(1, Ordering::Relaxed);
        }
        match (method, parts.as_slice()) {
            (&Method::GET, ["api", "accounts"]) => Reply::new(
                200,
                json!({ "accounts": DEMO.iter().map(|(id, name, _)| json!({
                    "id": Uuid::from_u128(*id).to_string(), "name": name,
                })).collect::<Vec<_>>() }),
            ),
            (&Method::POST, ["api", "batch"]) => self.batch(body),
            (_, ["api", "accounts", id, action]) => {
                let Ok(account) = Uuid::parse_str(id) else {
                    return Reply::error(422, "VALIDATION_ERROR");
                };
                match (method, *action) {
                    (&Method::GET, "balance") => {
                        let state = self.state.lock().unwrap();
                        Reply::new(200, position(&state, account))
                    }
                    (&Method::GET, "history") => self.history(account, query),
                    (&Method::POST, "deposit" | "withdraw" | "transfers") => {
                        self.write(account, action, key, body)
                    }
                    _ => Reply::error(404, "NOT_FOUND"),
                }
            }
            _ => Reply::error(404, "NOT_FOUND"),
        }
    }

    fn history(&self, account: Uuid, query: &str) -> Reply {
        let param = |name: &str| {
            query
                .split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == name)
                .and_then(|(_, v)| v.parse::<u64>().ok())
        };
        let from = param("fromVersion").unwrap_or(0);
        let limit = param("limit").unwrap_or(100).clamp(1, 1000) as usize;
        let state = self.state.lock().unwrap();
        let all = state
            .streams
            .get(&account)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let rest: Vec<&Value> = all
            .iter()
            .filter(|e| e["aggregateVersion"].as_u64().unwrap_or(0) >= from)
            .collect();
        let page: Vec<Value> = rest.iter().take(limit).map(|e| (*e).clone()).collect();
        let mut body = json!({
            "events": page,
            "currentAggregateVersion": all.len(),
            "balanceCents": state.balances.get(&account).copied().unwrap_or(0),
        });
        if rest.len() > limit {
            let last = page
                .last()
                .and_then(|e| e["aggregateVersion"].as_u64())
                .unwrap_or(from);
            body["nextFromVersion"] = json!(last + 1);
        }
        Reply::new(200, body)
    }

    /// `POST /api/batch`: each item through [`Fake::write`] as its single route's body, so
    /// items and single requests share keys and faults; the whole batch hangs up when any
    /// item would.
    fn batch(&self, body: &[u8]) -> Reply {
        let items = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v["items"].as_array().cloned())
            .filter(|items| !items.is_empty());
        let Some(items) = items else {
            return Reply::error(400, "VALIDATION_ERROR");
        };
        if items.len() > MAX_FAKE_BATCH {
            return Reply::error(413, "BATCH_TOO_LARGE");
        }
        let (mut results, mut hang_up, mut shed) = (Vec::new(), false, false);
        for item in &items {
            let key = item["idempotencyKey"].as_str();
            let amount = item["amountCents"].clone();
            let (account, action, single) = match item["type"].as_str() {
                Some(kind @ ("deposit" | "withdraw")) => {
                    (&item["accountId"], kind, json!({ "amountCents": amount }))
                }
                Some("transfer") => (
                    &item["fromAccountId"],
                    "transfers",
                    json!({ "toAccountId": item["toAccountId"], "amountCents": amount }),
                ),
                _ => (&Value::Null, "", Value::Null),
            };
            let reply = match account.as_str().and_then(|a| Uuid::parse_str(a).ok()) {
                Some(account) => self.write(account, action, key, single.to_string().as_bytes()),
                None => Reply::error(400, "VALIDATION_ERROR"),
            };
            hang_up |= reply.hang_up;
            shed |= reply.status == 503;
            results.push(json!({
                "status": reply.status,
                "body": serde_json::from_str::<Value>(&reply.body).unwrap_or_default(),
                "idempotencyKey": key,
                "replayed": reply.replayed,
                "idempotencyWindow": 90,
            }));
        }
        Reply {
            retry_after: shed,
            hang_up,
            ..Reply::new(200, json!({ "results": results }))
        }
    }

    fn write(&self, account: Uuid, action: &str, key: Option<&str>, body: &[u8]) -> Reply {
        let Some(key) = key.filter(|k| !k.is_empty() && k.len() <= 255) else {
            return Reply::error(422, "VALIDATION_ERROR");
        };
        let Ok(request) = serde_json::from_slice::<Value>(body) else {
            return Reply::error(422, "VALIDATION_ERROR");
        };
        let amount = request["amountCents"].as_i64().filter(|a| *a > 0);
        let to = request["toAccountId"]
            .as_str()
            .and_then(|s| Uuid::parse_str(s).ok());
        let Some(amount) = amount else {
            return Reply::error(422, "VALIDATION_ERROR");
        };
        if action == "transfers" && to.is_none_or(|t| t == account) {
            return Reply::error(422, "VALIDATION_ERROR");
        }
        let fingerprint = format!("{action} {account} {request}");
        let event_id = Uuid::parse_str(key).ok();
        let mut state = self.state.lock().unwrap();
        state.writes += 1;
        if self.faults.shed_every > 0 && state.writes.is_multiple_of(self.faults.shed_every) {
            let mut reply = Reply::error(503, "OVERLOADED");
            reply.retry_after = true;
            return reply;
        }
        if let Some(stored) = state.keys.get(key) {
            if stored.fingerprint != fingerprint {
                return Reply::error(422, "IDEMPOTENCY_KEY_REUSED");
            }
            if !self.faults.double_apply_retries {
                return Reply {
                    status: stored.status,
                    body: stored.body.clone(),
                    replayed: true,
                    retry_after: false,
                    hang_up: false,
                };
            }
        }
        let balance = state.balances.get(&account).copied().unwrap_or(0);
        let answer = match (action, to) {
            ("deposit", _) => {
                append(&mut state, account, "Deposited", amount, None, event_id);
                position(&state, account)
            }
            (_, _) if balance < amount => return Reply::error(422, "INSUFFICIENT_FUNDS"),
            ("withdraw", _) => {
                append(&mut state, account, "Withdrawn", -amount, None, event_id);
                position(&state, account)
            }
            (_, Some(to)) => {
                append(
                    &mut state,
                    account,
                    "TransferredOut",
                    -amount,
                    Some(("toAccountId", to)),
                    event_id,
                );
                append(
                    &mut state,
                    to,
                    "TransferredIn",
                    amount,
                    Some(("fromAccountId", account)),
                    event_id,
                );
                json!({ "from": position(&state, account), "to": position(&state, to) })
            }
            _ => return Reply::error(422, "VALIDATION_ERROR"),
        };
        let reply = Reply::new(200, answer);
        state.keys.insert(
            key.to_string(),
            Stored {
                fingerprint,
                status: reply.status,
                body: reply.body.clone(),
            },
        );
        state.fresh_writes += 1;
        if self.faults.lost_answer_every > 0
            && state
                .fresh_writes
                .is_multiple_of(self.faults.lost_answer_every)
        {
            let mut lost = Reply::error(503, "UNAVAILABLE");
            lost.retry_after = true;
            return lost;
        }
        let hang_up = self.faults.hang_up_every > 0
            && state.fresh_writes.is_multiple_of(self.faults.hang_up_every);
        Reply { hang_up, ..reply }
    }
}

/// Appends one event; `delta` is signed, the event's amount is its magnitude.
fn append(
    state: &mut State,
    account: Uuid,
    kind: &str,
    delta: i64,
    counterparty: Option<(&str, Uuid)>,
    event_id: Option<Uuid>,
) {
    let stream = state.streams.entry(account).or_default();
    let mut event = json!({
        "aggregateVersion": stream.len() + 1,
        "timestamp": "2025-01-01T00:00:00Z",
        "type": kind,
        "amountCents": delta.abs(),
    });
    if let Some((field, other)) = counterparty {
        event[field] = json!(other.to_string());
    }
    if let Some(id) = event_id {
        event["eventId"] = json!(id.to_string());
    }
    stream.push(event);
    *state.balances.entry(account).or_default() += delta;
}

fn position(state: &State, account: Uuid) -> Value {
    json!({
        "balanceCents": state.balances.get(&account).copied().unwrap_or(0),
        "aggregateVersion": state.streams.get(&account).map_or(0, Vec::len),
    })
}

/// Serves one request; an error makes hyper close the connection without an answer.
async fn handle(
    fake: Arc<Fake>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or_default().to_string();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match Limited::new(request.into_body(), MAX_FAKE_BODY)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let reply = fake.route(&method, &path, &query, key.as_deref(), &body);
    if reply.hang_up {
        return Err(std::io::Error::other("the fake hangs up after writing"));
    }
    let mut response = Response::builder()
        .status(StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json");
    if reply.replayed {
        response = response.header("idempotent-replayed", "true");
    }
    if reply.retry_after {
        response = response.header("retry-after", "0");
    }
    Ok(response
        .body(Full::new(Bytes::from(reply.body)))
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

/// Runs the generator core with `command_line` (flags separated by whitespace).
async fn run_generator(command_line: &str) -> Report {
    let argv = std::iter::once("tally-load").chain(command_line.split_whitespace());
    let options = Options::try_parse_from(argv).expect("options parse");
    tokio::time::timeout(RUN_LIMIT, tally_load::run(options))
        .await
        .expect("generator finished in time")
        .expect("generator ran")
}

fn target(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A loopback address nothing listens on: connections to it are refused.
async fn refusing_address() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

/// 2xx answers in `report`.
fn successes(report: &Report) -> u64 {
    report
        .status_counts
        .iter()
        .filter(|(status, _)| (200..300).contains(*status))
        .map(|(_, n)| n)
        .sum()
}

/// The counts a report must satisfy whatever the scenario.
fn assert_counts_add_up(report: &Report, fake: &Fake) {
    let answered: u64 = report.status_counts.values().sum();
    assert_eq!(
        report.requests,
        report.operations + report.retries + report.failovers
    );
    assert_eq!(answered + report.errors, report.requests);
    assert_eq!(report.latency_us.count, answered);
    assert!(report.latency_us.p50 <= report.latency_us.p90);
    assert!(report.latency_us.p90 <= report.latency_us.p99);
    assert!(report.latency_us.p99 <= report.latency_us.p999);
    assert_eq!(
        fake.load_requests.load(Ordering::Relaxed),
        report.requests + report.setup.requests,
        "the fake saw exactly the requests the generator counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_fleet_with_retries_and_faults_passes() {
    let fake = Fake::new(Faults {
        shed_every: 13,
        lost_answer_every: 17,
        ..Faults::default()
    });
    let (a, b) = (serve(fake.clone()).await, serve(fake.clone()).await);
    let report = run_generator(&format!(
        "--target {} --target {} --scenario mixed --accounts 6 --requests 300 --connections 8 --retry-ratio 0.4 --seed 7 --amount-cents 250",
        target(a), target(b)
    ))
    .await;
    print!("{report}");
    assert_eq!(report.operations, 300);
    assert!(report.retries > 0);
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.errors, 0);
    assert!(report.replays > 0, "retries of landed writes are replayed");
    assert!(report.status_counts.get(&503).is_some_and(|n| *n > 0));
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert!(report.passed());
    assert_eq!(e.checked, report.operations + report.setup.accounts as u64);
    assert_eq!(e.checked, e.succeeded + e.rejected + e.unknown);
    assert!(
        e.unknown > 0 && e.unknown_landed > 0,
        "shed and lost answers are unknown"
    );
    assert_eq!(e.violation_count, 0);
}

/// The counts a `--batch` report must satisfy: requests are batches and their re-sends,
/// operations are items, and every item of every send is counted once by status.
fn assert_batch_counts_add_up(report: &Report, fake: &Fake, size: u64) {
    let answered: u64 = report.status_counts.values().sum();
    let batch = report.batch.as_ref().expect("a batch summary");
    assert_eq!(batch.size as u64, size);
    assert_eq!(batch.batches, report.operations.div_ceil(size));
    assert_eq!(
        report.requests,
        batch.batches + report.retries + report.resends + report.failovers
    );
    assert_eq!(answered + report.errors, report.requests);
    assert_eq!(
        report.latency_us.count, answered,
        "latency is per batch request"
    );
    assert_eq!(
        batch.item_status_counts.values().sum::<u64>(),
        batch.items_sent
    );
    assert_eq!(
        fake.load_requests.load(Ordering::Relaxed),
        report.requests + report.setup.requests,
        "the fake saw exactly the requests the generator counted"
    );
}

/// Rule: with `--batch N` every write scenario sends its operations N to a request, each
/// item under its own key, and the audit holds each item to exactly once (a retried batch
/// replays item by item; shed and lost items are unknown and land at most once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_every_write_scenario_pass_the_audit_per_item() {
    let fake = Fake::new(Faults {
        shed_every: 13,
        lost_answer_every: 17,
        ..Faults::default()
    });
    let (a, b) = (serve(fake.clone()).await, serve(fake.clone()).await);
    let report = run_generator(&format!(
        "--target {} --target {} --scenario mixed --accounts 6 --requests 300 --batch 10 --connections 4 --retry-ratio 0.4 --seed 7 --amount-cents 250 --json",
        target(a), target(b)
    ))
    .await;
    print!("{report}");
    assert_batch_counts_add_up(&report, &fake, 10);
    assert_eq!(report.operations, 300);
    assert!(report.retries > 0);
    let batch = report.batch.as_ref().unwrap();
    assert_eq!(
        batch.items_sent,
        300 + 10 * report.retries,
        "a retry re-sends its whole batch"
    );
    let items = |status| batch.item_status_counts.get(&status).copied().unwrap_or(0);
    assert!(items(503) > 0, "the fake sheds and loses items");
    assert!(
        batch.item_replays >= 10 * report.retries - items(503) - items(422),
        "a retried batch replays its landed items"
    );
    {
        let state = fake.state.lock().unwrap();
        assert_eq!(
            state.writes,
            batch.items_sent + report.setup.accounts as u64,
            "each item sent is one write"
        );
    }
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(e.checked, 300 + report.setup.accounts as u64);
    assert!(
        e.unknown > 0 && e.unknown_landed > 0,
        "lost items landed once"
    );
    assert!(batch.items_per_sec > 0.0);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["batch"]["size"], 10);
    assert!(json["batch"]["items_per_sec"].as_f64().unwrap() > 0.0);
    assert!(
        report
            .to_string()
            .contains("batches:     30 of up to 10 items")
    );

    for scenario in ["spread", "hot", "first-touch"] {
        let fake = Fake::new(Faults::default());
        let addr = serve(fake.clone()).await;
        let report = run_generator(&format!(
            "--target {} --scenario {scenario} --accounts 5 --requests 95 --batch 20 --connections 2 --seed 3",
            target(addr)
        ))
        .await;
        assert_batch_counts_add_up(&report, &fake, 20);
        let batch = report.batch.as_ref().unwrap();
        assert_eq!(batch.batches, 5, "{scenario}: the last batch carries 15");
        assert_eq!(batch.item_status_counts.get(&200).copied(), Some(95));
        let e = &report.exactly_once;
        assert_eq!(e.verdict, Verdict::Pass, "{scenario}: {:?}", e.violations);
        assert_eq!(e.succeeded, e.checked, "{scenario}");
    }
}

/// Rule: a batch re-sent whole whose items the server applies again is caught item by item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_applied_batch_retry_fails_the_verdict_per_item() {
    let fake = Fake::new(Faults {
        double_apply_retries: true,
        ..Faults::default()
    });
    let addr = serve(fake.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario spread --accounts 20 --requests 200 --batch 5 --connections 4 --retry-ratio 0.5 --seed 11",
        target(addr)
    ))
    .await;
    assert_batch_counts_add_up(&report, &fake, 5);
    assert!(report.retries > 0);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Fail);
    let duplicates = e
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::Duplicate)
        .count();
    assert!(duplicates > 0, "{:?}", e.violations);
    assert!(
        e.violation_count >= 5 * report.retries,
        "every item of every retried batch is caught: {} violations, {} retries",
        e.violation_count,
        report.retries
    );
}

/// Rule: `--on-503` re-sends only the items answered 503, under their keys, until each gets
/// another answer; every item then lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_503_resends_only_the_refused_items() {
    let fake = Fake::new(Faults {
        shed_every: 7,
        ..Faults::default()
    });
    let addr = serve(fake.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario spread --accounts 10 --requests 300 --batch 10 --connections 4 --on-503 resend --seed 5 --metrics {}",
        target(addr),
        target(addr)
    ))
    .await;
    print!("{report}");
    assert_batch_counts_add_up(&report, &fake, 10);
    let batch = report.batch.as_ref().unwrap();
    let shed = batch.item_status_counts.get(&503).copied().unwrap_or(0);
    assert!(shed > 0 && report.resends > 0);
    assert_eq!(
        batch.items_sent,
        300 + shed,
        "each re-send carries only the items shed"
    );
    assert_eq!(batch.item_status_counts.get(&200).copied(), Some(300));
    // `--metrics`: the fake counts one store write per item it took, shed ones included.
    let store = report.store_requests.as_ref().expect("--metrics read");
    assert_eq!(store.by_operation.get("write"), Some(&batch.items_sent));
    assert_eq!(store.by_operation.get("read"), Some(&0));
    assert_eq!(store.total, batch.items_sent);
    assert_eq!(store.successes, 300, "every item got its 2xx");
    assert!((store.writes_per_success - batch.items_sent as f64 / 300.0).abs() < 1e-9);
    assert!(report.to_string().contains("writes per 2xx item"));
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.succeeded, e.unknown), (e.checked, 0));
}

/// Rule: `--failover` re-sends a batch that got no answer to another target, and its items,
/// applied before the hang-up, are replayed there and land once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_resends_an_unanswered_batch_and_its_items_land_once() {
    let fake = Fake::new(Faults {
        hang_up_every: 23,
        ..Faults::default()
    });
    let (a, b) = (serve(fake.clone()).await, serve(fake.clone()).await);
    let report = run_generator(&format!(
        "--target {} --target {} --scenario mixed --accounts 8 --requests 300 --batch 5 --connections 4 --failover true --seed 13",
        target(a),
        target(b)
    ))
    .await;
    print!("{report}");
    assert_batch_counts_add_up(&report, &fake, 5);
    assert!(
        report.failovers > 0,
        "a batch holding a 23rd write hangs up"
    );
    assert_eq!(report.failovers, report.errors);
    let batch = report.batch.as_ref().unwrap();
    assert!(
        batch.item_replays > 0,
        "the other target replays what landed"
    );
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(e.unknown, 0, "every item settled after its failover");
}

/// Rule: a batch refused as a whole (413, over the server's cap) wrote nothing: each of its
/// items is recorded as refused, and the audit finds none of them in history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_whole_is_rejected_item_by_item() {
    let fake = Fake::new(Faults::default());
    let addr = serve(fake.clone()).await;
    let over = MAX_FAKE_BATCH + 1;
    let report = run_generator(&format!(
        "--target {} --scenario spread --accounts 4 --requests {} --batch {over} --connections 2 --seed 2",
        target(addr),
        2 * over
    ))
    .await;
    assert_batch_counts_add_up(&report, &fake, over as u64);
    assert_eq!(report.status_counts.get(&413).copied(), Some(2));
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.rejected, e.succeeded), (2 * over as u64, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_applied_retry_fails_the_verdict() {
    let fake = Fake::new(Faults {
        double_apply_retries: true,
        ..Faults::default()
    });
    let addr = serve(fake.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario spread --accounts 20 --requests 200 --connections 4 --retry-ratio 0.5 --seed 11",
        target(addr)
    ))
    .await;
    print!("{report}");
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.replays, 0);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Fail);
    assert!(!report.passed());
    let kinds: Vec<ViolationKind> = e.violations.iter().map(|v| v.kind).collect();
    assert!(kinds.contains(&ViolationKind::Duplicate));
    assert!(kinds.contains(&ViolationKind::BodyMismatch));
    assert!(
        e.violation_count >= report.retries,
        "each double apply is caught"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_hot_uses_the_demo_accounts() {
    let fake = Fake::new(Faults::default());
    let addr = serve(fake.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario hot --rate 2000 --requests 200 --connections 16 --retry-ratio 0.2 --json",
        target(addr)
    ))
    .await;
    assert_eq!(report.mode, "open-loop");
    assert_eq!(report.operations, 200);
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.setup.accounts, 3);
    assert_eq!(
        report.status_counts.get(&200).copied(),
        Some(report.requests)
    );
    assert_eq!(report.replays, report.retries);
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(
        (e.checked, e.foreign_events),
        (200, 3),
        "demo deposits carry no eventId"
    );
    let json = serde_json::to_value(&report).unwrap();
    for field in ["throughput", "status_counts", "replays", "errors"] {
        assert!(json.get(field).is_some(), "{field}");
    }
    for field in ["p50", "p90", "p99", "p999"] {
        assert!(json["latency_us"][field].is_u64(), "{field}");
    }
    assert_eq!(json["exactly_once"]["verdict"], "pass");
    assert!(json["exactly_once"]["violations"].is_array());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_refuses_connections_is_left_alone_and_verified_through_the_others() {
    let fake = Fake::new(Faults::default());
    let (dead, live) = (refusing_address().await, serve(fake.clone()).await);
    let connections = 4;
    let report = run_generator(&format!(
        "--target {} --target {} --scenario spread --accounts 20 --requests 400 --connections {connections} --seed 5",
        target(dead),
        target(live)
    ))
    .await;
    print!("{report}");
    let refused = report.error_kinds.get("connect").copied().unwrap_or(0);
    assert!(refused > 0, "half the tickets start at the dead target");
    assert_eq!(report.errors, refused, "no other transport error");
    // A worker meets the refusal once, then leaves the target alone for a pause: not once
    // per ticket (about 200 of the 400 would start there).
    let pauses = (report.elapsed_secs / TARGET_DOWN_PAUSE.as_secs_f64()).ceil() as u64 + 1;
    assert!(
        refused <= connections * pauses,
        "{refused} refusals in {:.2} s from {connections} workers",
        report.elapsed_secs
    );
    assert_eq!(successes(&report), report.operations - refused);
    assert_eq!(report.failovers, 0, "failover is off by default");
    // The verifier's reads move on to the live target instead of giving up.
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?} {:?}", e.error, e.violations);
    assert_eq!(e.unknown, refused, "a refused operation was never sent");
    assert_eq!(e.unknown_landed, 0);
    // The hot scenario lists its accounts from the first target that answers.
    let hot = run_generator(&format!(
        "--target {} --target {} --scenario hot --requests 100 --connections 2 --seed 5",
        target(dead),
        target(live)
    ))
    .await;
    assert_eq!(hot.exactly_once.verdict, Verdict::Pass);
    assert_eq!(successes(&hot), hot.operations - hot.errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_resends_an_unanswered_write_elsewhere_and_it_lands_once() {
    let fake = Fake::new(Faults {
        hang_up_every: 7,
        ..Faults::default()
    });
    let (a, b) = (serve(fake.clone()).await, serve(fake.clone()).await);
    let report = run_generator(&format!(
        "--target {} --target {} --scenario mixed --accounts 8 --requests 300 --connections 6 --failover true --seed 13",
        target(a),
        target(b)
    ))
    .await;
    print!("{report}");
    assert_counts_add_up(&report, &fake);
    assert!(
        report.failovers > 0,
        "every 7th write is applied, then hung up on"
    );
    assert_eq!(
        report.failovers, report.errors,
        "each unanswered request failed over"
    );
    assert!(
        report.replays >= report.failovers,
        "a failed-over write had landed: the other target replays it"
    );
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!(e.unknown, 0, "every write settled after its failover");
    assert_eq!(e.checked, e.succeeded + e.rejected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_reads_and_paged_history() {
    let fake = Fake::new(Faults::default());
    let addr = serve(fake.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario balance --accounts 5 --requests 150 --connections 4 --retry-ratio 1",
        target(addr)
    ))
    .await;
    assert_counts_add_up(&report, &fake);
    assert_eq!(report.retries, 0, "reads are never re-sent");
    assert_eq!(report.status_counts.get(&200).copied(), Some(150));
    assert_eq!(report.exactly_once.verdict, Verdict::Pass);
    assert_eq!(
        report.exactly_once.checked, 5,
        "only the pre-funding deposits carry keys"
    );

    // One hot account with more events than a history page holds.
    let deep = Fake::new(Faults::default());
    let addr = serve(deep.clone()).await;
    let report = run_generator(&format!(
        "--target {} --scenario spread --accounts 1 --requests 1200 --connections 8 --seed 3",
        target(addr)
    ))
    .await;
    let e = &report.exactly_once;
    assert_eq!(e.verdict, Verdict::Pass, "{:?}", e.violations);
    assert_eq!((e.checked, e.events_read), (1201, 1201));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_prints_json_and_sets_exit_codes() {
    let exe = env!("CARGO_BIN_EXE_tally-load");
    let good = serve(Fake::new(Faults::default())).await;
    let output = tokio::process::Command::new(exe)
        .args([
            "--target",
            &target(good),
            "--scenario",
            "mixed",
            "--accounts",
            "4",
        ])
        .args([
            "--requests",
            "200",
            "--connections",
            "8",
            "--retry-ratio",
            "0.3",
            "--json",
        ])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(json["exactly_once"]["verdict"], "pass");
    assert_eq!(json["operations"], 200);

    let bad = serve(Fake::new(Faults {
        double_apply_retries: true,
        ..Faults::default()
    }))
    .await;
    let output = tokio::process::Command::new(exe)
        .args([
            "--target",
            &target(bad),
            "--requests",
            "100",
            "--accounts",
            "5",
        ])
        .args(["--connections", "4", "--retry-ratio", "0.5"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("exactly-once: FAIL"), "{text}");

    let output = tokio::process::Command::new(exe)
        .args(["--target", "http://example.invalid:8080", "--requests", "1"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("loopback"));

    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let output = tokio::process::Command::new(exe)
        .args([
            "--target",
            &target(closed),
            "--scenario",
            "hot",
            "--requests",
            "1",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("setup failed"));
}
