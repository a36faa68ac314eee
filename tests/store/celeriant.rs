//! The Celeriant backend on the wire.
//!
//! `lost_reply`: against a loopback listener that takes a request and never answers, so it
//! always runs. `live`: against a real server named by `CELERIANT_ADDRESS` (skipped when
//! unset); its keys are fresh uuids, so it can run again and again on one server.
//! `cross_shard`: needs a server with at least two shards routed by aggregate id, named by
//! `CELERIANT_SHARDED_ADDRESS`. `api_key`: needs a server with API keys enabled and
//! `--require-client-identity` (without it the server lets a client that never identifies
//! through with full access), named by `CELERIANT_AUTH_ADDRESS`, with a read-write key in
//! `CELERIANT_AUTH_RW_KEY` and a read-only one in `CELERIANT_AUTH_RO_KEY`.
//! `scripts/with-celeriant.sh` (so `make test`) starts all three; a test whose server is not
//! named skips outside CI and fails under `CI=true`.

use crate::common::required;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use tally::store::celeriant::{CeleriantConfig, CeleriantLog, READ_MAX_ATTEMPTS};
use tally::store::{
    AggregateKey, AggregateWrite, Event, EventLog, EventType, ReadFilter, StoreError,
};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

fn event(seq: u64) -> Event {
    Event {
        client_seq: seq,
        event_id: Some(u128::from(seq)),
        event_type: EventType { major: 1, minor: 0 },
        payload: Bytes::from(format!("event-{seq}")),
        timestamp_ms: 1_700_000_000_000 + seq,
    }
}

fn write(key: AggregateKey, seqs: &[u64], expected: Option<u64>, enforce: bool) -> AggregateWrite {
    AggregateWrite {
        key,
        events: seqs.iter().copied().map(event).collect(),
        expected_version: expected,
        allow_create: true,
        enforce_client_idempotency: enforce,
    }
}

fn fresh_key() -> AggregateKey {
    AggregateKey {
        org_id: uuid::Uuid::new_v4().as_u128(),
        aggregate_type_id: uuid::Uuid::new_v4().as_u128(),
        aggregate_id: uuid::Uuid::new_v4().as_u128(),
    }
}

fn log_at(address: String) -> CeleriantLog {
    let cfg = CeleriantConfig {
        address,
        ..CeleriantConfig::default()
    };
    CeleriantLog::connect(&cfg).expect("valid config")
}

mod lost_reply {
    use super::*;

    /// A node that reads each request and hangs up without a reply. Counts connections.
    async fn hang_up_server() -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    // Take the whole request (a header at least), then close: the client has
                    // sent it and never hears back.
                    let mut buf = [0u8; 4096];
                    let _ = socket.read(&mut buf).await;
                });
            }
        });
        (address, accepted)
    }

    #[tokio::test]
    async fn a_write_whose_reply_is_lost_is_outcome_unknown_and_never_resent() {
        let (address, accepted) = hang_up_server().await;
        let log = log_at(address);
        let got = log
            .write(7, vec![write(fresh_key(), &[1], Some(0), true)])
            .await;
        match got {
            Err(e @ StoreError::OutcomeUnknown { .. }) => assert!(e.may_have_applied()),
            other => panic!("expected OutcomeUnknown, got {other:?}"),
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the write went out once"
        );
    }

    #[tokio::test]
    async fn a_trim_whose_reply_is_lost_is_outcome_unknown() {
        let (address, _) = hang_up_server().await;
        let got = log_at(address).trim_start(fresh_key(), 2).await;
        assert!(
            matches!(got, Err(StoreError::OutcomeUnknown { .. })),
            "{got:?}"
        );
    }

    #[tokio::test]
    async fn a_read_whose_reply_is_lost_is_retried_then_not_applied() {
        let (address, accepted) = hang_up_server().await;
        let log = log_at(address);
        let got = log.read(fresh_key(), &ReadFilter::default()).await;
        assert!(matches!(got, Err(StoreError::NotApplied { .. })), "{got:?}");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            READ_MAX_ATTEMPTS as usize,
            "one connection per attempt"
        );
    }

    #[tokio::test]
    async fn ping_over_a_silent_node_fails_as_not_applied() {
        let (address, _) = hang_up_server().await;
        let got = log_at(address).ping().await;
        assert!(matches!(got, Err(StoreError::NotApplied { .. })), "{got:?}");
    }
}

