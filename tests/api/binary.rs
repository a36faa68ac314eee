//! The real `tally` binary as a child process: `--help` names every flag and its
//! environment variable, it starts like `make run`, drains in-flight requests and exits 0 on
//! SIGTERM, refuses an invalid configuration with exit 2, and logs to a pipe without colour.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{self, new_account};

/// The flags only useful for measuring the design (BENCHMARKS.md, "Flags for measuring the
/// design"): taken, but hidden from `--help`.
const HIDDEN_FLAGS: [&str; 6] = [
    "one-round-trip",
    "batching",
    "combine-max-in-flight",
    "combine-max-aggregates",
    "min-active-requests",
    "max-active-requests",
];

/// The headings of `--help`, one per concern, the everyday ones first.
const HEADINGS: [&str; 11] = [
    "Commands:",
    "Options:",
    "Listening and limits:",
    "Store:",
    "Accounts:",
    "Projection:",
    "Idempotency:",
    "Auth:",
    "Watch:",
    "Writes:",
    "Observability:",
];

/// Every flag `--help` shows, each settable from the environment.
const FLAGS: [&str; 72] = [
    // Authentication, rate limits and the admin listener.
    "auth",
    "auth-secret-file",
    "auth-jwks-file",
    "auth-issuer",
    "auth-audience",
    "auth-leeway-secs",
    "rate-limit-per-caller",
    "rate-limit-burst",
    "auth-failures-per-minute",
    "allowed-hosts",
    "admin-listen",
    "max-index-entries",
    "max-header-bytes",
    "max-live-writes",
    "max-queued-writes-per-account",
    "listen",
    "store",
    "idempotency-window",
    "client-id",
    "org-id",
    "account-type-id",
    "seed-demo-accounts",
    "faults",
    "max-concurrent-requests",
    "max-queue-wait-ms",
    "write-stall-secs",
    "max-connections",
    "worker-threads",
    "write-deadline-ms",
    "write-max-attempts",
    "max-batch-events",
    "combine-writes",
    "checkpoint-every-events",
    "checkpoint-interval-secs",
    "checkpoint-in-flight",
    "retain-history-secs",
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
    // Watch stream.
    "watch-max-subscribers",
    "watch-max-per-account",
    "watch-max-per-caller",
    "watch-buffer",
    "watch-max-replay",
    "watch-keepalive-secs",
    // The Postgres projection.
    "projection",
    "postgres-url",
    "postgres-pool-size",
    "postgres-statement-timeout-ms",
    "idempotency-scan-window",
    "idempotency-retention",
    "batch-max-items",
    "batch-max-bytes",
    "batch-items-in-flight",
    "idempotency-max-keys-per-account",
    "idempotency-max-keys",
    "accounts",
    "device-max-run-withdrawal-cents",
    // Holds.
    "holds",
    "hold-sweep-interval-ms",
    "hold-sweep-budget",
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

/// Starts `tally` with its stdout (the log) streamed to the returned channel, a line at a time.
fn spawn_logging(args: &[&str], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
    let mut child = tally_command(args, env)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tally starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, lines)
}

/// A running `tally` with its JSON log lines streamed to the test; killed if the test fails.
pub(crate) struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<Value>,
    addr: SocketAddr,
}

impl Server {
    pub(crate) fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let (child, lines) = spawn_logging(args, env);
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

    /// On a free port, logging JSON, without the demo accounts, with `extra` flags.
    pub(crate) fn start_unseeded(extra: &[&str]) -> Server {
        let mut args = vec![
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--seed-demo-accounts",
            "false",
        ];
        args.extend_from_slice(extra);
        Server::start(&args, &[])
    }

