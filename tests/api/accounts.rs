//! Opening accounts (`POST /api/accounts`) and explicit accounts (`--accounts explicit`):
//! with explicit accounts money moves only between accounts that exist, and an id nobody
//! opened is a 404 `ACCOUNT_NOT_FOUND` that writes nothing; with implicit accounts (the
//! default) every id is still an account.

use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::store::StoreError;

use crate::common::{
    Reply, TestApp, assert_error, leg, new_account, spawn, test_auth, test_config,
};

async fn explicit() -> TestApp {
    spawn(test_config(&["--accounts", "explicit"]), None, None).await
}

/// Opens an account: the body names it, or (`None`) its id comes from the key.
async fn open(t: &TestApp, account: Option<&str>, key: &str) -> Reply {
    let body = match account {
        Some(id) => json!({ "accountId": id }),
        None => json!({}),
    };
    t.post("/api/accounts", &body, Some(key)).await
}

/// An open's whole answer: 201, the account at version 1 with nothing in it, where to read
/// its balance, the key and the window. Returns the account's id.
#[track_caller]
fn assert_opened(r: &Reply, key: &str, replayed: bool) -> String {
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let id = r.body["accountId"].as_str().expect("accountId").to_owned();
    assert_eq!(
        r.body,
        json!({ "accountId": id, "balanceCents": 0, "aggregateVersion": 1 })
    );
    assert_eq!(
        r.header("location"),
        Some(format!("/api/accounts/{id}/balance").as_str())
    );
    assert_eq!(r.replayed(), replayed, "Idempotent-Replayed of {}", r.text);
    assert_eq!(r.header("idempotency-key"), Some(key));
    assert_eq!(r.header("idempotency-window"), Some("90"));
    id
}

/// Whether the store holds a stream for the account (straight from the store).
async fn stored(t: &TestApp, account: &str) -> bool {
    let id: AccountId = account.parse().expect("account id");
    match t.app.log.details(t.app.identity.key(id)).await {
        Ok(_) => true,
        Err(StoreError::AggregateNotFound) => false,
        Err(e) => panic!("details of {account}: {e}"),
    }
}

/// Item 8's finding, with explicit accounts: a deposit (or withdrawal) to an id nobody
/// opened is refused with 404 `ACCOUNT_NOT_FOUND` (the key and the window, as a rule's
/// refusal), nothing is written, and its balance and history are 404 too.
#[tokio::test]
async fn with_explicit_accounts_money_never_moves_to_an_account_nobody_opened() {
    let t = explicit().await;
    let typo = new_account();
    let r = t.deposit(&typo, 500, Some("typo-1")).await;
    assert_error(&r, 404, "ACCOUNT_NOT_FOUND");
    assert!(r.text.contains(&typo), "names the account: {}", r.text);
    assert_eq!(r.header("idempotency-key"), Some("typo-1"));
    assert_eq!(r.header("idempotency-window"), Some("90"));
    assert_error(
        &t.withdraw(&typo, 1, Some("typo-2")).await,
        404,
        "ACCOUNT_NOT_FOUND",
    );
    for read in ["balance", "history", "balance?minVersion=0"] {
        let r = t.get(&format!("/api/accounts/{typo}/{read}")).await;
        assert_error(&r, 404, "ACCOUNT_NOT_FOUND");
    }
    assert!(!stored(&t, &typo).await, "nothing was written");
    t.shutdown().await;
}

/// A transfer with either leg on an account never opened is 404 and moves nothing: the
/// opened side keeps its balance and version, the other side stays missing.
#[tokio::test]
async fn with_explicit_accounts_a_transfer_with_a_leg_nobody_opened_moves_nothing() {
    let t = explicit().await;
    let payer = assert_opened(&open(&t, None, "payer").await, "payer", false);
    let r = t.deposit(&payer, 1_000, Some("fund")).await;
    assert_eq!(leg(&r.body), (1_000, 2), "{}", r.text);
    let typo = new_account();
    assert_error(
        &t.transfer(&payer, &typo, 100, Some("t-1")).await,
        404,
        "ACCOUNT_NOT_FOUND",
    );
    assert_error(
        &t.transfer(&typo, &payer, 100, Some("t-2")).await,
        404,
        "ACCOUNT_NOT_FOUND",
    );
    let r = t
        .post(
            &format!("/api/accounts/{payer}/transfers"),
            &json!({ "toAccountId": typo, "amountCents": 100 }),
            Some("t-3"),
        )
        .await;
    assert_error(&r, 404, "ACCOUNT_NOT_FOUND");
    assert_eq!(t.balance(&payer).await, (1_000, 2));
    assert!(!stored(&t, &typo).await);
    t.shutdown().await;
}

