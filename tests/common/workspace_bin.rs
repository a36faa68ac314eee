//! Binaries of the other workspace members (`tally-load`), which Cargo names to a suite only
//! within their own package (`CARGO_BIN_EXE_*`). They are built into the same directory as
//! this package's `tally`; `cargo test --workspace` (what `make test` runs) builds them before
//! any suite starts. A suite run on its own (`cargo test --test NAME`) does not: then a
//! missing or out-of-date binary is a failure that names the command, never a stale run.
//! The same goes for this package's own `tally` from the release profile, which no test
//! command builds.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The path of workspace member `package`'s binary of the same name, checked to exist and to
/// be newer than every file under `src/` of that member and of the members it builds on
/// (`uses`, directories under `crates/`).
pub fn path(package: &str, uses: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_tally"))
        .parent()
        .expect("a binary lives in a directory");
    let bin = dir.join(format!("{package}{}", std::env::consts::EXE_SUFFIX));
    let build = format!("cargo build --locked -p {package} (make test builds every member)");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("no {} ({e}): build it first: {build}", bin.display()));
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    for member in std::iter::once(&package).chain(uses) {
        // Its sources only: a change to its tests or manifest alone relinks no binary.
        let newest = newest_source(&crates.join(member).join("src"));
        assert!(
            newest <= built,
            "{} is older than the sources of crates/{member}: rebuild it: {build}",
            bin.display()
        );
    }
    bin
}

/// This package's `tally` from the release profile, checked to exist and to be newer than
/// every file under `src/`. For suites that run the binary as deployed, where its speed
/// shapes the load they put on the store.
pub fn release_tally() -> PathBuf {
    let target = Path::new(env!("CARGO_BIN_EXE_tally"))
        .parent()
        .and_then(Path::parent)
        .expect("a binary lives in a profile's directory under the target directory");
    let bin = target
        .join("release")
        .join(format!("tally{}", std::env::consts::EXE_SUFFIX));
    let build = "cargo build --release --locked --bin tally";
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("no {} ({e}): build it first: {build}", bin.display()));
    let newest = newest_source(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(
        newest <= built,
        "{} is older than the sources under src/: rebuild it: {build}",
        bin.display()
    );
    bin
}

/// The latest modification time among the files under `dir`.
fn newest_source(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries =
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("cannot list {}: {e}", d.display()));
        for entry in entries.flatten() {
            let (path, meta) = (entry.path(), entry.metadata().expect("metadata"));
            if meta.is_dir() {
                pending.push(path);
            } else if let Ok(t) = meta.modified() {
                newest = newest.max(t);
            }
        }
    }
    newest
}
