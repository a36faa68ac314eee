//! A write found by its key, without resending it: what a caller asks after it lost the
//! answer (a crash, a timeout) and wants to know whether the write landed before it decides
//! anything.
//!
//! The rule: found is proven (an index entry, or a remembered key confirmed against its batch,
//! is only ever made for an event the store holds); not found is proven only on a fold that
//! reached the leader's tip with nothing under the key running here. Anything short of
//! that is a retryable error, never "not landed": a lagging read or a write still under
//! way would make that answer wrong, and a caller told "not landed" writes again.

use super::error::{WriteError, invariant};
use super::service::WriteService;
use super::{LegResult, WriteOutcome};
use uuid::Uuid;

use crate::account::holds::HoldId;
use crate::account::{AccountEvent, AccountId, AmountCents, Operation};
use crate::projection::{RecentWrite, Snapshot};

/// What a lookup proved about a key on an account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// A write under the key landed on the account within the retention: the operation it
    /// was, and its outcome leg by leg, as the write answered it.
    Landed {
        op: Operation,
        outcome: WriteOutcome,
    },
    /// No write under the key is remembered on the account, on a fold at the store's tip,
    /// with none running here: a write sent under the key now would be a new write.
    NotLanded,
}

/// One account's part of a lookup: its entry for the key, and the state it was caught up to.
struct LegSearch {
    hit: Option<RecentWrite>,
    snap: Snapshot,
}

impl WriteService {
    /// Looks `event_id` up on `account`: caught up first (a landing this replica has not
    /// folded yet is found too), then the window's index, then the key memory past the
    /// window. A transfer found on either account is answered with both legs.
    pub async fn find_write(
        &self,
        account: AccountId,
        event_id: u128,
    ) -> Result<Found, WriteError> {
        let here = self.search(account, event_id).await?;
        let Some(hit) = here.hit else {
            return self.proven_absent(account, event_id, here.snap).await;
        };
        let found = |op: Operation, legs: Vec<LegResult>| {
            Ok(Found::Landed {
                op,
                outcome: WriteOutcome {
                    legs,
                    replayed: true,
                },
            })
        };
        let leg = |h: &RecentWrite| LegResult {
            account,
            balance: h.balance,
            version: h.version,
        };
        match hit.event {
            AccountEvent::Deposited { amount } => found(
                Operation::Deposit {
                    account,
                    amount: amount_of(amount)?,
                },
                vec![leg(&hit)],
            ),
            AccountEvent::Withdrawn { amount } => found(
                Operation::Withdraw {
                    account,
                    amount: amount_of(amount)?,
                },
                vec![leg(&hit)],
            ),
            AccountEvent::Opened => found(Operation::Open { account }, vec![leg(&hit)]),
            AccountEvent::TransferredOut { amount, to } => {
                let op = Operation::Transfer {
                    from: account,
                    to,
                    amount: amount_of(amount)?,
                };
                let other = self.other_leg(&op, to, event_id).await?;
                found(op, vec![leg(&hit), other])
            }
            AccountEvent::TransferredIn { amount, from } => {
                let op = Operation::Transfer {
                    from,
                    to: account,
                    amount: amount_of(amount)?,
                };
                let other = self.other_leg(&op, from, event_id).await?;
                found(op, vec![other, leg(&hit)])
            }
            AccountEvent::HoldPlaced {
                amount,
                to,
                expires_in_secs,
            } => found(
                Operation::PlaceHold {
                    account,
                    hold: HoldId(Uuid::from_u128(event_id)),
                    amount: amount_of(amount)?,
                    to,
                    expires_in_secs,
                },
                vec![leg(&hit)],
            ),
            // A post is answered with the held account's leg, as its write route answers it.
            AccountEvent::HoldPosted { hold, amount } => found(
                Operation::PostHold {
                    account,
                    hold,
                    amount: amount_of(amount)?,
                    to: None,
                },
                vec![leg(&hit)],
            ),
            AccountEvent::HoldVoided { hold } => {
                found(Operation::VoidHold { account, hold }, vec![leg(&hit)])
            }
            AccountEvent::HoldExpired { hold } => {
                found(Operation::ExpireHold { account, hold }, vec![leg(&hit)])
            }
        }
    }

