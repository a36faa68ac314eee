//! The feed task: follows the store's watch for this service's accounts and hands each
//! commit to the hub. A gap, or a feed that broke and was reopened, makes the hub re-read
//! every watched account and end the fleet-wide streams (which cannot re-read "every
//! account"); nothing is missed silently.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use uuid::Uuid;

use super::{END_FEED_GAP, Hub, WriteFrame, end_all, fan_out};
use crate::account::AccountId;
use crate::store::{Commit, StoreError, WATCH_UNSUPPORTED_CODE, WatchFilter, WatchItem};

/// How often every watched account is re-read regardless of notifications: a safety net
/// for a notification whose batch was not readable in time, or a feed that went silent
/// without an error (a half-open connection). Reading past the tip costs one empty read.
pub(super) const RESYNC_INTERVAL: Duration = Duration::from_secs(30);

/// Pause before reopening a feed that failed, doubling up to the maximum.
const REOPEN_BACKOFF: Duration = Duration::from_millis(100);
const REOPEN_BACKOFF_MAX: Duration = Duration::from_secs(5);

pub(super) async fn run(hub: Arc<Hub>) {
    let identity = *hub.projection.identity();
    let filter = WatchFilter {
        org_id: Some(identity.org_id.as_u128()),
        aggregate_type_id: Some(identity.account_type_id.as_u128()),
    };
    let log = hub.projection.log().clone();
    let mut backoff = REOPEN_BACKOFF;
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
                hub.feed_ready.send_replace(Some(Err(e.to_string())));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REOPEN_BACKOFF_MAX);
                continue;
            }
        };
        backoff = REOPEN_BACKOFF;
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
