//! Conformance suite for the event-log port.
//!
//! Every rule is written once, in [`rules`], as an async function over a [`SharedLog`] and a
//! [`Keys`] generator that mints fresh aggregate keys and client ids (uuid v4), so runs never
//! collide on a shared server. [`conformance_suite!`] turns the rules into one `#[tokio::test]`
//! per rule for a backend:
//!
//! ```ignore
//! conformance_suite!(memory, || async { Arc::new(MemoryLog::new()) as SharedLog });
//! conformance_suite!(celeriant, gate = required::celeriant_address, |address: String| async move {
//!     Arc::new(CeleriantLog::connect(&address).await.unwrap()) as SharedLog
//! });
//! ```
//!
//! The second form runs when its gate names a backend; when it does not, the gate has said the
//! test skipped (or failed it, under `CI=true`: `common/required.rs`). Tests that need MemoryLog internals (a manual clock, a small page size) live in
//! [`memory_only`]; those that script the fault injector in [`fault_injector`]. The lost-ack
//! rule of multi-aggregate writes needs a second client that loses acknowledgements, so it
//! runs on its own: on the fault injector there and on the real server in
//! [`celeriant_lost_ack`].

use crate::common::required;

use std::sync::Arc;

use tally::store::faults::{FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{EventLog, SharedLog};

/// Generates one `#[tokio::test]` per conformance rule, in a module named `$suite`.
///
/// `conformance_suite!(name, factory)`: `factory()` returns a future of a [`SharedLog`].
/// `conformance_suite!(name, gate = gate_fn, factory)`: runs only when `gate_fn()` names a
/// backend; `factory(name)` returns a future of a [`SharedLog`].
macro_rules! conformance_suite {
    ($suite:ident, gate = $gate:expr, $factory:expr) => {
        conformance_suite!(@rules $suite, {
            match ($gate)() {
                Some(value) => Some(($factory)(value).await),
                None => None,
            }
        });
    };
    ($suite:ident, $factory:expr) => {
        conformance_suite!(@rules $suite, { Some(($factory)().await) });
    };
    (@rules $suite:ident, $make:block) => {
        conformance_suite!(@tests $suite, $make, [
            write_appends_one_batch_per_write_and_versions_start_at_one,
            write_returns_versions_in_request_order,
            write_to_missing_aggregate_without_allow_create_is_not_found,
            expected_version_zero_means_must_not_exist,
            version_guard_conflict_reports_expected_and_current,
            existence_is_checked_before_the_version_guard,
            the_leader_tip_probe_names_the_tip_and_lands_nothing,
            retried_conditional_write_that_landed_gets_conflict_not_idempotency_violation,
            retry_with_refreshed_expected_version_gets_idempotency_violation,
            idempotency_rejects_lowest_seq_at_or_below_the_mark,
            idempotency_is_scoped_per_client_id,
            idempotency_is_scoped_per_aggregate,
            mark_moves_on_unenforced_writes,
            mark_never_moves_down,
            multi_aggregate_write_fails_whole_when_one_leg_fails_the_version_guard,
            multi_aggregate_write_fails_whole_when_one_leg_fails_idempotency,
            multi_aggregate_write_fails_whole_when_one_leg_is_missing,
            a_write_refused_for_a_missing_aggregate_moves_no_mark,
            failed_create_leaves_no_aggregate_behind,
            empty_write_is_rejected_with_code_2000,
            event_type_major_zero_is_rejected_with_code_2001,
            server_timestamps_are_non_decreasing,
            read_of_missing_aggregate_is_not_found,
            read_returns_events_as_written,
            read_from_version_zero_reads_from_one,
            read_past_the_tip_is_empty,
            read_to_version_is_inclusive,
            filter_min_client_seq_keeps_batches_whose_highest_seq_reaches_it,
            filter_max_client_seq_keeps_batches_whose_lowest_seq_is_within_it,
            filter_client_id_keeps_only_that_writer,
            filter_min_server_timestamp_is_inclusive,
            batch_stream_visits_every_batch_exactly_once_in_order,
            details_report_bounds_and_last_server_timestamp,
            details_of_missing_aggregate_is_not_found,
            trim_drops_batches_below_keep_from_and_keeps_versions,
            read_below_the_trim_point_is_trimmed_with_min_available,
            client_mark_survives_trim,
            trim_beyond_the_tip_is_rejected,
            trim_of_missing_aggregate_is_not_found,
            concurrent_conditional_writers_exactly_one_wins_per_version,
            multi_aggregate_write_is_never_torn_under_concurrency,
            // Multi-aggregate writes with failing members, as the real server answers them.
            multi_aggregate_conflict_applies_no_member_and_moves_no_mark,
            multi_aggregate_idempotency_violation_applies_no_member_and_moves_no_mark,
            multi_aggregate_write_with_a_missing_member_applies_none_and_creates_none,
            multi_aggregate_write_failing_for_several_reasons_answers_in_the_port_order,
            multi_aggregate_conflict_names_the_first_stale_member_in_request_order,
            multi_aggregate_idempotency_violation_reports_one_violating_members_sequences,
            multi_aggregate_idempotency_judges_each_member_by_its_own_lowest_sequence,
            multi_aggregate_write_moves_each_members_mark_to_its_own_highest_sequence,
            duplicate_of_a_landed_multi_aggregate_write_is_a_conflict_then_an_idempotency_violation,
            // The watch.
            watch_reports_each_commit_after_it_opened_in_version_order,
            watch_reports_every_writer_and_never_a_failed_write,
            watch_reports_only_the_aggregates_its_filter_admits,
            // Checkpoints (`projection/checkpoint.rs`) and the trims retention makes.
            a_checkpoint_round_trips_through_its_stream_and_one_position_takes_one,
            a_keyed_checkpoint_carrying_the_largest_segment_round_trips,
            a_read_at_the_trim_point_returns_that_batch_unchanged_and_details_say_where_history_begins,
        ]);
    };
    (@tests $suite:ident, $make:block, [$($rule:ident),* $(,)?]) => {
        mod $suite {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let made: Option<tally::store::SharedLog> = $make;
                    if let Some(log) = made {
                        super::rules::$rule(log, super::rules::Keys::random()).await;
                    }
                }
            )*
        }
    };
}

conformance_suite!(memory, || async { Arc::new(MemoryLog::new()) as SharedLog });

// A FaultyLog with no faults configured must be a transparent decorator.
conformance_suite!(faulty_without_faults, || async {
    let inner: SharedLog = Arc::new(MemoryLog::new());
    Arc::new(FaultyLog::new(inner, FaultConfig::default())) as SharedLog
});

// The real server CELERIANT_ADDRESS names.
conformance_suite!(
    celeriant,
    gate = required::celeriant_address,
    |address: String| async move {
        let cfg = tally::store::celeriant::CeleriantConfig {
            address,
            ..Default::default()
        };
        Arc::new(tally::store::celeriant::CeleriantLog::connect(&cfg).expect("Celeriant config"))
            as SharedLog
    }
);

/// The rules, each a function of the backend under test.
mod rules {
    pub use super::checkpoint_rules::*;
    pub use super::multi_rules::*;
    pub use super::watch_rules::*;

    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;

    use bytes::Bytes;
    use tally::store::{
        AggregateKey, AggregateWrite, BatchStream, ClientId, Event, EventType, ReadFilter,
        SharedLog, StoreError,
    };
    use tokio::task::JoinSet;

    /// Mints fresh keys and client ids. The org and aggregate type are fixed per run.
    pub struct Keys {
        pub org_id: u128,
        pub aggregate_type_id: u128,
    }

    impl Keys {
        pub fn random() -> Self {
            Self {
                org_id: uuid::Uuid::new_v4().as_u128(),
                aggregate_type_id: uuid::Uuid::new_v4().as_u128(),
            }
        }

        /// A key nobody has written to.
        pub fn key(&self) -> AggregateKey {
            AggregateKey {
                org_id: self.org_id,
                aggregate_type_id: self.aggregate_type_id,
                aggregate_id: uuid::Uuid::new_v4().as_u128(),
            }
        }

        /// A client id nobody has written with.
        pub fn client(&self) -> ClientId {
            uuid::Uuid::new_v4().as_u128()
        }
    }

    pub fn event(seq: u64) -> Event {
        Event {
            client_seq: seq,
            event_id: Some(u128::from(seq) << 64 | 0xabc),
            event_type: EventType { major: 1, minor: 0 },
            payload: Bytes::from(format!("payload-{seq}")),
            timestamp_ms: 1_700_000_000_000 + seq,
        }
    }

    /// A write of events with the given sequences.
    pub fn write(
        key: AggregateKey,
        seqs: &[u64],
        expected_version: Option<u64>,
        enforce: bool,
    ) -> AggregateWrite {
        AggregateWrite {
            key,
            events: seqs.iter().copied().map(event).collect(),
            expected_version,
            allow_create: true,
            enforce_client_idempotency: enforce,
        }
    }

    async fn versions(log: &SharedLog, key: AggregateKey) -> Vec<u64> {
        let mut out = Vec::new();
        let mut stream = BatchStream::new(&**log, key, ReadFilter::default());
        while let Some(page) = stream.next_page().await.expect("read") {
            out.extend(page.iter().map(|b| b.version));
        }
        out
    }

    async fn max_version(log: &SharedLog, key: AggregateKey) -> u64 {
        log.details(key).await.expect("details").max_version
    }

    async fn read_versions(log: &SharedLog, key: AggregateKey, filter: ReadFilter) -> Vec<u64> {
        let mut out = Vec::new();
        let mut stream = BatchStream::new(&**log, key, filter);
        while let Some(page) = stream.next_page().await.expect("read") {
            out.extend(page.iter().map(|b| b.version));
        }
        out
    }

