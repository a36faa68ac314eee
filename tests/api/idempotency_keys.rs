//! The Idempotency-Key contract: replays (on any replica, within the window in server time),
//! key syntax, minted keys, a key reused for another request, and concurrent duplicates.

use std::sync::Arc;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::store::SharedLog;
use tally::store::faults::Fault;
use tally::store::memory::MemoryLog;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::common::hand_clocks;
use crate::common::raw_http::send;
use crate::common::{
    self, Reply, account_transfer_path, assert_error, deposit_path, faults, funded, leg,
    new_account, observe, spawn, spawn_default, spawn_fleet_in_memory,
    spawn_one_attempt_with_scripted_faults, test_config, withdraw_path,
};

#[tokio::test]
async fn a_replay_returns_the_original_status_and_body_marked_replayed() {
    let t = spawn_default().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    let first = t.deposit(&account, 500, Some(&key)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("idempotency-key"), Some(key.as_str()));
    // Another write moves the account on; the replay still answers what the first one did.
    assert_eq!(t.deposit(&account, 50, None).await.status, StatusCode::OK);
    for _ in 0..2 {
        let again = t.deposit(&account, 500, Some(&key)).await;
        assert_eq!(again.status, first.status);
        assert_eq!(again.text, first.text);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("idempotency-key"), Some(key.as_str()));
        assert_eq!(again.header("idempotency-window"), Some("90"));
    }
    assert_eq!(observe(&t, &account).await.0, 550);
    assert_eq!(t.history(&account).await.len(), 2);
    // Withdrawals replay the same way.
    let wkey = "withdraw-once";
    let w = t.withdraw(&account, 20, Some(wkey)).await;
    let w2 = t.withdraw(&account, 20, Some(wkey)).await;
    assert_eq!((w.status, &w.body), (w2.status, &w2.body));
    assert!(!w.replayed() && w2.replayed());
    assert_eq!(t.balance(&account).await, (530, 3));
    t.shutdown().await;
}

