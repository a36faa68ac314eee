//! A request head over `--max-header-bytes` answered with the API's JSON error: 414
//! `URI_TOO_LONG` when the request line alone passes the limit, 431 `HEADERS_TOO_LARGE`
//! when the header fields do (or number more than hyper's 100), and the connection closed.
//!
//! hyper refuses such a head itself, before there is a request to route, and answers it
//! with a status and an empty body. hyper stays the one judge of a head (its limits are
//! unchanged, and with them what a connection may buffer): [`HeadGuard`], around a
//! connection's socket, replaces that answer on its way out with the JSON one, in the same
//! place in the connection's answers, so answers to requests pipelined before it still go
//! first. Which of the two statuses it is comes from [`HeadScan`], which follows the
//! request stream's framing as hyper reads it (heads, `Content-Length` and chunked bodies)
//! to know where each head starts and whether its request line ended within the limit.
//!
//! Where the scan cannot follow the framing (an upgrade, conflicting lengths: requests hyper
//! refuses or closes the connection after), a later refusal is the 431.

mod chunked;
mod guard;
mod scan;

pub use guard::HeadGuard;
pub use scan::{HeadScan, Over};
