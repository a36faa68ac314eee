//! The business rules: what an operation writes, and whether fresh state allows it.

use super::{AccountEvent, AccountId, AmountCents, fold};

/// A write a caller asked for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Operation {
    Deposit {
        account: AccountId,
        amount: AmountCents,
    },
    Withdraw {
        account: AccountId,
        amount: AmountCents,
    },
    Transfer {
        from: AccountId,
        to: AccountId,
        amount: AmountCents,
    },
}

/// A business rule said no. Nothing was written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("{0}")]
    Validation(String),
    #[error("insufficient funds: balance {balance} cents")]
    InsufficientFunds { balance: i64 },
    #[error("the balance would overflow")]
    Overflow,
}

/// One account's part of an operation: the event it appends there.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Leg {
    pub account: AccountId,
    pub event: AccountEvent,
}

impl Operation {
    /// A transfer between two different accounts.
    pub fn transfer(
        from: AccountId,
        to: AccountId,
        amount: AmountCents,
    ) -> Result<Self, RuleError> {
        if from == to {
            return Err(RuleError::Validation(
                "a transfer needs two different accounts".into(),
            ));
        }
        Ok(Operation::Transfer { from, to, amount })
    }

    /// The operation's name, as used in metrics labels and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Operation::Deposit { .. } => "deposit",
            Operation::Withdraw { .. } => "withdraw",
            Operation::Transfer { .. } => "transfer",
        }
    }

    /// The events this operation appends, one per account. They depend only on the
    /// operation, never on state, so a retry always writes the same payload.
    pub fn legs(&self) -> Legs {
        match *self {
            Operation::Deposit { account, amount } => Legs::one(Leg {
                account,
                event: AccountEvent::Deposited {
                    amount: amount.get(),
                },
            }),
            Operation::Withdraw { account, amount } => Legs::one(Leg {
                account,
                event: AccountEvent::Withdrawn {
                    amount: amount.get(),
                },
            }),
            Operation::Transfer { from, to, amount } => Legs {
                legs: [
                    Leg {
                        account: from,
                        event: AccountEvent::TransferredOut {
                            amount: amount.get(),
                            to,
                        },
                    },
                    Leg {
                        account: to,
                        event: AccountEvent::TransferredIn {
                            amount: amount.get(),
                            from,
                        },
                    },
                ],
                len: 2,
            },
        }
    }
}

/// Decides one leg on fresh state: the balance after it, or the rule it breaks. A debit may
/// never take a balance below zero.
pub fn decide_leg(balance: i64, event: &AccountEvent) -> Result<i64, RuleError> {
    let next = fold::apply(balance, event).map_err(|_| RuleError::Overflow)?;
    if !event.is_credit() && next < 0 {
        return Err(RuleError::InsufficientFunds { balance });
    }
    Ok(next)
}

/// The one or two legs of an operation, without allocating.
#[derive(Clone, Copy, Debug)]
pub struct Legs {
    legs: [Leg; 2],
    len: usize,
}

impl Legs {
    fn one(leg: Leg) -> Self {
        Self {
            legs: [leg, leg],
            len: 1,
        }
    }

    pub fn as_slice(&self) -> &[Leg] {
        &self.legs[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn acct(n: u128) -> AccountId {
        AccountId(Uuid::from_u128(n))
    }

    #[test]
    fn a_transfer_to_the_same_account_is_rejected() {
        let amount = AmountCents::new(1).unwrap();
        assert!(matches!(
            Operation::transfer(acct(1), acct(1), amount),
            Err(RuleError::Validation(_))
        ));
        let op = Operation::transfer(acct(1), acct(2), amount).unwrap();
        let legs = op.legs();
        assert_eq!(legs.as_slice().len(), 2);
        assert_eq!(legs.as_slice()[0].account, acct(1));
        assert!(!legs.as_slice()[0].event.is_credit());
        assert!(legs.as_slice()[1].event.is_credit());
    }

    #[test]
    fn a_debit_never_takes_the_balance_below_zero() {
        let w = AccountEvent::Withdrawn { amount: 100 };
        assert_eq!(decide_leg(100, &w), Ok(0));
        assert_eq!(
            decide_leg(99, &w),
            Err(RuleError::InsufficientFunds { balance: 99 })
        );
        let d = AccountEvent::Deposited { amount: 1 };
        assert_eq!(decide_leg(i64::MAX, &d), Err(RuleError::Overflow));
    }
}
