//! The retry contract, one test per rule: against a scripted server (a raw HTTP/1 listener
//! that answers each request with the next step of its script and records what it got), and
//! against a real Tally in this process, over TCP, with store faults.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use tally_client::{
    AmountCents, BatchItem, Client, Error, EventKind, Failure, IdempotencyKey, ItemValue,
    RetryPolicy,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::time::Instant;
use uuid::Uuid;

/// What the scripted server does with one request.
enum Step {
    Answer {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Reads the request and never answers.
    Hang,
    /// Reads the request and closes the connection.
    Close,
}

/// What the scripted server received.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    request_line: String,
    key: Option<String>,
    body: String,
}

struct Scripted {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    /// Serves `steps` in order; a request past the end is answered 418 (final), so a test
    /// that sends too many sees it.
    async fn start(steps: Vec<Step>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let steps = Arc::new(Mutex::new(VecDeque::from(steps)));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_connection(stream, steps.clone(), record.clone()));
            }
        });
        Scripted { base, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.seen().into_iter().map(|s| s.key).collect()
    }
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    let mut stream = BufReader::new(stream);
    loop {
        let mut request_line = String::new();
        if stream.read_line(&mut request_line).await.unwrap_or(0) == 0 {
            return;
        }
        let (mut key, mut length) = (None, 0usize);
        loop {
            let mut line = String::new();
            stream.read_line(&mut line).await.unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap();
            match name.to_ascii_lowercase().as_str() {
                "idempotency-key" => key = Some(value.trim().to_string()),
                "content-length" => length = value.trim().parse().unwrap(),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        stream.read_exact(&mut body).await.unwrap();
        seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            request_line: request_line.trim_end().to_string(),
            key,
            body: String::from_utf8(body).unwrap(),
        });
        let step = steps.lock().unwrap().pop_front();
        let (status, headers, body) = match step {
            Some(Step::Answer {
                status,
                headers,
                body,
            }) => (status, headers, body),
            Some(Step::Hang) => {
                std::future::pending::<()>().await;
                return;
            }
            Some(Step::Close) => return,
            None => (418, vec![], error_body("SCRIPT_ENDED")),
        };
        let mut head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let stream = stream.get_mut();
        if stream.write_all(head.as_bytes()).await.is_err()
            || stream.write_all(body.as_bytes()).await.is_err()
        {
            return;
        }
    }
}

