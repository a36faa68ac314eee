//! `/metrics` after a scripted sequence (a write, a replay, a key reuse, a forced conflict):
//! each counter moved by exactly the expected amount.

use crate::common;

use common::{metric_sample as sample, new_account, spawn_fleet_in_memory};

#[tokio::test]
async fn counters_move_by_exactly_what_the_scripted_sequence_did() {
    let fleet = spawn_fleet_in_memory(2, &[]).await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let acct = new_account();
    // The start-up store checks (the epoch's create-only write, or its read) are done before
    // the script starts; the store's counters below count from here.
    for replica in &fleet {
        replica.app.projection.store_checked(1).await;
    }
    let before = a.get("/metrics").await.text;
    let store_delta = |t: &str, name: &str| sample(t, name) - sample(&before, name);

    // A write (cold account: one catch-up, one write).
    assert_eq!(a.deposit(&acct, 100, Some("k1")).await.status, 200);
    // A replay, answered from A's index without touching the store.
    assert!(a.deposit(&acct, 100, Some("k1")).await.replayed());
    // A key reuse, refused.
    assert_eq!(a.deposit(&acct, 200, Some("k1")).await.status, 422);
    // Replica B moves the stream, so A's next write (at A's stale cursor) conflicts once,
    // catches up, and lands.
    assert_eq!(b.deposit(&acct, 50, Some("k2")).await.status, 200);
    assert_eq!(a.deposit(&acct, 10, Some("k3")).await.status, 200);

    let m = a.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert!(
        m.header("content-type")
            .unwrap_or("")
            .starts_with("text/plain"),
        "{:?}",
        m.headers
    );
    let t = &m.text;
    let arm = |arm: &str| {
        sample(
            t,
            &format!("tally_write_outcomes_total{{arm=\"{arm}\",operation=\"deposit\"}}"),
        )
    };
    assert_eq!(arm("success"), 2.0, "k1 and k3 landed on A\n{t}");
    assert_eq!(arm("replayed"), 1.0);
    assert_eq!(arm("conflict"), 1.0);
    assert_eq!(arm("outcome_unknown"), 0.0);
    assert_eq!(sample(t, "tally_idempotency_replays_total"), 1.0);
    assert_eq!(sample(t, "tally_idempotency_key_reuse_total"), 1.0);
    assert_eq!(sample(t, "tally_idempotency_keys_minted_total"), 0.0);
    let http = |class: &str| {
        sample(
            t,
            &format!(
                "tally_http_requests_total{{method=\"POST\",route=\"/api/accounts/{{id}}/deposit\",status_class=\"{class}\"}}"
            ),
        )
    };
    assert_eq!(http("2xx"), 3.0);
    assert_eq!(http("4xx"), 1.0);
    // Round trips: k1 = write (a first touch: the catch-up it starts beside the write is
    // cancelled once the write lands); replay and reuse = none (local fold); k3 = write
    // (conflict) + catch-up + write.
    assert_eq!(sample(t, "tally_store_round_trips_per_write_count"), 4.0);
    assert_eq!(sample(t, "tally_store_round_trips_per_write_sum"), 4.0);
    assert_eq!(
        store_delta(
            t,
            "tally_store_requests_total{operation=\"write\",result=\"conflict\"}"
        ),
        1.0
    );
    // k1 and k3.
    assert_eq!(
        store_delta(
            t,
            "tally_store_requests_total{operation=\"write\",result=\"ok\"}"
        ),
        2.0
    );
    // B's own registry saw only its own write: replicas never mix their counts.
    let mb = b.get("/metrics").await.text;
    assert_eq!(
        sample(
            &mb,
            "tally_write_outcomes_total{arm=\"success\",operation=\"deposit\"}"
        ),
        1.0
    );
    // No account id ever appears in a label.
    assert!(!t.contains(&acct), "an account id leaked into /metrics");
}

/// Rule: every series an alert counts with `increase(...)` exists on a fresh replica, at 0.
/// A labelled counter has no series until its first increment, and `increase` over a series
/// that goes from absent to 1 is 0: the alert on the store going backwards never paged for
/// a first regression. (Rate-over-rate alerts need a sustained condition,
/// which outlives a series' first scrape.) Checks each selector inside `increase(` in the
/// committed rules (`=` and `=~` matchers) against `Metrics::new()`'s exposition.
#[test]
fn every_series_an_alert_counts_exists_from_start() {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/prometheus/tally-alerts.yaml"
    ))
    .expect("alert rules");
    let text = tally::metrics::Metrics::new().render();
    let series: Vec<(&str, &str)> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            l.split_once(' ')
                .map(|(s, _)| s.split_once('{').unwrap_or((s, "")))
        })
        .collect();
    let mut checked = 0;
    for counted in rules.split("increase(").skip(1) {
        let end = counted.find('[').expect("a range after the selector");
        let selector = &counted[..end];
        let (name, matchers) = match selector.split_once('{') {
            Some((name, m)) => (name, m.trim_end_matches('}')),
            None => (selector, ""),
        };
        let wanted = matchers_of(matchers);
        let found = series.iter().any(|(series_name, labels)| {
            *series_name == name
                && wanted.iter().all(|(label, values)| {
                    values
                        .iter()
                        .any(|v| labels.contains(&format!("{label}=\"{v}\"")))
                })
        });
        assert!(
            found,
            "no series {selector} on a fresh replica: its alert cannot see a first change\n{text}"
        );
        checked += 1;
    }
    assert!(checked >= 4, "the rules were read ({checked} selectors)");
}

/// The `=` and `=~` matchers of a selector body: (label, accepted values).
fn matchers_of(matchers: &str) -> Vec<(&str, Vec<&str>)> {
    matchers
        .split(',')
        .filter_map(|m| {
            let m = m.trim();
            if m.is_empty() || m.contains("!~") || m.contains("!=") {
                return None;
            }
            if let Some((label, value)) = m.split_once("=~") {
                return Some((label.trim(), value.trim_matches('"').split('|').collect()));
            }
            let (label, value) = m.split_once('=')?;
            Some((label.trim(), vec![value.trim_matches('"')]))
        })
        .collect()
}

/// Rule: every metric a replica exports is named in the docs (the table in
/// docs/operations.md, "Observability", or the page of the feature it counts), so an operator
/// can look any of them up.
#[test]
fn every_exported_metric_is_named_in_the_docs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README");
    let mut pages: Vec<_> = std::fs::read_dir(format!("{root}/docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    for page in pages {
        readme += &std::fs::read_to_string(&page).expect("docs page");
    }
    let text = tally::metrics::Metrics::new().render();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert!(names.len() > 40, "{names:?}");
    let missing: Vec<&&str> = names
        .iter()
        .filter(|n| !readme.contains(&format!("`{n}")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in README.md or docs/*.md: {missing:?}"
    );
}
