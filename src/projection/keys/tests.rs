use proptest::prelude::*;

use super::*;

fn id(n: u64) -> u128 {
    // Spread like a UUIDv5: the low and high words both vary.
    (u128::from(n.wrapping_mul(0x2545_F491_4F6C_DD1D)) << 64) | u128::from(n)
}

/// Rule: the fingerprint is a fixed function of the event id, the same in every build:
/// checkpoints written by one release are read by the next.
#[test]
fn the_fingerprint_is_fixed_across_builds() {
    assert_eq!(fingerprint(0), 0);
    assert_eq!(fingerprint(1), 0x9e37_79b9);
    assert_ne!(fingerprint(id(1)), fingerprint(id(2)));
}

/// Rule: every key pushed is found again with its version and balance, through sealing and
/// merging, and a key never pushed finds nothing but a rare fingerprint collision.
#[test]
fn every_remembered_key_is_found_with_its_version_and_balance() {
    let mut m = KeyMemory::default();
    let n = 3 * MAX_RUN_KEYS as u64 + 17;
    for v in 1..=n {
        m.push(id(v), v, v as i64 * 3 - 1_000, v);
    }
    assert_eq!(m.len(), n as usize);
    for v in (1..=n).step_by(97) {
        let c = m.candidates(id(v)).unwrap();
        let want = Remembered {
            version: v,
            balance: v as i64 * 3 - 1_000,
        };
        assert!(c.contains(&want), "key {v} lost: {c:?}");
    }
    let misses = (n + 1..n + 10_001)
        .filter(|&v| !m.candidates(id(v)).unwrap().is_empty())
        .count();
    // ~200k keys in 2^32 fingerprints: about 0.5 collisions in 10k looks.
    assert!(misses < 10, "{misses} collisions");
}

/// Rule: a remembered key costs at most 16 bytes, runs, tail and spare room included.
#[test]
fn a_remembered_key_costs_at_most_16_bytes() {
    for keys in [1_000u64, 10_000, 300_000] {
        let mut m = KeyMemory::default();
        for v in 1..=keys {
            m.push(id(v), v, (v % 7) as i64 * 100, v);
        }
        let per_key = m.heap_bytes() as f64 / keys as f64;
        assert!(per_key <= 16.0, "{keys} keys: {per_key:.2} bytes a key");
    }
}

/// Rule: a key whose balance moved more than an `i32` from its run's first starts a new run,
/// and both are still found.
#[test]
fn a_key_far_from_its_runs_balance_starts_a_new_run() {
    let mut m = KeyMemory::default();
    let far = i64::from(i32::MAX) * 4;
    m.push(id(1), 1, 0, 1);
    m.push(id(2), 2, far, 2);
    m.push(id(3), 3, i64::MIN, 3);
    for (v, b) in [(1, 0), (2, far), (3, i64::MIN)] {
        let want = Remembered {
            version: v,
            balance: b,
        };
        assert_eq!(m.candidates(id(v)).unwrap(), vec![want]);
    }
}

/// Rule: the retention drops whole runs whose newest key is older than it, and says nothing
/// was forgotten early; a cap drops the oldest and moves the forgotten horizon.
#[test]
fn retention_expires_old_runs_and_a_cap_forgets_the_oldest() {
    let mut m = KeyMemory::default();
    // Two sealed tails merge into one run of the oldest 2,048; a third stays a run; ten
    // keys sit in the tail.
    let newest = 3 * TAIL_KEYS as u64 + 10;
    for v in 1..=newest {
        m.push(id(v), v, 0, v * 10);
    }
    let before = m.len();
    assert_eq!(m.expire(5), 0, "nothing is older than its first key");
    let gone = m.expire(2 * TAIL_KEYS as u64 * 10 + 1);
    assert_eq!(gone, 2 * TAIL_KEYS, "the oldest run expires whole");
    assert_eq!(m.forgotten_ms(), 0, "expiry is not forgetting");
    assert!(m.candidates(id(1)).unwrap().is_empty());
    assert_eq!(m.len(), before - gone);

    // Over the cap by 10: down to its slack below it, the oldest keys of the oldest run.
    let dropped = m.cap(TAIL_KEYS);
    let target = TAIL_KEYS - TAIL_KEYS / CAP_SLACK_DIVISOR;
    assert_eq!((dropped, m.len()), (TAIL_KEYS + 10 - target, target));
    assert!(
        m.candidates(id(2 * TAIL_KEYS as u64 + 1))
            .unwrap()
            .is_empty()
    );
    let kept = 2 * TAIL_KEYS as u64 + (TAIL_KEYS + 10 - target) as u64 + 1;
    assert_eq!(
        m.candidates(id(kept)).unwrap().len(),
        1,
        "the next oldest is kept"
    );
    assert_eq!(m.forgotten_ms(), 3 * TAIL_KEYS as u64 * 10);
    assert_eq!(m.candidates(id(newest)).unwrap().len(), 1);
    assert!(m.floor() > 0, "a cap raises the floor");
    assert!(
        m.segment(0, 0, newest).is_none(),
        "a segment below the floor is not whole"
    );
}

