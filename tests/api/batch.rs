//! `POST /api/batch`: each item is one write of the single routes, under its own key, and
//! its result is exactly what that route would have answered.

use crate::common::{self, new_account, spawn, test_auth, test_config};

use hyper::StatusCode;
use serde_json::{Value, json};

fn deposit(account: &str, cents: i64, key: &str) -> Value {
    json!({"type": "deposit", "accountId": account, "amountCents": cents, "idempotencyKey": key})
}

fn withdraw(account: &str, cents: i64, key: &str) -> Value {
    json!({"type": "withdraw", "accountId": account, "amountCents": cents, "idempotencyKey": key})
}

fn transfer(from: &str, to: &str, cents: i64, key: &str) -> Value {
    json!({"type": "transfer", "fromAccountId": from, "toAccountId": to,
           "amountCents": cents, "idempotencyKey": key})
}

async fn batch(t: &common::TestApp, items: Vec<Value>) -> Vec<Value> {
    let r = t.post("/api/batch", &json!({ "items": items }), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    r.body["results"].as_array().expect("results").clone()
}

fn statuses(results: &[Value]) -> Vec<u64> {
    results
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect()
}

/// Rule: each item's result is the status and body its single route answers, in item order;
/// a refused item refuses nothing else; and the single route with the same key replays it.
#[tokio::test]
async fn each_item_answers_as_its_single_route_in_item_order() {
    let t = spawn(test_config(&[]), None, None).await;
    let (a, b, c) = (new_account(), new_account(), new_account());
    let results = batch(
        &t,
        vec![
            deposit(&a, 500, "b1-dep"),
            withdraw(&b, 1, "b1-poor"),
            transfer(&a, &c, 200, "b1-tr"),
            json!({"type": "deposit", "accountId": a, "amountCents": 5}),
            json!({"type": "refund", "accountId": a, "amountCents": 5, "idempotencyKey": "x"}),
            deposit(&a, 0, "b1-zero"),
        ],
    )
    .await;
    assert_eq!(statuses(&results), vec![200, 422, 200, 422, 422, 422]);
    assert_eq!(
        results[0]["body"],
        json!({"balanceCents": 500, "aggregateVersion": 1})
    );
    assert_eq!(results[0]["idempotencyKey"], "b1-dep");
    assert_eq!(results[0]["replayed"], false);
    assert!(results[0]["idempotencyWindow"].as_u64().is_some());
    assert!(results[0]["idempotencyRetention"].as_u64().is_some());
    assert_eq!(results[1]["body"]["error"], "INSUFFICIENT_FUNDS");
    assert_eq!(results[2]["body"]["from"]["balanceCents"], 300);
    // The single routes with the same keys are the same writes: replays of these bodies.
    let single = t.deposit(&a, 500, Some("b1-dep")).await;
    assert!(single.replayed(), "{}", single.text);
    assert_eq!(single.body, results[0]["body"]);
    let single = t.transfer(&a, &c, 200, Some("b1-tr")).await;
    assert!(single.replayed(), "{}", single.text);
    assert_eq!(single.body, results[2]["body"]);
    assert_eq!(t.balance(&a).await, (300, 2));
    assert_eq!(t.balance(&c).await, (200, 1));
    t.shutdown().await;
}

/// Rule: items on one account apply in the order given, so a withdrawal after the deposit
/// that pays for it lands, and one past the balance is refused.
#[tokio::test]
async fn items_on_one_account_apply_in_the_order_given() {
    let t = spawn(test_config(&[]), None, None).await;
    let (a, b) = (new_account(), new_account());
    let mut items = Vec::new();
    for i in 0..20 {
        items.push(deposit(&a, 10, &format!("o-d{i}")));
        items.push(withdraw(&a, 10, &format!("o-w{i}")));
        items.push(transfer(&b, &a, 1, &format!("o-t{i}")));
    }
    items.push(withdraw(&a, 1, "o-last"));
    let results = batch(&t, items).await;
    let s = statuses(&results);
    for i in 0..20 {
        assert_eq!(s[3 * i], 200, "deposit {i}");
        assert_eq!(s[3 * i + 1], 200, "the withdrawal after deposit {i}");
        assert_eq!(s[3 * i + 2], 422, "b has nothing to send");
    }
    assert_eq!(s[60], 422, "nothing left to withdraw");
    assert_eq!(t.balance(&a).await, (0, 40));
    t.shutdown().await;
}

/// Rule: a batch resent whole writes nothing new: every item that landed replays, and a key
/// sent twice in one batch is as if sent again after the first answered.
#[tokio::test]
async fn a_batch_resent_whole_replays_and_a_key_twice_is_a_replay_or_a_reuse() {
    let t = spawn(test_config(&[]), None, None).await;
    let (a, b) = (new_account(), new_account());
    let items = vec![
        deposit(&a, 100, "r-1"),
        deposit(&b, 7, "r-2"),
        deposit(&a, 100, "r-1"),
        deposit(&a, 101, "r-1"),
    ];
    let first = batch(&t, items.clone()).await;
    assert_eq!(statuses(&first), vec![200, 200, 200, 422]);
    assert_eq!(first[2]["replayed"], true);
    assert_eq!(first[2]["body"], first[0]["body"]);
    assert_eq!(first[3]["body"]["error"], "IDEMPOTENCY_KEY_REUSED");
    let again = batch(&t, items).await;
    assert_eq!(statuses(&again), vec![200, 200, 200, 422]);
    for i in 0..3 {
        assert_eq!(again[i]["replayed"], true, "item {i}");
        assert_eq!(again[i]["body"], first[i]["body"], "item {i}");
    }
    assert_eq!(t.balance(&a).await, (100, 1));
    assert_eq!(t.balance(&b).await, (7, 1));
    t.shutdown().await;
}

/// Rule: a batch over a limit (items, bytes) or not a batch at all is refused whole, and
/// nothing is written.
#[tokio::test]
async fn a_batch_over_its_limits_is_refused_whole_and_writes_nothing() {
    let t = spawn(
        test_config(&["--batch-max-items", "3", "--batch-max-bytes", "2048"]),
        None,
        None,
    )
    .await;
    let a = new_account();
    let four: Vec<Value> = (0..4).map(|i| deposit(&a, 1, &format!("l-{i}"))).collect();
    let r = t.post("/api/batch", &json!({ "items": four }), None).await;
    common::assert_error(&r, 400, "BAD_REQUEST");
    let body = json!({ "items": [deposit(&a, 1, &"q".repeat(2_100))] });
    let r = t.post("/api/batch", &body, None).await;
    common::assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    let r = t.post("/api/batch", &json!({ "items": [] }), None).await;
    common::assert_error(&r, 400, "BAD_REQUEST");
    let r = t.post("/api/batch", &json!({ "things": [] }), None).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.text);
    assert_eq!(t.balance(&a).await, (0, 0), "nothing was written");
    t.shutdown().await;
}