fn error_body(code: &str) -> String {
    format!(r#"{{"error":"{code}","message":"scripted"}}"#)
}

fn refusal(status: u16, code: &str, headers: Vec<(&'static str, String)>) -> Step {
    Step::Answer {
        status,
        headers,
        body: error_body(code),
    }
}

fn balance(cents: i64, version: u64) -> Step {
    Step::Answer {
        status: 200,
        headers: vec![],
        body: format!(r#"{{"balanceCents":{cents},"aggregateVersion":{version}}}"#),
    }
}

/// Short waits, so that the tests run in milliseconds unless the server asks for longer.
fn quick() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 5,
        total: Duration::from_secs(20),
        attempt_timeout: Duration::from_secs(5),
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
    }
}

fn client(server: &Scripted, policy: RetryPolicy) -> Client {
    Client::builder(&server.base)
        .policy(policy)
        .build()
        .unwrap()
}

/// An amount the API takes (the tests' amounts are all in range).
fn cents(amount: i64) -> AmountCents {
    AmountCents::new(amount).expect("an amount in the API's range")
}

fn all_the_same(keys: &[Option<String>]) -> bool {
    keys.iter().all(|k| k.is_some() && *k == keys[0])
}

#[tokio::test]
async fn every_write_carries_a_key_and_a_minted_one_is_returned() {
    let server = Scripted::start(vec![balance(5, 1), balance(10, 2)]).await;
    let tally = client(&server, quick());
    let account = Uuid::new_v4();
    let minted = tally.deposit(account, cents(5)).send().await.unwrap();
    let given = IdempotencyKey::new("order-42").unwrap();
    let named = tally
        .deposit(account, cents(5))
        .key(given.clone())
        .send()
        .await
        .unwrap();
    let keys = server.keys();
    assert_eq!(keys[0].as_deref(), Some(minted.key.as_str()));
    assert!(
        Uuid::parse_str(minted.key.as_str()).is_ok(),
        "a minted key is a UUID"
    );
    assert_eq!(keys[1].as_deref(), Some("order-42"));
    assert_eq!(named.key, given);
    assert_eq!(named.value.balance_cents, 10);
    let seen = server.seen();
    assert_eq!(
        seen[0].request_line,
        format!("POST /api/accounts/{account}/deposit HTTP/1.1")
    );
    assert_eq!(seen[0].body, r#"{"amountCents":5}"#);
}

#[tokio::test]
async fn a_conflict_409_is_retried_with_the_same_key() {
    let conflict = || refusal(409, "CONFLICT", vec![("retry-after", "0".into())]);
    let server = Scripted::start(vec![conflict(), conflict(), balance(7, 3)]).await;
    let written = client(&server, quick())
        .deposit(Uuid::new_v4(), cents(7))
        .send()
        .await
        .unwrap();
    assert_eq!(written.attempts, 3);
    assert_eq!(server.keys().len(), 3);
    assert!(all_the_same(&server.keys()), "{:?}", server.keys());
}

#[tokio::test]
async fn a_503_and_a_500_are_retried_with_the_same_key() {
    let steps = vec![
        refusal(503, "SERVICE_UNAVAILABLE", vec![]),
        refusal(500, "STORE_ERROR", vec![]),
        balance(1, 1),
    ];
    let server = Scripted::start(steps).await;
    let key = IdempotencyKey::new("k-503").unwrap();
    let written = client(&server, quick())
        .withdraw(Uuid::new_v4(), cents(1))
        .key(key)
        .send()
        .await
        .unwrap();
    assert_eq!(written.attempts, 3);
    assert_eq!(server.keys(), vec![Some("k-503".to_string()); 3]);
}

#[tokio::test]
async fn a_timeout_is_retried_with_the_same_key() {
    let server = Scripted::start(vec![Step::Hang, balance(2, 2)]).await;
    let policy = RetryPolicy {
        attempt_timeout: Duration::from_millis(300),
        ..quick()
    };
    let written = client(&server, policy)
        .deposit(Uuid::new_v4(), cents(2))
        .send()
        .await
        .unwrap();
    assert_eq!(written.attempts, 2);
    assert!(all_the_same(&server.keys()), "{:?}", server.keys());
}

/// Rule: a caller who may not read the payee gets the payer's leg only, and the client reads
/// that answer as a transfer with no payee leg, not as a broken one.
#[tokio::test]
async fn a_transfer_answered_without_the_payees_leg_is_read_as_such() {
    let payer_only = Step::Answer {
        status: 200,
        headers: vec![],
        body: r#"{"from":{"balanceCents":3,"aggregateVersion":2}}"#.into(),
    };
    let server = Scripted::start(vec![payer_only]).await;
    let written = client(&server, quick())
        .transfer(Uuid::new_v4(), Uuid::new_v4(), cents(2))
        .send()
        .await
        .unwrap();
    assert_eq!(written.value.from.balance_cents, 3);
    assert_eq!(written.value.to, None);
}

#[tokio::test]
async fn a_broken_connection_is_retried_with_the_same_key() {
    let (from, to) = (Uuid::new_v4(), Uuid::new_v4());
    let transferred = Step::Answer {
        status: 200,
        headers: vec![],
        body: r#"{"from":{"balanceCents":3,"aggregateVersion":2},"to":{"balanceCents":2,"aggregateVersion":1}}"#.into(),
    };
    let server = Scripted::start(vec![Step::Close, transferred]).await;
    let written = client(&server, quick())
        .transfer(from, to, cents(2))
        .send()
        .await
        .unwrap();
    assert_eq!(
        (
            written.value.from.balance_cents,
            written.value.to.map(|b| b.balance_cents)
        ),
        (3, Some(2))
    );
    assert_eq!(written.attempts, 2);
    assert!(all_the_same(&server.keys()), "{:?}", server.keys());
    let body: serde_json::Value = serde_json::from_str(&server.seen()[1].body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"fromAccountId": from, "toAccountId": to, "amountCents": 2})
    );
}

