//! A fleet of real `tally` processes behind nginx, started by `deploy/fleet.sh`, over the
//! live Celeriant server named by `CELERIANT_ADDRESS` (unset, skipped outside CI and a failure under `CI=true`).
//!
//! The replicas share nothing but the stream and one client id. Each scenario sends its
//! requests either through nginx (which hashes the account id from the path) or straight to
//! a replica's own port when it needs "another replica", and checks every answer and the
//! exact events of every stream it touched (history read back, page by page, on every
//! replica and through nginx). Account ids and keys are fresh per run: the server is shared
//! and durable.
//!
//! Three tests, each with a fleet of its own, one fleet at a time: scenarios 1 to 8; scenario
//! 9, a transfer retried on a replica that has folded only one of its legs; and `tally-load`
//! driving mixed traffic with retries at nginx and the replicas, whose exactly-once verdict
//! must pass.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::fleet_script::{Fleet, FleetStore};
use common::remote::Remote;
use common::{Reply, leg, new_account};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

/// Replicas in the fleet.
const FLEET_SIZE: u16 = 3;
/// How long every replica and nginx may take to answer /readyz 200 once the fleet is up.
const READY_BOUND: Duration = Duration::from_secs(20);
/// Pause between readiness probes.
const READY_PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// fleet.sh stops by itself after this long, should this test die without stopping it.
const FLEET_MAX_SECONDS: &str = "150";
/// Any one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// The whole tally-load run, setup and verification included.
const LOAD_BOUND: Duration = Duration::from_secs(40);
/// The idempotency window every write answer names (the server's default).
const WINDOW: &str = "90";

/// The fleet, as the scenarios see it.
struct Cluster {
    lb: Remote,
    replicas: Vec<Remote>,
}

impl Cluster {
    /// Every address that serves the API: nginx and each replica.
    fn all(&self) -> impl Iterator<Item = &Remote> {
        std::iter::once(&self.lb).chain(self.replicas.iter())
    }

    /// The replica whose authority nginx named in `X-Tally-Upstream`.
    fn upstream_of(&self, r: &Reply) -> usize {
        let named = r
            .header("x-tally-upstream")
            .expect("nginx names the upstream");
        self.replicas
            .iter()
            .position(|rep| rep.authority() == named)
            .unwrap_or_else(|| panic!("X-Tally-Upstream {named:?} is not a replica"))
    }

    /// Asserts the stream holds exactly `expected` (event id → type, amount), each once, and
    /// reads the same on every replica and through nginx.
    async fn assert_stream(&self, account: &str, expected: &[(&str, &str, i64)]) {
        let mut want: BTreeMap<String, (String, i64)> = BTreeMap::new();
        for (id, kind, cents) in expected {
            let fresh = want.insert(id.to_string(), (kind.to_string(), *cents));
            assert!(fresh.is_none(), "the test expects {id} once");
        }
        let mut first: Option<Vec<Value>> = None;
        for remote in self.all() {
            let events = remote.history(account).await;
            let mut seen: BTreeMap<String, (String, i64)> = BTreeMap::new();
            for e in &events {
                let id = e["eventId"].as_str().expect("every event has an eventId");
                let again = seen.insert(
                    id.to_owned(),
                    (
                        e["type"].as_str().unwrap_or("").to_owned(),
                        e["amountCents"].as_i64().unwrap_or(0),
                    ),
                );
                assert!(
                    again.is_none(),
                    "event {id} appears twice in {account} (read on {}): {events:#?}",
                    remote.base
                );
            }
            assert_eq!(
                events.len(),
                expected.len(),
                "events in {account} (read on {}): {events:#?}",
                remote.base
            );
            assert_eq!(seen, want, "stream {account} read on {}", remote.base);
            match &first {
                None => first = Some(events),
                Some(f) => assert_eq!(
                    f, &events,
                    "every replica reads the same history of {account}"
                ),
            }
        }
    }

    /// Asserts every replica and nginx report this balance and version.
    async fn assert_balance(&self, account: &str, want: (i64, u64)) {
        for remote in self.all() {
            assert_eq!(
                remote.balance(account).await,
                want,
                "balance of {account} on {}",
                remote.base
            );
        }
    }
}

/// A fresh idempotency key, a UUID, which is also the event id it names.
fn new_key() -> String {
    Uuid::new_v4().to_string()
}

