//! The replica's estimate of the server's now, which every index entry's age is measured
//! against: anchored by a probe write to the service's own clock aggregate, raised by every
//! newer server time a read shows, and run on by the local monotonic clock in between.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;

use super::Projection;
use crate::store::{AggregateWrite, Event, EventType, StoreError};

/// The event type of a server-clock probe (in the clock aggregate, never in an account).
const SERVER_CLOCK_PROBE_EVENT: EventType = EventType { major: 1, minor: 0 };

/// How often a replica re-anchors its estimate of the server's now. Between anchors the
/// estimate runs on the local monotonic clock, so this bounds how long a clock rate error or
/// a server clock step can skew index lifetimes.
pub const SERVER_CLOCK_RESYNC: Duration = Duration::from_secs(60);

impl Projection {
    /// The server's now as this replica can vouch for it: the newest server time observed,
    /// run on by the local monotonic clock since. 0 before any observation (every batch is
    /// then as young as can be).
    pub fn server_tip_ms(&self) -> u64 {
        let offset = self.server_offset_ms.load(Ordering::Acquire);
        if offset == i64::MIN {
            return 0;
        }
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        u64::try_from(now.saturating_add(offset)).unwrap_or(0)
    }

    /// Raises the replica's server-time tip: the server's now was at least `ts_ms` at this
    /// local moment.
    pub fn observe_server_time(&self, ts_ms: u64) {
        let ts = i64::try_from(ts_ms).unwrap_or(i64::MAX);
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        self.server_offset_ms
            .fetch_max(ts.saturating_sub(now), Ordering::AcqRel);
    }

    /// Anchors the server-time tip to the server's now: writes one probe event to the
    /// service's clock aggregate and reads back its commit time. Without an anchor, a replica
    /// that has seen no newer batch would take an idle account's last batch as "now", and
    /// revive its expired index entries when it folds it.
    ///
    /// The anchor *replaces* the estimate (reads in between only raise it), so an estimate
    /// that ran ahead of the server (a server clock stepped back, a local clock running fast)
    /// is corrected at the next anchor: the caller repeats this every
    /// [`SERVER_CLOCK_RESYNC`]. Returns the commit time read.
    pub async fn sync_server_clock(&self) -> Result<u64, StoreError> {
        let key = self.identity.server_clock_key();
        let probe = AggregateWrite {
            key,
            events: vec![Event {
                // Not an idempotent write: it may land twice, and that is harmless.
                client_seq: 0,
                event_id: None,
                event_type: SERVER_CLOCK_PROBE_EVENT,
                payload: Bytes::from_static(b"{}"),
                timestamp_ms: 0,
            }],
            expected_version: None,
            allow_create: true,
            enforce_client_idempotency: false,
        };
        let version = self
            .log
            .write(self.identity.client(), vec![probe])
            .await?
            .first()
            .copied()
            .unwrap_or(0);
        self.probe_version.store(version, Ordering::Release);
        let details = self.log.details(key).await?;
        // Measured after the read: the offset is a lower bound, by about the probe's round
        // trip, so entries may outlive their window by that much but are never cut short.
        let ts = i64::try_from(details.last_server_timestamp_ms).unwrap_or(i64::MAX);
        let now = i64::try_from(self.now_ms()).unwrap_or(i64::MAX);
        self.server_offset_ms
            .store(ts.saturating_sub(now), Ordering::Release);
        // Only the newest probe matters: keep the aggregate at one batch.
        if version > 1
            && let Err(e) = self.log.trim_start(key, version).await
        {
            tracing::debug!(error = %e, "could not trim the server-clock aggregate");
        }
        Ok(details.last_server_timestamp_ms)
    }
}