/// Rule: a connection that is refused carried no request, so a call whose every attempt was
/// refused ends with nothing written, and says so (`Unreachable`, outcome known).
#[tokio::test]
async fn a_refused_connection_is_retried_and_then_known_to_have_sent_nothing() {
    // A port nothing listens on: every attempt is refused.
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tally = Client::builder(&format!("http://127.0.0.1:{port}"))
        .policy(quick())
        .build()
        .unwrap();
    let err = tally
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Unreachable {
                key: Some(_),
                attempts: 5,
                last: Failure::Connect(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.outcome_unknown(), "{err}");
}

/// Rule: once one attempt may have reached the server (its connection broke after the
/// request went out), later refused connections do not make the outcome known.
#[tokio::test]
async fn a_refusal_after_a_sent_attempt_leaves_the_outcome_unknown() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    // Takes one connection, reads the request's head, closes, and stops listening.
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        drop(listener);
        let mut stream = BufReader::new(stream);
        let mut line = String::new();
        while stream.read_line(&mut line).await.unwrap_or(0) > 0 && line != "\r\n" {
            line.clear();
        }
    });
    let tally = Client::builder(&base).policy(quick()).build().unwrap();
    let call = tally.deposit(Uuid::new_v4(), cents(1)).send();
    let err = call.await.unwrap_err();
    server.await.unwrap();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                key: Some(_),
                attempts: 5,
                last: Failure::Connect(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.outcome_unknown(), "{err}");
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let shed = refusal(
        503,
        "SERVICE_UNAVAILABLE",
        vec![("retry-after", "1".into())],
    );
    let server = Scripted::start(vec![shed, balance(3, 1)]).await;
    client(&server, quick())
        .deposit(Uuid::new_v4(), cents(3))
        .send()
        .await
        .unwrap();
    let seen = server.seen();
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(1),
        "the retry came {gap:?} after the answer that asked for 1 s (the backoff alone is 10 ms)"
    );
}

#[tokio::test]
async fn a_retry_after_beyond_the_total_time_ends_the_call_without_waiting() {
    let shed = refusal(
        503,
        "SERVICE_UNAVAILABLE",
        vec![("retry-after", "60".into())],
    );
    let server = Scripted::start(vec![shed, balance(3, 1)]).await;
    let started = Instant::now();
    let err = client(&server, quick())
        .deposit(Uuid::new_v4(), cents(3))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Exhausted { attempts: 1, .. }),
        "{err:?}"
    );
    assert_eq!(server.seen().len(), 1);
    assert!(
        started.elapsed() < quick().total,
        "it did not wait out a Retry-After it could not honour within its bound"
    );
}

#[tokio::test]
async fn no_resend_after_the_idempotency_window() {
    // The window is spent: no resend at all.
    let spent = refusal(409, "CONFLICT", vec![("idempotency-window", "0".into())]);
    let server = Scripted::start(vec![spent, balance(1, 1)]).await;
    let err = client(&server, quick())
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::WindowClosed { attempts: 1, .. }),
        "{err:?}"
    );
    assert!(err.outcome_unknown());
    assert_eq!(server.seen().len(), 1, "the key was not resent");

    // The server asks for a wait longer than what is left of the window.
    let late = refusal(
        503,
        "SERVICE_UNAVAILABLE",
        vec![
            ("idempotency-window", "1".into()),
            ("retry-after", "2".into()),
        ],
    );
    let server = Scripted::start(vec![late, balance(1, 1)]).await;
    let err = client(&server, quick())
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::WindowClosed { .. }), "{err:?}");
    assert_eq!(server.seen().len(), 1, "the key was not resent");

    // Within the window the resend goes out.
    let open = refusal(409, "CONFLICT", vec![("idempotency-window", "30".into())]);
    let server = Scripted::start(vec![open, balance(1, 1)]).await;
    let written = client(&server, quick())
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap();
    assert_eq!(written.attempts, 2);
}

#[tokio::test]
async fn a_422_is_never_retried() {
    let window = vec![("idempotency-window", "90".into())];
    let server = Scripted::start(vec![
        refusal(422, "INSUFFICIENT_FUNDS", window),
        balance(0, 1),
    ])
    .await;
    let err = client(&server, quick())
        .withdraw(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    match &err {
        Error::Refused { status, error, key } => {
            assert_eq!((*status, error.code.as_str()), (422, "INSUFFICIENT_FUNDS"));
            assert_eq!(
                key.as_ref().map(|k| k.as_str().to_string()),
                server.keys()[0]
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!err.outcome_unknown());
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn other_final_answers_are_never_retried() {
    for (status, code) in [
        (409, "ACCOUNT_EXISTS"),
        (404, "ACCOUNT_NOT_FOUND"),
        (400, "BAD_QUERY"),
    ] {
        let server = Scripted::start(vec![refusal(status, code, vec![]), balance(0, 1)]).await;
        let err = client(&server, quick())
            .open(None)
            .send()
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Refused { status: s, error, .. } if *s == status && error.code == code),
            "{err:?}"
        );
        assert_eq!(server.seen().len(), 1, "{status} {code} was sent once");
    }
}

#[tokio::test]
async fn attempts_are_bounded() {
    let shed = || refusal(503, "SERVICE_UNAVAILABLE", vec![]);
    let server = Scripted::start((0..10).map(|_| shed()).collect()).await;
    let policy = RetryPolicy {
        max_attempts: 3,
        ..quick()
    };
    let err = client(&server, policy)
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                attempts: 3,
                last: Failure::Answer { status: 503, .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(server.seen().len(), 3);
}

#[tokio::test]
async fn total_time_is_bounded() {
    // An attempt may take 30 s, the call only 1 s: the attempt is cut at the call's bound.
    let server = Scripted::start(vec![Step::Hang, Step::Hang]).await;
    let policy = RetryPolicy {
        total: Duration::from_secs(1),
        attempt_timeout: Duration::from_secs(30),
        ..quick()
    };
    let started = Instant::now();
    let err = client(&server, policy)
        .deposit(Uuid::new_v4(), cents(1))
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                attempts: 1,
                last: Failure::Timeout(_),
                ..
            }
        ),
        "{err:?}"
    );
    // Far below the attempt's own 30 s: the call's bound, not a speed target.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn reads_are_retried_without_a_key() {
    let lagging = refusal(
        503,
        "SERVICE_UNAVAILABLE",
        vec![("retry-after", "0".into())],
    );
    let server = Scripted::start(vec![lagging, balance(9, 4)]).await;
    let account = Uuid::new_v4();
    let read = client(&server, quick())
        .balance(account, Some(4))
        .await
        .unwrap();
    assert_eq!((read.balance_cents, read.aggregate_version), (9, 4));
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.key.is_none()));
    assert_eq!(
        seen[1].request_line,
        format!("GET /api/accounts/{account}/balance?minVersion=4 HTTP/1.1")
    );
}

