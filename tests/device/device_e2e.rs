//! Device sync end to end, with two real processes: a `tally` replica (seeded store faults) and
//! the `tally-device` binary recording offline and syncing against it.
//!
//! Each scenario runs twice: module `memory` on the embedded store, and module `celeriant` on
//! the real server `CELERIANT_ADDRESS` names (unset, each test says it skipped, or fails under
//! `CI=true`: `common::required`). Celeriant gets the same fault spec: the injector wraps
//! the store, so a lost ack there is a write that really landed in the durable log, and the
//! device's resend must then be recognised by the server's real client idempotency. That
//! store is durable and shared across runs, and seeds no demo accounts by default, so there
//! every account is a fresh uuid, funded online with the demo account's opening balance.
//!
//! What it pins: every recorded event lands once, in recorded order, and shows in history,
//! balance and metrics like any other event; device events never raise Tally's own client
//! sequence (an ordinary keyed deposit afterwards still lands and replays); a device may take
//! an account below zero offline, and the online rules then refuse a withdrawal.
//!
//! The faults make the replica lose acks and requests, refuse writes, hold writes in flight
//! and serve lagging reads. The seed is fixed and printed; `TALLY_E2E_SEED` overrides it to
//! reproduce or explore. Both processes are real, so thread scheduling still varies a little
//! between runs: the assertions hold for any interleaving.
//!
//! `tally-device` is a package of its own in this workspace (`crates/tally-device`), so cargo
//! gives this suite no `CARGO_BIN_EXE_` for it: the binary is taken from beside `tally`
//! ([`device_bin`]). `cargo test --workspace` builds both before any test runs; run alone,
//! this suite needs `cargo build --locked -p tally-device` first, and refuses a missing or
//! stale binary rather than test an old device.

use crate::common;

use common::test_dir::TestDir;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Reply, assert_error, metric_sample, metric_sum};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::{AccountEvent, AccountId, AmountCents, Operation};
use tally::config::{DEMO_ACCOUNTS, demo_account_id};
use tally::device::DeviceId;
use tally::device::ingest::store_event_id;
use tally::device::run::RunEvent;
use uuid::Uuid;

const TALLY: &str = env!("CARGO_BIN_EXE_tally");
/// The store faults; the seed is appended per test.
const FAULTS: &str = "lost-ack=0.2,lost-request=0.1,refused=0.1,inflight=0.1,read-lag=0.2";
/// The seed used unless `TALLY_E2E_SEED` names another.
const DEFAULT_SEED: u64 = 1515;
/// How long the replica may take to print its listening line.
const START_BOUND: Duration = Duration::from_secs(20);
/// Readiness probes before the replica counts as never ready, and the pause between them.
const READY_PROBES: u32 = 200;
const READY_PROBE_INTERVAL: Duration = Duration::from_millis(25);
/// `tally-device sync` runs before the test gives up: each exits 1 when the injected faults
/// outlast its attempts, keeping its queue, and the next one resumes.
const SYNC_RUNS: u32 = 8;
/// Sends of one run within one `sync`, and the time allowed for each.
const SYNC_ATTEMPTS: &str = "6";
const SYNC_TIMEOUT_MS: &str = "5000";
/// Tries of one HTTP call the replica answers "retry" (503, 409, 429) under the faults, and
/// the pause between them (the answer's own Retry-After is a second: too slow for a test).
const HTTP_TRIES: u32 = 40;
const HTTP_RETRY_PAUSE: Duration = Duration::from_millis(20);
/// Any one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// History page size: small, so that following `nextFromVersion` is exercised.
const HISTORY_PAGE: u64 = 2;
/// Most history pages read for one account before the read counts as runaway.
const MAX_HISTORY_PAGES: usize = 500;
/// Log lines of the replica shown when a test fails.
const LOG_TAIL_LINES: usize = 30;

