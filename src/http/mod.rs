//! The hyper front end. Under hyper, on each connection's socket: the gate (`gate`: how
//! many requests are worked on at once, before they are read) and the head guard (`head`:
//! an over-long head answered in the API's shape). Over it, each request goes through the
//! edge's layers (`layer`: route, metrics, access log, `Host`, auth, readiness, admission,
//! backstop) to the handlers (`router`). `serve` runs the API listener and `admin` the
//! optional admin one.

mod accounts;
mod admin;
mod admission;
mod answer;
pub mod auth;
mod batch;
pub mod body;
pub mod config;
mod console;
mod deadline;
mod detach;
mod devices;
pub mod error;
pub mod gate;
mod gauge;
pub mod head;
mod headers;
mod holds;
pub mod idempotency;
mod layer;
pub mod openapi;
mod ops;
mod peer;
pub mod response;
pub mod router;
mod serve;
pub mod watch;
mod write_lookup;
mod write_stall;
mod writes;

pub use admin::serve_admin;
pub use serve::serve;
