//! Who owns a contested client sequence. A 2002 proves only that some committed batch from
//! our client id recorded a sequence at or above ours; with one client id shared by every
//! request of every replica, it may be a sibling's. The stream knows which: a point read of
//! the contested sequences, scoped to our client id, from the lowest version at which they
//! could have landed (or the minimum available version, past a trim).
//!
//! Bounded: a sequence derived on a fold at version `v` is above every sequence of ours the
//! stream holds up to `v` (the fold saw them all), so any batch holding it, ours or a
//! sibling's, is above `v`. The read starts there, not at version 1, so settling a 2002
//! costs a page or two however long the stream is, and at most [`MAX_OWNERSHIP_PAGES`].

use std::collections::HashMap;

use crate::store::{AggregateKey, BatchStream, ClientId, EventLog, ReadFilter, StoreError};

/// The verdict on one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqOwnership {
    /// Our event id holds the sequence: the earlier attempt landed, at this version.
    Ours { version: u64 },
    /// Another request's event holds it: ours never landed under it.
    Sibling,
    /// Nothing visible holds it. Not a verdict: a lagging replica, a trimmed range or a
    /// soft-deleted aggregate all look like this, and the server still counts the sequence
    /// as consumed. Refuse to guess.
    Unwritten,
}

/// What a point read found at each sequence of a range: (event id, batch version).
pub type SeqOwners = HashMap<u64, (Option<u128>, u64)>;

/// The most pages one ownership read may take. Past it the read gives up with
/// [`StoreError::NotApplied`] (nothing was learnt; the loop holds and tries again later).
pub const MAX_OWNERSHIP_PAGES: usize = 8;

/// Point-reads the sequences `first..=last` of `client` on `key`, from version 1.
pub async fn read_seq_owners(
    log: &dyn EventLog,
    key: AggregateKey,
    client: ClientId,
    first: u64,
    last: u64,
) -> Result<SeqOwners, StoreError> {
    read_seq_owners_from(log, key, client, first, last, 1).await
}

/// Point-reads the sequences `first..=last` of `client` on `key`, from `from_version` (no
/// batch below it can hold them) and, when that range was trimmed, once more from the
/// minimum available version.
pub async fn read_seq_owners_from(
    log: &dyn EventLog,
    key: AggregateKey,
    client: ClientId,
    first: u64,
    last: u64,
    from_version: u64,
) -> Result<SeqOwners, StoreError> {
    let filter = |from_version| ReadFilter {
        from_version,
        min_client_seq: Some(first),
        max_client_seq: Some(last),
        include_client_id: Some(client),
        ..ReadFilter::default()
    };
    match collect_owners(log, key, filter(from_version.max(1)), first, last).await {
        Err(StoreError::Trimmed { min_available }) => {
            collect_owners(log, key, filter(min_available), first, last).await
        }
        other => other,
    }
}

async fn collect_owners(
    log: &dyn EventLog,
    key: AggregateKey,
    filter: ReadFilter,
    first: u64,
    last: u64,
) -> Result<SeqOwners, StoreError> {
    let mut owners = SeqOwners::new();
    let mut stream = BatchStream::new(log, key, filter);
    for _ in 0..MAX_OWNERSHIP_PAGES {
        let page = match stream.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) | Err(StoreError::AggregateNotFound) => return Ok(owners),
            Err(e) => return Err(e),
        };
        for batch in &page {
            for e in batch.events.iter() {
                if (first..=last).contains(&e.client_seq) {
                    owners
                        .entry(e.client_seq)
                        .or_insert((e.event_id, batch.version));
                }
            }
        }
        if owners.len() as u64 > last - first {
            return Ok(owners);
        }
    }
    Err(StoreError::shed(format!(
        "the ownership read passed {MAX_OWNERSHIP_PAGES} pages"
    )))
}

/// The verdict for `event_id` at `seq`, given what the point read found.
pub fn ownership(owners: &SeqOwners, seq: u64, event_id: u128) -> SeqOwnership {
    match owners.get(&seq) {
        Some(&(Some(id), version)) if id == event_id => SeqOwnership::Ours { version },
        Some(_) => SeqOwnership::Sibling,
        None => SeqOwnership::Unwritten,
    }
}

