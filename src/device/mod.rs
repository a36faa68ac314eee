//! Offline devices: a point-of-sale terminal (or any client that must keep working without a
//! network) records deposits and withdrawals into a durable local outbox and syncs them later,
//! however much later, without ever depositing twice.
//!
//! The trick is the store's own idempotency guard. A device is its own Celeriant writer: it
//! owns a client id (generated once, kept in the outbox) and numbers its events per account
//! from a durable local counter, in the same SQLite transaction that stores the event. The
//! (account, device) high-water mark in the store then deduplicates forever: there is no
//! window to fall out of, because the dedup state is the device's own outbox.
//!
//! This module is what the service needs, and what both sides share:
//! - [`protocol`]: the JSON shapes of `POST /api/devices/{deviceId}/sync` (both sides);
//! - [`DeviceId`] and [`MAX_RUN_EVENTS`] (both sides);
//! - [`run`]: one validated run of a device's events;
//! - [`ingest`]: the service-side core behind that endpoint, which writes one run with the
//!   device's client id, classifies the store's answer and reads a resent run back;
//! - [`error`]: how a sync fails on the service side, and why a run is resent.
//!
//! The device's own side (the SQLite outbox, the sync loop, the transports, the crash points
//! and the `tally-device` CLI) is the `tally-device` crate (`crates/tally-device`): the
//! service links no SQLite.
//!
//! Transfers are not recorded offline (the outbox refuses them). Withdrawals are: offline
//! there is no balance to check, so a device withdrawal is a fact the service folds as it
//! comes (the balance may go below zero), never a request it refuses.

pub mod error;
pub mod ingest;
pub mod protocol;
pub mod run;

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// The most events one sync request may carry. The device's batch size is capped by it.
pub const MAX_RUN_EVENTS: usize = 256;

/// A device's identity on the store: its Celeriant client id. Generated once, on the device,
/// when its outbox is created; never derived from anything that could repeat.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub Uuid);

impl DeviceId {
    /// A fresh random id (UUIDv4).
    pub fn generate() -> Self {
        DeviceId(Uuid::new_v4())
    }

    pub fn as_u128(self) -> u128 {
        self.0.as_u128()
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for DeviceId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(DeviceId)
    }
}
