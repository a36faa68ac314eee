//! One demo account's opening deposit, seeded exactly once, and known to be.
//!
//! The seed is a create-only write: `expected_version` 0, `client_seq` 1 with enforced
//! idempotency, and a fixed event id per demo account. However often it is sent, by this
//! replica or a sibling, the version guard lets it land at most once; what an attempt has to
//! settle is whether it *did* land, and every ambiguous answer is settled by the stream:
//!
//! | answer | what it means | next |
//! |---|---|---|
//! | success | our write created the account | done: `Written` |
//! | `Conflict` (2003) | the account exists (someone seeded it, maybe us) | never write again; read version 1 |
//! | `IdempotencyViolation` (2002) | our sequence 1 on it is used | never write again; read version 1 |
//! | `OutcomeUnknown` | maybe landed | read version 1; nothing there yet: send again later |
//! | `InflightDuplicate` (2013) | a write holding sequence 1 is not durable yet | send again later |
//! | `NotApplied`, other errors | not landed, or nothing we can tell | send again later |
//!
//! Reading version 1: our event id from our client id there means the seed landed (an
//! earlier attempt whose ack was lost, or a sibling replica's): `Found`. Any other first
//! event, or a trimmed opening, means the account began otherwise and a create-only seed can
//! never land on it: `Occupied`, logged, and never retried. Nothing visible is not a verdict
//! (a lagging read hides the newest batch): the step stays pending and looks again.

use crate::account::{AccountEvent, AccountId, Identity, named_id};
use crate::store::{
    AggregateKey, AggregateWrite, Batch, ClientId, Event, EventLog, ReadFilter, StoreError,
};

/// The demo accounts seeded on the embedded store: (name, opening balance in cents). Their
/// ids are UUIDv5 of the name, in the shared identity namespace.
pub const DEMO_ACCOUNTS: [(&str, i64); 3] =
    [("Alice", 50_000), ("Bob", 25_000), ("Charlie", 10_000)];

/// The id of a demo account.
pub fn demo_account_id(name: &str) -> uuid::Uuid {
    named_id(name)
}

/// The client sequence of a demo account's opening deposit: its stream's first own event.
const SEED_CLIENT_SEQ: u64 = 1;

/// How a seed finished. Each one is final: the step is never redone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeedOutcome {
    /// Our write was acknowledged: it created the account.
    Written,
    /// Our seed event is the account's first: an earlier attempt whose ack was lost, or a
    /// sibling replica (same client id, same event id), landed it.
    Found,
    /// The account exists but did not begin with our seed (or its opening was trimmed): the
    /// create-only seed can never land, and nothing is written.
    Occupied,
}

impl SeedOutcome {
    /// The value of the `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            SeedOutcome::Written => "written",
            SeedOutcome::Found => "found",
            SeedOutcome::Occupied => "occupied",
        }
    }
}

/// Why a seed is not settled yet. Every one is retried after a backoff.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SeedPending {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The store answered 2003 or 2002, but a read does not show version 1 yet.
    #[error("the store reports the account exists, but its version 1 is not visible yet")]
    NotVisible,
}

/// What reading the account's version 1 showed.
#[derive(Debug, PartialEq, Eq)]
enum Opening {
    Ours,
    Foreign,
    Trimmed,
    /// No batch at version 1 is visible: the account is missing, or the read lags.
    NotVisible,
}

/// One demo account's seed step, with what earlier attempts learned.
pub struct DemoSeed {
    name: &'static str,
    key: AggregateKey,
    client: ClientId,
    event: Event,
    /// The store answered 2003 or 2002: the account exists or our sequence is used, so no
    /// write could ever land again. From then on attempts only read.
    exists: bool,
}

impl DemoSeed {
    pub fn new(identity: &Identity, name: &'static str, opening_cents: i64) -> Self {
        let deposit = AccountEvent::Deposited {
            amount: opening_cents,
        };
        Self {
            name,
            key: identity.key(AccountId(demo_account_id(name))),
            client: identity.client(),
            event: Event {
                client_seq: SEED_CLIENT_SEQ,
                event_id: Some(Self::event_id(name)),
                event_type: deposit.event_type(),
                payload: deposit.encode(),
                timestamp_ms: 0,
            },
            exists: false,
        }
    }

    /// The fixed event id of a demo account's seed, the same on every replica and every run.
    pub fn event_id(name: &str) -> u128 {
        demo_account_id(&format!("seed:{name}")).as_u128()
    }

    /// The demo account's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The demo account.
    pub fn account(&self) -> AccountId {
        AccountId(uuid::Uuid::from_u128(self.key.aggregate_id))
    }