/// Rule: a segment carries exactly the keys of its version range, in version order, and
/// round-trips through its encoding; a memory loaded from it finds them.
#[test]
fn a_segment_round_trips_and_loads() {
    let mut m = KeyMemory::default();
    for v in 1..=5_000u64 {
        m.push(id(v), v, -(v as i64) * 1_000, v);
    }
    let seg = m.segment(1_000, 1_000, 4_000).unwrap();
    assert_eq!(seg.keys.len(), 3_000);
    assert!(seg.keys.windows(2).all(|w| w[0].version <= w[1].version));
    let mut buf = Vec::new();
    seg.encode(&mut buf);
    assert!(buf.len() < 3_000 * 10, "{} bytes", buf.len());
    let back = Segment::decode(&buf, 4_000).unwrap();
    assert_eq!(back, seg);
    assert!(
        Segment::decode(&buf, 3_999).is_none(),
        "a key past the checkpoint"
    );
    assert!(Segment::decode(&buf[..buf.len() - 1], 4_000).is_none());
    let forgot = Segment {
        forgotten: true,
        ..seg.clone()
    };
    let mut buf2 = Vec::new();
    forgot.encode(&mut buf2);
    assert_eq!(Segment::decode(&buf2, 4_000), Some(forgot));

    let mut cold = KeyMemory::default();
    cold.load(&back, 77);
    assert_eq!(cold.floor(), 1_000);
    let want = Remembered {
        version: 2_500,
        balance: -2_500_000,
    };
    assert_eq!(cold.candidates(id(2_500)).unwrap(), vec![want]);
    assert!(cold.candidates(id(999)).unwrap().is_empty());
}

/// Rule: a batch's keys share its version, and a memory loaded from a segment finds every
/// one of them; a second segment that overlaps the first adds only what is newer.
#[test]
fn a_loaded_segment_keeps_every_key_of_a_batch() {
    let mut m = KeyMemory::default();
    for v in 1..=10u64 {
        for e in 0..3 {
            m.push(id(v * 10 + e), v, (v * 10 + e) as i64, v);
        }
    }
    let mut cold = KeyMemory::default();
    cold.load(&m.segment(0, 0, 6).unwrap(), 6);
    cold.load(&m.segment(4, 4, 10).unwrap(), 10);
    assert_eq!(cold.len(), 30, "every key once");
    for v in 1..=10u64 {
        for e in 0..3 {
            let want = Remembered {
                version: v,
                balance: (v * 10 + e) as i64,
            };
            assert_eq!(cold.candidates(id(v * 10 + e)).unwrap(), vec![want]);
        }
    }
}

/// Every key a memory holds, by what a look answers: the same for two memories when each
/// event's candidates agree.
fn agree(a: &KeyMemory, b: &KeyMemory, events: &[u128]) -> Result<(), String> {
    let facts = |m: &KeyMemory| {
        (
            m.len(),
            m.floor(),
            m.floor_ms(),
            m.newest_version(),
            m.oldest_ms(),
            m.forgotten_ms(),
        )
    };
    if facts(a) != facts(b) {
        return Err(format!("{:?} against {:?}", facts(a), facts(b)));
    }
    for e in events {
        let (x, y) = (a.candidates(*e), b.candidates(*e));
        if x.clone().map(sorted) != y.clone().map(sorted) {
            return Err(format!("event {e}: {x:?} against {y:?}"));
        }
    }
    Ok(())
}

/// Rule: a chain loaded at once holds what loading its segments one by one holds, at a
/// million keys' scale (whole runs sealed at once, then the rest cut as pushes leave it),
/// and a push after it lands as after the other.
#[test]
fn a_chain_loaded_at_once_holds_what_its_segments_loaded_one_by_one_hold() {
    let mut m = KeyMemory::default();
    let keys = 3 * MAX_RUN_KEYS as u64 + 5 * TAIL_KEYS as u64 + 77;
    for k in 1..=keys {
        m.push(id(k), k / 8 + 1, k as i64, k / 4_000);
    }
    let newest = keys / 8 + 1;
    let cuts: Vec<u64> = (0..newest).step_by(509).chain([newest]).collect();
    let segments: Vec<(Segment, u64)> = cuts
        .windows(2)
        .map(|w| (m.segment(w[0], w[0], w[1]).unwrap(), w[1] * 8 / 4_000))
        .collect();
    let (mut one_by_one, mut at_once) = (KeyMemory::default(), KeyMemory::default());
    for (seg, ms) in &segments {
        one_by_one.load(seg, *ms);
    }
    at_once.load_chain(segments.iter().map(|(s, ms)| (s, *ms)));
    let events: Vec<u128> = (1..=keys).step_by(7).map(id).collect();
    agree(&one_by_one, &at_once, &events).unwrap();
    assert_eq!(at_once.len(), keys as usize);
    for m in [&mut one_by_one, &mut at_once] {
        m.push(id(keys + 1), newest + 1, 0, 1_000);
    }
    agree(&one_by_one, &at_once, &[id(keys + 1), id(1), id(keys)]).unwrap();
}

