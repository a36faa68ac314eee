//! When the store fails: a write that cannot complete is a retryable 409 whose retry with the
//! same key writes once, and a poisoned stream is a 500 with an error id that nothing is
//! written to. When the replica itself stood still: keyed writes read just after are a
//! retryable 503 that writes nothing.

use std::sync::Arc;

use bytes::Bytes;
use reqwest::StatusCode;
use tally::account::AccountId;
use tally::store::faults::Fault;
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, Event, EventType, SharedLog};
use uuid::Uuid;

use crate::common::{
    assert_error, faults, funded, leg, new_account, observe, spawn,
    spawn_one_attempt_with_scripted_faults, test_config,
};

#[tokio::test]
async fn a_write_that_cannot_complete_is_a_retryable_409_and_writes_nothing() {
    // Every store write is refused: the loop gives up after its attempts.
    let t = spawn(
        test_config(&["--faults", "seed=1", "--write-max-attempts", "3"]),
        None,
        None,
    )
    .await;
    for _ in 0..3 {
        faults(&t).fail_next_write(Fault::Refused);
    }
    let account = new_account();
    let r = t.deposit(&account, 100, Some("refused-1")).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("idempotency-key"), Some("refused-1"));
    // What is left of the 90 s window for a retry sent now: less this attempt's time (it
    // joined no running attempt) and the 7.75 s a retry may take to look (waits, an
    // unfenced stall, its own life).
    let left: u64 = r
        .header("idempotency-window")
        .and_then(|w| w.parse().ok())
        .expect("a window header");
    // 90 - 7.75 = 82 less this attempt's time: above 77, which taking a running attempt's
    // whole life off as well would give (`write_loop::service`'s coalescing test pins that
    // a shared answer counts from the first attempt).
    assert!((78..=82).contains(&left), "{left}");
    assert!(!r.replayed());
    let r = t.transfer(&account, &new_account(), 1, None).await;
    // Nothing to move: the rule refuses before any write is tried.
    assert_error(&r, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(observe(&t, &account).await, (0, 0, vec![]));
    assert_eq!(faults(&t).counts().refused, 3);
    t.shutdown().await;
}

#[tokio::test]
async fn a_409_after_a_refused_write_is_retried_with_the_same_key_and_writes_once() {
    let t = spawn(
        test_config(&["--faults", "seed=1", "--write-max-attempts", "1"]),
        None,
        None,
    )
    .await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    faults(&t).fail_next_write(Fault::Refused);
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(observe(&t, &account).await, (0, 0, vec![]));
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        !r.replayed(),
        "nothing had landed, so this is the first answer"
    );
    assert_eq!(leg(&r.body), (100, 1));
    assert_eq!(t.history(&account).await.len(), 1);
    t.shutdown().await;
}

#[tokio::test]
async fn a_409_after_a_lost_ack_is_answered_by_the_retry_as_a_replay_without_a_second_write() {
    // One attempt per request, each starting with a catch-up read, so the first request
    // gives up right after the lost ack and the retry reads the stream before writing.
    let t = spawn_one_attempt_with_scripted_faults().await;
    let account = new_account();
    let key = Uuid::new_v4().to_string();
    // The write lands, but its answer is lost: the loop cannot know and gives up.
    faults(&t).fail_next_write(Fault::LostAck);
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_error(&r, 409, "CONFLICT");
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = t.deposit(&account, 100, Some(&key)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.replayed());
    assert_eq!(leg(&r.body), (100, 1));
    let events = t.history(&account).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["eventId"], key);
    t.shutdown().await;
}

#[tokio::test]
async fn a_poisoned_stream_is_500_with_an_error_id_and_nothing_is_written_to_it() {
    let mem = Arc::new(MemoryLog::new());
    let t = spawn(test_config(&[]), Some(mem.clone() as SharedLog), None).await;
    let account = new_account();
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    // An event no Tally version can decode, straight into the shared store.
    mem.write_now(
        0xbad,
        vec![AggregateWrite {
            key,
            events: vec![Event {
                client_seq: 1,
                event_id: None,
                event_type: EventType {
                    major: 99,
                    minor: 0,
                },
                payload: Bytes::from_static(b"{}"),
                timestamp_ms: 0,
            }],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: false,
        }],
    )
    .expect("poison written");
    let mut ids = Vec::new();
    for path in [
        format!("/api/accounts/{account}/balance"),
        format!("/api/accounts/{account}/balance"),
        format!("/api/accounts/{account}/history"),
    ] {
        let r = t.get(&path).await;
        assert_error(&r, 500, "ACCOUNT_UNREADABLE");
        let id = r.body["errorId"].as_str().expect("errorId");
        ids.push(Uuid::parse_str(id).expect("errorId is a UUID"));
    }
    ids.dedup();
    assert_eq!(ids.len(), 3, "each failure has its own error id");
    let r = t.deposit(&account, 100, None).await;
    assert_error(&r, 500, "ACCOUNT_UNREADABLE");
    assert!(r.body["errorId"].is_string(), "{}", r.text);
    let payer = funded(&t, 10).await;
    let r = t.transfer(&payer, &account, 5, None).await;
    assert_error(&r, 500, "ACCOUNT_UNREADABLE");
    assert_eq!(
        mem.batch_count(key),
        1,
        "nothing was appended to the poisoned stream"
    );
    // Other accounts are unaffected, the payer of the refused transfer included.
    assert_eq!(t.balance(&payer).await, (10, 1));
    assert_eq!(t.deposit(&payer, 1, None).await.status, StatusCode::OK);
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    t.shutdown().await;
}

