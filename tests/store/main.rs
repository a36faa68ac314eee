//! The stores: the event-log port every backend passes, the Celeriant adapter on the wire,
//! the Postgres projection, checkpoints, and a store that went backwards.
//!
//! One test binary (`cargo test --test store`), one module per suite:
//! - [`conformance`]: the port's named rules, on the embedded store, the fault injector and
//!   the real server;
//! - [`celeriant`]: the Celeriant adapter: lost replies, and wire tests on the real servers;
//! - [`postgres`]: the Postgres projection against a real Postgres;
//! - [`checkpoints`]: cold folds from a checkpoint, the writer, retention and `tally trim`;
//! - [`store_regression`]: a store replaced under a running replica.
//!
//! Real servers come from `scripts/with-celeriant.sh` and `scripts/with-postgres.sh`; a
//! suite whose server is not named skips outside CI and fails under `CI=true`
//! (`tests/common/required.rs`). Shared helpers live in `tests/common/`.

#[path = "../common/mod.rs"]
mod common;

mod celeriant;
mod checkpoints;
mod conformance;
mod postgres;
mod store_regression;
