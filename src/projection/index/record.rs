//! How one [`RecentWrite`] is kept: packed into a 56-byte [`Record`] on append, unpacked on
//! lookup. The packing is what keeps a cold catch-up's index small and sequential; nothing
//! outside this file reads a record's bits.

use uuid::Uuid;

use crate::account::{AccountEvent, AccountId};

use super::RecentWrite;
use super::WRITE_TAG_BITS;
use super::table::{Inner, MAX_RECORDS};

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

impl Inner {
    /// Appends a record to be indexed by the next [`Inner::commit`].
    #[inline]
    pub(super) fn append(&mut self, event_id: u128, write: RecentWrite) {
        // The hard check runs once per commit; here only in debug builds (the hot path).
        debug_assert!((self.records.len() as u64) < MAX_RECORDS);
        self.pending_tags.push(self.tag(event_id));
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
        if let Some(party) = party {
            let seq = self
                .parties_front_seq
                .wrapping_add(self.parties.len() as u64);
            meta |= (seq & u64::from(u32::MAX)) << 32;
            self.parties.push_back(*party.0.as_bytes());
        }
        self.records.push_back(Record {
            id_lo: event_id as u64,
            id_hi: (event_id >> 64) as u64,
            balance: write.balance,
            version: write.version,
            expires_at_ms: write.expires_at_ms,
            amount,
            meta,
        });
    }

    /// What `record` answers.
    pub(super) fn write_of(&self, record: &Record) -> RecentWrite {
        let amount = record.amount;
        let party = || {
            let at = ((record.meta >> 32) as u32).wrapping_sub(self.parties_front_seq as u32);
            AccountId(Uuid::from_bytes(self.parties[at as usize]))
        };
        let event = match record.meta & KIND_MASK {
            KIND_DEPOSITED if record.meta & OPENED != 0 => AccountEvent::Opened,
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
        let write_tag = (record.meta & TAG_KNOWN != 0)
            .then(|| ((record.meta & u64::from(u32::MAX)) >> TAG_SHIFT) as u32);
        RecentWrite {
            balance: record.balance,
            version: record.version,
            expires_at_ms: record.expires_at_ms,
            event,
            write_tag,
        }
    }

    /// Drops the oldest record (and its counterparty, for a transfer).
    pub(super) fn pop_front(&mut self) {
        if let Some(popped) = self.records.pop_front() {
            self.front_seq = self.front_seq.wrapping_add(1);
            if popped.is_transfer() {
                self.parties.pop_front();
                self.parties_front_seq = self.parties_front_seq.wrapping_add(1);
            }
        }
    }
}
