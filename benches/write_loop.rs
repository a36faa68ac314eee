//! The write loop end to end against the embedded store (no HTTP): one warm account, writes
//! spread over many accounts, transfers, and concurrent deposits on one hot account.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tally::account::{AccountId, AmountCents, Identity, Operation};
use tally::metrics::Metrics;
use tally::projection::{MonotonicClock, Projection, ProjectionConfig};
use tally::store::memory::MemoryLog;
use tally::write_loop::{WriteConfig, WriteRequest, WriteService};
use uuid::Uuid;

const SPREAD_ACCOUNTS: u64 = 1_000;
const HOT_CONCURRENCY: u64 = 64;

fn service() -> Arc<WriteService> {
    let projection = Arc::new(Projection::new(
        Arc::new(MemoryLog::new()),
        Identity::default(),
        ProjectionConfig::default(),
        Arc::new(MonotonicClock::new()),
        Arc::new(Metrics::new()),
    ));
    Arc::new(WriteService::new(projection, WriteConfig::default()))
}

fn account(n: u64) -> AccountId {
    AccountId(Uuid::from_u64_pair(1, n))
}

fn deposit(account: AccountId, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::Deposit {
            account,
            amount: AmountCents::new(1).expect("positive"),
        },
        event_id,
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let next = Arc::new(AtomicU64::new(1));
    let id = move || u128::from(next.fetch_add(1, Ordering::Relaxed));
    let mut g = c.benchmark_group("write_loop");
    g.throughput(Throughput::Elements(1));

    let svc = service();
    g.bench_function("deposit_warm_account", |b| {
        b.to_async(&rt)
            .iter(|| async { svc.execute(deposit(account(0), id())).await.expect("lands") })
    });

    let svc = service();
    let mut n = 0u64;
    g.bench_function("deposit_spread_1000_accounts", |b| {
        b.to_async(&rt).iter(|| {
            n += 1;
            let acct = account(n % SPREAD_ACCOUNTS);
            let svc = svc.clone();
            let eid = id();
            async move { svc.execute(deposit(acct, eid)).await.expect("lands") }
        })
    });

    let svc = service();
    rt.block_on(async {
        for a in 0..2 {
            svc.execute(WriteRequest {
                op: Operation::Deposit {
                    account: account(a),
                    amount: AmountCents::new(1_000_000_000).expect("positive"),
                },
                event_id: u128::MAX - u128::from(a),
            })
            .await
            .expect("funded");
        }
    });
    g.bench_function("transfer", |b| {
        b.to_async(&rt).iter(|| async {
            let op = Operation::transfer(
                account(0),
                account(1),
                AmountCents::new(1).expect("positive"),
            )
            .expect("two accounts");
            svc.execute(WriteRequest { op, event_id: id() })
                .await
                .expect("lands")
        })
    });

    let svc = service();
    g.throughput(Throughput::Elements(HOT_CONCURRENCY));
    g.bench_function("hot_account_64_concurrent_deposits", |b| {
        b.to_async(&rt).iter(|| {
            let svc = svc.clone();
            let ids: Vec<u128> = (0..HOT_CONCURRENCY).map(|_| id()).collect();
            async move {
                let tasks: Vec<_> = ids
                    .into_iter()
                    .map(|eid| {
                        let svc = svc.clone();
                        tokio::spawn(async move { svc.execute(deposit(account(7), eid)).await })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task").expect("lands");
                }
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
