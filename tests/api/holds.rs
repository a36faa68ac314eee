//! Black box: holds (`--holds true`). Money is reserved by a placement, then posted (in
//! part or whole, out of the account or to a destination), voided or expired, exactly once;
//! debits and new holds take only what is available; every refusal writes nothing; a replica
//! with holds off refuses what it cannot fold; a cold replica folds holds as a warm one does.

use crate::common;

use common::hand_clocks::{self, SERVER_START_MS};
use common::{Reply, TestApp, assert_error, new_account, observe, read, spawn, test_config};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::account::holds::MAX_HOLD_EXPIRY_SECS;
use tally::projection::checkpoint::Checkpoint;
use tally::store::memory::MemoryLog;
use tally::store::{SharedLog, read_whole};

const HOLDS_ON: &[&str] = &["--holds", "true"];

async fn holds_app() -> TestApp {
    spawn(test_config(HOLDS_ON), None, None).await
}

async fn place(t: &TestApp, account: &str, body: &Value, key: Option<&str>) -> Reply {
    t.post(&format!("/api/accounts/{account}/holds"), body, key)
        .await
}

/// Places a hold of `cents` on `account` and returns its id.
async fn placed(t: &TestApp, account: &str, body: Value) -> String {
    let r = place(t, account, &body, None).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    r.body["holdId"].as_str().expect("holdId").to_owned()
}

async fn post_hold(
    t: &TestApp,
    account: &str,
    hold: &str,
    body: &Value,
    key: Option<&str>,
) -> Reply {
    t.post(
        &format!("/api/accounts/{account}/holds/{hold}/post"),
        body,
        key,
    )
    .await
}

async fn void_hold(t: &TestApp, account: &str, hold: &str, key: Option<&str>) -> Reply {
    t.post(
        &format!("/api/accounts/{account}/holds/{hold}/void"),
        &json!({}),
        key,
    )
    .await
}

async fn get_hold(t: &TestApp, account: &str, hold: &str) -> Reply {
    t.get(&format!("/api/accounts/{account}/holds/{hold}"))
        .await
}

/// `(balanceCents, availableCents, heldCents)` of the balance read.
async fn amounts(t: &TestApp, account: &str) -> (i64, i64, i64) {
    let r = t.get(&format!("/api/accounts/{account}/balance")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let n = |f: &str| {
        r.body[f]
            .as_i64()
            .unwrap_or_else(|| panic!("{f}: {}", r.text))
    };
    (n("balanceCents"), n("availableCents"), n("heldCents"))
}

/// A replica with holds on, and an account on it with one deposit of `cents`.
async fn funded_app(cents: i64) -> (TestApp, String) {
    let t = holds_app().await;
    let account = funded(&t, cents).await;
    (t, account)
}

/// An account on `t` with one deposit of `cents`.
async fn funded(t: &TestApp, cents: i64) -> String {
    common::funded(t, cents).await
}

/// The `type` of every history event.
fn types(history: &[Value]) -> Vec<&str> {
    history
        .iter()
        .map(|e| e["type"].as_str().unwrap_or(""))
        .collect()
}

/// Rule: a placement answers 201 with the hold and its Location, reserves the money, and a
/// retry under its key replays the same status and body, marked; the key with another body
/// is refused and writes nothing.
#[tokio::test]
async fn a_placement_reserves_money_and_its_retry_replays_the_same_answer() {
    let (t, account) = funded_app(100).await;
    let key = uuid::Uuid::new_v4().to_string();
    let first = place(&t, &account, &json!({"amountCents": 30}), Some(&key)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    assert!(!first.replayed());
    let hold = first.body["holdId"].as_str().expect("holdId").to_owned();
    assert_eq!(
        hold,
        common::test_auth::event_id(&key),
        "a hold's id is its key's event id"
    );
    assert_eq!(first.body["status"], "open");
    assert_eq!(first.body["amountCents"], 30);
    assert_eq!(
        (
            first.body["balanceCents"].as_i64(),
            first.body["aggregateVersion"].as_u64()
        ),
        (Some(100), Some(2)),
        "a placement moves no money"
    );
    assert_eq!(
        first.header("location"),
        Some(format!("/api/accounts/{account}/holds/{hold}").as_str())
    );
    assert_eq!(amounts(&t, &account).await, (100, 70, 30));

    let again = place(&t, &account, &json!({"amountCents": 30}), Some(&key)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text);
    assert!(again.replayed(), "a retry is marked as a replay");
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));

    let before = observe(&t, &account).await;
    let other = place(&t, &account, &json!({"amountCents": 31}), Some(&key)).await;
    assert_error(&other, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(
        observe(&t, &account).await,
        before,
        "a reused key wrote something"
    );
    assert_eq!(
        amounts(&t, &account).await,
        (100, 70, 30),
        "one hold, not two"
    );

    let shown = get_hold(&t, &account, &hold).await;
    assert_eq!(shown.status, StatusCode::OK, "{}", shown.text);
    assert_eq!(shown.body["status"], "open");
    assert_eq!(shown.body["amountCents"], 30);
    assert_eq!(shown.body["placedVersion"], 2);
    let list = t.get(&format!("/api/accounts/{account}/holds")).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text);
    assert_eq!(list.body["holds"].as_array().map(Vec::len), Some(1));
    assert_eq!(list.body["holds"][0]["holdId"], hold.as_str());
    assert_eq!(
        (
            &list.body["heldCents"],
            &list.body["availableCents"],
            &list.body["balanceCents"]
        ),
        (&json!(30), &json!(70), &json!(100))
    );
    t.shutdown().await;
}