    pub async fn write_appends_one_batch_per_write_and_versions_start_at_one(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        assert_eq!(
            log.write(c, vec![write(key, &[1, 2, 3], None, true)]).await,
            Ok(vec![1])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[4], None, true)]).await,
            Ok(vec![2])
        );
        let page = log.read(key, &ReadFilter::default()).await.expect("read");
        assert_eq!(page.batches.len(), 2, "{key:?}");
        assert_eq!(page.batches[0].version, 1);
        assert_eq!(page.batches[0].events.len(), 3);
        assert_eq!(page.batches[1].version, 2);
        assert_eq!(page.batches[1].events.len(), 1);
        assert_eq!(page.next_version, None);
    }

    pub async fn write_returns_versions_in_request_order(log: SharedLog, k: Keys) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(c, vec![write(b, &[1], None, false)])
            .await
            .expect("seed b");
        log.write(c, vec![write(b, &[2], None, false)])
            .await
            .expect("seed b");
        let got = log
            .write(
                c,
                vec![write(b, &[3], None, false), write(a, &[1], None, false)],
            )
            .await;
        assert_eq!(got, Ok(vec![3, 1]), "a={a:?} b={b:?}");
        let got = log
            .write(
                c,
                vec![write(a, &[2], None, false), write(b, &[4], None, false)],
            )
            .await;
        assert_eq!(got, Ok(vec![2, 4]));
    }

    pub async fn write_to_missing_aggregate_without_allow_create_is_not_found(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        let mut w = write(key, &[1], None, true);
        w.allow_create = false;
        assert_eq!(
            log.write(c, vec![w.clone()]).await,
            Err(StoreError::AggregateNotFound)
        );
        assert_eq!(log.details(key).await, Err(StoreError::AggregateNotFound));
        // Once it exists, allow_create=false writes append.
        log.write(c, vec![write(key, &[1], None, true)])
            .await
            .expect("create");
        w.events = vec![event(2)];
        assert_eq!(log.write(c, vec![w]).await, Ok(vec![2]));
    }

    pub async fn expected_version_zero_means_must_not_exist(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        assert_eq!(
            log.write(c, vec![write(key, &[1], Some(0), true)]).await,
            Ok(vec![1])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[2], Some(0), true)]).await,
            Err(StoreError::Conflict {
                expected: 0,
                current: 1
            })
        );
    }

    pub async fn version_guard_conflict_reports_expected_and_current(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1], None, true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[2], None, true)])
            .await
            .expect("v2");
        assert_eq!(
            log.write(c, vec![write(key, &[3], Some(1), true)]).await,
            Err(StoreError::Conflict {
                expected: 1,
                current: 2
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[3], Some(7), true)]).await,
            Err(StoreError::Conflict {
                expected: 7,
                current: 2
            })
        );
        // A missing aggregate is at version 0.
        let fresh = k.key();
        assert_eq!(
            log.write(c, vec![write(fresh, &[1], Some(3), true)]).await,
            Err(StoreError::Conflict {
                expected: 3,
                current: 0
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[3], Some(2), true)]).await,
            Ok(vec![3])
        );
    }

    /// `leader_tip` is a write guarded at a version no stream reaches: the guard refuses it
    /// and names the current version. It must never land, create an aggregate, or move a
    /// mark, whoever wrote the aggregate and whatever its marks are.
    pub async fn the_leader_tip_probe_names_the_tip_and_lands_nothing(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        // An aggregate that does not exist is at 0, and the probe does not create it.
        assert_eq!(log.leader_tip(c, key).await, Ok(0));
        assert_eq!(
            log.read(key, &ReadFilter::default())
                .await
                .map(|p| p.batches.len()),
            Err(StoreError::AggregateNotFound)
        );
        // Another writer's aggregate, on which this client holds no mark.
        let other = k.client();
        log.write(other, vec![write(key, &[1], None, true)])
            .await
            .expect("v1");
        log.write(other, vec![write(key, &[2], None, true)])
            .await
            .expect("v2");
        assert_eq!(log.leader_tip(c, key).await, Ok(2));
        assert_eq!(log.leader_tip(other, key).await, Ok(2));
        assert_eq!(versions(&log, key).await, vec![1, 2]);
        assert_eq!(log.details(key).await.map(|d| d.max_version), Ok(2));
        // No mark moved: the writer's next sequence still lands, and this client's first.
        assert_eq!(
            log.write(other, vec![write(key, &[3], Some(2), true)])
                .await,
            Ok(vec![3])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[1], Some(3), true)]).await,
            Ok(vec![4])
        );
        assert_eq!(log.leader_tip(c, key).await, Ok(4));
    }

    pub async fn existence_is_checked_before_the_version_guard(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        let mut w = write(key, &[1], Some(5), true);
        w.allow_create = false;
        assert_eq!(
            log.write(c, vec![w]).await,
            Err(StoreError::AggregateNotFound)
        );
    }

    pub async fn retried_conditional_write_that_landed_gets_conflict_not_idempotency_violation(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1], Some(0), true)])
            .await
            .expect("v1");
        let attempt = write(key, &[2], Some(1), true);
        assert_eq!(log.write(c, vec![attempt.clone()]).await, Ok(vec![2]));
        // The same request again (its ack was lost): the version moved, so 2003.
        assert_eq!(
            log.write(c, vec![attempt]).await,
            Err(StoreError::Conflict {
                expected: 1,
                current: 2
            })
        );
    }

    pub async fn retry_with_refreshed_expected_version_gets_idempotency_violation(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1], Some(0), true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[2], Some(1), true)])
            .await
            .expect("v2");
        let fresh = max_version(&log, key).await;
        assert_eq!(
            log.write(c, vec![write(key, &[2], Some(fresh), true)])
                .await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(2),
                attempted_seq: Some(2)
            })
        );
        assert_eq!(max_version(&log, key).await, 2, "nothing appended");
    }

    pub async fn idempotency_rejects_lowest_seq_at_or_below_the_mark(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[5], None, true)])
            .await
            .expect("seq 5");
        assert_eq!(
            log.write(c, vec![write(key, &[5], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(5),
                attempted_seq: Some(5)
            })
        );
        // Judged by the lowest sequence of the write, whatever the order of events.
        assert_eq!(
            log.write(c, vec![write(key, &[9, 3, 7], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(5),
                attempted_seq: Some(3)
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[6, 7], None, true)]).await,
            Ok(vec![2])
        );
        assert_eq!(
            log.write(c, vec![write(key, &[7], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(7),
                attempted_seq: Some(7)
            })
        );
        assert_eq!(versions(&log, key).await, vec![1, 2]);
    }

    pub async fn idempotency_is_scoped_per_client_id(log: SharedLog, k: Keys) {
        let (key, c1, c2) = (k.key(), k.client(), k.client());
        log.write(c1, vec![write(key, &[10], None, true)])
            .await
            .expect("c1");
        assert_eq!(
            log.write(c2, vec![write(key, &[1], None, true)]).await,
            Ok(vec![2])
        );
        assert!(matches!(
            log.write(c1, vec![write(key, &[1], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(10),
                attempted_seq: Some(1)
            })
        ));
    }

    pub async fn idempotency_is_scoped_per_aggregate(log: SharedLog, k: Keys) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(c, vec![write(a, &[10], None, true)])
            .await
            .expect("a");
        assert_eq!(
            log.write(c, vec![write(b, &[1], None, true)]).await,
            Ok(vec![1])
        );
    }

    pub async fn mark_moves_on_unenforced_writes(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[500], None, false)])
            .await
            .expect("unenforced 500");
        assert_eq!(
            log.write(c, vec![write(key, &[8], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(500),
                attempted_seq: Some(8)
            })
        );
        // Unenforced writes below the mark still land.
        assert_eq!(
            log.write(c, vec![write(key, &[8], None, false)]).await,
            Ok(vec![2])
        );
    }

    pub async fn mark_never_moves_down(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[500], None, false)])
            .await
            .expect("500");
        log.write(c, vec![write(key, &[10], None, false)])
            .await
            .expect("10");
        assert_eq!(
            log.write(c, vec![write(key, &[500], None, true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(500),
                attempted_seq: Some(500)
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[501], None, true)]).await,
            Ok(vec![3])
        );
    }

    pub async fn multi_aggregate_write_fails_whole_when_one_leg_fails_the_version_guard(
        log: SharedLog,
        k: Keys,
    ) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(
            c,
            vec![write(a, &[1], None, true), write(b, &[1], None, true)],
        )
        .await
        .expect("seed");
        let got = log
            .write(
                c,
                vec![write(a, &[2], Some(1), true), write(b, &[2], Some(0), true)],
            )
            .await;
        assert_eq!(
            got,
            Err(StoreError::Conflict {
                expected: 0,
                current: 1
            }),
            "{a:?} {b:?}"
        );
        assert_eq!(
            versions(&log, a).await,
            vec![1],
            "leg a must not be appended"
        );
        assert_eq!(versions(&log, b).await, vec![1]);
        // The failed write moved no mark: its sequences are still free on both legs.
        let got = log
            .write(
                c,
                vec![write(a, &[2], Some(1), true), write(b, &[2], Some(1), true)],
            )
            .await;
        assert_eq!(got, Ok(vec![2, 2]));
    }

    pub async fn multi_aggregate_write_fails_whole_when_one_leg_fails_idempotency(
        log: SharedLog,
        k: Keys,
    ) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(c, vec![write(a, &[1], None, true)])
            .await
            .expect("a1");
        log.write(c, vec![write(b, &[9], None, true)])
            .await
            .expect("b9");
        // The version guard passes on both; idempotency fails on b only.
        let got = log
            .write(
                c,
                vec![write(a, &[2], Some(1), true), write(b, &[5], Some(1), true)],
            )
            .await;
        assert_eq!(
            got,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(9),
                attempted_seq: Some(5)
            })
        );
        assert_eq!(
            versions(&log, a).await,
            vec![1],
            "leg a must not be appended"
        );
        assert_eq!(versions(&log, b).await, vec![1]);
        // a's mark did not move to 2.
        assert_eq!(
            log.write(c, vec![write(a, &[2], Some(1), true)]).await,
            Ok(vec![2])
        );
    }

    pub async fn multi_aggregate_write_fails_whole_when_one_leg_is_missing(
        log: SharedLog,
        k: Keys,
    ) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(c, vec![write(a, &[1], None, true)])
            .await
            .expect("a1");
        let mut missing = write(b, &[1], None, true);
        missing.allow_create = false;
        // b is missing: existence fails first, even though a also fails its version guard.
        let got = log
            .write(c, vec![write(a, &[2], Some(7), true), missing])
            .await;
        assert_eq!(got, Err(StoreError::AggregateNotFound));
        assert_eq!(versions(&log, a).await, vec![1]);
    }

    /// A device's run refused because its account does not exist yet (explicit accounts)
    /// is sent again, the same sequences, once the account is opened: the refusal must
    /// not have used them.
    pub async fn a_write_refused_for_a_missing_aggregate_moves_no_mark(log: SharedLog, k: Keys) {
        let (key, device, service) = (k.key(), k.client(), k.client());
        let mut run = write(key, &[1, 2], None, true);
        run.allow_create = false;
        assert_eq!(
            log.write(device, vec![run.clone()]).await,
            Err(StoreError::AggregateNotFound)
        );
        log.write(service, vec![write(key, &[1], Some(0), true)])
            .await
            .expect("opened by another writer");
        assert_eq!(log.write(device, vec![run]).await, Ok(vec![2]));
    }

    pub async fn failed_create_leaves_no_aggregate_behind(log: SharedLog, k: Keys) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        log.write(c, vec![write(b, &[1], None, true)])
            .await
            .expect("b1");
        let got = log
            .write(
                c,
                vec![write(a, &[1], Some(0), true), write(b, &[2], Some(0), true)],
            )
            .await;
        assert_eq!(
            got,
            Err(StoreError::Conflict {
                expected: 0,
                current: 1
            })
        );
        assert_eq!(log.details(a).await, Err(StoreError::AggregateNotFound));
        assert_eq!(
            log.read(a, &ReadFilter::default())
                .await
                .map(|p| p.batches.len()),
            Err(StoreError::AggregateNotFound)
        );
        let mut append = write(a, &[1], None, true);
        append.allow_create = false;
        assert_eq!(
            log.write(c, vec![append]).await,
            Err(StoreError::AggregateNotFound)
        );
    }

    pub async fn empty_write_is_rejected_with_code_2000(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        let got = log.write(c, vec![write(key, &[], None, true)]).await;
        assert!(
            matches!(got, Err(StoreError::Other { code: 2000, .. })),
            "{got:?}"
        );
        let got = log.write(c, vec![]).await;
        assert!(
            matches!(got, Err(StoreError::Other { code: 2000, .. })),
            "{got:?}"
        );
        assert_eq!(log.details(key).await, Err(StoreError::AggregateNotFound));
    }

    pub async fn event_type_major_zero_is_rejected_with_code_2001(log: SharedLog, k: Keys) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        let mut bad = write(b, &[1, 2], None, true);
        bad.events[1].event_type = EventType { major: 0, minor: 3 };
        let got = log.write(c, vec![write(a, &[1], None, true), bad]).await;
        assert!(
            matches!(got, Err(StoreError::Other { code: 2001, .. })),
            "{got:?}"
        );
        assert_eq!(log.details(a).await, Err(StoreError::AggregateNotFound));
        assert_eq!(log.details(b).await, Err(StoreError::AggregateNotFound));
    }

    pub async fn server_timestamps_are_non_decreasing(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=20 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        let page = log.read(key, &ReadFilter::default()).await.expect("read");
        let ts: Vec<u64> = page.batches.iter().map(|b| b.server_timestamp_ms).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
        assert!(ts[0] > 0, "timestamps are epoch milliseconds");
        let details = log.details(key).await.expect("details");
        assert_eq!(Some(&details.last_server_timestamp_ms), ts.last());
    }

    pub async fn read_of_missing_aggregate_is_not_found(log: SharedLog, k: Keys) {
        let got = log.read(k.key(), &ReadFilter::default()).await;
        assert!(matches!(got, Err(StoreError::AggregateNotFound)), "{got:?}");
    }

    pub async fn read_returns_events_as_written(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        let mut w = write(key, &[3, 4], None, true);
        w.events[0].event_type = EventType { major: 7, minor: 2 };
        w.events[1].event_id = None;
        w.events[1].payload = Bytes::from_static(b"\x00\xffbinary");
        log.write(c, vec![w.clone()]).await.expect("write");
        let page = log.read(key, &ReadFilter::default()).await.expect("read");
        assert_eq!(page.batches.len(), 1);
        assert_eq!(page.batches[0].client_id, c);
        assert_eq!(&*page.batches[0].events, &w.events[..]);
    }

    pub async fn read_from_version_zero_reads_from_one(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=3 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        let zero = log
            .read(key, &ReadFilter::from_version(0))
            .await
            .expect("read");
        let one = log
            .read(key, &ReadFilter::from_version(1))
            .await
            .expect("read");
        let v =
            |p: &tally::store::ReadPage| p.batches.iter().map(|b| b.version).collect::<Vec<_>>();
        assert_eq!(v(&zero), vec![1, 2, 3]);
        assert_eq!(v(&zero), v(&one));
        let two = log
            .read(key, &ReadFilter::from_version(2))
            .await
            .expect("read");
        assert_eq!(v(&two), vec![2, 3]);
    }

    pub async fn read_past_the_tip_is_empty(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1], None, true)])
            .await
            .expect("write");
        for from in [2, 3, 1_000_000, u64::MAX] {
            let page = log.read(key, &ReadFilter::from_version(from)).await;
            let page = page.unwrap_or_else(|e| panic!("from {from}: {e:?}"));
            assert!(page.batches.is_empty(), "from {from}");
            assert_eq!(page.next_version, None, "from {from}");
        }
    }

    pub async fn read_to_version_is_inclusive(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=5 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        let f = |from, to| ReadFilter {
            from_version: from,
            to_version: Some(to),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, f(2, 4)).await, vec![2, 3, 4]);
        assert_eq!(read_versions(&log, key, f(3, 3)).await, vec![3]);
        assert_eq!(read_versions(&log, key, f(4, 99)).await, vec![4, 5]);
        assert_eq!(read_versions(&log, key, f(4, 2)).await, Vec::<u64>::new());
    }

    pub async fn filter_min_client_seq_keeps_batches_whose_highest_seq_reaches_it(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1, 2], None, true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[3, 4], None, true)])
            .await
            .expect("v2");
        log.write(c, vec![write(key, &[5], None, true)])
            .await
            .expect("v3");
        let f = |min| ReadFilter {
            min_client_seq: Some(min),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, f(4)).await, vec![2, 3]);
        assert_eq!(read_versions(&log, key, f(3)).await, vec![2, 3]);
        assert_eq!(read_versions(&log, key, f(5)).await, vec![3]);
        assert_eq!(read_versions(&log, key, f(6)).await, Vec::<u64>::new());
    }

    pub async fn filter_max_client_seq_keeps_batches_whose_lowest_seq_is_within_it(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1, 2], None, true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[3, 4], None, true)])
            .await
            .expect("v2");
        log.write(c, vec![write(key, &[5], None, true)])
            .await
            .expect("v3");
        let point = |seq| ReadFilter {
            min_client_seq: Some(seq),
            max_client_seq: Some(seq),
            ..ReadFilter::default()
        };
        // The point read of the guide: the batch holding that sequence.
        assert_eq!(read_versions(&log, key, point(4)).await, vec![2]);
        assert_eq!(read_versions(&log, key, point(3)).await, vec![2]);
        assert_eq!(read_versions(&log, key, point(1)).await, vec![1]);
        let max = ReadFilter {
            max_client_seq: Some(3),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, max).await, vec![1, 2]);
    }

    pub async fn filter_client_id_keeps_only_that_writer(log: SharedLog, k: Keys) {
        let (key, c1, c2) = (k.key(), k.client(), k.client());
        log.write(c1, vec![write(key, &[1], None, true)])
            .await
            .expect("v1");
        log.write(c2, vec![write(key, &[1], None, true)])
            .await
            .expect("v2");
        log.write(c1, vec![write(key, &[2], None, true)])
            .await
            .expect("v3");
        let f = |c| ReadFilter {
            include_client_id: Some(c),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, f(c1)).await, vec![1, 3]);
        assert_eq!(read_versions(&log, key, f(c2)).await, vec![2]);
        assert_eq!(
            read_versions(&log, key, f(k.client())).await,
            Vec::<u64>::new()
        );
        // Point read scoped to a client id: c2's seq 1, not c1's.
        let scoped = ReadFilter {
            min_client_seq: Some(1),
            max_client_seq: Some(1),
            include_client_id: Some(c2),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, scoped).await, vec![2]);
    }

    pub async fn filter_min_server_timestamp_is_inclusive(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=10 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
            if seq % 3 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(3)).await;
            }
        }
        let all = log
            .read(key, &ReadFilter::default())
            .await
            .expect("read")
            .batches;
        let distinct: BTreeSet<u64> = all.iter().map(|b| b.server_timestamp_ms).collect();
        for &ts in &distinct {
            let f = ReadFilter {
                min_server_timestamp_ms: Some(ts),
                ..ReadFilter::default()
            };
            let expected: Vec<u64> = all
                .iter()
                .filter(|b| b.server_timestamp_ms >= ts)
                .map(|b| b.version)
                .collect();
            assert!(!expected.is_empty());
            assert_eq!(read_versions(&log, key, f).await, expected, "min ts {ts}");
        }
        let last = distinct.last().copied().unwrap_or(0);
        let f = ReadFilter {
            min_server_timestamp_ms: Some(last + 1),
            ..ReadFilter::default()
        };
        assert_eq!(read_versions(&log, key, f).await, Vec::<u64>::new());
    }

    /// Enough batches to span several pages of any reasonable page size.
    const STREAM_BATCHES: u64 = 2_500;

    pub async fn batch_stream_visits_every_batch_exactly_once_in_order(log: SharedLog, k: Keys) {
        let (key, c1, c2) = (k.key(), k.client(), k.client());
        for seq in 1..=STREAM_BATCHES {
            let c = if seq % 3 == 0 { c2 } else { c1 };
            log.write(c, vec![write(key, &[seq], None, false)])
                .await
                .expect("write");
        }
        let all: Vec<u64> = (1..=STREAM_BATCHES).collect();
        assert_eq!(versions(&log, key).await, all);
        // With a filter, pages skip non-matching batches and still visit each match once.
        let only_c2 = ReadFilter {
            include_client_id: Some(c2),
            ..ReadFilter::default()
        };
        let expected: Vec<u64> = all.iter().copied().filter(|v| v % 3 == 0).collect();
        assert_eq!(read_versions(&log, key, only_c2).await, expected);
        let mut stream = BatchStream::new(&*log, key, ReadFilter::from_version(1000));
        let mut seqs = Vec::new();
        while let Some(page) = stream.next_page().await.expect("read") {
            seqs.extend(
                page.iter()
                    .flat_map(|b| b.events.iter().map(|e| e.client_seq)),
            );
        }
        assert_eq!(seqs, (1000..=STREAM_BATCHES).collect::<Vec<_>>());
    }

    pub async fn details_report_bounds_and_last_server_timestamp(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=4 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        let d = log.details(key).await.expect("details");
        assert_eq!(d.min_available_version, 1);
        assert_eq!(d.max_version, 4);
        let page = log
            .read(key, &ReadFilter::from_version(4))
            .await
            .expect("read");
        assert_eq!(
            d.last_server_timestamp_ms,
            page.batches[0].server_timestamp_ms
        );
    }

    pub async fn details_of_missing_aggregate_is_not_found(log: SharedLog, k: Keys) {
        assert_eq!(
            log.details(k.key()).await,
            Err(StoreError::AggregateNotFound)
        );
    }

    pub async fn trim_drops_batches_below_keep_from_and_keeps_versions(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=5 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        log.trim_start(key, 3).await.expect("trim");
        let d = log.details(key).await.expect("details");
        assert_eq!((d.min_available_version, d.max_version), (3, 5));
        assert_eq!(
            read_versions(&log, key, ReadFilter::from_version(3)).await,
            vec![3, 4, 5]
        );
        assert_eq!(
            log.write(c, vec![write(key, &[6], Some(5), true)]).await,
            Ok(vec![6])
        );
        // Trimming lower than before is a no-op; trimming everything keeps the version.
        log.trim_start(key, 2).await.expect("trim lower");
        assert_eq!(
            log.details(key)
                .await
                .expect("details")
                .min_available_version,
            3
        );
        // The newest batch can never be trimmed: keep-from is at most the tip.
        assert!(matches!(
            log.trim_start(key, 7).await,
            Err(StoreError::Other { .. })
        ));
        log.trim_start(key, 6).await.expect("trim to the tip");
        let d = log.details(key).await.expect("details");
        assert_eq!((d.min_available_version, d.max_version), (6, 6));
        assert_eq!(
            read_versions(&log, key, ReadFilter::from_version(6)).await,
            vec![6]
        );
        assert_eq!(
            log.write(c, vec![write(key, &[7], Some(6), true)]).await,
            Ok(vec![7])
        );
        assert_eq!(
            read_versions(&log, key, ReadFilter::from_version(6)).await,
            vec![6, 7]
        );
    }

    pub async fn read_below_the_trim_point_is_trimmed_with_min_available(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=5 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        log.trim_start(key, 4).await.expect("trim");
        for from in [0, 1, 3] {
            assert_eq!(
                log.read(key, &ReadFilter::from_version(from))
                    .await
                    .map(|p| p.batches.len()),
                Err(StoreError::Trimmed { min_available: 4 }),
                "from {from}"
            );
        }
    }

    pub async fn client_mark_survives_trim(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[40], None, true)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[41], None, true)])
            .await
            .expect("v2");
        log.trim_start(key, 2).await.expect("trim to the tip");
        assert_eq!(
            log.write(c, vec![write(key, &[41], Some(2), true)]).await,
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(41),
                attempted_seq: Some(41)
            })
        );
        assert_eq!(
            log.write(c, vec![write(key, &[42], Some(2), true)]).await,
            Ok(vec![3])
        );
    }

    pub async fn trim_beyond_the_tip_is_rejected(log: SharedLog, k: Keys) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[1], None, true)])
            .await
            .expect("v1");
        let got = log.trim_start(key, 2).await;
        assert!(matches!(got, Err(StoreError::Other { .. })), "{got:?}");
        assert_eq!(versions(&log, key).await, vec![1], "nothing trimmed");
    }

    pub async fn trim_of_missing_aggregate_is_not_found(log: SharedLog, k: Keys) {
        assert_eq!(
            log.trim_start(k.key(), 1).await,
            Err(StoreError::AggregateNotFound)
        );
    }

    /// Concurrent conditional writers, and attempts each.
    const WRITERS: u64 = 8;
    const ATTEMPTS: u64 = 40;

    pub async fn concurrent_conditional_writers_exactly_one_wins_per_version(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        log.write(c, vec![write(key, &[0], Some(0), false)])
            .await
            .expect("create");
        let mut tasks = JoinSet::new();
        for writer in 0..WRITERS {
            let log = Arc::clone(&log);
            let client = k.client();
            tasks.spawn(async move {
                let mut wins = Vec::new();
                for attempt in 0..ATTEMPTS {
                    let seen = log.details(key).await.expect("details").max_version;
                    let seq = writer * 1_000 + attempt + 1;
                    match log
                        .write(client, vec![write(key, &[seq], Some(seen), false)])
                        .await
                    {
                        Ok(v) => {
                            assert_eq!(v, vec![seen + 1]);
                            wins.push((seen + 1, seq));
                        }
                        Err(StoreError::Conflict { expected, current }) => {
                            assert_eq!(expected, seen);
                            assert!(current > seen, "a conflict means someone moved on");
                        }
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                    tokio::task::yield_now().await;
                }
                wins
            });
        }
        let mut winners: BTreeMap<u64, u64> = BTreeMap::new();
        while let Some(done) = tasks.join_next().await {
            for (version, seq) in done.expect("writer task") {
                assert!(
                    winners.insert(version, seq).is_none(),
                    "two winners for version {version}"
                );
            }
        }
        let tip = max_version(&log, key).await;
        assert_eq!(
            winners.len() as u64,
            tip - 1,
            "every version after the first has one winner"
        );
        // No lost update: every acknowledged write is in the log, at the version it was told.
        let page_versions = {
            let mut got = BTreeMap::new();
            let mut stream = BatchStream::new(&*log, key, ReadFilter::from_version(2));
            while let Some(page) = stream.next_page().await.expect("read") {
                for b in page {
                    got.insert(b.version, b.events[0].client_seq);
                }
            }
            got
        };
        assert_eq!(page_versions, winners);
    }

    /// Concurrent transfer tasks and transfers each.
    const TRANSFER_TASKS: u64 = 6;
    const TRANSFERS: u64 = 50;

    pub async fn multi_aggregate_write_is_never_torn_under_concurrency(log: SharedLog, k: Keys) {
        let (a, b) = (k.key(), k.key());
        let mut tasks = JoinSet::new();
        for t in 0..TRANSFER_TASKS {
            let log = Arc::clone(&log);
            let client = k.client();
            tasks.spawn(async move {
                let mut landed = BTreeSet::new();
                for i in 1..=TRANSFERS {
                    // Every fifth transfer reuses a sequence on leg b, so it must fail whole.
                    let seq_b = if i % 5 == 0 { i - 1 } else { i };
                    let mut wa = write(a, &[i], None, true);
                    let mut wb = write(b, &[seq_b], None, true);
                    let id = u128::from(t) << 64 | u128::from(i);
                    wa.events[0].event_id = Some(id);
                    wb.events[0].event_id = Some(id);
                    let legs = if i % 2 == 0 {
                        vec![wa, wb]
                    } else {
                        vec![wb, wa]
                    };
                    match log.write(client, legs).await {
                        Ok(_) => {
                            landed.insert(id);
                        }
                        // Refused whole either way: the real server answers 2013 rather
                        // than 2002 while the batch holding the sequence is acknowledged
                        // but not yet durable (more often on a busy disk).
                        Err(
                            StoreError::IdempotencyViolation { .. } | StoreError::InflightDuplicate,
                        ) if i % 5 == 0 => {}
                        Err(e) => panic!("transfer {t}/{i}: {e:?}"),
                    }
                }
                landed
            });
        }
        let mut landed = BTreeSet::new();
        while let Some(done) = tasks.join_next().await {
            landed.extend(done.expect("transfer task"));
        }
        assert_eq!(
            landed.len() as u64,
            TRANSFER_TASKS * (TRANSFERS - TRANSFERS / 5)
        );
        let ids = |key| {
            let log = Arc::clone(&log);
            async move {
                let mut out = BTreeSet::new();
                let mut stream = BatchStream::new(&*log, key, ReadFilter::default());
                while let Some(page) = stream.next_page().await.expect("read") {
                    out.extend(
                        page.iter()
                            .flat_map(|b| b.events.iter().filter_map(|e| e.event_id)),
                    );
                }
                out
            }
        };
        assert_eq!(
            ids(a).await,
            landed,
            "leg a holds exactly the landed transfers"
        );
        assert_eq!(
            ids(b).await,
            landed,
            "leg b holds exactly the landed transfers"
        );
    }
}

