//! Black-box tests of the HTTP API: every route, every status, the error body, and the
//! Idempotency-Key contract, against servers on port 0 (the harness) and against the real
//! `tally` binary (startup, `--help`, graceful shutdown on SIGTERM).
//!
//! One test binary (`cargo test --test api`), one module per area:
//! - [`startup`]: demo-account seeding and readiness while a replica starts;
//! - [`routes`]: every route's successful answers;
//! - [`bad_input`]: 400, 404, 405, 415 and 422, each changing nothing;
//! - [`limits`]: the body limit (413), load shedding (503), abandoned requests;
//! - [`store_failures`]: retryable 409s and the poisoned stream's 500;
//! - [`idempotency_keys`]: replays, key syntax, minted keys, reuse, concurrent duplicates;
//! - [`accounts`]: opening accounts, and explicit accounts (`--accounts explicit`);
//! - [`binary`]: the `tally` process itself.
//!
//! The harness, the raw HTTP client and the checks the modules share live in `tests/common/`,
//! where the other suites can use them too.

#[path = "../common/mod.rs"]
mod common;

mod accounts;
mod bad_input;
mod binary;
mod idempotency_keys;
mod limits;
mod routes;
mod startup;
mod store_failures;
