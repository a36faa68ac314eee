//! The HTTP edge, black-box: every route, every status, the error body and the
//! Idempotency-Key contract, against servers on port 0 (the harness) and against the real
//! `tally` binary; and the edge's own concerns around it.
//!
//! One test binary (`cargo test --test api`), one module per area. The black-box API suite
//! proper, which `make test` runs a second time on the Postgres projection (`API_SUITE` in the
//! Makefile skips the edge's modules further down, so a new module joins that rerun unless it
//! is skipped there too):
//! - [`startup`]: demo-account seeding and readiness while a replica starts;
//! - [`routes`]: every route's successful answers;
//! - [`bad_input`]: 400, 404, 405, 415 and 422, each changing nothing;
//! - [`limits`]: the body limit (413), load shedding (503), abandoned requests;
//! - [`store_failures`]: retryable 409s and the poisoned stream's 500;
//! - [`store_outage`]: a real server SIGKILLed under the binary: 503s, the log, the retry;
//! - [`idempotency_keys`]: replays, key syntax, minted keys, reuse, concurrent duplicates;
//! - [`write_lookup`]: a write looked up by its key, without resending it;
//! - [`accounts`]: opening accounts, and explicit accounts (`--accounts explicit`);
//! - [`holds`]: holds placed, posted, voided and expired (`--holds true`; memory projection only);
//! - [`binary`]: the `tally` process itself.
//!
//! The edge around it (run once):
//! - [`auth`]: tokens, scopes, key ownership per caller, pacing;
//! - [`front_end_limits`]: the request-head cap, framing and the Host header, over raw TCP;
//! - [`overload`]: admission at the edge (the gate, shedding, the connection cap);
//! - [`write_side_limits`]: the write side's permits, queue cap, deadlines and key scope;
//! - [`metrics`]: exact counter deltas after a scripted sequence;
//! - [`openapi`]: `docs/openapi.json` against the code;
//! - [`architecture_doc`]: every name `docs/architecture.md` quotes still exists;
//! - [`layers`]: every `crate::` path in `src/` follows that page's layer table.
//!
//! The harness, the raw HTTP client and the checks the modules share live in `tests/common/`,
//! where the other suites use them too. Every server a test starts is its own (its own
//! registry, limits and gate), so the modules share this process without measuring each
//! other; the one suite that measures the whole process, `tests/memory_bounds.rs`, keeps a
//! binary of its own.

#[path = "../common/mod.rs"]
mod common;

mod accounts;
mod bad_input;
mod batch;
mod binary;
mod holds;
mod idempotency_keys;
mod limits;
mod routes;
mod startup;
mod store_failures;
mod store_outage;
mod write_lookup;

mod architecture_doc;
mod auth;
mod front_end_limits;
mod layers;
mod metrics;
mod openapi;
mod overload;
mod write_side_limits;
