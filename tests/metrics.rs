//! `/metrics` after a scripted sequence (a write, a replay, a key reuse, a forced conflict):
//! each counter moved by exactly the expected amount.

mod common;

use std::sync::Arc;

use common::{metric_sample as sample, new_account, spawn_fleet};
use tally::store::SharedLog;
use tally::store::memory::MemoryLog;

#[tokio::test]
async fn counters_move_by_exactly_what_the_scripted_sequence_did() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let fleet = spawn_fleet(2, store, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let acct = new_account();
    // The start-up store checks (the epoch's create-only write, or its read) are done before
    // the script starts; the store's counters below count from here.
    for replica in &fleet {
        replica.app.projection.store_checked(1).await;
    }
    let before = a.get("/metrics").await.text;
    let store_delta = |t: &str, name: &str| sample(t, name) - sample(&before, name);

    // A write (cold account: one catch-up, one write).
    assert_eq!(a.deposit(&acct, 100, Some("k1")).await.status, 200);
    // A replay, answered from A's index without touching the store.
    assert!(a.deposit(&acct, 100, Some("k1")).await.replayed());
    // A key reuse, refused.
    assert_eq!(a.deposit(&acct, 200, Some("k1")).await.status, 422);
    // Replica B moves the stream, so A's next write (at A's stale cursor) conflicts once,
    // catches up, and lands.
    assert_eq!(b.deposit(&acct, 50, Some("k2")).await.status, 200);
    assert_eq!(a.deposit(&acct, 10, Some("k3")).await.status, 200);

    let m = a.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert!(
        m.header("content-type")
            .unwrap_or("")
            .starts_with("text/plain"),
        "{:?}",
        m.headers
    );
    let t = &m.text;
    let arm = |arm: &str| {
        sample(
            t,
            &format!("tally_write_outcomes_total{{arm=\"{arm}\",operation=\"deposit\"}}"),
        )
    };
    assert_eq!(arm("success"), 2.0, "k1 and k3 landed on A\n{t}");
    assert_eq!(arm("replayed"), 1.0);
    assert_eq!(arm("conflict"), 1.0);
    assert_eq!(arm("outcome_unknown"), 0.0);
    assert_eq!(sample(t, "tally_idempotency_replays_total"), 1.0);
    assert_eq!(sample(t, "tally_idempotency_key_reuse_total"), 1.0);
    assert_eq!(sample(t, "tally_idempotency_keys_minted_total"), 0.0);
    let http = |class: &str| {
        sample(
            t,
            &format!(
                "tally_http_requests_total{{method=\"POST\",route=\"/api/accounts/{{id}}/deposit\",status_class=\"{class}\"}}"
            ),
        )
    };
    assert_eq!(http("2xx"), 3.0);
    assert_eq!(http("4xx"), 1.0);
    // Round trips: k1 = write (a first touch: the catch-up it starts beside the write is
    // cancelled once the write lands); replay and reuse = none (local fold); k3 = write
    // (conflict) + catch-up + write.
    assert_eq!(sample(t, "tally_store_round_trips_per_write_count"), 4.0);
    assert_eq!(sample(t, "tally_store_round_trips_per_write_sum"), 4.0);
    assert_eq!(
        store_delta(
            t,
            "tally_store_requests_total{operation=\"write\",result=\"conflict\"}"
        ),
        1.0
    );
    // k1 and k3.
    assert_eq!(
        store_delta(
            t,
            "tally_store_requests_total{operation=\"write\",result=\"ok\"}"
        ),
        2.0
    );
    // B's own registry saw only its own write: replicas never mix their counts.
    let mb = b.get("/metrics").await.text;
    assert_eq!(
        sample(
            &mb,
            "tally_write_outcomes_total{arm=\"success\",operation=\"deposit\"}"
        ),
        1.0
    );
    // No account id ever appears in a label.
    assert!(!t.contains(&acct), "an account id leaked into /metrics");
}
