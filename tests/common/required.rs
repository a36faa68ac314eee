//! Real parts a suite needs (a Celeriant server, the replaced service, a Postgres cluster, a
//! browser), found from the environment, with one rule for when one is missing: outside CI
//! the test says it skipped and how to run it, and passes; under `CI=true` it fails, because
//! CI must never pass by skipping. `make test` provides every part (`scripts/with-celeriant.sh`,
//! `scripts/with-postgres.sh`, the `browser` target).

/// The variable naming the standalone server whose accounts share one shard.
pub const CELERIANT_ADDRESS: &str = "CELERIANT_ADDRESS";
/// The variable naming a server with two shards routed by aggregate id.
pub const CELERIANT_SHARDED_ADDRESS: &str = "CELERIANT_SHARDED_ADDRESS";
/// The variable naming the replaced service's binary.
pub const CELERIANT_REFERENCE_BIN: &str = "CELERIANT_REFERENCE_BIN";

const CELERIANT_HOW: &str = "run through scripts/with-celeriant.sh (make test does), which starts \
    servers from CELERIANT_BIN or ../shared/celeriant/; or set CELERIANT_ADDRESS=HOST:PORT";

/// Whether this run is CI's, where nothing may pass by skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Says a test skipped because `what` is missing, or fails under CI (and whenever `require`
/// is set): the one place a real-part suite decides to skip.
pub fn skip_or_fail(what: &str, how: &str, require: bool) {
    assert!(
        !(require || in_ci()),
        "{what}, and this run must not skip: {how}"
    );
    eprintln!("skipped: {what} ({how})");
}

/// The value of `var` when it is set and not empty; otherwise skips (or fails under CI).
pub fn var(var: &str, how: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(value) if !value.is_empty() => Some(value),
        _ => {
            skip_or_fail(&format!("{var} not set"), how, false);
            None
        }
    }
}

/// The real server every real-server suite runs against.
pub fn celeriant_address() -> Option<String> {
    var(CELERIANT_ADDRESS, CELERIANT_HOW)
}

/// A real server with two shards routed by aggregate id.
pub fn celeriant_sharded_address() -> Option<String> {
    var(CELERIANT_SHARDED_ADDRESS, CELERIANT_HOW)
}

/// The replaced service's binary, and the server it is to share with Tally.
pub fn celeriant_reference() -> Option<(String, String)> {
    let bin = var(CELERIANT_REFERENCE_BIN, CELERIANT_HOW)?;
    Some((bin, celeriant_address()?))
}
