//! The watch streams, black-box over HTTP: `GET /api/accounts/{id}/events` and
//! `GET /api/watch/stream`. Ordering, resume without gap or duplicate, the typed trim
//! event, limits, a slow subscriber's end, clean-up on disconnect and shutdown.
//!
//! "Another replica" is a second `App` in this process over the same `MemoryLog` (the
//! embedded store cannot be shared between processes): each replica has its own hub
//! following the store's watch, exactly as two processes over one Celeriant would.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::sse::{EVENT_BOUND, Stream};
use common::windowed_log::{CELERIANT_WINDOW, WindowedLog, one_deposit};
use common::{TestApp, metric_sample, new_account, spawn, spawn_fleet, test_config};
use reqwest::StatusCode;
use tally::account::{AccountId, Identity};
use tally::store::faults::{FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, SharedLog};
use tally::watch::{EndReason, Item, Resume, Subscription};

fn events_path(account: &str) -> String {
    format!("/api/accounts/{account}/events")
}

async fn deposit_ok(t: &TestApp, account: &str, cents: i64) -> u64 {
    let r = t.deposit(account, cents, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    r.body["aggregateVersion"].as_u64().expect("version")
}

/// Waits, bounded, until the replica serves no stream (it learns of a closed connection,
/// or ends a stream, asynchronously).
async fn wait_for_no_subscribers(t: &TestApp, why: &str) {
    let deadline = tokio::time::Instant::now() + EVENT_BOUND;
    while t.app.watch.subscribers() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{why}: subscribers stuck at {}",
            t.app.watch.subscribers()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A replica with `flags`, and a stream on a new account that the test does not read while
/// `deposits` deposits of 1 cent land on it.
async fn unread_stream_over_deposits(flags: &[&str], deposits: usize) -> (TestApp, Subscription) {
    let t = spawn(test_config(flags), None, None).await;
    let account = new_account();
    let id = AccountId(account.parse().unwrap());
    let sub = t
        .app
        .watch
        .subscribe_account(None, id, Resume::Live)
        .await
        .unwrap();
    for _ in 0..deposits {
        deposit_ok(&t, &account, 1).await;
    }
    (t, sub)
}

#[tokio::test]
async fn a_fresh_stream_starts_with_a_snapshot_then_each_event_with_the_balance_after_it() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    deposit_ok(&t, &account, 500).await;
    let mut s = Stream::open(&t, &events_path(&account), None).await;
    let snap = s.next().await;
    assert_eq!(snap.name(), "snapshot");
    assert_eq!(snap.id.as_deref(), Some("1"));
    assert_eq!(snap.json()["balanceCents"], 500);
    assert_eq!(snap.json()["aggregateVersion"], 1);

    deposit_ok(&t, &account, 250).await;
    let r = t.withdraw(&account, 100, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let history = t.history(&account).await;
    for (version, name, balance) in [(2, "Deposited", 750), (3, "Withdrawn", 650)] {
        let e = s.next().await;
        assert_eq!(e.name(), name);
        assert_eq!(e.id, Some(version.to_string()));
        let mut data = e.json();
        assert_eq!(data["balanceCents"], balance);
        assert_eq!(data["accountId"], account.as_str());
        // Otherwise exactly the history event of that version.
        let obj = data.as_object_mut().unwrap();
        obj.remove("balanceCents");
        obj.remove("accountId");
        assert_eq!(&data, &history[version as usize - 1]);
        assert_eq!(data["writer"], "service");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn another_replicas_writes_and_another_writers_events_appear_on_the_stream() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let mut fleet = spawn_fleet(2, store.clone(), &[]).await;
    let (b, a) = (fleet.pop().unwrap(), fleet.pop().unwrap());
    let account = new_account();
    let mut s = Stream::open(&a, &events_path(&account), None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    deposit_ok(&b, &account, 300).await;
    let e = s.next().await;
    assert_eq!(
        (e.name(), e.json()["balanceCents"].clone()),
        ("Deposited", 300.into())
    );

    // A write by another client id (an offline device's sync writes this way).
    let device = uuid::Uuid::new_v4();
    let key = Identity::default().key(AccountId(account.parse().unwrap()));
    store
        .write(device.as_u128(), vec![one_deposit(key, 1, None, 40)])
        .await
        .unwrap();
    let e = s.next().await;
    let data = e.json();
    assert_eq!(e.id.as_deref(), Some("2"));
    assert_eq!(data["writer"], "client");
    assert_eq!(data["writerId"], device.to_string());
    assert_eq!(data["balanceCents"], 340);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn last_event_id_and_from_version_resume_without_a_gap_or_a_duplicate() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    for cents in 1..=5 {
        deposit_ok(&t, &account, cents * 100).await;
    }
    // Last-Event-ID 2: versions 3, 4, 5 from the store, then 6 live. It wins over the
    // fromVersion a browser keeps in the URL.
    let path = format!("{}?fromVersion=1", events_path(&account));
    let mut s = Stream::open(&t, &path, Some("2")).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let e = s.next().await;
        seen.push((
            e.id.clone().unwrap(),
            e.json()["balanceCents"].as_i64().unwrap(),
        ));
    }
    deposit_ok(&t, &account, 600).await;
    let e = s.next().await;
    seen.push((
        e.id.clone().unwrap(),
        e.json()["balanceCents"].as_i64().unwrap(),
    ));
    let want: Vec<(String, i64)> = vec![
        ("3".into(), 600),
        ("4".into(), 1000),
        ("5".into(), 1500),
        ("6".into(), 2100),
    ];
    assert_eq!(seen, want);

    let mut s = Stream::open(
        &t,
        &format!("{}?fromVersion=6", events_path(&account)),
        None,
    )
    .await;
    let e = s.next().await;
    assert_eq!((e.id.as_deref(), e.name()), (Some("6"), "Deposited"));
    deposit_ok(&t, &account, 700).await;
    assert_eq!(s.next().await.id.as_deref(), Some("7"));
    t.shutdown().await;
}

/// Rule: a resume never goes live over a hole. A read served by a lagging replica of the
/// store ends early without an error; the replay reads again from the first missing version,
/// and a range that stays short ends the stream with an `error` event (the client resumes
/// from its last id). Never skipped versions, never balances shifted by a short read.
#[tokio::test]
async fn a_resume_over_lagging_reads_never_skips_a_version_or_shifts_a_balance() {
    let spec = "read-lag=0.5,read-lag-batches=3,seed=7";
    let config = FaultConfig::parse(spec).expect("fault spec");
    let store = Arc::new(FaultyLog::new(Arc::new(MemoryLog::new()), config));
    let t = spawn(test_config(&[]), Some(store as SharedLog), None).await;
    let account = new_account();
    // Version v deposits v * 100: the balance after v is 100 * v(v+1)/2.
    for cents in 1..=6 {
        deposit_ok(&t, &account, cents * 100).await;
    }
    let mut streams = Vec::new();
    for _ in 0..12 {
        streams.push(Stream::open(&t, &events_path(&account), Some("1")).await);
    }
    // A live version after the replayed ones: a stream that skipped shows it next to a hole.
    deposit_ok(&t, &account, 700).await;
    let mut whole = 0;
    for (i, s) in streams.iter_mut().enumerate() {
        let mut want = 2u64;
        loop {
            let e = s.next().await;
            if e.name() == "error" {
                assert_eq!(
                    e.json()["error"],
                    "STORE_UNAVAILABLE",
                    "stream {i} ({spec})"
                );
                break;
            }
            let version: u64 = e.id.as_deref().unwrap().parse().unwrap();
            assert_eq!(version, want, "stream {i} skipped or repeated ({spec})");
            let balance = e.json()["balanceCents"].as_i64().unwrap();
            let v = version as i64;
            assert_eq!(
                balance,
                100 * v * (v + 1) / 2,
                "stream {i}, version {v} ({spec})"
            );
            if version == 7 {
                whole += 1;
                break;
            }
            want += 1;
        }
    }
    // Five reads in a row without progress end a stream; most get through.
    assert!(
        whole >= 6,
        "only {whole} of 12 streams replayed whole ({spec})"
    );
    t.shutdown().await;
}

#[tokio::test]
async fn a_resume_point_below_the_trim_says_so_in_a_typed_event() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    for _ in 0..4 {
        deposit_ok(&t, &account, 100).await;
    }
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    t.app.log.trim_start(key, 3).await.unwrap();
    let mut s = Stream::open(
        &t,
        &format!("{}?fromVersion=1", events_path(&account)),
        None,
    )
    .await;
    let e = s.next().await;
    assert_eq!(e.name(), "trimmed");
    assert_eq!(e.json()["fromVersion"], 1);
    assert_eq!(e.json()["firstAvailableVersion"], 3);
    assert_eq!(s.next().await.id.as_deref(), Some("3"));
    assert_eq!(s.next().await.id.as_deref(), Some("4"));
    t.shutdown().await;
}

#[tokio::test]
async fn bad_resume_points_are_refused_with_json_errors() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    deposit_ok(&t, &account, 100).await;
    // Not a number, or longer than the published pattern's 19 digits (else
    // 2^64-1 would be taken as a resume point).
    for id in ["abc", "18446744073709551615", "00000000000000000001"] {
        let r = common::read(
            t.client
                .get(t.url(&events_path(&account)))
                .header("Last-Event-ID", id)
                .send()
                .await
                .unwrap(),
        )
        .await;
        common::assert_error(&r, 400, "BAD_LAST_EVENT_ID");
    }
    // One header, like every other one Tally reads: two are refused, not resolved.
    let r = common::read(
        t.client
            .get(t.url(&events_path(&account)))
            .header("Last-Event-ID", "0")
            .header("Last-Event-ID", "1")
            .send()
            .await
            .unwrap(),
    )
    .await;
    common::assert_error(&r, 400, "BAD_LAST_EVENT_ID");
    // The header wins over fromVersion, but the query is still checked.
    for query in ["bogus=1", "fromVersion=1&fromVersion=2", "fromVersion=-1"] {
        let r = common::read(
            t.client
                .get(t.url(&format!("{}?{query}", events_path(&account))))
                .header("Last-Event-ID", "0")
                .send()
                .await
                .unwrap(),
        )
        .await;
        common::assert_error(&r, 400, "BAD_QUERY");
    }
    for (query, code) in [
        ("fromVersion=x", "BAD_QUERY"),
        ("from=1", "BAD_QUERY"),
        ("fromVersion=9", "RESUME_BEYOND_TIP"),
    ] {
        let r = t.get(&format!("{}?{query}", events_path(&account))).await;
        common::assert_error(&r, 400, code);
    }
    // On the embedded store, an account with no version at all is below any resume point
    // past 1, and no retry could change that: a final 400, as for a written account.
    let r = t
        .get(&format!(
            "{}?fromVersion=11648",
            events_path(&new_account())
        ))
        .await;
    common::assert_error(&r, 400, "RESUME_BEYOND_TIP");
    assert!(
        r.body["message"].as_str().unwrap().contains("version 0"),
        "{}",
        r.text
    );
    // The version after the tip is where a caught-up client resumes: accepted.
    let mut s = Stream::open(
        &t,
        &format!("{}?fromVersion=2", events_path(&account)),
        None,
    )
    .await;
    deposit_ok(&t, &account, 100).await;
    assert_eq!(s.next().await.id.as_deref(), Some("2"));
    assert_eq!(
        t.app.watch.subscribers(),
        1,
        "refused streams hold no place"
    );
    t.shutdown().await;
}

/// Rule: a resume point further back than `--watch-max-replay` versions is refused before
/// the stream starts (400 `RESUME_TOO_FAR_BACK`, naming the history API), never replayed
/// from the store however long the account; one within it replays its range, read once.
#[tokio::test]
async fn a_resume_further_back_than_the_replay_limit_is_refused_before_the_stream_starts() {
    let memory = Arc::new(MemoryLog::new());
    let windowed = Arc::new(WindowedLog::new(memory, CELERIANT_WINDOW));
    let store: SharedLog = windowed.clone();
    let t = spawn(test_config(&["--watch-max-replay", "4"]), Some(store), None).await;
    let account = new_account();
    for _ in 0..6 {
        deposit_ok(&t, &account, 10).await;
    }
    // From version 2 to 6 is five versions: one too many, by either way of resuming.
    let r = t
        .get(&format!("{}?fromVersion=2", events_path(&account)))
        .await;
    common::assert_error(&r, 400, "RESUME_TOO_FAR_BACK");
    assert!(r.text.contains("/history"), "{}", r.text);
    let r = common::read(
        t.client
            .get(t.url(&events_path(&account)))
            .header("Last-Event-ID", "1")
            .send()
            .await
            .unwrap(),
    )
    .await;
    common::assert_error(&r, 400, "RESUME_TOO_FAR_BACK");
    assert_eq!(
        t.app.watch.subscribers(),
        0,
        "refused streams hold no place"
    );

    // A live stream first, so the account's channel has started and reads nothing more.
    let mut live = Stream::open(&t, &events_path(&account), None).await;
    assert_eq!(live.next().await.name(), "snapshot");
    windowed.reset();
    let mut s = Stream::open(
        &t,
        &format!("{}?fromVersion=3", events_path(&account)),
        None,
    )
    .await;
    for version in 3..=6u64 {
        let e = s.next().await;
        assert_eq!(e.id, Some(version.to_string()));
        assert_eq!(e.json()["balanceCents"], 10 * version);
    }
    // Twice over the range (what it adds to the balance, then the frames), never held
    // whole: one window each here.
    assert_eq!(
        windowed.reads(),
        2,
        "the replayed range is read twice, page by page"
    );
    t.shutdown().await;
}

#[tokio::test]
async fn the_per_account_and_per_replica_limits_refuse_with_a_retryable_503() {
    let t = spawn(
        test_config(&[
            "--watch-max-per-account",
            "2",
            "--watch-max-subscribers",
            "3",
        ]),
        None,
        None,
    )
    .await;
    let (a, b) = (new_account(), new_account());
    let _s1 = Stream::open(&t, &events_path(&a), None).await;
    let _s2 = Stream::open(&t, &events_path(&a), None).await;
    let r = t.get(&events_path(&a)).await;
    common::assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert!(r.header("retry-after").is_some());
    let _s3 = Stream::open(&t, &events_path(&b), None).await;
    let r = t.get("/api/watch/stream").await;
    common::assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_refused_total{limit="account"}"#),
        1.0
    );
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_refused_total{limit="replica"}"#),
        1.0
    );
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_subscribers{stream="account"}"#),
        3.0
    );
    t.shutdown().await;
}