/// Asserts a first (not replayed) 200 write answer with this body, naming its key and window.
#[track_caller]
fn assert_written(r: &Reply, key: &str, body: &Value) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(&r.body, body, "answer body");
    assert!(
        !r.replayed(),
        "a first write is not a replay: {:?}",
        r.headers
    );
    assert_eq!(r.header("idempotency-key"), Some(key));
    assert_eq!(r.header("idempotency-window"), Some(WINDOW));
    assert_eq!(r.header("content-type"), Some("application/json"));
}

/// Asserts that `retry` is `original` replayed: same status, body and key, marked replayed.
#[track_caller]
fn assert_replay(original: &Reply, retry: &Reply) {
    assert_eq!(
        retry.status, original.status,
        "a retry gets the original status: {}",
        retry.text
    );
    assert_eq!(retry.body, original.body, "a retry gets the original body");
    assert!(
        retry.replayed(),
        "a retry is marked Idempotent-Replayed: {:?}",
        retry.headers
    );
    assert_eq!(
        retry.header("idempotency-key"),
        original.header("idempotency-key")
    );
    assert_eq!(retry.header("idempotency-window"), Some(WINDOW));
}

/// Asserts an error answer with this status and code.
#[track_caller]
fn assert_error(r: &Reply, status: u16, code: &str) {
    assert_eq!(r.status.as_u16(), status, "{}", r.text);
    assert_eq!(r.error_code(), code, "{}", r.text);
    assert!(
        r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "an error carries a message: {}",
        r.text
    );
}

/// A fresh account holding one deposit of `cents` made through nginx; returns it and the
/// deposit's key.
async fn funded(c: &Cluster, cents: i64) -> (String, String) {
    let account = new_account();
    let key = new_key();
    let r = c.lb.deposit(&account, cents, &key).await;
    assert_written(
        &r,
        &key,
        &json!({ "balanceCents": cents, "aggregateVersion": 1 }),
    );
    (account, key)
}

// --- Scenarios -------------------------------------------------------------------------------

/// 1: a plain deposit through nginx.
async fn plain_deposit(c: &Cluster) {
    let account = new_account();
    let key = new_key();
    let r = c.lb.deposit(&account, 1234, &key).await;
    assert_written(
        &r,
        &key,
        &json!({ "balanceCents": 1234, "aggregateVersion": 1 }),
    );
    c.upstream_of(&r);
    c.assert_stream(&account, &[(&key, "Deposited", 1234)])
        .await;
    c.assert_balance(&account, (1234, 1)).await;
}

/// 2: a retry on the same replica (nginx sends the account to one replica; then that replica
/// directly) gets the original answer and writes nothing.
async fn retry_on_the_same_replica(c: &Cluster) {
    let account = new_account();
    let key = new_key();
    let first = c.lb.deposit(&account, 700, &key).await;
    assert_written(
        &first,
        &key,
        &json!({ "balanceCents": 700, "aggregateVersion": 1 }),
    );
    let owner = c.upstream_of(&first);

    let again = c.lb.deposit(&account, 700, &key).await;
    assert_replay(&first, &again);
    assert_eq!(
        c.upstream_of(&again),
        owner,
        "nginx sends an account to one replica"
    );
    let direct = c.replicas[owner].deposit(&account, 700, &key).await;
    assert_replay(&first, &direct);

    c.assert_stream(&account, &[(&key, "Deposited", 700)]).await;
    c.assert_balance(&account, (700, 1)).await;
}

/// 3: a retry on each other replica gets the original answer and writes nothing. Every
/// replica has folded the account before the write, so the others hold it warm but stale
/// when the retry comes.
async fn retry_on_another_replica(c: &Cluster) {
    let (account, fund) = funded(c, 5_000).await;
    for replica in &c.replicas {
        assert_eq!(replica.balance(&account).await, (5_000, 1));
    }
    let key = new_key();
    let first = c.lb.withdraw(&account, 1_500, &key).await;
    assert_written(
        &first,
        &key,
        &json!({ "balanceCents": 3_500, "aggregateVersion": 2 }),
    );
    let owner = c.upstream_of(&first);
    for (i, replica) in c.replicas.iter().enumerate() {
        if i == owner {
            continue;
        }
        let retry = replica.withdraw(&account, 1_500, &key).await;
        assert_replay(&first, &retry);
    }
    c.assert_stream(
        &account,
        &[(&fund, "Deposited", 5_000), (&key, "Withdrawn", 1_500)],
    )
    .await;
    c.assert_balance(&account, (3_500, 2)).await;
}

