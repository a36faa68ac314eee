//! The Postgres projection in tests: a fresh schema per test in the throwaway
//! cluster that `scripts/with-postgres.sh` starts (it exports `TALLY_TEST_POSTGRES_URL`).
//!
//! Without that variable the Postgres tests are skipped, except under `CI=true`, where a
//! missing database is a failure: CI must never pass by skipping them.

use std::sync::atomic::{AtomicU64, Ordering};

/// The variable naming the test cluster.
pub const URL_VAR: &str = "TALLY_TEST_POSTGRES_URL";
/// Set to `postgres` to run the suites that honour it ([`projection_flags`]) on the
/// Postgres projection.
pub const PROJECTION_VAR: &str = "TALLY_TEST_PROJECTION";

/// The test cluster's URL; `None` (the test skips) when unset outside CI.
pub fn base_url() -> Option<String> {
    super::required::var(
        URL_VAR,
        "run the tests through scripts/with-postgres.sh (make test does)",
    )
}

/// A URL to a schema of its own in the test cluster (created empty), so tests running in
/// parallel never see each other's rows; several replicas given the same URL share it.
pub async fn fresh_url() -> Option<String> {
    let base = base_url()?;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let schema = format!(
        "t_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        uuid::Uuid::new_v4().simple()
    );
    let client = connect(&base).await;
    client
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .expect("create the test schema");
    let sep = if base.contains('?') { '&' } else { '?' };
    Some(format!("{base}{sep}options=-csearch_path%3D{schema}"))
}

/// The schema for an instance over `store`: instances over one store share one schema (a
/// fleet shares its database as it shares its store); an instance with a store of its own
/// gets a fresh one. The map keeps each store alive, so its address is never reused by
/// another test's store.
pub async fn url_for_store(store: Option<&tally::store::SharedLog>) -> Option<String> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    type Shared = Mutex<HashMap<usize, (tally::store::SharedLog, String)>>;
    static SHARED: std::sync::OnceLock<Shared> = std::sync::OnceLock::new();
    let Some(store) = store else {
        return fresh_url().await;
    };
    let addr = std::sync::Arc::as_ptr(store).cast::<()>() as usize;
    let shared = SHARED.get_or_init(Default::default);
    if let Some((_, url)) = shared.lock().expect("schema map").get(&addr) {
        return Some(url.clone());
    }
    let url = fresh_url().await?;
    let mut map = shared.lock().expect("schema map");
    let entry = map.entry(addr).or_insert_with(|| (store.clone(), url));
    Some(entry.1.clone())
}

/// A plain connection (for tests that look at or tamper with the tables).
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test Postgres");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// The flags that put an instance on the Postgres projection at `url`.
pub fn flags(url: &str) -> Vec<String> {
    vec![
        "--projection".into(),
        "postgres".into(),
        "--postgres-url".into(),
        url.into(),
    ]
}

/// Whether the suites that honour it run on the Postgres projection in this run.
pub fn suite_on_postgres() -> bool {
    std::env::var(PROJECTION_VAR).is_ok_and(|v| v == "postgres")
}