    /// Waits (bounded) for the log line with this message; returns it.
    pub(crate) fn wait_for(&mut self, message: &str) -> Value {
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

    /// Takes in every log line written so far, waiting at most `quiet` for each next one.
    pub(crate) fn drain_log(&mut self, quiet: Duration) {
        while let Ok(line) = self.lines.recv_timeout(quiet) {
            if let Ok(v) = serde_json::from_str(&line) {
                self.log.push(v);
            }
        }
    }

    /// The log lines taken in so far.
    pub(crate) fn log(&self) -> &[Value] {
        &self.log
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

    pub(crate) fn url(&self, path: &str) -> String {
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

/// `--help` cut into one block per option, from its `--flag` line (which may carry the
/// description too, when it fits beside the name) to the next option: (name, block).
fn flag_blocks(help: &str) -> Vec<(String, String)> {
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
                blocks.push((name, format!("{line}\n")));
            }
            _ => {
                if let Some((_, body)) = blocks.last_mut() {
                    body.push_str(line);
                    body.push('\n');
                }
            }
        }
    }
    blocks
}

#[test]
fn binary_help_lists_every_flag_with_its_env_name() {
    let out = tally_command(&["--help"], &[])
        .output()
        .expect("tally runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    let blocks = flag_blocks(&help);
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
            // The name every Postgres tool and platform uses.
            "postgres-url" => "DATABASE_URL".into(),
            _ => format!("TALLY_{}", name.replace('-', "_").to_uppercase()),
        };
        assert!(
            body.contains(&format!("[env: {env}=")) || body.contains(&format!("[env: {env}]")),
            "--{name} does not name {env}:\n{body}"
        );
    }
    assert_eq!(blocks.len(), FLAGS.len() + 2, "{names:?}");
    let headings: Vec<&str> = help
        .lines()
        .filter(|l| l.ends_with(':') && !l.starts_with(' '))
        .collect();
    assert_eq!(headings, HEADINGS);
}

/// Rule: `tally --help` is a page to scan, not a manual. Each flag gets one line saying what
/// it is, with its environment variable and default beside it: the flag's name, then that
/// line (or both on one line where they fit). What each flag does in full is in
/// `docs/operations.md`, "Every flag".
#[test]
fn binary_help_gives_each_flag_one_line() {
    let out = tally_command(&["--help"], &[])
        .output()
        .expect("tally runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    let lines = help.lines().count();
    assert!(lines < 200, "--help is {lines} lines:\n{help}");
    for (name, block) in flag_blocks(&help) {
        // The flag's own lines: indented, unlike the heading that may follow it.
        let shown: Vec<&str> = block
            .lines()
            .filter(|l| l.starts_with(' ') && !l.trim().is_empty())
            .collect();
        assert!(
            shown.len() <= 2,
            "--{name} takes {} lines:\n{block}",
            shown.len()
        );
    }
}

/// Rule: `tally --help` names the subcommands (`trim`, `token`) in its usage and lists them
/// with what each does; they are dispatched before the server's flags are read.
#[test]
fn binary_help_lists_the_subcommands() {
    let out = tally_command(&["--help"], &[])
        .output()
        .expect("tally runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    let usage: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Usage:"))
        .take_while(|l| !l.trim().is_empty())
        .collect();
    for sub in ["tally trim [OPTIONS]", "tally token [OPTIONS]"] {
        assert!(
            usage.iter().any(|l| l.contains(sub)),
            "{sub} missing from the usage: {usage:#?}"
        );
    }
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    for sub in ["tally trim", "tally token"] {
        assert!(
            commands
                .iter()
                .any(|l| l.trim_start().starts_with(sub) && l.contains(&format!("`{sub} --help`"))),
            "{sub} missing from the commands: {help}"
        );
    }
    // The short help too.
    let short = tally_command(&["-h"], &[]).output().expect("tally runs");
    let short = String::from_utf8(short.stdout).expect("UTF-8 help");
    assert!(
        short.contains("tally trim [OPTIONS]") && short.contains("Commands:"),
        "{short}"
    );
}