#[tokio::test]
async fn the_subscriber_count_returns_to_zero_after_clients_disconnect() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    let streams = vec![
        Stream::open(&t, &events_path(&account), None).await,
        Stream::open(&t, &events_path(&account), None).await,
        Stream::open(&t, "/api/watch/stream", None).await,
    ];
    assert_eq!(t.app.watch.subscribers(), 3);
    assert_eq!(t.app.watch.watched_accounts(), 1);
    drop(streams);
    wait_for_no_subscribers(&t, "closed connections").await;
    assert_eq!(t.app.watch.watched_accounts(), 0);
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_subscribers{stream="account"}"#),
        0.0
    );
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_subscribers{stream="all"}"#),
        0.0
    );
    t.shutdown().await;
}

#[tokio::test]
async fn shutdown_ends_every_stream_with_a_final_event() {
    let t = spawn(test_config(&["--shutdown-grace-secs", "30"]), None, None).await;
    let account = new_account();
    let mut s = Stream::open(&t, &events_path(&account), None).await;
    let mut all = Stream::open(&t, "/api/watch/stream", None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(t.shutdown());
    assert_eq!(s.next().await.name(), "shutdown");
    assert!(
        s.next_any().await.is_none(),
        "the stream ends after its final event"
    );
    assert_eq!(all.next().await.name(), "shutdown");
    assert!(all.next_any().await.is_none());
    stopping.await.unwrap();
    // Well inside the 30 s grace: the streams ended, they were not cut off.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn the_fleet_wide_stream_has_the_replaced_services_shape_for_every_account() {
    let t = spawn(test_config(&[]), None, None).await;
    let mut s = Stream::open(&t, "/api/watch/stream", None).await;
    let (a, b) = (new_account(), new_account());
    deposit_ok(&t, &a, 100).await;
    deposit_ok(&t, &b, 100).await;
    deposit_ok(&t, &a, 100).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let e = s.next().await;
        assert_eq!(
            e.name(),
            "message",
            "unnamed, as the replaced service sends"
        );
        let data = e.json();
        assert_eq!(data.as_object().unwrap().len(), 3, "{data}");
        assert_eq!(data["operation"], "Write");
        got.push((
            data["aggregateId"].as_str().unwrap().to_string(),
            data["toAggregateVersion"].as_u64().unwrap(),
        ));
    }
    assert_eq!(got, vec![(a.clone(), 1), (b.clone(), 1), (a.clone(), 2)]);
    t.shutdown().await;
}

