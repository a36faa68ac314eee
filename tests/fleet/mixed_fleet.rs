//! The migration path: the replaced service (`celeriant-reference`, memory projection) and a
//! Tally replica joined to its fleet (its client id; the org and account type are the same by
//! default) over one real Celeriant server. A request goes to one service and its retry to
//! either: the retry answers the first response (or Tally's replay of it), every key lands
//! once, and both services fold the same balance, equal to the history's own sum.
//!
//! Needs `CELERIANT_REFERENCE_BIN` and `CELERIANT_ADDRESS` (`scripts/with-celeriant.sh` sets
//! both); unset, the tests skip outside CI and fail under `CI=true`. The replaced service
//! binds 0.0.0.0:5001 (fixed in its code), so one runs at a time, and a port already taken
//! fails the test with a line that says so. `TALLY_MIXED_SEED=N` replays one workload.

use crate::common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::{Identity, named_id};
use tally::store::SharedLog;
use tally::store::celeriant::{CeleriantConfig, CeleriantLog};

use common::{Reply, TestApp, read, required, spawn, test_config};

/// The replaced service's address, fixed in its code.
const REFERENCE_ADDR: &str = "127.0.0.1:5001";
/// How long the replaced service may take to answer its first request.
const REFERENCE_START_BOUND: Duration = Duration::from_secs(20);
/// The workload's seed unless `TALLY_MIXED_SEED` names another.
const DEFAULT_SEED: u64 = 20_261_204;
/// Operations in the sequential workload, and accounts it spreads them over.
const OPERATIONS: usize = 60;
const ACCOUNTS: usize = 4;
/// Keys sent to both services at the same moment.
const RACED_KEYS: usize = 12;

/// One replaced service at a time: its port is fixed.
static ONE_REFERENCE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The replaced service, stopped (killed) when dropped.
struct Reference {
    child: Child,
}

impl Reference {
    async fn start(bin: &str, celeriant: &str) -> Reference {
        assert!(
            std::net::TcpStream::connect(REFERENCE_ADDR).is_err(),
            "another process holds {REFERENCE_ADDR}, the replaced service's fixed port"
        );
        let child = Command::new(bin)
            .env("PROJECTION", "memory")
            .env("CELERIANT_ADDRESS", celeriant)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start the replaced service {bin}: {e}"));
        let mut reference = Reference { child };
        reference.wait_answering().await;
        reference
    }

    /// Polls until `GET /api/accounts` answers 200: the service's own readiness signal.
    async fn wait_answering(&mut self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + REFERENCE_START_BOUND;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the replaced service exited at start: {status}");
            }
            let url = format!("http://{REFERENCE_ADDR}/api/accounts");
            if let Ok(r) = client.get(url).send().await
                && r.status() == StatusCode::OK
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replaced service did not answer within {REFERENCE_START_BOUND:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Either service, as a client sees it.
struct Service {
    name: &'static str,
    base: String,
    client: reqwest::Client,
}

impl Service {
    async fn post(&self, path: &str, body: &Value, key: &str) -> Reply {
        let req = self.client.post(format!("{}{path}", self.base)).json(body);
        let sent = req.header("Idempotency-Key", key).send().await;
        read(sent.unwrap_or_else(|e| panic!("{} answers {path}: {e}", self.name))).await
    }

    async fn balance(&self, account: &str) -> (i64, u64) {
        let url = format!("{}/api/accounts/{account}/balance", self.base);
        let r = read(self.client.get(url).send().await.expect("balance")).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{} balance: {}",
            self.name,
            r.text
        );
        (
            r.body["balanceCents"].as_i64().expect("balanceCents"),
            r.body["aggregateVersion"]
                .as_u64()
                .expect("aggregateVersion"),
        )
    }
}

/// Both services over one server, the replaced one first.
struct Mixed {
    services: [Service; 2],
    tally: TestApp,
    _reference: Reference,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl Mixed {
    async fn start() -> Option<Mixed> {
        Mixed::start_with(&[]).await
    }

    /// As [`Mixed::start`], the Tally replica with `extra` flags.
    async fn start_with(extra: &[&str]) -> Option<Mixed> {
        let (bin, address) = required::celeriant_reference()?;
        let turn = ONE_REFERENCE.lock().await;
        let reference = Reference::start(&bin, &address).await;
        let tally = replica_joined_to_the_reference(&address, extra).await;
        let client = reqwest::Client::new();
        let services = [
            Service {
                name: "replaced service",
                base: format!("http://{REFERENCE_ADDR}"),
                client: client.clone(),
            },
            Service {
                name: "tally",
                base: format!("http://{}", tally.addr),
                client,
            },
        ];
        Some(Mixed {
            services,
            tally,
            _reference: reference,
            _turn: turn,
        })
    }
}

/// A Tally replica writing as the replaced service does: its client id (the org and account
/// type are the defaults both share).
async fn replica_joined_to_the_reference(address: &str, extra: &[&str]) -> TestApp {
    let client_id = named_id(Identity::REFERENCE_SERVICE_CLIENT).to_string();
    let cfg = CeleriantConfig {
        address: address.to_owned(),
        ..Default::default()
    };
    let store: SharedLog = Arc::new(CeleriantLog::connect(&cfg).expect("Celeriant config"));
    let mut flags = vec!["--client-id", &client_id];
    flags.extend_from_slice(extra);
    let t = spawn(test_config(&flags), Some(store), None).await;
    t.app.started().await;
    t
}

/// One write of the workload.
#[derive(Clone, Debug)]
enum Op {
    Deposit(usize, i64),
    Withdraw(usize, i64),
    Transfer(usize, usize, i64),
}

impl Op {
    fn random(rng: &mut ChaCha8Rng) -> Op {
        let (a, cents) = (rng.gen_range(0..ACCOUNTS), rng.gen_range(1..=500));
        match rng.gen_range(0..3) {
            0 => Op::Deposit(a, cents),
            1 => Op::Withdraw(a, cents),
            _ => Op::Transfer(a, (a + rng.gen_range(1..ACCOUNTS)) % ACCOUNTS, cents),
        }
    }

