//! Every route's successful answers: balance (with `minVersion`), history and its pages,
//! deposit, withdraw, both transfer routes, the probes and the metrics scrape.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::account::AccountId;
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, Event, SharedLog};
use uuid::Uuid;

use crate::common::{
    self, Reply, account_transfer_path, assert_error, funded, leg, new_account, observe,
    scripted_faults, spawn, spawn_default, spawn_fleet_in_memory, test_config,
};

#[tokio::test]
async fn balance_of_an_account_without_events_is_zero_at_version_zero_and_creates_nothing() {
    let t = spawn_default().await;
    let account = new_account();
    let r = t.get(&format!("/api/accounts/{account}/balance")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "balanceCents": 0, "aggregateVersion": 0 }));
    let h = t.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(h.status, StatusCode::OK, "{}", h.text);
    assert_eq!(
        h.body,
        json!({ "events": [], "currentAggregateVersion": 0, "balanceCents": 0 })
    );
    t.shutdown().await;
}

#[tokio::test]
async fn deposit_and_withdraw_answer_the_new_balance_and_version() {
    let t = spawn_default().await;
    let account = new_account();
    let r = t.deposit(&account, 1_000, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.body,
        json!({ "balanceCents": 1000, "aggregateVersion": 1 })
    );
    let r = t.withdraw(&account, 300, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body,
        json!({ "balanceCents": 700, "aggregateVersion": 2 })
    );
    // Withdrawing everything is allowed: the balance may reach zero, not go below it.
    let r = t.withdraw(&account, 700, None).await;
    assert_eq!(r.body, json!({ "balanceCents": 0, "aggregateVersion": 3 }));
    assert_eq!(t.balance(&account).await, (0, 3));
    // The largest amount one operation may move.
    let r = t.deposit(&account, 2_147_483_647, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (2_147_483_647, 4));
    t.shutdown().await;
}

