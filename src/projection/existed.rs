//! Accounts this replica knows to exist although it no longer holds them (evicted): a
//! first touch (`Projection::first_touch`) would write to them at version 0 and be bounced,
//! so they are read first, as before. A direct-mapped table of id hashes, fixed in size:
//! a collision forgets an account (it then takes one bounced first touch, which is safe),
//! and a false "exists" only costs the read a first touch would have saved.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::account::AccountId;

/// Slots in the table: 8 bytes each (2 MiB), about as many evicted accounts remembered.
pub const EXISTED_SLOTS: usize = 1 << 18;

pub struct Existed {
    slots: Box<[AtomicU64]>,
    hasher: foldhash::fast::FixedState,
}

impl Default for Existed {
    fn default() -> Self {
        Self {
            slots: (0..EXISTED_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: foldhash::fast::FixedState::with_seed(0x7a11_e715),
        }
    }
}

impl Existed {
    /// The slot and the non-zero tag of `account`.
    fn place(&self, account: AccountId) -> (usize, u64) {
        let h = self.hasher.hash_one(account.0.as_u128());
        ((h as usize) % self.slots.len(), h | 1)
    }

    pub fn remember(&self, account: AccountId) {
        let (i, tag) = self.place(account);
        self.slots[i].store(tag, Ordering::Relaxed);
    }

    pub fn knows(&self, account: AccountId) -> bool {
        let (i, tag) = self.place(account);
        self.slots[i].load(Ordering::Relaxed) == tag
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn a_remembered_account_is_known_and_another_is_not() {
        let t = Existed::default();
        let (a, b) = (AccountId(Uuid::from_u128(1)), AccountId(Uuid::from_u128(2)));
        assert!(!t.knows(a));
        t.remember(a);
        assert!(t.knows(a));
        assert!(!t.knows(b));
    }
}