/// One item's result as the batch endpoint answers it: `status` and `body` as the single
/// route would answer, the item's key, and the window a resend of it stays safe.
fn item(status: u16, body: &str, key: &str, replayed: bool, window: u64) -> serde_json::Value {
    serde_json::json!({
        "status": status,
        "body": serde_json::from_str::<serde_json::Value>(body).unwrap(),
        "idempotencyKey": key,
        "replayed": replayed,
        "idempotencyWindow": window,
        "idempotencyRetention": 86_400,
    })
}

fn item_ok(cents: i64, key: &str) -> serde_json::Value {
    let body = format!(r#"{{"balanceCents":{cents},"aggregateVersion":1}}"#);
    item(200, &body, key, false, 90)
}

fn item_refused(status: u16, code: &str, key: &str) -> serde_json::Value {
    item(status, &error_body(code), key, false, 90)
}

/// A 200 batch answer holding `results`, with `headers`.
fn batch_answer(results: Vec<serde_json::Value>, headers: Vec<(&'static str, String)>) -> Step {
    Step::Answer {
        status: 200,
        headers,
        body: serde_json::json!({ "results": results }).to_string(),
    }
}

/// The keys of the items one batch request carried, in order.
fn sent_keys(seen: &Seen) -> Vec<String> {
    let body: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["idempotencyKey"].as_str().unwrap().to_string())
        .collect()
}

/// Deposits of 1 cent each under the keys `k0`, `k1`, ...
fn deposits(n: usize) -> Vec<BatchItem> {
    (0..n)
        .map(|i| {
            BatchItem::deposit(Uuid::new_v4(), cents(1))
                .key(IdempotencyKey::new(format!("k{i}")).unwrap())
        })
        .collect()
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|k| k.to_string()).collect()
}

/// Rule: a batch is one `POST /api/batch` of typed items, each with its key; the results
/// come back aligned with the items, decoded as each item's type answers.
#[tokio::test]
async fn a_batch_sends_each_item_with_its_key_and_answers_in_order() {
    let transferred = r#"{"from":{"balanceCents":3,"aggregateVersion":2},"to":{"balanceCents":9,"aggregateVersion":4}}"#;
    let server = Scripted::start(vec![batch_answer(
        vec![item_ok(5, "d"), item(200, transferred, "t", true, 90)],
        vec![],
    )])
    .await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let items = vec![
        BatchItem::deposit(a, cents(5)).key(IdempotencyKey::new("d").unwrap()),
        BatchItem::transfer(a, b, cents(2)).key(IdempotencyKey::new("t").unwrap()),
    ];
    let results = client(&server, quick()).batch(items).await.unwrap();
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].request_line, "POST /api/batch HTTP/1.1");
    assert_eq!(seen[0].key, None, "the keys travel in the items");
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"items": [
            {"type": "deposit", "accountId": a, "amountCents": 5, "idempotencyKey": "d"},
            {"type": "transfer", "fromAccountId": a, "toAccountId": b, "amountCents": 2,
             "idempotencyKey": "t"},
        ]})
    );
    let deposit = results[0].as_ref().unwrap();
    assert!(matches!(deposit.value, ItemValue::Balance(b) if b.balance_cents == 5));
    assert_eq!(
        (deposit.key.as_str(), deposit.replayed, deposit.attempts),
        ("d", false, 1)
    );
    let transfer = results[1].as_ref().unwrap();
    assert!(
        matches!(transfer.value, ItemValue::Transferred(t) if t.to.map(|l| l.balance_cents) == Some(9))
    );
    assert!(transfer.replayed);
}