/// A store whose reads hide every event of the accounts in `hidden`, while its details
/// still say where they stand: the shape of a server that acknowledged a create and then
/// kept the new aggregate's head from every read (docs/stores.md).
struct HidesReads {
    inner: SharedLog,
    hidden: std::sync::Mutex<Vec<tally::store::AggregateKey>>,
}

#[async_trait::async_trait]
impl tally::store::EventLog for HidesReads {
    async fn write(
        &self,
        client: tally::store::ClientId,
        writes: Vec<AggregateWrite>,
    ) -> tally::store::StoreResult<Vec<u64>> {
        self.inner.write(client, writes).await
    }
    async fn read(
        &self,
        key: tally::store::AggregateKey,
        filter: &tally::store::ReadFilter,
    ) -> tally::store::StoreResult<tally::store::ReadPage> {
        if self.hidden.lock().unwrap().contains(&key) {
            return Ok(tally::store::ReadPage {
                batches: Vec::new(),
                next_version: None,
            });
        }
        self.inner.read(key, filter).await
    }
    async fn details(
        &self,
        key: tally::store::AggregateKey,
    ) -> tally::store::StoreResult<tally::store::AggregateDetails> {
        self.inner.details(key).await
    }
    async fn trim_start(
        &self,
        key: tally::store::AggregateKey,
        keep_from_version: u64,
    ) -> tally::store::StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule: an account the store says exists, but whose events its reads do not show, is never
/// answered as a new account (balance 0 at version 0 in a 200): balance and history are a
/// retryable 503. An account that really does not exist still reads as empty.
#[tokio::test]
async fn an_account_whose_events_the_store_hides_is_a_retryable_503_never_a_zero_balance() {
    let mem: SharedLog = Arc::new(MemoryLog::new());
    let writer = spawn(test_config(&[]), Some(mem.clone()), None).await;
    let account = new_account();
    assert_eq!(
        writer.deposit(&account, 700, None).await.status,
        StatusCode::OK
    );
    let key = tally::account::Identity::default().key(AccountId(account.parse().unwrap()));
    let hiding: SharedLog = Arc::new(HidesReads {
        inner: mem,
        hidden: std::sync::Mutex::new(vec![key]),
    });
    let reader = spawn(test_config(&[]), Some(hiding), None).await;
    let balance = reader
        .get(&format!("/api/accounts/{account}/balance"))
        .await;
    assert_error(&balance, 503, "SERVICE_UNAVAILABLE");
    assert!(balance.text.contains("version 1"), "{}", balance.text);
    let history = reader
        .get(&format!("/api/accounts/{account}/history"))
        .await;
    assert_error(&history, 503, "SERVICE_UNAVAILABLE");
    let unknown = reader
        .get(&format!("/api/accounts/{}/balance", new_account()))
        .await;
    assert_eq!(unknown.status, StatusCode::OK, "{}", unknown.text);
    assert_eq!(
        (
            &unknown.body["balanceCents"],
            &unknown.body["aggregateVersion"]
        ),
        (&serde_json::json!(0), &serde_json::json!(0))
    );
    writer.shutdown().await;
    reader.shutdown().await;
}

/// Rule: just after the replica stood still (stopped or frozen past `stall::THRESHOLD`),
/// a keyed write is a retryable 503 that decides and writes nothing, since it may have
/// waited unread through the stall for longer than a write may live; reads are served.
#[tokio::test]
async fn a_keyed_write_read_just_after_a_stall_is_a_retryable_503_and_writes_nothing() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    assert_eq!(t.deposit(&account, 100, Some("before")).await.status, 200);
    t.app.stall.observe_now(std::time::Duration::from_secs(95));
    let r = t.deposit(&account, 50, Some("after-stall")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(
        r.body["message"]
            .as_str()
            .unwrap_or("")
            .contains("95000 ms"),
        "{}",
        r.text
    );
    let r = t
        .transfer(&account, &new_account(), 10, Some("after-stall-2"))
        .await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(t.balance(&account).await, (100, 1), "nothing written");
    assert_eq!(
        t.app.metrics.process_stalls.get(),
        1,
        "the stall is counted once"
    );
    let refused = t
        .app
        .metrics
        .write_refused
        .with_label_values(&["stall"])
        .get();
    assert_eq!(refused, 2, "each refusal counted");
}