    /// Catches `account` up and looks the key up in its window, then in its key memory.
    async fn search(&self, account: AccountId, event_id: u128) -> Result<LegSearch, WriteError> {
        let projection = self.projection();
        let loaded = projection.refresh(account, &[event_id]).await?;
        let hit = match projection.lookup(&loaded.view, event_id) {
            Some(hit) => Some(hit),
            None => projection
                .remembered(account, &loaded.view, event_id)
                .await
                .map_err(WriteError::Store)?,
        };
        Ok(LegSearch {
            hit,
            snap: loaded.snap,
        })
    }

    /// The other account's leg of a transfer found on one of its accounts. Its own entry when
    /// it still has one for this transfer. Else it is rebuilt from the account's state, as
    /// the write loop's read-back rebuilds a leg whose entry is gone (`run/readback.rs`,
    /// `rebuildable`): only on a fold at the leader's tip, which holds the transfer, since
    /// the store took both legs in one write. So a lookup answers what a retry of the
    /// transfer would. Short of the tip the answer is a retryable error.
    async fn other_leg(
        &self,
        op: &Operation,
        other: AccountId,
        event_id: u128,
    ) -> Result<LegResult, WriteError> {
        let expected = op
            .legs()
            .as_slice()
            .iter()
            .find(|l| l.account == other)
            .map(|l| l.event);
        let there = self.search(other, event_id).await?;
        let (balance, version) = match there.hit {
            Some(h) if Some(h.event) == expected => (h.balance, h.version),
            // No entry for this transfer (its key forgotten there, or the key reused there
            // for another write once forgotten): the state, once it is the tip's.
            _ => {
                let tip = self.projection().store_version(other).await;
                match tip {
                    Ok(tip) if there.snap.version >= tip => {
                        (there.snap.balance, there.snap.version)
                    }
                    Ok(tip) => return Err(behind(other, there.snap.version, tip)),
                    Err(e) => return Err(WriteError::Store(e)),
                }
            }
        };
        Ok(LegResult {
            account: other,
            balance,
            version,
        })
    }

    /// A key not found on `account`: [`Found::NotLanded`] once the fold it was looked for in
    /// is at the leader's tip and nothing under the key is running here; a retryable error
    /// otherwise. The running check comes last, so a write that starts after the fold was
    /// read is still seen as running.
    async fn proven_absent(
        &self,
        account: AccountId,
        event_id: u128,
        snap: Snapshot,
    ) -> Result<Found, WriteError> {
        // The leader's tip: a follower that lags would vouch for a fold behind a landing.
        let tip = self
            .projection()
            .store_version(account)
            .await
            .map_err(WriteError::Store)?;
        if snap.version < tip {
            return Err(behind(account, snap.version, tip));
        }
        if self.coalescer.writing(event_id, account) {
            return Err(WriteError::Unverifiable {
                reason: "a write under this key is still running on this replica".into(),
            });
        }
        Ok(Found::NotLanded)
    }
}

/// The retryable answer of a fold that has not reached the store's tip.
fn behind(account: AccountId, folded: u64, tip: u64) -> WriteError {
    WriteError::Unverifiable {
        reason: format!(
            "this replica's read of account {account} reached version {folded}, short of the store's {tip}"
        ),
    }
}

/// A landed event's amount. Every write Tally makes under a key carries a valid amount (its
/// request was refused otherwise), so another is a broken invariant, never an answer.
fn amount_of(cents: i64) -> Result<AmountCents, WriteError> {
    AmountCents::new(cents)
        .map_err(|_| invariant("a keyed event in the stream carries an amount no write may"))
}