/// Rule: a post and a void are keyed writes like any other: a retry replays the same status
/// and body, marked, and the key with another body (or on another hold) is refused.
#[tokio::test]
async fn a_post_and_a_void_replay_on_retry_and_refuse_their_key_on_another_body() {
    let (t, account) = funded_app(100).await;
    let a = placed(&t, &account, json!({"amountCents": 40})).await;
    let b = placed(&t, &account, json!({"amountCents": 20})).await;

    let post = post_hold(
        &t,
        &account,
        &a,
        &json!({"amountCents": 25}),
        Some("post-a"),
    )
    .await;
    assert_eq!(post.status, StatusCode::OK, "{}", post.text);
    assert_eq!(post.body["status"], "posted");
    assert_eq!(post.body["amountCents"], 25);
    assert_eq!(post.body["holdId"], a.as_str());
    assert_eq!(post.body["balanceCents"], 75);
    let again = post_hold(
        &t,
        &account,
        &a,
        &json!({"amountCents": 25}),
        Some("post-a"),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(again.replayed() && !post.replayed());
    assert_eq!(again.body, post.body);

    let void = void_hold(&t, &account, &b, Some("void-b")).await;
    assert_eq!(void.status, StatusCode::OK, "{}", void.text);
    assert_eq!(void.body["status"], "voided");
    assert_eq!(void.body["balanceCents"], 75, "a void moves no money");
    let again = void_hold(&t, &account, &b, Some("void-b")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(again.replayed());
    assert_eq!(again.body, void.body);

    let before = observe(&t, &account).await;
    let r = post_hold(
        &t,
        &account,
        &a,
        &json!({"amountCents": 24}),
        Some("post-a"),
    )
    .await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    let r = t.deposit(&account, 5, Some("void-b")).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    let c = placed(&t, &account, json!({"amountCents": 1})).await;
    let before_c = observe(&t, &account).await;
    let r = void_hold(&t, &account, &c, Some("void-b")).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(
        observe(&t, &account).await,
        before_c,
        "a reused key wrote something"
    );
    assert_eq!(before.0, before_c.0);
    assert_eq!(amounts(&t, &account).await, (75, 74, 1));
    t.shutdown().await;
}

/// Rule: open holds keep their money: a withdrawal, a transfer (both routes) or a new hold
/// over the available amount is refused 422 naming what is available and held, and writes
/// nothing; up to the available amount each goes through.
#[tokio::test]
async fn debits_and_new_holds_take_only_the_available_amount_and_a_refusal_writes_nothing() {
    let (t, account) = funded_app(100).await;
    let other = new_account();
    placed(&t, &account, json!({"amountCents": 60})).await;
    let before = observe(&t, &account).await;
    let refusals = [
        t.withdraw(&account, 41, None).await,
        t.transfer(&account, &other, 41, None).await,
        t.post(
            &common::account_transfer_path(&account),
            &json!({"toAccountId": other, "amountCents": 41}),
            None,
        )
        .await,
        place(&t, &account, &json!({"amountCents": 41}), None).await,
    ];
    for r in &refusals {
        assert_error(r, 422, "INSUFFICIENT_FUNDS");
        assert_eq!(r.body["availableCents"], 40, "{}", r.text);
        assert_eq!(r.body["heldCents"], 60, "{}", r.text);
    }
    assert_eq!(
        observe(&t, &account).await,
        before,
        "a refusal wrote something"
    );
    assert_eq!(
        t.balance(&other).await,
        (0, 0),
        "a refused transfer credited its destination"
    );

    let r = t.withdraw(&account, 15, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = t.transfer(&account, &other, 15, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = place(&t, &account, &json!({"amountCents": 10}), None).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    assert_eq!(amounts(&t, &account).await, (70, 0, 70));
    let r = t.withdraw(&account, 1, None).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(
        (&r.body["availableCents"], &r.body["heldCents"]),
        (&json!(0), &json!(70))
    );
    t.shutdown().await;
}

/// Rule: a post of part of a hold takes that part out of the balance and releases the rest;
/// a post with no amount takes the whole hold; a post over the held amount is refused.
#[tokio::test]
async fn a_post_of_part_takes_that_part_and_releases_the_rest() {
    let (t, account) = funded_app(100).await;
    let part = placed(&t, &account, json!({"amountCents": 50})).await;
    let whole = placed(&t, &account, json!({"amountCents": 20})).await;
    assert_eq!(amounts(&t, &account).await, (100, 30, 70));

    let before = observe(&t, &account).await;
    let r = post_hold(&t, &account, &part, &json!({"amountCents": 51}), None).await;
    assert_error(&r, 422, "HOLD_AMOUNT_EXCEEDED");
    assert_eq!(
        observe(&t, &account).await,
        before,
        "a refused post wrote something"
    );

    let r = post_hold(&t, &account, &part, &json!({"amountCents": 30}), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        amounts(&t, &account).await,
        (70, 50, 20),
        "the other 20 are released"
    );
    let shown = get_hold(&t, &account, &part).await;
    assert_eq!(shown.body["status"], "posted");
    assert_eq!(shown.body["amountCents"], 50, "the hold as placed");
    assert_eq!(shown.body["postedCents"], 30);

    let r = post_hold(&t, &account, &whole, &json!({}), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["amountCents"], 20, "no amount: the whole hold");
    assert_eq!(amounts(&t, &account).await, (50, 50, 0));
    let history = t.history(&account).await;
    assert_eq!(
        types(&history),
        [
            "Deposited",
            "HoldPlaced",
            "HoldPlaced",
            "HoldPosted",
            "HoldPosted"
        ]
    );
    assert_eq!(history[3]["amountCents"], 30);
    assert_eq!(history[3]["holdId"], part.as_str());
    t.shutdown().await;
}

/// Rule: a post of a hold with a destination moves the money there in one write: the
/// source's `HoldPosted` and the destination's `TransferredIn` commit together, and both
/// balances and histories show it.
#[tokio::test]
async fn a_post_to_a_destination_moves_the_money_in_one_write_with_history_on_both() {
    let (t, account) = funded_app(100).await;
    let dest = funded(&t, 7).await;
    let hold = placed(
        &t,
        &account,
        json!({"amountCents": 60, "toAccountId": dest}),
    )
    .await;
    let shown = get_hold(&t, &account, &hold).await;
    assert_eq!(shown.body["toAccountId"], dest.as_str());
    assert_eq!(
        t.balance(&dest).await,
        (7, 1),
        "a placement credits nothing yet"
    );

    let r = post_hold(&t, &account, &hold, &json!({"amountCents": 45}), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(amounts(&t, &account).await, (55, 55, 0));
    assert_eq!(t.balance(&dest).await, (52, 2));

    let source = t.history(&account).await;
    let target = t.history(&dest).await;
    let out = source.last().expect("an event");
    let into = target.last().expect("an event");
    assert_eq!(out["type"], "HoldPosted");
    assert_eq!(out["amountCents"], 45);
    assert_eq!(into["type"], "TransferredIn");
    assert_eq!(into["amountCents"], 45);
    assert_eq!(into["fromAccountId"], account.as_str());
    assert_eq!(
        out["timestamp"], into["timestamp"],
        "both legs commit in one write"
    );
    t.shutdown().await;
}

/// Rule: a hold resolves once: a second post or void, under a new key, is 409
/// `HOLD_RESOLVED` naming how it resolved first, and writes nothing.
#[tokio::test]
async fn a_second_resolution_of_any_kind_is_refused_naming_the_first() {
    let (t, account) = funded_app(100).await;
    let posted = placed(&t, &account, json!({"amountCents": 10})).await;
    let voided = placed(&t, &account, json!({"amountCents": 10})).await;
    assert_eq!(
        post_hold(&t, &account, &posted, &json!({"amountCents": 4}), None)
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        void_hold(&t, &account, &voided, None).await.status,
        StatusCode::OK
    );
    let before = observe(&t, &account).await;
    for (hold, first) in [(&posted, "posted"), (&voided, "voided")] {
        let r = post_hold(&t, &account, hold, &json!({}), None).await;
        assert_error(&r, 409, "HOLD_RESOLVED");
        assert_eq!(r.body["resolution"], first, "{}", r.text);
        let r = post_hold(&t, &account, hold, &json!({"amountCents": 1}), None).await;
        assert_error(&r, 409, "HOLD_RESOLVED");
        assert_eq!(r.body["resolution"], first, "{}", r.text);
        let r = void_hold(&t, &account, hold, None).await;
        assert_error(&r, 409, "HOLD_RESOLVED");
        assert_eq!(r.body["resolution"], first, "{}", r.text);
        let shown = get_hold(&t, &account, hold).await;
        assert_eq!(shown.body["status"], first);
    }
    assert_eq!(
        observe(&t, &account).await,
        before,
        "a second resolution wrote something"
    );
    t.shutdown().await;
}

/// Rule: a hold the account never had is 404 `HOLD_NOT_FOUND` for a read, a post and a
/// void, and nothing is written; so is a hold of another account.
#[tokio::test]
async fn an_unknown_hold_is_not_found_and_nothing_is_written() {
    let (t, account) = funded_app(100).await;
    let elsewhere = funded(&t, 100).await;
    let theirs = placed(&t, &elsewhere, json!({"amountCents": 5})).await;
    let before = observe(&t, &account).await;
    for hold in [uuid::Uuid::new_v4().to_string(), theirs] {
        assert_error(&get_hold(&t, &account, &hold).await, 404, "HOLD_NOT_FOUND");
        let r = post_hold(&t, &account, &hold, &json!({}), None).await;
        assert_error(&r, 404, "HOLD_NOT_FOUND");
        let r = post_hold(&t, &account, &hold, &json!({"amountCents": 1}), None).await;
        assert_error(&r, 404, "HOLD_NOT_FOUND");
        assert_error(
            &void_hold(&t, &account, &hold, None).await,
            404,
            "HOLD_NOT_FOUND",
        );
    }
    assert_eq!(
        observe(&t, &account).await,
        before,
        "an unknown hold's write wrote something"
    );
    assert_eq!(amounts(&t, &elsewhere).await, (100, 95, 5));
    t.shutdown().await;
}

/// Rule: bad input to a hold route is refused with a JSON error (400 or 422) and writes
/// nothing: amounts out of range, an expiry of 0 or past the most allowed, the held account
/// as its own destination, unknown fields, a hold id that is not a UUID.
#[tokio::test]
async fn bad_hold_input_is_refused_and_nothing_is_written() {
    let (t, account) = funded_app(100).await;
    let hold = placed(&t, &account, json!({"amountCents": 10})).await;
    let before = observe(&t, &account).await;
    let max = tally::account::MAX_AMOUNT_CENTS;
    let placements = [
        (json!({"amountCents": 0}), 422, "VALIDATION_ERROR"),
        (json!({"amountCents": -5}), 422, "VALIDATION_ERROR"),
        (json!({"amountCents": max + 1}), 422, "VALIDATION_ERROR"),
        (
            json!({"amountCents": 5, "expiresInSecs": 0}),
            422,
            "VALIDATION_ERROR",
        ),
        (
            json!({"amountCents": 5, "expiresInSecs": MAX_HOLD_EXPIRY_SECS + 1}),
            422,
            "VALIDATION_ERROR",
        ),
        (
            json!({"amountCents": 5, "expiresInSecs": -1}),
            422,
            "VALIDATION_ERROR",
        ),
        (
            json!({"amountCents": 5, "toAccountId": account}),
            422,
            "VALIDATION_ERROR",
        ),
        (
            json!({"amountCents": 5, "toAccountId": "nope"}),
            422,
            "VALIDATION_ERROR",
        ),
        (
            json!({"amountCents": 5, "colour": "red"}),
            422,
            "VALIDATION_ERROR",
        ),
        (json!({}), 422, "VALIDATION_ERROR"),
    ];
    for (body, status, code) in &placements {
        let r = place(&t, &account, body, None).await;
        assert_error(&r, *status, code);
    }
    let posts = [
        (json!({"amountCents": 0}), 422, "VALIDATION_ERROR"),
        (json!({"amountCents": -1}), 422, "VALIDATION_ERROR"),
        (json!({"amountCents": max + 1}), 422, "VALIDATION_ERROR"),
        (
            json!({"amountCents": 1, "toAccountId": new_account()}),
            422,
            "VALIDATION_ERROR",
        ),
    ];
    for (body, status, code) in &posts {
        let r = post_hold(&t, &account, &hold, body, None).await;
        assert_error(&r, *status, code);
    }
    let r = t
        .post(
            &format!("/api/accounts/{account}/holds/{hold}/void"),
            &json!({"amountCents": 1}),
            None,
        )
        .await;
    assert_error(&r, 422, "VALIDATION_ERROR");
    let r = t
        .post(
            &format!("/api/accounts/{account}/holds/not-a-uuid/void"),
            &json!({}),
            None,
        )
        .await;
    assert_error(&r, 400, "INVALID_ID");
    assert_eq!(
        observe(&t, &account).await,
        before,
        "bad input wrote something"
    );
    assert_eq!(get_hold(&t, &account, &hold).await.body["status"], "open");
    t.shutdown().await;
}

/// A replica over `store` on a local clock the test moves, with holds on and `extra`.
async fn on_hand_clock(
    store: SharedLog,
    extra: &[&str],
) -> (TestApp, std::sync::Arc<tally::projection::ManualClock>) {
    let mut flags = HOLDS_ON.to_vec();
    flags.extend_from_slice(extra);
    hand_clocks::spawn_on_hand_clock(&flags, store).await
}

/// Rule: no hold expires before its time in server time, whatever touches the account; at
/// its time the next touch (or a sweep) writes its expiry as an event of the history, the
/// money is available again, and a post or void after it is 409 `HOLD_RESOLVED` expired.
#[tokio::test]
async fn no_hold_expires_before_its_time_in_server_time_and_its_expiry_is_an_event() {
    let (server, store) = hand_clocks::store_at(SERVER_START_MS);
    // The sweeper's own passes stay out of the way: this test runs them by hand.
    let (t, clock) = on_hand_clock(store, &["--hold-sweep-interval-ms", "3600000"]).await;
    let advance = |ms: u64| {
        server.advance(ms);
        clock.advance_ms(ms);
    };
    let account = funded(&t, 100).await;
    let hold = placed(&t, &account, json!({"amountCents": 40, "expiresInSecs": 5})).await;
    let placed_at = t.history(&account).await[1]["timestamp"]
        .as_u64()
        .expect("timestamp");
    assert_eq!(
        get_hold(&t, &account, &hold).await.body["expiresAt"],
        placed_at + 5_000
    );

    advance(4_999);
    // A touch and a sweep one millisecond early expire nothing.
    assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    t.app.writes.sweep_holds_once(64).await;
    assert_eq!(get_hold(&t, &account, &hold).await.body["status"], "open");
    assert_eq!(amounts(&t, &account).await, (101, 61, 40));
    let r = t.withdraw(&account, 62, None).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");

    advance(1);
    let r = t.withdraw(&account, 62, None).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "the touch expired the hold first: {}",
        r.text
    );
    assert_eq!(amounts(&t, &account).await, (39, 39, 0));
    let history = t.history(&account).await;
    assert_eq!(
        types(&history),
        [
            "Deposited",
            "HoldPlaced",
            "Deposited",
            "HoldExpired",
            "Withdrawn"
        ]
    );
    assert_eq!(history[3]["holdId"], hold.as_str());
    assert!(
        history[3]["timestamp"].as_u64().expect("timestamp") >= placed_at + 5_000,
        "expired before its time in server time: {history:?}"
    );
    assert_eq!(
        get_hold(&t, &account, &hold).await.body["status"],
        "expired"
    );
    let before = observe(&t, &account).await;
    let r = post_hold(&t, &account, &hold, &json!({}), None).await;
    assert_error(&r, 409, "HOLD_RESOLVED");
    assert_eq!(r.body["resolution"], "expired");
    let r = void_hold(&t, &account, &hold, None).await;
    assert_error(&r, 409, "HOLD_RESOLVED");
    assert_eq!(r.body["resolution"], "expired");
    assert_eq!(observe(&t, &account).await, before);
    t.shutdown().await;
}

/// Rule: a post that arrives after its hold's time expires the hold first, in server time,
/// and is refused 409 `HOLD_RESOLVED` expired: a late post never moves money.
#[tokio::test]
async fn a_post_after_the_expiry_is_refused_as_expired_and_moves_no_money() {
    let (server, store) = hand_clocks::store_at(SERVER_START_MS);
    let (t, clock) = on_hand_clock(store, &["--hold-sweep-interval-ms", "3600000"]).await;
    let account = funded(&t, 100).await;
    let dest = new_account();
    let hold = placed(
        &t,
        &account,
        json!({"amountCents": 40, "expiresInSecs": 1, "toAccountId": dest}),
    )
    .await;
    server.advance(1_000);
    clock.advance_ms(1_000);
    let r = post_hold(&t, &account, &hold, &json!({}), None).await;
    assert_error(&r, 409, "HOLD_RESOLVED");
    assert_eq!(r.body["resolution"], "expired");
    assert_eq!(amounts(&t, &account).await, (100, 100, 0));
    assert_eq!(t.balance(&dest).await, (0, 0), "a late post moved money");
    assert_eq!(
        types(&t.history(&account).await),
        ["Deposited", "HoldPlaced", "HoldExpired"]
    );
    t.shutdown().await;
}

/// Rule: the sweeper expires due holds of an account nobody touches, and only once they
/// are due in server time.
#[tokio::test]
async fn the_sweeper_expires_holds_of_accounts_nobody_touches() {
    let (server, store) = hand_clocks::store_at(SERVER_START_MS);
    let (t, clock) = on_hand_clock(store, &["--hold-sweep-interval-ms", "10"]).await;
    let account = funded(&t, 100).await;
    let hold = placed(&t, &account, json!({"amountCents": 40, "expiresInSecs": 2})).await;
    server.advance(1_999);
    clock.advance_ms(1_999);
    // Several passes run while the hold is a millisecond short of its time: the pass counter
    // is the signal that they ran.
    let passes = || t.app.metrics.hold_sweeps.with_label_values(&["idle"]).get();
    let seen = passes();
    wait_for("three idle sweeper passes", || async {
        passes() >= seen + 3
    })
    .await;
    assert_eq!(get_hold(&t, &account, &hold).await.body["status"], "open");
    server.advance(1);
    clock.advance_ms(1);
    wait_for("the sweeper's expiry", || async {
        get_hold(&t, &account, &hold).await.body["status"] == "expired"
    })
    .await;
    assert_eq!(amounts(&t, &account).await, (100, 100, 0));
    t.shutdown().await;
}

/// Polls `done` until it holds, failing the test after a bound.
async fn wait_for<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Rule: with holds off, the hold routes answer 503 `HOLDS_OFF`; and an account whose
/// stream holds hold events (written by a replica with holds on over the same store) is
/// refused for reads and writes with 503 `HOLDS_OFF`, and nothing is written.
#[tokio::test]
async fn a_replica_with_holds_off_refuses_hold_routes_and_accounts_with_hold_events() {
    let store: SharedLog = std::sync::Arc::new(MemoryLog::new());
    let on = spawn(test_config(HOLDS_ON), Some(store.clone()), None).await;
    let off = spawn(test_config(&[]), Some(store), None).await;
    let account = funded(&on, 100).await;
    let hold = placed(&on, &account, json!({"amountCents": 30})).await;
    let plain = funded(&off, 50).await;
    let before = observe(&on, &account).await;

    let refused = [
        place(&off, &account, &json!({"amountCents": 1}), None).await,
        place(&off, &plain, &json!({"amountCents": 1}), None).await,
        post_hold(&off, &account, &hold, &json!({}), None).await,
        void_hold(&off, &account, &hold, None).await,
        get_hold(&off, &account, &hold).await,
        off.get(&format!("/api/accounts/{account}/holds")).await,
        off.get(&format!("/api/accounts/{account}/balance")).await,
        off.deposit(&account, 5, None).await,
        off.withdraw(&account, 5, None).await,
        off.transfer(&plain, &account, 5, None).await,
        off.transfer(&account, &plain, 5, None).await,
    ];
    for r in &refused {
        assert_error(r, 503, "HOLDS_OFF");
    }
    assert_eq!(
        observe(&on, &account).await,
        before,
        "a holds-off replica wrote something"
    );
    assert_eq!(
        off.balance(&plain).await,
        (50, 1),
        "an account without holds is served"
    );
    assert_eq!(on.balance(&plain).await, (50, 1));
    on.shutdown().await;
    off.shutdown().await;
}

/// Rule: hold writes need the write scope and hold reads the read scope; a refusal writes
/// nothing.
#[tokio::test]
async fn hold_writes_need_the_write_scope_and_hold_reads_the_read_scope() {
    let secret = common::test_auth::secret_file();
    let mut flags = HOLDS_ON.to_vec();
    flags.extend(common::test_auth::flags(&secret));
    let t = spawn(test_config(&flags), None, None).await;
    let token = |scope: &str| common::test_auth::token(json!({ "scope": scope }));
    let (all, read_only, write_only) = (
        token("accounts:read accounts:write"),
        token("accounts:read"),
        token("accounts:write"),
    );
    let send = |method: reqwest::Method, path: String, tok: &str, body: Option<Value>| {
        let mut req = t.client.request(method, t.url(&path)).bearer_auth(tok);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move { read(req.send().await.expect("sent")).await }
    };
    let account = new_account();
    let r = send(
        reqwest::Method::POST,
        common::deposit_path(&account),
        &all,
        Some(json!({"amountCents": 100})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = send(
        reqwest::Method::POST,
        format!("/api/accounts/{account}/holds"),
        &all,
        Some(json!({"amountCents": 10})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let hold = r.body["holdId"].as_str().expect("holdId").to_owned();
    let holds = format!("/api/accounts/{account}/holds");
    let one = format!("{holds}/{hold}");
    for (path, body) in [
        (holds.clone(), json!({"amountCents": 1})),
        (format!("{one}/post"), json!({})),
        (format!("{one}/void"), json!({})),
    ] {
        let r = send(reqwest::Method::POST, path, &read_only, Some(body)).await;
        assert_error(&r, 403, "INSUFFICIENT_SCOPE");
    }
    for path in [holds.clone(), one.clone()] {
        let r = send(reqwest::Method::GET, path.clone(), &write_only, None).await;
        assert_error(&r, 403, "INSUFFICIENT_SCOPE");
        let r = send(reqwest::Method::GET, path, &read_only, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    }
    let r = send(reqwest::Method::GET, one, &read_only, None).await;
    assert_eq!(r.body["status"], "open", "{}", r.text);
    let r = send(
        reqwest::Method::GET,
        format!("/api/accounts/{account}/balance"),
        &read_only,
        None,
    )
    .await;
    assert_eq!(
        (&r.body["aggregateVersion"], &r.body["heldCents"]),
        (&json!(2), &json!(10)),
        "a refused hold write wrote something: {}",
        r.text
    );
    t.shutdown().await;
}

/// What a replica shows of an account's holds: the open list (ids, amounts), the balance
/// read, and each named hold's read.
async fn holds_seen(t: &TestApp, account: &str, holds: &[&str]) -> Vec<Value> {
    let mut out = Vec::new();
    let list = t.get(&format!("/api/accounts/{account}/holds")).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text);
    out.push(list.body);
    out.push(
        t.get(&format!("/api/accounts/{account}/balance"))
            .await
            .body,
    );
    for h in holds {
        out.push(get_hold(t, account, h).await.body);
    }
    out
}

/// Writes holds of every kind on `account` (funded with 1,000): open with and without an
/// expiry and a destination, posted in part and whole, voided. Returns the hold ids.
async fn every_kind_of_hold(t: &TestApp, account: &str, dest: &str) -> Vec<String> {
    let open = placed(t, account, json!({"amountCents": 100})).await;
    let expiring = placed(
        t,
        account,
        json!({"amountCents": 50, "expiresInSecs": MAX_HOLD_EXPIRY_SECS, "toAccountId": dest}),
    )
    .await;
    let part = placed(t, account, json!({"amountCents": 80, "toAccountId": dest})).await;
    let whole = placed(t, account, json!({"amountCents": 30})).await;
    let voided = placed(t, account, json!({"amountCents": 20})).await;
    for (hold, body) in [(&part, json!({"amountCents": 60})), (&whole, json!({}))] {
        let r = post_hold(t, account, hold, &body, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    }
    assert_eq!(
        void_hold(t, account, &voided, None).await.status,
        StatusCode::OK
    );
    vec![open, expiring, part, whole, voided]
}

/// Rule: a cold replica (a second one over the same store) folds open holds and their
/// resolutions to what the warm one shows, and decides on them the same way: the available
/// amount, and a second resolution refused.
#[tokio::test]
async fn a_cold_replica_folds_open_holds_and_their_resolutions_as_the_warm_one() {
    let store: SharedLog = std::sync::Arc::new(MemoryLog::new());
    let warm = spawn(test_config(HOLDS_ON), Some(store.clone()), None).await;
    let account = funded(&warm, 1_000).await;
    let dest = new_account();
    let holds = every_kind_of_hold(&warm, &account, &dest).await;
    let ids: Vec<&str> = holds.iter().map(String::as_str).collect();
    let cold = spawn(test_config(HOLDS_ON), Some(store), None).await;
    let seen = holds_seen(&warm, &account, &ids).await;
    assert!(
        seen[3]["expiresAt"].is_u64(),
        "the replica that placed it states its expiry: {}",
        seen[3]
    );
    assert_eq!(holds_seen(&cold, &account, &ids).await, seen);
    assert_eq!(amounts(&cold, &account).await, (910, 760, 150));
    let r = cold.withdraw(&account, 761, None).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    let r = void_hold(&cold, &account, &holds[3], None).await;
    assert_error(&r, 409, "HOLD_RESOLVED");
    assert_eq!(r.body["resolution"], "posted");
    let r = post_hold(&cold, &account, &holds[1], &json!({}), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        warm.balance(&dest).await.0,
        110,
        "60 then 50 posted to the destination"
    );
    warm.shutdown().await;
    cold.shutdown().await;
}

/// Rule: checkpoints carry an account's holds (format 3): a cold replica over a stream
/// trimmed below the newest checkpoint folds its open holds and remembered resolutions to
/// what the warm one shows.
#[tokio::test]
async fn a_cold_replica_folds_holds_from_a_checkpoint_over_a_trimmed_stream() {
    let (server, store) = hand_clocks::store_at(SERVER_START_MS);
    let mem: std::sync::Arc<MemoryLog> = store.clone();
    // A retention as long as the window, so a checkpoint just past the window may be
    // trimmed below.
    let flags = ["--idempotency-retention", "90"];
    let (warm, clock) = on_hand_clock(store.clone(), &flags).await;
    let account = funded(&warm, 1_000).await;
    let dest = new_account();
    let holds = every_kind_of_hold(&warm, &account, &dest).await;
    let ids: Vec<&str> = holds.iter().map(String::as_str).collect();
    let seen = holds_seen(&warm, &account, &ids).await;

    // Past the window every key is out of the recent-writes index, so a checkpoint may be
    // trimmed below.
    let id = AccountId(account.parse().expect("uuid"));
    let p = &warm.app.projection;
    p.write_checkpoint(id).await;
    let past_window = p.window_ms().max(p.retention_ms()) + 1;
    server.advance(past_window);
    clock.advance_ms(past_window);
    p.sync_server_clock().await.expect("anchor");
    let trim = p
        .trim_account(id, std::time::Duration::ZERO)
        .await
        .expect("trim");
    assert!(trim.first_available > 1, "nothing trimmed: {trim:?}");

    let key = warm.app.identity.checkpoint_key(id);
    let tip = mem
        .details_now(key)
        .expect("a checkpoint stream")
        .max_version;
    let newest = read_whole(mem.as_ref(), key, tip, tip).await.expect("read");
    let event = &newest[0].events[0];
    assert_eq!(
        event.payload[0], 3,
        "the newest checkpoint is of the held format"
    );
    let cp = Checkpoint::decode(event).expect("a checkpoint");
    assert!(cp.holds_len > 0, "it carries the holds: {cp:?}");

    let (cold, _) = on_hand_clock(store, &flags).await;
    assert_eq!(holds_seen(&cold, &account, &ids).await, seen);
    let r = post_hold(&cold, &account, &holds[2], &json!({}), None).await;
    assert_error(&r, 409, "HOLD_RESOLVED");
    assert_eq!(r.body["resolution"], "posted");
    let r = void_hold(&cold, &account, &holds[0], None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(amounts(&cold, &account).await, (910, 860, 50));
    warm.shutdown().await;
    cold.shutdown().await;
}
