//! Admission at the HTTP edge: a request over the in-flight limit waits for a slot
//! instead of being refused at once; one that waits its full time is shed with 503,
//! Retry-After, the JSON error and `Connection: close`; at the connection cap the server
//! stops accepting until a connection closes.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestApp, metric_sum, new_account, spawn, test_config};
use reqwest::StatusCode;
use tally::config::http::DEFAULT_MAX_CONCURRENT_REQUESTS;
use tally::store::faults::FaultyLog;
use tally::write_loop::DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for something that must happen before it fails instead of hanging.
const BOUND: Duration = Duration::from_secs(30);
/// The pause between two checks of a signal the server gives (a metric, a gauge): a test
/// polling for seconds (a write stall) leaves the two cores to the servers under test.
const POLL: Duration = Duration::from_millis(2);
/// How long a request that must not be answered is watched. A negative can only be checked
/// for a while; this is far longer than a loopback answer takes.
const NO_ANSWER_WATCH: Duration = Duration::from_millis(300);

fn faults(t: &TestApp) -> &Arc<FaultyLog> {
    t.app.faults.as_ref().expect("started with --faults")
}

/// Scrapes `/metrics` until `name` sums to `value` (a signal from the server, polled).
async fn wait_for_metric(t: &TestApp, name: &str, value: f64) {
    tokio::time::timeout(BOUND, async {
        loop {
            if metric_sum(&t.get("/metrics").await.text, name) == value {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{name} never reached {value}"));
}

/// A replica with one in-flight slot, where a request over it waits (for longer than any
/// of these tests waits: never shed in them), and `extra` flags.
async fn one_in_flight_slot(extra: &[&str]) -> TestApp {
    let mut flags = vec![
        "--max-concurrent-requests",
        "1",
        "--max-queue-wait-ms",
        "10000",
    ];
    flags.extend_from_slice(extra);
    spawn(test_config(&flags), None, None).await
}

/// Rule: a request over `--max-concurrent-requests` waits for a slot and is served when one
/// frees, instead of being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_limit_waits_for_a_slot() {
    let t = one_in_flight_slot(&["--faults", "seed=1"]).await;
    let account = new_account();
    // Hold one write inside the store: its request keeps the only slot.
    let mut hold = faults(&t).hold_next_write();
    let deposit = |cents: i64, key: &'static str| {
        let (client, url) = (
            t.client.clone(),
            t.url(&format!("/api/accounts/{account}/deposit")),
        );
        tokio::spawn(async move { common::keyed_deposit(&client, &url, key, cents).await })
    };
    let held = deposit(1, "held");
    assert!(hold.held().await);
    let queued = deposit(2, "queued");
    wait_for_metric(&t, "tally_http_requests_queued", 1.0).await;
    hold.release();
    let (held, queued) = (held.await.unwrap(), queued.await.unwrap());
    assert_eq!(held.status, StatusCode::OK, "{}", held.text);
    assert_eq!(queued.status, StatusCode::OK, "{}", queued.text);
    assert_eq!(t.balance(&account).await.0, 3);
    let m = t.get("/metrics").await.text;
    assert_eq!(metric_sum(&m, "tally_http_requests_shed_total"), 0.0);
    assert_eq!(metric_sum(&m, "tally_http_requests_queued"), 0.0);
    assert_eq!(metric_sum(&m, "tally_http_queue_wait_seconds_count"), 1.0);
    t.shutdown().await;
}

/// Rule: a request that waits `--max-queue-wait-ms` without a slot is shed: 503 with
/// Retry-After and the JSON error, counted, and nothing written. Below the connection cap
/// its connection stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waited_its_full_time_is_shed() {
    let t = spawn(
        test_config(&[
            "--max-concurrent-requests",
            "1",
            "--max-queue-wait-ms",
            "50",
            "--faults",
            "seed=1",
        ]),
        None,
        None,
    )
    .await;
    let account = new_account();
    let mut hold = faults(&t).hold_next_write();
    let held = {
        let (client, url) = (
            t.client.clone(),
            t.url(&format!("/api/accounts/{account}/deposit")),
        );
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .json(&serde_json::json!({ "amountCents": 1 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    assert!(hold.held().await);
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    assert_eq!(r.error_code(), "SERVICE_UNAVAILABLE");
    assert!(r.body["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("connection"), None, "below the connection cap");
    let m = t.get("/metrics").await.text;
    assert_eq!(metric_sum(&m, "tally_http_requests_shed_total"), 1.0);
    assert_eq!(metric_sum(&m, "tally_http_queue_wait_seconds_count"), 1.0);
    assert!(metric_sum(&m, "tally_http_queue_wait_seconds_sum") >= 0.05);
    hold.release();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    // The shed write did nothing: its key is still fresh.
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed());
    assert_eq!(t.balance(&account).await.0, 3);
    t.shutdown().await;
}

/// Rule: at the default limits, a burst of writes to one account bigger than its write queue
/// waits at the edge instead of being refused at once by the write side's per-account cap,
/// and every write lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_one_account_waits_at_the_edge_instead_of_being_refused() {
    // The gate is opened past the burst, so every request is read and the rule pinned is
    // the in-flight limit's (the gate's own wait: `over_the_gate_...`).
    let t = spawn(
        test_config(&[
            "--max-queue-wait-ms",
            "10000",
            "--min-active-requests",
            "1024",
            "--max-active-requests",
            "1024",
            "--faults",
            "seed=1",
        ]),
        None,
        None,
    )
    .await;
    let account = new_account();
    let extra = 64;
    let burst = DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT + extra;
    // The first write waits inside the store, so the rest pile up behind it.
    let mut hold = faults(&t).hold_next_write();
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..burst {
        let (client, url) = (
            t.client.clone(),
            t.url(&format!("/api/accounts/{account}/deposit")),
        );
        requests.spawn(async move {
            common::keyed_deposit(&client, &url, &format!("burst-{i}"), 1).await
        });
    }
    assert!(hold.held().await);
    wait_for_metric(
        &t,
        "tally_http_requests_queued",
        (burst - DEFAULT_MAX_CONCURRENT_REQUESTS) as f64,
    )
    .await;
    hold.release();
    while let Some(reply) = requests.join_next().await {
        let reply = reply.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    assert_eq!(t.balance(&account).await.0, burst as i64);
    let m = t.get("/metrics").await.text;
    assert_eq!(metric_sum(&m, "tally_write_refused_total"), 0.0);
    assert_eq!(metric_sum(&m, "tally_http_requests_shed_total"), 0.0);
    t.shutdown().await;
}

/// Rule: at the connection cap a shed request's connection is closed, so the next client in
/// the accept queue gets its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_a_shed_request_closes_its_connection() {
    let t = spawn(
        test_config(&[
            "--max-connections",
            "2",
            "--max-concurrent-requests",
            "1",
            "--max-queue-wait-ms",
            "50",
            "--faults",
            "seed=1",
        ]),
        None,
        None,
    )
    .await;
    let account = new_account();
    // The first connection holds the only in-flight slot with a write held in the store.
    let (hold, mut holder) = hold_a_deposit(&t, &account).await;
    let post = raw_deposit(&account, r#"{"amountCents":1}"#);
    // The second takes the last connection slot, waits 50 ms for an in-flight slot, and is
    // shed with its connection closed.
    let mut shed = TcpStream::connect(t.addr).await.expect("connect");
    shed.write_all(post.as_bytes()).await.expect("sent");
    let answer = tokio::time::timeout(BOUND, read_response(&mut shed))
        .await
        .expect("answered");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    assert!(answer.contains("SERVICE_UNAVAILABLE"), "{answer}");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(BOUND, shed.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "the server closed the connection"
    );
    hold.release();
    assert_served(&mut holder, "the held deposit").await;
    drop(holder);
    t.shutdown().await;
}

/// Sends `GET path` over `stream` and reads one whole response (keep-alive, Content-Length).
async fn raw_get(stream: &mut TcpStream, path: &str) -> String {
    let head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("sent");
    read_response(stream).await
}

async fn read_response(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "connection closed mid-response");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return text;
            }
        }
    }
}

/// Rule: with `--max-connections` open, the server accepts no more until one closes; the
/// waiting client is then served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_the_server_stops_accepting() {
    let t = spawn(test_config(&["--max-connections", "1"]), None, None).await;
    let mut first = TcpStream::connect(t.addr).await.expect("connect");
    assert!(
        raw_get(&mut first, "/healthz")
            .await
            .starts_with("HTTP/1.1 200")
    );
    // The accept loop is now waiting for a slot: the first connection sees it say so.
    let metrics = raw_get(&mut first, "/metrics").await;
    assert_eq!(metric_sum(&metrics, "tally_http_connections_open"), 1.0);
    assert_eq!(metric_sum(&metrics, "tally_http_accept_paused_total"), 1.0);
    // The kernel completes the second handshake; Tally does not accept it.
    let mut second = TcpStream::connect(t.addr).await.expect("connect");
    second
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("sent");
    let mut byte = [0u8; 1];
    assert!(
        tokio::time::timeout(NO_ANSWER_WATCH, second.peek(&mut byte))
            .await
            .is_err(),
        "answered while the only slot was taken"
    );
    drop(first);
    let answer = tokio::time::timeout(BOUND, read_response(&mut second))
        .await
        .expect("served once the first connection closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    t.shutdown().await;
}

/// The deposit request `POST /api/accounts/{account}/deposit` with `body`, as raw bytes.
fn raw_deposit(account: &impl std::fmt::Display, body: &str) -> String {
    format!(
        "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A replica whose gate lets exactly one request be worked on at once.
async fn one_slot_gate() -> TestApp {
    spawn(
        test_config(&[
            "--min-active-requests",
            "1",
            "--max-active-requests",
            "1",
            // Longer than any of these tests waits: no gate wait runs out in them.
            "--max-queue-wait-ms",
            "10000",
            "--faults",
            "seed=1",
        ]),
        None,
        None,
    )
    .await
}

/// Sends a deposit of 1 cent on a raw connection of its own and waits until the store holds
/// its write: its request keeps an in-flight slot (and a gate slot) until `release`.
async fn hold_a_deposit(
    t: &TestApp,
    account: &impl std::fmt::Display,
) -> (tally::store::faults::HoldHandle, TcpStream) {
    let mut hold = faults(t).hold_next_write();
    let mut holder = TcpStream::connect(t.addr).await.expect("connect");
    holder
        .write_all(raw_deposit(account, r#"{"amountCents":1}"#).as_bytes())
        .await
        .expect("sent");
    assert!(hold.held().await);
    (hold, holder)
}

/// Reads one answer from `stream` within [`BOUND`] and checks it is a 200.
async fn assert_served(stream: &mut TcpStream, who: &str) {
    let answer = tokio::time::timeout(BOUND, read_response(stream))
        .await
        .unwrap_or_else(|_| panic!("{who}: never answered"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{who}: {answer}");
}

/// A new client's API request (a balance read) is answered within [`BOUND`].
async fn another_client_is_served(t: &TestApp) {
    let mut other = TcpStream::connect(t.addr).await.expect("connect");
    let path = format!("/api/accounts/{}/balance", new_account());
    let head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    other.write_all(head.as_bytes()).await.expect("sent");
    assert_served(&mut other, "another client").await;
}

/// A new client's API request is served without waiting out its gate wait: no slot is
/// held by anyone else.
async fn another_client_is_served_at_once(t: &TestApp) {
    let expired = t.app.metrics.http_gate_waits_expired.get();
    another_client_is_served(t).await;
    assert_eq!(
        t.app.metrics.http_gate_waits_expired.get(),
        expired,
        "another client waited out its gate wait"
    );
}

/// Polls an in-process gauge until it reads `value` (a signal from the server).
async fn wait_for_gauge(gauge: &prometheus::IntGauge, value: i64) {
    tokio::time::timeout(BOUND, async {
        while gauge.get() != value {
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("gauge never reached {value}, at {}", gauge.get()));
}

/// Rule 6 of the gate: an event stream holds no gate slot while it lasts. Its head and one
/// more byte go in one write: hyper reads both and keeps the byte for after the stream,
/// reading nothing more, so a slot the stream kept would never come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_event_stream_holds_no_gate_slot() {
    let t = one_slot_gate().await;
    let m = t.app.metrics.clone();
    let account = new_account();
    let mut watcher = TcpStream::connect(t.addr).await.expect("connect");
    let head = format!("GET /api/accounts/{account}/events HTTP/1.1\r\nHost: localhost\r\n\r\nX");
    watcher.write_all(head.as_bytes()).await.expect("sent");
    let mut seen = String::new();
    tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        while !seen.contains("event: snapshot") {
            let n = watcher.read(&mut buf).await.expect("read");
            assert!(n > 0, "the stream closed: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
    .await
    .expect("the stream's snapshot");
    assert_eq!(
        m.http_gate_active.get(),
        0,
        "the open stream holds a gate slot"
    );
    another_client_is_served_at_once(&t).await;
    drop(watcher);
    t.shutdown().await;
}

/// A client that pipelines 60 history pages of 1,000 events (about 150 KB each) with a
/// small receive buffer and never reads: far more answer bytes than the two sockets'
/// buffers hold, so the server's writes block. Returns it once its first request took a
/// gate slot.
async fn deaf_client(t: &TestApp) -> TcpStream {
    let account = new_account();
    for _ in 0..1_000 {
        assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    }
    let mut deaf = small_window_connection(t.addr).await;
    let get = format!(
        "GET /api/accounts/{account}/history?limit=1000 HTTP/1.1\r\nHost: localhost\r\n\r\n"
    );
    let taken = t.app.metrics.http_gate_taken.get();
    deaf.write_all(get.repeat(60).as_bytes())
        .await
        .expect("sent");
    wait_for(
        || t.app.metrics.http_gate_taken.get() > taken,
        "the deaf client's slot",
    )
    .await;
    deaf
}

/// Polls an in-process condition until it holds (a signal from the server), within BOUND.
async fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    tokio::time::timeout(BOUND, async {
        while !done() {
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: not within the bound"));
}

/// Rule 7 of the gate: a client that pipelines requests and never reads the answers holds
/// no gate slot once its answers fill the socket: other clients are served without waiting
/// out their gate wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_answers_holds_no_gate_slot() {
    let t = one_slot_gate().await;
    let m = t.app.metrics.clone();
    let deaf = deaf_client(&t).await;
    wait_for(|| m.http_gate_active.get() == 0, "the slot given back").await;
    another_client_is_served_at_once(&t).await;
    drop(deaf);
    t.shutdown().await;
}

/// A replica with the shortest write stall limit accepted: longer than a watch stream's
/// own (2 x 1 s).
async fn short_stall_replica() -> TestApp {
    spawn(
        test_config(&["--write-stall-secs", "3", "--watch-keepalive-secs", "1"]),
        None,
        None,
    )
    .await
}

/// A connection to `addr` with a small receive buffer, which the server's answers fill soon.
async fn small_window_connection(addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .set_recv_buffer_size(4096)
        .expect("small receive buffer");
    socket.connect(addr).await.expect("connect")
}

/// Waits for the server to count a write stall, then reads what the client had not taken:
/// part of the answers, and then the end of the connection.
async fn read_after_stall(t: &TestApp, reader: &mut (impl AsyncReadExt + Unpin)) -> Vec<u8> {
    let m = t.app.metrics.clone();
    wait_for(
        || m.http_write_stalls.get() == 1,
        "the stalled connection closed",
    )
    .await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(BOUND, reader.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the connection is still open after its stall");
    got
}

/// Rule: a connection whose client takes none of an answer for `--write-stall-secs` is
/// closed, so clients that stop reading cannot hold connections (and `--max-connections`)
/// for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_client_reads_nothing_is_closed_at_the_write_stall_limit() {
    let t = short_stall_replica().await;
    let mut deaf = deaf_client(&t).await;
    let got = read_after_stall(&t, &mut deaf).await;
    assert!(
        got.len() < 60 * 100_000,
        "all the answers arrived: {} bytes",
        got.len()
    );
    t.shutdown().await;
}

/// Rule: past the gate's limit a connection's request waits unread (it has not reached a
/// handler, so it is not in flight) and is served when the slot frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_gate_a_request_waits_unread_until_a_slot_frees() {
    let t = one_slot_gate().await;
    let m = t.app.metrics.clone();
    let account = new_account();
    let (hold, mut holder) = hold_a_deposit(&t, &account).await;
    let mut waiter = TcpStream::connect(t.addr).await.expect("connect");
    waiter
        .write_all(raw_deposit(&account, r#"{"amountCents":2}"#).as_bytes())
        .await
        .expect("sent");
    wait_for_gauge(&m.http_gate_waiting, 1).await;
    assert_eq!(m.http_in_flight.get(), 1, "only the held request was read");
    assert_eq!(
        m.http_queued.get(),
        0,
        "nothing waits behind the in-flight limit"
    );
    hold.release();
    assert_served(&mut holder, "the held deposit").await;
    let answer = tokio::time::timeout(BOUND, read_response(&mut waiter))
        .await
        .expect("the waiting request is served once the slot frees");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(m.http_gate_waiting.get(), 0);
    assert_eq!(t.balance(&account).await.0, 3);
    t.shutdown().await;
}

/// Rule: a client sending its head slowly holds no slot while the server waits for the
/// rest, so it cannot block the other connections (a slowloris against the gate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_head_holds_no_gate_slot() {
    let t = one_slot_gate().await;
    let account = new_account();
    let post = raw_deposit(&account, r#"{"amountCents":5}"#);
    let (first, rest) = post.split_at(20);
    let m = &t.app.metrics;
    let taken = m.http_gate_taken.get();
    let mut slow = TcpStream::connect(t.addr).await.expect("connect");
    slow.write_all(first.as_bytes()).await.expect("sent");
    // The server took a slot to read those bytes, and gave it back to wait for the rest.
    tokio::time::timeout(BOUND, async {
        while m.http_gate_taken.get() == taken || m.http_gate_active.get() != 0 {
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .expect("the slow connection took a slot and gave it back");
    another_client_is_served(&t).await;
    slow.write_all(rest.as_bytes()).await.expect("sent");
    assert_served(&mut slow, "the slow client once its head is whole").await;
    assert_eq!(t.balance(&account).await.0, 5);
    t.shutdown().await;
}

/// A deposit of `cents` whose client sends all but the last bytes of its body and then
/// stalls: returns its connection and the bytes still to send, once its handler is running.
async fn stalled_deposit(
    t: &TestApp,
    account: &impl std::fmt::Display,
    cents: i64,
) -> (TcpStream, String) {
    let post = raw_deposit(account, &format!(r#"{{"amountCents":{cents}}}"#));
    let (head_and_some, rest) = post.split_at(post.len() - 4);
    let mut slow = TcpStream::connect(t.addr).await.expect("connect");
    slow.write_all(head_and_some.as_bytes())
        .await
        .expect("sent");
    wait_for_gauge(&t.app.metrics.http_in_flight, 1).await;
    (slow, rest.to_string())
}

/// Sends the rest of a stalled deposit's body; it is then served.
async fn finish_stalled(mut slow: TcpStream, rest: &str) {
    slow.write_all(rest.as_bytes()).await.expect("sent");
    assert_served(&mut slow, "the slow client once its body is whole").await;
}

/// Rule: a handler waiting for the rest of its body gives its slot back for the wait, so a
/// slow body cannot block the other connections either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_holds_no_gate_slot() {
    let t = one_slot_gate().await;
    let account = new_account();
    let (slow, rest) = stalled_deposit(&t, &account, 7).await;
    // Its handler is running, waiting for the body's last bytes without a slot.
    wait_for_gauge(&t.app.metrics.http_gate_active, 0).await;
    another_client_is_served(&t).await;
    finish_stalled(slow, &rest).await;
    assert_eq!(t.balance(&account).await.0, 7);
    t.shutdown().await;
}

/// Rule: a handler waiting for the rest of its body gives its in-flight slot back for the
/// wait too: clients trickling their bodies cannot hold `--max-concurrent-requests` against
/// every other API request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_holds_no_in_flight_slot() {
    let t = one_in_flight_slot(&[]).await;
    let account = new_account();
    // Its handler is running, admitted, waiting for the body's last bytes: the other
    // request gets the only slot (before the fix it waited out its 10 s and was shed).
    let (slow, rest) = stalled_deposit(&t, &account, 9).await;
    another_client_is_served(&t).await;
    finish_stalled(slow, &rest).await;
    assert_eq!(t.balance(&account).await.0, 9);
    t.shutdown().await;
}

/// Rule: a probe or a scrape never waits at the gate: a replica at its limit still answers
/// its load balancer and its monitoring, while an API request waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_or_scrape_never_waits_at_the_gate() {
    let t = one_slot_gate().await;
    let m = t.app.metrics.clone();
    let account = new_account();
    let (hold, mut holder) = hold_a_deposit(&t, &account).await;
    let mut api = TcpStream::connect(t.addr).await.expect("connect");
    let balance =
        format!("GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: localhost\r\n\r\n");
    api.write_all(balance.as_bytes()).await.expect("sent");
    wait_for_gauge(&m.http_gate_waiting, 1).await;
    for path in ["/healthz", "/readyz", "/metrics"] {
        let mut probe = TcpStream::connect(t.addr).await.expect("connect");
        let answer = tokio::time::timeout(BOUND, raw_get(&mut probe, path))
            .await
            .unwrap_or_else(|_| panic!("{path} answered while the gate is full"));
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    assert_eq!(m.http_gate_waiting.get(), 1, "the API request still waits");
    hold.release();
    assert_served(&mut holder, "the held deposit").await;
    assert_served(&mut api, "the waiting balance read").await;
    t.shutdown().await;
}

/// A replica with one gate slot and one in-flight slot, waits of `queue_wait_ms`, and the
/// fault injector (for [`hold_a_deposit`]).
async fn one_slot_in_all(queue_wait_ms: u64) -> TestApp {
    let wait = queue_wait_ms.to_string();
    spawn(
        test_config(&[
            "--min-active-requests",
            "1",
            "--max-active-requests",
            "1",
            "--max-concurrent-requests",
            "1",
            "--max-queue-wait-ms",
            &wait,
            "--faults",
            "seed=1",
        ]),
        None,
        None,
    )
    .await
}

/// Rule: a request waits for a gate slot at most `--max-queue-wait-ms`; then it is read
/// without one and meets the in-flight limit, which sheds it with 503 and Retry-After
/// instead of leaving its client hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_gate_wait_runs_out_is_read_and_shed() {
    let t = one_slot_in_all(50).await;
    let account = new_account();
    let (hold, mut holder) = hold_a_deposit(&t, &account).await;
    let r = t.deposit(&account, 2, Some("late-1")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    let m = t.get("/metrics").await.text;
    assert_eq!(metric_sum(&m, "tally_http_gate_waits_expired_total"), 1.0);
    assert_eq!(metric_sum(&m, "tally_http_requests_shed_total"), 1.0);
    hold.release();
    assert_served(&mut holder, "the held deposit").await;
    assert_eq!(
        t.balance(&account).await.0,
        1,
        "the shed deposit wrote nothing"
    );
    t.shutdown().await;
}

/// Rule 2 of the gate, its other bound: hyper's head-read timer (10 s) runs from when a
/// connection went idle, not from when its next request arrived. A request arriving later
/// in that idle time than a full gate wait allows is read at once without a slot (and
/// answered by the in-flight limit behind the gate), never cut off unanswered when the
/// timer fires mid-wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_late_in_its_connections_idle_time_is_answered_not_cut_off() {
    // Capped at half the head-read timeout: 5 s.
    let t = one_slot_in_all(10_000).await;
    let account = new_account();
    let mut late = TcpStream::connect(t.addr).await.expect("connect");
    assert!(
        raw_get(&mut late, "/api/accounts")
            .await
            .starts_with("HTTP/1.1 200")
    );
    let went_idle = tokio::time::Instant::now();
    let (hold, holder) = hold_a_deposit(&t, &account).await;
    // The scenario itself, not a wait for a signal: 6 s of idleness leave the head-read
    // timer 4 s, less than the 5 s the gate would keep this request waiting.
    tokio::time::sleep_until(went_idle + Duration::from_secs(6)).await;
    let expired = t.app.metrics.http_gate_waits_expired.get();
    let path = format!("/api/accounts/{account}/balance");
    let head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    late.write_all(head.as_bytes()).await.expect("sent");
    let answer = tokio::time::timeout(BOUND, read_response(&mut late))
        .await
        .expect("answered within the bound");
    // Served or shed by what stands behind the gate: either way an answer.
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 503"),
        "{answer}"
    );
    assert_eq!(
        t.app.metrics.http_gate_waits_expired.get(),
        expired + 1,
        "read without a slot, counted as a wait that could not run"
    );
    // Held past its write's life, its answer is a retryable refusal: not what this pins.
    hold.release();
    drop(holder);
    t.shutdown().await;
}

/// Rule: the admin listener's connections obey `--write-stall-secs` too: a client that
/// pipelines scrapes and reads none of the answers is closed at the limit instead of
/// holding one of the few admin connections for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_connection_whose_client_reads_nothing_is_closed_at_the_write_stall_limit() {
    let t = short_stall_replica().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let admin = listener.local_addr().expect("addr");
    let server = tokio::spawn(tally::http::serve_admin(
        t.app.clone(),
        listener,
        std::future::pending(),
    ));
    let mut deaf = small_window_connection(admin).await;
    let scrape = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n".repeat(2_000);
    let (mut reader, mut writer) = deaf.split();
    // Ends when the server has read everything, or fails when it closes the stalled
    // connection with requests still unread.
    let _ = writer.write_all(scrape.as_bytes()).await;
    let got = read_after_stall(&t, &mut reader).await;
    let answered = String::from_utf8_lossy(&got)
        .matches("HTTP/1.1 200")
        .count();
    assert!(answered < 2_000, "every scrape was answered");
    server.abort();
    t.shutdown().await;
}

/// Rule: a request waiting for an in-flight slot whose client has gone leaves the queue at
/// once, unanswered (nothing was done for it). The server reads nothing mid-request (a
/// client that half-closes after its request is answered), so the wait watches its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_leaves_while_it_waits_for_admission_leaves_the_queue() {
    let t = one_in_flight_slot(&["--faults", "seed=1"]).await;
    let account = new_account();
    let (hold, mut holder) = hold_a_deposit(&t, &account).await;
    let m = t.app.metrics.clone();
    let mut waiting = TcpStream::connect(t.addr).await.expect("connect");
    let head = format!("GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: localhost\r\n\r\n");
    waiting.write_all(head.as_bytes()).await.expect("sent");
    wait_for(|| m.http_queued.get() == 1, "the request queued").await;
    drop(waiting);
    wait_for(
        || m.http_queued.get() == 0 && m.http_shed.get() == 1,
        "the request left the queue",
    )
    .await;
    hold.release();
    assert_served(&mut holder, "the held deposit").await;
    t.shutdown().await;
}
