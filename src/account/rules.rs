//! The business rules: what an operation writes, and whether fresh state allows it.

use std::num::NonZeroU32;

use super::holds::{HoldId, HoldStatus, MAX_OPEN_HOLDS_PER_ACCOUNT, Resolution};
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
    Open {
        account: AccountId,
    },
    /// Reserves `amount` on the account (`--holds true`); the hold's id is the request's
    /// event id.
    PlaceHold {
        account: AccountId,
        /// The request's event id: what names the hold.
        hold: HoldId,
        amount: AmountCents,
        to: Option<AccountId>,
        expires_in_secs: Option<NonZeroU32>,
    },
    /// Posts `amount` of an open hold; `to` is the hold's own destination (fixed when it
    /// was placed), so a post with one is a transfer's two legs in one write.
    PostHold {
        account: AccountId,
        hold: HoldId,
        amount: AmountCents,
        to: Option<AccountId>,
    },
    VoidHold {
        account: AccountId,
        hold: HoldId,
    },
    /// Written once a hold is past its expiry in the store's time.
    ExpireHold {
        account: AccountId,
        hold: HoldId,
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
    /// Accounts are explicit and this one was never opened (its stream does not exist).
    #[error("account {account} was never opened; open it with POST /api/accounts")]
    AccountNotFound { account: AccountId },
    /// An open of an account that already exists (opened, or written before).
    #[error("account {account} is already open")]
    AccountExists { account: AccountId },
    /// A debit or a hold would take more than the balance less the open holds.
    #[error("insufficient funds: {available} cents available ({held} cents held)")]
    InsufficientAvailable { available: i64, held: i64 },
    #[error("no open hold {hold} on this account")]
    HoldNotFound { hold: HoldId },
    #[error("hold {hold} is already {}", how.name())]
    HoldResolved { hold: HoldId, how: Resolution },
    #[error("hold {hold} holds {held} cents; a post takes at most that")]
    HoldExceeded { hold: HoldId, held: i64 },
    #[error("the account has {MAX_OPEN_HOLDS_PER_ACCOUNT} open holds, the most it may carry")]
    HoldLimit,
}

/// What the rules know of one account: its balance, whether its stream exists (any event
/// at all: an open, or a write made while accounts were implicit), and its open holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    pub balance: i64,
    pub exists: bool,
    /// The sum of the open holds.
    pub held: i64,
    pub open_holds: usize,
}

impl Standing {
    /// The balance less the open holds: what a debit or a new hold may take.
    pub fn available(&self) -> i64 {
        self.balance.saturating_sub(self.held)
    }
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
            Operation::PlaceHold { .. } => "hold",
            Operation::PostHold { .. } => "post_hold",
            Operation::VoidHold { .. } => "void_hold",
            Operation::ExpireHold { .. } => "expire_hold",
        }
    }

    /// The account an operation is about (a transfer's or a post's source).
    pub fn account(&self) -> AccountId {
        match *self {
            Operation::Deposit { account, .. }
            | Operation::Withdraw { account, .. }
            | Operation::Open { account }
            | Operation::PlaceHold { account, .. }
            | Operation::PostHold { account, .. }
            | Operation::VoidHold { account, .. }
            | Operation::ExpireHold { account, .. } => account,
            Operation::Transfer { from, .. } => from,
        }
    }

    /// The one account of a write that queues in that account's lane and is written in a
    /// batch with the others queued there: deposits, withdrawals, and the hold operations on
    /// one account (a post to a destination writes two, as a transfer does). `None` for the
    /// others, which run alone: transfers, and opens (written at version 0 only).
    pub fn lane_account(&self) -> Option<AccountId> {
        match *self {
            Operation::Deposit { account, .. }
            | Operation::Withdraw { account, .. }
            | Operation::PlaceHold { account, .. }
            | Operation::PostHold {
                account, to: None, ..
            }
            | Operation::VoidHold { account, .. }
            | Operation::ExpireHold { account, .. } => Some(account),
            Operation::PostHold { to: Some(_), .. }
            | Operation::Transfer { .. }
            | Operation::Open { .. } => None,
        }
    }

    /// Whether it is one of the hold operations (`--holds true` only).
    pub fn is_hold(&self) -> bool {
        matches!(
            self,
            Operation::PlaceHold { .. }
                | Operation::PostHold { .. }
                | Operation::VoidHold { .. }
                | Operation::ExpireHold { .. }
        )
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
            Operation::PlaceHold {
                account,
                amount,
                to,
                expires_in_secs,
                ..
            } => Legs::one(Leg {
                account,
                event: AccountEvent::HoldPlaced {
                    amount: amount.get(),
                    to,
                    expires_in_secs,
                },
            }),
            Operation::PostHold {
                account,
                hold,
                amount,
                to,
            } => {
                let posted = Leg {
                    account,
                    event: AccountEvent::HoldPosted {
                        hold,
                        amount: amount.get(),
                    },
                };
                match to {
                    None => Legs::one(posted),
                    Some(to) => Legs {
                        legs: [
                            posted,
                            Leg {
                                account: to,
                                event: AccountEvent::TransferredIn {
                                    amount: amount.get(),
                                    from: account,
                                },
                            },
                        ],
                        len: 2,
                    },
                }
            }
            Operation::VoidHold { account, hold } => Legs::one(Leg {
                account,
                event: AccountEvent::HoldVoided { hold },
            }),
            Operation::ExpireHold { account, hold } => Legs::one(Leg {
                account,
                event: AccountEvent::HoldExpired { hold },
            }),
        }
    }
}