    /// One attempt. `Err` says why the seed is not settled yet; the caller backs off and
    /// calls again (on the same value: what this attempt learned is kept).
    pub async fn attempt(&mut self, log: &dyn EventLog) -> Result<SeedOutcome, SeedPending> {
        let mut unknown = None;
        if !self.exists {
            match log.write(self.client, vec![self.write()]).await {
                Ok(_) => return Ok(SeedOutcome::Written),
                Err(StoreError::Conflict { .. } | StoreError::IdempotencyViolation { .. }) => {
                    self.exists = true;
                }
                Err(e @ StoreError::OutcomeUnknown { .. }) => unknown = Some(e),
                // Not applied, or not durable yet: the next attempt sends the same again.
                Err(e) => return Err(e.into()),
            }
        }
        match self.read_opening(log).await? {
            Opening::Ours => Ok(SeedOutcome::Found),
            Opening::Foreign => {
                tracing::warn!(
                    account = self.name,
                    "demo account exists but did not begin with its seed; leaving it as it is"
                );
                Ok(SeedOutcome::Occupied)
            }
            Opening::Trimmed => {
                tracing::warn!(
                    account = self.name,
                    "demo account exists and its opening was trimmed; leaving it as it is"
                );
                Ok(SeedOutcome::Occupied)
            }
            // After an unknown outcome, nothing visible may be a lost request or a lagging
            // read: the next attempt sends the seed again, and the version guard answers.
            Opening::NotVisible => Err(unknown.map_or(SeedPending::NotVisible, SeedPending::Store)),
        }
    }

    /// The create-only write of the opening deposit.
    fn write(&self) -> AggregateWrite {
        AggregateWrite {
            key: self.key,
            events: vec![self.event.clone()],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: true,
        }
    }

    async fn read_opening(&self, log: &dyn EventLog) -> Result<Opening, StoreError> {
        let filter = ReadFilter {
            from_version: 1,
            to_version: Some(1),
            ..ReadFilter::default()
        };
        match log.read(self.key, &filter).await {
            Ok(page) => Ok(match page.batches.iter().find(|b| b.version == 1) {
                Some(b) if self.is_ours(b) => Opening::Ours,
                Some(_) => Opening::Foreign,
                None => Opening::NotVisible,
            }),
            Err(StoreError::AggregateNotFound) => Ok(Opening::NotVisible),
            Err(StoreError::Trimmed { .. }) => Ok(Opening::Trimmed),
            Err(e) => Err(e),
        }
    }

