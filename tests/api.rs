//! Black-box tests of the HTTP API: every route, every status, the error body, and the
//! Idempotency-Key contract, against servers on port 0 (the harness) and against the real
//! `tally` binary (startup, `--help`, graceful shutdown on SIGTERM).

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use common::{Reply, TestApp, new_account, spawn, spawn_default, spawn_fleet, test_config};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::config::Config;
use tally::projection::ManualClock;
use tally::store::faults::{Fault, FaultyLog};
use tally::store::memory::{MemoryLog, MemoryOptions, ServerClock};
use tally::store::{AggregateWrite, Event, EventType, SharedLog};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;
use uuid::Uuid;

// --- Helpers ---

/// The body limit the API states: 64 KiB.
const MAX_BODY: usize = 64 * 1024;

/// Asserts an error answer: the status, a JSON content type, and a body
/// `{"error": code, "message": "<non-empty>"}` (never plain text).
#[track_caller]
fn assert_error(r: &Reply, status: u16, code: &str) {
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

/// Sends any request: method, path, extra headers (raw bytes allowed) and an optional body.
async fn send(
    t: &TestApp,
    method: Method,
    path: &str,
    headers: &[(&str, &[u8])],
    body: Option<Vec<u8>>,
) -> Reply {
    let mut req = t.client.request(method, t.url(path));
    for (name, value) in headers {
        req = req.header(
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_bytes(value).expect("header value"),
        );
    }
    if let Some(b) = body {
        req = req.body(b);
    }
    common::read(req.send().await.expect("request sent")).await
}

/// POSTs a raw JSON body (any bytes) with `Content-Type: application/json`.
async fn post_raw(t: &TestApp, path: &str, body: &[u8], key: Option<&str>) -> Reply {
    let mut headers: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
    if let Some(k) = key {
        headers.push(("idempotency-key", k.as_bytes()));
    }
    send(t, Method::POST, path, &headers, Some(body.to_vec())).await
}

fn deposit_path(account: &str) -> String {
    format!("/api/accounts/{account}/deposit")
}

fn withdraw_path(account: &str) -> String {
    format!("/api/accounts/{account}/withdraw")
}

fn account_transfer_path(account: &str) -> String {
    format!("/api/accounts/{account}/transfers")
}

/// What an account looks like from outside: balance, version and every history event.
async fn observe(t: &TestApp, account: &str) -> (i64, u64, Vec<Value>) {
    let (balance, version) = t.balance(account).await;
    (balance, version, t.history(account).await)
}

/// An account with one deposit of `cents`, so "unchanged" means more than "empty".
async fn funded(t: &TestApp, cents: i64) -> String {
    let account = new_account();
    let r = t.deposit(&account, cents, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    account
}

/// The `{balanceCents, aggregateVersion}` of a single-account answer.
fn leg(v: &Value) -> (i64, u64) {
    (
        v["balanceCents"].as_i64().expect("balanceCents"),
        v["aggregateVersion"].as_u64().expect("aggregateVersion"),
    )
}

/// The fault injector of an app started with `--faults`.
fn faults(t: &TestApp) -> &Arc<FaultyLog> {
    t.app.faults.as_ref().expect("started with --faults")
}

/// How long a raw exchange waits for the server before the test fails (instead of hanging).
const RAW_READ_BOUND: Duration = Duration::from_secs(30);

/// Sends raw bytes over one TCP connection (`head` and then each body chunk) and reads one
/// response. For what a well-behaved client cannot send: chunked bodies past the limit, a
/// declared length with no body.
async fn raw_exchange(addr: SocketAddr, head: String, chunks: Vec<Vec<u8>>) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    // The writer keeps its half open until it is aborted: dropping it would half-close the
    // connection. Errors are expected once the server stops reading.
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_err() {
            return wr;
        }
        for c in chunks {
            if wr.write_all(&c).await.is_err() {
                break;
            }
        }
        let _ = wr.flush().await;
        std::future::pending::<()>().await;
        wr
    });
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let parsed = loop {
        if let Some(parsed) = parse_response(&buf) {
            break parsed;
        }
        let read = tokio::time::timeout(RAW_READ_BOUND, rd.read(&mut chunk))
            .await
            .expect("the server answers");
        match read {
            Ok(0) | Err(_) => break parse_response(&buf).expect("a whole response"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    writer.abort();
    parsed
}

/// Parses a whole HTTP/1.1 response with a Content-Length, or `None` if more bytes are needed.
fn parse_response(buf: &[u8]) -> Option<Reply> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).expect("ASCII head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let code: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':')?;
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).ok()?,
            HeaderValue::from_str(value.trim()).ok()?,
        );
    }
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("the server always sends Content-Length");
    let body = buf.get(end + 4..end + 4 + len)?;
    let text = String::from_utf8(body.to_vec()).expect("UTF-8 body");
    Some(Reply {
        status: StatusCode::from_u16(code).ok()?,
        headers,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
    })
}

// --- Routes ---

#[tokio::test]
async fn no_accounts_are_listed_unless_demo_accounts_are_seeded() {
    let t = spawn_default().await;
    let r = t.get("/api/accounts").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "accounts": [] }));
    t.shutdown().await;
}

/// The harness config with demo-account seeding on (the harness turns it off).
fn seeding_config() -> Config {
    Config::parse_from([
        "tally",
        "--listen",
        "127.0.0.1:0",
        "--seed-demo-accounts",
        "true",
    ])
}

/// A demo account's id: UUIDv5 of its name in the documented namespace.
fn demo_id(name: &str) -> String {
    let ns = Uuid::parse_str("a1b2c3d4-e5f6-7890-abcd-ef1234567890").unwrap();
    Uuid::new_v5(&ns, name.as_bytes()).to_string()
}

/// Every demo account holds exactly its opening deposit, at version 1.
async fn assert_demo_accounts_seeded_once(t: &TestApp) {
    for (name, cents) in [("Alice", 50_000), ("Bob", 25_000), ("Charlie", 10_000)] {
        assert_eq!(t.balance(&demo_id(name)).await, (cents, 1), "{name}");
    }
}

/// The embedded store behind a fault injector that injects only what a test scripts.
fn scripted_faults() -> Arc<FaultyLog<MemoryLog>> {
    Arc::new(FaultyLog::new(
        Arc::new(MemoryLog::new()),
        Default::default(),
    ))
}

#[tokio::test]
async fn seeded_demo_accounts_are_listed_with_named_ids_and_opening_balances() {
    let t = spawn(seeding_config(), None, None).await;
    let r = t.get("/api/accounts").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let expected: Vec<Value> = ["Alice", "Bob", "Charlie"]
        .iter()
        .map(|name| json!({ "id": demo_id(name), "name": name }))
        .collect();
    assert_eq!(r.body["accounts"], Value::Array(expected));
    assert_demo_accounts_seeded_once(&t).await;
    t.shutdown().await;
}

/// Black-box finding: a store fault during demo seeding stopped the process at boot. Now the
/// replica starts and serves, `/readyz` says it is not ready, and the seeding is retried until
/// it lands (once: the opening deposits are create-only).
#[tokio::test]
async fn a_store_fault_during_start_up_leaves_the_replica_serving_and_not_ready_until_retried() {
    let faulty = scripted_faults();
    faulty.fail_next_write(Fault::Refused);
    faulty.fail_next_write(Fault::LostAck);
    let t = spawn(seeding_config(), Some(faulty.clone()), None).await;
    assert!(!t.app.is_started());
    let r = t.get("/readyz").await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert!(r.text.contains("starting"), "{}", r.text);
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    // The API waits too: a write now could take a demo account's first version, and the
    // fold cannot age the index before the server clock is anchored.
    let alice = demo_id("Alice");
    let r = t.deposit(&alice, 100, Some("early")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(t.app.projection.server_tip_ms(), 0, "not anchored yet");

    t.app.started().await;
    assert!(t.app.projection.server_tip_ms() > 0, "anchored");
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    assert_demo_accounts_seeded_once(&t).await;
    let r = t.deposit(&alice, 100, Some("early")).await;
    assert_eq!(leg(&r.body), (50_100, 2), "{}", r.text);
    let counts = faulty.counts();
    assert_eq!((counts.refused, counts.lost_ack), (1, 1));
    t.shutdown().await;
}

#[tokio::test]
async fn balance_of_an_account_without_events_is_zero_at_version_zero_and_creates_nothing() {
    let t = spawn_default().await;
    let account = new_account();
    let r = t.get(&format!("/api/accounts/{account}/balance")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "balanceCents": 0, "aggregateVersion": 0 }));
    let h = t.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(h.status, StatusCode::OK, "{}", h.text);
    assert_eq!(
        h.body,
        json!({ "events": [], "currentAggregateVersion": 0, "balanceCents": 0 })
    );
    t.shutdown().await;
}