/// Decides one leg on fresh state: the account after it, or the rule it breaks. An open
/// needs an account that does not exist; with explicit accounts every other leg needs one
/// that does. A debit may never take a balance below zero, nor below what the open holds
/// keep; a hold may never reserve more than is available. `hold` is what the state shows
/// of the hold a post, void or expiry resolves (`None` for any other leg).
pub fn decide_leg(
    before: Standing,
    leg: &Leg,
    mode: AccountsMode,
    hold: Option<HoldStatus>,
) -> Result<Standing, RuleError> {
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
    let mut after = Standing {
        balance: next,
        exists: true,
        ..before
    };
    match leg.event {
        AccountEvent::HoldPlaced { amount, .. } => {
            if before.open_holds >= MAX_OPEN_HOLDS_PER_ACCOUNT {
                return Err(RuleError::HoldLimit);
            }
            if before.available() < amount {
                return Err(refusal_of(before));
            }
            after.held = before.held.checked_add(amount).ok_or(RuleError::Overflow)?;
            after.open_holds += 1;
        }
        AccountEvent::HoldPosted { hold: id, amount } => {
            let open = open_hold(id, hold)?;
            if amount > open.amount {
                return Err(RuleError::HoldExceeded {
                    hold: id,
                    held: open.amount,
                });
            }
            after.held -= open.amount;
            after.open_holds -= 1;
            if next < 0 {
                return Err(refusal_of(before));
            }
        }
        AccountEvent::HoldVoided { hold: id } | AccountEvent::HoldExpired { hold: id } => {
            let open = open_hold(id, hold)?;
            after.held -= open.amount;
            after.open_holds -= 1;
        }
        AccountEvent::Withdrawn { .. } | AccountEvent::TransferredOut { .. } => {
            if next < before.held.max(0) {
                return Err(refusal_of(before));
            }
        }
        AccountEvent::Deposited { .. }
        | AccountEvent::TransferredIn { .. }
        | AccountEvent::Opened => {}
    }
    Ok(after)
}

/// The refusal of a debit or a hold the account cannot cover: in the words it always had
/// when nothing is held.
fn refusal_of(before: Standing) -> RuleError {
    if before.held == 0 {
        RuleError::InsufficientFunds {
            balance: before.balance,
        }
    } else {
        RuleError::InsufficientAvailable {
            available: before.available(),
            held: before.held,
        }
    }
}

