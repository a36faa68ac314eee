//! The hold sweeper: expires due holds of accounts nobody writes, on its own budget, behind
//! client writes.
//!
//! Each pass takes at most `budget` accounts whose holds may be due, one at a time, and
//! expires theirs ([`WriteService::expire_due`]). It skips a pass while the write side is
//! busy (more than half of the live-write permits in use): client writes come first, and an
//! expiry that waits only keeps money held a little longer. An account's next write
//! expires its due holds itself ([`WriteService::expire_before_write`]).
//!
//! It sweeps the accounts this replica has seen with expiring holds since it started, resident
//! or evicted since (`Projection::accounts_with_due_holds`). After a restart, an account's
//! due holds are expired once something reads or writes it here, or on another replica.

use std::sync::Arc;
use std::time::Duration;

use super::service::WriteService;

/// How often the sweeper looks for due holds.
pub const DEFAULT_HOLD_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// The most accounts one sweeper pass expires holds on.
pub const DEFAULT_HOLD_SWEEP_BUDGET: usize = 64;

/// What one pass did (the `tally_hold_sweeps_total` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepPass {
    Idle,
    Swept,
    Busy,
    Failed,
}

impl SweepPass {
    pub fn label(self) -> &'static str {
        match self {
            SweepPass::Idle => "idle",
            SweepPass::Swept => "swept",
            SweepPass::Busy => "busy",
            SweepPass::Failed => "failed",
        }
    }
}

impl WriteService {
    /// One pass over at most `budget` accounts with holds that may be due.
    pub async fn sweep_holds_once(&self, budget: usize) -> SweepPass {
        if self.busy() {
            return SweepPass::Busy;
        }
        let accounts = self.projection().accounts_with_due_holds(budget);
        if accounts.is_empty() {
            return SweepPass::Idle;
        }
        let mut pass = SweepPass::Swept;
        for account in accounts {
            if self.busy() {
                return SweepPass::Busy;
            }
            if let Err(e) = self.expire_due(account).await {
                tracing::debug!(%account, error = %e, "hold sweep: expiry not written; the next pass tries again");
                pass = SweepPass::Failed;
            }
        }
        pass
    }

    /// Runs passes every `interval` until the task is dropped.
    pub async fn run_hold_sweeper(self: Arc<Self>, interval: Duration, budget: usize) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let pass = self.sweep_holds_once(budget).await;
            self.metrics()
                .hold_sweeps
                .with_label_values(&[pass.label()])
                .inc();
        }
    }
}