/// A live server's address (or key), or `None` when the tests should skip: outside CI only.
fn live_address(var: &str) -> Option<String> {
    required::var(
        var,
        "run through scripts/with-celeriant.sh (make test does), which starts every server these tests name",
    )
}

mod live {
    use super::*;

    fn live() -> Option<CeleriantLog> {
        live_address("CELERIANT_ADDRESS").map(log_at)
    }

    #[tokio::test]
    async fn ping_answers() {
        let Some(log) = live() else { return };
        assert_eq!(log.ping().await, Ok(()));
    }

    #[tokio::test]
    async fn write_read_details_trim_round_trip() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 11);
        assert_eq!(
            log.write(c, vec![write(key, &[1, 2], Some(0), true)]).await,
            Ok(vec![1])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[3], Some(1), true)]).await,
            Ok(vec![2])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[4], None, true)]).await,
            Ok(vec![3])
        );

        let page = log.read(key, &ReadFilter::default()).await.expect("read");
        assert_eq!(page.next_version, None);
        let versions: Vec<u64> = page.batches.iter().map(|b| b.version).collect();
        assert_eq!(versions, vec![1, 2, 3]);
        assert_eq!(page.batches[0].client_id, c);
        assert_eq!(&*page.batches[0].events, &[event(1), event(2)][..]);

        let d = log.details(key).await.expect("details");
        assert_eq!((d.min_available_version, d.max_version), (1, 3));
        assert_eq!(
            d.last_server_timestamp_ms,
            page.batches[2].server_timestamp_ms
        );

        log.trim_start(key, 2).await.expect("trim");
        let d = log.details(key).await.expect("details");
        assert_eq!((d.min_available_version, d.max_version), (2, 3));
        let page = log
            .read(key, &ReadFilter::from_version(2))
            .await
            .expect("read");
        assert_eq!(page.batches.len(), 2);
    }

    #[tokio::test]
    async fn each_server_error_maps_to_its_port_class() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 12);
        log.write(c, vec![write(key, &[5], Some(0), true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[6], Some(1), true)])
            .await
            .expect("v2");
        // 2003
        assert_eq!(
            log.write(c, vec![write(key, &[7], Some(1), true)]).await,
            Err(StoreError::Conflict {
                expected: 1,
                current: 2
            })
        );
        // 2002
        assert_eq!(
            log.write(c, vec![write(key, &[6], Some(2), true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(6),
                attempted_seq: Some(6)
            })
        );
        // 1000
        log.trim_start(key, 2).await.expect("trim");
        assert_eq!(
            log.read(key, &ReadFilter::from_version(1))
                .await
                .map(|p| p.batches.len()),
            Err(StoreError::Trimmed { min_available: 2 })
        );
        // 1001, 7001, 2005, 3000
        let missing = fresh_key();
        assert_eq!(
            log.read(missing, &ReadFilter::default())
                .await
                .map(|p| p.batches.len()),
            Err(StoreError::AggregateNotFound)
        );
        assert_eq!(
            log.details(missing).await,
            Err(StoreError::AggregateNotFound)
        );
        let mut no_create = write(missing, &[1], None, true);
        no_create.allow_create = false;
        assert_eq!(
            log.write(c, vec![no_create]).await,
            Err(StoreError::AggregateNotFound)
        );
        assert_eq!(
            log.trim_start(missing, 1).await,
            Err(StoreError::AggregateNotFound)
        );
        // 3004: the server refuses to trim past the tip.
        let got = log.trim_start(key, 9).await;
        assert!(
            matches!(got, Err(StoreError::Other { code: 3004, .. })),
            "{got:?}"
        );
    }

    #[tokio::test]
    async fn min_server_timestamp_is_inclusive_on_the_server() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 13);
        log.write(c, vec![write(key, &[1], None, false)])
            .await
            .expect("v1");
        let ts = log
            .details(key)
            .await
            .expect("details")
            .last_server_timestamp_ms;
        let at = |ts| ReadFilter {
            min_server_timestamp_ms: Some(ts),
            ..ReadFilter::default()
        };
        let page = log.read(key, &at(ts)).await.expect("read");
        assert_eq!(
            page.batches.len(),
            1,
            "a batch at exactly the bound is kept"
        );
        let page = log.read(key, &at(ts + 1)).await.expect("read");
        assert!(
            page.batches.is_empty(),
            "a batch before the bound is dropped"
        );
    }

    #[tokio::test]
    async fn client_seq_filters_keep_whole_batches() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 14);
        log.write(c, vec![write(key, &[1, 2, 3], None, true)])
            .await
            .expect("v1");
        let filter = ReadFilter {
            min_client_seq: Some(3),
            max_client_seq: Some(3),
            ..ReadFilter::default()
        };
        let page = log.read(key, &filter).await.expect("read");
        assert_eq!(page.batches.len(), 1);
        assert_eq!(
            page.batches[0].events.len(),
            3,
            "no event is cut out of the batch"
        );
    }

    #[tokio::test]
    async fn multi_aggregate_writes_report_each_version_in_order() {
        let Some(log) = live() else { return };
        let org = uuid::Uuid::new_v4().as_u128();
        let ty = uuid::Uuid::new_v4().as_u128();
        let key = |_| AggregateKey {
            org_id: org,
            aggregate_type_id: ty,
            aggregate_id: uuid::Uuid::new_v4().as_u128(),
        };
        let (a, b, c) = (key(0), key(1), 15);
        log.write(c, vec![write(b, &[1], None, false)])
            .await
            .expect("b v1");
        let got = log
            .write(
                c,
                vec![write(b, &[2], None, false), write(a, &[1], None, false)],
            )
            .await;
        match got {
            Ok(v) => assert_eq!(v, vec![2, 1]),
            // A server routing by aggregate id may put a and b on two shards.
            Err(StoreError::CrossShard) => eprintln!("a and b are on different shards"),
            Err(e) => panic!("{e:?}"),
        }
    }

    /// Longer than one read window, with a client filter that leaves the first window short,
    /// so the next page can only be found from the aggregate's tip.
    #[tokio::test]
    async fn a_filtered_read_pages_past_a_sparse_window() {
        let Some(log) = live() else { return };
        let (key, c1, c2) = (fresh_key(), 16, 17);
        let n = tally::store::celeriant::READ_PAGE_MAX_VERSIONS + 20;
        for seq in 1..=n {
            let c = if seq == 1 || seq == n { c2 } else { c1 };
            log.write(c, vec![write(key, &[seq], None, false)])
                .await
                .expect("write");
        }
        let filter = ReadFilter {
            include_client_id: Some(c2),
            ..ReadFilter::default()
        };
        let mut stream = tally::store::BatchStream::new(&log, key, filter);
        let mut pages = Vec::new();
        while let Some(page) = stream.next_page().await.expect("read") {
            pages.push(page.iter().map(|b| b.version).collect::<Vec<_>>());
        }
        assert_eq!(pages.concat(), vec![1, n]);
        assert!(pages.len() >= 2, "{pages:?}");
    }

    /// Both keys on one shard: the same org and aggregate type (the live server routes by
    /// type), fresh aggregate ids.
    fn two_keys() -> (AggregateKey, AggregateKey) {
        let a = fresh_key();
        let b = AggregateKey {
            aggregate_id: uuid::Uuid::new_v4().as_u128(),
            ..a
        };
        (a, b)
    }

    /// Attempts per mixed-failure case. The server's own answer depends on hash order, so
    /// each case is repeated until both orders have certainly come up.
    const ORDER_ROUNDS: usize = 16;

    #[tokio::test]
    async fn mixed_multi_aggregate_rejections_come_back_in_port_order() {
        let Some(log) = live() else { return };
        let c = 19;
        for _ in 0..ORDER_ROUNDS {
            let (a, b) = two_keys();
            log.write(
                c,
                vec![write(a, &[5], None, true), write(b, &[1], None, true)],
            )
            .await
            .expect("seed");
            // a repeats its sequence (2002), b is stale (2003): the version guard wins.
            let got = log
                .write(
                    c,
                    vec![write(a, &[5], Some(1), true), write(b, &[2], Some(0), true)],
                )
                .await;
            assert_eq!(
                got,
                Err(StoreError::Conflict {
                    expected: 0,
                    current: 1
                })
            );
            // m must exist and does not (2005), b is stale: existence wins.
            let m = AggregateKey {
                aggregate_id: uuid::Uuid::new_v4().as_u128(),
                ..a
            };
            let mut missing = write(m, &[1], None, true);
            missing.allow_create = false;
            let got = log
                .write(c, vec![write(b, &[9], Some(0), true), missing])
                .await;
            assert_eq!(got, Err(StoreError::AggregateNotFound));
            assert_eq!(log.details(b).await.map(|d| d.max_version), Ok(1));
        }
    }

    #[tokio::test]
    async fn the_client_mark_survives_a_trim() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 20);
        log.write(c, vec![write(key, &[40], None, true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[41], None, true)])
            .await
            .expect("v2");
        log.trim_start(key, 2).await.expect("trim to the tip");
        assert_eq!(
            log.write(c, vec![write(key, &[41], Some(2), true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(41),
                attempted_seq: Some(41)
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[42], Some(2), true)]).await,
            Ok(vec![3])
        );
    }

    /// Where Celeriant differs from the port's memory store: the tip batch cannot be trimmed.
    #[tokio::test]
    async fn trimming_past_the_tip_is_refused_even_by_one() {
        let Some(log) = live() else { return };
        let (key, c) = (fresh_key(), 21);
        log.write(c, vec![write(key, &[1], None, true)])
            .await
            .expect("v1");
        let got = log.trim_start(key, 2).await;
        assert!(
            matches!(got, Err(StoreError::Other { code: 3004, .. })),
            "{got:?}"
        );
        let d = log.details(key).await.expect("details");
        assert_eq!((d.min_available_version, d.max_version), (1, 1));
    }
}