/// Rule: the flags for measuring the design stay out of `--help` but are still taken (an
/// unknown flag would be refused before `--version` is reached).
#[test]
fn binary_takes_the_hidden_measuring_flags() {
    let help = tally_command(&["--help"], &[])
        .output()
        .expect("tally runs");
    let help = String::from_utf8(help.stdout).expect("UTF-8 help");
    for flag in HIDDEN_FLAGS {
        assert!(!help.contains(&format!("--{flag}")), "--{flag} in --help");
    }
    let args = [
        "--one-round-trip",
        "false",
        "--batching",
        "false",
        "--min-active-requests",
        "4",
        "--max-active-requests",
        "8",
        "--version",
    ];
    let out = tally_command(&args, &[]).output().expect("tally runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    // Which store and projection serve, in words a first run can act on.
    assert_eq!(
        listening["fields"]["store"],
        "memory (embedded in this process, shared with no other)"
    );
    assert_eq!(listening["fields"]["projection"], "memory");
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
    let mut server =
        Server::start_unseeded(&["--faults", "inflight=1,inflight-hold-ms=1500,seed=1"]);
    let client = reqwest::Client::new();
    let account = new_account();
    let slow = {
        let (client, url) = (
            client.clone(),
            server.url(&format!("/api/accounts/{account}/deposit")),
        );
        tokio::spawn(async move { common::keyed_deposit(&client, &url, "drain-1", 700).await })
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
            v["fields"]["message"] == "served"
                && v["fields"]["route"] == "/api/accounts/{id}/deposit"
        })
        .expect("the deposit's access log line");
    let stopped = server.position("stopped").expect("a stopped log line");
    assert!(draining < served && served < stopped, "{:#?}", server.log);
    // The line says what the write did: its key's hash, the run's attempts and outcome.
    let line = &server.log[served]["fields"];
    assert_eq!(line["status"], 200, "{line}");
    assert!(
        line["key_hash"].as_str().is_some_and(|h| h.len() == 8),
        "{line}"
    );
    assert_eq!(line["attempts"], 1, "{line}");
    assert_eq!(line["outcome"], "ok", "{line}");
}

/// Rule: a replica that stood still (SIGSTOP) refuses, retryably and without writing, the
/// write that waited unread in its socket meanwhile (else a replica paused past
/// the idempotency window would write such a request again after its retry had landed elsewhere).
/// The pause is the fault under test, not a wait for a signal: the process must stand still
/// past the stall threshold.
#[tokio::test]
async fn binary_refuses_a_write_that_waited_unread_while_it_was_stopped() {
    let server = Server::start_unseeded(&[]);
    let client = reqwest::Client::new();
    let account = new_account();
    let deposit = |key: &'static str| {
        let (client, url) = (
            client.clone(),
            server.url(&format!("/api/accounts/{account}/deposit")),
        );
        async move { common::keyed_deposit(&client, &url, key, 100).await }
    };
    assert_eq!(deposit("before-stop").await.status, StatusCode::OK);
    let signal = |sig: &str| {
        let status = Command::new("kill")
            .args([sig, &server.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    };
    signal("-STOP");
    let waiting = tokio::spawn(deposit("sent-while-stopped"));
    tokio::time::sleep(tally::stall::THRESHOLD + Duration::from_secs(1)).await;
    signal("-CONT");
    let r = waiting.await.expect("request task");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    let balance = common::read(
        client
            .get(server.url(&format!("/api/accounts/{account}/balance")))
            .send()
            .await
            .expect("answered"),
    )
    .await;
    assert_eq!(
        balance.body,
        json!({ "balanceCents": 100, "aggregateVersion": 1 }),
        "nothing written"
    );
}

/// Rule: a window too short for any retry after a 409 to be known safe (no longer than two
/// write lives plus the stall threshold) is allowed, and said at start (a
/// 3 s window with a 1.9 s deadline writes late requests again; its 409s say 0).
#[tokio::test]
async fn binary_warns_at_start_of_a_window_that_leaves_a_retry_no_safe_time() {
    let mut server =
        Server::start_unseeded(&["--idempotency-window", "11", "--write-deadline-ms", "4500"]);
    let warning = server.wait_for(
        "the idempotency window leaves a retry no time it is known safe in: a non-final write answer says Idempotency-Window: 0",
    );
    assert_eq!(warning["fields"]["window_secs"], 11, "{warning}");
    drop(server);
    let mut roomy =
        Server::start_unseeded(&["--idempotency-window", "13", "--write-deadline-ms", "4500"]);
    roomy.wait_for("start-up done");
    assert!(
        roomy
            .position("the idempotency window leaves a retry no time it is known safe in: a non-final write answer says Idempotency-Window: 0")
            .is_none(),
        "{:#?}",
        roomy.log
    );
}

/// Rule: a store that holds every call at boot does not keep the replica from listening:
/// it answers `/healthz`, and `/readyz` says what it waits for, while its start-up steps'
/// first attempts are still held (else it would listen only after they returned).
#[tokio::test]
async fn binary_listens_not_ready_while_its_start_up_writes_are_held() {
    // `Server::start` waits (bounded) for the listening line, which came only after the
    // held first attempts returned (60 s) before the fix.
    let server = Server::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--faults",
            "inflight=1,inflight-hold-ms=60000,seed=1",
        ],
        &[],
    );
    assert_live_and_starting(&server).await;
}

