//! An offline device's side of Tally: a point-of-sale terminal (or any client that must keep
//! working without a network) records deposits and withdrawals into a durable local outbox
//! and syncs them later, however much later, without ever depositing twice (the rule and the
//! protocol: `tally::device`, and docs/devices.md).
//!
//! - [`outbox`]: the device's SQLite outbox (identity, per-account sequences, runs);
//! - [`sync`]: the one sync loop that drains the outbox in order;
//! - [`transport`]: how the loop reaches a server (HTTP, or in process for tests);
//! - [`crash`]: the named crash points between durable steps, for tests.
//!
//! The `tally-device` binary (`src/main.rs`) is the CLI over these. What the device shares
//! with the service (the wire protocol, [`tally::device::DeviceId`], the run limit, account
//! types) comes from the `tally` library; SQLite is linked here only.
//!
//! Transfers are not recorded offline (see [`outbox::OutboxError::TransferOffline`]).

pub mod crash;
pub mod outbox;
pub mod sync;
pub mod transport;