/// An open is a keyed write: 201 with the account; the same key again replays it (the same
/// account, marked replayed, one event written); without `accountId` the id comes from the
/// key, so a client that lost the answer finds its account by retrying. The account then
/// takes money, and its history starts with the open.
#[tokio::test]
async fn an_open_is_answered_201_and_a_retry_with_its_key_replays_the_same_account() {
    let t = explicit().await;
    let id = assert_opened(&open(&t, None, "signup-7").await, "signup-7", false);
    assert_eq!(
        assert_opened(&open(&t, None, "signup-7").await, "signup-7", true),
        id
    );
    let other = assert_opened(&open(&t, None, "signup-8").await, "signup-8", false);
    assert_ne!(other, id, "another key, another account");

    let r = t.deposit(&id, 250, Some("first-money")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (250, 2));
    assert_eq!(t.balance(&id).await, (250, 2));
    let history: Vec<(Value, Value, Value)> = t
        .history(&id)
        .await
        .iter()
        .map(|e| {
            (
                e["type"].clone(),
                e["amountCents"].clone(),
                e["eventId"].clone(),
            )
        })
        .collect();
    assert_eq!(
        history,
        vec![
            (
                json!("AccountOpened"),
                json!(0),
                json!(test_auth::event_id("signup-7"))
            ),
            (
                json!("Deposited"),
                json!(250),
                json!(test_auth::event_id("first-money"))
            ),
        ]
    );
    t.shutdown().await;
}

/// An open names its account, or finds it taken: an account that exists (opened under
/// another key, or written while accounts were implicit) is 409 `ACCOUNT_EXISTS`, final (no
/// `Retry-After`), and nothing is written. The named account's id is kept as sent.
#[tokio::test]
async fn opening_an_account_that_exists_is_409_account_exists_and_writes_nothing() {
    let t = explicit().await;
    let chosen = new_account();
    assert_eq!(
        assert_opened(&open(&t, Some(&chosen), "mine").await, "mine", false),
        chosen
    );
    let r = open(&t, Some(&chosen), "also-mine").await;
    assert_error(&r, 409, "ACCOUNT_EXISTS");
    assert_eq!(r.header("retry-after"), None, "final: {}", r.text);
    assert_eq!(r.header("idempotency-key"), Some("also-mine"));
    assert_eq!(r.header("idempotency-window"), Some("90"));
    assert_eq!(t.balance(&chosen).await, (0, 1));
    assert_eq!(t.history(&chosen).await.len(), 1);

    // With implicit accounts (the default) opening works too, and a deposit's account exists.
    let implicit = spawn(test_config(&[]), None, None).await;
    let used = new_account();
    assert_eq!(
        implicit.deposit(&used, 5, None).await.status,
        StatusCode::OK
    );
    assert_error(
        &open(&implicit, Some(&used), "late").await,
        409,
        "ACCOUNT_EXISTS",
    );
    assert_eq!(implicit.balance(&used).await, (5, 1));
    implicit.shutdown().await;
    t.shutdown().await;
}

/// With implicit accounts (the default) nothing changes: a deposit to any id lands and
/// creates it, and an id nobody wrote reads as empty.
#[tokio::test]
async fn with_implicit_accounts_every_id_is_still_an_account() {
    let t = spawn(test_config(&[]), None, None).await;
    let fresh = new_account();
    assert_eq!(t.balance(&fresh).await, (0, 0));
    let r = t.deposit(&fresh, 100, None).await;
    assert_eq!(leg(&r.body), (100, 1), "{}", r.text);
    let opened = assert_opened(&open(&t, None, "k").await, "k", false);
    assert_eq!(leg(&t.deposit(&opened, 7, None).await.body), (7, 2));
    t.shutdown().await;
}