/// The replica answers `/healthz`, and `/readyz` says it is starting, waiting for the
/// server-clock anchor (the first start-up step, which needs the store).
async fn assert_live_and_starting(server: &Server) {
    let client = reqwest::Client::new();
    let health = common::read(client.get(server.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.text);
    let ready = common::read(client.get(server.url("/readyz")).send().await.unwrap()).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text
    );
    assert_eq!(ready.body["status"], "starting", "{}", ready.text);
    assert!(
        ready.body["waiting"]
            .as_array()
            .is_some_and(|w| w.iter().any(|s| s == "serverClock")),
        "{}",
        ready.text
    );
}

/// Rule: a Celeriant that accepts connections and never answers does not keep the replica
/// from listening either (else the boot ping would hold it for two request timeouts).
#[tokio::test]
async fn binary_listens_not_ready_while_celeriant_accepts_but_never_answers() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
    let address = silent.local_addr().unwrap().to_string();
    // Accepts, keeps each connection open, never writes: a store that holds every call.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming() {
            match conn {
                Ok(c) => held.push(c),
                Err(_) => break,
            }
        }
    });
    // Without the fix, `Server::start` gives up waiting for the listening line: the ping
    // alone held start-up for two of these timeouts.
    let server = Server::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--store",
            "celeriant",
            "--celeriant-address",
            &address,
            "--celeriant-request-timeout-ms",
            "60000",
        ],
        &[],
    );
    assert_live_and_starting(&server).await;
}

/// Rule: an address already taken stops the binary with a message that names the flag and
/// the variable that choose another (a first `make run` often finds 8080 taken).
#[test]
fn binary_names_the_flag_and_variable_when_its_address_is_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = taken.local_addr().unwrap().to_string();
    for (flag, env) in [
        ("--listen", "TALLY_LISTEN"),
        ("--admin-listen", "TALLY_ADMIN_LISTEN"),
    ] {
        let mut args = vec!["--seed-demo-accounts", "false", flag, addr.as_str()];
        if flag != "--listen" {
            args.extend(["--listen", "127.0.0.1:0"]);
        }
        let out = tally_command(&args, &[]).output().expect("tally runs");
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{flag}: {log}");
        let line = log
            .lines()
            .find(|l| l.contains("cannot listen"))
            .unwrap_or_else(|| panic!("{flag}: no 'cannot listen' line in {log}"));
        assert!(
            line.contains(&addr)
                && line.contains(&format!("{flag} HOST:PORT"))
                && line.contains(env),
            "{flag}: {line}"
        );
    }
}

/// Rule: the addresses are bound before the start-up steps run (the server clock, the demo
/// seeds), so a taken port stops the replica at once, not after a slow store let them finish.
#[test]
fn binary_binds_its_addresses_before_the_start_up_steps() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = taken.local_addr().unwrap().to_string();
    for flag in ["--listen", "--admin-listen"] {
        let mut args = vec!["--seed-demo-accounts", "true", flag, addr.as_str()];
        if flag != "--listen" {
            args.extend(["--listen", "127.0.0.1:0"]);
        }
        let out = tally_command(&args, &[]).output().expect("tally runs");
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{flag}: {log}");
        assert!(log.contains("cannot listen"), "{flag}: {log}");
        // Each step logs when it is done (`start-up done` once all are): none ran.
        assert!(
            !log.contains("start-up"),
            "{flag}: start-up steps ran before the address was bound: {log}"
        );
    }
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

/// Rule: a log that is not a terminal (a file, a pipe to a collector) carries no colour
/// escape codes; the human format colours only what a person reads live.
#[test]
fn binary_logs_to_a_pipe_without_colour_codes() {
    let (mut child, lines) = spawn_logging(&["--listen", "127.0.0.1:0"], &[]);
    let deadline = Instant::now() + PROCESS_BOUND;
    let mut read = Vec::new();
    while !read.iter().any(|l: &String| l.contains("tally listening")) {
        let left = deadline.saturating_duration_since(Instant::now());
        read.push(
            lines
                .recv_timeout(left)
                .expect("tally logs that it listens"),
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    for line in &read {
        assert!(!line.contains('\u{1b}'), "an escape code in: {line:?}");
    }
}
