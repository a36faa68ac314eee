//! The store's own ceiling for combined writes: how many account writes per second a real
//! Celeriant server takes when each request carries `group` accounts, from `tasks` concurrent
//! writers, with nothing of Tally's request path in between (the port's Celeriant adapter
//! only). What group commit can reach is bounded by this.
//!
//! ```sh
//! CELERIANT_ADDRESS=127.0.0.1:10000 cargo run --release --example combined_writes -- 10 64:1 4:16 8:16 16:16
//! ```
//! Arguments: seconds per point, then `tasks:group` points. Each writer owns its accounts
//! and writes one small event to each of `group` of them per request, guarded on the version
//! it wrote last, as Tally's write loop does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tally::store::celeriant::{CeleriantConfig, CeleriantLog};
use tally::store::{AggregateKey, AggregateWrite, Event, EventLog, EventType};

const PAYLOAD: &[u8] = br#"{"amountCents":100,"kind":"deposit"}"#;

#[tokio::main]
async fn main() {
    let address = std::env::var("CELERIANT_ADDRESS").expect("CELERIANT_ADDRESS names a server");
    let mut args = std::env::args().skip(1);
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let log = Arc::new(
        CeleriantLog::connect(&CeleriantConfig {
            address,
            ..CeleriantConfig::default()
        })
        .expect("valid config"),
    );
    let org = uuid::Uuid::new_v4().as_u128();
    for point in args {
        let (tasks, group) = point
            .split_once(':')
            .and_then(|(t, g)| Some((t.parse::<usize>().ok()?, g.parse::<usize>().ok()?)))
            .expect("points are tasks:group");
        let (requests, accounts) = run(&log, org, tasks, group, Duration::from_secs(seconds)).await;
        println!(
            "tasks {tasks:>3} group {group:>3}: {:>8.0} account writes/s, {:>7.0} requests/s",
            accounts as f64 / seconds as f64,
            requests as f64 / seconds as f64
        );
    }
}

/// Runs `tasks` writers for `length`; returns (requests, account writes) that landed.
async fn run(
    log: &Arc<CeleriantLog>,
    org: u128,
    tasks: usize,
    group: usize,
    length: Duration,
) -> (u64, u64) {
    let requests = Arc::new(AtomicU64::new(0));
    let accounts = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + length;
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (log, requests, accounts) = (log.clone(), requests.clone(), accounts.clone());
        set.spawn(async move {
            let keys: Vec<AggregateKey> = (0..group)
                .map(|_| AggregateKey {
                    org_id: org,
                    aggregate_type_id: 1,
                    aggregate_id: uuid::Uuid::new_v4().as_u128(),
                })
                .collect();
            let mut version = 0u64;
            while Instant::now() < end {
                let writes = keys
                    .iter()
                    .map(|&key| AggregateWrite {
                        key,
                        events: vec![Event {
                            client_seq: version + 1,
                            event_id: None,
                            event_type: EventType { major: 1, minor: 0 },
                            payload: Bytes::from_static(PAYLOAD),
                            timestamp_ms: 0,
                        }],
                        expected_version: Some(version),
                        allow_create: true,
                        enforce_client_idempotency: true,
                    })
                    .collect();
                match log.write_combined(1, writes).await {
                    Ok(_) => {
                        version += 1;
                        requests.fetch_add(1, Ordering::Relaxed);
                        accounts.fetch_add(group as u64, Ordering::Relaxed);
                    }
                    Err(e) => panic!("a writer's own accounts refused a write: {e}"),
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    (
        requests.load(Ordering::Relaxed),
        accounts.load(Ordering::Relaxed),
    )
}