/// The checkpoint stream's rules: what a checkpoint and a retention trim rely on.
mod checkpoint_rules {
    use tally::projection::Checkpoint;
    use tally::projection::checkpoint::fingerprint;
    use tally::store::{AggregateWrite, ReadFilter, SharedLog, StoreError};

    use super::rules::{Keys, write};

    fn checkpoint_write(
        key: tally::store::AggregateKey,
        cp: &Checkpoint,
        expected: u64,
    ) -> AggregateWrite {
        AggregateWrite {
            key,
            events: vec![cp.event()],
            expected_version: Some(expected),
            allow_create: true,
            enforce_client_idempotency: false,
        }
    }

    /// A checkpoint reads back as written, and two writers guarded on one position of the
    /// checkpoint stream land one checkpoint: the other gets a conflict naming the current
    /// version (what the writer takes as "another replica did it").
    pub async fn a_checkpoint_round_trips_through_its_stream_and_one_position_takes_one(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        let cp = Checkpoint {
            version: 1_000_000,
            balance: -42,
            max_client_seq: 999_999,
            commit_ms: 1_700_000_000_123,
            fingerprint: 0xfeed_f00d,
            keys_after: None,
            holds_len: 0,
        };
        assert_eq!(
            log.write(c, vec![checkpoint_write(key, &cp, 0)]).await,
            Ok(vec![1])
        );
        let later = Checkpoint {
            version: 1_000_500,
            ..cp
        };
        assert_eq!(
            log.write(c, vec![checkpoint_write(key, &later, 0)]).await,
            Err(StoreError::Conflict {
                expected: 0,
                current: 1
            })
        );
        let page = log
            .read(key, &ReadFilter::from_version(1))
            .await
            .expect("read");
        let read: Vec<_> = page
            .batches
            .iter()
            .flat_map(|b| b.events.iter())
            .map(Checkpoint::decode)
            .collect();
        assert_eq!(read, vec![Some(cp)]);
    }