#[tokio::test]
async fn deposit_and_withdraw_answer_the_new_balance_and_version() {
    let t = spawn_default().await;
    let account = new_account();
    let r = t.deposit(&account, 1_000, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.body,
        json!({ "balanceCents": 1000, "aggregateVersion": 1 })
    );
    let r = t.withdraw(&account, 300, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body,
        json!({ "balanceCents": 700, "aggregateVersion": 2 })
    );
    // Withdrawing everything is allowed: the balance may reach zero, not go below it.
    let r = t.withdraw(&account, 700, None).await;
    assert_eq!(r.body, json!({ "balanceCents": 0, "aggregateVersion": 3 }));
    assert_eq!(t.balance(&account).await, (0, 3));
    // The largest amount one operation may move.
    let r = t.deposit(&account, 2_147_483_647, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (2_147_483_647, 4));
    t.shutdown().await;
}

#[tokio::test]
async fn balance_with_min_version_reads_your_writes_on_any_replica() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let fleet = spawn_fleet(2, store, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let account = new_account();
    // Replica b folds the account while it is still empty.
    assert_eq!(b.balance(&account).await, (0, 0));
    let r = a.deposit(&account, 250, None).await;
    assert_eq!(leg(&r.body), (250, 1));
    let r = a
        .get(&format!("/api/accounts/{account}/balance?minVersion=1"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (250, 1));
    let r = b
        .get(&format!("/api/accounts/{account}/balance?minVersion=1"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (250, 1));
    // minVersion=0 is satisfied by anything.
    let r = b
        .get(&format!("/api/accounts/{account}/balance?minVersion=0"))
        .await;
    assert_eq!(leg(&r.body), (250, 1));
    for t in fleet {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn balance_with_a_min_version_no_replica_has_is_a_retryable_503() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let r = t
        .get(&format!("/api/accounts/{account}/balance?minVersion=2"))
        .await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    t.shutdown().await;
}

#[tokio::test]
async fn history_lists_every_event_with_its_fields() {
    let t = spawn_default().await;
    let (a, b) = (new_account(), new_account());
    let k1 = Uuid::new_v4().to_string();
    let k2 = Uuid::new_v4().to_string();
    let k3 = Uuid::new_v4().to_string();
    assert_eq!(t.deposit(&a, 1_000, Some(&k1)).await.status, StatusCode::OK);
    assert_eq!(t.withdraw(&a, 100, Some(&k2)).await.status, StatusCode::OK);
    assert_eq!(
        t.transfer(&a, &b, 250, Some(&k3)).await.status,
        StatusCode::OK
    );

    let r = t.get(&format!("/api/accounts/{a}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["balanceCents"], 650);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    let events = r.body["events"].as_array().expect("events");
    assert_eq!(events.len(), 3);
    for e in events {
        assert!(e["timestamp"].as_u64().is_some_and(|ts| ts > 0), "{e}");
    }
    let strip = |e: &Value| {
        let mut e = e.clone();
        e.as_object_mut().unwrap().remove("timestamp");
        e
    };
    assert_eq!(
        strip(&events[0]),
        json!({ "aggregateVersion": 1, "type": "Deposited", "amountCents": 1000, "eventId": k1 })
    );
    assert_eq!(
        strip(&events[1]),
        json!({ "aggregateVersion": 2, "type": "Withdrawn", "amountCents": 100, "eventId": k2 })
    );
    assert_eq!(
        strip(&events[2]),
        json!({
            "aggregateVersion": 3, "type": "TransferredOut", "amountCents": 250,
            "toAccountId": b, "eventId": k3
        })
    );
    let r = t.get(&format!("/api/accounts/{b}/history")).await;
    assert_eq!(r.body["balanceCents"], 250);
    assert_eq!(r.body["currentAggregateVersion"], 1);
    assert_eq!(
        strip(&r.body["events"][0]),
        json!({
            "aggregateVersion": 1, "type": "TransferredIn", "amountCents": 250,
            "fromAccountId": a, "eventId": k3
        })
    );
    t.shutdown().await;
}

#[tokio::test]
async fn history_pages_with_limit_and_next_from_version() {
    let t = spawn_default().await;
    let account = new_account();
    for cents in 1..=5 {
        assert_eq!(
            t.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    let page = |from: u64, limit: u64| {
        let path = format!("/api/accounts/{account}/history?fromVersion={from}&limit={limit}");
        let t = &t;
        async move { t.get(&path).await }
    };
    let versions = |r: &Reply| -> Vec<u64> {
        r.body["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["aggregateVersion"].as_u64().unwrap())
            .collect()
    };
    let r = page(1, 2).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(versions(&r), [1, 2]);
    assert_eq!(r.body["nextFromVersion"], 3);
    assert_eq!(r.body["currentAggregateVersion"], 5);
    assert_eq!(r.body["balanceCents"], 15);
    let r = page(3, 2).await;
    assert_eq!(versions(&r), [3, 4]);
    assert_eq!(r.body["nextFromVersion"], 5);
    let r = page(5, 2).await;
    assert_eq!(versions(&r), [5]);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    // A page that ends exactly at the tip has no next page either.
    let r = page(4, 2).await;
    assert_eq!(versions(&r), [4, 5]);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    // Without fromVersion, paging starts at the beginning; fromVersion=0 reads as 1.
    let r = t
        .get(&format!("/api/accounts/{account}/history?limit=1"))
        .await;
    assert_eq!(versions(&r), [1]);
    assert_eq!(r.body["nextFromVersion"], 2);
    let r = page(0, 1).await;
    assert_eq!(versions(&r), [1]);
    // Past the tip: nothing, and no next page.
    let r = page(6, 10).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(versions(&r), Vec::<u64>::new());
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    assert_eq!(r.body["currentAggregateVersion"], 5);
    // Far past it, too: the version reported is the account's, not the one asked for.
    let r = page(1000, 10).await;
    assert_eq!(r.body["currentAggregateVersion"], 5, "{}", r.text);
    let r = t
        .get(&format!(
            "/api/accounts/{}/history?fromVersion=5",
            new_account()
        ))
        .await;
    assert_eq!(r.body["currentAggregateVersion"], 0, "{}", r.text);
    t.shutdown().await;
}

/// Black-box finding: a hot account's batch holds several events under one version, and a
/// page overran `limit` by the rest of a batch. A page ends on a batch boundary and holds at
/// most `limit` events, unless one batch alone holds more.
#[tokio::test]
async fn a_history_page_ends_on_a_batch_boundary_within_the_limit() {
    let mem = Arc::new(MemoryLog::new());
    let t = spawn(test_config(&[]), Some(mem.clone() as SharedLog), None).await;
    let account = new_account();
    assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    let deposit = tally::account::AccountEvent::Deposited { amount: 2 };
    mem.write_now(
        0xf0e1,
        vec![AggregateWrite {
            key,
            events: (1..=3)
                .map(|seq| Event {
                    client_seq: seq,
                    event_id: None,
                    event_type: deposit.event_type(),
                    payload: deposit.encode(),
                    timestamp_ms: 0,
                })
                .collect(),
            expected_version: Some(1),
            allow_create: false,
            enforce_client_idempotency: false,
        }],
    )
    .expect("a 3-event batch at version 2");
    assert_eq!(t.deposit(&account, 4, None).await.status, StatusCode::OK);

    let page = |from: u64, limit: u64| {
        let path = format!("/api/accounts/{account}/history?fromVersion={from}&limit={limit}");
        let t = &t;
        async move {
            let r = t.get(&path).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            let versions: Vec<u64> = r.body["events"]
                .as_array()
                .expect("events")
                .iter()
                .map(|e| e["aggregateVersion"].as_u64().unwrap())
                .collect();
            (versions, r.body["nextFromVersion"].as_u64())
        }
    };
    assert_eq!(page(1, 2).await, (vec![1], Some(2)));
    assert_eq!(page(1, 4).await, (vec![1, 2, 2, 2], Some(3)));
    assert_eq!(
        page(2, 1).await,
        (vec![2, 2, 2], Some(3)),
        "one batch, whole"
    );
    assert_eq!(page(2, 3).await, (vec![2, 2, 2], Some(3)));
    assert_eq!(page(2, 4).await, (vec![2, 2, 2, 3], None));
    t.shutdown().await;
}

/// Black-box finding: under a lagging read, a page came back empty without `nextFromVersion`
/// although the account had more, and a client following the pages stopped early. Every page
/// now either moves forward or is a retryable 503.
#[tokio::test]
async fn a_history_page_cut_short_by_a_lagging_read_still_points_at_the_rest() {
    let faulty = scripted_faults();
    let t = spawn(test_config(&[]), Some(faulty.clone() as SharedLog), None).await;
    let account = new_account();
    for cents in 1..=3 {
        assert_eq!(
            t.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    // The history's catch-up read is current; its page read hides the newest 2 batches.
    faulty.lag_next_read(0);
    faulty.lag_next_read(2);
    let r = t
        .get(&format!("/api/accounts/{account}/history?fromVersion=3"))
        .await;
    // Nothing read at all: a retryable 503, never an empty page pointing at itself.
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // A read that shows part of what is there: that part, and where the rest starts.
    faulty.lag_next_read(0);
    faulty.lag_next_read(1);
    let r = t
        .get(&format!("/api/accounts/{account}/history?fromVersion=2"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().map(Vec::len), Some(1));
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["nextFromVersion"], 3, "{}", r.text);
    assert_eq!(faulty.counts().read_lag, 4);
    t.shutdown().await;
}

#[tokio::test]
async fn history_page_size_defaults_to_100_and_is_bounded_at_1000() {
    let t = spawn_default().await;
    let account = new_account();
    for _ in 0..101 {
        assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    }
    let r = t.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 100);
    assert_eq!(r.body["nextFromVersion"], 101);
    let r = t
        .get(&format!("/api/accounts/{account}/history?limit=1000"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 101);
    assert!(r.body.get("nextFromVersion").is_none());
    for limit in ["1001", "0"] {
        let r = t
            .get(&format!("/api/accounts/{account}/history?limit={limit}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn transfer_answers_both_legs_and_replays_them() {
    let t = spawn_default().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = "transfer-1";
    let r = t.transfer(&from, &to, 400, Some(key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let expected = json!({
        "from": { "balanceCents": 600, "aggregateVersion": 2 },
        "to": { "balanceCents": 400, "aggregateVersion": 1 },
    });
    assert_eq!(r.body, expected);
    assert!(!r.replayed());
    assert_eq!(r.header("idempotency-key"), Some(key));
    // Later writes on both accounts do not change the replayed answer.
    assert_eq!(t.deposit(&from, 5, None).await.status, StatusCode::OK);
    assert_eq!(t.deposit(&to, 5, None).await.status, StatusCode::OK);
    let again = t.transfer(&from, &to, 400, Some(key)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, expected);
    assert!(again.replayed());
    assert_eq!(again.header("idempotency-window"), Some("90"));
    assert_eq!(t.balance(&from).await, (605, 3));
    assert_eq!(t.balance(&to).await, (405, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn account_scoped_transfer_has_the_same_semantics_as_the_transfers_route() {
    let t = spawn_default().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = Uuid::new_v4().to_string();
    let body = json!({ "toAccountId": to, "amountCents": 300 });
    let r = t
        .post(&account_transfer_path(&from), &body, Some(&key))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let expected = json!({
        "from": { "balanceCents": 700, "aggregateVersion": 2 },
        "to": { "balanceCents": 300, "aggregateVersion": 1 },
    });
    assert_eq!(r.body, expected);
    assert!(!r.replayed());
    assert_eq!(r.header("idempotency-window"), Some("90"));
    // The same intent through the other route is the same request: a replay.
    let r = t.transfer(&from, &to, 300, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body, expected);
    assert!(r.replayed());
    // And the other way round.
    let key2 = Uuid::new_v4().to_string();
    let first = t.transfer(&from, &to, 50, Some(&key2)).await;
    let body2 = json!({ "toAccountId": to, "amountCents": 50 });
    let second = t
        .post(&account_transfer_path(&from), &body2, Some(&key2))
        .await;
    assert_eq!(first.body, second.body);
    assert!(second.replayed());
    assert_eq!(t.balance(&from).await, (650, 3));
    assert_eq!(t.balance(&to).await, (350, 2));
    let before = (observe(&t, &from).await, observe(&t, &to).await);
    let rejected = [
        // The payer comes from the path: naming it in the body is an unknown field.
        (
            json!({ "fromAccountId": from, "toAccountId": to, "amountCents": 1 }),
            "VALIDATION_ERROR",
        ),
        // Insufficient funds and the same-account rule hold on this route too.
        (
            json!({ "toAccountId": to, "amountCents": 651 }),
            "INSUFFICIENT_FUNDS",
        ),
        (
            json!({ "toAccountId": from, "amountCents": 1 }),
            "VALIDATION_ERROR",
        ),
    ];
    for (body, code) in rejected {
        let r = t.post(&account_transfer_path(&from), &body, None).await;
        assert_error(&r, 422, code);
        if code == "INSUFFICIENT_FUNDS" {
            assert_eq!(r.body["balanceCents"], 650);
        }
        assert_eq!(
            (observe(&t, &from).await, observe(&t, &to).await),
            before,
            "{body} changed something"
        );
    }
    t.shutdown().await;
}

#[tokio::test]
async fn healthz_and_readyz_answer_and_readyz_fails_while_shutting_down() {
    let t = spawn_default().await;
    let r = t.get("/healthz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "status": "ok" }));
    let r = t.get("/readyz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, json!({ "status": "ready" }));
    t.app.begin_shutdown();
    let r = t.get("/readyz").await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // Liveness is not readiness: the process is still healthy while it drains.
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    t.shutdown().await;
}

#[tokio::test]
async fn metrics_are_prometheus_text_labelled_by_route_template_never_by_raw_path() {
    let t = spawn_default().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    assert_eq!(
        t.deposit(&account, 10, Some(&key)).await.status,
        StatusCode::OK
    );
    assert!(t.deposit(&account, 10, Some(&key)).await.replayed());
    assert_eq!(t.get("/no/such/route").await.status, StatusCode::NOT_FOUND);
    let r = t.get("/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = &r.text;
    for name in [
        "tally_http_requests_total",
        "tally_http_request_duration_seconds",
        "tally_http_requests_in_flight",
        "tally_idempotency_replays_total",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} in\n{text}"
        );
    }
    let deposits: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("tally_http_requests_total{"))
        .filter(|l| l.contains(r#"route="/api/accounts/{id}/deposit""#))
        .collect();
    assert_eq!(deposits.len(), 1, "{text}");
    assert!(deposits[0].contains(r#"method="POST""#), "{}", deposits[0]);
    assert!(
        deposits[0].contains(r#"status_class="2xx""#),
        "{}",
        deposits[0]
    );
    assert!(deposits[0].ends_with(" 2"), "{}", deposits[0]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("tally_http_requests_total{")
                && l.contains(r#"route="unmatched""#)
                && l.contains(r#"status_class="4xx""#)),
        "{text}"
    );
    assert!(
        common::metric_sum(text, "tally_idempotency_replays_total") >= 1.0,
        "{text}"
    );
    assert!(
        !text.contains(&account),
        "a raw id leaked into a label:\n{text}"
    );
    assert!(
        !text.contains("/no/such/route"),
        "a raw path leaked:\n{text}"
    );
    t.shutdown().await;
}

// --- Statuses ---

#[tokio::test]
async fn malformed_json_is_400_and_changes_nothing() {
    let t = spawn_default().await;
    let account = funded(&t, 500).await;
    let before = observe(&t, &account).await;
    for body in [
        &b"{"[..],
        b"not json",
        b"",
        br#"{"amountCents":1}x"#,
        br#"{"amountCents":1,}"#,
    ] {
        for path in [
            deposit_path(&account),
            withdraw_path(&account),
            "/api/transfers".to_string(),
            account_transfer_path(&account),
        ] {
            let r = post_raw(&t, &path, body, None).await;
            assert_error(&r, 400, "INVALID_JSON");
            assert_eq!(observe(&t, &account).await, before, "{path} {body:?}");
        }
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_malformed_account_id_in_the_path_is_400() {
    let t = spawn_default().await;
    for action in ["balance", "history"] {
        for bad in ["not-a-uuid", "1234", "00000000-0000-0000-0000-00000000000g"] {
            let r = t.get(&format!("/api/accounts/{bad}/{action}")).await;
            assert_error(&r, 400, "INVALID_ID");
        }
    }
    let body = json!({ "amountCents": 1, "toAccountId": new_account() });
    for action in ["deposit", "withdraw", "transfers"] {
        let r = t
            .post(&format!("/api/accounts/not-a-uuid/{action}"), &body, None)
            .await;
        assert_error(&r, 400, "INVALID_ID");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn bad_query_parameters_are_400() {
    let t = spawn_default().await;
    let account = funded(&t, 1).await;
    for query in [
        "minVersion=abc",
        "minVersion=-1",
        "minVersion=",
        "minVersion=1.5",
        "minversion=1",
        "fromVersion=1",
        "bogus=1",
    ] {
        let r = t
            .get(&format!("/api/accounts/{account}/balance?{query}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    for query in [
        "fromVersion=x",
        "fromVersion=-1",
        "limit=abc",
        "limit=0",
        "limit=1001",
        "limit=-5",
        "minVersion=1",
        "cursor=1",
        "limit=1&limit=2",
        "limit=+2",
        "limit=1%2E5",
    ] {
        let r = t
            .get(&format!("/api/accounts/{account}/history?{query}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    // Values and names are percent-decoded like any query string.
    assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    let r = t
        .get(&format!("/api/accounts/{account}/history?%6Cimit=%31"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().map(Vec::len), Some(1));
    assert_eq!(r.body["nextFromVersion"], 2);
    t.shutdown().await;
}

#[tokio::test]
async fn a_body_of_64_kib_is_accepted_and_one_byte_more_is_413() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let before = observe(&t, &account).await;
    let json = br#"{"amountCents":7}"#;
    let padded = |len: usize| {
        let mut b = json.to_vec();
        b.resize(len, b' ');
        b
    };
    let r = post_raw(&t, &withdraw_path(&account), &padded(MAX_BODY + 1), None).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    // Refused on the declared length alone, before any body byte is read.
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        withdraw_path(&account),
        t.addr,
        MAX_BODY + 1
    );
    let r = raw_exchange(t.addr, head, Vec::new()).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    // Exactly the limit is fine.
    let r = post_raw(&t, &withdraw_path(&account), &padded(MAX_BODY), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (93, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn a_chunked_body_over_64_kib_is_413() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let before = observe(&t, &account).await;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        withdraw_path(&account),
        t.addr
    );
    let frame = |data: &[u8]| {
        let mut f = format!("{:x}\r\n", data.len()).into_bytes();
        f.extend_from_slice(data);
        f.extend_from_slice(b"\r\n");
        f
    };
    let mut chunks = vec![frame(br#"{"amountCents":7}"#)];
    // 9 × 8 KiB of padding: past the limit however the chunks are counted.
    chunks.extend((0..9).map(|_| frame(&[b' '; 8192])));
    chunks.push(b"0\r\n\r\n".to_vec());
    let r = raw_exchange(t.addr, head, chunks).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    t.shutdown().await;
}

#[tokio::test]
async fn a_small_chunked_body_is_accepted() {
    let t = spawn_default().await;
    let account = new_account();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        deposit_path(&account),
        t.addr
    );
    let r = raw_exchange(
        t.addr,
        head,
        vec![b"5\r\n{\"amo\r\nd\r\nuntCents\":42}\r\n0\r\n\r\n".to_vec()],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (42, 1));
    t.shutdown().await;
}

#[tokio::test]
async fn unknown_routes_are_404_json() {
    let t = spawn_default().await;
    let account = new_account();
    for path in [
        "/".to_string(),
        "/nope".to_string(),
        "/api".to_string(),
        "/api/accounts/".to_string(),
        "/healthz/".to_string(),
        format!("/api/accounts/{account}"),
        format!("/api/accounts/{account}/statement"),
        format!("/api/accounts/{account}/balance/extra"),
    ] {
        let r = t.get(&path).await;
        assert_error(&r, 404, "NOT_FOUND");
        let r = t.post(&path, &json!({ "amountCents": 1 }), None).await;
        assert_error(&r, 404, "NOT_FOUND");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_wrong_method_is_405_with_allow() {
    let t = spawn_default().await;
    let account = new_account();
    let cases = [
        (Method::GET, deposit_path(&account), "POST"),
        (Method::GET, withdraw_path(&account), "POST"),
        (Method::GET, account_transfer_path(&account), "POST"),
        (Method::GET, "/api/transfers".to_string(), "POST"),
        (Method::PUT, deposit_path(&account), "POST"),
        (Method::DELETE, "/api/transfers".to_string(), "POST"),
        (
            Method::POST,
            format!("/api/accounts/{account}/balance"),
            "GET, HEAD",
        ),
        (
            Method::POST,
            format!("/api/accounts/{account}/history"),
            "GET, HEAD",
        ),
        (Method::POST, "/api/accounts".to_string(), "GET, HEAD"),
        (Method::POST, "/healthz".to_string(), "GET, HEAD"),
        (Method::POST, "/readyz".to_string(), "GET, HEAD"),
        (Method::POST, "/metrics".to_string(), "GET, HEAD"),
        (
            Method::DELETE,
            format!("/api/accounts/{account}/balance"),
            "GET, HEAD",
        ),
        // The method is checked before the id, so a bad id with a wrong method is still 405.
        (
            Method::GET,
            "/api/accounts/not-a-uuid/deposit".to_string(),
            "POST",
        ),
    ];
    for (method, path, allow) in cases {
        let r = send(&t, method.clone(), &path, &[], None).await;
        assert_error(&r, 405, "METHOD_NOT_ALLOWED");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    assert_eq!(t.balance(&account).await, (0, 0));
    // A HEAD answer has no body, so the 405 is its status and `Allow` only.
    let r = send(&t, Method::HEAD, &deposit_path(&account), &[], None).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.header("allow"), Some("POST"));
    // GET routes answer HEAD: the GET's status and headers, no body.
    for path in [
        "/healthz".to_string(),
        format!("/api/accounts/{account}/balance"),
    ] {
        let get = send(&t, Method::GET, &path, &[], None).await;
        let r = send(&t, Method::HEAD, &path, &[], None).await;
        assert_eq!(r.status, StatusCode::OK, "HEAD {path}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("content-length"),
            Some(get.text.len().to_string().as_str()),
            "HEAD {path}: the GET's length"
        );
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_missing_or_wrong_content_type_is_415_and_changes_nothing() {
    let t = spawn_default().await;
    let (account, payee) = (funded(&t, 100).await, new_account());
    let before = (observe(&t, &account).await, observe(&t, &payee).await);
    let withdraw = br#"{"amountCents":5}"#.to_vec();
    let transfer = json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 5 })
        .to_string()
        .into_bytes();
    let requests = [
        (withdraw_path(&account), withdraw.clone()),
        ("/api/transfers".to_string(), transfer),
    ];
    let content_types: [Option<&str>; 6] = [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("application/jsonx"),
        Some("application/problem+json"),
        Some(""),
    ];
    for (path, body) in &requests {
        for ct in content_types {
            let headers: Vec<(&str, &[u8])> = ct
                .map(|ct| ("content-type", ct.as_bytes()))
                .into_iter()
                .collect();
            let r = send(&t, Method::POST, path, &headers, Some(body.clone())).await;
            assert_error(&r, 415, "UNSUPPORTED_MEDIA_TYPE");
            assert_eq!(
                (observe(&t, &account).await, observe(&t, &payee).await),
                before,
                "{path} with {ct:?} changed something"
            );
        }
    }
    // Parameters and case do not matter.
    for ct in ["application/json; charset=utf-8", "Application/JSON"] {
        let r = send(
            &t,
            Method::POST,
            &withdraw_path(&account),
            &[("content-type", ct.as_bytes())],
            Some(withdraw.clone()),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{ct}: {}", r.text);
    }
    assert_eq!(t.balance(&account).await, (90, 3));
    t.shutdown().await;
}

#[tokio::test]
async fn invalid_amounts_and_body_shapes_are_422_validation_errors_and_change_nothing() {
    let t = spawn_default().await;
    let (account, other) = (funded(&t, 1_000).await, funded(&t, 1_000).await);
    let before = (observe(&t, &account).await, observe(&t, &other).await);
    // Every case is (path, raw body).
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    let mut case = |path: String, body: Value| cases.push((path, body.to_string().into_bytes()));
    for amount in [
        json!(0),
        json!(-1),
        json!(-2_147_483_647),
        json!(2_147_483_648_i64),
        json!(i64::MAX),
        json!(1.5),
        json!(100.0),
        json!("100"),
        json!(null),
        json!(true),
        json!([1]),
        json!({ "cents": 1 }),
    ] {
        case(deposit_path(&account), json!({ "amountCents": amount }));
        case(withdraw_path(&account), json!({ "amountCents": amount }));
        case(
            "/api/transfers".into(),
            json!({ "fromAccountId": account, "toAccountId": other, "amountCents": amount }),
        );
        case(
            account_transfer_path(&account),
            json!({ "toAccountId": other, "amountCents": amount }),
        );
    }
    // Unknown fields.
    case(
        deposit_path(&account),
        json!({ "amountCents": 1, "memo": "x" }),
    );
    case(withdraw_path(&account), json!({ "amount": 1 }));
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": other, "amountCents": 1, "x": 0 }),
    );
    // Missing fields.
    case(deposit_path(&account), json!({}));
    case(
        "/api/transfers".into(),
        json!({ "toAccountId": other, "amountCents": 1 }),
    );
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "amountCents": 1 }),
    );
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": other }),
    );
    case(account_transfer_path(&account), json!({ "amountCents": 1 }));
    // Not an account id.
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": "nope", "amountCents": 1 }),
    );
    case(
        account_transfer_path(&account),
        json!({ "toAccountId": 7, "amountCents": 1 }),
    );
    // Not an object: a scalar, or a positional array even when its items line up with the
    // fields.
    case(deposit_path(&account), json!(5));
    case(deposit_path(&account), json!("amountCents"));
    case(deposit_path(&account), json!([5]));
    case(withdraw_path(&account), json!([5]));
    case("/api/transfers".into(), json!([account, other, 5]));
    case(account_transfer_path(&account), json!([other, 5]));
    case(withdraw_path(&account), json!([{ "amountCents": 1 }]));
    // Spellings `json!` cannot produce.
    let raw: [(String, &[u8]); 3] = [
        // Too large even for 64 bits.
        (
            deposit_path(&account),
            br#"{"amountCents":99999999999999999999}"#,
        ),
        (deposit_path(&account), br#"{"amountCents":1e2}"#),
        (
            deposit_path(&account),
            br#"{"amountCents":1,"amountCents":2}"#,
        ),
    ];
    cases.extend(raw.into_iter().map(|(p, b)| (p, b.to_vec())));
    for (path, body) in cases {
        let r = post_raw(&t, &path, &body, None).await;
        let shown = String::from_utf8_lossy(&body);
        assert_eq!(r.status.as_u16(), 422, "{path} {shown}: {}", r.text);
        assert_error(&r, 422, "VALIDATION_ERROR");
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &other).await),
            before,
            "{path} {shown} changed something"
        );
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_transfer_to_the_same_account_is_422_and_changes_nothing() {
    let t = spawn_default().await;
    let account = funded(&t, 1_000).await;
    let before = observe(&t, &account).await;
    // Also with an amount the account cannot cover (the shape is checked before the funds),
    // and with the same id in another spelling.
    let upper = account.to_uppercase();
    for (to, cents) in [(&account, 10), (&account, 5_000), (&upper, 10)] {
        let r = t.transfer(&account, to, cents, None).await;
        assert_error(&r, 422, "VALIDATION_ERROR");
        assert_eq!(observe(&t, &account).await, before);
    }
    t.shutdown().await;
}

#[tokio::test]
async fn overdrawing_is_422_insufficient_funds_with_the_balance_and_changes_nothing() {
    let t = spawn_default().await;
    // `empty` has no events, so it has nothing to give.
    let (account, payee, empty) = (funded(&t, 1_000).await, new_account(), new_account());
    let before = (observe(&t, &account).await, (0, 0, vec![]));
    let cases = [
        (
            withdraw_path(&account),
            json!({ "amountCents": 1_001 }),
            1_000,
        ),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 1_001 }),
            1_000,
        ),
        (
            account_transfer_path(&account),
            json!({ "toAccountId": payee, "amountCents": 2_147_483_647 }),
            1_000,
        ),
        (withdraw_path(&empty), json!({ "amountCents": 1 }), 0),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": empty, "toAccountId": account, "amountCents": 1 }),
            0,
        ),
    ];
    for (path, body, balance) in cases {
        let r = t.post(&path, &body, None).await;
        assert_error(&r, 422, "INSUFFICIENT_FUNDS");
        assert_eq!(r.body["balanceCents"], balance, "{path} {body}");
        assert_eq!(r.header("idempotency-window"), Some("90"));
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &payee).await),
            before,
            "{path} {body} changed something"
        );
        assert_eq!(observe(&t, &empty).await, (0, 0, vec![]));
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_write_that_cannot_complete_is_a_retryable_409_and_writes_nothing() {
    // Every store write is refused: the loop gives up after its attempts.
    let t = spawn(
        test_config(&["--faults", "seed=1", "--write-max-attempts", "3"]),
        None,
        None,
    )
    .await;
    for _ in 0..3 {
        faults(&t).fail_next_write(Fault::Refused);
    }
    let account = new_account();
    let r = t.deposit(&account, 100, Some("refused-1")).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("idempotency-key"), Some("refused-1"));
    assert_eq!(r.header("idempotency-window"), Some("90"));
    assert!(!r.replayed());
    let r = t.transfer(&account, &new_account(), 1, None).await;
    // Nothing to move: the rule refuses before any write is tried.
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(observe(&t, &account).await, (0, 0, vec![]));
    assert_eq!(faults(&t).counts().refused, 3);
    t.shutdown().await;
}

#[tokio::test]
async fn a_409_after_a_refused_write_is_retried_with_the_same_key_and_writes_once() {
    let t = spawn(
        test_config(&["--faults", "seed=1", "--write-max-attempts", "1"]),
        None,
        None,
    )
    .await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    faults(&t).fail_next_write(Fault::Refused);
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(observe(&t, &account).await, (0, 0, vec![]));
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        !r.replayed(),
        "nothing had landed, so this is the first answer"
    );
    assert_eq!(leg(&r.body), (100, 1));
    assert_eq!(t.history(&account).await.len(), 1);
    t.shutdown().await;
}

/// An instance whose store injects only scripted faults, and whose writes get one attempt
/// each, starting with a catch-up read: a scripted fault ends the request, and its retry
/// reads the stream before it writes.
async fn spawn_one_attempt_with_scripted_faults() -> TestApp {
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

#[tokio::test]
async fn a_409_after_a_lost_ack_is_answered_by_the_retry_as_a_replay_without_a_second_write() {
    // One attempt per request, each starting with a catch-up read, so the first request
    // gives up right after the lost ack and the retry reads the stream before writing.
    let t = spawn_one_attempt_with_scripted_faults().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    // The write lands, but its answer is lost: the loop cannot know and gives up.
    faults(&t).fail_next_write(Fault::LostAck);
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.replayed());
    assert_eq!(leg(&r.body), (100, 1));
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], key);
    t.shutdown().await;
}

#[tokio::test]
async fn requests_over_the_concurrency_limit_are_shed_with_a_retryable_503() {
    let t = spawn(
        test_config(&["--max-concurrent-requests", "1", "--faults", "seed=1"]),
        None,
        None,
    )
    .await;
    let account = funded(&t, 1_000).await;
    // Hold one write inside the store: its request keeps the only slot.
    let mut hold = faults(&t).hold_next_write();
    let held = {
        let (client, url) = (t.client.clone(), t.url(&deposit_path(&account)));
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .json(&json!({ "amountCents": 1 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    assert!(hold.held().await);
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = t.get(&format!("/api/accounts/{account}/balance")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // Probes and scrapes are never shed.
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    let m = t.get("/metrics").await;
    assert_eq!(
        common::metric_sum(&m.text, "tally_http_requests_shed_total"),
        2.0
    );
    hold.release();
    let first = held.await.expect("held request");
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(leg(&first.body), (1_001, 2));
    // The shed write did nothing: retrying its key is a first write.
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed());
    assert_eq!(leg(&r.body), (1_003, 3));
    t.shutdown().await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_write_is_not_counted_in_flight_forever_and_its_write_still_lands()
 {
    let t = spawn(test_config(&["--faults", "seed=1"]), None, None).await;
    let app = t.app.clone();
    let account = new_account();
    let mut hold = faults(&t).hold_next_write();
    let request = {
        let (client, url) = (t.client.clone(), t.url(&deposit_path(&account)));
        tokio::spawn(async move {
            client
                .post(url)
                .header("idempotency-key", "disconnect-1")
                .json(&json!({ "amountCents": 100 }))
                .send()
                .await
        })
    };
    assert!(hold.held().await);
    assert_eq!(app.metrics.http_in_flight.get(), 1);
    // The client gives up while its write is held in the store, and closes the connection.
    request.abort();
    assert!(request.await.is_err_and(|e| e.is_cancelled()));
    // Graceful shutdown returns once every connection is gone: the server has dropped the
    // abandoned request by then, while its write is still held.
    t.shutdown().await;
    assert_eq!(
        app.metrics.http_in_flight.get(),
        0,
        "an abandoned request is still counted in flight"
    );
    // The write was detached from the connection: it lands, and a retry of its key (served
    // by the same app on a new listener) is answered from it.
    hold.release();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(tally::http::serve(
        app.clone(),
        listener,
        std::future::pending(),
    ));
    let r = common::read(
        reqwest::Client::new()
            .post(format!("http://{addr}{}", deposit_path(&account)))
            .header("idempotency-key", "disconnect-1")
            .json(&json!({ "amountCents": 100 }))
            .send()
            .await
            .expect("sent"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        r.replayed(),
        "the abandoned write was cancelled, not detached"
    );
    assert_eq!(leg(&r.body), (100, 1));
    server.abort();
}

#[tokio::test]
async fn a_poisoned_stream_is_500_with_an_error_id_and_nothing_is_written_to_it() {
    let mem = Arc::new(MemoryLog::new());
    let t = spawn(test_config(&[]), Some(mem.clone() as SharedLog), None).await;
    let account = new_account();
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    // An event no Tally version can decode, straight into the shared store.
    mem.write_now(
        0xbad,
        vec![AggregateWrite {
            key,
            events: vec![Event {
                client_seq: 1,
                event_id: None,
                event_type: EventType {
                    major: 99,
                    minor: 0,
                },
                payload: Bytes::from_static(b"{}"),
                timestamp_ms: 0,
            }],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: false,
        }],
    )
    .expect("poison written");
    let mut ids = Vec::new();
    for path in [
        format!("/api/accounts/{account}/balance"),
        format!("/api/accounts/{account}/balance"),
        format!("/api/accounts/{account}/history"),
    ] {
        let r = t.get(&path).await;
        assert_error(&r, 500, "ACCOUNT_UNREADABLE");
        let id = r.body["errorId"].as_str().expect("errorId");
        ids.push(Uuid::parse_str(id).expect("errorId is a UUID"));
    }
    ids.dedup();
    assert_eq!(ids.len(), 3, "each failure has its own error id");
    let r = t.deposit(&account, 100, None).await;
    assert_error(&r, 500, "ACCOUNT_UNREADABLE");
    assert!(r.body["errorId"].is_string(), "{}", r.text);
    let payer = funded(&t, 10).await;
    let r = t.transfer(&payer, &account, 5, None).await;
    assert_error(&r, 500, "ACCOUNT_UNREADABLE");
    assert_eq!(
        mem.batch_count(key),
        1,
        "nothing was appended to the poisoned stream"
    );
    // Other accounts are unaffected, the payer of the refused transfer included.
    assert_eq!(t.balance(&payer).await, (10, 1));
    assert_eq!(t.deposit(&payer, 1, None).await.status, StatusCode::OK);
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    t.shutdown().await;
}

// --- Idempotency-Key ---

#[tokio::test]
async fn a_replay_returns_the_original_status_and_body_marked_replayed() {
    let t = spawn_default().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    let first = t.deposit(&account, 500, Some(&key)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("idempotency-key"), Some(key.as_str()));
    // Another write moves the account on; the replay still answers what the first one did.
    assert_eq!(t.deposit(&account, 50, None).await.status, StatusCode::OK);
    for _ in 0..2 {
        let again = t.deposit(&account, 500, Some(&key)).await;
        assert_eq!(again.status, first.status);
        assert_eq!(again.text, first.text);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("idempotency-key"), Some(key.as_str()));
        assert_eq!(again.header("idempotency-window"), Some("90"));
    }
    assert_eq!(observe(&t, &account).await.0, 550);
    assert_eq!(t.history(&account).await.len(), 2);
    // Withdrawals replay the same way.
    let wkey = "withdraw-once";
    let w = t.withdraw(&account, 20, Some(wkey)).await;
    let w2 = t.withdraw(&account, 20, Some(wkey)).await;
    assert_eq!((w.status, &w.body), (w2.status, &w2.body));
    assert!(!w.replayed() && w2.replayed());
    assert_eq!(t.balance(&account).await, (530, 3));
    t.shutdown().await;
}

#[tokio::test]
async fn uuid_and_opaque_keys_dedup_and_a_quoted_key_is_the_same_key() {
    let t = spawn_default().await;
    let account = new_account();
    let uuid_key = Uuid::new_v4().to_string();
    let a = t.deposit(&account, 10, Some(&uuid_key)).await;
    let b = t.deposit(&account, 10, Some(&uuid_key)).await;
    assert!(!a.replayed() && b.replayed());
    assert_eq!(a.body, b.body);

    let opaque = "order-42/attempt:a".to_string();
    let c = t.deposit(&account, 20, Some(&opaque)).await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.text);
    assert!(!c.replayed());
    assert_eq!(c.header("idempotency-key"), Some(opaque.as_str()));
    let quoted = format!("\"{opaque}\"");
    let d = t.deposit(&account, 20, Some(&quoted)).await;
    assert_eq!(d.status, StatusCode::OK, "{}", d.text);
    assert!(d.replayed(), "the quoted form names the same key");
    assert_eq!(c.body, d.body);
    let e = t.deposit(&account, 20, Some(&opaque)).await;
    assert!(e.replayed());

    // A quoted key may hold spaces and escapes; its bare spelling cannot, but the escaped
    // form of the same characters is the same key.
    let spaced = t.deposit(&account, 30, Some(r#""a \"b\" c""#)).await;
    assert_eq!(spaced.status, StatusCode::OK, "{}", spaced.text);
    let spaced2 = t.deposit(&account, 30, Some(r#""a \"b\" c""#)).await;
    assert!(!spaced.replayed() && spaced2.replayed());
    // The key comes back as it was sent, so resending the echoed header is the same key.
    let echoed = spaced.header("idempotency-key").expect("echoed").to_owned();
    assert_eq!(echoed, r#""a \"b\" c""#);
    assert!(t.deposit(&account, 30, Some(&echoed)).await.replayed());

    // Different keys are different requests.
    let f = t.deposit(&account, 20, Some("order-43")).await;
    assert!(!f.replayed());
    assert_eq!(t.history(&account).await.len(), 4);
    assert_eq!(t.balance(&account).await, (80, 4));
    t.shutdown().await;
}

#[tokio::test]
async fn keys_too_long_or_with_invalid_characters_are_400_and_write_nothing() {
    let t = spawn_default().await;
    let (account, payee) = (funded(&t, 100).await, new_account());
    let before = (observe(&t, &account).await, observe(&t, &payee).await);
    let too_long = "k".repeat(256);
    let quoted_too_long = format!("\"{too_long}\"");
    let bad: Vec<&[u8]> = vec![
        too_long.as_bytes(),
        quoted_too_long.as_bytes(),
        b"",
        b"\"\"",
        b"has space",
        b"tab\there",
        b"caf\xc3\xa9",
        b"\xff",
        b"\"unterminated",
        b"\"bad \\x escape\"",
        b"\"inner \" quote\"",
    ];
    for key in bad {
        for path in [deposit_path(&account), withdraw_path(&account)] {
            let r = send(
                &t,
                Method::POST,
                &path,
                &[
                    ("content-type", b"application/json"),
                    ("idempotency-key", key),
                ],
                Some(br#"{"amountCents":1}"#.to_vec()),
            )
            .await;
            assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
            assert_eq!(
                r.header("idempotency-key"),
                None,
                "a bad key is never replaced"
            );
        }
        let r = send(
            &t,
            Method::POST,
            "/api/transfers",
            &[
                ("content-type", b"application/json"),
                ("idempotency-key", key),
            ],
            Some(
                json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 1 })
                    .to_string()
                    .into_bytes(),
            ),
        )
        .await;
        assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &payee).await),
            before,
            "key {:?} changed something",
            String::from_utf8_lossy(key)
        );
    }
    // Two keys on one request are refused, not picked from.
    let r = send(
        &t,
        Method::POST,
        &deposit_path(&account),
        &[
            ("content-type", b"application/json"),
            ("idempotency-key", b"one"),
            ("idempotency-key", b"two"),
        ],
        Some(br#"{"amountCents":1}"#.to_vec()),
    )
    .await;
    assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
    assert_eq!(
        (observe(&t, &account).await, observe(&t, &payee).await),
        before
    );
    // 255 characters is the longest key accepted.
    let longest = "k".repeat(255);
    let r = t.deposit(&account, 1, Some(&longest)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(t.deposit(&account, 1, Some(&longest)).await.replayed());
    t.shutdown().await;
}

#[tokio::test]
async fn without_a_key_the_server_mints_one_and_a_retry_with_it_replays() {
    let t = spawn_default().await;
    let account = new_account();
    let first = t.deposit(&account, 300, None).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert!(!first.replayed());
    let minted = first
        .header("idempotency-key")
        .expect("a minted key is returned")
        .to_owned();
    let minted_id = Uuid::parse_str(&minted).expect("the minted key is a UUID");
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], minted_id.to_string());
    let again = t.deposit(&account, 300, Some(&minted)).await;
    assert_eq!(again.status, StatusCode::OK);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // Each keyless request gets its own key, so two keyless requests are two writes.
    let second = t.deposit(&account, 300, None).await;
    assert!(!second.replayed());
    assert_ne!(second.header("idempotency-key"), Some(minted.as_str()));
    assert_eq!(t.balance(&account).await, (600, 2));
    // Transfers too.
    let payee = new_account();
    let tr = t.transfer(&account, &payee, 100, None).await;
    assert_eq!(tr.status, StatusCode::OK, "{}", tr.text);
    let tkey = tr.header("idempotency-key").expect("minted").to_owned();
    let tr2 = t.transfer(&account, &payee, 100, Some(&tkey)).await;
    assert!(tr2.replayed(), "{}", tr2.text);
    assert_eq!(tr2.body, tr.body);
    assert_eq!(t.balance(&payee).await, (100, 1));
    t.shutdown().await;
}

#[tokio::test]
async fn reusing_a_key_for_a_different_amount_or_operation_is_422_and_writes_nothing() {
    let t = spawn_default().await;
    let (account, other) = (new_account(), new_account());
    let key = Uuid::new_v4().to_string();
    let first = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let before = (observe(&t, &account).await, observe(&t, &other).await);
    let attempts = [
        (deposit_path(&account), json!({ "amountCents": 101 })),
        (withdraw_path(&account), json!({ "amountCents": 100 })),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": account, "toAccountId": other, "amountCents": 100 }),
        ),
        (
            account_transfer_path(&account),
            json!({ "toAccountId": other, "amountCents": 100 }),
        ),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": other, "toAccountId": account, "amountCents": 100 }),
        ),
    ];
    for (path, body) in attempts {
        let r = t.post(&path, &body, Some(&key)).await;
        assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
        assert!(!r.replayed());
        assert_eq!(r.header("idempotency-window"), Some("90"));
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &other).await),
            before,
            "{path} {body} changed something"
        );
    }
    // The original request still replays.
    let again = t.deposit(&account, 100, Some(&key)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // A transfer's key is bound to the transfer on both accounts.
    let tkey = "transfer-bound";
    let funded_from = funded(&t, 500).await;
    assert_eq!(
        t.transfer(&funded_from, &other, 50, Some(tkey))
            .await
            .status,
        StatusCode::OK
    );
    let r = t.transfer(&funded_from, &other, 51, Some(tkey)).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    let r = t.deposit(&other, 50, Some(tkey)).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(t.balance(&other).await, (50, 1));
    assert_eq!(t.balance(&funded_from).await, (450, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn a_409_without_a_key_returns_the_minted_key_and_a_retry_with_it_replays_the_transfer() {
    let t = spawn_one_attempt_with_scripted_faults().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    faults(&t).fail_next_write(Fault::LostAck);
    let r = t.transfer(&from, &to, 300, None).await;
    assert_error(&r, 409, "CONFLICT");
    let minted = r
        .header("idempotency-key")
        .expect("a 409 carries the minted key, so the caller can retry safely")
        .to_owned();
    let again = t.transfer(&from, &to, 300, Some(&minted)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(again.replayed());
    assert_eq!(
        again.body,
        json!({
            "from": { "balanceCents": 700, "aggregateVersion": 2 },
            "to": { "balanceCents": 300, "aggregateVersion": 1 },
        })
    );
    assert_eq!(t.history(&from).await.len(), 2);
    assert_eq!(t.history(&to).await.len(), 1);
    t.shutdown().await;
}

#[tokio::test]
async fn a_retry_on_another_replica_is_a_replay_of_the_original() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let fleet = spawn_fleet(2, store, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let (account, payee) = (new_account(), new_account());
    let first = a.deposit(&account, 500, Some("fleet-1")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let again = b.deposit(&account, 500, Some("fleet-1")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
    let tr = a.transfer(&account, &payee, 200, Some("fleet-2")).await;
    let tr2 = b.transfer(&account, &payee, 200, Some("fleet-2")).await;
    assert_eq!(tr2.body, tr.body);
    assert!(tr2.replayed());
    // The key stays bound to its operation on the other replica too.
    let r = b.deposit(&account, 501, Some("fleet-1")).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(b.balance(&account).await, (300, 2));
    assert_eq!(a.history(&payee).await.len(), 1);
    for t in fleet {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn a_retry_on_a_replica_that_folded_the_account_earlier_is_marked_replayed() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let fleet = spawn_fleet(2, store, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let account = new_account();
    // b folds the account (warm at version 0), then a serves the original request.
    assert_eq!(b.balance(&account).await, (0, 0));
    let first = a.deposit(&account, 500, Some("fleet-warm")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let again = b.deposit(&account, 500, Some("fleet-warm")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, first.body);
    assert_eq!(
        b.history(&account).await.len(),
        1,
        "one write, as it should be"
    );
    assert!(
        again.replayed(),
        "the retry's answer is the original write's, but is not marked replayed"
    );
    for t in fleet {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn a_replay_is_honoured_for_the_stated_window_measured_in_server_time() {
    let server_clock = Arc::new(ServerClock::new(1_000_000));
    let store: SharedLog = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: server_clock.clone(),
        ..MemoryOptions::default()
    }));
    let (clock_a, clock_b) = (Arc::new(ManualClock::new(0)), Arc::new(ManualClock::new(0)));
    let a = spawn(test_config(&[]), Some(store.clone()), Some(clock_a.clone())).await;
    let b = spawn(test_config(&[]), Some(store.clone()), Some(clock_b.clone())).await;
    let (account, other, late) = (new_account(), new_account(), new_account());
    let first = a.deposit(&account, 100, Some("window-1")).await;
    let first_other = a.deposit(&other, 100, Some("window-2")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);

    // On the replica that wrote: the whole window, from its own clock.
    clock_a.advance_ms(89_999);
    let r = a.deposit(&account, 100, Some("window-1")).await;
    assert!(r.replayed(), "{}", r.text);
    assert_eq!(r.body, first.body);
    clock_a.advance_ms(1);
    let r = a.deposit(&account, 100, Some("window-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        !r.replayed(),
        "past the window the key is forgotten: a new write"
    );
    assert_eq!(leg(&r.body), (200, 2));

    // On a replica that only reads the write back, the age comes from server time: 89 s
    // after it was written, one second of the window is left.
    server_clock.advance(89_000);
    assert_eq!(a.deposit(&late, 1, None).await.status, StatusCode::OK);
    assert_eq!(b.balance(&late).await, (1, 1));
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert!(r.replayed(), "{}", r.text);
    assert_eq!(r.body, first_other.body);
    clock_b.advance_ms(999);
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert!(r.replayed(), "{}", r.text);
    clock_b.advance_ms(1);
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed());
    assert_eq!(leg(&r.body), (200, 2));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn history_of_a_trimmed_stream_starts_at_the_first_available_version() {
    let mem = Arc::new(MemoryLog::new());
    let store: SharedLog = mem.clone();
    let a = spawn(test_config(&[]), Some(store.clone()), None).await;
    let account = new_account();
    for cents in [1, 2, 3] {
        assert_eq!(
            a.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    let key = a.app.identity.key(AccountId(account.parse().unwrap()));
    mem.trim_start_now(key, 3).expect("trimmed");
    // A replica that folded the stream before the trim still knows the balance.
    let r = a.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["firstAvailableVersion"], 3);
    assert_eq!(r.body["balanceCents"], 6);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 1);
    assert_eq!(r.body["events"][0]["aggregateVersion"], 3);
    // A fresh replica can list what is left, but cannot derive a balance.
    let b = spawn(test_config(&[]), Some(store.clone()), None).await;
    let r = b.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["firstAvailableVersion"], 3);
    assert_eq!(r.body["balanceCents"], Value::Null);
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["events"][0]["amountCents"], 3);
    let r = b.get(&format!("/api/accounts/{account}/balance")).await;
    assert_error(&r, 500, "ACCOUNT_TRIMMED");
    assert!(r.body["errorId"].is_string(), "{}", r.text);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_are_answered_once_and_replayed_to_the_rest() {
    const N: usize = 16;
    let t = Arc::new(spawn(test_config(&["--faults", "seed=1"]), None, None).await);
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    // Hold the first store write so the duplicates arrive while it is in flight (any that
    // arrive after it are answered from the index instead: the outcome is the same).
    let mut hold = faults(&t).hold_next_write();
    let mut set = JoinSet::new();
    let fire = |set: &mut JoinSet<Reply>| {
        let (t, account, key) = (t.clone(), account.clone(), key.clone());
        set.spawn(async move { t.deposit(&account, 700, Some(&key)).await });
    };
    fire(&mut set);
    assert!(hold.held().await);
    for _ in 1..N {
        fire(&mut set);
    }
    hold.release();
    let replies = set.join_all().await;
    assert_eq!(replies.len(), N);
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.text, replies[0].text);
        assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
    }
    assert_eq!(leg(&replies[0].body), (700, 1));
    let replayed = replies.iter().filter(|r| r.replayed()).count();
    assert_eq!(replayed, N - 1, "exactly one answer is the original");
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], key);
    assert_eq!(t.balance(&account).await, (700, 1));
    // Every duplicate was either coalesced onto the in-flight write or answered from the
    // index: never written.
    let m = t.get("/metrics").await;
    let coalesced = common::metric_sum(&m.text, "tally_idempotency_coalesced_total");
    let replays = common::metric_sum(&m.text, "tally_idempotency_replays_total");
    assert_eq!(coalesced + replays, (N - 1) as f64, "{}", m.text);
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every request task has finished")
    };
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfer_duplicates_write_one_transfer() {
    const N: usize = 8;
    let t = Arc::new(spawn_default().await);
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = Uuid::new_v4().to_string();
    let mut set = JoinSet::new();
    for _ in 0..N {
        let (t, from, to, key) = (t.clone(), from.clone(), to.clone(), key.clone());
        set.spawn(async move { t.transfer(&from, &to, 100, Some(&key)).await });
    }
    let replies = set.join_all().await;
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.body, replies[0].body);
    }
    assert_eq!(replies.iter().filter(|r| r.replayed()).count(), N - 1);
    assert_eq!(t.balance(&from).await, (900, 2));
    assert_eq!(t.balance(&to).await, (100, 1));
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every request task has finished")
    };
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_request_reusing_an_in_flight_key_with_another_amount_is_refused() {
    let t = spawn(test_config(&["--faults", "seed=1"]), None, None).await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    let mut hold = faults(&t).hold_next_write();
    let first = {
        let (client, url, key) = (
            t.client.clone(),
            t.url(&deposit_path(&account)),
            key.clone(),
        );
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .header("idempotency-key", key)
                    .json(&json!({ "amountCents": 100 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    assert!(hold.held().await);
    let second = {
        let (client, url, key) = (
            t.client.clone(),
            t.url(&deposit_path(&account)),
            key.clone(),
        );
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .header("idempotency-key", key)
                    .json(&json!({ "amountCents": 999 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    hold.release();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert!(!first.replayed());
    assert_error(&second, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(observe(&t, &account).await.0, 100);
    assert_eq!(t.history(&account).await.len(), 1);
    t.shutdown().await;
}

#[tokio::test]
async fn every_write_response_states_the_idempotency_window() {
    let t = spawn_default().await;
    let (a, b) = (funded(&t, 1_000).await, new_account());
    let replies = [
        t.deposit(&a, 1, None).await,
        t.withdraw(&a, 1, None).await,
        t.transfer(&a, &b, 1, Some("window-t")).await,
        t.transfer(&a, &b, 1, Some("window-t")).await,
        t.post(
            &account_transfer_path(&a),
            &json!({ "toAccountId": b, "amountCents": 1 }),
            None,
        )
        .await,
    ];
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.header("idempotency-window"), Some("90"), "{r:?}");
    }
    // Reads are not writes.
    let r = t.get(&format!("/api/accounts/{a}/balance")).await;
    assert_eq!(r.header("idempotency-window"), None);
    t.shutdown().await;

    let t = spawn(test_config(&["--idempotency-window", "30"]), None, None).await;
    let a = new_account();
    let r = t.deposit(&a, 5, Some("w30")).await;
    assert_eq!(r.header("idempotency-window"), Some("30"));
    let r = t.deposit(&a, 5, Some("w30")).await;
    assert!(r.replayed());
    assert_eq!(r.header("idempotency-window"), Some("30"));
    let r = t.withdraw(&a, 50, None).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(r.header("idempotency-window"), Some("30"));
    t.shutdown().await;
}

// --- The binary ---

/// Every flag the binary takes, each settable from the environment.
const FLAGS: [&str; 28] = [
    "listen",
    "store",
    "idempotency-window",
    "client-id",
    "org-id",
    "account-type-id",
    "seed-demo-accounts",
    "faults",
    "max-concurrent-requests",
    "write-deadline-ms",
    "write-max-attempts",
    "one-round-trip",
    "batching",
    "max-batch-events",
    "max-resident-accounts",
    "idle-timeout-secs",
    "shutdown-grace-secs",
    "log-format",
    "celeriant-address",
    "celeriant-seeds",
    "celeriant-request-timeout-ms",
    "celeriant-connect-timeout-ms",
    "celeriant-pool-size",
    "celeriant-tls-ca",
    "celeriant-tls-cert",
    "celeriant-tls-key",
    "celeriant-tls-server-name",
    "celeriant-api-key",
];

/// How long the binary may take to start or stop before a test fails.
const PROCESS_BOUND: Duration = Duration::from_secs(30);

/// The `tally` binary as a child process, with a clean environment for its settings.
fn tally_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tally"));
    for (name, _) in std::env::vars() {
        if name.starts_with("TALLY_") || name == "RUST_LOG" {
            cmd.env_remove(name);
        }
    }
    cmd.args(args).envs(env.iter().copied());
    cmd
}

/// A running `tally` with its JSON log lines streamed to the test; killed if the test fails.
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<Value>,
    addr: SocketAddr,
}

impl Server {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = tally_command(args, env)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("tally starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            lines,
            log: Vec::new(),
            addr: "0.0.0.0:0".parse().unwrap(),
        };
        let listening = server.wait_for("tally listening");
        server.addr = listening["fields"]["addr"]
            .as_str()
            .expect("the listening line names the address")
            .parse()
            .expect("a socket address");
        server
    }

    /// Waits (bounded) for the log line with this message; returns it.
    fn wait_for(&mut self, message: &str) -> Value {
        let deadline = Instant::now() + PROCESS_BOUND;
        loop {
            if let Some(v) = self.log.iter().find(|v| v["fields"]["message"] == message) {
                return v.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let v = serde_json::from_str(&line)
                        .unwrap_or_else(|_| panic!("a JSON log line: {line}"));
                    self.log.push(v);
                }
                Err(e) => panic!("no {message:?} log line ({e}); log so far: {:#?}", self.log),
            }
        }
    }

    /// The position of the first log line with this message.
    fn position(&self, message: &str) -> Option<usize> {
        self.log
            .iter()
            .position(|v| v["fields"]["message"] == message)
    }

    fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Reads the log to its end (the process closed stdout), then reaps the process.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PROCESS_BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Ok(v) = serde_json::from_str(&line) {
                        self.log.push(v);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("tally did not exit"),
            }
        }
        self.child.wait().expect("reaped")
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only matters when a test failed half-way: this is our own child.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn binary_help_lists_every_flag_with_its_env_name() {
    let out = tally_command(&["--help"], &[])
        .output()
        .expect("tally runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    // One block per option, from its `--flag` line to the next option.
    let mut blocks: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        let flag = trimmed
            .strip_prefix("--")
            .or_else(|| trimmed.strip_prefix("-h, --"))
            .or_else(|| trimmed.strip_prefix("-V, --"));
        match flag {
            Some(rest) if line.starts_with("  ") && !line.starts_with("          ") => {
                let name = rest.split([' ', '<']).next().unwrap_or("").to_owned();
                blocks.push((name, String::new()));
            }
            _ => {
                if let Some((_, body)) = blocks.last_mut() {
                    body.push_str(line);
                    body.push('\n');
                }
            }
        }
    }
    let names: Vec<&str> = blocks.iter().map(|(n, _)| n.as_str()).collect();
    for flag in FLAGS {
        assert!(
            names.contains(&flag),
            "--{flag} missing from --help:\n{help}"
        );
    }
    for (name, body) in &blocks {
        if name == "help" || name == "version" {
            continue;
        }
        assert!(
            FLAGS.contains(&name.as_str()),
            "--{name} is new: add it to FLAGS"
        );
        // The connection to Celeriant uses the names Celeriant's own tools use.
        let env = match name.as_str() {
            "celeriant-address" | "celeriant-seeds" | "celeriant-api-key" => {
                name.replace('-', "_").to_uppercase()
            }
            _ => format!("TALLY_{}", name.replace('-', "_").to_uppercase()),
        };
        assert!(
            body.contains(&format!("[env: {env}=")) || body.contains(&format!("[env: {env}]")),
            "--{name} does not name {env}:\n{body}"
        );
    }
    assert_eq!(blocks.len(), FLAGS.len() + 2, "{names:?}");
}

#[cfg(unix)]
#[tokio::test]
async fn binary_starts_like_make_run_serves_the_demo_accounts_and_stops_on_sigterm() {
    // `make run` is the binary with every default; only the port (0) and the log format
    // (to read the bound address) differ, both set through the environment.
    let mut server = Server::start(
        &[],
        &[
            ("TALLY_LISTEN", "127.0.0.1:0"),
            ("TALLY_LOG_FORMAT", "json"),
        ],
    );
    let listening = server.wait_for("tally listening");
    assert_eq!(listening["fields"]["window_secs"], 90);
    assert_eq!(listening["fields"]["store"], "Memory");
    let client = reqwest::Client::new();
    let r = common::read(client.get(server.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = common::read(client.get(server.url("/readyz")).send().await.unwrap()).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = common::read(
        client
            .get(server.url("/api/accounts"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let accounts = r.body["accounts"].as_array().expect("accounts").clone();
    let names: Vec<&str> = accounts
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Alice", "Bob", "Charlie"]);
    let alice = accounts[0]["id"].as_str().unwrap();
    let r = common::read(
        client
            .get(server.url(&format!("/api/accounts/{alice}/balance")))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        r.body,
        json!({ "balanceCents": 50000, "aggregateVersion": 1 })
    );
    let r = common::read(
        client
            .post(server.url(&format!("/api/accounts/{alice}/withdraw")))
            .json(&json!({ "amountCents": 1000 }))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        r.body,
        json!({ "balanceCents": 49000, "aggregateVersion": 2 })
    );
    drop(client);
    server.sigterm();
    let status = server.wait_exit();
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(server.position("stopped").is_some(), "{:#?}", server.log);
}

#[cfg(unix)]
#[tokio::test]
async fn binary_drains_an_in_flight_request_on_sigterm_and_exits_0() {
    // Every store write is held for 1.5 s: a deterministic slow request.
    let mut server = Server::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--seed-demo-accounts",
            "false",
            "--faults",
            "inflight=1,inflight-hold-ms=1500,seed=1",
        ],
        &[],
    );
    let client = reqwest::Client::new();
    let account = new_account();
    let slow = {
        let (client, url) = (
            client.clone(),
            server.url(&format!("/api/accounts/{account}/deposit")),
        );
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .header("idempotency-key", "drain-1")
                    .json(&json!({ "amountCents": 700 }))
                    .send()
                    .await
                    .expect("the in-flight request is answered"),
            )
            .await
        })
    };
    // Wait (bounded) until the deposit is being served: the scrape counts itself, so two.
    let deadline = Instant::now() + PROCESS_BOUND;
    loop {
        let m = common::read(client.get(server.url("/metrics")).send().await.unwrap()).await;
        if common::metric_sum(&m.text, "tally_http_requests_in_flight") >= 2.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the deposit never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.sigterm();
    let r = slow.await.expect("request task");
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body,
        json!({ "balanceCents": 700, "aggregateVersion": 1 })
    );
    assert_eq!(r.header("idempotency-key"), Some("drain-1"));
    let status = server.wait_exit();
    assert_eq!(status.code(), Some(0), "{status}");
    // The drain began while the deposit was in flight, and the process stopped after it.
    let draining = server
        .position("shutting down: draining in-flight requests")
        .expect("a drain log line");
    let served = server
        .log
        .iter()
        .position(|v| {
            v["fields"]["message"] == "served" && v["span"]["route"] == "/api/accounts/{id}/deposit"
        })
        .expect("the deposit's access log line");
    let stopped = server.position("stopped").expect("a stopped log line");
    assert!(draining < served && served < stopped, "{:#?}", server.log);
}

#[test]
fn binary_refuses_an_invalid_configuration_with_exit_2() {
    for args in [
        &["--idempotency-window", "0"][..],
        &["--max-concurrent-requests", "0"],
        &["--faults", "lost-ack=2"],
        &["--faults", "bogus=1"],
    ] {
        let out = tally_command(args, &[]).output().expect("tally runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("invalid configuration"),
            "{args:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "nothing was served: {args:?}");
    }
}
