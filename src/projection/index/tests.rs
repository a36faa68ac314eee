//! The index against its reference semantics (a map with an order log), by example and by
//! property.

use super::table::{MAX_RECORDS, assert_addressable};
use super::*;
use crate::account::AccountId;
use crate::account::holds::HoldId;
use proptest::prelude::*;
use std::collections::{HashMap, VecDeque};
use uuid::Uuid;

fn write(expires_at_ms: u64) -> RecentWrite {
    RecentWrite {
        balance: 1,
        version: 1,
        expires_at_ms,
        event: AccountEvent::Deposited { amount: 1 },
        write_tag: None,
    }
}

#[test]
fn an_expired_entry_is_a_miss_and_is_evicted_in_order() {
    let mut idx = RecentIndex::default();
    idx.insert(1, write(100));
    idx.insert(2, write(200));
    assert!(idx.get(1, 99).is_some());
    assert!(idx.get(1, 100).is_none());
    assert_eq!(idx.evict_expired(150), 1);
    assert_eq!(idx.len(), 1);
    assert!(idx.get(2, 150).is_some());
    assert_eq!(idx.evict_expired(200), 1);
    assert!(idx.is_empty());
}

#[test]
fn re_indexing_a_write_never_shortens_its_lifetime() {
    let mut idx = RecentIndex::default();
    idx.insert(7, write(900));
    idx.insert(7, write(300));
    assert_eq!(idx.get(7, 500).map(|w| w.expires_at_ms), Some(900));
    // The stale order record at 300 must not evict the entry that lives to 900.
    assert_eq!(idx.evict_expired(500), 0);
    assert!(idx.get(7, 500).is_some());
}

#[test]
fn a_re_record_answers_with_the_latest_response() {
    let mut idx = RecentIndex::default();
    idx.insert(7, write(900));
    let later = RecentWrite {
        balance: 5,
        version: 4,
        ..write(100)
    };
    idx.insert(7, later);
    assert_eq!(
        idx.get(7, 0),
        Some(RecentWrite {
            expires_at_ms: 900,
            ..later
        })
    );
    assert_eq!(idx.len(), 1);
}

#[test]
fn a_large_index_grows_finds_everything_and_drains_to_nothing() {
    let mut idx = RecentIndex::default();
    let n = 100_000u64;
    for i in 0..n {
        // Ids that differ only in their high word, to exercise the hashing of both.
        idx.insert(u128::from(i) << 64, write(i + 1));
    }
    assert_eq!(idx.len(), n as usize);
    for i in (0..n).step_by(997) {
        assert_eq!(
            idx.get(u128::from(i) << 64, 0).map(|w| w.expires_at_ms),
            Some(i + 1)
        );
    }
    assert!(idx.get(u128::from(n) << 64, 0).is_none());
    assert_eq!(idx.evict_expired(n / 2), (n / 2) as usize);
    assert!(idx.get(u128::from(n / 2) << 64, 0).is_some());
    assert!(idx.get(u128::from(n / 2 - 1) << 64, 0).is_none());
    assert_eq!(idx.evict_expired(n), (n / 2) as usize);
    assert!(idx.is_empty());
    assert!(idx.inner.is_none());
}

#[test]
fn positions_stay_exact_across_the_32_bit_wrap_of_sequences() {
    // Sequences run from 8 below 2^32 to 24 above it, then the front expires past it.
    let start = u64::from(u32::MAX) - 7;
    let mut idx = RecentIndex::starting_at(start);
    let party = |i: u64| AccountId(Uuid::from_u128(u128::from(i) + 1000));
    for i in 0..32u64 {
        let event = if i % 2 == 0 {
            AccountEvent::TransferredOut {
                amount: i as i64,
                to: party(i),
            }
        } else {
            AccountEvent::Deposited { amount: i as i64 }
        };
        idx.insert(
            u128::from(i),
            RecentWrite {
                balance: i as i64,
                version: i,
                expires_at_ms: 100 + i,
                event,
                write_tag: (!i.is_multiple_of(3)).then(|| write_tag(u64::MAX - i, i)),
            },
        );
    }
    let check = |idx: &RecentIndex, from: u64| {
        for i in from..32u64 {
            let w = idx.get(u128::from(i), 0).expect("indexed");
            assert_eq!((w.version, w.expires_at_ms), (i, 100 + i), "id {i}");
            if i % 2 == 0 {
                assert_eq!(
                    w.event,
                    AccountEvent::TransferredOut {
                        amount: i as i64,
                        to: party(i)
                    },
                    "id {i}"
                );
            }
        }
    };
    check(&idx, 0);
    // The front moves past the wrap; what is left still resolves to its own record.
    assert_eq!(idx.evict_expired(100 + 20), 21);
    check(&idx, 21);
    assert!(idx.get(20, 0).is_none());
}

#[test]
fn every_position_below_2_pow_32_is_addressable() {
    assert_addressable(0);
    assert_addressable(MAX_RECORDS as usize);
}

#[test]
#[should_panic(expected = "beyond the 4294967296 a 32-bit position addresses")]
fn an_index_longer_than_32_bit_positions_address_is_an_assertion() {
    assert_addressable(MAX_RECORDS as usize + 1);
}

/// The reference semantics: a map of the latest record per id (with the latest expiry)
/// plus an insertion-order log of (expiry, id) that eviction pops from the front.
#[derive(Default)]
struct Model {
    map: HashMap<u128, RecentWrite>,
    order: VecDeque<(u64, u128)>,
}

