//! A directory for one test (`tempfile` makes and removes it): removed when the test ends,
//! kept when it fails, and named on stderr, for a look at what it left.
//!
//! The device crate's suites (`crates/tally-device/tests/device/`, another package) take this
//! file alone by `#[path]`, without the rest of `common`, and may not use all of it: hence
//! `dead_code` is allowed here as well as in `common`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub struct TestDir(tempfile::TempDir);

impl TestDir {
    /// A fresh directory under the system's temporary directory, its name starting `label`.
    pub fn new(label: &str) -> TestDir {
        TestDir::under(&std::env::temp_dir(), label)
    }

    /// On tmpfs when the machine has one (`/dev/shm`): for suites that crash in process and
    /// so need no durability, where every fsync would only cost time.
    pub fn in_memory(label: &str) -> TestDir {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            TestDir::under(shm, label)
        } else {
            TestDir::new(label)
        }
    }

    fn under(base: &Path, label: &str) -> TestDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("tally-{label}-"))
            .tempdir_in(base)
            .unwrap_or_else(|e| panic!("a test directory under {}: {e}", base.display()));
        TestDir(dir)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// `name` inside the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.disable_cleanup(true);
            eprintln!(
                "kept the failed test's directory {}",
                self.0.path().display()
            );
        }
    }
}
