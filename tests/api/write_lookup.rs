//! `GET /api/accounts/{id}/writes/{idempotencyKey}`: a write looked up by its key without
//! resending it. Found: 200 with the write's original status and body, on any replica,
//! inside the window or past it within the retention, a transfer from either account. Not
//! found: 404 `KEY_NOT_FOUND` only once proven. Still running: retryable, never 404.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreResult,
};
use tokio::sync::{Notify, Semaphore};
use uuid::Uuid;

use crate::common::hand_clocks;
use crate::common::hooked_log::{Around, HookedLog};
use crate::common::{
    Reply, TestApp, assert_error, funded, new_account, read, spawn, spawn_default,
    spawn_fleet_in_memory, test_auth, test_config,
};

/// The lookup's path for `key` on `account`, the key percent-encoded whole.
fn lookup_path(account: &str, key: &str) -> String {
    let key = utf8_percent_encode(key, NON_ALPHANUMERIC);
    format!("/api/accounts/{account}/writes/{key}")
}

async fn lookup(t: &TestApp, account: &str, key: &str) -> Reply {
    t.get(&lookup_path(account, key)).await
}

/// Asserts a lookup found `original`: 200, its status and its body, and nothing that
/// would read as the write's own answer (no replay mark).
#[track_caller]
fn assert_found(r: &Reply, original: &Reply) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body,
        json!({ "status": original.status.as_u16(), "body": original.body }),
        "the original answer: {}",
        original.text
    );
    assert_eq!(r.header("idempotent-replayed"), None);
}

/// Rule: a landed write is found with its original status and body, on the replica that
/// wrote it and on another over the same store, whatever the account did since; an open
/// is found with its 201.
#[tokio::test]
async fn a_landed_write_is_found_with_its_original_answer_on_any_replica() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let account = new_account();
    let key = "order-42/payment#1?";
    let deposit = a.deposit(&account, 500, Some(key)).await;
    assert_eq!(deposit.status, StatusCode::OK, "{}", deposit.text);
    // The account moves on: the lookup still answers what the deposit did.
    assert_eq!(a.deposit(&account, 7, None).await.status, StatusCode::OK);
    let withdrawal = a.withdraw(&account, 20, Some("w-1")).await;
    assert_eq!(withdrawal.status, StatusCode::OK, "{}", withdrawal.text);
    for t in [a, b] {
        assert_found(&lookup(t, &account, key).await, &deposit);
        assert_found(&lookup(t, &account, "w-1").await, &withdrawal);
    }
    let opened = a.post("/api/accounts", &json!({}), Some("open-once")).await;
    assert_eq!(opened.status, StatusCode::CREATED, "{}", opened.text);
    let id = opened.body["accountId"].as_str().expect("accountId");
    for t in [a, b] {
        assert_found(&lookup(t, id, "open-once").await, &opened);
    }
    // Looking up wrote nothing.
    assert_eq!(b.balance(&account).await, (487, 3));
    for t in fleet {
        t.shutdown().await;
    }
}

/// Rule: a transfer is found from either of its accounts, with both legs as it answered.
#[tokio::test]
async fn a_transfer_is_found_from_either_account() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let (from, to) = (funded(a, 1_000).await, funded(a, 50).await);
    let transfer = a.transfer(&from, &to, 300, Some("pay-7")).await;
    assert_eq!(transfer.status, StatusCode::OK, "{}", transfer.text);
    assert!(transfer.body["to"].is_object(), "{}", transfer.text);
    // Both accounts move on after it.
    assert_eq!(a.deposit(&from, 1, None).await.status, StatusCode::OK);
    assert_eq!(a.deposit(&to, 1, None).await.status, StatusCode::OK);
    for t in [a, b] {
        for account in [&from, &to] {
            assert_found(&lookup(t, account, "pay-7").await, &transfer);
        }
    }
    for t in fleet {
        t.shutdown().await;
    }
}