/// The `tally-device` binary beside `tally` in the same target directory. Refused when it is
/// missing, or older than a source it is built from (the device crate's, or the `tally`
/// library's): the suite would otherwise test an old device against a new server.
fn device_bin() -> PathBuf {
    let bin =
        Path::new(TALLY).with_file_name(format!("tally-device{}", std::env::consts::EXE_SUFFIX));
    let build =
        "build it with `cargo build --locked -p tally-device` (or run `cargo test --workspace`)";
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("no tally-device binary at {}: {e}; {build}", bin.display()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut newest = None;
    newest_source(&root.join("crates/tally-device/src"), &mut newest);
    newest_source(&root.join("src"), &mut newest);
    if let Some((changed, path)) = newest
        && changed > built
    {
        panic!(
            "{} is older than {}: {build}",
            bin.display(),
            path.display()
        );
    }
    bin
}

/// The most recently modified `.rs` file under `dir`, leaving out the sources of the `tally`
/// package's own binaries (`src/main.rs`, `src/bin/`), which `tally-device` does not link.
fn newest_source(dir: &Path, newest: &mut Option<(std::time::SystemTime, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let tally_src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for entry in entries.flatten() {
        let path = entry.path();
        if path == tally_src.join("main.rs") || path == tally_src.join("bin") {
            continue;
        }
        if path.is_dir() {
            newest_source(&path, newest);
        } else if path.extension().is_some_and(|e| e == "rs")
            && let Ok(changed) = entry.metadata().and_then(|m| m.modified())
            && newest.as_ref().is_none_or(|(t, _)| changed > *t)
        {
            *newest = Some((changed, path));
        }
    }
}

fn seed(offset: u64) -> u64 {
    let base = std::env::var("TALLY_E2E_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    base.wrapping_add(offset)
}

// --- The store behind the replica ------------------------------------------------------------

/// The store the replica runs on.
enum Backend {
    /// The embedded store: fresh per replica, demo accounts seeded.
    Memory,
    /// The real server at this address: durable, shared across runs, no demo accounts.
    Celeriant(String),
}

/// The server `CELERIANT_ADDRESS` names, or `None` when it is unset (the test says it skipped;
/// under `CI=true` it fails instead).
fn celeriant() -> Option<Backend> {
    common::required::celeriant_address().map(Backend::Celeriant)
}

/// Generates one test per scenario for each backend, named after the scenario.
macro_rules! on_each_backend {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Backend::Memory).await;
                }
            )*
        }

        mod celeriant {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    if let Some(backend) = super::celeriant() {
                        super::$scenario(backend).await;
                    }
                }
            )*
        }
    };
}

on_each_backend! {
    device_events_land_once_in_order_and_show_in_history_balance_and_metrics,
    an_offline_overdraft_lands_and_online_withdrawals_are_then_refused,
}

// --- The replica -----------------------------------------------------------------------------

/// A running `tally` child; killed and reaped on drop, so a failing test leaves nothing behind.
struct Replica {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    client: reqwest::Client,
}

impl Replica {
    /// Starts `tally` on `backend` on a port the kernel picks (read back from its listening
    /// line, so no other process can take it in between), then waits for /readyz 200.
    async fn start(backend: &Backend, seed: u64) -> Replica {
        Self::start_with(backend, seed, &[]).await
    }

    /// [`Replica::start`] with extra flags.
    async fn start_with(backend: &Backend, seed: u64, extra: &[&str]) -> Replica {
        let faults = format!("{FAULTS},seed={seed}");
        println!("replica faults: {faults} (TALLY_E2E_SEED reproduces the seed)");
        let mut cmd = Command::new(TALLY);
        for (name, _) in std::env::vars() {
            if name.starts_with("TALLY_") || name.starts_with("CELERIANT_") || name == "RUST_LOG" {
                cmd.env_remove(name);
            }
        }
        match backend {
            Backend::Memory => cmd.args(["--store", "memory"]),
            Backend::Celeriant(address) => {
                cmd.args(["--store", "celeriant", "--celeriant-address", address])
            }
        };
        let mut child = cmd
            .args(["--listen", "127.0.0.1:0"])
            .args(["--log-format", "json", "--faults", &faults])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("tally starts");
        let stdout = child.stdout.take().expect("stdout");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, listening) = mpsc::channel();
        let sink = Arc::clone(&log);
        // Drains stdout for the whole life of the child (a full pipe would stall it), and
        // hands over the listening line's address.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && v["fields"]["message"] == "tally listening"
                    && let Some(addr) = v["fields"]["addr"].as_str()
                {
                    let _ = tx.send(addr.to_owned());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .unwrap();
        let mut replica = Replica {
            child,
            addr: "0.0.0.0:0".parse().unwrap(),
            log,
            client,
        };
        let addr = match listening.recv_timeout(START_BOUND) {
            Ok(addr) => addr,
            Err(e) => replica.fail(&format!("no listening line within {START_BOUND:?}: {e}")),
        };
        replica.addr = addr.parse().expect("a socket address");
        replica.wait_ready().await;
        replica
    }

