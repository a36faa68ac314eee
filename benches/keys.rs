//! The key memory: what a cold replica's first touch pays to load an account's remembered
//! keys from its checkpoints' segments, and what a write pays to remember one key.
//!
//! The shape is a hot account at the per-account cap: about 984,000 keys in 243 segments
//! (one a checkpoint), 16 keys a batch (one version), one cent a deposit.

use bytes::BytesMut;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tally::projection::keys::{KeyMemory, Segment, SegmentKey};

const SEGMENTS: u64 = 243;
const KEYS_PER_SEGMENT: u64 = 4_050;
const KEYS_PER_BATCH: u64 = 16;

/// Event ids as they arrive: random-looking 128-bit values.
fn id(i: u64) -> u128 {
    u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
}

/// The segments' encoded bytes, oldest first, each with its checkpoint's commit time.
fn encoded_segments() -> Vec<(BytesMut, u64)> {
    let mut out = Vec::new();
    let mut key = 0u64;
    for s in 0..SEGMENTS {
        let after = key / KEYS_PER_BATCH;
        let keys = (0..KEYS_PER_SEGMENT)
            .map(|_| {
                key += 1;
                SegmentKey {
                    fingerprint: tally::projection::keys::fingerprint(id(key)),
                    version: after + 1 + (key - 1 - after * KEYS_PER_BATCH) / KEYS_PER_BATCH,
                    balance: key as i64,
                }
            })
            .collect::<Vec<_>>();
        let seg = Segment {
            after,
            after_ms: 1_000 + s,
            forgotten: false,
            keys,
        };
        let mut b = BytesMut::new();
        seg.encode(&mut b);
        out.push((b, 1_001 + s));
    }
    out
}

fn decode_all(encoded: &[(BytesMut, u64)]) -> Vec<(Segment, u64)> {
    encoded
        .iter()
        .map(|(b, ms)| (Segment::decode(b, u64::MAX).expect("a valid segment"), *ms))
        .collect()
}

fn bench(c: &mut Criterion) {
    let encoded = encoded_segments();
    let total = SEGMENTS * KEYS_PER_SEGMENT;
    let mut g = c.benchmark_group("keys");
    g.sample_size(20);
    g.throughput(Throughput::Elements(total));
    g.bench_function("decode_segments", |b| {
        b.iter(|| decode_all(black_box(&encoded)))
    });
    let decoded = decode_all(&encoded);
    g.bench_function("load_segments", |b| {
        b.iter(|| {
            let mut m = KeyMemory::default();
            m.load_chain(decoded.iter().map(|(s, ms)| (s, *ms)));
            m
        })
    });
    g.bench_function("decode_and_load", |b| {
        b.iter(|| {
            let decoded = decode_all(black_box(&encoded));
            let mut m = KeyMemory::default();
            m.load_chain(decoded.iter().map(|(s, ms)| (s, *ms)));
            m
        })
    });
    g.bench_function("push", |b| {
        b.iter_batched(
            KeyMemory::default,
            |mut m| {
                for k in 1..=total {
                    m.push(id(k), k / KEYS_PER_BATCH + 1, k as i64, 1_000 + k / 4_000);
                }
                m
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
