//! Holds past their expiry, expired through the write loop: by the write that next touches
//! the account on this replica, and by the sweeper for accounts nobody writes.
//!
//! An expiry is a write like any other, under a key derived from the hold
//! ([`expiry_event_id`]): replicas that race to expire one hold write one event, and the
//! loser's read-back finds it. A hold is expired only once the replica's estimate of the
//! store's clock, which never runs ahead of it, is past the hold's expiry in server time.

use uuid::Uuid;

use super::service::WriteService;
use super::{WriteError, WriteRequest};
use crate::account::holds::HoldId;
use crate::account::{AccountId, Operation, RuleError};

/// The most holds one touch or one sweep of an account expires: a write waits for these
/// first, so they are few; the sweeper takes the rest.
pub const MAX_EXPIRIES_PER_TOUCH: usize = 16;

/// The namespace an expiry's event id is derived in from its hold's id. Never change it: a
/// replica across the change would write a second expiry's key (the fold would refuse it as
/// a resolution of a resolved hold, but only after it landed).
const EXPIRY_NAMESPACE: Uuid = Uuid::from_u128(0x686f_6c64_2d65_7870_6972_7920_6b65_7973);

/// The event id of the expiry of `hold`: the same on every replica.
pub fn expiry_event_id(hold: HoldId) -> u128 {
    Uuid::new_v5(&EXPIRY_NAMESPACE, hold.0.as_bytes()).as_u128()
}

impl WriteService {
    /// Expires the account's holds that are due now, at most [`MAX_EXPIRIES_PER_TOUCH`]:
    /// catches the account up, proves each due in server time, and writes each expiry.
    /// Returns how many landed here. A hold another write resolved first is no failure.
    pub async fn expire_due(&self, account: AccountId) -> Result<usize, WriteError> {
        let projection = self.projection();
        let loaded = projection.refresh(account, &[]).await?;
        let due = projection
            .due_holds(account, &loaded.view, MAX_EXPIRIES_PER_TOUCH)
            .await
            .map_err(WriteError::Store)?;
        let mut expired = 0;
        for hold in due {
            let req = WriteRequest {
                op: Operation::ExpireHold { account, hold },
                event_id: expiry_event_id(hold),
            };
            match self.execute(req).await {
                Ok(_) => {
                    expired += 1;
                    self.metrics().holds_expired.inc();
                }
                Err(WriteError::Rule(
                    RuleError::HoldResolved { .. } | RuleError::HoldNotFound { .. },
                )) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(expired)
    }

    /// Before a write touches `account`: its due holds are expired first when this replica
    /// holds the account and sees one due, so the write is decided on what is really held.
    /// A failure is left to the sweeper: the write itself is decided on the holds as they
    /// stand, which only keeps more money held.
    pub async fn expire_before_write(&self, account: AccountId) {
        if !self.projection().may_have_due_holds(account) {
            return;
        }
        if let Err(e) = self.expire_due(account).await {
            tracing::debug!(%account, error = %e, "due holds not expired before a write; the sweeper tries again");
        }
    }
}
