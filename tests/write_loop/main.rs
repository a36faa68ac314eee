//! The write path below the HTTP edge: the write loop arm by arm, group commit, the fault
//! injector the suites steer the store with, scan on miss, and start-up.
//!
//! One test binary (`cargo test --test write_loop`), one module per suite:
//! - [`write_loop`]: every arm of the write loop with a scripted, recording store (`make
//!   test` runs it a second time on the Postgres projection: the `write_loop::` filter);
//! - [`combine`]: group commit, writes of different accounts sharing one store request;
//! - [`faults`]: every fault of the injector, counted, same seed same sequence;
//! - [`leader_tip`]: a refusal is final only on the leader's tip, never a lagging follower's;
//! - [`scan_on_miss`]: a retry past the recent-writes window found in the account's batches;
//! - [`startup`]: start-up steps that retry on their own, and `/readyz` while they do.
//!
//! Shared helpers live in `tests/common/`.

#[path = "../common/mod.rs"]
mod common;

mod combine;
mod faults;
mod leader_tip;
mod scan_on_miss;
mod startup;
mod write_loop;