/// The open hold a post, void or expiry resolves, or why there is none.
fn open_hold(
    id: HoldId,
    status: Option<HoldStatus>,
) -> Result<crate::account::holds::OpenHold, RuleError> {
    match status {
        Some(HoldStatus::Open(open)) => Ok(open),
        Some(HoldStatus::Resolved(how)) => Err(RuleError::HoldResolved { hold: id, how }),
        Some(HoldStatus::Unknown) | None => Err(RuleError::HoldNotFound { hold: id }),
    }
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
            ..Standing::default()
        }
    }

    #[test]
    fn a_debit_never_takes_the_balance_below_zero() {
        let w = on(AccountEvent::Withdrawn { amount: 100 });
        let implicit = AccountsMode::Implicit;
        assert_eq!(
            decide_leg(open_with(100), &w, implicit, None),
            Ok(open_with(0))
        );
        assert_eq!(
            decide_leg(open_with(99), &w, implicit, None),
            Err(RuleError::InsufficientFunds { balance: 99 })
        );
        let d = on(AccountEvent::Deposited { amount: 1 });
        assert_eq!(
            decide_leg(open_with(i64::MAX), &d, implicit, None),
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
            decide_leg(missing, &deposit, AccountsMode::Explicit, None),
            not_found
        );
        assert_eq!(
            decide_leg(missing, &deposit, AccountsMode::Implicit, None),
            Ok(open_with(5))
        );
        for mode in [AccountsMode::Explicit, AccountsMode::Implicit] {
            assert_eq!(decide_leg(missing, &open, mode, None), Ok(open_with(0)));
            assert_eq!(
                decide_leg(open_with(0), &open, mode, None),
                Err(RuleError::AccountExists { account: acct(1) })
            );
        }
        assert_eq!(
            decide_leg(open_with(0), &deposit, AccountsMode::Explicit, None),
            Ok(open_with(5))
        );
    }

    fn held(balance: i64, held: i64, open_holds: usize) -> Standing {
        Standing {
            balance,
            exists: true,
            held,
            open_holds,
        }
    }

    /// Rule: open holds keep their money: a debit or a new hold takes at most the balance
    /// less what is held, and the refusal names both.
    #[test]
    fn a_debit_or_a_hold_takes_only_what_is_available() {
        let mode = AccountsMode::Implicit;
        let w = on(AccountEvent::Withdrawn { amount: 30 });
        assert_eq!(
            decide_leg(held(100, 70, 1), &w, mode, None),
            Ok(held(70, 70, 1))
        );
        let w31 = on(AccountEvent::Withdrawn { amount: 31 });
        assert_eq!(
            decide_leg(held(100, 70, 1), &w31, mode, None),
            Err(RuleError::InsufficientAvailable {
                available: 30,
                held: 70
            })
        );
        let place = |amount| {
            on(AccountEvent::HoldPlaced {
                amount,
                to: None,
                expires_in_secs: None,
            })
        };
        assert_eq!(
            decide_leg(held(100, 70, 1), &place(30), mode, None),
            Ok(held(100, 100, 2))
        );
        assert!(matches!(
            decide_leg(held(100, 70, 1), &place(31), mode, None),
            Err(RuleError::InsufficientAvailable { .. })
        ));
        assert_eq!(
            decide_leg(
                held(100, 0, MAX_OPEN_HOLDS_PER_ACCOUNT),
                &place(1),
                mode,
                None
            ),
            Err(RuleError::HoldLimit)
        );
    }

    /// Rule: a post, void or expiry needs the hold open; a post takes at most what it holds
    /// and releases the whole hold.
    #[test]
    fn a_hold_resolves_only_while_open() {
        use crate::account::holds::OpenHold;
        let mode = AccountsMode::Implicit;
        let id = HoldId(Uuid::from_u128(9));
        let open = Some(HoldStatus::Open(OpenHold {
            amount: 40,
            to: None,
            expires_in_secs: None,
            placed_version: 1,
            placed: crate::account::holds::Commit::Known(0),
        }));
        let post = |amount| on(AccountEvent::HoldPosted { hold: id, amount });
        assert_eq!(
            decide_leg(held(100, 50, 2), &post(25), mode, open),
            Ok(held(75, 10, 1))
        );
        assert_eq!(
            decide_leg(held(100, 50, 2), &post(41), mode, open),
            Err(RuleError::HoldExceeded { hold: id, held: 40 })
        );
        let void = on(AccountEvent::HoldVoided { hold: id });
        assert_eq!(
            decide_leg(held(100, 50, 2), &void, mode, open),
            Ok(held(100, 10, 1))
        );
        let resolved = Some(HoldStatus::Resolved(Resolution::Expired));
        assert_eq!(
            decide_leg(held(100, 10, 1), &void, mode, resolved),
            Err(RuleError::HoldResolved {
                hold: id,
                how: Resolution::Expired
            })
        );
        assert_eq!(
            decide_leg(held(100, 10, 1), &post(1), mode, Some(HoldStatus::Unknown)),
            Err(RuleError::HoldNotFound { hold: id })
        );
    }
}
