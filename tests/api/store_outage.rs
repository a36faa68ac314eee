//! A store outage as a caller and an operator see it, on a real Celeriant server SIGKILLed
//! under the real `tally` binary: writes and reads answer 503 `STORE_UNAVAILABLE` with
//! `Retry-After`, a write stops retrying once the replica knows the store is gone, the log
//! has one WARN when the store is lost and one INFO when it is back, and a write retried
//! after the restart lands exactly once.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::binary::Server;
use crate::common::{self, new_account, required};

/// The variable naming the Celeriant server binary (`scripts/with-celeriant.sh` sets it), so
/// a test can start, kill and restart a server of its own.
const CELERIANT_SERVER_BIN: &str = "CELERIANT_SERVER_BIN";
/// How long a server may take to accept connections, or the replica to answer ready.
const READY_BOUND: Duration = Duration::from_secs(30);
/// Pause between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// A standalone Celeriant server of this test's own, on fixed ports so that it can be
/// restarted in place with its data.
struct Celeriant {
    bin: String,
    data: PathBuf,
    client_port: u16,
    replication_port: u16,
    child: Option<Child>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Celeriant {
    fn start(bin: String) -> Celeriant {
        let data = std::env::temp_dir().join(format!("tally-outage-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&data).expect("data dir");
        let mut server = Celeriant {
            bin,
            data,
            client_port: free_port(),
            replication_port: free_port(),
            child: None,
        };
        server.run();
        server
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Starts the process on this server's ports and data, and waits until it accepts.
    fn run(&mut self) {
        let child = Command::new(&self.bin)
            .env("CELERIANT_METRICS_ENABLED", "false")
            .args(["--standalone", "--routing-rule", "aggregate_type_id"])
            .args(["--listen-address", "127.0.0.1"])
            .arg("--data-root")
            .arg(&self.data)
            .args(["--client-port", &self.client_port.to_string()])
            .args(["--replication-port", &self.replication_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("celeriant starts");
        self.child = Some(child);
        let deadline = Instant::now() + READY_BOUND;
        while std::net::TcpStream::connect(self.address()).is_err() {
            assert!(
                Instant::now() < deadline,
                "celeriant did not accept in time"
            );
            std::thread::sleep(PROBE_INTERVAL);
        }
    }

    fn sigkill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }
}

impl Drop for Celeriant {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// One answer: status, `Retry-After`, the JSON body.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
}

async fn send(req: reqwest::RequestBuilder) -> Answer {
    let resp = req.send().await.expect("tally answers");
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = resp.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        retry_after,
        body,
    }
}

async fn deposit(http: &reqwest::Client, tally: &Server, account: &str, key: &str) -> Answer {
    send(
        http.post(tally.url(&format!("/api/accounts/{account}/deposit")))
            .header("idempotency-key", key)
            .json(&json!({"amountCents": 100})),
    )
    .await
}

async fn wait_ready(http: &reqwest::Client, tally: &Server) {
    let base = tally.url("");
    common::wait_ready(http, &[base.as_str()], READY_BOUND, PROBE_INTERVAL).await;
}

/// The newest `served` line of the deposit route.
fn last_served_deposit(tally: &Server) -> Value {
    tally
        .log()
        .iter()
        .rev()
        .find(|v| {
            v["fields"]["message"] == "served"
                && v["fields"]["route"] == "/api/accounts/{id}/deposit"
        })
        .map(|v| v["fields"].clone())
        .expect("a served line for the deposit")
}

fn lines_at(tally: &Server, from: usize, level: &str, message_part: &str) -> usize {
    tally.log()[from..]
        .iter()
        .filter(|v| {
            v["level"] == level
                && v["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(message_part))
        })
        .count()
}

/// Rule: a store that cannot be reached is a 503 `STORE_UNAVAILABLE` with `Retry-After`, for
/// writes and reads alike, never a 409; once the replica knows the store is gone a write
/// answers after one attempt; the outage is logged once as a WARN and its end once as an
/// INFO; and the same key sent after the restart lands exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_a_503_logged_once_and_a_retry_after_it_lands_once() {
    let Some(bin) = required::var(
        CELERIANT_SERVER_BIN,
        "run through scripts/with-celeriant.sh",
    ) else {
        return;
    };
    let mut store = Celeriant::start(bin);
    let address = store.address();
    let mut tally =
        Server::start_unseeded(&["--store", "celeriant", "--celeriant-address", &address]);
    let http = reqwest::Client::new();
    wait_ready(&http, &tally).await;
    let account = new_account();
    assert_eq!(
        deposit(&http, &tally, &account, "before-the-outage")
            .await
            .status,
        200
    );
    tally.drain_log(Duration::from_millis(300));
    let before = tally.log().len();

    store.sigkill();
    let started = Instant::now();
    // The first write after the loss may ride out a blip with its usual retries; it ends as
    // the outage, not as a conflict.
    let first = deposit(&http, &tally, &account, "outage-1").await;
    assert_eq!(
        (first.status, first.body["error"].as_str()),
        (503, Some("STORE_UNAVAILABLE")),
        "{}",
        first.body
    );
    assert!(first.retry_after.is_some(), "Retry-After on {}", first.body);
    eprintln!(
        "the first write after the loss answered in {:?}",
        started.elapsed()
    );
    // The replica knows by now (its first answer took at least the grace): the next write
    // answers after one attempt.
    let started = Instant::now();
    let second = deposit(&http, &tally, &account, "outage-2").await;
    let took = started.elapsed();
    assert_eq!(
        (second.status, second.body["error"].as_str()),
        (503, Some("STORE_UNAVAILABLE")),
        "{}",
        second.body
    );
    let message = second.body["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains("127.0.0.1"),
        "the answer names no node: {message}"
    );
    let ready = send(http.get(tally.url("/readyz"))).await;
    assert_eq!(
        (ready.status, ready.body["status"].as_str()),
        (503, Some("storeUnreachable")),
        "{}",
        ready.body
    );
    let said = ready.body["message"].as_str().unwrap_or_default();
    assert!(
        !said.contains("127.0.0.1") && !said.contains("os error"),
        "an open probe names no node: {said}"
    );
    let read = send(http.get(tally.url(&format!("/api/accounts/{account}/balance")))).await;
    assert_eq!(
        (read.status, read.body["error"].as_str()),
        (503, Some("STORE_UNAVAILABLE")),
        "{}",
        read.body
    );
    assert!(read.retry_after.is_some());
    tally.drain_log(Duration::from_millis(300));
    let served = last_served_deposit(&tally);
    assert_eq!(served["status"], 503, "{served}");
    assert_eq!(
        served["attempts"], 1,
        "a write against a store known lost: {served}"
    );
    eprintln!("a write during the outage answered in {took:?}");

    store.run();
    wait_ready(&http, &tally).await;
    let landed = deposit(&http, &tally, &account, "outage-2").await;
    assert_eq!(landed.status, 200, "{}", landed.body);
    let again = deposit(&http, &tally, &account, "outage-2").await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body, landed.body, "the retry replays the landing");
    let history = send(http.get(tally.url(&format!("/api/accounts/{account}/history")))).await;
    let events = history.body["events"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        events.len(),
        2,
        "one deposit before, one after: {}",
        history.body
    );

    tally.drain_log(Duration::from_millis(300));
    let outage = &tally.log()[before..];
    assert_eq!(
        lines_at(&tally, before, "WARN", "lost the event store"),
        1,
        "{outage:#?}"
    );
    assert_eq!(
        lines_at(&tally, before, "INFO", "the event store answers again"),
        1,
        "{outage:#?}"
    );
    // No line per request: the outage's only WARN is the one above.
    let warns = outage.iter().filter(|v| v["level"] == "WARN").count();
    assert_eq!(warns, 1, "{outage:#?}");
}
