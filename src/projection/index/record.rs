//! How one [`RecentWrite`] is kept: packed into a 56-byte [`Record`] on append, unpacked on
//! lookup. It knows nothing of the table that holds the records. The packing is what keeps a cold catch-up's index small and sequential; nothing
//! outside this file reads a record's bits.

use uuid::Uuid;

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
    /// The event kind in the low two bits; bit 2 set when the write tag is known, the tag
    /// in bits 3..32; for a transfer, the low 32 bits of its counterparty's sequence in
    /// `Inner::parties` in the high 32; for an open ([`OPENED`]), bit 32.
    meta: u64,
}

const _: () = assert!(std::mem::size_of::<Record>() == 56);

const KIND_MASK: u64 = 0b11;
const KIND_DEPOSITED: u64 = 0;
const KIND_WITHDRAWN: u64 = 1;
const KIND_TRANSFERRED_OUT: u64 = 2;
const KIND_TRANSFERRED_IN: u64 = 3;
/// An open: kind [`KIND_DEPOSITED`] with this bit, which only a transfer's counterparty bits
/// could otherwise hold (a deposit never sets them), and no amount.
const OPENED: u64 = 1 << 32;
const TAG_KNOWN: u64 = 1 << 2;
const TAG_SHIFT: u32 = 3;
const _: () = assert!(
    TAG_SHIFT + WRITE_TAG_BITS <= 32,
    "the tag stays below the party bits"
);

impl Record {
    pub(super) fn id(&self) -> u128 {
        (u128::from(self.id_hi) << 64) | u128::from(self.id_lo)
    }

    pub(super) fn is_transfer(&self) -> bool {
        self.meta & KIND_MASK >= KIND_TRANSFERRED_OUT
    }
}

impl Record {
    /// Packs `write` under `event_id`. A transfer's counterparty is handed back, to be kept
    /// at sequence `party_seq` of `Inner::parties`; the record keeps that sequence's low 32
    /// bits.
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
        };
        let mut meta = kind;
        if let Some(tag) = write.write_tag {
            debug_assert!(tag < 1 << WRITE_TAG_BITS, "a write tag fits its bits");
            meta |= TAG_KNOWN | (u64::from(tag & ((1 << WRITE_TAG_BITS) - 1)) << TAG_SHIFT);
        }
        if party.is_some() {
            meta |= (party_seq & u64::from(u32::MAX)) << 32;
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
        let event = match self.meta & KIND_MASK {
            KIND_DEPOSITED if self.meta & OPENED != 0 => AccountEvent::Opened,
            KIND_DEPOSITED => AccountEvent::Deposited { amount },
            KIND_WITHDRAWN => AccountEvent::Withdrawn { amount },
            KIND_TRANSFERRED_OUT => AccountEvent::TransferredOut {
                amount,
                to: party(),
            },
            _ => AccountEvent::TransferredIn {
                amount,
                from: party(),
            },
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