/// Rule: with authentication on, each item's accounts are checked on their own: a token that
/// may write only account A gets 403 on the item for B, and A's item runs.
#[tokio::test]
async fn an_item_for_an_account_the_token_may_not_write_is_refused_alone() {
    let secret = test_auth::secret_file();
    let t = spawn(test_config(&test_auth::flags(&secret)), None, None).await;
    let (a, b) = (new_account(), new_account());
    let send = |token: String, body: Value| {
        let url = t.url("/api/batch");
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .expect("sent");
            common::read(r).await
        }
    };
    let limited = test_auth::token(json!({ "accounts": [a] }));
    let body = json!({ "items": [deposit(&a, 5, "au-1"), deposit(&b, 5, "au-2")] });
    let r = send(limited, body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let results = r.body["results"].as_array().unwrap();
    assert_eq!(statuses(results), vec![200, 403]);
    // Resent by a token that may write both: A's item replays, B's lands now, once.
    let body = json!({ "items": [deposit(&a, 5, "au-1"), deposit(&b, 5, "au-2")] });
    let r = send(test_auth::token(json!({})), body).await;
    let results = r.body["results"].as_array().unwrap();
    assert_eq!(statuses(results), vec![200, 200]);
    assert_eq!(results[0]["replayed"], true);
    assert_eq!(results[1]["replayed"], false);
    t.shutdown().await;
}

fn linked(mut item: Value, group: &str) -> Value {
    item["group"] = json!(group);
    item
}