#[tokio::test]
async fn balance_with_min_version_reads_your_writes_on_any_replica() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let account = new_account();
    // Replica b folds the account while it is still empty.
    assert_eq!(b.balance(&account).await, (0, 0));
    let r = a.deposit(&account, 250, None).await;
    assert_eq!(leg(&r.body), (250, 1));
    let r = a
        .get(&format!("/api/accounts/{account}/balance?minVersion=1"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (250, 1));
    let r = b
        .get(&format!("/api/accounts/{account}/balance?minVersion=1"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (250, 1));
    // minVersion=0 is satisfied by anything.
    let r = b
        .get(&format!("/api/accounts/{account}/balance?minVersion=0"))
        .await;
    assert_eq!(leg(&r.body), (250, 1));
    for t in fleet {
        t.shutdown().await;
    }
}

/// Rule: a `minVersion` the store has not reached is a final 400, never a 503 that no retry
/// can answer; once a write reaches it, the same read is answered. (A version the store has
/// but this replica cannot see yet is the retryable 503: `src/reader/tests.rs`.)
#[tokio::test]
async fn balance_with_a_min_version_beyond_the_stores_tip_is_400() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let path = format!("/api/accounts/{account}/balance?minVersion=2");
    let r = t.get(&path).await;
    assert_error(&r, 400, "MIN_VERSION_BEYOND_TIP");
    let r = t
        .get(&format!(
            "/api/accounts/{account}/balance?minVersion={}",
            u64::MAX
        ))
        .await;
    assert_error(&r, 400, "MIN_VERSION_BEYOND_TIP");
    assert_eq!(t.deposit(&account, 5, None).await.status, StatusCode::OK);
    let r = t.get(&path).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (105, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn history_lists_every_event_with_its_fields() {
    let t = spawn_default().await;
    let (a, b) = (new_account(), new_account());
    let k1 = Uuid::new_v4().to_string();
    let k2 = Uuid::new_v4().to_string();
    let k3 = Uuid::new_v4().to_string();
    assert_eq!(t.deposit(&a, 1_000, Some(&k1)).await.status, StatusCode::OK);
    assert_eq!(t.withdraw(&a, 100, Some(&k2)).await.status, StatusCode::OK);
    assert_eq!(
        t.transfer(&a, &b, 250, Some(&k3)).await.status,
        StatusCode::OK
    );

    let r = t.get(&format!("/api/accounts/{a}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["balanceCents"], 650);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    let events = r.body["events"].as_array().expect("events");
    assert_eq!(events.len(), 3);
    for e in events {
        assert!(e["timestamp"].as_u64().is_some_and(|ts| ts > 0), "{e}");
    }
    let strip = |e: &Value| {
        let mut e = e.clone();
        e.as_object_mut().unwrap().remove("timestamp");
        e
    };
    assert_eq!(
        strip(&events[0]),
        json!({ "aggregateVersion": 1, "type": "Deposited", "amountCents": 1000, "eventId": k1, "writer": "service" })
    );
    assert_eq!(
        strip(&events[1]),
        json!({ "aggregateVersion": 2, "type": "Withdrawn", "amountCents": 100, "eventId": k2, "writer": "service" })
    );
    assert_eq!(
        strip(&events[2]),
        json!({
            "aggregateVersion": 3, "type": "TransferredOut", "amountCents": 250,
            "toAccountId": b, "eventId": k3, "writer": "service"
        })
    );
    let r = t.get(&format!("/api/accounts/{b}/history")).await;
    assert_eq!(r.body["balanceCents"], 250);
    assert_eq!(r.body["currentAggregateVersion"], 1);
    assert_eq!(
        strip(&r.body["events"][0]),
        json!({
            "aggregateVersion": 1, "type": "TransferredIn", "amountCents": 250,
            "fromAccountId": a, "eventId": k3, "writer": "service"
        })
    );
    t.shutdown().await;
}

#[tokio::test]
async fn history_pages_with_limit_and_next_from_version() {
    let t = spawn_default().await;
    let account = new_account();
    for cents in 1..=5 {
        assert_eq!(
            t.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    let page = |from: u64, limit: u64| {
        let path = format!("/api/accounts/{account}/history?fromVersion={from}&limit={limit}");
        let t = &t;
        async move { t.get(&path).await }
    };
    let versions = |r: &Reply| -> Vec<u64> {
        r.body["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["aggregateVersion"].as_u64().unwrap())
            .collect()
    };
    let r = page(1, 2).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(versions(&r), [1, 2]);
    assert_eq!(r.body["nextFromVersion"], 3);
    assert_eq!(r.body["currentAggregateVersion"], 5);
    assert_eq!(r.body["balanceCents"], 15);
    let r = page(3, 2).await;
    assert_eq!(versions(&r), [3, 4]);
    assert_eq!(r.body["nextFromVersion"], 5);
    let r = page(5, 2).await;
    assert_eq!(versions(&r), [5]);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    // A page that ends exactly at the tip has no next page either.
    let r = page(4, 2).await;
    assert_eq!(versions(&r), [4, 5]);
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    // Without fromVersion, paging starts at the beginning; fromVersion=0 reads as 1.
    let r = t
        .get(&format!("/api/accounts/{account}/history?limit=1"))
        .await;
    assert_eq!(versions(&r), [1]);
    assert_eq!(r.body["nextFromVersion"], 2);
    let r = page(0, 1).await;
    assert_eq!(versions(&r), [1]);
    // Past the tip: nothing, and no next page.
    let r = page(6, 10).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(versions(&r), Vec::<u64>::new());
    assert!(r.body.get("nextFromVersion").is_none(), "{}", r.text);
    assert_eq!(r.body["currentAggregateVersion"], 5);
    // Far past it, too: the version reported is the account's, not the one asked for.
    let r = page(1000, 10).await;
    assert_eq!(r.body["currentAggregateVersion"], 5, "{}", r.text);
    let r = t
        .get(&format!(
            "/api/accounts/{}/history?fromVersion=5",
            new_account()
        ))
        .await;
    assert_eq!(r.body["currentAggregateVersion"], 0, "{}", r.text);
    t.shutdown().await;
}

/// Black-box finding: a hot account's batch holds several events under one version, and a
/// page overran `limit` by the rest of a batch. A page ends on a batch boundary and holds at
/// most `limit` events, unless one batch alone holds more.
#[tokio::test]
async fn a_history_page_ends_on_a_batch_boundary_within_the_limit() {
    let mem = Arc::new(MemoryLog::new());
    let t = spawn(test_config(&[]), Some(mem.clone() as SharedLog), None).await;
    let account = new_account();
    assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    let deposit = tally::account::AccountEvent::Deposited { amount: 2 };
    mem.write_now(
        0xf0e1,
        vec![AggregateWrite {
            key,
            events: (1..=3)
                .map(|seq| Event {
                    client_seq: seq,
                    event_id: None,
                    event_type: deposit.event_type(),
                    payload: deposit.encode(),
                    timestamp_ms: 0,
                })
                .collect(),
            expected_version: Some(1),
            allow_create: false,
            enforce_client_idempotency: false,
        }],
    )
    .expect("a 3-event batch at version 2");
    assert_eq!(t.deposit(&account, 4, None).await.status, StatusCode::OK);

    let page = |from: u64, limit: u64| {
        let path = format!("/api/accounts/{account}/history?fromVersion={from}&limit={limit}");
        let t = &t;
        async move {
            let r = t.get(&path).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            let versions: Vec<u64> = r.body["events"]
                .as_array()
                .expect("events")
                .iter()
                .map(|e| e["aggregateVersion"].as_u64().unwrap())
                .collect();
            (versions, r.body["nextFromVersion"].as_u64())
        }
    };
    assert_eq!(page(1, 2).await, (vec![1], Some(2)));
    assert_eq!(page(1, 4).await, (vec![1, 2, 2, 2], Some(3)));
    assert_eq!(
        page(2, 1).await,
        (vec![2, 2, 2], Some(3)),
        "one batch, whole"
    );
    assert_eq!(page(2, 3).await, (vec![2, 2, 2], Some(3)));
    assert_eq!(page(2, 4).await, (vec![2, 2, 2, 3], None));
    t.shutdown().await;
}

/// Black-box finding: under a lagging read, a page came back empty without `nextFromVersion`
/// although the account had more, and a client following the pages stopped early. Every page
/// now either moves forward or is a retryable 503.
#[tokio::test]
async fn a_history_page_cut_short_by_a_lagging_read_still_points_at_the_rest() {
    let faulty = scripted_faults();
    let t = spawn(test_config(&[]), Some(faulty.clone() as SharedLog), None).await;
    let account = new_account();
    for cents in 1..=3 {
        assert_eq!(
            t.deposit(&account, cents, None).await.status,
            StatusCode::OK
        );
    }
    // The history's catch-up read is current; its page read hides the newest 2 batches.
    faulty.lag_next_read(0);
    faulty.lag_next_read(2);
    let r = t
        .get(&format!("/api/accounts/{account}/history?fromVersion=3"))
        .await;
    // Nothing read at all: a retryable 503, never an empty page pointing at itself.
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // A read that shows part of what is there: that part, and where the rest starts.
    faulty.lag_next_read(0);
    faulty.lag_next_read(1);
    let r = t
        .get(&format!("/api/accounts/{account}/history?fromVersion=2"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().map(Vec::len), Some(1));
    assert_eq!(r.body["currentAggregateVersion"], 3);
    assert_eq!(r.body["nextFromVersion"], 3, "{}", r.text);
    assert_eq!(faulty.counts().read_lag, 4);
    t.shutdown().await;
}

#[tokio::test]
async fn history_page_size_defaults_to_100_and_is_bounded_at_1000() {
    let t = spawn_default().await;
    let account = new_account();
    for _ in 0..101 {
        assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    }
    let r = t.get(&format!("/api/accounts/{account}/history")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 100);
    assert_eq!(r.body["nextFromVersion"], 101);
    let r = t
        .get(&format!("/api/accounts/{account}/history?limit=1000"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().unwrap().len(), 101);
    assert!(r.body.get("nextFromVersion").is_none());
    for limit in ["1001", "0"] {
        let r = t
            .get(&format!("/api/accounts/{account}/history?limit={limit}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn transfer_answers_both_legs_and_replays_them() {
    let t = spawn_default().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = "transfer-1";
    let r = t.transfer(&from, &to, 400, Some(key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let expected = json!({
        "from": { "balanceCents": 600, "aggregateVersion": 2 },
        "to": { "balanceCents": 400, "aggregateVersion": 1 },
    });
    assert_eq!(r.body, expected);
    assert!(!r.replayed());
    assert_eq!(r.header("idempotency-key"), Some(key));
    // Later writes on both accounts do not change the replayed answer.
    assert_eq!(t.deposit(&from, 5, None).await.status, StatusCode::OK);
    assert_eq!(t.deposit(&to, 5, None).await.status, StatusCode::OK);
    let again = t.transfer(&from, &to, 400, Some(key)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, expected);
    assert!(again.replayed());
    assert_eq!(again.header("idempotency-window"), Some("90"));
    assert_eq!(t.balance(&from).await, (605, 3));
    assert_eq!(t.balance(&to).await, (405, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn account_scoped_transfer_has_the_same_semantics_as_the_transfers_route() {
    let t = spawn_default().await;
    let (from, to) = (funded(&t, 1_000).await, new_account());
    let key = Uuid::new_v4().to_string();
    let body = json!({ "toAccountId": to, "amountCents": 300 });
    let r = t
        .post(&account_transfer_path(&from), &body, Some(&key))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let expected = json!({
        "from": { "balanceCents": 700, "aggregateVersion": 2 },
        "to": { "balanceCents": 300, "aggregateVersion": 1 },
    });
    assert_eq!(r.body, expected);
    assert!(!r.replayed());
    assert_eq!(r.header("idempotency-window"), Some("90"));
    // The same intent through the other route is the same request: a replay.
    let r = t.transfer(&from, &to, 300, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body, expected);
    assert!(r.replayed());
    // And the other way round.
    let key2 = Uuid::new_v4().to_string();
    let first = t.transfer(&from, &to, 50, Some(&key2)).await;
    let body2 = json!({ "toAccountId": to, "amountCents": 50 });
    let second = t
        .post(&account_transfer_path(&from), &body2, Some(&key2))
        .await;
    assert_eq!(first.body, second.body);
    assert!(second.replayed());
    assert_eq!(t.balance(&from).await, (650, 3));
    assert_eq!(t.balance(&to).await, (350, 2));
    let before = (observe(&t, &from).await, observe(&t, &to).await);
    let rejected = [
        // The payer comes from the path: naming it in the body is an unknown field.
        (
            json!({ "fromAccountId": from, "toAccountId": to, "amountCents": 1 }),
            "VALIDATION_ERROR",
        ),
        // Insufficient funds and the same-account rule hold on this route too.
        (
            json!({ "toAccountId": to, "amountCents": 651 }),
            "INSUFFICIENT_FUNDS",
        ),
        (
            json!({ "toAccountId": from, "amountCents": 1 }),
            "VALIDATION_ERROR",
        ),
    ];
    for (body, code) in rejected {
        let r = t.post(&account_transfer_path(&from), &body, None).await;
        assert_error(&r, 422, code);
        if code == "INSUFFICIENT_FUNDS" {
            assert_eq!(r.body["balanceCents"], 650);
        }
        assert_eq!(
            (observe(&t, &from).await, observe(&t, &to).await),
            before,
            "{body} changed something"
        );
    }
    t.shutdown().await;
}

#[tokio::test]
async fn healthz_and_readyz_answer_and_readyz_fails_while_shutting_down() {
    let t = spawn_default().await;
    let r = t.get("/healthz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "status": "ok" }));
    let r = t.get("/readyz").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, json!({ "status": "ready" }));
    t.app.begin_shutdown();
    let r = t.get("/readyz").await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // Liveness is not readiness: the process is still healthy while it drains.
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    t.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_probes_share_one_store_ping_a_second() {
    // Probes are unauthenticated and skip every admission limit: they must not become
    // store load.
    const PROBES: usize = 32;
    let t = Arc::new(spawn_default().await);
    let pings = |text: &str| {
        text.lines()
            .filter(|l| {
                l.starts_with("tally_store_requests_total{") && l.contains("operation=\"ping\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let before = pings(&t.get("/metrics").await.text);
    let started = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..PROBES {
        let t = t.clone();
        set.spawn(async move { t.get("/readyz").await });
    }
    for r in set.join_all().await {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    }
    let sent = pings(&t.get("/metrics").await.text) - before;
    let most = 1.0 + started.elapsed().as_secs_f64().floor();
    assert!(
        sent >= 1.0 && sent <= most,
        "{sent} pings for {PROBES} probes"
    );
    let Ok(t) = Arc::try_unwrap(t) else {
        panic!("every probe has finished")
    };
    t.shutdown().await;
}

#[tokio::test]
async fn metrics_are_prometheus_text_labelled_by_route_template_never_by_raw_path() {
    let t = spawn_default().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    assert_eq!(
        t.deposit(&account, 10, Some(&key)).await.status,
        StatusCode::OK
    );
    assert!(t.deposit(&account, 10, Some(&key)).await.replayed());
    assert_eq!(t.get("/no/such/route").await.status, StatusCode::NOT_FOUND);
    let r = t.get("/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = &r.text;
    for name in [
        "tally_http_requests_total",
        "tally_http_request_duration_seconds",
        "tally_http_requests_in_flight",
        "tally_idempotency_replays_total",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} in\n{text}"
        );
    }
    let deposits: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("tally_http_requests_total{"))
        .filter(|l| l.contains(r#"route="/api/accounts/{id}/deposit""#))
        .collect();
    assert_eq!(deposits.len(), 1, "{text}");
    assert!(deposits[0].contains(r#"method="POST""#), "{}", deposits[0]);
    assert!(
        deposits[0].contains(r#"status_class="2xx""#),
        "{}",
        deposits[0]
    );
    assert!(deposits[0].ends_with(" 2"), "{}", deposits[0]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("tally_http_requests_total{")
                && l.contains(r#"route="unmatched""#)
                && l.contains(r#"status_class="4xx""#)),
        "{text}"
    );
    assert!(
        common::metric_sum(text, "tally_idempotency_replays_total") >= 1.0,
        "{text}"
    );
    assert!(
        !text.contains(&account),
        "a raw id leaked into a label:\n{text}"
    );
    assert!(
        !text.contains("/no/such/route"),
        "a raw path leaked:\n{text}"
    );
    t.shutdown().await;
}

/// Rule: every answer says its content type is final (`X-Content-Type-Options: nosniff`),
/// whatever route or error gave it, an event stream too; and the console's policy runs its
/// inline code by hash, never by `'unsafe-inline'`.
#[tokio::test]
async fn every_answer_forbids_sniffing_and_the_console_allows_no_unsafe_inline() {
    let t = spawn_default().await;
    let account = new_account();
    let client = &t.client;
    let requests = [
        client.get(t.url("/")),
        client.get(t.url("/healthz")),
        client.get(t.url("/readyz")),
        client.get(t.url("/metrics")),
        client.get(t.url("/openapi.json")),
        client.get(t.url(&format!("/api/accounts/{account}/balance"))),
        client.get(t.url("/api/nothing")),
        client.delete(t.url("/api/accounts")),
        client
            .post(t.url(&format!("/api/accounts/{account}/deposit")))
            .body("{"),
        client.get(t.url(&format!("/api/accounts/{account}/events"))),
    ];
    for req in requests {
        let resp = req.send().await.expect("sent");
        let what = format!("{} {}", resp.status(), resp.url().path());
        assert_eq!(
            resp.headers()
                .get("x-content-type-options")
                .map(|v| v.to_str().unwrap()),
            Some("nosniff"),
            "{what}"
        );
        if resp.url().path() == "/" {
            let policy = resp.headers()["content-security-policy"].to_str().unwrap();
            assert!(!policy.contains("unsafe-inline"), "{policy}");
            assert!(policy.contains("script-src 'sha256-"), "{policy}");
        }
        // The event stream's headers are enough; its body never ends.
        drop(resp);
    }
    t.shutdown().await;
}
