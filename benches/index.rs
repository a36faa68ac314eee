//! The recent-writes index: insert, lookup (hit and miss) and expiry, per operation.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tally::account::AccountEvent;
use tally::projection::{RecentIndex, RecentWrite};

const N: u64 = 100_000;

fn entry(i: u64) -> RecentWrite {
    RecentWrite {
        balance: i as i64,
        version: i,
        expires_at_ms: 1_000 + i,
        event: AccountEvent::Deposited { amount: 100 },
        write_tag: Some(tally::projection::index::write_tag(i, i)),
    }
}

/// Event ids as they arrive: random-looking 128-bit values.
fn id(i: u64) -> u128 {
    u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
}

fn filled() -> RecentIndex {
    let mut idx = RecentIndex::default();
    for i in 0..N {
        idx.insert(id(i), entry(i));
    }
    idx
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("index");
    g.throughput(Throughput::Elements(N));
    g.bench_function("insert", |b| {
        b.iter_batched(
            RecentIndex::default,
            |mut idx| {
                for i in 0..N {
                    idx.insert(id(i), entry(i));
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    let idx = filled();
    g.bench_function("get_hit", |b| {
        b.iter(|| {
            let mut found = 0u64;
            for i in 0..N {
                found += u64::from(idx.get(black_box(id(i)), 0).is_some());
            }
            found
        })
    });
    g.bench_function("get_miss", |b| {
        b.iter(|| {
            let mut found = 0u64;
            for i in N..2 * N {
                found += u64::from(idx.get(black_box(id(i)), 0).is_some());
            }
            found
        })
    });
    g.bench_function("evict_all", |b| {
        b.iter_batched(
            filled,
            |mut idx| idx.evict_expired(u64::MAX),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
