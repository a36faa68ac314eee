//! Device sync on the server: the service-side core against the store port, and the whole
//! path through a real `tally` and the `tally-device` binary. The device crate's own suites
//! are in `crates/tally-device/tests/`.
//!
//! One test binary (`cargo test --test device`), one module per suite:
//! - [`device_server`]: the device's client id, no version guard, every store answer
//!   classified, the projection;
//! - [`device_e2e`]: two real processes, offline recording and sync under seeded faults.
//!
//! Shared helpers live in `tests/common/`.

#[path = "../common/mod.rs"]
mod common;

mod device_e2e;
mod device_server;