/// Rule: a key is 404 `KEY_NOT_FOUND` once the replica has caught up and found no write
/// under it: a key never sent, one sent on another account, and one whose write a rule
/// refused (it wrote nothing). On the replica that wrote and on one that never saw it.
#[tokio::test]
async fn a_key_that_never_landed_on_the_account_is_404_once_caught_up() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let (account, elsewhere) = (funded(a, 100).await, new_account());
    let landed = a.deposit(&account, 5, Some("here")).await;
    assert_eq!(landed.status, StatusCode::OK, "{}", landed.text);
    let refused = a.withdraw(&account, 1_000, Some("refused")).await;
    assert_error(&refused, 422, "INSUFFICIENT_FUNDS");
    for t in [a, b] {
        for (acct, key) in [
            (&account, "never-sent"),
            (&account, "refused"),
            (&elsewhere, "here"),
        ] {
            assert_error(&lookup(t, acct, key).await, 404, "KEY_NOT_FOUND");
        }
        // An account never written is caught up at version 0: nothing landed there.
        assert_error(
            &lookup(t, &new_account(), "here").await,
            404,
            "KEY_NOT_FOUND",
        );
    }
    // A key found on its own account all along.
    assert_found(&lookup(b, &account, "here").await, &landed);
    for t in fleet {
        t.shutdown().await;
    }
}

/// Rule: a malformed key is 400 as in the header, and the route takes no query.
#[tokio::test]
async fn a_malformed_key_or_a_query_is_400() {
    let t = spawn_default().await;
    let account = new_account();
    for path in [
        format!("/api/accounts/{account}/writes/has%20space"),
        format!("/api/accounts/{account}/writes/%C3%A9"),
        format!("/api/accounts/{account}/writes/%FF"),
        format!("/api/accounts/{account}/writes/"),
        format!("/api/accounts/{account}/writes/{}", "k".repeat(256)),
    ] {
        assert_error(&t.get(&path).await, 400, "INVALID_IDEMPOTENCY_KEY");
    }
    let r = t
        .get(&format!("/api/accounts/{account}/writes/k?x=1"))
        .await;
    assert_error(&r, 400, "BAD_QUERY");
    let r = t.get("/api/accounts/nope/writes/k").await;
    assert_error(&r, 400, "INVALID_ID");
    t.shutdown().await;
}

/// Holds the next write before it reaches the store, once armed, until released.
#[derive(Clone)]
struct HoldNextWrite(Arc<Hold>);

struct Hold {
    armed: AtomicBool,
    /// Signalled once the armed write is held.
    held: Notify,
    /// A permit lets it go.
    release: Semaphore,
}

impl HoldNextWrite {
    fn new() -> Self {
        Self(Arc::new(Hold {
            armed: AtomicBool::new(false),
            held: Notify::new(),
            release: Semaphore::new(0),
        }))
    }
}

#[async_trait]
impl Around for HoldNextWrite {
    async fn before_write(&self) {
        if self.0.armed.swap(false, Ordering::SeqCst) {
            self.0.held.notify_one();
            self.0.release.acquire().await.expect("open").forget();
        }
    }
}

/// Rule: a write still running on this replica is never answered 404: the lookup is a
/// retryable 409 until it lands, then it is found.
#[tokio::test]
async fn a_key_whose_write_is_still_running_is_retryable_never_404() {
    let hold = HoldNextWrite::new();
    let store: SharedLog = Arc::new(HookedLog::around(Arc::new(MemoryLog::new()), hold.clone()));
    let t = Arc::new(spawn(test_config(&[]), Some(store), None).await);
    let account = new_account();
    hold.0.armed.store(true, Ordering::SeqCst);
    let write = tokio::spawn({
        let (t, account) = (t.clone(), account.clone());
        async move { t.deposit(&account, 40, Some("slow")).await }
    });
    hold.0.held.notified().await;
    let r = lookup(&t, &account, "slow").await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    hold.0.release.add_permits(1);
    let landed = write.await.expect("the write's task");
    assert_eq!(landed.status, StatusCode::OK, "{}", landed.text);
    assert_found(&lookup(&t, &account, "slow").await, &landed);
    Arc::into_inner(t).expect("one owner").shutdown().await;
}

/// A store whose reads and details of one aggregate stop at a version, as a follower
/// that lags does; writes and the leader's tip see the store as it is.
struct LaggingReads {
    inner: SharedLog,
    lag: parking_lot::Mutex<Option<(AggregateKey, u64)>>,
}

