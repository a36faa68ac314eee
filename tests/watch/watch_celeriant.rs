//! The watch over a real Celeriant, when `CELERIANT_ADDRESS` names one: two
//! replicas, each with its own connection pool and its own watch connection, over one
//! server. A write through one appears on the other's stream; a resume reads the server.
//! Skipped when the variable is unset, except under `CI=true`, where that fails.

use crate::common;

use common::sse::Stream;
use common::{TestApp, new_account, spawn, test_config};
use reqwest::StatusCode;

/// A replica on the server at `address`, in an org of its own so runs never collide.
async fn replica(address: &str, org: &str) -> TestApp {
    spawn(
        test_config(&[
            "--store",
            "celeriant",
            "--celeriant-address",
            address,
            "--org-id",
            org,
        ]),
        None,
        None,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_one_replica_streams_from_the_other_over_celeriant() {
    let Some(address) = common::required::celeriant_address() else {
        return;
    };
    let org = uuid::Uuid::new_v4().to_string();
    let (a, b) = (replica(&address, &org).await, replica(&address, &org).await);
    a.app.started().await;
    b.app.started().await;
    let account = new_account();
    let path = format!("/api/accounts/{account}/events");
    let mut s = Stream::open(&a, &path, None).await;
    assert_eq!(s.next().await.name(), "snapshot");
    for cents in [100, 200] {
        let r = b.deposit(&account, cents, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    }
    let (e1, e2) = (s.next().await, s.next().await);
    assert_eq!((e1.id.as_deref(), e2.id.as_deref()), (Some("1"), Some("2")));
    assert_eq!(e2.json()["balanceCents"], 300);

    // The fleet-wide stream on A sees B's write too; a resume on B replays from the server.
    let mut all = Stream::open(&a, "/api/watch/stream", None).await;
    let mut resumed = Stream::open(&b, &path, Some("1")).await;
    assert_eq!(resumed.next().await.id.as_deref(), Some("2"));
    let r = b.withdraw(&account, 50, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let w = all.next().await.json();
    assert_eq!(
        (w["aggregateId"].as_str(), w["toAggregateVersion"].as_u64()),
        (Some(account.as_str()), Some(3))
    );
    assert_eq!(resumed.next().await.json()["balanceCents"], 250);
    assert_eq!(s.next().await.id.as_deref(), Some("3"));
    a.shutdown().await;
    b.shutdown().await;
}