#[tokio::test]
async fn an_idle_stream_gets_keep_alive_comments() {
    let t = spawn(test_config(&["--watch-keepalive-secs", "1"]), None, None).await;
    let mut s = Stream::open(&t, &events_path(&new_account()), None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    let e = s.next_any().await.unwrap();
    assert!(e.comment && e.data == "keep-alive", "{e:?}");
    t.shutdown().await;
}

#[tokio::test]
async fn a_subscriber_that_falls_behind_its_buffer_gets_a_final_lagged_event() {
    // Not read while the writes land: its buffer (2) and the hand-off (a few) overflow.
    let (t, mut sub) = unread_stream_over_deposits(&["--watch-buffer", "2"], 40).await;
    let mut versions = Vec::new();
    let end = loop {
        match tokio::time::timeout(EVENT_BOUND, sub.items.recv())
            .await
            .unwrap()
        {
            Some(Item::Snapshot { version, .. }) => assert_eq!(version, 0),
            Some(Item::Events(f)) => versions.push(f.version),
            Some(Item::End(reason)) => break reason,
            Some(other) => panic!("unexpected {other:?}"),
            None => panic!("ended without a final event"),
        }
    };
    assert!(
        sub.items.recv().await.is_none(),
        "closed after the final event"
    );
    // What it got is a gap-free prefix, and the final event says where it stopped.
    let n = versions.len() as u64;
    assert!(n > 0 && n < 40, "{versions:?}");
    assert_eq!(versions, (1..=n).collect::<Vec<_>>());
    assert_eq!(
        end,
        EndReason::Lagged {
            last_version: Some(n)
        }
    );
    drop(sub);
    wait_for_no_subscribers(&t, "a dropped lagged stream").await;
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_dropped_total{reason="lagged"}"#),
        1.0
    );
    t.shutdown().await;
}