/// Rule: only the items answered retryably (409 `CONFLICT`, 503, 500, 429) are resent, each
/// under its own key; the items answered 2xx or final are settled and never sent again.
#[tokio::test]
async fn only_the_retryable_items_are_resent_under_their_keys() {
    let first = batch_answer(
        vec![
            item_ok(1, "k0"),
            item_refused(409, "CONFLICT", "k1"),
            item_refused(503, "SERVICE_UNAVAILABLE", "k2"),
            item_refused(422, "INSUFFICIENT_FUNDS", "k3"),
            item_refused(500, "STORE_ERROR", "k4"),
            item_refused(429, "TOO_MANY_REQUESTS", "k5"),
            item_refused(409, "ACCOUNT_EXISTS", "k6"),
            item_refused(403, "FORBIDDEN", "k7"),
            item_refused(400, "VALIDATION_ERROR", "k8"),
        ],
        vec![("retry-after", "0".into())],
    );
    let second = batch_answer(
        ["k1", "k2", "k4", "k5"]
            .iter()
            .map(|k| {
                item(
                    200,
                    r#"{"balanceCents":1,"aggregateVersion":1}"#,
                    k,
                    true,
                    90,
                )
            })
            .collect(),
        vec![],
    );
    let server = Scripted::start(vec![first, second]).await;
    let results = client(&server, quick()).batch(deposits(9)).await.unwrap();
    let seen = server.seen();
    assert_eq!(seen.len(), 2, "one resend, of the retryable items only");
    assert_eq!(sent_keys(&seen[1]), keys(&["k1", "k2", "k4", "k5"]));
    let attempts: Vec<Option<u32>> = results
        .iter()
        .map(|r| r.as_ref().ok().map(|w| w.attempts))
        .collect();
    assert_eq!(
        attempts,
        [
            Some(1),
            Some(2),
            Some(2),
            None,
            Some(2),
            Some(2),
            None,
            None,
            None
        ]
    );
    for (i, (status, code)) in [
        (3, (422, "INSUFFICIENT_FUNDS")),
        (6, (409, "ACCOUNT_EXISTS")),
        (7, (403, "FORBIDDEN")),
        (8, (400, "VALIDATION_ERROR")),
    ] {
        match &results[i] {
            Err(
                e @ Error::Refused {
                    status: s,
                    error,
                    key,
                },
            ) => {
                assert_eq!((*s, error.code.as_str()), (status, code));
                assert_eq!(key.as_ref().unwrap().as_str(), format!("k{i}"));
                assert!(!e.outcome_unknown());
            }
            other => panic!("item {i}: {other:?}"),
        }
    }
}

/// Rule: the batch answer's `Retry-After` is honoured before its retryable items are resent.
#[tokio::test]
async fn a_batch_answers_retry_after_is_honoured_for_its_items() {
    let first = batch_answer(
        vec![
            item_ok(1, "k0"),
            item_refused(503, "SERVICE_UNAVAILABLE", "k1"),
        ],
        vec![("retry-after", "1".into())],
    );
    let server = Scripted::start(vec![first, batch_answer(vec![item_ok(1, "k1")], vec![])]).await;
    let results = client(&server, quick()).batch(deposits(2)).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let seen = server.seen();
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(1),
        "the resend came {gap:?} after the answer that asked for 1 s (the backoff alone is 10 ms)"
    );
}