    fn request(&self, accounts: &[String]) -> (String, Value) {
        match *self {
            Op::Deposit(a, cents) => (
                format!("/api/accounts/{}/deposit", accounts[a]),
                json!({ "amountCents": cents }),
            ),
            Op::Withdraw(a, cents) => (
                format!("/api/accounts/{}/withdraw", accounts[a]),
                json!({ "amountCents": cents }),
            ),
            Op::Transfer(from, to, cents) => (
                String::from("/api/transfers"),
                json!({
                    "fromAccountId": accounts[from],
                    "toAccountId": accounts[to],
                    "amountCents": cents,
                }),
            ),
        }
    }
}

fn seed() -> u64 {
    std::env::var("TALLY_MIXED_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

fn accounts() -> Vec<String> {
    (0..ACCOUNTS).map(|_| common::new_account()).collect()
}

/// Every key that landed appears once in the histories (Tally's names each event's id), and
/// both services answer the balance the history sums to, at the same version.
async fn assert_each_key_once_and_balances_agree(
    m: &Mixed,
    accounts: &[String],
    landed: &[String],
) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for account in accounts {
        let events = m.tally.history(account).await;
        let mut sum = 0i64;
        for e in &events {
            let cents = e["amountCents"].as_i64().expect("amountCents");
            sum += match e["type"].as_str().expect("type") {
                "Deposited" | "TransferredIn" => cents,
                "Withdrawn" | "TransferredOut" => -cents,
                other => panic!("unexpected event type {other}"),
            };
            let id = e["eventId"].as_str().expect("eventId").to_owned();
            *seen.entry(id).or_default() += 1;
        }
        let want = (sum, events.len() as u64);
        for s in &m.services {
            assert_eq!(s.balance(account).await, want, "{} on {account}", s.name);
        }
    }
    for key in landed {
        // A transfer's two legs carry its one key.
        let n = seen.get(key).copied().unwrap_or(0);
        assert!(n == 1 || n == 2, "key {key} landed {n} times");
    }
    let total: usize = seen.values().sum();
    let legs: usize = landed.iter().map(|k| seen[k]).sum();
    assert_eq!(total, legs, "events without a landed key: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_either_service_answers_the_first_response_and_lands_once() {
    let Some(m) = Mixed::start().await else {
        return;
    };
    let seed = seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let accounts = accounts();
    let mut landed = Vec::new();
    for i in 0..OPERATIONS {
        let op = Op::random(&mut rng);
        let (path, body) = op.request(&accounts);
        let key = uuid::Uuid::new_v4().to_string();
        let first = &m.services[rng.gen_range(0..2)];
        let retry = &m.services[rng.gen_range(0..2)];
        let a = first.post(&path, &body, &key).await;
        let b = retry.post(&path, &body, &key).await;
        let context = format!(
            "seed {seed}, operation {i} {op:?}: {} answered {} {}, its retry on {} {} {}",
            first.name, a.status, a.text, retry.name, b.status, b.text
        );
        assert_eq!(a.status, b.status, "{context}");
        match a.status {
            StatusCode::OK => {
                assert_eq!(a.body, b.body, "{context}");
                landed.push(key);
            }
            StatusCode::UNPROCESSABLE_ENTITY => {}
            other => panic!("unexpected {other}: {context}"),
        }
    }
    assert!(!landed.is_empty(), "seed {seed} landed nothing");
    assert_each_key_once_and_balances_agree(&m, &accounts, &landed).await;
}

/// Rule: a batch item shares the single routes' keys across the mixed fleet: the replaced
/// service's single write of a key and a Tally batch item with that key and body are one
/// write, whichever comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_item_and_the_replaced_services_write_of_its_key_are_one_write() {
    let Some(m) = Mixed::start().await else {
        return;
    };
    let seed = seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let accounts = accounts();
    let mut landed = Vec::new();
    for i in 0..OPERATIONS {
        let op = Op::random(&mut rng);
        let (path, body) = op.request(&accounts);
        let key = uuid::Uuid::new_v4().to_string();
        let mut item = body.clone();
        match op {
            Op::Deposit(a, _) | Op::Withdraw(a, _) => {
                let kind = if matches!(op, Op::Deposit(..)) {
                    "deposit"
                } else {
                    "withdraw"
                };
                item["type"] = json!(kind);
                item["accountId"] = json!(accounts[a]);
            }
            Op::Transfer(..) => item["type"] = json!("transfer"),
        }
        item["idempotencyKey"] = json!(key);
        let batch = json!({ "items": [item] });
        let single_first = rng.gen_bool(0.5);
        let single = || m.services[0].post(&path, &body, &key);
        let in_batch = || async {
            let r = m.tally.post("/api/batch", &batch, None).await;
            assert_eq!(
                r.status,
                StatusCode::OK,
                "seed {seed} operation {i}: {}",
                r.text
            );
            r.body["results"][0].clone()
        };
        let (a, b) = if single_first {
            let a = single().await;
            (a, in_batch().await)
        } else {
            let b = in_batch().await;
            (single().await, b)
        };
        let context = format!(
            "seed {seed}, operation {i} {op:?}, single first {single_first}: the replaced service answered {} {}, the item {b}",
            a.status, a.text
        );
        assert_eq!(u64::from(a.status.as_u16()), b["status"], "{context}");
        if a.status == StatusCode::OK {
            assert_eq!(a.body, b["body"], "{context}");
            landed.push(key);
        }
    }
    assert!(!landed.is_empty(), "seed {seed} landed nothing");
    assert_each_key_once_and_balances_agree(&m, &accounts, &landed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_sent_to_both_services_at_once_lands_once() {
    let Some(m) = Mixed::start().await else {
        return;
    };
    let accounts = accounts();
    let [reference, tally] = &m.services;
    // Each account opened by the replaced service alone, so Tally must fold its writes.
    let mut keys = Vec::new();
    for account in &accounts {
        let key = uuid::Uuid::new_v4().to_string();
        let r = reference
            .post(
                &format!("/api/accounts/{account}/deposit"),
                &json!({ "amountCents": 1 }),
                &key,
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        keys.push(key);
    }
    for i in 0..RACED_KEYS {
        let key = uuid::Uuid::new_v4().to_string();
        let (path, body) = Op::Deposit(i % ACCOUNTS, 100 + i as i64).request(&accounts);
        let (a, b) = tokio::join!(
            reference.post(&path, &body, &key),
            tally.post(&path, &body, &key)
        );
        // Either may lose the race (a conflict to retry); once both are retried after it,
        // both answer the landed write.
        for r in [&a, &b] {
            assert!(
                r.status == StatusCode::OK || r.status.as_u16() == 409 || r.status.as_u16() == 503,
                "race {i}: {} {}",
                r.status,
                r.text
            );
        }
        let (c, d) = (
            reference.post(&path, &body, &key).await,
            tally.post(&path, &body, &key).await,
        );
        assert_eq!(
            (c.status, d.status),
            (StatusCode::OK, StatusCode::OK),
            "race {i}: {} / {}",
            c.text,
            d.text
        );
        assert_eq!(c.body, d.body, "race {i}");
        keys.push(key);
    }
    assert_each_key_once_and_balances_agree(&m, &accounts, &keys).await;
}

/// A conformance rule of the replaced service, found by probing its binary: it honours a key
/// only when the key parses as a UUID; any other key is taken as no key (a fresh random event
/// id), so its retry writes again. Tally maps such a key to UUIDv5 of the key, so in a mixed
/// fleet only UUID keys are safe to retry across the two (docs/operations.md, "Running a fleet").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replaced_service_takes_a_key_that_is_not_a_uuid_as_no_key() {
    let Some(m) = Mixed::start().await else {
        return;
    };
    let account = common::new_account();
    let (path, body) = (
        format!("/api/accounts/{account}/deposit"),
        json!({ "amountCents": 7 }),
    );
    let key = format!("order-{}", uuid::Uuid::new_v4().simple());
    let [reference, tally] = &m.services;
    for want_version in [1, 2] {
        let r = reference.post(&path, &body, &key).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.body["aggregateVersion"], want_version, "{}", r.text);
    }
    // Tally, joined to the same fleet, finds neither event under the key's id and writes a
    // third; its own retry replays it.
    let first = tally.post(&path, &body, &key).await;
    assert_eq!(first.body["aggregateVersion"], 3, "{}", first.text);
    let again = tally.post(&path, &body, &key).await;
    assert_eq!((again.body.clone(), again.replayed()), (first.body, true));
}

/// A key landed by each service on one account, retried on Tally once both are past its
/// window. The wait is the caller's: `aged_keys` runs this beside its own scenarios and
/// shares their one wait, so the suite pays for it once.
pub(crate) struct KeysLandedByBoth {
    tally: Service,
    replica: TestApp,
    account: String,
    path: String,
    /// Each key, its amount and the first answer it got.
    landed: [(String, i64, Reply); 2],
}

/// Before the wait: the replaced service lands one deposit and a Tally replica joined to it
/// (started with `flags`, a short window among them) another; both services agree; then the
/// replaced service stops, freeing its port and turn for the other tests here. `None` when
/// the replaced service is not configured (skipped outside CI, a failure under `CI=true`).
pub(crate) async fn keys_landed_by_both_services(flags: &[&str]) -> Option<KeysLandedByBoth> {
    let m = Mixed::start_with(flags).await?;
    let [reference, tally] = &m.services;
    let account = common::new_account();
    let path = format!("/api/accounts/{account}/deposit");
    let (by_reference, by_tally) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let (by_reference, by_tally) = (by_reference.to_string(), by_tally.to_string());
    let first = reference
        .post(&path, &json!({ "amountCents": 300 }), &by_reference)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let second = tally
        .post(&path, &json!({ "amountCents": 40 }), &by_tally)
        .await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.text);
    assert_eq!(
        second.body,
        json!({ "balanceCents": 340, "aggregateVersion": 2 })
    );
    let keys = [by_reference.clone(), by_tally.clone()];
    assert_each_key_once_and_balances_agree(&m, std::slice::from_ref(&account), &keys).await;
    let Mixed {
        services: [_, tally],
        tally: replica,
        _reference: reference,
        _turn: turn,
    } = m;
    drop((reference, turn));
    Some(KeysLandedByBoth {
        tally,
        replica,
        account,
        path,
        landed: [(by_reference, 300, first), (by_tally, 40, second)],
    })
}

/// Rule: past its window, a Tally replica in a mixed fleet still replays a write either
/// service landed: its key memory holds every keyed event it folds, the replaced service's
/// too. The fleet as a whole still promises only 90 s, because the replaced service forgets
/// then; that half takes a 90 s wait and is not pinned here.
pub(crate) async fn past_its_window_a_tally_replica_in_a_mixed_fleet_replays_either_services_write(
    s: &KeysLandedByBoth,
) {
    for (key, cents, original) in &s.landed {
        let retry = s
            .tally
            .post(&s.path, &json!({ "amountCents": cents }), key)
            .await;
        assert_eq!(
            (retry.status, &retry.body, retry.replayed()),
            (original.status, &original.body, true),
            "a retry two windows later on Tally: {}",
            retry.text
        );
        let reused = s
            .tally
            .post(&s.path, &json!({ "amountCents": cents + 1 }), key)
            .await;
        assert_eq!(reused.status.as_u16(), 422, "{}", reused.text);
        assert_eq!(
            reused.body["error"], "IDEMPOTENCY_KEY_REUSED",
            "{}",
            reused.text
        );
    }
    // Nothing was written again: each key once, the balance its two deposits.
    let ids: Vec<Value> = s
        .replica
        .history(&s.account)
        .await
        .iter()
        .map(|e| e["eventId"].clone())
        .collect();
    let keys: Vec<Value> = s.landed.iter().map(|(k, _, _)| json!(k)).collect();
    assert_eq!(ids, keys);
    assert_eq!(s.replica.balance(&s.account).await, (340, 2));
}