/// Rule: a stream whose client takes nothing for two keep-alive intervals (it stopped
/// reading, its connection's buffers full) ends and releases its place, counted as
/// `stalled`: a client that keeps a connection open and reads nothing cannot hold a place
/// for ever.
#[tokio::test]
async fn a_client_that_stops_reading_releases_its_place() {
    // Never read: the snapshot and the first events fill the hand-off to the body.
    let (t, mut sub) = unread_stream_over_deposits(&["--watch-keepalive-secs", "1"], 20).await;
    assert_eq!(t.app.watch.subscribers(), 1);
    wait_for_no_subscribers(&t, "a stream nobody reads").await;
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(&metrics, r#"tally_watch_dropped_total{reason="stalled"}"#),
        1.0
    );
    // What was handed over is a gap-free prefix, then the end: nothing after the stall.
    let mut versions = Vec::new();
    while let Some(item) = sub.items.recv().await {
        match item {
            Item::Snapshot { version, .. } => assert_eq!(version, 0),
            Item::Events(f) => versions.push(f.version),
            Item::KeepAlive => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let n = versions.len() as u64;
    assert!(n > 0 && n < 20, "{versions:?}");
    assert_eq!(versions, (1..=n).collect::<Vec<_>>());
    t.shutdown().await;
}

#[tokio::test]
async fn a_feed_that_falls_behind_resyncs_account_streams_and_ends_fleet_wide_ones() {
    // Room for one notification: a burst of writes overflows the feed.
    let store = Arc::new(MemoryLog::new().with_watch_capacity(1));
    let t = spawn(test_config(&[]), Some(store.clone() as SharedLog), None).await;
    let account = new_account();
    let mut s = Stream::open(&t, &events_path(&account), None).await;
    let mut all = Stream::open(&t, "/api/watch/stream", None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    let key = t.app.identity.key(AccountId(account.parse().unwrap()));
    let amount = 10;
    // Synchronous writes: the feed's reader cannot run in between.
    for seq in 1..=20u64 {
        let w = one_deposit(key, seq, None, amount);
        store.write_now(t.app.identity.client(), vec![w]).unwrap();
    }
    // The account stream re-read the store: every version, once, in order.
    for v in 1..=20u64 {
        let e = s.next().await;
        assert_eq!(e.id, Some(v.to_string()));
        assert_eq!(e.json()["balanceCents"], 10 * v as i64);
    }
    // The fleet-wide stream cannot re-read every account: it says so and ends.
    let mut last = all.next().await;
    while last.name() == "message" {
        last = all.next().await;
    }
    assert_eq!(last.name(), "gap");
    assert!(all.next_any().await.is_none());
    let metrics = t.get("/metrics").await.text;
    assert!(metric_sample(&metrics, "tally_watch_feed_gaps_total") >= 1.0);
    t.shutdown().await;
}

#[tokio::test]
async fn a_device_run_streams_as_one_version_written_by_the_device() {
    let t = spawn(test_config(&[]), None, None).await;
    let account = new_account();
    let mut s = Stream::open(&t, &events_path(&account), None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    let device = uuid::Uuid::new_v4();
    let run = serde_json::json!({"accountId": account, "events": [
        {"clientSeq": 1, "type": "deposit", "amountCents": 500},
        {"clientSeq": 2, "type": "withdraw", "amountCents": 200},
    ]});
    let r = t
        .post(&format!("/api/devices/{device}/sync"), &run, None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    // One batch, two events: only the last carries the version as its id, so a client
    // that resumes never splits a version.
    let (first, second) = (s.next().await, s.next().await);
    assert_eq!((first.name(), first.id.as_deref()), ("Deposited", None));
    assert_eq!(
        (second.name(), second.id.as_deref()),
        ("Withdrawn", Some("1"))
    );
    for (e, balance) in [(&first, 500), (&second, 300)] {
        let data = e.json();
        assert_eq!(data["aggregateVersion"], 1);
        assert_eq!(data["writer"], "client");
        assert_eq!(data["writerId"], device.to_string());
        assert_eq!(data["balanceCents"], balance);
    }
    // Resuming from before it replays the whole version.
    let mut again = Stream::open(&t, &events_path(&account), Some("0")).await;
    assert_eq!(again.next().await.name(), "Deposited");
    assert_eq!(again.next().await.id.as_deref(), Some("1"));
    t.shutdown().await;
}

/// Resumes that race live writes: each subscriber joins at a random moment from a random
/// version (or live) while a writer appends, and must see every version from its start, once,
/// in order, each with the balance after it. Seeded; the seed is printed on failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_racing_live_writes_never_skip_or_repeat_a_version() {
    use rand::{Rng, SeedableRng};
    const WRITES: u64 = 300;
    const SUBSCRIBERS: usize = 16;
    let seed: u64 = std::env::var("TALLY_WATCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let store = Arc::new(MemoryLog::new());
    let t = spawn(
        test_config(&["--watch-buffer", "1000"]),
        Some(store.clone() as SharedLog),
        None,
    )
    .await;
    let account = AccountId(uuid::Uuid::new_v4());
    let key = t.app.identity.key(account);
    let client = t.app.identity.client();
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            let amount = 1;
            for seq in 1..=WRITES {
                let w = one_deposit(key, seq, None, amount);
                store.write_now(client, vec![w]).unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut readers = Vec::new();
    for _ in 0..SUBSCRIBERS {
        for _ in 0..rng.gen_range(0..20) {
            tokio::task::yield_now().await;
        }
        let tip = store.details_now(key).map_or(0, |d| d.max_version);
        let resume = if rng.gen_bool(0.25) {
            Resume::Live
        } else {
            // Past the last write there would be nothing to wait for.
            Resume::From(rng.gen_range(1..=(tip + 1).min(WRITES)))
        };
        let mut sub = t
            .app
            .watch
            .subscribe_account(None, account, resume)
            .await
            .unwrap();
        readers.push(tokio::spawn(async move {
            let mut next = None;
            loop {
                let item = tokio::time::timeout(EVENT_BOUND, sub.items.recv())
                    .await
                    .unwrap_or_else(|_| panic!("seed {seed}: {resume:?} stalled at {next:?}"));
                match item {
                    Some(Item::Snapshot {
                        version,
                        balance_cents,
                        ..
                    }) => {
                        assert_eq!(balance_cents, Some(version as i64), "seed {seed}");
                        next = Some(version + 1);
                        if version == WRITES {
                            return;
                        }
                    }
                    Some(Item::Events(f)) => {
                        let expected = next.unwrap_or_else(|| match resume {
                            Resume::From(v) => v,
                            Resume::Live => {
                                panic!("seed {seed}: a live stream starts with a snapshot")
                            }
                        });
                        assert_eq!(f.version, expected, "seed {seed}: {resume:?}");
                        assert_eq!(
                            f.entries[0].balance_cents,
                            Some(f.version as i64),
                            "seed {seed}"
                        );
                        next = Some(f.version + 1);
                        if f.version == WRITES {
                            return;
                        }
                    }
                    other => panic!("seed {seed}: {resume:?} got {other:?}"),
                }
            }
        }));
    }
    writer.await.unwrap();
    for r in readers {
        r.await.unwrap();
    }
    t.shutdown().await;
}

/// The next frame of events on `sub`, past keep-alives.
async fn next_events(sub: &mut Subscription) -> Arc<tally::watch::AccountFrame> {
    loop {
        match sub.items.recv().await {
            Some(Item::Events(f)) => return f,
            Some(Item::KeepAlive) => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A replica over `store`, started, and a live stream on a new account, past its snapshot.
async fn watching_a_new_account(
    store: SharedLog,
) -> (Arc<tally::app::App>, AccountId, Subscription) {
    let app = tally::app::App::builder(test_config(&[]))
        .store(store)
        .build()
        .await
        .unwrap();
    app.started().await;
    let id = AccountId(new_account().parse().unwrap());
    let mut sub = app
        .watch
        .subscribe_account(None, id, Resume::Live)
        .await
        .unwrap();
    assert!(matches!(
        sub.items.recv().await,
        Some(Item::Snapshot { version: 0, .. })
    ));
    (app, id, sub)
}

/// A store whose watch opens but never reports anything: a feed gone silent without an
/// error (a half-open connection). Its reads fail while `failing` is set.
struct SilentWatch(Arc<MemoryLog>, Arc<std::sync::atomic::AtomicBool>);

struct SilentFeed;

#[async_trait::async_trait]
impl tally::store::WatchFeed for SilentFeed {
    async fn next(&mut self) -> tally::store::StoreResult<tally::store::WatchItem> {
        std::future::pending().await
    }
}

#[async_trait::async_trait]
impl tally::store::EventLog for SilentWatch {
    async fn write(
        &self,
        client_id: tally::store::ClientId,
        writes: Vec<AggregateWrite>,
    ) -> tally::store::StoreResult<Vec<u64>> {
        self.0.write_now(client_id, writes)
    }
    async fn read(
        &self,
        key: tally::store::AggregateKey,
        filter: &tally::store::ReadFilter,
    ) -> tally::store::StoreResult<tally::store::ReadPage> {
        if self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tally::store::StoreError::shed("scripted outage"));
        }
        self.0.read_now(key, filter)
    }
    async fn details(
        &self,
        key: tally::store::AggregateKey,
    ) -> tally::store::StoreResult<tally::store::AggregateDetails> {
        self.0.details_now(key)
    }
    async fn trim_start(
        &self,
        key: tally::store::AggregateKey,
        keep_from_version: u64,
    ) -> tally::store::StoreResult<()> {
        self.0.trim_start_now(key, keep_from_version)
    }
    async fn watch(
        &self,
        _filter: tally::store::WatchFilter,
    ) -> tally::store::StoreResult<Box<dyn tally::store::WatchFeed>> {
        Ok(Box::new(SilentFeed))
    }
}

#[tokio::test(start_paused = true)]
async fn a_feed_gone_silent_still_delivers_through_the_periodic_resync() {
    let mem = Arc::new(MemoryLog::new());
    let (app, id, mut sub) =
        watching_a_new_account(Arc::new(SilentWatch(mem.clone(), Default::default())) as SharedLog)
            .await;
    let amount = 7;
    let w = one_deposit(app.identity.key(id), 1, None, amount);
    mem.write_now(app.identity.client(), vec![w]).unwrap();
    // No notification ever comes; the paused clock runs ahead to the resync (keep-alives
    // on the way).
    let started = tokio::time::Instant::now();
    let frame = loop {
        match sub.items.recv().await {
            Some(Item::KeepAlive) => {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "nothing delivered"
                );
            }
            Some(Item::Events(f)) => break f,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(
        (frame.version, frame.entries[0].balance_cents),
        (1, Some(7))
    );
    assert!(
        started.elapsed() <= Duration::from_secs(31),
        "{:?}",
        started.elapsed()
    );
    app.watch.shutdown();
}

/// Rule: a stream lasts as long as the bearer token it was opened with: when the token stops
/// being accepted (its `exp` plus the leeway) the stream ends with a final `expired` event,
/// having delivered everything before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_with_an_expired_event_when_its_token_expires() {
    let secret = common::test_auth::secret_file();
    let mut flags = common::test_auth::flags(&secret);
    flags.extend(["--auth-leeway-secs", "0"]);
    let t = spawn_fleet(1, Arc::new(MemoryLog::new()), &flags)
        .await
        .pop()
        .expect("a replica");
    let account = new_account();
    let writer = common::test_auth::token(serde_json::json!({}));
    let deposit = || {
        t.client
            .post(t.url(&format!("/api/accounts/{account}/deposit")))
            .bearer_auth(&writer)
            .json(&serde_json::json!({ "amountCents": 7 }))
            .send()
    };
    assert_eq!(deposit().await.unwrap().status(), StatusCode::OK);
    let now = jsonwebtoken::get_current_timestamp();
    let short = common::test_auth::token(serde_json::json!({ "exp": now + 2 }));
    let mut resp = t
        .client
        .get(t.url(&events_path(&account)))
        .bearer_auth(&short)
        .send()
        .await
        .expect("stream opened");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(deposit().await.unwrap().status(), StatusCode::OK);
    let mut text = String::new();
    let ended = tokio::time::timeout(EVENT_BOUND, async {
        while let Some(chunk) = resp.chunk().await.expect("readable") {
            text.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    })
    .await;
    assert!(ended.is_ok(), "the stream never ended: {text}");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        names,
        ["snapshot", "Deposited", "expired"],
        "the live deposit, then the end: {text}"
    );
    assert!(
        jsonwebtoken::get_current_timestamp() >= now + 2,
        "not before the token expired"
    );
    t.shutdown().await;
}

/// Rule: an account whose live reads keep failing (the replica cannot see it at all) ends
/// its streams with `event: error` once they have failed for `READ_FAILURE_LIMIT` (10 s),
/// rather than sending keep-alives that look like an idle account for as long as the outage
/// lasts. Its clients resume with `Last-Event-ID`.
#[tokio::test(start_paused = true)]
async fn an_account_whose_reads_keep_failing_ends_its_streams_with_a_store_error() {
    let mem = Arc::new(MemoryLog::new());
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (app, _, mut sub) =
        watching_a_new_account(Arc::new(SilentWatch(mem.clone(), failing.clone())) as SharedLog)
            .await;
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    // Only the periodic resync reads (the feed is silent): its failure is retried every
    // second, and 10 s of them end the streams.
    let started = tokio::time::Instant::now();
    let end = loop {
        match sub.items.recv().await {
            Some(Item::KeepAlive) => {
                assert!(
                    started.elapsed() < Duration::from_secs(300),
                    "still open after {:?} of failed reads",
                    started.elapsed()
                );
            }
            Some(Item::End(reason)) => break reason,
            other => panic!("unexpected {other:?}"),
        }
    };
    match end {
        EndReason::StoreError(message) => assert!(message.contains("Last-Event-ID"), "{message}"),
        other => panic!("ended as {other:?}"),
    }
    assert!(
        started.elapsed() <= Duration::from_secs(42),
        "ended {:?} after the outage began: the resync's failure at 30 s, then 10 s of retries",
        started.elapsed()
    );
    app.watch.shutdown();
}

/// Rule: a read that failed is tried again a second later, not at the next notification or
/// resync: what a store blip held back arrives soon after the store recovers.
#[tokio::test(start_paused = true)]
async fn what_a_failed_read_missed_arrives_a_second_after_the_store_recovers() {
    let mem = Arc::new(MemoryLog::new());
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (app, id, mut sub) =
        watching_a_new_account(Arc::new(SilentWatch(mem.clone(), failing.clone())) as SharedLog)
            .await;
    let started = tokio::time::Instant::now();
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    mem.write_now(
        app.identity.client(),
        vec![one_deposit(app.identity.key(id), 1, None, 3)],
    )
    .unwrap();
    // The resync's read at 30 s fails; the store is back half a second later.
    tokio::time::sleep(Duration::from_millis(30_500)).await;
    failing.store(false, std::sync::atomic::Ordering::SeqCst);
    let frame = next_events(&mut sub).await;
    assert_eq!(
        (frame.version, frame.entries[0].balance_cents),
        (1, Some(3))
    );
    assert!(
        started.elapsed() < Duration::from_secs(32),
        "delivered {:?} after the write: the next resync, not a retry",
        started.elapsed()
    );
    app.watch.shutdown();
}

/// A store whose reads of one account, once blocked, wait until released (an account whose
/// reads lag without end), whose reads leave out one version, once named (a store that
/// shows a hole), and whose next `n` reads, once `lags` is `(from, n)`, show nothing from
/// version `from` on (a lagging replica).
struct BlockedReads {
    mem: Arc<MemoryLog>,
    blocked: parking_lot::Mutex<Option<u128>>,
    release: tokio::sync::Notify,
    hides_version: parking_lot::Mutex<Option<u64>>,
    lags: parking_lot::Mutex<Option<(u64, usize)>>,
    /// Whether its watch, once opened, stays silent (as [`SilentWatch`]'s).
    silent_feed: std::sync::atomic::AtomicBool,
}

impl BlockedReads {
    fn new() -> Arc<Self> {
        Arc::new(BlockedReads {
            mem: Arc::new(MemoryLog::new()),
            blocked: parking_lot::Mutex::new(None),
            release: tokio::sync::Notify::new(),
            hides_version: parking_lot::Mutex::new(None),
            lags: parking_lot::Mutex::new(None),
            silent_feed: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

#[async_trait::async_trait]
impl tally::store::EventLog for BlockedReads {
    async fn write(
        &self,
        client_id: tally::store::ClientId,
        writes: Vec<AggregateWrite>,
    ) -> tally::store::StoreResult<Vec<u64>> {
        self.mem.write_now(client_id, writes)
    }
    async fn read(
        &self,
        key: tally::store::AggregateKey,
        filter: &tally::store::ReadFilter,
    ) -> tally::store::StoreResult<tally::store::ReadPage> {
        if *self.blocked.lock() == Some(key.aggregate_id) {
            self.release.notified().await;
        }
        let mut page = self.mem.read_now(key, filter)?;
        if let Some(hidden) = *self.hides_version.lock() {
            page.batches.retain(|b| b.version != hidden);
        }
        if let Some((from, reads)) = self.lags.lock().as_mut()
            && *reads > 0
        {
            *reads -= 1;
            let from = *from;
            page.batches.retain(|b| b.version < from);
        }
        Ok(page)
    }
    async fn details(
        &self,
        key: tally::store::AggregateKey,
    ) -> tally::store::StoreResult<tally::store::AggregateDetails> {
        self.mem.details_now(key)
    }
    async fn trim_start(
        &self,
        key: tally::store::AggregateKey,
        keep_from_version: u64,
    ) -> tally::store::StoreResult<()> {
        self.mem.trim_start_now(key, keep_from_version)
    }
    async fn watch(
        &self,
        filter: tally::store::WatchFilter,
    ) -> tally::store::StoreResult<Box<dyn tally::store::WatchFeed>> {
        if self.silent_feed.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Box::new(SilentFeed));
        }
        tally::store::EventLog::watch(self.mem.as_ref(), filter).await
    }
}

/// Rule: the feed hands a commit over without waiting on its account's read, so an account
/// whose reads hang holds up no other account's stream (reading each
/// notified account in turn, one lagging account would stall them all while the feed's
/// buffer grew).
#[tokio::test]
async fn an_account_whose_reads_hang_holds_up_no_other_accounts_stream() {
    let store = BlockedReads::new();
    let app = tally::app::App::builder(test_config(&[]))
        .store(store.clone() as SharedLog)
        .build()
        .await
        .unwrap();
    app.started().await;
    let (slow, other) = (
        AccountId(new_account().parse().unwrap()),
        AccountId(new_account().parse().unwrap()),
    );
    let mut slow_sub = app
        .watch
        .subscribe_account(None, slow, Resume::Live)
        .await
        .unwrap();
    let mut other_sub = app
        .watch
        .subscribe_account(None, other, Resume::Live)
        .await
        .unwrap();
    for sub in [&mut slow_sub, &mut other_sub] {
        assert!(matches!(
            sub.items.recv().await,
            Some(Item::Snapshot { version: 0, .. })
        ));
    }
    *store.blocked.lock() = Some(slow.0.as_u128());
    let client = app.identity.client();
    store
        .mem
        .write_now(
            client,
            vec![one_deposit(app.identity.key(slow), 1, None, 5)],
        )
        .unwrap();
    store
        .mem
        .write_now(
            client,
            vec![one_deposit(app.identity.key(other), 2, None, 7)],
        )
        .unwrap();
    // Well inside the 30 s resync, which would otherwise deliver it.
    let frame = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match other_sub.items.recv().await {
                Some(Item::Events(f)) => break f,
                Some(Item::KeepAlive) => continue,
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("the other account's event, while the slow one's read hangs");
    assert_eq!(
        (frame.version, frame.entries[0].balance_cents),
        (1, Some(7))
    );
    // Released, the slow account's stream gets its event too.
    *store.blocked.lock() = None;
    store.release.notify_waiters();
    let frame = next_events(&mut slow_sub).await;
    assert_eq!(
        (frame.version, frame.entries[0].balance_cents),
        (1, Some(5))
    );
    app.watch.shutdown();
}

/// Rule: a read that shows a version missing delivers nothing past the hole (every balance
/// after it would be off), and a hole that never fills counts as reads failing: 10 s of it
/// end the account's streams with a store error, never a stream gone quiet for good; also
/// when only a resync's read to the tip finds it (a silent feed otherwise: the retry
/// after the hole would read nothing and count nothing).
#[tokio::test(start_paused = true)]
async fn a_hole_in_an_accounts_reads_is_never_skipped_and_ends_its_streams_if_it_stays() {
    for silent_feed in [false, true] {
        a_hole_that_stays(silent_feed).await;
    }
}

async fn a_hole_that_stays(silent_feed: bool) {
    let store = BlockedReads::new();
    store
        .silent_feed
        .store(silent_feed, std::sync::atomic::Ordering::SeqCst);
    let (app, id, mut sub) = watching_a_new_account(store.clone() as SharedLog).await;
    *store.hides_version.lock() = Some(2);
    let client = app.identity.client();
    for seq in 1..=3 {
        store
            .mem
            .write_now(
                client,
                vec![one_deposit(app.identity.key(id), seq, None, 1)],
            )
            .unwrap();
    }
    let started = tokio::time::Instant::now();
    let mut delivered = Vec::new();
    let end = loop {
        match sub.items.recv().await {
            Some(Item::Events(f)) => delivered.push(f.version),
            Some(Item::KeepAlive) => assert!(
                started.elapsed() < Duration::from_secs(300),
                "still open after {:?} of a hole",
                started.elapsed()
            ),
            Some(Item::End(reason)) => break reason,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(delivered, vec![1], "nothing past the missing version 2");
    assert!(matches!(end, EndReason::StoreError(_)), "{end:?}");
    // Retried every second: 10 s of the hole after it was first seen (at once, or at the
    // resync 30 s in when the feed is silent).
    assert!(
        started.elapsed() <= Duration::from_secs(42),
        "silent feed: {silent_feed}; ended after {:?}",
        started.elapsed()
    );
    assert!(app.metrics.watch_read_failures.get() >= 10);
    app.watch.shutdown();
}

/// Rule: a notified version that a lagging read does not show yet is read again at once (a
/// few times, 20 ms apart), also when a resync was asked for while the account's reader
/// was busy and the two are read together (merged into the resync's one
/// read to the tip, it would otherwise wait 30 s for the next resync).
#[tokio::test(start_paused = true)]
async fn a_notified_version_a_lagging_read_misses_is_read_again_even_merged_with_a_resync() {
    for with_resync in [false, true] {
        let store = BlockedReads::new();
        let (app, id, mut sub) = watching_a_new_account(store.clone() as SharedLog).await;
        let key = app.identity.key(id);
        // The reader is held on its read of version 1 while version 2 is notified (and,
        // the second time, while the 30 s resync asks for the tip).
        *store.blocked.lock() = Some(id.0.as_u128());
        let client = app.identity.client();
        store
            .mem
            .write_now(client, vec![one_deposit(key, 1, None, 1)])
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        store
            .mem
            .write_now(client, vec![one_deposit(key, 2, None, 1)])
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        if with_resync {
            tokio::time::sleep(Duration::from_secs(31)).await;
        }
        // Released, the next two reads lag behind version 2.
        *store.blocked.lock() = None;
        *store.lags.lock() = Some((2, 2));
        store.release.notify_waiters();
        let released = tokio::time::Instant::now();
        loop {
            match sub.items.recv().await {
                Some(Item::Events(f)) if f.version == 2 => break,
                Some(Item::Events(_) | Item::KeepAlive) => continue,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(
            released.elapsed() < Duration::from_secs(1),
            "resync asked too: {with_resync}; version 2 after {:?}",
            released.elapsed()
        );
        app.watch.shutdown();
    }
}

/// Rule: where the store cannot prove an account has no version (a store Tally did not open
/// as its own embedded one; a Celeriant server can hide a create, docs/stores.md), a resume
/// past 1 on an account it shows nothing of stays retryable: 503 with `Retry-After`, never
/// a final 400 for a version a client may have seen.
#[tokio::test]
async fn a_resume_on_an_account_an_unproven_store_shows_nothing_of_stays_retryable() {
    let store: SharedLog = Arc::new(MemoryLog::new());
    let t = spawn(test_config(&[]), Some(store), None).await;
    let r = t
        .get(&format!("{}?fromVersion=5", events_path(&new_account())))
        .await;
    common::assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    t.shutdown().await;
}