/// Rule: an item is not resent once its own `idempotencyWindow` has run out; the call ends
/// for that item with `WindowClosed` (outcome unknown) while the others go on.
#[tokio::test]
async fn no_item_is_resent_after_its_window() {
    let first = batch_answer(
        vec![
            item(409, &error_body("CONFLICT"), "k0", false, 0),
            item(409, &error_body("CONFLICT"), "k1", false, 30),
        ],
        vec![],
    );
    let server = Scripted::start(vec![first, batch_answer(vec![item_ok(1, "k1")], vec![])]).await;
    let results = client(&server, quick()).batch(deposits(2)).await.unwrap();
    match &results[0] {
        Err(
            e @ Error::WindowClosed {
                key, attempts: 1, ..
            },
        ) => {
            assert_eq!(key.as_str(), "k0");
            assert!(e.outcome_unknown());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(results[1].as_ref().unwrap().attempts, 2);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(sent_keys(&seen[1]), keys(&["k1"]), "k0 was not resent");
}

/// Rule: the attempts bound holds per item: an item answered 503 every time ends
/// `Exhausted` after `max_attempts` requests, while its neighbour settled at once.
#[tokio::test]
async fn item_attempts_are_bounded() {
    let shed = |k: &str| item_refused(503, "SERVICE_UNAVAILABLE", k);
    let mut steps = vec![batch_answer(vec![item_ok(1, "k0"), shed("k1")], vec![])];
    steps.extend((0..5).map(|_| batch_answer(vec![shed("k1")], vec![])));
    let server = Scripted::start(steps).await;
    let policy = RetryPolicy {
        max_attempts: 3,
        ..quick()
    };
    let results = client(&server, policy).batch(deposits(2)).await.unwrap();
    assert_eq!(results[0].as_ref().unwrap().attempts, 1);
    assert!(
        matches!(
            &results[1],
            Err(Error::Exhausted {
                key: Some(k),
                attempts: 3,
                last: Failure::Answer { status: 503, .. },
                ..
            }) if k.as_str() == "k1"
        ),
        "{:?}",
        results[1]
    );
    assert_eq!(server.seen().len(), 3);
}

/// Rule: a round the whole batch got no answer to (a broken connection, a timeout, a 502,
/// a 503 or 504 of the whole) resends every item it carried that is not settled, under the
/// same keys.
#[tokio::test]
async fn a_whole_batch_failure_resends_the_unsettled_items() {
    let shed_whole = refusal(
        503,
        "SERVICE_UNAVAILABLE",
        vec![("retry-after", "0".into())],
    );
    let steps = vec![
        Step::Close,
        batch_answer(
            vec![
                item_ok(1, "k0"),
                item_refused(409, "CONFLICT", "k1"),
                item_ok(1, "k2"),
            ],
            vec![],
        ),
        refusal(502, "", vec![]),
        shed_whole,
        Step::Hang,
        refusal(504, "", vec![]),
        batch_answer(vec![item_ok(1, "k1")], vec![]),
    ];
    let server = Scripted::start(steps).await;
    let policy = RetryPolicy {
        max_attempts: 10,
        attempt_timeout: Duration::from_millis(300),
        ..quick()
    };
    let results = client(&server, policy).batch(deposits(3)).await.unwrap();
    let attempts: Vec<u32> = results
        .iter()
        .map(|r| r.as_ref().unwrap().attempts)
        .collect();
    assert_eq!(attempts, [2, 7, 2]);
    let sent: Vec<Vec<String>> = server.seen().iter().map(sent_keys).collect();
    let all = keys(&["k0", "k1", "k2"]);
    let k1 = keys(&["k1"]);
    assert_eq!(
        sent,
        [
            all.clone(),
            all,
            k1.clone(),
            k1.clone(),
            k1.clone(),
            k1.clone(),
            k1
        ]
    );
}

/// Rule: a batch refused as a whole on its first send (over a limit, not JSON, not allowed)
/// wrote nothing: the call ends with that refusal and sends nothing more.
#[tokio::test]
async fn a_batch_refused_whole_is_not_resent() {
    for (status, code) in [
        (413, "BATCH_TOO_LARGE"),
        (400, "VALIDATION_ERROR"),
        (415, "UNSUPPORTED_MEDIA_TYPE"),
    ] {
        let server = Scripted::start(vec![refusal(status, code, vec![]), Step::Hang]).await;
        let err = client(&server, quick())
            .batch(deposits(2))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Refused { status: s, error, key: None } if *s == status && error.code == code),
            "{err:?}"
        );
        assert!(!err.outcome_unknown());
        assert_eq!(server.seen().len(), 1, "{status} was sent once");
    }
}

/// Rule: a whole refusal after an earlier round may have written settles each unsettled item
/// with it (the items already settled keep their results).
#[tokio::test]
async fn a_whole_refusal_on_a_resend_settles_the_open_items() {
    let first = batch_answer(
        vec![
            item_ok(1, "k0"),
            item_refused(503, "SERVICE_UNAVAILABLE", "k1"),
        ],
        vec![],
    );
    let server = Scripted::start(vec![first, refusal(401, "UNAUTHORIZED", vec![])]).await;
    let results = client(&server, quick()).batch(deposits(2)).await.unwrap();
    assert!(results[0].is_ok());
    assert!(
        matches!(&results[1], Err(Error::Refused { status: 401, key: Some(k), .. }) if k.as_str() == "k1"),
        "{:?}",
        results[1]
    );
    assert_eq!(server.seen().len(), 2);
}

