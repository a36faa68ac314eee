//! The port's watch over Celeriant's: one dedicated `WatchConnection` (not pooled), whose
//! notifications name an aggregate and the version a write took it to.
//!
//! The server batches notifications; this feed hands them out one at a time. A broken
//! connection is an error: the caller opens a new feed and resyncs by reading, since the
//! server does not replay what was sent while no one was connected.

use std::collections::{HashSet, VecDeque};

use async_trait::async_trait;
use celeriant_client_tokio::{WatchConnection, WatchOptions};
use celeriant_msg::request::requests::WatchRequest;
use celeriant_msg::response::watch_event::WatchResponseEvent;

use super::{CeleriantLog, Op, map_error};
use crate::store::{AggregateKey, Commit, StoreResult, WatchFeed, WatchFilter, WatchItem};

/// The `operation` of a notification for a committed write (checked against a live server
/// by `tests/store/conformance.rs`); others (trims) carry no new version and are skipped.
pub const WRITE_OPERATION: u8 = 1;

impl CeleriantLog {
    /// Opens a watch connection for the aggregates `filter` admits.
    pub(super) async fn open_watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        let request = WatchRequest {
            correlation_id: None,
            requested_latency_ms: None,
            shard_id: None,
            orgs: filter.org_id.map(|o| HashSet::from([o])),
            aggregate_types: filter.aggregate_type_id.map(|t| HashSet::from([t])),
            aggregates: None,
            operation_types: Some(HashSet::from([WRITE_OPERATION])),
        };
        let connection = self
            .pool
            .watch(request, WatchOptions::default())
            .await
            .map_err(|e| map_error(Op::Read, e))?;
        Ok(Box::new(CeleriantFeed {
            connection,
            pending: VecDeque::new(),
            filter,
        }))
    }
}

struct CeleriantFeed {
    connection: WatchConnection,
    pending: VecDeque<Commit>,
    filter: WatchFilter,
}

/// The commit a notification reports, if it is a write's.
fn commit_of(e: &WatchResponseEvent) -> Option<Commit> {
    if e.operation != WRITE_OPERATION {
        return None;
    }
    Some(Commit {
        key: AggregateKey {
            org_id: e.org_id,
            aggregate_type_id: e.aggregate_type_id,
            aggregate_id: e.aggregate_id,
        },
        version: e.to_aggregate_version?,
    })
}

#[async_trait]
impl WatchFeed for CeleriantFeed {
    async fn next(&mut self) -> StoreResult<WatchItem> {
        loop {
            if let Some(c) = self.pending.pop_front() {
                return Ok(WatchItem::Commit(c));
            }
            let response = self
                .connection
                .next()
                .await
                .map_err(|e| map_error(Op::Read, e))?;
            let filter = self.filter;
            self.pending.extend(
                response
                    .events
                    .iter()
                    .filter_map(commit_of)
                    .filter(|c| filter.admits(&c.key)),
            );
        }
    }
}