/// Rule: a rule's refusal wrote nothing and is not remembered: a retry with the same key is
/// decided again on the account as it is then, and lands once if it now passes.
#[tokio::test]
async fn a_rules_refusal_is_decided_again_on_retry() {
    let t = spawn_default().await;
    let account = new_account();
    let key = "withdraw-when-funded";
    let refused = t.withdraw(&account, 500, Some(key)).await;
    assert_error(&refused, 422, "INSUFFICIENT_FUNDS");
    assert!(!refused.replayed());
    // Unchanged account: decided the same way again, not replayed.
    let again = t.withdraw(&account, 500, Some(key)).await;
    assert_error(&again, 422, "INSUFFICIENT_FUNDS");
    assert!(!again.replayed());
    assert_eq!(t.deposit(&account, 800, None).await.status, StatusCode::OK);
    let landed = t.withdraw(&account, 500, Some(key)).await;
    assert_eq!(landed.status, StatusCode::OK, "{}", landed.text);
    assert!(!landed.replayed());
    // From here the key names a landed write: replayed, never written twice.
    let replay = t.withdraw(&account, 500, Some(key)).await;
    assert!(replay.replayed());
    assert_eq!(replay.text, landed.text);
    assert_eq!(t.balance(&account).await, (300, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn uuid_and_opaque_keys_dedup_and_a_quoted_key_is_the_same_key() {
    let t = spawn_default().await;
    let account = new_account();
    let uuid_key = Uuid::new_v4().to_string();
    let a = t.deposit(&account, 10, Some(&uuid_key)).await;
    let b = t.deposit(&account, 10, Some(&uuid_key)).await;
    assert!(!a.replayed() && b.replayed());
    assert_eq!(a.body, b.body);

    let opaque = "order-42/attempt:a".to_string();
    let c = t.deposit(&account, 20, Some(&opaque)).await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.text);
    assert!(!c.replayed());
    assert_eq!(c.header("idempotency-key"), Some(opaque.as_str()));
    let quoted = format!("\"{opaque}\"");
    let d = t.deposit(&account, 20, Some(&quoted)).await;
    assert_eq!(d.status, StatusCode::OK, "{}", d.text);
    assert!(d.replayed(), "the quoted form names the same key");
    assert_eq!(c.body, d.body);
    let e = t.deposit(&account, 20, Some(&opaque)).await;
    assert!(e.replayed());

    // A quoted key may hold spaces and escapes; its bare spelling cannot, but the escaped
    // form of the same characters is the same key.
    let spaced = t.deposit(&account, 30, Some(r#""a \"b\" c""#)).await;
    assert_eq!(spaced.status, StatusCode::OK, "{}", spaced.text);
    let spaced2 = t.deposit(&account, 30, Some(r#""a \"b\" c""#)).await;
    assert!(!spaced.replayed() && spaced2.replayed());
    // The key comes back as it was sent, so resending the echoed header is the same key.
    let echoed = spaced.header("idempotency-key").expect("echoed").to_owned();
    assert_eq!(echoed, r#""a \"b\" c""#);
    assert!(t.deposit(&account, 30, Some(&echoed)).await.replayed());

    // Different keys are different requests.
    let f = t.deposit(&account, 20, Some("order-43")).await;
    assert!(!f.replayed());
    assert_eq!(t.history(&account).await.len(), 4);
    assert_eq!(t.balance(&account).await, (80, 4));
    t.shutdown().await;
}

#[tokio::test]
async fn keys_too_long_or_with_invalid_characters_are_400_and_write_nothing() {
    let t = spawn_default().await;
    let (account, payee) = (funded(&t, 100).await, new_account());
    let before = (observe(&t, &account).await, observe(&t, &payee).await);
    let too_long = "k".repeat(256);
    let quoted_too_long = format!("\"{too_long}\"");
    let bad: Vec<&[u8]> = vec![
        too_long.as_bytes(),
        quoted_too_long.as_bytes(),
        b"",
        b"\"\"",
        b"has space",
        b"tab\there",
        b"caf\xc3\xa9",
        b"\xff",
        b"\"unterminated",
        b"\"bad \\x escape\"",
        b"\"inner \" quote\"",
    ];
    for key in bad {
        for path in [deposit_path(&account), withdraw_path(&account)] {
            let r = send(
                &t,
                Method::POST,
                &path,
                &[
                    ("content-type", b"application/json"),
                    ("idempotency-key", key),
                ],
                Some(br#"{"amountCents":1}"#.to_vec()),
            )
            .await;
            assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
            assert_eq!(
                r.header("idempotency-key"),
                None,
                "a bad key is never replaced"
            );
        }
        let r = send(
            &t,
            Method::POST,
            "/api/transfers",
            &[
                ("content-type", b"application/json"),
                ("idempotency-key", key),
            ],
            Some(
                json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 1 })
                    .to_string()
                    .into_bytes(),
            ),
        )
        .await;
        assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &payee).await),
            before,
            "key {:?} changed something",
            String::from_utf8_lossy(key)
        );
    }
    // Two keys on one request are refused, not picked from.
    let r = send(
        &t,
        Method::POST,
        &deposit_path(&account),
        &[
            ("content-type", b"application/json"),
            ("idempotency-key", b"one"),
            ("idempotency-key", b"two"),
        ],
        Some(br#"{"amountCents":1}"#.to_vec()),
    )
    .await;
    assert_error(&r, 400, "INVALID_IDEMPOTENCY_KEY");
    assert_eq!(
        (observe(&t, &account).await, observe(&t, &payee).await),
        before
    );
    // 255 characters is the longest key accepted.
    let longest = "k".repeat(255);
    let r = t.deposit(&account, 1, Some(&longest)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(t.deposit(&account, 1, Some(&longest)).await.replayed());
    t.shutdown().await;
}

#[tokio::test]
async fn without_a_key_the_server_mints_one_and_a_retry_with_it_replays() {
    let t = spawn_default().await;
    let account = new_account();
    let first = t.deposit(&account, 300, None).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert!(!first.replayed());
    let minted = first
        .header("idempotency-key")
        .expect("a minted key is returned")
        .to_owned();
    let minted_id = Uuid::parse_str(&minted).expect("the minted key is a UUID");
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], minted_id.to_string());
    let again = t.deposit(&account, 300, Some(&minted)).await;
    assert_eq!(again.status, StatusCode::OK);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // Each keyless request gets its own key, so two keyless requests are two writes.
    let second = t.deposit(&account, 300, None).await;
    assert!(!second.replayed());
    assert_ne!(second.header("idempotency-key"), Some(minted.as_str()));
    assert_eq!(t.balance(&account).await, (600, 2));
    // Transfers too.
    let payee = new_account();
    let tr = t.transfer(&account, &payee, 100, None).await;
    assert_eq!(tr.status, StatusCode::OK, "{}", tr.text);
    let tkey = tr.header("idempotency-key").expect("minted").to_owned();
    let tr2 = t.transfer(&account, &payee, 100, Some(&tkey)).await;
    assert!(tr2.replayed(), "{}", tr2.text);
    assert_eq!(tr2.body, tr.body);
    assert_eq!(t.balance(&payee).await, (100, 1));
    t.shutdown().await;
}

#[tokio::test]
async fn reusing_a_key_for_a_different_amount_or_operation_is_422_and_writes_nothing() {
    let t = spawn_default().await;
    let (account, other) = (new_account(), new_account());
    let key = Uuid::new_v4().to_string();
    let first = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let before = (observe(&t, &account).await, observe(&t, &other).await);
    let attempts = [
        (deposit_path(&account), json!({ "amountCents": 101 })),
        (withdraw_path(&account), json!({ "amountCents": 100 })),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": account, "toAccountId": other, "amountCents": 100 }),
        ),
        (
            account_transfer_path(&account),
            json!({ "toAccountId": other, "amountCents": 100 }),
        ),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": other, "toAccountId": account, "amountCents": 100 }),
        ),
    ];
    for (path, body) in attempts {
        let r = t.post(&path, &body, Some(&key)).await;
        assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
        assert!(!r.replayed());
        assert_eq!(r.header("idempotency-window"), Some("90"));
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &other).await),
            before,
            "{path} {body} changed something"
        );
    }
    // The original request still replays.
    let again = t.deposit(&account, 100, Some(&key)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // A transfer's key is bound to the transfer on both accounts.
    let tkey = "transfer-bound";
    let funded_from = funded(&t, 500).await;
    assert_eq!(
        t.transfer(&funded_from, &other, 50, Some(tkey))
            .await
            .status,
        StatusCode::OK
    );
    let r = t.transfer(&funded_from, &other, 51, Some(tkey)).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    let r = t.deposit(&other, 50, Some(tkey)).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(t.balance(&other).await, (50, 1));
    assert_eq!(t.balance(&funded_from).await, (450, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn a_409_without_a_key_returns_the_minted_key_and_a_retry_with_it_replays_the_transfer() {
    let t = spawn_one_attempt_with_scripted_faults().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    faults(&t).fail_next_write(Fault::LostAck);
    let r = t.transfer(&from, &to, 300, None).await;
    assert_error(&r, 409, "CONFLICT");
    let minted = r
        .header("idempotency-key")
        .expect("a 409 carries the minted key, so the caller can retry safely")
        .to_owned();
    let again = t.transfer(&from, &to, 300, Some(&minted)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(again.replayed());
    assert_eq!(
        again.body,
        json!({
            "from": { "balanceCents": 700, "aggregateVersion": 2 },
            "to": { "balanceCents": 300, "aggregateVersion": 1 },
        })
    );
    assert_eq!(t.history(&from).await.len(), 2);
    assert_eq!(t.history(&to).await.len(), 1);
    t.shutdown().await;
}

#[tokio::test]
async fn a_retry_on_another_replica_is_a_replay_of_the_original() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let (account, payee) = (new_account(), new_account());
    let first = a.deposit(&account, 500, Some("fleet-1")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let again = b.deposit(&account, 500, Some("fleet-1")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
    let tr = a.transfer(&account, &payee, 200, Some("fleet-2")).await;
    let tr2 = b.transfer(&account, &payee, 200, Some("fleet-2")).await;
    assert_eq!(tr2.body, tr.body);
    assert!(tr2.replayed());
    // The key stays bound to its operation on the other replica too.
    let r = b.deposit(&account, 501, Some("fleet-1")).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(b.balance(&account).await, (300, 2));
    assert_eq!(a.history(&payee).await.len(), 1);
    for t in fleet {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn a_retry_on_a_replica_that_folded_the_account_earlier_is_marked_replayed() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let account = new_account();
    // b folds the account (warm at version 0), then a serves the original request.
    assert_eq!(b.balance(&account).await, (0, 0));
    let first = a.deposit(&account, 500, Some("fleet-warm")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let again = b.deposit(&account, 500, Some("fleet-warm")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, first.body);
    assert_eq!(
        b.history(&account).await.len(),
        1,
        "one write, as it should be"
    );
    assert!(
        again.replayed(),
        "the retry's answer is the original write's, but is not marked replayed"
    );
    for t in fleet {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn a_replay_is_honoured_for_the_stated_window_measured_in_server_time() {
    let (server_clock, store) = hand_clocks::store_at(hand_clocks::SERVER_START_MS);
    // The retention equal to the window: nothing is remembered past it, as in a fleet
    // that still runs the replaced service.
    let flags = ["--idempotency-retention", "90"];
    let (a, clock_a) = hand_clocks::spawn_on_hand_clock(&flags, store.clone()).await;
    let (b, clock_b) = hand_clocks::spawn_on_hand_clock(&flags, store.clone()).await;
    let (account, other, late) = (new_account(), new_account(), new_account());
    let first = a.deposit(&account, 100, Some("window-1")).await;
    let first_other = a.deposit(&other, 100, Some("window-2")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);

    // On the replica that wrote: the whole window, from its own clock.
    clock_a.advance_ms(89_999);
    let r = a.deposit(&account, 100, Some("window-1")).await;
    assert!(r.replayed(), "{}", r.text);
    assert_eq!(r.body, first.body);
    clock_a.advance_ms(1);
    let r = a.deposit(&account, 100, Some("window-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        !r.replayed(),
        "past the window the key is forgotten: a new write"
    );
    assert_eq!(leg(&r.body), (200, 2));

    // On a replica that only reads the write back, the age comes from server time: 89 s
    // after it was written, one second of the window is left.
    server_clock.advance(89_000);
    assert_eq!(a.deposit(&late, 1, None).await.status, StatusCode::OK);
    assert_eq!(b.balance(&late).await, (1, 1));
    if common::pg::suite_on_postgres() {
        // On Postgres b answers `late` from the shared row and reads no batch, so it learns
        // the server's time at its next anchor (every SERVER_CLOCK_RESYNC) instead. Until
        // then its estimate lags, and rows answer longer, never shorter.
        b.app
            .projection
            .sync_server_clock()
            .await
            .expect("re-anchor");
    }
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert!(r.replayed(), "{}", r.text);
    assert_eq!(r.body, first_other.body);
    clock_b.advance_ms(999);
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert!(r.replayed(), "{}", r.text);
    clock_b.advance_ms(1);
    let r = b.deposit(&other, 100, Some("window-2")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed());
    assert_eq!(leg(&r.body), (200, 2));
    a.shutdown().await;
    b.shutdown().await;
}

/// Rule: past the window and inside the retention a retry still gets its original answer, on
/// the replica that wrote and on one that never held the account, and the same key with
/// another body is still refused; past the retention the key is forgotten and a retry
/// writes again. Every answer states the retention.
#[tokio::test]
async fn a_retry_past_the_window_inside_the_retention_replays_on_any_replica_and_past_it_writes_again()
 {
    if common::pg::suite_on_postgres() {
        // The Postgres projection keeps keys in its rows: pinned in tests/store/postgres.rs.
        return;
    }
    let (server_clock, store) = hand_clocks::store_at(hand_clocks::SERVER_START_MS);
    let flags = ["--idempotency-retention", "600"];
    let (a, clock_a) = hand_clocks::spawn_on_hand_clock(&flags, store.clone()).await;
    let (b, clock_b) = hand_clocks::spawn_on_hand_clock(&flags, store.clone()).await;
    let account = new_account();
    let first = a.deposit(&account, 100, Some("day-1")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(first.header("idempotency-retention"), Some("600"));
    assert_eq!(first.header("idempotency-window"), Some("90"));

    // Two windows later: past the window, inside the retention.
    let later = |ms| {
        server_clock.advance(ms);
        clock_a.advance_ms(ms);
        clock_b.advance_ms(ms);
    };
    later(200_000);
    let r = a.deposit(&account, 100, Some("day-1")).await;
    assert!(r.replayed(), "the writer remembers the key: {}", r.text);
    assert_eq!(r.body, first.body);
    let r = b.deposit(&account, 100, Some("day-1")).await;
    assert!(
        r.replayed(),
        "a replica that never held the account too: {}",
        r.text
    );
    assert_eq!(r.body, first.body);
    let r = b.deposit(&account, 101, Some("day-1")).await;
    assert_error(&r, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(a.history(&account).await.len(), 1, "one write");

    // Past the retention: forgotten, a new write.
    later(401_000);
    let r = b.deposit(&account, 100, Some("day-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed(), "past the retention the key is forgotten");
    assert_eq!(leg(&r.body), (200, 2));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn history_of_a_trimmed_stream_starts_at_the_first_available_version() {
    let mem = Arc::new(MemoryLog::new());
    let store: SharedLog = mem.clone();
    let a = spawn(test_config(&[]), Some(store.clone()), None).await;
    let account = new_account();
    for cents in [1, 2, 3] {
        assert_eq!(
            a.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    let key = a.app.identity.key(AccountId(account.parse().unwrap()));
    mem.trim_start_now(key, 3).expect("trimmed");
    // A replica that folded the stream before the trim still knows the balance.
    let r = a.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["firstAvailableVersion"], 3);
    assert_eq!(r.body["balanceCents"], 6);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 1);
    assert_eq!(r.body["events"][0]["aggregateVersion"], 3);
    // A fresh replica can list what is left. On the memory projection it cannot derive a
    // balance; on Postgres it shares the row folded before the trim, so it can
    // (replicas restart warm).
    let b = spawn(test_config(&[]), Some(store.clone()), None).await;
    let r = b.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["firstAvailableVersion"], 3);
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["events"][0]["amountCents"], 3);
    let shared_rows = common::pg::suite_on_postgres();
    if shared_rows {
        assert_eq!(r.body["balanceCents"], 6);
        assert_eq!(b.balance(&account).await, (6, 3));
    } else {
        assert_eq!(r.body["balanceCents"], Value::Null);
        let r = b.get(&format!("/api/accounts/{account}/balance")).await;
        assert_error(&r, 500, "ACCOUNT_TRIMMED");
        assert!(r.body["errorId"].is_string(), "{}", r.text);
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_are_answered_once_and_replayed_to_the_rest() {
    const N: usize = 16;
    let t = Arc::new(spawn(test_config(&["--faults", "seed=1"]), None, None).await);
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    // Hold the first store write so the duplicates arrive while it is in flight (any that
    // arrive after it are answered from the index instead: the outcome is the same).
    let mut hold = faults(&t).hold_next_write();
    let mut set = JoinSet::new();
    let fire = |set: &mut JoinSet<Reply>| {
        let (t, account, key) = (t.clone(), account.clone(), key.clone());
        set.spawn(async move { t.deposit(&account, 700, Some(&key)).await });
    };
    fire(&mut set);
    assert!(hold.held().await);
    for _ in 1..N {
        fire(&mut set);
    }
    hold.release();
    let replies = set.join_all().await;
    assert_eq!(replies.len(), N);
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.text, replies[0].text);
        assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
    }
    assert_eq!(leg(&replies[0].body), (700, 1));
    let replayed = replies.iter().filter(|r| r.replayed()).count();
    assert_eq!(replayed, N - 1, "exactly one answer is the original");
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], key);
    assert_eq!(t.balance(&account).await, (700, 1));
    // Every duplicate was either coalesced onto the in-flight write or answered from the
    // index: never written.
    let m = t.get("/metrics").await;
    let coalesced = common::metric_sum(&m.text, "tally_idempotency_coalesced_total");
    let replays = common::metric_sum(&m.text, "tally_idempotency_replays_total");
    assert_eq!(coalesced + replays, (N - 1) as f64, "{}", m.text);
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every request task has finished")
    };
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfer_duplicates_write_one_transfer() {
    const N: usize = 8;
    let t = Arc::new(spawn_default().await);
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = Uuid::new_v4().to_string();
    let mut set = JoinSet::new();
    for _ in 0..N {
        let (t, from, to, key) = (t.clone(), from.clone(), to.clone(), key.clone());
        set.spawn(async move { t.transfer(&from, &to, 100, Some(&key)).await });
    }
    let replies = set.join_all().await;
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.body, replies[0].body);
    }
    assert_eq!(replies.iter().filter(|r| r.replayed()).count(), N - 1);
    assert_eq!(t.balance(&from).await, (900, 2));
    assert_eq!(t.balance(&to).await, (100, 1));
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every request task has finished")
    };
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_request_reusing_an_in_flight_key_with_another_amount_is_refused() {
    let t = spawn(test_config(&["--faults", "seed=1"]), None, None).await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    let mut hold = faults(&t).hold_next_write();
    let first = {
        let (client, url, key) = (
            t.client.clone(),
            t.url(&deposit_path(&account)),
            key.clone(),
        );
        tokio::spawn(async move { common::keyed_deposit(&client, &url, &key, 100).await })
    };
    assert!(hold.held().await);
    let second = {
        let (client, url, key) = (
            t.client.clone(),
            t.url(&deposit_path(&account)),
            key.clone(),
        );
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .header("idempotency-key", key)
                    .json(&json!({ "amountCents": 999 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    hold.release();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert!(!first.replayed());
    assert_error(&second, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(observe(&t, &account).await.0, 100);
    assert_eq!(t.history(&account).await.len(), 1);
    t.shutdown().await;
}

/// Rule: requests under one key whose first is refused are each decided on their own; a
/// race of many (each a different amount, each refused) ends in a refusal for every one.
/// Else a follower would re-run while the refused first's entry was still in the map,
/// followed it again at once, and recursed until the stack overflowed and the process died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_race_of_refused_requests_under_one_key_refuses_each() {
    const RACERS: i64 = 20;
    const ROUNDS: usize = 20;
    let t = Arc::new(spawn_default().await);
    let account = funded(&t, 100).await;
    for round in 0..ROUNDS {
        let key = format!("refused-race-{round}");
        let mut set = JoinSet::new();
        for i in 0..RACERS {
            let (t, account, key) = (t.clone(), account.clone(), key.clone());
            set.spawn(async move { t.withdraw(&account, 1_000 + i, Some(&key)).await });
        }
        for r in set.join_all().await {
            assert_error(&r, 422, "INSUFFICIENT_FUNDS");
        }
    }
    assert_eq!(t.balance(&account).await, (100, 1), "nothing written");
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every request task has finished")
    };
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_unanswered_by_the_request_deadline_is_a_retryable_409_naming_its_key() {
    // No key sent: the minted key must reach the client even when the answer is "not known
    // yet", or a retry (under a new minted key) could write twice.
    let t = spawn(
        test_config(&["--faults", "seed=1", "--write-deadline-ms", "100"]),
        None,
        None,
    )
    .await;
    let account = new_account();
    let mut hold = faults(&t).hold_next_write();
    let late = t.deposit(&account, 700, None).await;
    assert!(hold.held().await);
    assert_error(&late, 409, "CONFLICT");
    let key = late
        .header("idempotency-key")
        .expect("the minted key is named")
        .to_string();
    assert!(late.header("idempotency-window").is_some(), "{late:?}");
    let m = t.get("/metrics").await;
    assert_eq!(
        common::metric_sum(&m.text, "tally_write_answers_late_total"),
        1.0
    );
    // The write went on: released, it lands once, and the retry under the key replays it.
    hold.release();
    let retry = t.deposit(&account, 700, Some(&key)).await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.text);
    assert!(retry.replayed());
    assert_eq!(leg(&retry.body), (700, 1));
    assert_eq!(t.history(&account).await.len(), 1);
    t.shutdown().await;
}

#[tokio::test]
async fn every_write_response_states_the_idempotency_window() {
    let t = spawn_default().await;
    let (a, b) = (funded(&t, 1_000).await, new_account());
    let replies = [
        t.deposit(&a, 1, None).await,
        t.withdraw(&a, 1, None).await,
        t.transfer(&a, &b, 1, Some("window-t")).await,
        t.transfer(&a, &b, 1, Some("window-t")).await,
        t.post(
            &account_transfer_path(&a),
            &json!({ "toAccountId": b, "amountCents": 1 }),
            None,
        )
        .await,
    ];
    for r in &replies {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.header("idempotency-window"), Some("90"), "{r:?}");
    }
    // Reads are not writes.
    let r = t.get(&format!("/api/accounts/{a}/balance")).await;
    assert_eq!(r.header("idempotency-window"), None);
    t.shutdown().await;

    let t = spawn(test_config(&["--idempotency-window", "30"]), None, None).await;
    let a = new_account();
    let r = t.deposit(&a, 5, Some("w30")).await;
    assert_eq!(r.header("idempotency-window"), Some("30"));
    let r = t.deposit(&a, 5, Some("w30")).await;
    assert!(r.replayed());
    assert_eq!(r.header("idempotency-window"), Some("30"));
    let r = t.withdraw(&a, 50, None).await;
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(r.header("idempotency-window"), Some("30"));
    t.shutdown().await;
}