/// Rule: a batch answer that cannot be matched to its items (here one result short) is no
/// answer for them: the items may have landed, so they are resent under their keys.
#[tokio::test]
async fn an_unreadable_batch_answer_resends_its_items() {
    let short = batch_answer(vec![item_ok(1, "k0")], vec![]);
    let wrong_key = batch_answer(vec![item_ok(1, "k1"), item_ok(1, "k0")], vec![]);
    let whole = batch_answer(vec![item_ok(1, "k0"), item_ok(2, "k1")], vec![]);
    let server = Scripted::start(vec![short, wrong_key, whole]).await;
    let results = client(&server, quick()).batch(deposits(2)).await.unwrap();
    let attempts: Vec<u32> = results
        .iter()
        .map(|r| r.as_ref().unwrap().attempts)
        .collect();
    assert_eq!(attempts, [3, 3]);
    let sent: Vec<Vec<String>> = server.seen().iter().map(sent_keys).collect();
    assert_eq!(sent, vec![keys(&["k0", "k1"]); 3]);

    // Every answer unreadable: the items end with their outcome unknown.
    let server = Scripted::start((0..5).map(|_| batch_answer(vec![], vec![])).collect()).await;
    let results = client(&server, quick()).batch(deposits(1)).await.unwrap();
    assert!(
        matches!(&results[0], Err(e @ Error::Exhausted { last: Failure::Unreadable { status: 200, .. }, .. }) if e.outcome_unknown()),
        "{:?}",
        results[0]
    );
}

/// Rule: when no round ever opened a connection, nothing was sent: each item ends
/// `Unreachable`, its outcome known.
#[tokio::test]
async fn a_batch_that_never_reached_the_server_is_known_to_have_written_nothing() {
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tally = Client::builder(&format!("http://127.0.0.1:{port}"))
        .policy(quick())
        .build()
        .unwrap();
    let results = tally.batch(deposits(2)).await.unwrap();
    for result in &results {
        let err = result.as_ref().unwrap_err();
        assert!(
            matches!(
                err,
                Error::Unreachable {
                    key: Some(_),
                    attempts: 5,
                    last: Failure::Connect(_),
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(!err.outcome_unknown());
    }
}

/// Rule: the call's total time bounds every item: an item still open when it runs out ends
/// `Exhausted` without waiting out a longer `Retry-After`.
#[tokio::test]
async fn a_batch_retry_after_beyond_the_total_time_ends_its_items() {
    let first = batch_answer(
        vec![
            item_ok(1, "k0"),
            item_refused(503, "SERVICE_UNAVAILABLE", "k1"),
        ],
        vec![("retry-after", "60".into())],
    );
    let server = Scripted::start(vec![first, Step::Hang]).await;
    let started = Instant::now();
    let results = client(&server, quick()).batch(deposits(2)).await.unwrap();
    assert!(results[0].is_ok());
    assert!(
        matches!(&results[1], Err(Error::Exhausted { attempts: 1, .. })),
        "{:?}",
        results[1]
    );
    assert_eq!(server.seen().len(), 1);
    assert!(started.elapsed() < quick().total);
}

#[tokio::test]
async fn an_empty_batch_sends_nothing() {
    let server = Scripted::start(vec![]).await;
    let results = client(&server, quick()).batch(Vec::new()).await.unwrap();
    assert!(results.is_empty());
    assert!(server.seen().is_empty());
}

/// A real Tally in this process, on its embedded store and port 0; stopped when dropped.
struct RealTally {
    base: String,
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
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(tally::http::serve(app, listener, async {
            let _ = stopped.await;
        }));
        RealTally { base, _stop: stop }
    }
}

/// Rule: a write whose acknowledgement the store lost is answered 409 by a replica that may
/// not try again (one store write per request); the client resends it under its key, and it
/// lands once (the resend is the replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_acks_on_a_real_tally_land_once() {
    let faults = "lost-ack=0.3,seed=7";
    let server = RealTally::start(&["--faults", faults, "--write-max-attempts", "1"]).await;
    let tally = Client::builder(&server.base)
        .policy(quick())
        .build()
        .unwrap();
    let account = Uuid::new_v4();
    let (mut sent, mut attempts, mut replays) = (0i64, 0, 0);
    for amount in 1..=40i64 {
        let key = IdempotencyKey::new(format!("lost-ack-{amount}")).unwrap();
        let written = tally.deposit(account, cents(amount)).key(key).send().await;
        let written = written.unwrap_or_else(|e| panic!("deposit {amount} ({faults}): {e}"));
        sent += amount;
        attempts += written.attempts;
        replays += u32::from(written.replayed);
        assert_eq!(
            written.value.balance_cents, sent,
            "deposit {amount} landed once"
        );
    }
    assert!(
        attempts > 40,
        "{faults} made the client resend ({attempts} attempts)"
    );
    let read = tally.balance(account, None).await.unwrap();
    assert_eq!(
        read.balance_cents, sent,
        "every deposit once ({replays} replays)"
    );
    let history = tally.history(account, None, Some(100)).await.unwrap();
    let amounts: Vec<i64> = history.events.iter().map(|e| e.amount_cents).collect();
    assert_eq!(
        amounts,
        (1..=40).collect::<Vec<i64>>(),
        "each deposit once, in order"
    );
    assert!(
        history
            .events
            .iter()
            .all(|e| e.kind == EventKind::Deposited)
    );
    assert_eq!(history.next_from_version, None);
}

/// Rule: a 503 from a replica shedding load is retried under the same key after its
/// `Retry-After`, and every write lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_tally_shedding_load_lands_every_write_once() {
    let server =
        RealTally::start(&["--max-concurrent-requests", "1", "--max-queue-wait-ms", "0"]).await;
    // Every shed writer is told `Retry-After: 1`: room for the waves that takes.
    let policy = RetryPolicy {
        max_attempts: 20,
        total: Duration::from_secs(60),
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(500),
        ..quick()
    };
    let tally = Client::builder(&server.base)
        .policy(policy)
        .build()
        .unwrap();
    let account = Uuid::new_v4();
    let writers: Vec<_> = (1..=16i64)
        .map(|amount| {
            let tally = tally.clone();
            tokio::spawn(async move { tally.deposit(account, cents(amount)).send().await })
        })
        .collect();
    let mut attempts = 0;
    for w in writers {
        attempts += w.await.unwrap().expect("every deposit lands").attempts;
    }
    assert!(
        attempts > 16,
        "16 writers over 1 slot were shed ({attempts} attempts)"
    );
    let read = tally.balance(account, None).await.unwrap();
    assert_eq!(read.balance_cents, (1..=16).sum::<i64>());
}