/// 4: the same request on two replicas at once lands once; both get the same answer.
async fn same_request_on_two_replicas_at_once(c: &Cluster) {
    for round in 0..5 {
        let (account, fund) = funded(c, 10_000).await;
        // Both replicas fold the account first, so they race on the write itself.
        assert_eq!(c.replicas[0].balance(&account).await, (10_000, 1));
        assert_eq!(c.replicas[1].balance(&account).await, (10_000, 1));
        let key = new_key();
        let (a, b) = tokio::join!(
            c.replicas[0].deposit(&account, 250, &key),
            c.replicas[1].deposit(&account, 250, &key),
        );
        let want = json!({ "balanceCents": 10_250, "aggregateVersion": 2 });
        for r in [&a, &b] {
            assert_eq!(r.status, StatusCode::OK, "round {round}: {}", r.text);
            assert_eq!(r.body, want, "round {round}");
            assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
            assert_eq!(r.header("idempotency-window"), Some(WINDOW));
        }
        assert!(
            !(a.replayed() && b.replayed()),
            "round {round}: one of the two wrote, so not both are replays"
        );
        c.assert_stream(
            &account,
            &[(&fund, "Deposited", 10_000), (&key, "Deposited", 250)],
        )
        .await;
        c.assert_balance(&account, (10_250, 2)).await;
    }
}

/// 5: two different requests on one account on two replicas at once both land, once each.
async fn two_requests_on_two_replicas_at_once(c: &Cluster) {
    for round in 0..5 {
        let (account, fund) = funded(c, 10_000).await;
        assert_eq!(c.replicas[0].balance(&account).await, (10_000, 1));
        assert_eq!(c.replicas[1].balance(&account).await, (10_000, 1));
        let (dk, wk) = (new_key(), new_key());
        let (d, w) = tokio::join!(
            c.replicas[0].deposit(&account, 100, &dk),
            c.replicas[1].withdraw(&account, 300, &wk),
        );
        for (r, k) in [(&d, &dk), (&w, &wk)] {
            assert_eq!(r.status, StatusCode::OK, "round {round}: {}", r.text);
            assert!(!r.replayed(), "round {round}: a fresh request is no replay");
            assert_eq!(r.header("idempotency-key"), Some(k.as_str()));
        }
        // Whichever landed first answers the balance after itself alone; the other after both.
        let (dl, wl) = (leg(&d.body), leg(&w.body));
        let mut answers = [dl, wl];
        answers.sort_by_key(|l| l.1);
        assert_eq!(
            (answers[0].1, answers[1].1),
            (2, 3),
            "round {round}: one lands at version 2, the other at 3"
        );
        assert_eq!(answers[1].0, 9_800, "round {round}: the later sees both");
        let first_alone = if dl.1 == 2 { 10_100 } else { 9_700 };
        assert_eq!(
            answers[0].0, first_alone,
            "round {round}: the earlier sees itself alone"
        );
        c.assert_stream(
            &account,
            &[
                (&fund, "Deposited", 10_000),
                (&dk, "Deposited", 100),
                (&wk, "Withdrawn", 300),
            ],
        )
        .await;
        c.assert_balance(&account, (9_800, 3)).await;
    }
}

