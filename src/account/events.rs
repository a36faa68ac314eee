//! Account events and their wire codec, compatible with existing Celeriant account streams:
//! event type majors 1 `Deposited`, 2 `Withdrawn`, 3 `TransferredOut`, 4 `TransferredIn`
//! (minor 0), with JSON payloads in PascalCase: `{"AmountCents":100}`, plus `"ToAccountId"`
//! or `"FromAccountId"` on the transfer legs.
//!
//! Major 5 `AccountOpened` (payload `{}`) is Tally's own: the event `POST /api/accounts`
//! writes as an account's first (docs/api.md, "Opening accounts"). It moves no money. The replaced
//! service folds a type it does not know as a zero amount, so its balances stay right; a
//! Tally older than this event stops on it (a poisoned account), which is why a fleet is
//! upgraded whole before anyone opens an account.
//!
//! Majors 6 to 9 are holds (`account/holds.rs`), Tally's own too, written only with
//! `--holds true`:
//! - 6 `HoldPlaced` `{"AmountCents":N}`, with `"ToAccountId"` and `"ExpiresInSecs"` when
//!   given; the hold's id is the event's own id;
//! - 7 `HoldPosted` `{"HoldId":..,"AmountCents":N}`: a debit of the posted amount;
//! - 8 `HoldVoided` and 9 `HoldExpired` `{"HoldId":..}`.
//!
//! The replaced service would fold a post as a zero amount and misstate the balance, so a
//! fleet with holds is Tally-only.

use std::num::NonZeroU32;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::AccountId;
use super::holds::HoldId;
use crate::store::EventType;

pub const DEPOSITED: EventType = EventType { major: 1, minor: 0 };
pub const WITHDRAWN: EventType = EventType { major: 2, minor: 0 };
pub const TRANSFERRED_OUT: EventType = EventType { major: 3, minor: 0 };
pub const TRANSFERRED_IN: EventType = EventType { major: 4, minor: 0 };
pub const ACCOUNT_OPENED: EventType = EventType { major: 5, minor: 0 };
pub const HOLD_PLACED: EventType = EventType { major: 6, minor: 0 };
pub const HOLD_POSTED: EventType = EventType { major: 7, minor: 0 };
pub const HOLD_VOIDED: EventType = EventType { major: 8, minor: 0 };
pub const HOLD_EXPIRED: EventType = EventType { major: 9, minor: 0 };

/// One fact about an account. Amounts are cents. `Opened` is an opened account's first
/// event, written only at version 0.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AccountEvent {
    Deposited {
        amount: i64,
    },
    Withdrawn {
        amount: i64,
    },
    TransferredOut {
        amount: i64,
        to: AccountId,
    },
    TransferredIn {
        amount: i64,
        from: AccountId,
    },
    Opened,
    /// Reserves `amount`; the hold's id is this event's id.
    HoldPlaced {
        amount: i64,
        to: Option<AccountId>,
        expires_in_secs: Option<NonZeroU32>,
    },
    /// Resolves the hold, taking `amount` (at most what it held) out of the balance.
    HoldPosted {
        hold: HoldId,
        amount: i64,
    },
    HoldVoided {
        hold: HoldId,
    },
    HoldExpired {
        hold: HoldId,
    },
}

/// A placement's amount and expiry in one `i64`, as the recent-writes index and the Postgres
/// index rows keep them: the amount in the low 32 bits (an amount never exceeds
/// [`super::MAX_AMOUNT_CENTS`], which is `i32::MAX`), the expiry's seconds in the high 32
/// (0: none).
pub fn pack_placement(amount: i64, expires_in_secs: Option<NonZeroU32>) -> i64 {
    debug_assert!((0..=i64::from(i32::MAX)).contains(&amount));
    (amount & i64::from(u32::MAX)) | (i64::from(expires_in_secs.map_or(0, NonZeroU32::get)) << 32)
}

/// The amount and expiry [`pack_placement`] packed.
pub fn unpack_placement(packed: i64) -> (i64, Option<NonZeroU32>) {
    (
        packed & i64::from(u32::MAX),
        NonZeroU32::new((packed >> 32) as u32),
    )
}

