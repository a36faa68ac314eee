//! Start-up: the demo accounts seeded (or not) and listed, and a replica that serves but is
//! not ready until its seeding and its first server-clock anchor are done.

use clap::Parser;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::config::Config;
use tally::store::faults::Fault;
use uuid::Uuid;

use crate::common::{
    TestApp, assert_error, leg, metric_sample, scripted_faults, spawn, spawn_default,
};

/// The harness config with demo-account seeding on (the harness turns it off).
fn seeding_config() -> Config {
    Config::parse_from([
        "tally",
        "--listen",
        "127.0.0.1:0",
        "--seed-demo-accounts",
        "true",
    ])
}

/// A demo account's id: UUIDv5 of its name in the documented namespace.
fn demo_id(name: &str) -> String {
    let ns = Uuid::parse_str("a1b2c3d4-e5f6-7890-abcd-ef1234567890").unwrap();
    Uuid::new_v5(&ns, name.as_bytes()).to_string()
}

/// Every demo account holds exactly its opening deposit, at version 1.
async fn assert_demo_accounts_seeded_once(t: &TestApp) {
    for (name, cents) in [("Alice", 50_000), ("Bob", 25_000), ("Charlie", 10_000)] {
        assert_eq!(t.balance(&demo_id(name)).await, (cents, 1), "{name}");
    }
}

#[tokio::test]
async fn no_accounts_are_listed_unless_demo_accounts_are_seeded() {
    let t = spawn_default().await;
    let r = t.get("/api/accounts").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, json!({ "accounts": [] }));
    t.shutdown().await;
}

#[tokio::test]
async fn seeded_demo_accounts_are_listed_with_named_ids_and_opening_balances() {
    let t = spawn(seeding_config(), None, None).await;
    let r = t.get("/api/accounts").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let expected: Vec<Value> = ["Alice", "Bob", "Charlie"]
        .iter()
        .map(|name| json!({ "id": demo_id(name), "name": name }))
        .collect();
    assert_eq!(r.body["accounts"], Value::Array(expected));
    assert_demo_accounts_seeded_once(&t).await;
    t.shutdown().await;
}

/// Black-box finding: a store fault during demo seeding stopped the process at boot. Now the
/// replica starts and serves, `/readyz` says it is not ready, and the seeding is retried until
/// it lands (once: the opening deposits are create-only).
#[tokio::test]
async fn a_store_fault_during_start_up_leaves_the_replica_serving_and_not_ready_until_retried() {
    let faulty = scripted_faults();
    // The first write (the clock anchor's probe: steps start in order on this test's one
    // thread) is held until released, so the replica is not started for as long as the
    // checks below take, however slow the machine (a refused anchor retried after 50 ms
    // could land before them). Two seeds fail on the way.
    let hold = faulty.hold_next_write();
    faulty.fail_next_write(Fault::Refused);
    faulty.fail_next_write(Fault::LostAck);
    let t = spawn(seeding_config(), Some(faulty.clone()), None).await;
    assert!(!t.app.is_started());
    let r = t.get("/readyz").await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert!(r.text.contains("starting"), "{}", r.text);
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    // The API waits too: a write now could take a demo account's first version, and the
    // fold cannot age the index before the server clock is anchored.
    let alice = demo_id("Alice");
    let r = t.deposit(&alice, 100, Some("early")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(t.app.projection.server_tip_ms(), 0, "not anchored yet");

    hold.release();
    t.app.started().await;
    assert!(t.app.projection.server_tip_ms() > 0, "anchored");
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    assert_demo_accounts_seeded_once(&t).await;
    let r = t.deposit(&alice, 100, Some("early")).await;
    assert_eq!(leg(&r.body), (50_100, 2), "{}", r.text);
    let counts = faulty.counts();
    assert_eq!((counts.refused, counts.lost_ack), (1, 1));
    t.shutdown().await;
}

/// Rule: a replica knows the demo accounts it seeded. Their first write is decided on their
/// state, not taken as a new account and bounced off the version guard: no conflict counted
/// for an account nobody else writes, and no wasted round trip.
#[tokio::test]
async fn the_first_write_to_a_seeded_account_is_decided_on_its_state() {
    let t = spawn(seeding_config(), None, None).await;
    let r = t
        .deposit(&demo_id("Alice"), 100, Some("first-after-start"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (50_100, 2));
    let metrics = t.get("/metrics").await.text;
    for arm in ["conflict", "first_touch_bounce"] {
        let series = format!("tally_write_outcomes_total{{arm=\"{arm}\",operation=\"deposit\"}}");
        // Every arm's series exists from the start, so an absent one is a wrong name.
        assert!(metrics.contains(&format!("{series} ")), "{series} exported");
        assert_eq!(metric_sample(&metrics, &series), 0.0, "{series}");
    }
    // A read and the write; a bounced first touch would cost a write before them.
    let trips = metric_sample(&metrics, "tally_store_round_trips_per_write_sum");
    assert_eq!(trips, 2.0, "round trips for one deposit");
    t.shutdown().await;
}