    /// A checkpoint carrying the most keys a segment may hold (the largest event Tally
    /// writes, about half a megabyte) is taken and reads back byte for byte, with every key.
    pub async fn a_keyed_checkpoint_carrying_the_largest_segment_round_trips(
        log: SharedLog,
        k: Keys,
    ) {
        use tally::projection::keys::{MAX_SEGMENT_KEYS, Segment, SegmentKey};
        let (key, c) = (k.key(), k.client());
        let keys: Vec<SegmentKey> = (0..MAX_SEGMENT_KEYS as u64)
            .map(|i| SegmentKey {
                fingerprint: (i as u32).wrapping_mul(0x9E37_79B9),
                version: 1_000 + i,
                // Large, alternating balances: the widest varints.
                balance: if i % 2 == 0 {
                    i64::MAX - i as i64
                } else {
                    i64::MIN + i as i64
                },
            })
            .collect();
        let segment = Segment {
            after: 999,
            after_ms: 1_700_000_000_000,
            forgotten: false,
            keys,
        };
        let top = 1_000 + MAX_SEGMENT_KEYS as u64 - 1;
        let cp = Checkpoint {
            version: top,
            balance: 7,
            max_client_seq: 3,
            commit_ms: 1_700_000_000_500,
            fingerprint: 1,
            keys_after: None,
            holds_len: 0,
        };
        let (cp, payload) = cp.keyed(&segment, None);
        let bytes = payload.len();
        assert!(bytes > 400_000, "the largest segment is {bytes} bytes");
        let w = AggregateWrite {
            key,
            events: vec![Checkpoint::event_of(payload.clone())],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: false,
        };
        assert_eq!(log.write(c, vec![w]).await, Ok(vec![1]));
        let page = log
            .read(key, &ReadFilter::from_version(1))
            .await
            .expect("read");
        let event = &page.batches[0].events[0];
        assert_eq!(event.payload, payload, "read back byte for byte");
        assert_eq!(Checkpoint::decode(event), Some(cp));
        assert_eq!(cp.segment(event), Some(segment));
    }