impl Model {
    fn insert(&mut self, id: u128, w: RecentWrite) {
        let expires = match self.map.get(&id) {
            Some(old) if old.expires_at_ms > w.expires_at_ms => old.expires_at_ms,
            _ => w.expires_at_ms,
        };
        self.map.insert(
            id,
            RecentWrite {
                expires_at_ms: expires,
                ..w
            },
        );
        self.order.push_back((expires, id));
    }

    fn get(&self, id: u128, now: u64) -> Option<RecentWrite> {
        self.map.get(&id).filter(|w| w.expires_at_ms > now).copied()
    }

    fn evict(&mut self, now: u64) -> usize {
        let mut n = 0;
        while let Some(&(expires, id)) = self.order.front() {
            if expires > now {
                break;
            }
            self.order.pop_front();
            if self.map.get(&id).is_some_and(|w| w.expires_at_ms <= now) {
                self.map.remove(&id);
                n += 1;
            }
        }
        // An index left with no id is dropped whole, order log included.
        if self.map.is_empty() {
            self.order.clear();
        }
        n
    }
}

/// A record of one of the ten kinds, its fields derived from the draws; transfers and holds
/// name a party that differs per record, so a mix-up of parties shows.
fn drawn(expires: u16, balance: i8, kind: u8, party: u16) -> RecentWrite {
    let amount = i64::from(party) - 300;
    let party = AccountId(uuid::Uuid::from_u128(u128::from(party) * 0x1_0000_0001));
    RecentWrite {
        balance: i64::from(balance),
        version: u64::from(party.0.as_u128() as u16),
        expires_at_ms: u64::from(expires),
        event: match kind % 10 {
            0 => AccountEvent::Deposited { amount },
            1 => AccountEvent::Withdrawn { amount },
            2 => AccountEvent::TransferredOut { amount, to: party },
            3 => AccountEvent::TransferredIn {
                amount,
                from: party,
            },
            5 | 6 => AccountEvent::HoldPlaced {
                amount: amount.abs(),
                to: (kind % 10 == 6).then_some(party),
                expires_in_secs: std::num::NonZeroU32::new(u32::from(expires)),
            },
            7 => AccountEvent::HoldPosted {
                hold: HoldId(party.0),
                amount,
            },
            8 => AccountEvent::HoldVoided {
                hold: HoldId(party.0),
            },
            9 => AccountEvent::HoldExpired {
                hold: HoldId(party.0),
            },
            _ => AccountEvent::Opened,
        },
        // Known for most records, with tags that use every bit (and their neighbours').
        write_tag: (!kind.is_multiple_of(5))
            .then(|| write_tag(u64::from(balance as u8), u64::from(kind))),
    }
}

/// (id, expires, balance, kind, party)
type Draw = (u8, u16, i8, u8, u16);

fn draw() -> impl Strategy<Value = Draw> {
    (
        any::<u8>(),
        any::<u16>(),
        any::<i8>(),
        any::<u8>(),
        any::<u16>(),
    )
}

#[derive(Clone, Debug)]
enum Op {
    Insert(Draw),
    Get { id: u8, now: u16 },
    Evict { now: u16 },
    Reserve { n: u8 },
    Bulk(Vec<Draw>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => draw().prop_map(Op::Insert),
        3 => (any::<u8>(), any::<u16>()).prop_map(|(id, now)| Op::Get { id, now }),
        1 => any::<u16>().prop_map(|now| Op::Evict { now }),
        1 => any::<u8>().prop_map(|n| Op::Reserve { n }),
        2 => proptest::collection::vec(draw(), 0..40).prop_map(Op::Bulk),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn behaves_exactly_like_a_map_with_an_order_log(
        ops in proptest::collection::vec(op(), 0..400),
        // Sequences from 0, or just below the 32-bit and 64-bit wraps.
        start in prop_oneof![
            Just(0u64),
            (u64::from(u32::MAX) - 300)..=u64::from(u32::MAX),
            (u64::MAX - 300)..=u64::MAX,
        ],
    ) {
        let mut idx = RecentIndex::starting_at(start);
        let mut model = Model::default();
        // Ids spread over both words, from a small space so that ids repeat.
        let id_of = |id: u8| (u128::from(id % 64) << 70) ^ u128::from(id);
        for op in ops {
            match op {
                Op::Insert((id, expires, balance, kind, party)) => {
                    let w = drawn(expires, balance, kind, party);
                    idx.insert(id_of(id), w);
                    model.insert(id_of(id), w);
                }
                Op::Get { id, now } => {
                    prop_assert_eq!(idx.get(id_of(id), u64::from(now)), model.get(id_of(id), u64::from(now)));
                }
                Op::Evict { now } => {
                    prop_assert_eq!(idx.evict_expired(u64::from(now)), model.evict(u64::from(now)));
                }
                Op::Reserve { n } => idx.reserve(usize::from(n)),
                Op::Bulk(records) => {
                    let mut bulk = idx.bulk();
                    for &(id, expires, balance, kind, party) in &records {
                        bulk.push(id_of(id), drawn(expires, balance, kind, party));
                    }
                    drop(bulk);
                    for (id, expires, balance, kind, party) in records {
                        model.insert(id_of(id), drawn(expires, balance, kind, party));
                    }
                }
            }
            prop_assert_eq!(idx.len(), model.map.len());
        }
        for id in 0..=255u8 {
            prop_assert_eq!(idx.get(id_of(id), 0), model.get(id_of(id), 0));
        }
    }
}