/// 6: a withdraw over the balance is 422 with the balance, on any replica, and writes nothing.
async fn over_balance_withdraw(c: &Cluster) {
    let (account, fund) = funded(c, 500).await;
    let key = new_key();
    let r = c.replicas[0].withdraw(&account, 501, &key).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(r.body["balanceCents"], 500, "{}", r.text);
    assert!(!r.replayed());
    let again = c.replicas[1].withdraw(&account, 501, &key).await;
    assert_error(&again, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(again.body["balanceCents"], 500, "{}", again.text);
    let via_lb = c.lb.withdraw(&account, 501, &key).await;
    assert_error(&via_lb, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(via_lb.body["balanceCents"], 500, "{}", via_lb.text);
    c.assert_stream(&account, &[(&fund, "Deposited", 500)])
        .await;
    c.assert_balance(&account, (500, 1)).await;
}

/// 7: a transfer retried on another replica (and on either route) gets the original answer
/// for both legs; each stream holds its leg once.
async fn transfer_retried_on_another_replica(c: &Cluster) {
    let (from, fund) = funded(c, 10_000).await;
    let to = new_account();
    let key = new_key();
    let first = c.replicas[0].transfer(&from, &to, 2_500, &key).await;
    assert_written(
        &first,
        &key,
        &json!({
            "from": { "balanceCents": 7_500, "aggregateVersion": 2 },
            "to": { "balanceCents": 2_500, "aggregateVersion": 1 },
        }),
    );
    assert_replay(
        &first,
        &c.replicas[1].transfer(&from, &to, 2_500, &key).await,
    );
    assert_replay(
        &first,
        &c.replicas[2]
            .account_transfer(&from, &to, 2_500, &key)
            .await,
    );
    assert_replay(
        &first,
        &c.lb.account_transfer(&from, &to, 2_500, &key).await,
    );
    assert_replay(&first, &c.lb.transfer(&from, &to, 2_500, &key).await);

    c.assert_stream(
        &from,
        &[
            (&fund, "Deposited", 10_000),
            (&key, "TransferredOut", 2_500),
        ],
    )
    .await;
    c.assert_stream(&to, &[(&key, "TransferredIn", 2_500)])
        .await;
    let out = c.lb.history(&from).await;
    assert_eq!(out[1]["toAccountId"], to.as_str(), "{out:#?}");
    let inn = c.lb.history(&to).await;
    assert_eq!(inn[0]["fromAccountId"], from.as_str(), "{inn:#?}");
    c.assert_balance(&from, (7_500, 2)).await;
    c.assert_balance(&to, (2_500, 1)).await;
}

/// 8: replica B writes, then replica A writes (folding B's event on the way); a retry of a
/// much older request on A still gets its original answer, and B's request replays on A too.
async fn old_retry_after_another_replica_wrote(c: &Cluster) {
    let (a, b) = (&c.replicas[0], &c.replicas[1]);
    let account = new_account();
    let old_key = new_key();
    let old = a.deposit(&account, 1_000, &old_key).await;
    assert_written(
        &old,
        &old_key,
        &json!({ "balanceCents": 1_000, "aggregateVersion": 1 }),
    );
    // Make the first request old: several later writes on A.
    let mut expected: Vec<(String, &str, i64)> = vec![(old_key.clone(), "Deposited", 1_000)];
    let mut balance = 1_000;
    for i in 0..6 {
        let k = new_key();
        let cents = 10 + i;
        balance += cents;
        let r = a.deposit(&account, cents, &k).await;
        assert_written(
            &r,
            &k,
            &json!({ "balanceCents": balance, "aggregateVersion": 2 + i as u64 }),
        );
        expected.push((k, "Deposited", cents));
    }
    // B writes: it folds A's seven events first.
    let b_key = new_key();
    let from_b = b.withdraw(&account, 40, &b_key).await;
    balance -= 40;
    assert_written(
        &from_b,
        &b_key,
        &json!({ "balanceCents": balance, "aggregateVersion": 8 }),
    );
    expected.push((b_key.clone(), "Withdrawn", 40));
    // A writes on its warm fold, which has not seen B's event: it must fold it and count it.
    let a_key = new_key();
    let from_a = a.deposit(&account, 5, &a_key).await;
    balance += 5;
    assert_written(
        &from_a,
        &a_key,
        &json!({ "balanceCents": balance, "aggregateVersion": 9 }),
    );
    expected.push((a_key.clone(), "Deposited", 5));

    assert_replay(&old, &a.deposit(&account, 1_000, &old_key).await);
    assert_replay(&from_b, &a.withdraw(&account, 40, &b_key).await);
    assert_replay(&from_a, &b.deposit(&account, 5, &a_key).await);
    assert_replay(&old, &b.deposit(&account, 1_000, &old_key).await);

    let expected: Vec<(&str, &str, i64)> = expected
        .iter()
        .map(|(k, t, n)| (k.as_str(), *t, *n))
        .collect();
    c.assert_stream(&account, &expected).await;
    c.assert_balance(&account, (balance, 9)).await;
}

/// 9: a transfer retried on a replica that has folded one leg's stream past the transfer and
/// holds the other leg's stream from before it (both warm) still gets the original answer for
/// both legs. Both ways round: the payer's stream folded, then the payee's.
async fn transfer_retried_where_one_leg_is_folded(c: &Cluster) {
    let (a, b) = (&c.replicas[0], &c.replicas[1]);
    for folded in ["from", "to"] {
        let (from, from_fund) = (new_account(), new_key());
        let (to, to_fund) = (new_account(), new_key());
        let r = a.deposit(&from, 10_000, &from_fund).await;
        assert_written(
            &r,
            &from_fund,
            &json!({ "balanceCents": 10_000, "aggregateVersion": 1 }),
        );
        let r = a.deposit(&to, 500, &to_fund).await;
        assert_written(
            &r,
            &to_fund,
            &json!({ "balanceCents": 500, "aggregateVersion": 1 }),
        );
        // B folds both accounts before the transfer.
        assert_eq!(b.balance(&from).await, (10_000, 1));
        assert_eq!(b.balance(&to).await, (500, 1));

        let key = new_key();
        let first = a.transfer(&from, &to, 2_500, &key).await;
        let original = json!({
            "from": { "balanceCents": 7_500, "aggregateVersion": 2 },
            "to": { "balanceCents": 3_000, "aggregateVersion": 2 },
        });
        assert_written(&first, &key, &original);
        // B folds one of the two streams past the transfer (a read catches it up).
        if folded == "from" {
            assert_eq!(b.balance(&from).await, (7_500, 2));
        } else {
            assert_eq!(b.balance(&to).await, (3_000, 2));
        }
        let retry = b.transfer(&from, &to, 2_500, &key).await;
        assert_eq!(
            retry.body, original,
            "a retry on a replica that folded only the {folded:?} leg past the transfer must \
             still get the original answer for both legs"
        );
        assert_replay(&first, &retry);

        c.assert_stream(
            &from,
            &[
                (&from_fund, "Deposited", 10_000),
                (&key, "TransferredOut", 2_500),
            ],
        )
        .await;
        c.assert_stream(
            &to,
            &[(&to_fund, "Deposited", 500), (&key, "TransferredIn", 2_500)],
        )
        .await;
        c.assert_balance(&from, (7_500, 2)).await;
        c.assert_balance(&to, (3_000, 2)).await;
    }
}

/// The load check: `tally-load` with mixed traffic and retries at nginx and every replica.
async fn load_through_nginx(c: &Cluster) -> Value {
    let mut targets = vec![c.lb.base.clone()];
    targets.extend(c.replicas.iter().map(|r| r.base.clone()));
    let mut cmd =
        tokio::process::Command::new(common::workspace_bin::path("tally-load", &["tally-client"]));
    for (name, _) in std::env::vars() {
        if name.starts_with("TALLY_LOAD_") {
            cmd.env_remove(name);
        }
    }
    cmd.args(["--target", &targets.join(",")])
        .args(["--scenario", "mixed", "--retry-ratio", "0.3", "--json"])
        .args(["--duration", "3", "--connections", "8", "--accounts", "12"])
        .kill_on_drop(true);
    let out = tokio::time::timeout(LOAD_BOUND, cmd.output())
        .await
        .expect("tally-load finishes within its bound")
        .expect("tally-load runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("one JSON report ({e}):\n{stdout}\nstderr:\n{stderr}"));
    let e = &report["exactly_once"];
    // What a failure needs to show: the verdict, the violations, what was answered.
    let summary = json!({
        "exactly_once": e,
        "status_counts": report["status_counts"],
        "error_kinds": report["error_kinds"],
        "error_samples": report["error_samples"],
        "seed": report["seed"],
    });
    assert!(
        out.status.success(),
        "tally-load exit {:?}: {summary:#}\nstderr:\n{stderr}",
        out.status
    );
    assert_eq!(e["verdict"], "pass", "{summary:#}");
    assert_eq!(e["violation_count"], 0, "{summary:#}");
    assert!(
        report["operations"].as_u64().unwrap_or(0) > 0,
        "{summary:#}"
    );
    assert!(report["retries"].as_u64().unwrap_or(0) > 0, "{summary:#}");
    assert!(report["replays"].as_u64().unwrap_or(0) > 0, "{summary:#}");
    assert!(e["succeeded"].as_u64().unwrap_or(0) > 0, "{summary:#}");
    assert_eq!(
        report["targets"].as_array().map(Vec::len),
        Some(targets.len()),
        "{summary:#}"
    );
    let statuses = report["status_counts"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    for (status, n) in &statuses {
        assert!(
            status.starts_with('2') || status == "409" || status == "422" || status == "503",
            "tally-load saw {n} answers {status}: {summary:#}"
        );
    }
    report
}

// --- The tests -------------------------------------------------------------------------------

/// One fleet at a time: the machine is small, and each test wants the fleet to itself.
static ONE_FLEET_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A started, ready fleet and the addresses to reach it. Fields drop in order: the fleet
/// stops before the next test may start one.
struct Session {
    fleet: Fleet,
    c: Cluster,
    started: Instant,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl Session {
    /// Starts a fleet against `CELERIANT_ADDRESS`, or `None` (printing why) when it is unset outside CI.
    async fn start() -> Option<Session> {
        let celeriant = common::required::celeriant_address()?;
        let turn = ONE_FLEET_AT_A_TIME.lock().await;
        let started = Instant::now();
        let address = celeriant.clone();
        // Starting blocks on fleet.sh's output; keep it off the runtime's workers.
        let fleet = tokio::task::spawn_blocking(move || {
            Fleet::start(
                &FleetStore::Celeriant(address),
                FLEET_SIZE,
                &[("FLEET_MAX_SECONDS", FLEET_MAX_SECONDS)],
            )
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .no_proxy()
            .build()
            .expect("client");
        let c = Cluster {
            lb: Remote::new(&fleet.lb, &client),
            replicas: fleet
                .replicas
                .iter()
                .map(|r| Remote::new(r, &client))
                .collect(),
        };
        let session = Session {
            fleet,
            c,
            started,
            _turn: turn,
        };
        wait_ready(&session.c).await;
        eprintln!(
            "fleet ready in {:?}: nginx {} over {:?}, Celeriant {celeriant}",
            started.elapsed(),
            session.fleet.lb,
            session.fleet.replicas
        );
        Some(session)
    }

    /// Checks that the fleet survived with no replica lost on the way (fleet.sh restarts a
    /// replica that exits, and says so on stderr), then stops it and checks it stopped
    /// cleanly: every replica drained within fleet.sh's bound and nothing had to be killed.
    fn finish(mut self) {
        assert!(self.fleet.running(), "fleet.sh stopped during the test");
        let status = self.fleet.stop();
        let stderr = self.fleet.stderr();
        assert!(
            !stderr.contains("restarting it"),
            "no replica exited during the test:\n{stderr}"
        );
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "fleet.sh stops cleanly on SIGTERM; stderr:\n{}",
            self.fleet.stderr()
        );
        eprintln!("fleet stopped; {:?} in all", self.started.elapsed());
    }
}

/// Polls /readyz on nginx and every replica until each answers 200, within a bound.
async fn wait_ready(c: &Cluster) {
    let bases: Vec<&str> = c.all().map(|r| r.base.as_str()).collect();
    common::wait_ready(&c.lb.client, &bases, READY_BOUND, READY_PROBE_INTERVAL).await;
}

/// Scenarios 1 to 8, through nginx and on the replicas directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_retry_on_any_replica_gets_the_original_answer_and_writes_once() {
    let Some(s) = Session::start().await else {
        return;
    };
    plain_deposit(&s.c).await;
    retry_on_the_same_replica(&s.c).await;
    retry_on_another_replica(&s.c).await;
    same_request_on_two_replicas_at_once(&s.c).await;
    two_requests_on_two_replicas_at_once(&s.c).await;
    over_balance_withdraw(&s.c).await;
    transfer_retried_on_another_replica(&s.c).await;
    old_retry_after_another_replica_wrote(&s.c).await;
    s.finish();
}

/// Scenario 9: a transfer's retry where the replica has folded only one of its legs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_retry_gets_both_original_legs_where_one_leg_is_folded() {
    let Some(s) = Session::start().await else {
        return;
    };
    transfer_retried_where_one_leg_is_folded(&s.c).await;
    s.finish();
}

/// `tally-load`: mixed traffic with retries at nginx and at every replica, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_with_retries_through_nginx_is_exactly_once() {
    let Some(s) = Session::start().await else {
        return;
    };
    let report = load_through_nginx(&s.c).await;
    eprintln!(
        "tally-load: {} operations, {} retries, {} replays, statuses {}, verdict {}",
        report["operations"],
        report["retries"],
        report["replays"],
        report["status_counts"],
        report["exactly_once"]["verdict"]
    );
    s.finish();
}
