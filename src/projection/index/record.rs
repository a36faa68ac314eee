//! How one [`RecentWrite`] is kept: packed into a 56-byte [`Record`] on append, unpacked on
//! lookup. It knows nothing of the table that holds the records. The packing is what keeps a cold catch-up's index small and sequential; nothing
//! outside this file reads a record's bits.

use uuid::Uuid;

use crate::account::events::{pack_placement, unpack_placement};
use crate::account::holds::HoldId;
use crate::account::{AccountEvent, AccountId};

use super::RecentWrite;
use super::WRITE_TAG_BITS;

/// A record: what one event answers, in 56 bytes. The id is kept as two words (no 16-byte
/// alignment), and the event as its kind and amount; a transfer's counterparty lives in
/// `Inner::parties`, so the other events do not carry 16 unused bytes each. The write tag
/// rides in `meta`'s spare bits.
#[derive(Clone, Copy)]
pub(super) struct Record {
    id_lo: u64,
    id_hi: u64,
    balance: i64,
    version: u64,
    pub(super) expires_at_ms: u64,
    amount: i64,
    /// The event kind in the low three bits; bit 3 set when the write tag is known, the tag
    /// in bits 5..32; bit 4 set when the event has a party (a transfer's counterparty, a
    /// hold's destination or the hold a resolution names) kept in `Inner::parties`, the low
    /// 32 bits of its sequence there in the high 32; for an open ([`OPENED`]), bit 32.
    meta: u64,
}

const _: () = assert!(std::mem::size_of::<Record>() == 56);

const KIND_MASK: u64 = 0b111;
const KIND_DEPOSITED: u64 = 0;
const KIND_WITHDRAWN: u64 = 1;
const KIND_TRANSFERRED_OUT: u64 = 2;
const KIND_TRANSFERRED_IN: u64 = 3;
/// A placement: `amount` keeps the held amount and the expiry together
/// ([`pack_placement`]).
const KIND_HOLD_PLACED: u64 = 4;
const KIND_HOLD_POSTED: u64 = 5;
const KIND_HOLD_VOIDED: u64 = 6;
const KIND_HOLD_EXPIRED: u64 = 7;
/// An open: kind [`KIND_DEPOSITED`] with this bit, which only a party's bits could
/// otherwise hold (a deposit never has one), and no amount.
const OPENED: u64 = 1 << 32;
const TAG_KNOWN: u64 = 1 << 3;
const HAS_PARTY: u64 = 1 << 4;
const TAG_SHIFT: u32 = 5;
const _: () = assert!(
    TAG_SHIFT + WRITE_TAG_BITS <= 32,
    "the tag stays below the party bits"
);

impl Record {
    pub(super) fn id(&self) -> u128 {
        (u128::from(self.id_hi) << 64) | u128::from(self.id_lo)
    }

    /// Whether it keeps a party in `Inner::parties`.
    pub(super) fn has_party(&self) -> bool {
        self.meta & HAS_PARTY != 0
    }
}

impl Record {
    /// Packs `write` under `event_id`. Its party is handed back, to be kept at sequence
    /// `party_seq` of `Inner::parties`; the record keeps that sequence's low 32 bits.
    #[inline]
    pub(super) fn pack(
        event_id: u128,
        write: RecentWrite,
        party_seq: u64,
    ) -> (Self, Option<[u8; 16]>) {
        let (kind, amount, party) = match write.event {
            AccountEvent::Opened => (KIND_DEPOSITED | OPENED, 0, None),
            AccountEvent::Deposited { amount } => (KIND_DEPOSITED, amount, None),
            AccountEvent::Withdrawn { amount } => (KIND_WITHDRAWN, amount, None),
            AccountEvent::TransferredOut { amount, to } => (KIND_TRANSFERRED_OUT, amount, Some(to)),
            AccountEvent::TransferredIn { amount, from } => {
                (KIND_TRANSFERRED_IN, amount, Some(from))
            }
            AccountEvent::HoldPlaced {
                amount,
                to,
                expires_in_secs,
            } => (
                KIND_HOLD_PLACED,
                pack_placement(amount, expires_in_secs),
                to,
            ),
            AccountEvent::HoldPosted { hold, amount } => {
                (KIND_HOLD_POSTED, amount, Some(AccountId(hold.0)))
            }
            AccountEvent::HoldVoided { hold } => (KIND_HOLD_VOIDED, 0, Some(AccountId(hold.0))),
            AccountEvent::HoldExpired { hold } => (KIND_HOLD_EXPIRED, 0, Some(AccountId(hold.0))),
        };
        let mut meta = kind;
        if let Some(tag) = write.write_tag {
            debug_assert!(tag < 1 << WRITE_TAG_BITS, "a write tag fits its bits");
            meta |= TAG_KNOWN | (u64::from(tag & ((1 << WRITE_TAG_BITS) - 1)) << TAG_SHIFT);
        }
        if party.is_some() {
            meta |= HAS_PARTY | ((party_seq & u64::from(u32::MAX)) << 32);
        }
        let record = Record {
            id_lo: event_id as u64,
            id_hi: (event_id >> 64) as u64,
            balance: write.balance,
            version: write.version,
            expires_at_ms: write.expires_at_ms,
            amount,
            meta,
        };
        (record, party.map(|p| *p.0.as_bytes()))
    }

    /// What the record answers. `party_at` gives the counterparty kept at the sequence whose
    /// low 32 bits it is passed.
    pub(super) fn unpack(&self, party_at: impl Fn(u32) -> [u8; 16]) -> RecentWrite {
        let amount = self.amount;
        let party = || AccountId(Uuid::from_bytes(party_at((self.meta >> 32) as u32)));
        let hold = || HoldId(party().0);
        let event = match self.meta & KIND_MASK {
            KIND_DEPOSITED if self.meta & OPENED != 0 => AccountEvent::Opened,
            KIND_DEPOSITED => AccountEvent::Deposited { amount },
            KIND_WITHDRAWN => AccountEvent::Withdrawn { amount },
            KIND_TRANSFERRED_OUT => AccountEvent::TransferredOut {
                amount,
                to: party(),
            },
            KIND_TRANSFERRED_IN => AccountEvent::TransferredIn {
                amount,
                from: party(),
            },
            KIND_HOLD_PLACED => {
                let (amount, expires_in_secs) = unpack_placement(amount);
                AccountEvent::HoldPlaced {
                    amount,
                    to: self.has_party().then(party),
                    expires_in_secs,
                }
            }
            KIND_HOLD_POSTED => AccountEvent::HoldPosted {
                hold: hold(),
                amount,
            },
            KIND_HOLD_VOIDED => AccountEvent::HoldVoided { hold: hold() },
            _ => AccountEvent::HoldExpired { hold: hold() },
        };
        let write_tag = (self.meta & TAG_KNOWN != 0)
            .then(|| ((self.meta & u64::from(u32::MAX)) >> TAG_SHIFT) as u32);
        RecentWrite {
            balance: self.balance,
            version: self.version,
            expires_at_ms: self.expires_at_ms,
            event,
            write_tag,
        }
    }
}
