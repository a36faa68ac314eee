//! The real `tally-device` binary, killed between every pair of steps (record, send, ack,
//! mark synced), against a tiny in-test HTTP server that calls the service-side core over a
//! `MemoryLog`. Whatever the crash, nothing recorded is lost and nothing lands twice.
//!
//! Crashes come from `TALLY_DEVICE_CRASH_AT` (the binary aborts at the named step) and, for
//! the gap between the server applying a run and the device reading the answer, from a
//! SIGKILL sent while the server holds its answer back.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Output, Stdio};
use std::sync::Arc;

use crate::test_dir::TestDir;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tally::account::{AccountEvent, AccountId, Identity};
use tally::device::error::DeviceSyncError;
use tally::device::ingest::DeviceSync;
use tally::device::protocol::SyncRequest;
use tally::store::memory::MemoryLog;
use tally::store::{ReadFilter, SharedLog};
use tally_device::crash::CRASH_ENV;
use tokio::sync::oneshot;

const BIN: &str = env!("CARGO_BIN_EXE_tally-device");
const ACCOUNT_A: &str = "00000000-0000-0000-0000-00000000000a";
const ACCOUNT_B: &str = "00000000-0000-0000-0000-00000000000b";
/// Largest request body the test server reads.
const MAX_BODY: usize = 1 << 20;

/// Holds the next answer back: signals once the run is applied, answers once released.
struct Pause {
    applied: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

struct Server {
    addr: SocketAddr,
    memory: Arc<MemoryLog>,
    pause: Arc<Mutex<Option<Pause>>>,
}

fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp
}

/// The route as the lead will wire it: parsed body in, typed result mapped to a status.
async fn handle(
    core: &DeviceSync,
    pause: &Mutex<Option<Pause>>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let device = path
        .strip_prefix("/api/devices/")
        .and_then(|rest| rest.strip_suffix("/sync"))
        .map(str::to_owned);
    let Some(device) = device else {
        return json_response(StatusCode::NOT_FOUND, &json!({"error": "NOT_FOUND"}));
    };
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return json_response(StatusCode::BAD_REQUEST, &json!({"error": "BAD_BODY"})),
    };
    let parsed: SyncRequest = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": "INVALID_JSON", "message": e.to_string()}),
            );
        }
    };
    let result = core.handle(&device, &parsed).await;
    let held = pause.lock().take();
    if let Some(p) = held {
        let _ = p.applied.send(());
        let _ = p.release.await;
    }
    match result {
        Ok(answer) => json_response(StatusCode::OK, &serde_json::to_value(answer).unwrap()),
        Err(e) => {
            let status = match &e {
                e if e.is_invalid_request() => StatusCode::UNPROCESSABLE_ENTITY,
                DeviceSyncError::RunStraddlesMark { .. } | DeviceSyncError::Store(_) => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            json_response(
                status,
                &json!({"error": e.code(), "message": e.to_string()}),
            )
        }
    }
}