mod cross_shard {
    use super::*;

    /// The server routes by `aggregate_id % shards`, so ids `n` and `n + 1` always land on two
    /// shards when there are at least two.
    #[tokio::test]
    async fn aggregates_on_two_shards_cannot_share_a_write() {
        let Some(address) = live_address("CELERIANT_SHARDED_ADDRESS") else {
            return;
        };
        let log = log_at(address);
        let a = fresh_key();
        let b = AggregateKey {
            aggregate_id: a.aggregate_id.wrapping_add(1),
            ..a
        };
        let got = log
            .write(
                18,
                vec![write(a, &[1], None, false), write(b, &[1], None, false)],
            )
            .await;
        assert_eq!(got, Err(StoreError::CrossShard));
        assert_eq!(log.details(a).await, Err(StoreError::AggregateNotFound));
    }
}

mod api_key {
    use super::*;

    fn with_key(address: &str, key: Option<&str>) -> CeleriantLog {
        let cfg = CeleriantConfig {
            address: address.to_owned(),
            api_key: key.map(|k| k.parse().expect("non-empty key")),
            ..CeleriantConfig::default()
        };
        CeleriantLog::connect(&cfg).expect("valid config")
    }

    fn code(got: Result<impl std::fmt::Debug, StoreError>) -> u32 {
        match got {
            Err(StoreError::Other { code, .. }) => code,
            other => panic!("expected a server refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn keys_are_sent_and_refusals_are_not_retryable() {
        let (Some(address), Some(rw), Some(ro)) = (
            live_address("CELERIANT_AUTH_ADDRESS"),
            live_address("CELERIANT_AUTH_RW_KEY"),
            live_address("CELERIANT_AUTH_RO_KEY"),
        ) else {
            return;
        };
        let key = fresh_key();
        let writer = with_key(&address, Some(&rw));
        assert_eq!(writer.ping().await, Ok(()));
        assert_eq!(
            writer.write(22, vec![write(key, &[1], None, true)]).await,
            Ok(vec![1])
        );

        let reader = with_key(&address, Some(&ro));
        let page = reader
            .read(key, &ReadFilter::default())
            .await
            .expect("read-only reads");
        assert_eq!(page.batches.len(), 1);
        // 10007: insufficient permissions.
        assert_eq!(
            code(reader.write(22, vec![write(key, &[2], None, true)]).await),
            10_007
        );

        // 10004: no identify handshake at all; 10006: a key the server does not know.
        assert_eq!(code(with_key(&address, None).ping().await), 10_004);
        let forged = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        assert_eq!(code(with_key(&address, Some(forged)).ping().await), 10_006);
    }
}
