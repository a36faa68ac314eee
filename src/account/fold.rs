//! The fold: how one event changes an account's balance.

use super::AccountEvent;
use super::events::Effect;

/// Why the fold cannot apply an event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FoldError {
    #[error("balance arithmetic overflows applying {event} of {amount} to {balance}")]
    Overflow {
        event: &'static str,
        amount: i64,
        balance: i64,
    },
}

/// The balance after `event`, with checked arithmetic: a stream whose sums overflow is
/// reported, never wrapped.
#[inline]
pub fn apply(balance: i64, event: &AccountEvent) -> Result<i64, FoldError> {
    let (next, amount) = match event.effect() {
        Effect::Credit(amount) => (balance.checked_add(amount), amount),
        Effect::Debit(amount) => (balance.checked_sub(amount), amount),
        Effect::None => return Ok(balance),
    };
    next.ok_or(FoldError::Overflow {
        event: event.name(),
        amount,
        balance,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::account::AccountId;
    use uuid::Uuid;

    #[test]
    fn credits_add_and_debits_subtract() {
        let other = AccountId(Uuid::nil());
        assert_eq!(apply(10, &AccountEvent::Deposited { amount: 5 }), Ok(15));
        assert_eq!(apply(10, &AccountEvent::Withdrawn { amount: 15 }), Ok(-5));
        assert_eq!(
            apply(
                10,
                &AccountEvent::TransferredOut {
                    amount: 3,
                    to: other
                }
            ),
            Ok(7)
        );
        assert_eq!(
            apply(
                10,
                &AccountEvent::TransferredIn {
                    amount: 3,
                    from: other
                }
            ),
            Ok(13)
        );
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(apply(i64::MAX, &AccountEvent::Deposited { amount: 1 }).is_err());
        assert!(apply(i64::MIN, &AccountEvent::Withdrawn { amount: 1 }).is_err());
        assert!(apply(0, &AccountEvent::Withdrawn { amount: i64::MIN }).is_err());
    }
}
