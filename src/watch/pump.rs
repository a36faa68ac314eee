//! The feed task: follows the store's watch for this service's accounts and hands each
//! commit to the hub. A gap, or a feed that broke and was reopened, makes the hub re-read
//! every watched account and end the fleet-wide streams (which cannot re-read "every
//! account"); nothing is missed silently.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use uuid::Uuid;

use super::{END_FEED_GAP, Hub, WriteFrame, end_all, fan_out};
use crate::account::AccountId;
use crate::backoff::Backoff;
use crate::store::{Commit, StoreError, WATCH_UNSUPPORTED_CODE, WatchFilter, WatchItem};

/// How often every watched account is re-read regardless of notifications: a safety net
/// for a notification whose batch was not readable in time, or a feed that went silent
/// without an error (a half-open connection). Reading past the tip costs one empty read.
pub(super) const RESYNC_INTERVAL: Duration = Duration::from_secs(30);

/// Pause before reopening a feed that failed, doubling per failure in a row up to the
/// maximum (not jittered: one feed per replica).
const REOPEN_BACKOFF: Duration = Duration::from_millis(100);
const REOPEN_BACKOFF_MAX: Duration = Duration::from_secs(5);
const REOPEN: Backoff = Backoff::new(REOPEN_BACKOFF, REOPEN_BACKOFF_MAX);

pub(super) async fn run(hub: Arc<Hub>) {
    let identity = *hub.projection.identity();
    let filter = WatchFilter {
        org_id: Some(identity.org_id.as_u128()),
        aggregate_type_id: Some(identity.account_type_id.as_u128()),
    };
    let log = hub.projection.log().clone();
    let mut failed_opens: u32 = 0;
    let mut opened_before = false;
    loop {
        let mut feed = match log.watch(filter).await {
            Ok(feed) => feed,
            Err(StoreError::Other { code, message }) if code == WATCH_UNSUPPORTED_CODE => {
                hub.feed_ready.send_replace(Some(Err(message)));
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not open the store's watch; retrying");
                // The class only: the message reaches a stream's caller.
                hub.feed_ready.send_replace(Some(Err(e.brief())));
                failed_opens = failed_opens.saturating_add(1);
                tokio::time::sleep(REOPEN.bound(failed_opens)).await;
                continue;
            }
        };
        failed_opens = 0;
        if opened_before {
            // Commits while no feed was open were not seen.
            gap(&hub);
        }
        opened_before = true;
        hub.feed_ready.send_replace(Some(Ok(())));
        loop {
            match feed.next().await {
                Ok(WatchItem::Commit(c)) => commit(&hub, c),
                Ok(WatchItem::Gap) => gap(&hub),
                Err(e) => {
                    tracing::warn!(error = %e, "the store's watch broke; reopening");
                    break;
                }
            }
        }
    }
}

fn commit(hub: &Arc<Hub>, c: Commit) {
    let account = AccountId(Uuid::from_u128(c.key.aggregate_id));
    {
        let mut global = hub.global.lock();
        if !global.is_empty() {
            let frame = Arc::new(WriteFrame {
                account,
                version: c.version,
                encoded: OnceLock::new(),
            });
            fan_out(&mut global, &frame, &hub.metrics);
        }
    }
    if let Some(channel) = hub.channel(account) {
        channel.notify(hub, c.version);
    }
}

fn gap(hub: &Arc<Hub>) {
    hub.metrics.watch_feed_gaps.inc();
    end_all(&mut hub.global.lock(), END_FEED_GAP);
    for channel in hub.channels() {
        channel.resync(hub);
    }
}

/// Re-reads every watched account every [`RESYNC_INTERVAL`].
pub(super) async fn resync_periodically(hub: Arc<Hub>) {
    loop {
        tokio::time::sleep(RESYNC_INTERVAL).await;
        for channel in hub.channels() {
            channel.resync(&hub);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a feed that keeps failing to open is retried after 100 ms, doubling per failure
    /// in a row, at most 5 s apart.
    #[test]
    fn reopen_pauses_double_from_100_ms_to_at_most_5_s() {
        let pauses: Vec<u128> = (1..=8).map(|n| REOPEN.bound(n).as_millis()).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000]);
        assert_eq!(REOPEN.bound(u32::MAX), REOPEN_BACKOFF_MAX);
    }
}
