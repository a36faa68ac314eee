//! The gate: how many requests a replica works on at once, enforced *before a request is
//! read*, with a limit that adapts to how busy the CPU is ([`limit`]).
//!
//! A connection takes a slot when its next request's bytes arrive and before it reads
//! them; the request keeps the slot until it is answered. Past the limit, a connection
//! waits (first come, first served) with its request still in the kernel's socket buffer:
//! no task polled, no buffer filled, no head parsed. That is socket-level backpressure, the
//! way Netty's `autoRead` off or an HTTP/2 server's stream limit push back.
//!
//! Why before reading: under overload a server that parses every request it can and queues
//! the rest behind an in-flight limit keeps every waiting request's state alive, and each
//! is touched cold when its turn comes. Measured on the embedded store with the server on
//! one core and 1,500 connections re-sending at once (wrk): the in-flight limit after
//! parsing kept 0.57-0.63 of the server's peak goodput; gated before reading, 16 at a time,
//! 0.75-0.78. Whatever the limit after parsing (64 or 2,048), it stayed under 0.7.
//!
//! The edge's in-flight limit with its queue wait and 503 (`admission`) stays behind the
//! gate as the hard cap, for requests that reach a handler without passing the gate.
//!
//! The parts: [`limit`] (the adaptive limit), `slots` (the slots and the queue of waiting
//! connections), `conn` (a connection's side, the rules a request meets) and `io` (the socket
//! wrapper under hyper).

mod conn;
mod io;
pub mod limit;
mod slots;

pub use conn::{ConnSlot, Streaming};
pub use io::GatedIo;
pub use slots::{Gate, Ticking};