fn sorted(mut v: Vec<Remembered>) -> Vec<Remembered> {
    v.sort_by_key(|r| (r.version, r.balance));
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Rule: whatever the versions and balances, a look finds exactly the keys a plain list
    /// would (fingerprint matches included), through sealing, merging and a cap.
    #[test]
    fn a_look_agrees_with_a_plain_list(
        steps in prop::collection::vec(
            (0u64..3, -1_000_000_000_000i64..1_000_000_000_000, 0u64..50),
            1..2_500,
        ),
        cap in 100usize..5_000,
    ) {
        let mut m = KeyMemory::default();
        let mut model: Vec<(u128, u64, i64)> = Vec::new();
        let mut version = 0u64;
        for (i, (dv, balance, key)) in steps.iter().enumerate() {
            version += dv;
            let event = id(*key * 1_000 + i as u64 % 3);
            m.push(event, version, *balance, version);
            model.push((event, version, *balance));
        }
        m.cap(cap);
        let floor = m.floor();
        for (event, _, _) in &model {
            let fp = fingerprint(*event);
            let wanted = |strict: bool| {
                sorted(
                    model
                        .iter()
                        .filter(|(e, v, _)| {
                            fingerprint(*e) == fp && (*v > floor || (!strict && *v == floor))
                        })
                        .map(|&(_, version, balance)| Remembered { version, balance })
                        .collect(),
                )
            };
            // Keys at the floor's own version may straddle a dropped run: either way.
            let (must, may) = (wanted(true), wanted(false));
            match m.candidates(*event) {
                Ok(got) => {
                    let got = sorted(got);
                    prop_assert!(must.iter().all(|r| got.contains(r)), "lost {:?} of {:?}", must, got);
                    prop_assert!(got.iter().all(|r| may.contains(r)), "invented {:?} beyond {:?}", got, may);
                }
                Err(n) => prop_assert!(n > MAX_CANDIDATES && n >= must.len() && n <= may.len()),
            }
        }
    }

    /// Rule: loading a chain at once agrees with loading its segments one by one, whatever
    /// the segments' overlaps, empty segments and balances that do not fit a run.
    #[test]
    fn a_chain_loaded_at_once_agrees_with_one_segment_at_a_time(
        steps in prop::collection::vec((0u64..3, -3_000_000_000i64..3_000_000_000), 1..5_000),
        cuts in prop::collection::vec((0u64..4_000, 0u64..3), 1..12),
    ) {
        let mut m = KeyMemory::default();
        let mut version = 1u64;
        let mut events = Vec::new();
        for (i, (dv, balance)) in steps.iter().enumerate() {
            version += dv;
            let event = id(i as u64);
            m.push(event, version, *balance, version / 10);
            events.push(event);
        }
        // Segments from version cut points; each may start a little before the last's end.
        let mut bounds: Vec<u64> = cuts.iter().map(|(at, _)| at % (version + 1)).collect();
        bounds.push(0);
        bounds.push(version);
        bounds.sort_unstable();
        bounds.dedup();
        let segments: Vec<(Segment, u64)> = bounds
            .windows(2)
            .zip(cuts.iter().cycle())
            .map(|(w, (_, back))| {
                let after = w[0].saturating_sub(*back);
                (m.segment(after, after * 3, w[1]).unwrap(), w[1] / 10)
            })
            .collect();
        let (mut one_by_one, mut at_once) = (KeyMemory::default(), KeyMemory::default());
        for (seg, ms) in &segments {
            one_by_one.load(seg, *ms);
        }
        at_once.load_chain(segments.iter().map(|(s, ms)| (s, *ms)));
        prop_assert_eq!(agree(&one_by_one, &at_once, &events), Ok(()));
        prop_assert_eq!(at_once.len(), steps.len());
    }

    /// Rule: the search from the expected place finds what a binary search finds, however
    /// the fingerprints bunch (spread, clustered, repeated, at either end).
    #[test]
    fn the_search_from_the_expected_place_agrees_with_a_binary_search(
        mut fps in prop::collection::vec(
            prop_oneof![any::<u32>(), 0u32..64, (u32::MAX - 64)..=u32::MAX, Just(1u32 << 31)],
            0..3_000,
        ),
        looks in prop::collection::vec(any::<u32>(), 1..50),
    ) {
        fps.sort_unstable();
        let probes = looks.iter().copied().chain(fps.iter().step_by(7).copied()).chain([0, u32::MAX]);
        for fp in probes {
            prop_assert_eq!(run::lower_bound(&fps, fp), fps.partition_point(|&f| f < fp), "fp {}", fp);
        }
    }
}
