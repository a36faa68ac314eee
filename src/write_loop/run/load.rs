//! Step 1 of an attempt, the state: each account's fold, from the replica's copy on a warm
//! account's first attempt (or a first touch, taken as empty without a read), else from a
//! catch-up; and what the run knows of how that state stands to the store's tip.

use tokio::time::Instant;

use super::{Copies, FirstTouch, Run, Touched};
use crate::account::{AccountsMode, Operation};
use crate::projection::{Loaded, ProjectionError};
use crate::write_loop::classify::{Behind, Failure};
use crate::write_loop::error::WriteError;

/// Where an attempt may take its state from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LoadFrom {
    /// The replica's copy (or a first touch) when it can vouch for every account, else the
    /// store.
    CopyFirst,
    /// The store: a catch-up per account.
    Store,
}

/// Where an attempt's state came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StateFrom {
    /// The replica's copy (or a first touch), without a store read: maybe behind the store.
    Copy,
    /// A catch-up from the store.
    CatchUp,
}

/// Why an attempt's state could not be loaded.
pub(super) enum LoadFailure {
    /// Transient (the store): try the attempt again.
    Retry,
    /// The account cannot be answered (poisoned, trimmed): answer every open request.
    Fail(WriteError),
}

impl Run<'_> {
    /// Whether the run is one account's deposits (accounts implicit) or an open: the shapes
    /// a first touch ([`Projection::first_touch`]) decides without a read, since the empty
    /// state it assumes never refuses them. With explicit accounts a deposit needs the
    /// account to exist, which an empty state denies: it reads first.
    pub(super) fn first_touch_fits(&self) -> bool {
        let implicit = self.cx.config.accounts == AccountsMode::Implicit;
        self.accounts.len() == 1
            && self
                .members
                .iter()
                .filter(|m| !m.is_done())
                .all(|m| match m.req.op {
                    Operation::Deposit { .. } => implicit,
                    Operation::Open { .. } => true,
                    _ => false,
                })
    }

    /// The event ids of unanswered members with a leg on account `ai`: what its load looks
    /// up in the index (on Postgres, in the statement that reads the account row).
    pub(super) fn lookups(&self, ai: usize) -> Vec<u128> {
        self.members
            .iter()
            .filter(|m| !m.is_done())
            .filter(|m| m.accounts[..m.legs.as_slice().len()].contains(&ai))
            .map(|m| m.req.event_id)
            .collect()
    }

    /// Where this attempt takes its state from: the replica's copy first on the first
    /// attempt (with `--one-round-trip`), unless that copy is known behind the store; else
    /// the store.
    pub(super) fn load_from(&self) -> LoadFrom {
        if self.cx.config.one_round_trip && self.attempt == 1 && self.copies != Copies::UnreadBehind
        {
            LoadFrom::CopyFirst
        } else {
            LoadFrom::Store
        }
    }

    /// Loads each account's state: from the projection's current state without a store read
    /// when `from` allows it and the projection can vouch for every account, else from a
    /// catch-up.
    pub(super) async fn load_state(&mut self, from: LoadFrom) -> Result<StateFrom, LoadFailure> {
        if from == LoadFrom::CopyFirst
            && let Some(local) = self.load_copies().await?
        {
            for (t, loaded) in self.accounts.iter_mut().zip(local) {
                t.view = Some(loaded.view);
                t.snap = loaded.snap;
            }
            return Ok(StateFrom::Copy);
        }
        self.catch_up().await?;
        Ok(StateFrom::CatchUp)
    }

    /// Every account's state from the projection's copy, or a first touch (one a run):
    /// `None` when the projection cannot vouch for one of them.
    async fn load_copies(&mut self) -> Result<Option<Vec<Loaded>>, LoadFailure> {
        let projection = self.cx.projection;
        let mut local: Vec<Loaded> = Vec::with_capacity(self.accounts.len());
        for ai in 0..self.accounts.len() {
            let lookups = self.lookups(ai);
            match projection
                .current(self.accounts[ai].account, &lookups)
                .await
            {
                Ok(Some(loaded)) => {
                    self.db_round_trips += loaded.db_statements;
                    local.push(loaded);
                }
                Ok(None) if self.first_touch == FirstTouch::Unused && self.first_touch_fits() => {
                    match projection.first_touch(self.accounts[ai].account) {
                        Some(loaded) => {
                            self.first_touch = FirstTouch::ThisAttempt;
                            local.push(loaded);
                        }
                        None => return Ok(None),
                    }
                }
                Ok(None) => return Ok(None),
                Err(e) => return Err(self.load_failure(e)),
            }
        }
        Ok(Some(local))
    }

    /// A catch-up per account, each from the store.
    async fn catch_up(&mut self) -> Result<(), LoadFailure> {
        let projection = self.cx.projection;
        for i in 0..self.accounts.len() {
            let lookups = self.lookups(i);
            self.round_trips += 1;
            match projection.refresh(self.accounts[i].account, &lookups).await {
                Ok(loaded) => {
                    self.db_round_trips += loaded.db_statements;
                    self.accounts[i].view = Some(loaded.view);
                    self.accounts[i].snap = loaded.snap;
                }
                Err(e) => return Err(self.load_failure(e)),
            }
        }
        Ok(())
    }

    /// What a failed load means: a store (or projection database) failure is transient;
    /// an account that cannot be answered (poisoned, trimmed) answers every open request.
    pub(super) fn load_failure(&mut self, e: ProjectionError) -> LoadFailure {
        match e {
            ProjectionError::Store(e) => {
                self.last_failure = Failure::store("catch-up: ", &e);
                LoadFailure::Retry
            }
            e @ ProjectionError::Database => {
                self.last_failure = Failure::other(format!("catch-up: {e}"));
                LoadFailure::Retry
            }
            e => LoadFailure::Fail(WriteError::Account(e)),
        }
    }

    /// A run giving up after a bounce on the version guard without having read the store
    /// leaves the replica's copies as stale as it found them, and every later write to them
    /// would spend its attempts the same way (with `--write-max-attempts 1`, one write by
    /// another replica or one lost ack would make every later write to the account a 409
    /// until something read it). One catch-up, within the deadline, brings
    /// the copies to the store; its outcome does not change this run's answer. Only after a
    /// bounce (the store answered just now, and the copy is known to be behind), or after a
    /// rule refused on the copy, which no attempt could settle without reading (with
    /// explicit accounts, a copy that still shows an account another replica has opened
    /// since refused every write to it); never for a run that could not reach the store,
    /// which would only add a read to an outage.
    pub(super) async fn refresh_unread_copies(&mut self, deadline: Instant) {
        if self.copies != Copies::UnreadBehind || Instant::now() >= deadline {
            return;
        }
        let _ = tokio::time::timeout_at(deadline, self.load_state(LoadFrom::Store)).await;
    }

    /// Whether the caught-up state reaches each account's tip, so a rule rejection decided on
    /// it is final. Compared with tips the store reported earlier in this run if there are
    /// any; otherwise the tips are asked for now (one round trip per account, on the
    /// rejection path only) and remembered, and a state behind them is read again.
    pub(super) async fn reached_tip(&mut self) -> bool {
        let reached = |tips: &[u64], accounts: &[Touched]| {
            accounts
                .iter()
                .zip(tips)
                .all(|(t, &tip)| t.snap.version >= tip)
        };
        if let Some(tips) = &self.tips {
            return reached(tips, &self.accounts);
        }
        let mut tips = Vec::with_capacity(self.accounts.len());
        for t in &self.accounts {
            self.round_trips += 1;
            // The leader's tip, not a read's: a follower that lags would vouch for a state
            // that misses an acknowledged write, and a refusal decided on it would be final.
            match self.cx.projection.store_version(t.account).await {
                Ok(tip) => tips.push(tip),
                Err(e) => {
                    self.last_failure = Failure::store("tip check: ", &e);
                    return false;
                }
            }
        }
        let done = reached(&tips, &self.accounts);
        if !done {
            self.last_failure = Failure::other("the state read lags behind the store's tip");
        }
        self.tips = Some(tips);
        done
    }

    /// A conflict put an account of this write below the version it was written at: the
    /// store went backwards (`projection/regress.rs`). Its fold is dropped, so the next
    /// attempt's catch-up folds it again from version 1 and decides against what the store
    /// holds. The leg is the one written at the conflict's expected version.
    pub(super) fn fold_again_where_the_store_is_behind(&mut self, behind: Behind) {
        for t in &mut self.accounts {
            if t.snap.version == behind.expected
                && self
                    .cx
                    .projection
                    .store_went_behind(t.account, behind.current)
            {
                t.view = None;
            }
        }
    }
}