    /// What a checkpoint is checked against survives a trim at its version: the batch there
    /// reads back with the same commit time and content, a read below it is `Trimmed` naming
    /// it, and details give it as the first available version with the tip and its time
    /// unchanged.
    pub async fn a_read_at_the_trim_point_returns_that_batch_unchanged_and_details_say_where_history_begins(
        log: SharedLog,
        k: Keys,
    ) {
        let (key, c) = (k.key(), k.client());
        for seq in 1..=5 {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .expect("write");
        }
        let at = |from, to| ReadFilter {
            to_version: Some(to),
            ..ReadFilter::from_version(from)
        };
        let before = log.read(key, &at(3, 3)).await.expect("read").batches;
        let details = log.details(key).await.expect("details");
        log.trim_start(key, 3).await.expect("trim");
        let after = log.read(key, &at(3, 3)).await.expect("read").batches;
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].version, 3);
        assert_eq!(after[0].server_timestamp_ms, before[0].server_timestamp_ms);
        assert_eq!(fingerprint(&after[0]), fingerprint(&before[0]));
        assert_eq!(
            log.read(key, &at(2, 3)).await.map(|p| p.batches.len()),
            Err(StoreError::Trimmed { min_available: 3 })
        );
        let trimmed = log.details(key).await.expect("details");
        assert_eq!(trimmed.min_available_version, 3);
        assert_eq!(trimmed.max_version, details.max_version);
        assert_eq!(
            trimmed.last_server_timestamp_ms,
            details.last_server_timestamp_ms
        );
    }
}

/// Rules that need MemoryLog's knobs: a manual clock and a small page size.
/// The watch's rules: what a feed opened with [`EventLog::watch`] reports.
mod watch_rules {
    use std::time::Duration;

    use tally::store::{AggregateKey, Commit, SharedLog, WatchFeed, WatchFilter, WatchItem};

    use super::rules::{Keys, write};

    /// How long a notification may take to arrive before a rule fails.
    const NOTIFY_BOUND: Duration = Duration::from_secs(10);

    fn filter(k: &Keys) -> WatchFilter {
        WatchFilter {
            org_id: Some(k.org_id),
            aggregate_type_id: Some(k.aggregate_type_id),
        }
    }

    /// The next `n` commits; a gap here would hide what the rule checks, so it fails.
    async fn commits(feed: &mut Box<dyn WatchFeed>, n: usize) -> Vec<Commit> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            match tokio::time::timeout(NOTIFY_BOUND, feed.next()).await {
                Ok(Ok(WatchItem::Commit(c))) => out.push(c),
                Ok(Ok(WatchItem::Gap)) => panic!("unexpected gap after {out:?}"),
                Ok(Err(e)) => panic!("feed broke after {out:?}: {e}"),
                Err(_) => panic!("no notification within {NOTIFY_BOUND:?} after {out:?}"),
            }
        }
        out
    }

    /// Nothing more arrives within a short wait.
    async fn quiet(feed: &mut Box<dyn WatchFeed>) {
        let more = tokio::time::timeout(Duration::from_millis(300), feed.next()).await;
        assert!(more.is_err(), "unexpected notification {more:?}");
    }

    fn at(key: AggregateKey, version: u64) -> Commit {
        Commit { key, version }
    }

    pub async fn watch_reports_each_commit_after_it_opened_in_version_order(
        log: SharedLog,
        k: Keys,
    ) {
        let (a, b, c) = (k.key(), k.key(), k.client());
        // Before the watch opens: not reported.
        log.write(c, vec![write(a, &[1], None, true)])
            .await
            .unwrap();
        let mut feed = log.watch(filter(&k)).await.expect("watch");
        for seq in 2..=4 {
            log.write(c, vec![write(a, &[seq], None, true)])
                .await
                .unwrap();
        }
        log.write(c, vec![write(b, &[1, 2], None, true)])
            .await
            .unwrap();
        let got = commits(&mut feed, 4).await;
        assert_eq!(got, vec![at(a, 2), at(a, 3), at(a, 4), at(b, 1)]);
        quiet(&mut feed).await;
    }

    pub async fn watch_reports_every_writer_and_never_a_failed_write(log: SharedLog, k: Keys) {
        let (a, c1, c2) = (k.key(), k.client(), k.client());
        let mut feed = log.watch(filter(&k)).await.expect("watch");
        log.write(c1, vec![write(a, &[1], Some(0), true)])
            .await
            .unwrap();
        // A stale version guard and a duplicate sequence append nothing: nothing to report.
        assert!(
            log.write(c2, vec![write(a, &[1], Some(0), true)])
                .await
                .is_err()
        );
        assert!(
            log.write(c1, vec![write(a, &[1], None, true)])
                .await
                .is_err()
        );
        log.write(c2, vec![write(a, &[1], Some(1), true)])
            .await
            .unwrap();
        assert_eq!(commits(&mut feed, 2).await, vec![at(a, 1), at(a, 2)]);
        quiet(&mut feed).await;
    }

    pub async fn watch_reports_only_the_aggregates_its_filter_admits(log: SharedLog, k: Keys) {
        let other = Keys::random();
        let (mine, theirs, c) = (k.key(), other.key(), k.client());
        let mut feed = log.watch(filter(&k)).await.expect("watch");
        log.write(c, vec![write(theirs, &[1], None, true)])
            .await
            .unwrap();
        log.write(c, vec![write(mine, &[1], None, true)])
            .await
            .unwrap();
        assert_eq!(commits(&mut feed, 1).await, vec![at(mine, 1)]);
        quiet(&mut feed).await;
    }
}

/// Multi-aggregate writes (several accounts' writes combined into one request): what such a
/// write answers when one or more members fail, as the real server answers it (probed on
/// Celeriant e7c6df9; docs/stores.md has the findings the port does not expose). Each rule
/// tries a transfer's two members and larger combined writes, with the failing member at
/// every position, since the server visits members in hash order.
mod multi_rules {
    use std::time::Duration;

    use tally::store::{
        AggregateKey, AggregateWrite, ClientId, ReadFilter, SharedLog, StoreError, StoreResult,
    };
    use tokio::time::Instant;

    use super::rules::{Keys, write};

    /// Member counts every rule is tried with.
    const SIZES: [usize; 3] = [2, 3, 8];

    /// Fresh key sets for the rules whose outcome on the server depends on its hash order.
    const TRIALS: usize = 8;

    /// `n` fresh members, each created by `c` with one write of sequence 1: all at version 1,
    /// each with a mark of 1.
    async fn members(log: &SharedLog, k: &Keys, c: ClientId, n: usize) -> Vec<AggregateKey> {
        let keys: Vec<AggregateKey> = (0..n).map(|_| k.key()).collect();
        for &key in &keys {
            log.write(c, vec![write(key, &[1], Some(0), true)])
                .await
                .expect("create a member");
        }
        keys
    }

