//! A final refusal is decided only on state that reached the tip as the store's leader holds
//! it. A store whose reads and `details` are served by a follower that lags (a cluster after
//! a failover) must not make a retry's refusal final on state behind an acknowledged write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use tally::store::faults::FaultyLog;
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    SharedLog, StoreResult,
};

use crate::common::{leg, new_account, scripted_faults, spawn_fleet};

/// A store whose next `details` answers as a follower that lags by some versions would:
/// its tip lower than the leader's. Writes (and so the leader's tip) are the leader's.
struct LaggingFollower {
    inner: Arc<FaultyLog<MemoryLog>>,
    details_lag: AtomicU64,
}

#[async_trait]
impl EventLog for LaggingFollower {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.inner.write(client_id, writes).await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.inner.read(key, filter).await
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let mut d = self.inner.details(key).await?;
        let lag = self.details_lag.swap(0, Ordering::SeqCst);
        d.max_version = d.max_version.saturating_sub(lag);
        Ok(d)
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

/// Rule: a refusal is final only on the leader's tip. A retry on a replica whose read and
/// tip both come from a follower one version behind an acknowledged deposit is decided
/// again on the leader's state, and lands: never a final 422 that the deposit covers.
#[tokio::test]
async fn a_refusal_is_never_final_on_a_follower_behind_an_acknowledged_write() {
    let faulty = scripted_faults();
    let store = Arc::new(LaggingFollower {
        inner: faulty.clone(),
        details_lag: AtomicU64::new(0),
    });
    let fleet = spawn_fleet(2, store.clone() as SharedLog, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let x = new_account();
    assert_eq!(leg(&a.deposit(&x, 500, Some("first")).await.body), (500, 1));
    // Acknowledged at version 2: 1,000 cents.
    assert_eq!(
        leg(&a.deposit(&x, 500, Some("second")).await.body),
        (1_000, 2)
    );

    // B has never held the account. Its read and the tip it is told both stop at version 1,
    // where 800 is not covered.
    faulty.lag_next_read(1);
    store.details_lag.store(1, Ordering::SeqCst);
    let r = b.withdraw(&x, 800, Some("covered")).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text);
    assert_eq!(leg(&r.body), (200, 3));
    for t in fleet {
        t.shutdown().await;
    }
}