impl LaggingReads {
    fn upto(&self, key: AggregateKey) -> Option<u64> {
        self.lag.lock().filter(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

#[async_trait]
impl EventLog for LaggingReads {
    async fn write(&self, client_id: ClientId, w: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        self.inner.write(client_id, w).await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let mut page = self.inner.read(key, filter).await?;
        if let Some(upto) = self.upto(key) {
            page.batches.retain(|b| b.version <= upto);
            page.next_version = None;
        }
        Ok(page)
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let mut details = self.inner.details(key).await?;
        if let Some(upto) = self.upto(key) {
            details.max_version = details.max_version.min(upto);
        }
        Ok(details)
    }

    async fn leader_tip(&self, client_id: ClientId, key: AggregateKey) -> StoreResult<u64> {
        self.inner.leader_tip(client_id, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule: a replica whose read of the account lags the store's tip never answers 404: its
/// lookup is retryable until its read reaches the tip, then the write is found.
#[tokio::test]
async fn a_lookup_on_a_read_that_lags_the_tip_is_retryable_never_404() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let lagging = Arc::new(LaggingReads {
        inner: store.clone(),
        lag: parking_lot::Mutex::new(None),
    });
    let a = spawn(test_config(&[]), Some(store), None).await;
    let b = spawn(test_config(&[]), Some(lagging.clone()), None).await;
    let account = new_account();
    let key = b
        .app
        .identity
        .key(AccountId(account.parse().expect("a UUID")));
    // Before anything lands, b's reads of the account stop at version 0.
    *lagging.lag.lock() = Some((key, 0));
    let landed = a.deposit(&account, 40, Some("lagged")).await;
    assert_eq!(landed.status, StatusCode::OK, "{}", landed.text);
    let r = lookup(&b, &account, "lagged").await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    // An unknown key is no more provable there than a landed one.
    assert_error(&lookup(&b, &account, "never-sent").await, 409, "CONFLICT");
    *lagging.lag.lock() = None;
    assert_found(&lookup(&b, &account, "lagged").await, &landed);
    assert_error(
        &lookup(&b, &account, "never-sent").await,
        404,
        "KEY_NOT_FOUND",
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Rule: a key past the window but inside the retention is still found, on the replica
/// that wrote it and on a fresh one, a transfer from either account.
#[tokio::test]
async fn a_key_past_the_window_inside_the_retention_is_found() {
    let (server_clock, store) = hand_clocks::store_at(hand_clocks::SERVER_START_MS);
    let (a, clock) = hand_clocks::spawn_on_hand_clock(&[], store.clone()).await;
    let (from, to) = (funded(&a, 1_000).await, funded(&a, 10).await);
    let deposit = a.deposit(&from, 25, Some("early-deposit")).await;
    let transfer = a.transfer(&from, &to, 100, Some("early-transfer")).await;
    assert_eq!(transfer.status, StatusCode::OK, "{}", transfer.text);
    // Past the 90 s window, by the writer's clock and by the store's.
    clock.advance_ms(91_000);
    server_clock.advance(91_000);
    let account = AccountId(from.parse().expect("a UUID"));
    let event_id: Uuid = test_auth::event_id("early-deposit")
        .parse()
        .expect("a UUID");
    assert_eq!(
        a.app.projection.warm_lookup(account, event_id.as_u128()),
        None,
        "the window's entry is gone: the key is remembered past it"
    );
    let fresh = spawn(test_config(&[]), Some(store.clone()), None).await;
    for t in [&a, &fresh] {
        assert_found(&lookup(t, &from, "early-deposit").await, &deposit);
        for account in [&from, &to] {
            assert_found(&lookup(t, account, "early-transfer").await, &transfer);
        }
    }
    a.shutdown().await;
    fresh.shutdown().await;
}

/// Rule: a transfer found on one account whose other account no longer remembers the key
/// (a cap made it forget) answers that leg as a retry of the transfer would: the account's
/// balance now, read at the store's tip. On the account that forgot, the key is not found.
#[tokio::test]
async fn a_transfer_leg_whose_account_forgot_the_key_is_its_balance_now() {
    let (server_clock, store) = hand_clocks::store_at(hand_clocks::SERVER_START_MS);
    let flags = ["--idempotency-max-keys-per-account", "3"];
    let (a, clock) = hand_clocks::spawn_on_hand_clock(&flags, store).await;
    let (from, to) = (funded(&a, 1_000).await, new_account());
    let transfer = a.transfer(&from, &to, 100, Some("then-forgotten")).await;
    assert_eq!(transfer.status, StatusCode::OK, "{}", transfer.text);
    // Three more keys on the payee: over its cap, it forgets its oldest.
    for cents in [1, 2, 3] {
        assert_eq!(a.deposit(&to, cents, None).await.status, StatusCode::OK);
    }
    clock.advance_ms(91_000);
    server_clock.advance(91_000);
    let r = lookup(&a, &from, "then-forgotten").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["status"], 200);
    assert_eq!(r.body["body"]["from"], transfer.body["from"], "{}", r.text);
    assert_eq!(
        r.body["body"]["to"],
        json!({"balanceCents": 106, "aggregateVersion": 4}),
        "the payee now, not when it was paid ({})",
        transfer.body["to"]
    );
    assert_error(
        &lookup(&a, &to, "then-forgotten").await,
        404,
        "KEY_NOT_FOUND",
    );
    a.shutdown().await;
}

/// Rule: a lookup asks what reading the account's balance asks, and refuses what it
/// refuses; keys are their caller's, so another caller's lookup of the same key finds
/// nothing; a transfer shows its caller the legs its write showed.
#[tokio::test]
async fn a_lookup_needs_what_a_balance_read_needs_and_finds_only_the_callers_keys() {
    let mut flags = test_auth::flags(&test_auth::secret_file());
    flags.push("--auth-failures-per-minute");
    flags.push("0");
    let t = spawn(test_config(&flags), None, None).await;
    // A client of its own: the harness's may send a token of its own on every request.
    let http = reqwest::Client::new();
    let (mine, payee) = (new_account(), new_account());
    let alice = test_auth::token(json!({"sub": "alice", "accounts": [mine]}));
    let send = |tok: Option<String>, path: String, body: Option<Value>, key: Option<&str>| {
        let mut req = match &body {
            Some(b) => http.post(t.url(&path)).json(b),
            None => http.get(t.url(&path)),
        };
        if let Some(tok) = tok {
            req = req.bearer_auth(tok);
        }
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        async move { read(req.send().await.expect("sent")).await }
    };
    let deposit = send(
        Some(alice.clone()),
        format!("/api/accounts/{mine}/deposit"),
        Some(json!({"amountCents": 900})),
        Some("k-1"),
    )
    .await;
    assert_eq!(deposit.status, StatusCode::OK, "{}", deposit.text);
    let found = send(Some(alice.clone()), lookup_path(&mine, "k-1"), None, None).await;
    assert_found(&found, &deposit);

    let refused = [
        None,
        Some(test_auth::token(
            json!({"sub": "alice", "scope": "accounts:write"}),
        )),
        Some(test_auth::token(
            json!({"sub": "alice", "accounts": [payee]}),
        )),
    ];
    for tok in refused {
        let balance = send(
            tok.clone(),
            format!("/api/accounts/{mine}/balance"),
            None,
            None,
        )
        .await;
        assert!(balance.status.is_client_error(), "{}", balance.text);
        let r = send(tok, lookup_path(&mine, "k-1"), None, None).await;
        assert_error(&r, balance.status.as_u16(), balance.error_code());
        assert_eq!(
            r.header("www-authenticate"),
            balance.header("www-authenticate")
        );
    }
    // Bob may read every account, but the key he names is his own: nothing of his landed.
    let bob = test_auth::token(json!({"sub": "bob"}));
    let r = send(Some(bob), lookup_path(&mine, "k-1"), None, None).await;
    assert_error(&r, 404, "KEY_NOT_FOUND");

    // Alice may not read the payee: her transfer's answer, and its lookup, show her leg.
    let transfer = send(
        Some(alice.clone()),
        format!("/api/accounts/{mine}/transfers"),
        Some(json!({"toAccountId": payee, "amountCents": 100})),
        Some("pay-1"),
    )
    .await;
    assert_eq!(transfer.status, StatusCode::OK, "{}", transfer.text);
    assert_eq!(transfer.body.get("to"), None, "{}", transfer.text);
    let r = send(Some(alice.clone()), lookup_path(&mine, "pay-1"), None, None).await;
    assert_found(&r, &transfer);
    let r = send(Some(alice), lookup_path(&payee, "pay-1"), None, None).await;
    assert_error(&r, 403, "FORBIDDEN");
    t.shutdown().await;
}