    /// Each aggregate's version, 0 for one that does not exist.
    /// Creates each aggregate with one event at the given client sequence, so its
    /// (aggregate, client) mark stands there.
    async fn marked(log: &SharedLog, c: ClientId, marks: &[(AggregateKey, u64)]) {
        for &(key, seq) in marks {
            log.write(c, vec![write(key, &[seq], None, true)])
                .await
                .unwrap_or_else(|e| panic!("mark {seq}: {e:?}"));
        }
    }

    async fn tips(log: &SharedLog, keys: &[AggregateKey]) -> Vec<u64> {
        let mut out = Vec::with_capacity(keys.len());
        for &key in keys {
            out.push(match log.details(key).await {
                Ok(d) => d.max_version,
                Err(StoreError::AggregateNotFound) => 0,
                Err(e) => panic!("details of {key:?}: {e:?}"),
            });
        }
        out
    }

    /// Checks that `c`'s mark on each of `keys` is still below `seq`: an enforced write of
    /// `seq` to that member alone lands. (It appends one version to each.)
    async fn assert_marks_below(
        log: &SharedLog,
        c: ClientId,
        keys: &[AggregateKey],
        seq: u64,
        ctx: &str,
    ) {
        for (i, &key) in keys.iter().enumerate() {
            let before = tips(log, &[key]).await[0];
            assert_eq!(
                log.write(c, vec![write(key, &[seq], None, true)]).await,
                Ok(vec![before + 1]),
                "{ctx}: member {i}'s mark moved to {seq} or beyond"
            );
        }
    }