async fn serve() -> Server {
    let memory = Arc::new(MemoryLog::new());
    let core = DeviceSync::new(memory.clone() as SharedLog, Identity::default());
    let pause: Arc<Mutex<Option<Pause>>> = Arc::new(Mutex::new(None));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shared = pause.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (core, pause) = (core.clone(), shared.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let (core, pause) = (core.clone(), pause.clone());
                    async move { Ok::<_, std::convert::Infallible>(handle(&core, &pause, req).await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Server {
        addr,
        memory,
        pause,
    }
}

/// One device: its outbox, the server, and what it has recorded.
struct Device {
    dir: TestDir,
    server: Server,
    recorded: BTreeMap<&'static str, Vec<(u64, &'static str, i64)>>,
}

impl Device {
    fn command(&self, args: &[&str], crash: Option<&str>) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.arg("--outbox")
            .arg(self.dir.join("outbox.sqlite"))
            .args(args)
            .env_remove(CRASH_ENV)
            .env_remove("TALLY_DEVICE_OUTBOX")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(step) = crash {
            cmd.env(CRASH_ENV, step);
        }
        cmd
    }

    async fn run(&self, args: &[&str], crash: Option<&str>) -> Output {
        self.command(args, crash).output().await.unwrap()
    }

    fn sync_args(&self) -> Vec<String> {
        [
            "sync",
            "--server",
            &format!("http://{}", self.server.addr),
            "--batch-size",
            "2",
            "--max-attempts",
            "3",
            "--timeout-ms",
            "5000",
            "--jitter-seed",
            "1",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn sync(&self, crash: Option<&str>) -> Output {
        let args = self.sync_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(&args, crash).await
    }

    async fn record(&mut self, account: &'static str, kind: &'static str, cents: i64) {
        let out = self
            .run(&["record", kind, account, &cents.to_string()], None)
            .await;
        assert!(out.status.success(), "record failed: {}", text(&out));
        let list = self.recorded.entry(account).or_default();
        list.push((list.len() as u64 + 1, kind, cents));
    }

    async fn status(&self) -> Value {
        let out = self.run(&["status", "--json"], None).await;
        assert!(out.status.success(), "status failed: {}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The invariant: the store holds a prefix of each account's recorded events, each once,
    /// in order; nothing is marked synced beyond it. `complete`: all landed and synced.
    async fn check(&self, complete: bool) {
        let status = self.status().await;
        let device: uuid::Uuid = status["deviceId"].as_str().unwrap().parse().unwrap();
        for (account, want) in &self.recorded {
            let key = Identity::default().key(account.parse::<AccountId>().unwrap());
            let filter = ReadFilter {
                include_client_id: Some(device.as_u128()),
                ..ReadFilter::from_version(1)
            };
            let got: Vec<(u64, &'static str, i64)> = match self.server.memory.read_now(key, &filter)
            {
                Ok(page) => page
                    .batches
                    .iter()
                    .flat_map(|b| b.events.iter())
                    .map(
                        |e| match AccountEvent::decode(e.event_type, &e.payload).unwrap() {
                            AccountEvent::Deposited { amount } => (e.client_seq, "deposit", amount),
                            AccountEvent::Withdrawn { amount } => {
                                (e.client_seq, "withdraw", amount)
                            }
                            other => panic!("unexpected {other:?}"),
                        },
                    )
                    .collect(),
                Err(_) => Vec::new(),
            };
            assert!(
                got.len() <= want.len() && got[..] == want[..got.len()],
                "{account}: store {got:?} is not a prefix of recorded {want:?}"
            );
            let acct = status["accounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["account"] == *account)
                .unwrap();
            let synced = acct["synced"].as_u64().unwrap() as usize;
            assert!(
                synced <= got.len(),
                "{account}: {synced} synced, {got:?} landed"
            );
            if complete {
                assert_eq!(got, *want, "{account}: not everything landed once");
                assert_eq!(synced, want.len());
            }
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether the process died at the crash point (aborted), rather than finishing.
fn crashed(out: &Output) -> bool {
    !out.status.success() && out.status.code().is_none()
}

async fn device(name: &str) -> Device {
    let d = Device {
        dir: TestDir::new(&format!("device-cli-{name}")),
        server: serve().await,
        recorded: BTreeMap::new(),
    };
    let out = d.run(&["init"], None).await;
    assert!(out.status.success(), "init failed: {}", text(&out));
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_device_between_any_two_steps_loses_nothing_and_lands_nothing_twice() {
    let mut d = device("crash").await;

    // Between record and commit: nothing recorded, and the next record takes sequence 1.
    let out = d
        .run(
            &["record", "deposit", ACCOUNT_A, "500"],
            Some("record-before-commit"),
        )
        .await;
    assert!(crashed(&out), "expected an abort: {}", text(&out));
    assert_eq!(d.status().await["pending"], 0);
    // Between commit and the operator being told: the event is kept.
    let out = d
        .run(
            &["record", "deposit", ACCOUNT_A, "700"],
            Some("record-committed"),
        )
        .await;
    assert!(crashed(&out), "expected an abort: {}", text(&out));
    d.recorded
        .entry(ACCOUNT_A)
        .or_default()
        .push((1, "deposit", 700));
    d.record(ACCOUNT_A, "withdraw", 200).await;
    d.record(ACCOUNT_B, "deposit", 50).await;
    d.record(ACCOUNT_A, "deposit", 300).await;
    d.check(false).await;

    // Each sync crash point, each followed by more records so runs keep their boundaries.
    let mut cents = 10;
    for step in [
        "run-persisted",
        "acked",
        "marked-synced",
        "acked@2",
        "run-persisted@2",
    ] {
        let out = d.sync(Some(step)).await;
        assert!(crashed(&out), "{step}: expected an abort: {}", text(&out));
        d.check(false).await;
        cents += 1;
        d.record(ACCOUNT_B, "deposit", cents).await;
        d.record(ACCOUNT_A, "withdraw", cents).await;
    }

    // Between send and ack: the server applied the run; the device is killed before the
    // answer reaches it.
    let (applied_tx, applied_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    *d.server.pause.lock() = Some(Pause {
        applied: applied_tx,
        release: release_rx,
    });
    let args = d.sync_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = d.command(&args, None).spawn().unwrap();
    applied_rx.await.expect("the server applied a run");
    child.kill().await.unwrap();
    let _ = release_tx.send(());
    d.check(false).await;
    let before = d.status().await;
    assert!(before["inFlight"].as_u64().unwrap() > 0, "{before}");

    // A clean sync resends what was in flight, is told it is already synced, and lands the
    // rest: everything exactly once.
    let out = d.sync(None).await;
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("(0 found already synced)"), "{stdout}");
    d.check(true).await;
    let after = d.status().await;
    assert_eq!(
        (after["pending"].as_u64(), after["inFlight"].as_u64()),
        (Some(0), Some(0))
    );
}

#[tokio::test]
async fn a_sync_with_the_server_down_stops_with_the_queue_intact() {
    let mut d = device("down").await;
    d.record(ACCOUNT_A, "deposit", 5).await;
    // A port nobody listens on: bind, read the port, close.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = d
        .run(
            &[
                "sync",
                "--server",
                &format!("http://{closed}"),
                "--max-attempts",
                "2",
                "--jitter-seed",
                "3",
            ],
            None,
        )
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("gave up after 2 attempts"), "{stderr}");
    // It names where it sent the run, and why that failed.
    let tried = format!("POST http://{closed}/api/devices/");
    assert!(stderr.contains(&tried), "names {tried}: {stderr}");
    assert!(
        stderr.to_ascii_lowercase().contains("connection refused"),
        "{stderr}"
    );
    let status = d.status().await;
    assert_eq!(status["inFlight"], 1);
    assert_eq!(status["accounts"][0]["runAttempts"], 2);
    // Back online: the same run lands.
    let out = d.sync(None).await;
    assert!(out.status.success(), "{}", text(&out));
    d.check(true).await;
}

#[tokio::test]
async fn the_cli_refuses_transfers_and_bad_input_and_records_nothing() {
    let d = device("input").await;
    for args in [
        vec!["record", "transfer", ACCOUNT_A, "5"],
        vec!["record", "deposit", ACCOUNT_A, "0"],
        vec!["record", "deposit", ACCOUNT_A, "1.5"],
        vec!["record", "withdraw", "not-an-account", "5"],
        vec!["record", "refund", ACCOUNT_A, "5"],
    ] {
        let out = d.run(&args, None).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    }
    // The refusal of a transfer is one short sentence that says where transfers go.
    let out = d.run(&["record", "transfer", ACCOUNT_A, "5"], None).await;
    let refusal = String::from_utf8_lossy(&out.stderr);
    let refusal = refusal.trim_end();
    assert!(
        refusal.contains("transfers are not recorded offline")
            && refusal.contains("POST /api/transfers"),
        "{refusal}"
    );
    assert!(
        !refusal.contains('\n') && refusal.split_whitespace().count() <= 18,
        "one short line: {refusal}"
    );
    // A negative amount is refused by the amount rule, not taken for an unknown flag.
    let out = d.run(&["record", "deposit", ACCOUNT_A, "-5"], None).await;
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("must be an integer from 1 to 2147483647, got -5"),
        "{said}"
    );
    assert_eq!(d.status().await["pending"], 0);

    let elsewhere = TestDir::new("device-cli-uninitialised");
    let out = tokio::process::Command::new(BIN)
        .arg("--outbox")
        .arg(elsewhere.join("none.sqlite"))
        .args(["record", "deposit", ACCOUNT_A, "5"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tally-device init"));
    assert!(
        !elsewhere.join("none.sqlite").exists(),
        "no outbox is created implicitly"
    );
}

/// Rule: output cut short by its reader (`tally-device status | head -1`) ends the program
/// quietly with success, never with a panic. The pipe's reading end is closed before the
/// program starts, so its first write meets a closed pipe.
#[tokio::test]
async fn a_reader_that_goes_away_ends_the_output_quietly() {
    let mut d = device("pipe").await;
    d.record(ACCOUNT_A, "deposit", 5).await;
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let mut cmd = d.command(&["status"], None);
    cmd.stdout(writer);
    // Not `output()`, which would pipe stdout again.
    let child = cmd.spawn().expect("started");
    drop(cmd);
    let out = child.wait_with_output().await.expect("ran");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