    async fn wait_ready(&self) {
        let mut last = String::new();
        for _ in 0..READY_PROBES {
            match self.client.get(self.url("/readyz")).send().await {
                Ok(r) if r.status() == StatusCode::OK => return,
                Ok(r) => last = format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(READY_PROBE_INTERVAL).await;
        }
        self.fail(&format!(
            "/readyz not 200 after {READY_PROBES} probes; last: {last}"
        ));
    }

    fn server(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Panics with the tail of the replica's log.
    fn fail(&self, why: &str) -> ! {
        let log = self.log.lock().unwrap();
        let tail = &log[log.len().saturating_sub(LOG_TAIL_LINES)..];
        panic!("{why}\nreplica log tail:\n{}", tail.join("\n"));
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        common::read(req.send().await.expect("the replica answers")).await
    }

    /// A request the replica may answer "retry" under the faults: resent, bounded, until the
    /// answer is final. Safe for reads, and for writes carrying an Idempotency-Key.
    async fn until_final(&self, make: impl Fn() -> reqwest::RequestBuilder) -> Reply {
        let mut last = None;
        for _ in 0..HTTP_TRIES {
            let r = self.send(make()).await;
            let retry = matches!(
                r.status,
                StatusCode::SERVICE_UNAVAILABLE
                    | StatusCode::CONFLICT
                    | StatusCode::TOO_MANY_REQUESTS
            );
            if !retry {
                return r;
            }
            last = Some(r);
            tokio::time::sleep(HTTP_RETRY_PAUSE).await;
        }
        self.fail(&format!(
            "still told to retry after {HTTP_TRIES} tries: {last:?}"
        ))
    }

    async fn get_ok(&self, path: &str) -> Value {
        let r = self.until_final(|| self.client.get(self.url(path))).await;
        if r.status != StatusCode::OK {
            self.fail(&format!("GET {path}: {} {}", r.status, r.text));
        }
        r.body
    }

    /// The balance once the replica shows at least `min_version` (`?minVersion`, the API's
    /// read-your-writes signal: a replica whose store read lags answers "retry", never stale).
    async fn balance(&self, account: Uuid, min_version: u64) -> i64 {
        let body = self
            .get_ok(&format!(
                "/api/accounts/{account}/balance?minVersion={min_version}"
            ))
            .await;
        body["balanceCents"].as_i64().expect("balanceCents")
    }

    /// Every event of the account's history, following `nextFromVersion` page by page.
    async fn history(&self, account: Uuid) -> Vec<Value> {
        let mut events = Vec::new();
        let mut from = 1u64;
        for _ in 0..MAX_HISTORY_PAGES {
            let page = self
                .get_ok(&format!(
                    "/api/accounts/{account}/history?fromVersion={from}&limit={HISTORY_PAGE}"
                ))
                .await;
            events.extend(page["events"].as_array().cloned().unwrap_or_default());
            match page["nextFromVersion"].as_u64() {
                Some(next) => {
                    assert!(next > from, "nextFromVersion {next} does not advance");
                    from = next;
                }
                None => return events,
            }
        }
        panic!("history of {account} runs past {MAX_HISTORY_PAGES} pages");
    }

    async fn metrics(&self) -> String {
        let r = self.send(self.client.get(self.url("/metrics"))).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        r.text
    }

    /// POSTs `{"amountCents": cents}` to the account's `op` endpoint with `key`, resending
    /// (with the same key) while the replica says retry.
    async fn keyed(&self, op: &str, account: Uuid, cents: i64, key: &str) -> Reply {
        let url = self.url(&format!("/api/accounts/{account}/{op}"));
        self.until_final(|| {
            self.client
                .post(&url)
                .header("Idempotency-Key", key)
                .json(&json!({ "amountCents": cents }))
        })
        .await
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // Our own child: killed by its id, then reaped.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// --- The device ------------------------------------------------------------------------------

/// A temporary directory for one device's outbox, removed unless the test failed.
/// One recorded event: the operation and the event id the device gave it.
#[derive(Clone, Debug)]
struct Recorded {
    seq: u64,
    operation: Operation,
    event_id: Uuid,
}

/// The `tally-device` binary over one outbox, and what it has recorded per account.
struct Device {
    dir: TestDir,
    id: DeviceId,
    recorded: BTreeMap<Uuid, Vec<Recorded>>,
}

impl Device {
    async fn init(name: &str) -> Device {
        let dir = TestDir::new(&format!("device-e2e-{name}"));
        let mut device = Device {
            dir,
            id: DeviceId(Uuid::nil()),
            recorded: BTreeMap::new(),
        };
        let out = device.run(&["init"]).await;
        assert!(out.status.success(), "init: {}", text(&out));
        let status = device.status().await;
        device.id = status["deviceId"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("status names the device id");
        device
    }

    async fn run(&self, args: &[&str]) -> Output {
        tokio::process::Command::new(device_bin())
            .arg("--outbox")
            .arg(self.dir.join("outbox.sqlite"))
            .args(args)
            .env_remove("TALLY_DEVICE_OUTBOX")
            .env_remove("TALLY_DEVICE_SERVER")
            .env_remove("TALLY_DEVICE_CRASH_AT")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .expect("tally-device runs")
    }

    /// Records offline (no server involved) and keeps the event id the device printed.
    async fn record(&mut self, kind: &str, account: Uuid, cents: i64) {
        let out = self
            .run(&["record", kind, &account.to_string(), &cents.to_string()])
            .await;
        assert!(out.status.success(), "record: {}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let event_id: Uuid = stdout
            .rsplit_once("(event ")
            .and_then(|(_, rest)| rest.split(')').next())
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("record prints the event id: {stdout}"));
        let id = AccountId(account);
        let amount = AmountCents::new(cents).expect("a positive amount");
        let operation = match kind {
            "deposit" => Operation::Deposit {
                account: id,
                amount,
            },
            _ => Operation::Withdraw {
                account: id,
                amount,
            },
        };
        let list = self.recorded.entry(account).or_default();
        let seq = list.len() as u64 + 1;
        assert!(
            stdout.contains(&format!("as sequence {seq} ")),
            "each account's sequences count from 1: {stdout}"
        );
        list.push(Recorded {
            seq,
            operation,
            event_id,
        });
    }

    /// Runs `sync` until one drains the outbox, bounded; a run that stops (exit 1) keeps its
    /// queue and the next resumes it. Any other exit is a failure.
    async fn sync(&self, replica: &Replica, jitter_seed: u64) -> u32 {
        self.sync_with(replica, jitter_seed, &[]).await
    }

    /// One `sync` against the replica, with extra flags.
    async fn sync_once(&self, replica: &Replica, jitter_seed: u64, extra: &[&str]) -> Output {
        let server = replica.server();
        let jitter = jitter_seed.to_string();
        let mut args = vec![
            "sync",
            "--server",
            &server,
            "--max-attempts",
            SYNC_ATTEMPTS,
            "--timeout-ms",
            SYNC_TIMEOUT_MS,
            "--jitter-seed",
            &jitter,
        ];
        args.extend_from_slice(extra);
        self.run(&args).await
    }

    /// [`Device::sync`] with extra flags.
    async fn sync_with(&self, replica: &Replica, jitter_seed: u64, extra: &[&str]) -> u32 {
        for run in 1..=SYNC_RUNS {
            let out = self.sync_once(replica, jitter_seed, extra).await;
            match out.status.code() {
                Some(0) => {
                    println!(
                        "sync run {run}: {}",
                        String::from_utf8_lossy(&out.stdout).trim()
                    );
                    return run;
                }
                Some(1) => println!("sync run {run} stopped, queue kept: {}", text(&out)),
                _ => replica.fail(&format!("sync run {run} failed: {}", text(&out))),
            }
        }
        replica.fail(&format!(
            "the outbox did not drain in {SYNC_RUNS} sync runs"
        ))
    }

    async fn status(&self) -> Value {
        let out = self.run(&["status", "--json"]).await;
        assert!(out.status.success(), "status: {}", text(&out));
        serde_json::from_slice(&out.stdout).expect("status --json is JSON")
    }

    /// The history entry (type, amount, event id) each recorded event must show as.
    fn expected_history(&self, account: Uuid) -> Vec<(String, i64, String)> {
        self.recorded[&account]
            .iter()
            .map(|r| {
                let event = match r.operation {
                    Operation::Deposit { amount, .. } => AccountEvent::Deposited {
                        amount: amount.get(),
                    },
                    Operation::Withdraw { amount, .. } => AccountEvent::Withdrawn {
                        amount: amount.get(),
                    },
                    _ => unreachable!("devices record deposits and withdrawals only"),
                };
                let run_event = RunEvent {
                    client_seq: r.seq,
                    operation: r.operation,
                    event_id: Some(r.event_id),
                    recorded_at_ms: None,
                };
                let id = Uuid::from_u128(store_event_id(self.id, AccountId(account), &run_event));
                (event.name().to_owned(), event.amount(), id.to_string())
            })
            .collect()
    }

    /// Deposits minus withdrawals recorded on the account.
    fn net(&self, account: Uuid) -> i64 {
        self.recorded[&account]
            .iter()
            .map(|r| match r.operation {
                Operation::Deposit { amount, .. } => amount.get(),
                Operation::Withdraw { amount, .. } => -amount.get(),
                _ => unreachable!("devices record deposits and withdrawals only"),
            })
            .sum()
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

/// The aggregate version of the newest history entry (0 for an empty history).
fn tip(history: &[Value]) -> u64 {
    history.last().map_or(0, |e| {
        e["aggregateVersion"].as_u64().expect("aggregateVersion")
    })
}

/// The history entries past `after` events as (type, amount, event id).
fn entries(history: &[Value], after: usize) -> Vec<(String, i64, String)> {
    history[after..]
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap_or("").to_owned(),
                e["amountCents"].as_i64().unwrap_or(i64::MIN),
                e["eventId"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn demo(name: &str) -> (Uuid, i64) {
    let (_, opening) = DEMO_ACCOUNTS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a demo account");
    (demo_account_id(name), *opening)
}

/// Asserts the replica lists the demo account under its UUIDv5 id.
async fn assert_listed(replica: &Replica, name: &str, id: Uuid) {
    let listed = replica.get_ok("/api/accounts").await;
    let found = listed["accounts"]
        .as_array()
        .expect("accounts")
        .iter()
        .any(|a| a["name"] == name && a["id"] == id.to_string());
    assert!(found, "{name} is listed as {id}: {listed}");
}

/// An account holding the demo account `name`'s opening balance at version 1: the seeded demo
/// account itself on the embedded store; on Celeriant (durable, shared across runs, unseeded)
/// a fresh uuid funded with one keyed deposit. Returns the id and the opening balance.
async fn opened(replica: &Replica, backend: &Backend, name: &str) -> (Uuid, i64) {
    let (demo_id, opening) = demo(name);
    let account = match backend {
        Backend::Memory => {
            assert_listed(replica, name, demo_id).await;
            demo_id
        }
        Backend::Celeriant(_) => {
            let account = Uuid::new_v4();
            println!("{name} stands in as fresh account {account}");
            let key = format!("e2e-open-{account}");
            let r = replica.keyed("deposit", account, opening, &key).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            assert_eq!(r.body["aggregateVersion"], 1, "{}", r.text);
            account
        }
    };
    // The account holds at least its opening (version 1); asking for it first makes the
    // history read next complete even when the store read lags.
    assert_eq!(replica.balance(account, 1).await, opening);
    (account, opening)
}

// --- The tests -------------------------------------------------------------------------------

async fn device_events_land_once_in_order_and_show_in_history_balance_and_metrics(
    backend: Backend,
) {
    let seed = seed(0);
    let replica = Replica::start(&backend, seed).await;
    let (alice, opening) = opened(&replica, &backend, "Alice").await;
    // A second account the device creates by syncing to it.
    let fresh = Uuid::new_v4();
    let before = replica.history(alice).await;

    let mut device = Device::init("history").await;
    for (kind, account, cents) in [
        ("deposit", alice, 1_250),
        ("withdraw", alice, 300),
        ("deposit", fresh, 5_000),
        ("withdraw", alice, 75),
        ("withdraw", fresh, 1_200),
        ("deposit", alice, 10_000),
        ("deposit", fresh, 40),
        ("withdraw", alice, 2_500),
    ] {
        device.record(kind, account, cents).await;
    }
    let runs = device.sync(&replica, seed).await;
    println!("synced in {runs} sync run(s)");

    // The outbox: nothing pending or in flight, every event synced, per account too.
    let status = device.status().await;
    assert_eq!(status["pending"], 0, "{status}");
    assert_eq!(status["inFlight"], 0, "{status}");
    assert_eq!(status["synced"], 8, "{status}");
    for (account, recorded) in &device.recorded {
        let a = status["accounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["account"] == account.to_string())
            .unwrap_or_else(|| panic!("{account} in status: {status}"));
        assert_eq!(a["synced"], recorded.len(), "{status}");
        assert_eq!(a["lastSeq"], recorded.len(), "{status}");
    }

    // Each account's events were all queued before the sync, so each went as one run, and a
    // run is one batch: the account's next version. Reading the balance at that version first
    // is the read-your-writes signal (store reads lag under the faults); history then follows
    // `nextFromVersion` to the fold's version.
    let balance = replica.balance(alice, tip(&before) + 1).await;
    assert_eq!(
        balance,
        opening + device.net(alice),
        "opening {opening} + deposits - withdrawals"
    );
    assert_eq!(replica.balance(fresh, 1).await, device.net(fresh));

    // History: exactly the recorded events, once each, in recorded order, after what the
    // account held before.
    let synced = replica.history(alice).await;
    assert_eq!(
        synced[..before.len()],
        before[..],
        "the events before the sync are untouched"
    );
    assert_eq!(
        entries(&synced, before.len()),
        device.expected_history(alice)
    );
    let created = replica.history(fresh).await;
    assert_eq!(entries(&created, 0), device.expected_history(fresh));

    // Metrics count the device's runs like any other traffic (one run per account at least;
    // a run whose ack was lost lands once and is answered already synced on its resend).
    let metrics = replica.metrics().await;
    println!(
        "device runs told to retry under the faults: {}",
        metric_sample(&metrics, r#"tally_device_sync_runs_total{outcome="retry"}"#)
    );
    assert!(metric_sum(&metrics, "tally_device_sync_runs_total") > 0.0);
    let landed = metric_sample(
        &metrics,
        r#"tally_device_sync_runs_total{outcome="synced"}"#,
    ) + metric_sample(
        &metrics,
        r#"tally_device_sync_runs_total{outcome="already_synced"}"#,
    );
    assert!(landed >= 2.0, "{metrics}");
    assert!(metric_sum(&metrics, "tally_device_sync_events_total") >= 8.0);

    // Tally's own client sequence is untouched by the device's 1, 2, 3...: a keyed deposit
    // lands once, and its retry is a replay of the same answer.
    let key = format!("e2e-after-device-{seed}-{alice}");
    let first = replica.keyed("deposit", alice, 777, &key).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(first.body["balanceCents"], balance + 777, "{}", first.text);
    let again = replica.keyed("deposit", alice, 777, &key).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(
        again.replayed(),
        "the retry is a replay: {:?}",
        again.headers
    );
    assert_eq!(again.body, first.body);
    let version = first.body["aggregateVersion"]
        .as_u64()
        .expect("aggregateVersion");
    assert_eq!(
        version,
        tip(&synced) + 1,
        "the next version after the device's"
    );
    assert_eq!(replica.balance(alice, version).await, balance + 777);
    let after = replica.history(alice).await;
    assert_eq!(after[..synced.len()], synced[..]);
    let added: Vec<_> = after[synced.len()..]
        .iter()
        .map(|e| (&e["type"], &e["amountCents"]))
        .collect();
    assert_eq!(added, [(&json!("Deposited"), &json!(777))], "landed once");
}

async fn an_offline_overdraft_lands_and_online_withdrawals_are_then_refused(backend: Backend) {
    let seed = seed(1);
    let replica = Replica::start(&backend, seed).await;
    let (charlie, opening) = opened(&replica, &backend, "Charlie").await;
    let before = replica.history(charlie).await;

    // Offline the device cannot know the balance: it records what it was asked to.
    let mut device = Device::init("overdraft").await;
    let overdraft = opening + 2_500;
    device.record("withdraw", charlie, overdraft).await;
    device.sync(&replica, seed).await;
    let status = device.status().await;
    assert_eq!(
        (&status["pending"], &status["synced"]),
        (&json!(0), &json!(1))
    );

    // One run, one batch: the account's next version (see the first test).
    let synced = tip(&before) + 1;
    assert_eq!(replica.balance(charlie, synced).await, opening - overdraft);
    let history = replica.history(charlie).await;
    assert_eq!(history[..before.len()], before[..]);
    assert_eq!(
        entries(&history, before.len()),
        device.expected_history(charlie)
    );

    // Online, the rules apply to the balance the device left: refused, nothing written.
    let key = format!("e2e-overdrawn-{seed}-{charlie}");
    let r = replica.keyed("withdraw", charlie, 100, &key).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(replica.balance(charlie, synced).await, opening - overdraft);
    assert_eq!(replica.history(charlie).await.len(), history.len());
}

/// Rule: with `--auth jwt` a device syncs only with a token of its own (`sub` = its id,
/// scope `devices:sync`). Without one, or with another device's, the sync stops refused
/// (nothing is resent, nothing lands) and keeps its queue; with its own, the queue drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_on_a_device_syncs_only_with_a_token_for_its_own_id() {
    let dir = TestDir::new("device-e2e-auth");
    let secret = dir.join("secret");
    std::fs::write(&secret, "a throwaway secret for one test, over 32 bytes").unwrap();
    let secret = secret.to_str().expect("a UTF-8 path");
    let replica = Replica::start_with(
        &Backend::Memory,
        seed(7),
        &["--auth", "jwt", "--auth-secret-file", secret],
    )
    .await;
    let mut device = Device::init("auth").await;
    let (alice, _) = demo("Alice");
    device.record("deposit", alice, 700).await;
    let synced = |status: &Value| status["synced"].as_u64();

    let mint = |sub: String| {
        let out = Command::new(TALLY)
            .args(["token", "--secret-file", secret, "--sub", &sub])
            .args(["--scope", "devices:sync"])
            .output()
            .expect("tally token runs");
        assert!(out.status.success(), "tally token: {}", text(&out));
        let path = dir.join(&format!("token-{sub}"));
        std::fs::write(&path, &out.stdout).unwrap();
        path.to_str().expect("a UTF-8 path").to_owned()
    };
    let other = mint(Uuid::new_v4().to_string());
    let own = mint(device.id.to_string());

    for extra in [vec![], vec!["--token-file", other.as_str()]] {
        let out = device.sync_once(&replica, 1, &extra).await;
        assert_eq!(out.status.code(), Some(1), "stopped: {}", text(&out));
        let status = device.status().await;
        assert_eq!(synced(&status), Some(0), "nothing synced: {status}");
        assert_eq!(
            status["pending"].as_u64().unwrap_or(0) + status["inFlight"].as_u64().unwrap_or(0),
            1,
            "the queue is kept: {status}"
        );
    }
    device.sync_with(&replica, 1, &["--token-file", &own]).await;
    let after = device.status().await;
    assert_eq!(synced(&after), Some(1), "{after}");
}