    /// Whether `got` refuses a write for a sequence already used: a 2002 carrying one of
    /// `pairs` as (committed mark, attempted lowest sequence), or the real server's 2013,
    /// which it answers instead while the batch holding the sequence is acknowledged but not
    /// yet durable (docs/stores.md). Either refuses the write whole.
    fn refused_as_duplicate(got: &StoreResult<Vec<u64>>, pairs: &[(u64, u64)]) -> bool {
        match got {
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(last),
                attempted_seq: Some(attempted),
            }) => pairs.contains(&(*last, *attempted)),
            Err(StoreError::InflightDuplicate) => true,
            _ => false,
        }
    }

    pub async fn multi_aggregate_conflict_applies_no_member_and_moves_no_mark(
        log: SharedLog,
        k: Keys,
    ) {
        for n in SIZES {
            for stale in 0..n {
                let c = k.client();
                let keys = members(&log, &k, c, n).await;
                log.write(c, vec![write(keys[stale], &[2], Some(1), true)])
                    .await
                    .expect("move one member to version 2");
                let legs = keys
                    .iter()
                    .map(|&m| write(m, &[3], Some(1), true))
                    .collect();
                let ctx = format!("{n} members, member {stale} stale");
                assert_eq!(
                    log.write(c, legs).await,
                    Err(StoreError::Conflict {
                        expected: 1,
                        current: 2
                    }),
                    "{ctx}"
                );
                let mut want = vec![1; n];
                want[stale] = 2;
                assert_eq!(tips(&log, &keys).await, want, "{ctx}: a member applied");
                assert_marks_below(&log, c, &keys, 3, &ctx).await;
            }
        }
    }

    pub async fn multi_aggregate_idempotency_violation_applies_no_member_and_moves_no_mark(
        log: SharedLog,
        k: Keys,
    ) {
        for n in SIZES {
            for dup in 0..n {
                for guard in [Some(1), None] {
                    let c = k.client();
                    let keys = members(&log, &k, c, n).await;
                    // The duplicate member carries its committed sequence 1, the others 2.
                    let legs = keys
                        .iter()
                        .enumerate()
                        .map(|(i, &m)| write(m, if i == dup { &[1] } else { &[2] }, guard, true))
                        .collect();
                    let ctx = format!("{n} members, member {dup} a duplicate, guard {guard:?}");
                    let got = log.write(c, legs).await;
                    assert!(refused_as_duplicate(&got, &[(1, 1)]), "{ctx}: {got:?}");
                    assert_eq!(
                        tips(&log, &keys).await,
                        vec![1; n],
                        "{ctx}: a member applied"
                    );
                    assert_marks_below(&log, c, &keys, 2, &ctx).await;
                }
            }
        }
    }

    pub async fn multi_aggregate_write_with_a_missing_member_applies_none_and_creates_none(
        log: SharedLog,
        k: Keys,
    ) {
        for n in SIZES {
            for missing in 0..n {
                for guard in [None, Some(0)] {
                    let c = k.client();
                    let mut keys = members(&log, &k, c, n - 1).await;
                    keys.insert(missing, k.key());
                    let legs = keys
                        .iter()
                        .enumerate()
                        .map(|(i, &m)| {
                            if i == missing {
                                AggregateWrite {
                                    allow_create: false,
                                    ..write(m, &[2], guard, true)
                                }
                            } else {
                                write(m, &[2], Some(1), true)
                            }
                        })
                        .collect();
                    let ctx = format!("{n} members, member {missing} missing, guard {guard:?}");
                    assert_eq!(
                        log.write(c, legs).await,
                        Err(StoreError::AggregateNotFound),
                        "{ctx}"
                    );
                    let mut want = vec![1; n];
                    want[missing] = 0;
                    assert_eq!(tips(&log, &keys).await, want, "{ctx}: a member applied");
                    let present: Vec<AggregateKey> =
                        (0..n).filter(|&i| i != missing).map(|i| keys[i]).collect();
                    assert_marks_below(&log, c, &present, 2, &ctx).await;
                }
            }
        }
    }

    /// The members of the several-reasons rule, by what is wrong with each.
    #[derive(Clone, Copy, Debug)]
    enum Member {
        Missing,
        Stale,
        Duplicate,
        Healthy,
    }

    /// One member's key and its leg: a missing member may not be created; a stale one is at
    /// version 2 where the write expects 1; a duplicate carries its committed sequence 1.
    async fn member(
        log: &SharedLog,
        k: &Keys,
        c: ClientId,
        what: Member,
    ) -> (AggregateKey, AggregateWrite) {
        let key = k.key();
        if !matches!(what, Member::Missing) {
            log.write(c, vec![write(key, &[1], Some(0), true)])
                .await
                .expect("create a member");
        }
        let leg = match what {
            Member::Missing => AggregateWrite {
                allow_create: false,
                ..write(key, &[3], None, true)
            },
            Member::Stale => {
                log.write(c, vec![write(key, &[2], Some(1), true)])
                    .await
                    .expect("move to version 2");
                write(key, &[3], Some(1), true)
            }
            Member::Duplicate => write(key, &[1], Some(1), true),
            Member::Healthy => write(key, &[3], Some(1), true),
        };
        (key, leg)
    }

    pub async fn multi_aggregate_write_failing_for_several_reasons_answers_in_the_port_order(
        log: SharedLog,
        k: Keys,
    ) {
        use Member::*;
        let conflict = Err(StoreError::Conflict {
            expected: 1,
            current: 2,
        });
        let cases: [(&[Member], StoreResult<Vec<u64>>); 4] = [
            (
                &[Missing, Stale, Duplicate, Healthy],
                Err(StoreError::AggregateNotFound),
            ),
            (&[Missing, Stale], Err(StoreError::AggregateNotFound)),
            (&[Missing, Duplicate], Err(StoreError::AggregateNotFound)),
            (&[Stale, Duplicate, Healthy], conflict),
        ];
        for trial in 0..TRIALS {
            for (whats, want) in &cases {
                let c = k.client();
                let mut keys = Vec::new();
                let mut legs = Vec::new();
                // Rotated, so each reason comes first in the request in some trial.
                for i in 0..whats.len() {
                    let what = whats[(i + trial) % whats.len()];
                    let (key, leg) = member(&log, &k, c, what).await;
                    keys.push((key, what));
                    legs.push(leg);
                }
                let ctx = format!("trial {trial}: {keys:?}");
                assert_eq!(&log.write(c, legs).await, want, "{ctx}");
                let keys_only: Vec<AggregateKey> = keys.iter().map(|(key, _)| *key).collect();
                let want_tips: Vec<u64> = keys
                    .iter()
                    .map(|(_, what)| match what {
                        Missing => 0,
                        Stale => 2,
                        Duplicate | Healthy => 1,
                    })
                    .collect();
                assert_eq!(
                    tips(&log, &keys_only).await,
                    want_tips,
                    "{ctx}: a member applied"
                );
                let present: Vec<AggregateKey> = keys
                    .iter()
                    .filter(|(_, what)| !matches!(what, Missing))
                    .map(|(key, _)| *key)
                    .collect();
                assert_marks_below(&log, c, &present, 3, &ctx).await;
            }
        }
    }

    pub async fn multi_aggregate_conflict_names_the_first_stale_member_in_request_order(
        log: SharedLog,
        k: Keys,
    ) {
        for trial in 0..TRIALS {
            let c = k.client();
            let (two, three) = (k.key(), k.key());
            for seq in 1..=2 {
                log.write(c, vec![write(two, &[seq], None, true)])
                    .await
                    .expect("to version 2");
            }
            for seq in 1..=3 {
                log.write(c, vec![write(three, &[seq], None, true)])
                    .await
                    .expect("to version 3");
            }
            for (first, current) in [(two, 2), (three, 3)] {
                let second = if first == two { three } else { two };
                assert_eq!(
                    log.write(
                        c,
                        vec![
                            write(first, &[9], Some(1), true),
                            write(second, &[9], Some(1), true)
                        ]
                    )
                    .await,
                    Err(StoreError::Conflict {
                        expected: 1,
                        current
                    }),
                    "trial {trial}: the member at version {current} comes first"
                );
            }
            assert_eq!(tips(&log, &[two, three]).await, vec![2, 3]);
        }
    }

    pub async fn multi_aggregate_idempotency_violation_reports_one_violating_members_sequences(
        log: SharedLog,
        k: Keys,
    ) {
        for trial in 0..TRIALS {
            let c = k.client();
            let (ten, twenty) = (k.key(), k.key());
            marked(&log, c, &[(ten, 10), (twenty, 20)]).await;
            let got = log
                .write(
                    c,
                    vec![
                        write(ten, &[5], None, true),
                        write(twenty, &[15], None, true),
                    ],
                )
                .await;
            // Which member's pair the server reports follows its hash order: either, never
            // a mix of the two (such as the request's lowest sequence 5 against mark 20).
            assert!(
                refused_as_duplicate(&got, &[(10, 5), (20, 15)]),
                "trial {trial}: {got:?}"
            );
            assert_eq!(tips(&log, &[ten, twenty]).await, vec![1, 1]);
        }
    }

    pub async fn multi_aggregate_idempotency_judges_each_member_by_its_own_lowest_sequence(
        log: SharedLog,
        k: Keys,
    ) {
        let (high, low, c) = (k.key(), k.key(), k.client());
        marked(&log, c, &[(high, 5), (low, 1)]).await;
        // The request's lowest sequence (2) is below `high`'s mark (5): it is not what is
        // judged. Each member's own lowest is above its own mark, so the write lands.
        assert_eq!(
            log.write(
                c,
                vec![
                    write(high, &[6], Some(1), true),
                    write(low, &[2], Some(1), true)
                ]
            )
            .await,
            Ok(vec![2, 2])
        );
        // A member whose own highest is above its mark but whose own lowest is not: refused.
        let got = log
            .write(
                c,
                vec![
                    write(high, &[9, 4], None, true),
                    write(low, &[3], None, true),
                ],
            )
            .await;
        assert!(refused_as_duplicate(&got, &[(6, 4)]), "{got:?}");
        assert_eq!(tips(&log, &[high, low]).await, vec![2, 2]);
    }

    pub async fn multi_aggregate_write_moves_each_members_mark_to_its_own_highest_sequence(
        log: SharedLog,
        k: Keys,
    ) {
        let (high, low, c) = (k.key(), k.key(), k.client());
        marked(&log, c, &[(high, 5), (low, 1)]).await;
        assert_eq!(
            log.write(
                c,
                vec![
                    write(high, &[6, 7, 8], None, true),
                    write(low, &[2], None, true)
                ]
            )
            .await,
            Ok(vec![2, 2])
        );
        // `low`'s mark is its own highest (2), not the request's (8).
        assert_eq!(
            log.write(c, vec![write(low, &[3], None, true)]).await,
            Ok(vec![3])
        );
        let got = log.write(c, vec![write(high, &[8], None, true)]).await;
        assert!(refused_as_duplicate(&got, &[(8, 8)]), "{got:?}");
        // An unenforced member below its mark lands beside an enforced one, and its mark
        // stays where it was.
        assert_eq!(
            log.write(
                c,
                vec![write(high, &[4], None, false), write(low, &[4], None, true)]
            )
            .await,
            Ok(vec![3, 4])
        );
        let got = log.write(c, vec![write(high, &[8], None, true)]).await;
        assert!(refused_as_duplicate(&got, &[(8, 8)]), "{got:?}");
        assert_eq!(
            log.write(c, vec![write(high, &[9], None, true)]).await,
            Ok(vec![4])
        );
    }

    pub async fn duplicate_of_a_landed_multi_aggregate_write_is_a_conflict_then_an_idempotency_violation(
        log: SharedLog,
        k: Keys,
    ) {
        for n in SIZES {
            let c = k.client();
            let keys = members(&log, &k, c, n).await;
            let guarded = |guard| -> Vec<AggregateWrite> {
                keys.iter().map(|&m| write(m, &[2], guard, true)).collect()
            };
            assert_eq!(log.write(c, guarded(Some(1))).await, Ok(vec![2; n]));
            // The same request again (its ack was lost): the guard is checked first.
            assert_eq!(
                log.write(c, guarded(Some(1))).await,
                Err(StoreError::Conflict {
                    expected: 1,
                    current: 2
                }),
                "{n} members"
            );
            // Without guards, or with refreshed ones, the sequences are what refuse it.
            for guard in [None, Some(2)] {
                let got = log.write(c, guarded(guard)).await;
                assert!(
                    refused_as_duplicate(&got, &[(2, 2)]),
                    "{n} members, guard {guard:?}: {got:?}"
                );
            }
            assert_eq!(tips(&log, &keys).await, vec![2; n], "{n} members");
        }
        // A combined create sent twice.
        let c = k.client();
        let keys: Vec<AggregateKey> = (0..3).map(|_| k.key()).collect();
        let create: Vec<AggregateWrite> = keys
            .iter()
            .map(|&m| write(m, &[1], Some(0), true))
            .collect();
        assert_eq!(log.write(c, create.clone()).await, Ok(vec![1; 3]));
        assert_eq!(
            log.write(c, create).await,
            Err(StoreError::Conflict {
                expected: 0,
                current: 1
            })
        );
    }

    /// Lost acknowledgements counted by [`multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none`].
    #[derive(Debug, Default)]
    pub struct LostAcks {
        /// Writes that answered (landed, with their versions).
        pub acknowledged: u32,
        /// Writes refused before they were sent (`NotApplied`).
        pub refused: u32,
        /// Writes that answered `OutcomeUnknown` and had landed.
        pub landed: u32,
        /// Writes that answered `OutcomeUnknown` and had not.
        pub not_landed: u32,
        /// Member reads that did not show version 2 at first although a version guard had
        /// already seen it.
        pub lagging_reads: u32,
    }

    /// How long a batch the version guard has seen may take to show in reads: on the real
    /// server a write whose ack was lost can be seen by the next write's guard (2003) a few
    /// ms before reads of some of its members show it (6 of 81 lost acknowledgements in one
    /// probe; every member showed it within 5 ms).
    const VISIBLE_WITHIN: Duration = Duration::from_secs(5);

    /// The event ids of `key`'s version 2, re-read until it shows (at most
    /// [`VISIBLE_WITHIN`]), and whether the first read did not show it. A member that never
    /// shows it is empty, which fails the rule: a torn write leaves one such member behind.
    async fn version_two(log: &SharedLog, key: AggregateKey) -> (Vec<Option<u128>>, bool) {
        let filter = ReadFilter {
            to_version: Some(2),
            ..ReadFilter::from_version(2)
        };
        let deadline = Instant::now() + VISIBLE_WITHIN;
        let mut lagged = false;
        loop {
            let page = log.read(key, &filter).await.expect("read version 2");
            let ids: Vec<Option<u128>> = page
                .batches
                .iter()
                .flat_map(|b| b.events.iter().map(|e| e.event_id))
                .collect();
            if !ids.is_empty() || Instant::now() >= deadline {
                return (ids, lagged);
            }
            lagged = true;
            // The read is the only word on when the batch shows: poll it, with a bound.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Combined writes (rounds of each size) sent through `lossy`, whose answers may be lost;
    /// `log` reaches the same store and answers. Each round's write appends version 2 to
    /// members at version 1; then a settling write with the same guards, through `log`,
    /// decides which of the two holds version 2: the guards let only one land on each
    /// member. Every member must hold the same one's event at version 2: a write whose ack
    /// was lost applied all its members or none, never some.
    pub async fn multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none(
        log: SharedLog,
        lossy: SharedLog,
        k: Keys,
        rounds: u32,
    ) -> LostAcks {
        let mut seen = LostAcks::default();
        for round in 0..rounds {
            let n = SIZES[round as usize % SIZES.len()];
            let c = k.client();
            let keys: Vec<AggregateKey> = (0..n).map(|_| k.key()).collect();
            let create = keys
                .iter()
                .map(|&m| write(m, &[1], Some(0), true))
                .collect();
            log.write(c, create).await.expect("create the members");
            let combined = |seq: u64, id: u128| -> Vec<AggregateWrite> {
                keys.iter()
                    .map(|&m| {
                        let mut w = write(m, &[seq], Some(1), true);
                        w.events[0].event_id = Some(id);
                        w
                    })
                    .collect()
            };
            let (lost_id, settle_id) = (u128::from(round) << 8 | 1, u128::from(round) << 8 | 2);
            let got = lossy.write(c, combined(2, lost_id)).await;
            let settled = log.write(c, combined(3, settle_id)).await;
            let ctx = format!("round {round}, {n} members: {got:?}, then {settled:?}");
            let holder = match &settled {
                Ok(_) => settle_id,
                Err(StoreError::Conflict { .. }) => lost_id,
                Err(e) => panic!("{ctx}: the settling write failed: {e:?}"),
            };
            match &got {
                Ok(versions) => {
                    assert_eq!((versions, holder), (&vec![2; n], lost_id), "{ctx}");
                    seen.acknowledged += 1;
                }
                Err(StoreError::NotApplied { .. }) => {
                    assert_eq!(holder, settle_id, "{ctx}");
                    seen.refused += 1;
                }
                Err(StoreError::OutcomeUnknown { .. }) if holder == lost_id => seen.landed += 1,
                Err(StoreError::OutcomeUnknown { .. }) => seen.not_landed += 1,
                Err(e) => panic!("{ctx}: {e:?}"),
            }
            for (i, &m) in keys.iter().enumerate() {
                let (ids, lagged) = version_two(&log, m).await;
                seen.lagging_reads += u32::from(lagged);
                assert_eq!(ids, vec![Some(holder)], "{ctx}: member {i} at version 2");
            }
        }
        eprintln!("lost-ack rule: {seen:?}");
        seen
    }
}

/// Rules that need the fault injector's knobs: scripted lost acknowledgements and held writes.
mod fault_injector {
    use std::sync::Arc;

    use tally::store::faults::{FaultConfig, FaultyLog};
    use tally::store::memory::MemoryLog;
    use tally::store::{EventLog, SharedLog, StoreError};

    use super::multi_rules::multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none as lost_ack_rule;
    use super::rules::{Keys, write};

    /// The fault seed of the lost-ack rule: fixed, so a failure replays.
    const LOST_ACK_SEED: u64 = 0x5eed_0001;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none() {
        let inner = Arc::new(MemoryLog::new());
        let config = FaultConfig {
            lost_ack: 0.4,
            lost_request: 0.3,
            refused: 0.1,
            seed: LOST_ACK_SEED,
            ..FaultConfig::default()
        };
        let lossy = Arc::new(FaultyLog::new(Arc::clone(&inner) as SharedLog, config));
        let seen = lost_ack_rule(inner, Arc::clone(&lossy) as SharedLog, Keys::random(), 60).await;
        // The rule must have met both kinds of unknown outcome (fixed seed).
        assert!(
            seen.landed > 0 && seen.not_landed > 0,
            "seed {LOST_ACK_SEED}: {seen:?}, {:?}",
            lossy.counts()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_inflight_duplicate_in_a_multi_aggregate_write_answers_in_the_port_order() {
        let inner = Arc::new(MemoryLog::new());
        let log = Arc::new(FaultyLog::new(
            Arc::clone(&inner) as SharedLog,
            FaultConfig::default(),
        ));
        let k = Keys::random();
        let (held, missing, stale, c) = (k.key(), k.key(), k.key(), k.client());
        log.write(c, vec![write(held, &[1], Some(0), true)])
            .await
            .unwrap();
        for seq in 1..=2 {
            log.write(c, vec![write(stale, &[seq], None, true)])
                .await
                .unwrap();
        }
        let mut hold = log.hold_next_write();
        let held_write = tokio::spawn({
            let log = Arc::clone(&log);
            async move { log.write(c, vec![write(held, &[2], Some(1), true)]).await }
        });
        assert!(hold.held().await, "the write on {held:?} is held");
        let overlap = || write(held, &[2], None, true);
        let absent = || tally::store::AggregateWrite {
            allow_create: false,
            ..write(missing, &[1], None, true)
        };
        // Existence comes before the version guard and the in-flight sequence, on every
        // member, guarded or not, wherever it stands in the request.
        assert_eq!(
            log.write(c, vec![overlap(), absent()]).await,
            Err(StoreError::AggregateNotFound)
        );
        assert_eq!(
            log.write(
                c,
                vec![write(stale, &[3], Some(1), true), overlap(), absent()]
            )
            .await,
            Err(StoreError::AggregateNotFound)
        );
        // Then the version guard, before the in-flight sequence.
        assert_eq!(
            log.write(c, vec![overlap(), write(stale, &[3], Some(1), true)])
                .await,
            Err(StoreError::Conflict {
                expected: 1,
                current: 2
            })
        );
        hold.release();
        assert_eq!(held_write.await.unwrap(), Ok(vec![2]));
        assert_eq!(inner.details(stale).await.unwrap().max_version, 2);
        assert_eq!(
            inner.details(missing).await,
            Err(StoreError::AggregateNotFound)
        );
    }
}

/// The lost-ack rule on the real server: a client whose request timeout (1 ms) is shorter
/// than the server's answer loses the acknowledgement of most combined writes after sending
/// them, which the adapter answers `OutcomeUnknown`.
mod celeriant_lost_ack {
    use std::sync::Arc;

    use tally::store::SharedLog;
    use tally::store::celeriant::{CeleriantConfig, CeleriantLog};

    use super::multi_rules::multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none as lost_ack_rule;
    use super::required;
    use super::rules::Keys;

    /// A request timeout the server cannot meet for a combined write.
    const HASTY_TIMEOUT_MS: u64 = 1;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multi_aggregate_write_whose_ack_is_lost_applied_all_members_or_none() {
        let Some(address) = required::celeriant_address() else {
            return;
        };
        let connect = |request_timeout_ms| {
            let cfg = CeleriantConfig {
                address: address.clone(),
                request_timeout_ms,
                ..Default::default()
            };
            Arc::new(CeleriantLog::connect(&cfg).expect("Celeriant config")) as SharedLog
        };
        let log = connect(CeleriantConfig::default().request_timeout_ms);
        let lossy = connect(HASTY_TIMEOUT_MS);
        // Whether an ack is lost is up to timing; the rule holds for every answer.
        lost_ack_rule(log, lossy, Keys::random(), 150).await;
    }
}

mod memory_only {
    use std::sync::Arc;

    use tally::store::memory::{DEFAULT_PAGE_SIZE, MemoryLog, MemoryOptions, ServerClock};
    use tally::store::{EventLog, ReadFilter, StoreError};

    use super::rules::{Keys, write};

    fn log_with(page_size: usize, clock: Arc<ServerClock>) -> MemoryLog {
        MemoryLog::with_options(MemoryOptions { page_size, clock })
    }

    #[tokio::test]
    async fn a_watch_that_falls_behind_its_capacity_reports_a_gap_then_goes_on() {
        use tally::store::{WatchFilter, WatchItem};
        let log = MemoryLog::new().with_watch_capacity(2);
        let k = Keys::random();
        let (a, c) = (k.key(), k.client());
        let mut feed = log.watch(WatchFilter::default()).await.unwrap();
        for seq in 1..=5 {
            log.write(c, vec![write(a, &[seq], None, true)])
                .await
                .unwrap();
        }
        // Three of five were overwritten unread: the feed says so instead of skipping them.
        assert_eq!(feed.next().await, Ok(WatchItem::Gap));
        let mut after = Vec::new();
        for _ in 0..2 {
            match feed.next().await.unwrap() {
                WatchItem::Commit(c) => after.push(c.version),
                WatchItem::Gap => panic!("a second gap"),
            }
        }
        assert_eq!(after, vec![4, 5]);
    }

    #[tokio::test]
    async fn server_timestamps_come_from_the_clock_and_never_go_back() {
        let clock = Arc::new(ServerClock::new(1_000));
        let log = log_with(DEFAULT_PAGE_SIZE, Arc::clone(&clock));
        let (k, c) = (Keys::random(), 7);
        let (a, b) = (k.key(), k.key());
        log.write(c, vec![write(a, &[1], None, true)])
            .await
            .expect("a1");
        clock.advance(500);
        log.write(c, vec![write(a, &[2], None, true)])
            .await
            .expect("a2");
        clock.set(200);
        log.write(
            c,
            vec![write(a, &[3], None, true), write(b, &[1], None, true)],
        )
        .await
        .expect("a3 b1");
        let ts: Vec<u64> = log
            .read(a, &ReadFilter::default())
            .await
            .expect("read")
            .batches
            .iter()
            .map(|x| x.server_timestamp_ms)
            .collect();
        assert_eq!(
            ts,
            vec![1_000, 1_500, 1_500],
            "clamped to the aggregate's last"
        );
        assert_eq!(
            log.details(b).await.expect("b").last_server_timestamp_ms,
            200
        );
        let f = ReadFilter {
            min_server_timestamp_ms: Some(1_500),
            ..ReadFilter::default()
        };
        let got: Vec<u64> = log
            .read(a, &f)
            .await
            .expect("read")
            .batches
            .iter()
            .map(|x| x.version)
            .collect();
        assert_eq!(got, vec![2, 3]);
    }

    #[tokio::test]
    async fn pages_hold_at_most_page_size_matching_batches_and_point_to_the_next() {
        let log = log_with(3, Arc::new(ServerClock::new(1)));
        let (k, c1, c2) = (Keys::random(), 1, 2);
        let key = k.key();
        for seq in 1..=10 {
            let c = if seq % 2 == 0 { c2 } else { c1 };
            log.write(c, vec![write(key, &[seq], None, false)])
                .await
                .expect("write");
        }
        let page = log.read(key, &ReadFilter::default()).await.expect("read");
        let v: Vec<u64> = page.batches.iter().map(|b| b.version).collect();
        assert_eq!((v, page.next_version), (vec![1, 2, 3], Some(4)));
        let page = log
            .read(key, &ReadFilter::from_version(7))
            .await
            .expect("read");
        let v: Vec<u64> = page.batches.iter().map(|b| b.version).collect();
        assert_eq!((v, page.next_version), (vec![7, 8, 9], Some(10)));
        let page = log
            .read(key, &ReadFilter::from_version(8))
            .await
            .expect("read");
        assert_eq!(page.next_version, None, "exactly page_size left: done");
        let f = ReadFilter {
            include_client_id: Some(c2),
            ..ReadFilter::default()
        };
        let page = log.read(key, &f).await.expect("read");
        let v: Vec<u64> = page.batches.iter().map(|b| b.version).collect();
        assert_eq!((v, page.next_version), (vec![2, 4, 6], Some(7)));
        let f = ReadFilter {
            from_version: 7,
            ..f
        };
        let page = log.read(key, &f).await.expect("read");
        let v: Vec<u64> = page.batches.iter().map(|b| b.version).collect();
        assert_eq!((v, page.next_version), (vec![8, 10], None));
    }

    #[tokio::test]
    async fn batch_count_and_marks_follow_writes_and_trims() {
        let log = MemoryLog::new();
        let (k, c) = (Keys::random(), 9);
        let key = k.key();
        assert_eq!(log.batch_count(key), 0);
        log.write(c, vec![write(key, &[3, 8], None, false)])
            .await
            .expect("v1");
        log.write(c, vec![write(key, &[5], None, false)])
            .await
            .expect("v2");
        assert_eq!(log.batch_count(key), 2);
        assert_eq!(log.client_mark(key, c), Some(8));
        assert_eq!(log.client_mark(key, c + 1), None);
        log.trim_start(key, 2).await.expect("trim");
        assert_eq!(log.batch_count(key), 1);
        assert_eq!(log.client_mark(key, c), Some(8));
    }

    #[tokio::test]
    async fn the_same_aggregate_twice_in_one_write_is_rejected() {
        let log = MemoryLog::new();
        let key = Keys::random().key();
        let got = log
            .write(
                1,
                vec![write(key, &[1], None, true), write(key, &[2], None, true)],
            )
            .await;
        assert!(matches!(got, Err(StoreError::Other { .. })), "{got:?}");
        assert_eq!(log.batch_count(key), 0);
    }
}

/// Keeps `EventLog` in scope for the macro-generated modules.
#[allow(dead_code)]
fn _uses(_: &dyn EventLog) {}
