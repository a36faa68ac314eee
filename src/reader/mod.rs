//! The read side: an account's balance and its history, as typed values with one typed
//! error. It knows nothing about HTTP; `http::accounts` parses a request, calls it and maps
//! the answer (and `http::error` maps [`ReadError`]).
//!
//! A balance comes from the fold ([`Projection`]); a history page comes from the store's
//! stream itself, so a stream the fold cannot derive (trimmed, poisoned) still has a
//! readable history, just no balance.
//!
//! Files: this one (the [`AccountReader`] and what both reads share), `balance` (the balance
//! read, with read-your-writes), `history` (a page of history), `error` ([`ReadError`]) and
//! `tests`.

mod balance;
mod error;
mod history;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use crate::account::{AccountId, AccountsMode};
use crate::projection::Projection;

pub use balance::Balance;
pub use error::ReadError;
pub use history::{DEFAULT_HISTORY_LIMIT, HistoryEntry, HistoryPage, MAX_HISTORY_LIMIT, Writer};

/// Answers balance and history reads from this replica's fold and the store.
pub struct AccountReader {
    projection: Arc<Projection>,
    accounts: AccountsMode,
}

impl AccountReader {
    /// A reader for implicit accounts: an account with no event reads as empty.
    pub fn new(projection: Arc<Projection>) -> Self {
        Self {
            projection,
            accounts: AccountsMode::Implicit,
        }
    }

    /// With explicit accounts an account with no event is [`ReadError::AccountNotFound`].
    pub fn with_accounts(mut self, accounts: AccountsMode) -> Self {
        self.accounts = accounts;
        self
    }

    /// An account whose reads showed no event at all (`version` 0) is asked about once more,
    /// by the store's details: one that does not exist is answered as such (balance 0 at
    /// version 0, or [`ReadError::AccountNotFound`] with explicit accounts); one the store
    /// says exists is a read that hides its events, and retryable. Costs a round trip only
    /// for accounts that look new.
    async fn confirm_empty(&self, account: AccountId, version: u64) -> Result<(), ReadError> {
        if version > 0 {
            return Ok(());
        }
        match self.projection.store_version(account).await? {
            0 if self.accounts == AccountsMode::Explicit => {
                Err(ReadError::AccountNotFound { account })
            }
            0 => Ok(()),
            version => Err(ReadError::StoreHidesEvents { version }),
        }
    }
}