/// Rule: a linked group's items land together, in one store write: every item on one
/// account answers that write's version, each with the balance right after its own event.
#[tokio::test]
async fn a_linked_group_lands_whole_in_one_store_write() {
    let t = spawn(test_config(&[]), None, None).await;
    let (a, b) = (new_account(), new_account());
    let results = batch(
        &t,
        vec![
            linked(deposit(&a, 100, "g1-dep"), "g1"),
            deposit(&b, 1, "alone"),
            linked(transfer(&a, &b, 30, "g1-pay"), "g1"),
            linked(withdraw(&a, 10, "g1-fee"), "g1"),
        ],
    )
    .await;
    assert_eq!(statuses(&results), vec![200, 200, 200, 200]);
    assert_eq!(
        results[0]["body"],
        json!({"balanceCents": 100, "aggregateVersion": 1})
    );
    assert_eq!(
        results[2]["body"]["from"],
        json!({"balanceCents": 70, "aggregateVersion": 1})
    );
    assert_eq!(
        results[3]["body"],
        json!({"balanceCents": 60, "aggregateVersion": 1})
    );
    let history = t.history(&a).await;
    assert_eq!(history.len(), 3);
    assert!(
        history.iter().all(|e| e["aggregateVersion"] == 1),
        "one batch: {history:?}"
    );
    // Resent whole: every item replays, nothing is written.
    let again = batch(
        &t,
        vec![
            linked(deposit(&a, 100, "g1-dep"), "g1"),
            linked(transfer(&a, &b, 30, "g1-pay"), "g1"),
            linked(withdraw(&a, 10, "g1-fee"), "g1"),
        ],
    )
    .await;
    assert_eq!(statuses(&again), vec![200, 200, 200]);
    assert!(again.iter().all(|r| r["replayed"] == true), "{again:?}");
    assert_eq!(t.balance(&a).await, (60, 1));
    t.shutdown().await;
}

/// Rule: a linked group with an item refused for good writes nothing: that item answers its
/// own refusal, the others 422 `LINKED_ITEM_FAILED`; an item refused before it runs (bad
/// input) refuses its group the same way.
#[tokio::test]
async fn a_linked_group_with_a_refused_item_writes_nothing() {
    let t = spawn(test_config(&[]), None, None).await;
    let (a, b) = (new_account(), new_account());
    let results = batch(
        &t,
        vec![
            linked(deposit(&b, 50, "g2-dep"), "g2"),
            linked(withdraw(&a, 1_000, "g2-poor"), "g2"),
            linked(deposit(&a, 5, "g3-dep"), "g3"),
            linked(deposit(&a, 0, "g3-zero"), "g3"),
        ],
    )
    .await;
    assert_eq!(statuses(&results), vec![422, 422, 422, 422]);
    assert_eq!(results[0]["body"]["error"], "LINKED_ITEM_FAILED");
    assert_eq!(results[1]["body"]["error"], "INSUFFICIENT_FUNDS");
    assert_eq!(results[2]["body"]["error"], "LINKED_ITEM_FAILED");
    assert_eq!(results[3]["body"]["error"], "VALIDATION_ERROR");
    assert_eq!(t.balance(&a).await, (0, 0));
    assert_eq!(t.balance(&b).await, (0, 0));
    t.shutdown().await;
}

/// Rule: a linked group past its limits (16 items, 16 accounts) or with a key twice is
/// refused whole, 400 on every item, and nothing is written.
#[tokio::test]
async fn a_linked_group_past_its_limits_is_refused_whole() {
    let t = spawn(test_config(&[]), None, None).await;
    let a = new_account();
    let mut items: Vec<Value> = (0..17)
        .map(|i| linked(deposit(&a, 1, &format!("big-{i}")), "big"))
        .collect();
    items.push(linked(deposit(&a, 1, "twice"), "dup"));
    items.push(linked(deposit(&a, 1, "twice"), "dup"));
    let results = batch(&t, items).await;
    assert!(statuses(&results).iter().all(|&s| s == 400), "{results:?}");
    let accounts: Vec<Value> = (0..17)
        .map(|i| linked(deposit(&new_account(), 1, &format!("wide-{i}")), "wide"))
        .collect();
    let results = batch(&t, accounts).await;
    assert!(statuses(&results).iter().all(|&s| s == 400), "{results:?}");
    assert_eq!(t.balance(&a).await, (0, 0));
    t.shutdown().await;
}