/// Combines the verdicts of an operation's legs (each leg has its own sequence, all carry the
/// same event id; the write was all or nothing): our id on any leg proves it landed, a
/// sibling on any leg proves it did not, and only if every leg is unwritten is it unknown.
pub fn combine(verdicts: impl IntoIterator<Item = SeqOwnership>) -> SeqOwnership {
    let mut combined = SeqOwnership::Unwritten;
    for v in verdicts {
        match v {
            SeqOwnership::Ours { .. } => return v,
            SeqOwnership::Sibling => combined = SeqOwnership::Sibling,
            SeqOwnership::Unwritten => {}
        }
    }
    combined
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::store::memory::{MemoryLog, MemoryOptions};
    use crate::store::{AggregateWrite, Event, EventType};

    const CLIENT: ClientId = 7;
    const KEY: AggregateKey = AggregateKey {
        org_id: 1,
        aggregate_type_id: 2,
        aggregate_id: 3,
    };

    /// A stream of `n` batches of ours, one event each, sequence = version, event id =
    /// 1000 + version; read `page_size` batches a page.
    fn long_stream(n: u64, page_size: usize) -> MemoryLog {
        let log = MemoryLog::with_options(MemoryOptions {
            page_size,
            ..MemoryOptions::default()
        });
        for v in 1..=n {
            let write = AggregateWrite {
                key: KEY,
                events: vec![Event {
                    client_seq: v,
                    event_id: Some(u128::from(1000 + v)),
                    event_type: EventType { major: 1, minor: 0 },
                    payload: Bytes::from_static(b"{}"),
                    timestamp_ms: 0,
                }],
                expected_version: Some(v - 1),
                allow_create: true,
                enforce_client_idempotency: true,
            };
            log.write_now(CLIENT, vec![write]).expect("write");
        }
        log
    }

    /// Rule: settling a 2002 costs a page or two however long the stream is: the read starts
    /// one above the fold the sequence was derived on, where it can first stand.
    #[tokio::test]
    async fn an_ownership_read_from_the_sequences_floor_takes_one_page_of_a_long_stream() {
        let log = long_stream(2_000, 10);
        let owners = read_seq_owners_from(&log, KEY, CLIENT, 1_995, 1_995, 1_995)
            .await
            .expect("one page");
        assert_eq!(
            ownership(&owners, 1_995, 1_000 + 1_995),
            SeqOwnership::Ours { version: 1_995 }
        );
    }

    /// Rule: the ownership read is bounded; past its page cap it says nothing was learnt (a
    /// retryable not-applied), never a verdict. (A range of 2,000 sequences at 10 batches a
    /// page needs 200 pages.)
    #[tokio::test]
    async fn an_ownership_read_past_its_page_cap_gives_up_without_a_verdict() {
        let log = long_stream(2_000, 10);
        let got = read_seq_owners(&log, KEY, CLIENT, 1, 2_000).await;
        assert!(matches!(got, Err(StoreError::NotApplied { .. })), "{got:?}");
    }

    #[test]
    fn our_id_on_either_leg_proves_the_write_landed() {
        let ours = SeqOwnership::Ours { version: 3 };
        assert_eq!(combine([SeqOwnership::Unwritten, ours]), ours);
        assert_eq!(combine([SeqOwnership::Sibling, ours]), ours);
        assert_eq!(
            combine([SeqOwnership::Unwritten, SeqOwnership::Sibling]),
            SeqOwnership::Sibling
        );
        assert_eq!(
            combine([SeqOwnership::Unwritten, SeqOwnership::Unwritten]),
            SeqOwnership::Unwritten
        );
    }

    #[test]
    fn an_event_without_our_id_is_a_siblings() {
        let mut owners = SeqOwners::new();
        owners.insert(5, (Some(9), 2));
        owners.insert(6, (None, 3));
        assert_eq!(ownership(&owners, 5, 9), SeqOwnership::Ours { version: 2 });
        assert_eq!(ownership(&owners, 5, 8), SeqOwnership::Sibling);
        assert_eq!(ownership(&owners, 6, 8), SeqOwnership::Sibling);
        assert_eq!(ownership(&owners, 7, 8), SeqOwnership::Unwritten);
    }
}
