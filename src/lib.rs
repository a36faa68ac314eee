//! Tally: idempotent, horizontally scaled account writes over the Celeriant event store.
//!
//! Layers, bottom up: [`store`] (the event-log port and its backends), [`account`] (events,
//! codec, fold and business rules), [`projection`] (per-account state, the recent-writes
//! index and catch-up), [`write_loop`] (the one write loop, with `write_loop::verify` for
//! contested sequences), [`startup`] (the steps a replica finishes before it serves), [`http`] (the hyper
//! front end), [`app`] (wiring), [`config`] and [`metrics`].

pub mod account;
pub mod app;
pub mod config;
pub mod device;
pub mod http;
pub mod metrics;
pub mod projection;
pub mod reader;
pub mod startup;
pub mod store;
pub mod write_loop;