/// How an event moves the balance.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Effect {
    Credit(i64),
    Debit(i64),
    /// It moves no money (an open, a hold's placement, void or expiry).
    None,
}

/// Why an event could not be decoded. The fold stops on it: nothing is silently skipped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("unknown event type {major}.{minor}")]
    UnknownType { major: u64, minor: u64 },
    #[error("undecodable {kind} payload: {reason}")]
    Payload { kind: &'static str, reason: String },
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct AmountPayload {
    amount_cents: i64,
}

/// The exact bytes Tally writes for an `AccountOpened`. It carries nothing; any JSON object
/// is read as it (fields a later version may add are ignored).
const OPENED_PAYLOAD: &[u8] = b"{}";

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct OutPayload {
    amount_cents: i64,
    to_account_id: Uuid,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct InPayload {
    amount_cents: i64,
    from_account_id: Uuid,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct PlacedPayload {
    amount_cents: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    to_account_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_in_secs: Option<NonZeroU32>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct PostedPayload {
    hold_id: Uuid,
    amount_cents: i64,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HoldPayload {
    hold_id: Uuid,
}

impl AccountEvent {
    /// The amount the event names: what it moves, or what a placement holds.
    pub fn amount(&self) -> i64 {
        match *self {
            AccountEvent::Deposited { amount }
            | AccountEvent::Withdrawn { amount }
            | AccountEvent::TransferredOut { amount, .. }
            | AccountEvent::TransferredIn { amount, .. }
            | AccountEvent::HoldPlaced { amount, .. }
            | AccountEvent::HoldPosted { amount, .. } => amount,
            AccountEvent::Opened
            | AccountEvent::HoldVoided { .. }
            | AccountEvent::HoldExpired { .. } => 0,
        }
    }

    /// How this event moves the balance.
    pub fn effect(&self) -> Effect {
        match *self {
            AccountEvent::Deposited { amount } | AccountEvent::TransferredIn { amount, .. } => {
                Effect::Credit(amount)
            }
            AccountEvent::Withdrawn { amount }
            | AccountEvent::TransferredOut { amount, .. }
            | AccountEvent::HoldPosted { amount, .. } => Effect::Debit(amount),
            AccountEvent::Opened
            | AccountEvent::HoldPlaced { .. }
            | AccountEvent::HoldVoided { .. }
            | AccountEvent::HoldExpired { .. } => Effect::None,
        }
    }

    /// Whether this event adds to the balance (a credit).
    pub fn is_credit(&self) -> bool {
        matches!(self.effect(), Effect::Credit(_))
    }

    /// Whether this is one of the hold events, which only a fleet with holds on writes.
    pub fn is_hold(&self) -> bool {
        matches!(
            self,
            AccountEvent::HoldPlaced { .. }
                | AccountEvent::HoldPosted { .. }
                | AccountEvent::HoldVoided { .. }
                | AccountEvent::HoldExpired { .. }
        )
    }

    /// The hold a post, void or expiry resolves.
    pub fn resolves(&self) -> Option<HoldId> {
        match *self {
            AccountEvent::HoldPosted { hold, .. }
            | AccountEvent::HoldVoided { hold }
            | AccountEvent::HoldExpired { hold } => Some(hold),
            _ => None,
        }
    }

    /// The name used on the wire of the history API.
    pub fn name(&self) -> &'static str {
        match self {
            AccountEvent::Deposited { .. } => "Deposited",
            AccountEvent::Withdrawn { .. } => "Withdrawn",
            AccountEvent::TransferredOut { .. } => "TransferredOut",
            AccountEvent::TransferredIn { .. } => "TransferredIn",
            AccountEvent::Opened => "AccountOpened",
            AccountEvent::HoldPlaced { .. } => "HoldPlaced",
            AccountEvent::HoldPosted { .. } => "HoldPosted",
            AccountEvent::HoldVoided { .. } => "HoldVoided",
            AccountEvent::HoldExpired { .. } => "HoldExpired",
        }
    }

    pub fn event_type(&self) -> EventType {
        match self {
            AccountEvent::Deposited { .. } => DEPOSITED,
            AccountEvent::Withdrawn { .. } => WITHDRAWN,
            AccountEvent::TransferredOut { .. } => TRANSFERRED_OUT,
            AccountEvent::TransferredIn { .. } => TRANSFERRED_IN,
            AccountEvent::Opened => ACCOUNT_OPENED,
            AccountEvent::HoldPlaced { .. } => HOLD_PLACED,
            AccountEvent::HoldPosted { .. } => HOLD_POSTED,
            AccountEvent::HoldVoided { .. } => HOLD_VOIDED,
            AccountEvent::HoldExpired { .. } => HOLD_EXPIRED,
        }
    }

    pub fn encode(&self) -> Bytes {
        let amount_cents = self.amount();
        let json = match *self {
            AccountEvent::Opened => return Bytes::from_static(OPENED_PAYLOAD),
            AccountEvent::Deposited { .. } | AccountEvent::Withdrawn { .. } => {
                serde_json::to_vec(&AmountPayload { amount_cents })
            }
            AccountEvent::TransferredOut { to, .. } => serde_json::to_vec(&OutPayload {
                amount_cents,
                to_account_id: to.0,
            }),
            AccountEvent::TransferredIn { from, .. } => serde_json::to_vec(&InPayload {
                amount_cents,
                from_account_id: from.0,
            }),
            AccountEvent::HoldPlaced {
                to,
                expires_in_secs,
                ..
            } => serde_json::to_vec(&PlacedPayload {
                amount_cents,
                to_account_id: to.map(|t| t.0),
                expires_in_secs,
            }),
            AccountEvent::HoldPosted { hold, .. } => serde_json::to_vec(&PostedPayload {
                hold_id: hold.0,
                amount_cents,
            }),
            AccountEvent::HoldVoided { hold } | AccountEvent::HoldExpired { hold } => {
                serde_json::to_vec(&HoldPayload { hold_id: hold.0 })
            }
        };
        // Serialising these plain structs into a Vec cannot fail.
        Bytes::from(json.unwrap_or_default())
    }

    pub fn decode(ty: EventType, payload: &[u8]) -> Result<Self, CodecError> {
        match (ty.major, ty.minor) {
            (1, 0) => Ok(AccountEvent::Deposited {
                amount: decode_amount("Deposited", payload)?,
            }),
            (2, 0) => Ok(AccountEvent::Withdrawn {
                amount: decode_amount("Withdrawn", payload)?,
            }),
            (3, 0) => {
                let p: OutPayload = parse("TransferredOut", payload)?;
                Ok(AccountEvent::TransferredOut {
                    amount: p.amount_cents,
                    to: AccountId(p.to_account_id),
                })
            }
            (4, 0) => {
                let p: InPayload = parse("TransferredIn", payload)?;
                Ok(AccountEvent::TransferredIn {
                    amount: p.amount_cents,
                    from: AccountId(p.from_account_id),
                })
            }
            (5, 0) => {
                if payload != OPENED_PAYLOAD {
                    let _: serde_json::Map<String, serde_json::Value> =
                        parse("AccountOpened", payload)?;
                }
                Ok(AccountEvent::Opened)
            }
            (6, 0) => {
                let p: PlacedPayload = parse("HoldPlaced", payload)?;
                Ok(AccountEvent::HoldPlaced {
                    amount: p.amount_cents,
                    to: p.to_account_id.map(AccountId),
                    expires_in_secs: p.expires_in_secs,
                })
            }
            (7, 0) => {
                let p: PostedPayload = parse("HoldPosted", payload)?;
                Ok(AccountEvent::HoldPosted {
                    hold: HoldId(p.hold_id),
                    amount: p.amount_cents,
                })
            }
            (8, 0) => {
                let p: HoldPayload = parse("HoldVoided", payload)?;
                Ok(AccountEvent::HoldVoided {
                    hold: HoldId(p.hold_id),
                })
            }
            (9, 0) => {
                let p: HoldPayload = parse("HoldExpired", payload)?;
                Ok(AccountEvent::HoldExpired {
                    hold: HoldId(p.hold_id),
                })
            }
            (major, minor) => Err(CodecError::UnknownType { major, minor }),
        }
    }
}

fn parse<'a, T: Deserialize<'a>>(kind: &'static str, payload: &'a [u8]) -> Result<T, CodecError> {
    serde_json::from_slice(payload).map_err(|e| CodecError::Payload {
        kind,
        reason: e.to_string(),
    })
}

/// The exact bytes every writer of these streams produces for an amount-only payload.
const AMOUNT_PREFIX: &[u8] = br#"{"AmountCents":"#;

/// Decodes `{"AmountCents":N}`. The canonical compact form, which is what Tally and the
/// existing services write, is read without a JSON parser (the fold's hot path); any other
/// spelling of the same object goes through serde.
fn decode_amount(kind: &'static str, payload: &[u8]) -> Result<i64, CodecError> {
    if let Some(n) = canonical_amount(payload) {
        return Ok(n);
    }
    parse::<AmountPayload>(kind, payload).map(|p| p.amount_cents)
}

/// `Some(N)` when `payload` is exactly `{"AmountCents":N}` with N a non-negative decimal of at
/// most 18 digits and no leading zero (so it fits an i64 and has one spelling).
fn canonical_amount(payload: &[u8]) -> Option<i64> {
    let digits = payload.strip_prefix(AMOUNT_PREFIX)?.strip_suffix(b"}")?;
    if digits.is_empty() || digits.len() > 18 || (digits.len() > 1 && digits[0] == b'0') {
        return None;
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n * 10 + i64::from(d - b'0');
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn acct(n: u128) -> AccountId {
        AccountId(Uuid::from_u128(n))
    }

    #[test]
    fn payloads_match_existing_streams_byte_for_byte() {
        assert_eq!(
            &AccountEvent::Deposited { amount: 100 }.encode()[..],
            br#"{"AmountCents":100}"#
        );
        let out = AccountEvent::TransferredOut {
            amount: 5,
            to: acct(1),
        };
        assert_eq!(
            &out.encode()[..],
            br#"{"AmountCents":5,"ToAccountId":"00000000-0000-0000-0000-000000000001"}"#
        );
        assert_eq!(out.event_type(), TRANSFERRED_OUT);
    }

    #[test]
    fn decoding_accepts_any_json_spelling_of_the_same_object() {
        let e = AccountEvent::decode(WITHDRAWN, br#"{ "AmountCents" : 42 , "Note": "x" }"#);
        assert_eq!(e, Ok(AccountEvent::Withdrawn { amount: 42 }));
        let big = AccountEvent::decode(DEPOSITED, b"{\"AmountCents\":9223372036854775807}");
        assert_eq!(big, Ok(AccountEvent::Deposited { amount: i64::MAX }));
    }

    #[test]
    fn unknown_types_and_bad_payloads_fail_loudly() {
        assert_eq!(
            AccountEvent::decode(
                EventType {
                    major: 99,
                    minor: 0
                },
                b"{}"
            ),
            Err(CodecError::UnknownType {
                major: 99,
                minor: 0
            })
        );
        assert!(AccountEvent::decode(EventType { major: 1, minor: 1 }, b"{}").is_err());
        for bad in [
            &b"{}"[..],
            b"{\"AmountCents\":\"7\"}",
            b"not json",
            b"{\"AmountCents\":01}",
        ] {
            assert!(
                matches!(
                    AccountEvent::decode(DEPOSITED, bad),
                    Err(CodecError::Payload { .. })
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// Rule: an open is written as `{}` and read from any JSON object; it moves no money.
    #[test]
    fn an_open_carries_an_empty_object_and_no_amount() {
        assert_eq!(&AccountEvent::Opened.encode()[..], b"{}");
        assert_eq!(AccountEvent::Opened.event_type(), ACCOUNT_OPENED);
        assert_eq!(AccountEvent::Opened.amount(), 0);
        for ok in [&b"{}"[..], b" { \"Note\": 1 } "] {
            assert_eq!(
                AccountEvent::decode(ACCOUNT_OPENED, ok),
                Ok(AccountEvent::Opened)
            );
        }
        for bad in [&b"[]"[..], b"", b"null", b"{"] {
            assert!(
                matches!(
                    AccountEvent::decode(ACCOUNT_OPENED, bad),
                    Err(CodecError::Payload { .. })
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// Rule: hold events are written in the streams' own style (PascalCase JSON), and only a
    /// post moves money.
    #[test]
    fn hold_events_carry_their_hold_and_only_a_post_moves_money() {
        let hold = HoldId(Uuid::from_u128(3));
        let placed = AccountEvent::HoldPlaced {
            amount: 7,
            to: Some(acct(1)),
            expires_in_secs: NonZeroU32::new(60),
        };
        assert_eq!(
            &placed.encode()[..],
            br#"{"AmountCents":7,"ToAccountId":"00000000-0000-0000-0000-000000000001","ExpiresInSecs":60}"#
        );
        let bare = AccountEvent::HoldPlaced {
            amount: 7,
            to: None,
            expires_in_secs: None,
        };
        assert_eq!(&bare.encode()[..], br#"{"AmountCents":7}"#);
        let posted = AccountEvent::HoldPosted { hold, amount: 5 };
        assert_eq!(
            &posted.encode()[..],
            br#"{"HoldId":"00000000-0000-0000-0000-000000000003","AmountCents":5}"#
        );
        assert_eq!(posted.effect(), Effect::Debit(5));
        assert_eq!(placed.effect(), Effect::None);
        assert_eq!(AccountEvent::HoldVoided { hold }.effect(), Effect::None);
        assert_eq!(AccountEvent::HoldExpired { hold }.resolves(), Some(hold));
        assert!(placed.is_hold() && !AccountEvent::Opened.is_hold());
        assert!(AccountEvent::decode(HOLD_VOIDED, b"{}").is_err());
    }

    proptest! {
        #[test]
        fn a_packed_placement_unpacks_to_itself(amount in 0i64..=i64::from(i32::MAX), secs in 0u32..) {
            let secs = NonZeroU32::new(secs);
            prop_assert_eq!(unpack_placement(pack_placement(amount, secs)), (amount, secs));
        }

        #[test]
        fn every_event_round_trips(amount in 0i64..=i64::MAX, other in any::<u128>(), kind in 0u8..11, secs in 0u32..) {
            let hold = HoldId(Uuid::from_u128(other));
            let e = match kind {
                0 => AccountEvent::Deposited { amount },
                1 => AccountEvent::Withdrawn { amount },
                2 => AccountEvent::TransferredOut { amount, to: acct(other) },
                3 => AccountEvent::TransferredIn { amount, from: acct(other) },
                4 => AccountEvent::HoldPlaced { amount, to: None, expires_in_secs: None },
                5 => AccountEvent::HoldPlaced { amount, to: Some(acct(other)), expires_in_secs: NonZeroU32::new(secs) },
                6 => AccountEvent::HoldPosted { hold, amount },
                7 => AccountEvent::HoldVoided { hold },
                8 => AccountEvent::HoldExpired { hold },
                _ => AccountEvent::Opened,
            };
            prop_assert_eq!(AccountEvent::decode(e.event_type(), &e.encode()), Ok(e));
        }

        #[test]
        fn the_fast_path_agrees_with_serde(payload in proptest::collection::vec(any::<u8>(), 0..24), n in any::<i64>()) {
            let canonical = format!("{{\"AmountCents\":{n}}}");
            for p in [payload.as_slice(), canonical.as_bytes()] {
                let serde = serde_json::from_slice::<AmountPayload>(p).ok().map(|a| a.amount_cents);
                if let Some(fast) = canonical_amount(p) {
                    prop_assert_eq!(Some(fast), serde);
                }
            }
        }
    }
}
