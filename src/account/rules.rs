//! The business rules: what an operation writes, and whether fresh state allows it.

use super::{AccountEvent, AccountId, AccountsMode, AmountCents, fold};

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
    /// Opens the account: its stream's first event.
    Open { account: AccountId },
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
    /// Accounts are explicit and this one was never opened (its stream does not exist).
    #[error("account {account} was never opened; open it with POST /api/accounts")]
    AccountNotFound { account: AccountId },
    /// An open of an account that already exists (opened, or written before).
    #[error("account {account} is already open")]
    AccountExists { account: AccountId },
}

/// What the rules know of one account: its balance, and whether its stream exists (any
/// event at all: an open, or a write made while accounts were implicit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    pub balance: i64,
    pub exists: bool,
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
            Operation::Open { .. } => "open",
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
            Operation::Open { account } => Legs::one(Leg {
                account,
                event: AccountEvent::Opened,
            }),
        }
    }
}

/// Decides one leg on fresh state: the account after it, or the rule it breaks. An open
/// needs an account that does not exist; with explicit accounts every other leg needs one
/// that does. A debit may never take a balance below zero.
pub fn decide_leg(before: Standing, leg: &Leg, mode: AccountsMode) -> Result<Standing, RuleError> {
    let account = leg.account;
    match leg.event {
        AccountEvent::Opened if before.exists => return Err(RuleError::AccountExists { account }),
        AccountEvent::Opened => {}
        _ if mode == AccountsMode::Explicit && !before.exists => {
            return Err(RuleError::AccountNotFound { account });
        }
        _ => {}
    }
    let balance = before.balance;
    let next = fold::apply(balance, &leg.event).map_err(|_| RuleError::Overflow)?;
    if !leg.event.is_credit() && next < 0 {
        return Err(RuleError::InsufficientFunds { balance });
    }
    Ok(Standing {
        balance: next,
        exists: true,
    })
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

    fn on(event: AccountEvent) -> Leg {
        Leg {
            account: acct(1),
            event,
        }
    }

    fn open_with(balance: i64) -> Standing {
        Standing {
            balance,
            exists: true,
        }
    }

    #[test]
    fn a_debit_never_takes_the_balance_below_zero() {
        let w = on(AccountEvent::Withdrawn { amount: 100 });
        let implicit = AccountsMode::Implicit;
        assert_eq!(decide_leg(open_with(100), &w, implicit), Ok(open_with(0)));
        assert_eq!(
            decide_leg(open_with(99), &w, implicit),
            Err(RuleError::InsufficientFunds { balance: 99 })
        );
        let d = on(AccountEvent::Deposited { amount: 1 });
        assert_eq!(
            decide_leg(open_with(i64::MAX), &d, implicit),
            Err(RuleError::Overflow)
        );
    }

    /// Rule: with explicit accounts only an existing account takes a write; an open needs an
    /// account that does not exist, in either mode. With implicit accounts any write creates.
    #[test]
    fn explicit_accounts_refuse_writes_to_an_account_never_opened() {
        let missing = Standing::default();
        let deposit = on(AccountEvent::Deposited { amount: 5 });
        let open = on(AccountEvent::Opened);
        let not_found = Err(RuleError::AccountNotFound { account: acct(1) });
        assert_eq!(
            decide_leg(missing, &deposit, AccountsMode::Explicit),
            not_found
        );
        assert_eq!(
            decide_leg(missing, &deposit, AccountsMode::Implicit),
            Ok(open_with(5))
        );
        for mode in [AccountsMode::Explicit, AccountsMode::Implicit] {
            assert_eq!(decide_leg(missing, &open, mode), Ok(open_with(0)));
            assert_eq!(
                decide_leg(open_with(0), &open, mode),
                Err(RuleError::AccountExists { account: acct(1) })
            );
        }
        assert_eq!(
            decide_leg(open_with(0), &deposit, AccountsMode::Explicit),
            Ok(open_with(5))
        );
    }
}