/// Accounts that exist when a fleet turns explicit stay open: the demo accounts (seeded
/// create-only) and any account written while accounts were implicit.
#[tokio::test]
async fn accounts_written_before_explicit_accounts_and_the_demo_accounts_stay_open() {
    let implicit = spawn(test_config(&[]), None, None).await;
    let earlier = new_account();
    assert_eq!(
        implicit.deposit(&earlier, 40, None).await.status,
        StatusCode::OK
    );
    let store = implicit.app.log.clone();
    // The harness turns seeding off; this replica seeds (and, like the start-up suite's,
    // runs without authentication).
    let seeding = <tally::config::Config as clap::Parser>::parse_from([
        "tally",
        "--listen",
        "127.0.0.1:0",
        "--accounts",
        "explicit",
    ]);
    let t = spawn(seeding, Some(store), None).await;
    t.app.started().await;
    let r = t.deposit(&earlier, 2, None).await;
    assert_eq!(leg(&r.body), (42, 2), "{}", r.text);
    let accounts = t.get("/api/accounts").await;
    let alice = accounts.body["accounts"][0]["id"]
        .as_str()
        .expect("the demo accounts are listed")
        .to_owned();
    let r = t.deposit(&alice, 100, None).await;
    assert_eq!(leg(&r.body), (50_100, 2), "{}", r.text);
    t.shutdown().await;
    implicit.shutdown().await;
}

/// `POST /api/accounts` is a write: its body is checked like any write's (an unknown field,
/// an id that is not a UUID, or null), and nothing is written for a refused one; other methods than
/// GET, HEAD and POST are 405 naming all three.
#[tokio::test]
async fn a_bad_open_is_refused_and_writes_nothing() {
    let t = explicit().await;
    let bad = json!({ "accountId": "nope" });
    let r = t.post("/api/accounts", &bad, Some("b-1")).await;
    assert_error(&r, 422, "VALIDATION_ERROR");
    // A null names no account; it is not taken as "derive one from the key".
    let r = t
        .post("/api/accounts", &json!({ "accountId": null }), Some("b-1"))
        .await;
    assert_error(&r, 422, "VALIDATION_ERROR");
    let named = new_account();
    let r = t
        .post("/api/accounts", &json!({ "id": named }), Some("b-2"))
        .await;
    assert_error(&r, 422, "VALIDATION_ERROR");
    assert!(!stored(&t, &named).await);
    // Nor was an account derived from either key opened: the same keys open them now.
    assert_opened(&open(&t, None, "b-1").await, "b-1", false);
    assert_opened(&open(&t, None, "b-2").await, "b-2", false);
    let r = t
        .client
        .put(t.url("/api/accounts"))
        .send()
        .await
        .expect("PUT sent");
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        r.headers().get("allow").and_then(|v| v.to_str().ok()),
        Some("GET, HEAD, POST")
    );
    t.shutdown().await;
}

/// A device's run to an account never opened (explicit accounts) is 404 and lands nothing;
/// the same run, resent once the account is opened, lands once.
#[tokio::test]
async fn with_explicit_accounts_a_device_run_waits_for_its_account_to_be_opened() {
    let t = explicit().await;
    let account = new_account();
    let device = uuid::Uuid::new_v4();
    let run = json!({ "accountId": account, "events": [
        { "clientSeq": 1, "type": "deposit", "amountCents": 300 },
    ]});
    let sync = || async {
        let mut req = reqwest::Client::new()
            .post(t.url(&format!("/api/devices/{device}/sync")))
            .json(&run);
        if test_auth::on() {
            let claims = json!({ "sub": device.to_string(), "scope": "devices:sync" });
            req = req.bearer_auth(test_auth::token(claims));
        }
        crate::common::read(req.send().await.expect("sync sent")).await
    };
    assert_error(&sync().await, 404, "ACCOUNT_NOT_FOUND");
    assert!(!stored(&t, &account).await);

    assert_opened(
        &open(&t, Some(&account), "for-the-till").await,
        "for-the-till",
        false,
    );
    let r = sync().await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["status"], "synced");
    assert_eq!(r.body["aggregateVersion"], 2);
    let r = sync().await;
    assert_eq!(r.body["status"], "alreadySynced", "{}", r.text);
    assert_eq!(t.balance(&account).await, (300, 2));
    t.shutdown().await;
}