    /// Our seed: written by our client id, holding sequence 1 with the seed's event id.
    fn is_ours(&self, batch: &Batch) -> bool {
        batch.client_id == self.client
            && batch
                .events
                .iter()
                .any(|e| e.client_seq == SEED_CLIENT_SEQ && e.event_id == self.event.event_id)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::faults::{Fault, FaultyLog};
    use crate::store::memory::MemoryLog;

    fn fixture() -> (Arc<MemoryLog>, FaultyLog<MemoryLog>, DemoSeed) {
        let mem = Arc::new(MemoryLog::new());
        let faulty = FaultyLog::new(mem.clone(), Default::default());
        (
            mem,
            faulty,
            DemoSeed::new(&Identity::default(), "Alice", 50_000),
        )
    }

    /// Every batch of the seed's account, straight from the store.
    async fn batches(mem: &MemoryLog, seed: &DemoSeed) -> Vec<Batch> {
        match mem.read(seed.key, &ReadFilter::from_version(1)).await {
            Ok(page) => page.batches,
            Err(StoreError::AggregateNotFound) => Vec::new(),
            Err(e) => panic!("read failed: {e}"),
        }
    }

    async fn assert_seeded_once(mem: &MemoryLog, seed: &DemoSeed) {
        let batches = batches(mem, seed).await;
        assert_eq!(batches.len(), 1, "exactly one batch: {batches:?}");
        assert!(seed.is_ours(&batches[0]), "and it is the seed");
    }

    #[tokio::test]
    async fn an_acknowledged_seed_is_written() {
        let (mem, faulty, mut seed) = fixture();
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Written));
        assert_seeded_once(&mem, &seed).await;
    }

    /// Rule: a seed whose ack was lost is recognised as landed by its event at version 1,
    /// without a second write.
    #[tokio::test]
    async fn a_seed_whose_ack_was_lost_is_found_at_version_one_and_not_sent_again() {
        let (mem, faulty, mut seed) = fixture();
        faulty.fail_next_write(Fault::LostAck);
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Found));
        assert_seeded_once(&mem, &seed).await;
        assert_eq!(faulty.counts().lost_ack, 1);
    }

    /// Rule: nothing visible after an unknown outcome is not a verdict; the seed is sent
    /// again, and the version guard makes the landing unique either way.
    #[tokio::test]
    async fn a_lost_request_is_sent_again_and_lands_once() {
        let (mem, faulty, mut seed) = fixture();
        faulty.fail_next_write(Fault::LostRequest);
        assert!(matches!(
            seed.attempt(&faulty).await,
            Err(SeedPending::Store(StoreError::OutcomeUnknown { .. }))
        ));
        assert!(batches(&mem, &seed).await.is_empty());
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Written));
        assert_seeded_once(&mem, &seed).await;
    }

    /// Rule: a lost ack whose read-back lags is settled by the next attempt: its write
    /// answers 2003 (never a second landing), and the read finds our event.
    #[tokio::test]
    async fn a_lost_ack_hidden_by_a_lagging_read_is_found_on_the_next_attempt() {
        let (mem, faulty, mut seed) = fixture();
        faulty.fail_next_write(Fault::LostAck);
        faulty.lag_next_read(1);
        assert!(seed.attempt(&faulty).await.is_err());
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Found));
        assert_seeded_once(&mem, &seed).await;
    }

    /// Rule: a 2003 means the account exists; once known, no attempt writes again, and a
    /// lagging read only delays the verdict.
    #[tokio::test]
    async fn after_a_conflict_attempts_only_read_until_version_one_is_visible() {
        let (mem, faulty, mut sibling) = fixture();
        // A sibling replica seeds first: same client id, same event id.
        assert_eq!(sibling.attempt(&*mem).await, Ok(SeedOutcome::Written));
        let mut seed = DemoSeed::new(&Identity::default(), "Alice", 50_000);
        faulty.lag_next_read(1);
        assert_eq!(
            seed.attempt(&faulty).await,
            Err(SeedPending::NotVisible),
            "lagging read: pending"
        );
        assert!(seed.exists);
        // The next write would be refused by a queued fault; the attempt must not send one.
        faulty.fail_next_write(Fault::Refused);
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Found));
        assert_eq!(faulty.counts().refused, 0, "no write after a 2003");
        assert_seeded_once(&mem, &seed).await;
    }

    /// Rule: an account that began with another event is never seeded over, and the step
    /// still finishes.
    #[tokio::test]
    async fn an_account_that_began_otherwise_is_occupied_and_left_alone() {
        let (mem, faulty, mut seed) = fixture();
        let mut other = seed.write();
        other.events[0].event_id = Some(7);
        mem.write(seed.client, vec![other])
            .await
            .expect("other opening");
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Occupied));
        let batches = batches(&mem, &seed).await;
        assert_eq!(batches.len(), 1);
        assert!(!seed.is_ours(&batches[0]));
    }

    /// Rule: a 2013 (a write holding sequence 1 not durable yet) is tried again later; once
    /// the held write lands, the retry's 2003 and read settle it as found.
    #[tokio::test]
    async fn an_inflight_duplicate_is_retried_and_then_found() {
        let (mem, faulty, mut seed) = fixture();
        let faulty = Arc::new(faulty);
        let mut hold = faulty.hold_next_write();
        let mut sibling = DemoSeed::new(&Identity::default(), "Alice", 50_000);
        let held = {
            let faulty = faulty.clone();
            tokio::spawn(async move { sibling.attempt(&*faulty).await })
        };
        assert!(hold.held().await);
        assert_eq!(
            seed.attempt(&*faulty).await,
            Err(SeedPending::Store(StoreError::InflightDuplicate))
        );
        hold.release();
        assert_eq!(held.await.expect("sibling"), Ok(SeedOutcome::Written));
        assert_eq!(seed.attempt(&*faulty).await, Ok(SeedOutcome::Found));
        assert_seeded_once(&mem, &seed).await;
    }

    /// Rule: a refused write is sent again as is.
    #[tokio::test]
    async fn a_refused_seed_is_sent_again() {
        let (mem, faulty, mut seed) = fixture();
        faulty.fail_next_write(Fault::Refused);
        assert!(matches!(
            seed.attempt(&faulty).await,
            Err(SeedPending::Store(StoreError::NotApplied { .. }))
        ));
        assert_eq!(seed.attempt(&faulty).await, Ok(SeedOutcome::Written));
        assert_seeded_once(&mem, &seed).await;
    }
}
