//! Translation between the port's types and the `celeriant_msg` wire types: keys, events and
//! batches; the server-side half of a read filter; the version window of one page and where
//! the next page starts; and the size estimate that refuses an oversized write before sending.
//!
//! Pure functions only, so paging and filtering can be tested without a server. The
//! client-sequence filters are not sent (the server would cut events out of a batch); the
//! adapter applies them to whole batches with `ReadFilter::admits`.

use std::sync::Arc;

use bytes::Bytes;
use celeriant_msg::request::read_filters::ReadFilters;
use celeriant_msg::response::aggregate_event_batch::AggregateEventBatch;
use celeriant_wal::aggregate_key::AggregateKey as WireKey;
use celeriant_wal::datablocks::datablock_aggregate_event::DatablockAggregateEvent;

use crate::store::{AggregateKey, AggregateWrite, Batch, Event, EventType, ReadFilter};

/// Most versions one `read` call asks the server for. The server also cuts a page at its
/// response-size limit; whichever is smaller wins.
pub const READ_PAGE_MAX_VERSIONS: u64 = 512;

/// Estimated encoding overhead per event and per aggregate, used to refuse a write that
/// could not fit the request-size limit before anything is sent.
pub(super) const EVENT_OVERHEAD_BYTES: usize = 128;
pub(super) const AGGREGATE_OVERHEAD_BYTES: usize = 128;

pub(super) fn wire_key(key: AggregateKey) -> WireKey {
    WireKey::new(key.org_id, key.aggregate_type_id, key.aggregate_id)
}

pub(super) fn wire_event(event: Event) -> DatablockAggregateEvent {
    DatablockAggregateEvent {
        client_seq: event.client_seq,
        // Assigned by the server.
        event_seq: 0,
        event_id: event.event_id,
        event_timestamp: event.timestamp_ms,
        event_type_major: event.event_type.major,
        event_type_minor: event.event_type.minor,
        event_value: Arc::new(Vec::from(event.payload)),
        iv: None,
    }
}

pub(super) fn port_event(event: DatablockAggregateEvent) -> Event {
    let payload = Arc::try_unwrap(event.event_value).unwrap_or_else(|shared| (*shared).clone());
    Event {
        client_seq: event.client_seq,
        event_id: event.event_id,
        event_type: EventType {
            major: event.event_type_major,
            minor: event.event_type_minor,
        },
        payload: Bytes::from(payload),
        timestamp_ms: event.event_timestamp,
    }
}

pub(super) fn port_batch(batch: AggregateEventBatch) -> Batch {
    Batch {
        version: batch.aggregate_version,
        client_id: batch.client_id,
        server_timestamp_ms: batch.server_timestamp,
        events: batch.events.into_iter().map(port_event).collect(),
    }
}

/// The version window one read asks for: `[from, to]`, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Window {
    pub(super) from: u64,
    pub(super) to: u64,
    /// Whether `to` is the caller's own bound (nothing past it is wanted).
    pub(super) caller_bound: bool,
}

pub(super) fn window(filter: &ReadFilter) -> Window {
    let from = filter.from_version.max(1);
    let cap = from.saturating_add(READ_PAGE_MAX_VERSIONS - 1);
    match filter.to_version {
        Some(to) if to <= cap => Window {
            from,
            to,
            caller_bound: true,
        },
        _ => Window {
            from,
            to: cap,
            caller_bound: false,
        },
    }
}

/// What one read asks the server for: the version window, and no filter. The port's
/// batch-level filters (client id, server time, client sequences) are applied here, with
/// `ReadFilter::admits`: the server would cut events out of a batch for the client-sequence
/// ones, and for the others it serves a window from its memory of recent writes only when
/// the window's first version passes, else it walks the account's chain back from its
/// newest write on disk. A filtered read of 512 versions on a 3,000-version account cost
/// about a second there (Celeriant e7c6df9), the same read unfiltered a few ms.
pub(super) fn server_filters(w: Window) -> ReadFilters {
    ReadFilters::new(w.from).to_aggregate_version(w.to)
}

/// Where the next page starts, as far as one response can tell, or `None` at the end.
pub(super) fn next_after(
    w: Window,
    server_next: Option<u64>,
    last_returned: Option<u64>,
) -> Option<u64> {
    if let Some(n) = server_next {
        // The server cut the page at its size limit.
        return Some(n);
    }
    if w.caller_bound {
        return None;
    }
    let after = w.to.checked_add(1)?;
    // Unfiltered versions are contiguous, so a short window ended at the tip.
    (last_returned == Some(w.to)).then_some(after)
}

/// An estimate of a write's encoded size, to refuse one the client could not send.
pub(super) fn estimated_request_bytes(writes: &[AggregateWrite]) -> usize {
    writes
        .iter()
        .map(|w| {
            AGGREGATE_OVERHEAD_BYTES
                + w.events
                    .iter()
                    .map(|e| e.payload.len().saturating_add(EVENT_OVERHEAD_BYTES))
                    .sum::<usize>()
        })
        .sum()
}
