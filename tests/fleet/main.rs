//! Fleets: replicas sharing one store and one client id, in one process and as real
//! processes behind nginx, and a fleet mixed with the replaced service.
//!
//! One test binary (`cargo test --test fleet`), one module per suite:
//! - [`fleet`]: replicas in this process over HTTP, on the embedded store and the real
//!   server (`make test` runs it a second time on the Postgres projection and again with
//!   `--auth jwt`: `FLEET_SUITE` in the Makefile names it by skipping the others);
//! - [`fleet_processes`]: real `tally` processes behind nginx (`deploy/fleet.sh`) on the
//!   real server, and a `tally-load` exactly-once run;
//! - [`fleet_script`]: `deploy/fleet.sh` on the embedded store, a replica's death and restart;
//! - [`mixed_fleet`]: the replaced service and a Tally replica on one real server;
//! - [`holds`]: real `tally` processes with holds on, racing, expiring and folding holds,
//!   and one with holds off;
//! - [`aged_keys`]: real `tally` processes with a short window on the real server, a
//!   key retried two windows later on a fresh replica and looked up on every replica;
//! - [`cluster_failover`]: two `tally` processes over a real 2-node cluster whose leader is
//!   killed under keyed load (opt-in: `make cluster-failover`).
//!
//! Shared helpers live in `tests/common/`.

#[path = "../common/mod.rs"]
mod common;

mod aged_keys;
mod cluster_failover;
mod fleet;
mod fleet_processes;
mod fleet_script;
mod holds;
mod mixed_fleet;