/// Rule: against a real Tally losing store acknowledgements, each batch item answered 409 is
/// resent under its key (with the other unsettled items only) and lands once: the balances
/// and the history hold every item once, and the batch resent whole replays every item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_acks_on_a_real_tally_land_each_batch_item_once() {
    let faults = "lost-ack=0.3,seed=11";
    let server = RealTally::start(&["--faults", faults, "--write-max-attempts", "1"]).await;
    // An item's 409 states no Retry-After of its own: the backoff gives the replica time to
    // settle what it does not know, as the single route's `Retry-After: 1` does.
    let policy = RetryPolicy {
        max_attempts: 20,
        total: Duration::from_secs(60),
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        ..quick()
    };
    let tally = Client::builder(&server.base)
        .policy(policy)
        .build()
        .unwrap();
    let accounts: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    // 40 deposits, ten on each account, interleaved.
    let items: Vec<BatchItem> = (1..=40i64)
        .map(|amount| {
            let key = IdempotencyKey::new(format!("batch-lost-ack-{amount}")).unwrap();
            BatchItem::deposit(accounts[(amount % 4) as usize], cents(amount)).key(key)
        })
        .collect();
    let results = tally.batch(items.clone()).await.unwrap();
    let attempts: u32 = results
        .iter()
        .map(|r| {
            r.as_ref()
                .unwrap_or_else(|e| panic!("{faults}: {e}"))
                .attempts
        })
        .sum();
    assert!(
        attempts > 40,
        "{faults} made the client resend items ({attempts})"
    );
    for (i, &account) in accounts.iter().enumerate() {
        let deposits: Vec<i64> = (1..=40i64).filter(|a| (a % 4) as usize == i).collect();
        let read = tally.balance(account, None).await.unwrap();
        assert_eq!(
            read.balance_cents,
            deposits.iter().sum::<i64>(),
            "account {i}: each item once"
        );
        let history = tally.history(account, None, Some(100)).await.unwrap();
        let mut amounts: Vec<i64> = history.events.iter().map(|e| e.amount_cents).collect();
        // An item answered 409 that had not landed lands on a later round, after the items
        // behind it: once each, not in item order.
        amounts.sort_unstable();
        assert_eq!(amounts, deposits, "account {i}: each item once");
    }
    let again = tally.batch(items).await.unwrap();
    for (first, second) in results.iter().zip(&again) {
        let (first, second) = (first.as_ref().unwrap(), second.as_ref().unwrap());
        assert!(second.replayed, "{}", second.key);
        assert_eq!(first.value, second.value);
    }
}
