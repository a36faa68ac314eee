//! The device crate's suites, one test binary (`cargo test -p tally-device --test device`),
//! one module per suite:
//! - [`device_outbox`]: the outbox through a crash at every step; sequences never renumbered;
//! - [`device_sync`]: the sync loop against the server core in this process;
//! - [`device_sim`]: a seeded device simulation;
//! - [`device_cli`]: the `tally-device` binary, killed between steps.
//!
//! The server side of device sync is pinned by the `tally` package's `device` binary
//! (`tests/device/`).

// The workspace's one test-directory helper (tests/common/test_dir.rs of the `tally` package).
#[path = "../../../../tests/common/test_dir.rs"]
mod test_dir;

mod device_cli;
mod device_outbox;
mod device_sim;
mod device_sync;

use std::path::PathBuf;

use test_dir::TestDir;

/// A test's directory (a [`TestDir`]: removed when the test ends, kept and named when it
/// fails) and the outbox file in it, for the suites that work on an outbox file alone.
struct OutboxDir(TestDir);

impl OutboxDir {
    /// `tally-device-{suite}-{name}-...` under the temporary directory.
    fn new(suite: &str, name: &str) -> OutboxDir {
        OutboxDir(TestDir::new(&format!("device-{suite}-{name}")))
    }

    fn file(&self) -> PathBuf {
        self.0.join("outbox.sqlite")
    }
}
