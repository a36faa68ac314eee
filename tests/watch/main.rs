//! The watch streams and the console: black-box over HTTP, over a real Celeriant, and in a
//! real browser.
//!
//! One test binary (`cargo test --test watch`), one module per suite:
//! - [`watch`]: ordering, resume without gap or duplicate, the trim event, limits, a slow
//!   subscriber, clean-up;
//! - [`watch_celeriant`]: two replicas over live Celeriant;
//! - [`watch_browser`]: the console in headless Chromium.
//!
//! Shared helpers live in `tests/common/`.

#[path = "../common/mod.rs"]
mod common;

mod watch;
mod watch_browser;
mod watch_celeriant;
