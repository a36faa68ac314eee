//! Tally: idempotent, horizontally scaled account writes over the Celeriant event store.
//!
//! Layers, bottom up: [`store`] (the event-log port and its backends), [`account`] (events,
//! codec, fold and business rules), [`projection`] (per-account state, the recent-writes
//! index and catch-up), then the users of the fold: [`write_loop`] (the one write loop,
//! with `write_loop::verify` for contested sequences), [`reader`] (balance and history),
//! [`startup`] (the server-clock anchor and demo seeds) and [`device`] (offline devices'
//! outbox, sync loop and the service-side core); on top, [`http`] (the hyper front end) and
//! [`app`] (wiring), with [`config`] and [`metrics`] beside them. `docs/architecture.md`
//! walks one write through them. Small leaves any layer may use: [`stall`] watches for a
//! replica that stood still; [`log_limit`] keeps a failure every request meets to one log line
//! per second; [`log_writer`] writes log lines in batches; [`request_note`] gathers what a
//! request's access-log line says; [`backoff`] is the retry loops' one wait; [`flag`] parses
//! the flags' values.

pub mod account;
pub mod app;
pub mod auth;
pub mod backoff;
pub mod config;
pub mod device;
pub mod flag;
pub mod http;
pub mod log_limit;
pub mod log_writer;
pub mod metrics;
pub mod projection;
pub mod reader;
pub mod request_note;
pub mod stall;
pub mod startup;
pub mod store;
pub mod watch;
pub mod write_loop;
