//! Who owns a contested client sequence. A 2002 proves only that some committed batch from
//! our client id recorded a sequence at or above ours; with one client id shared by every
//! request of every replica, it may be a sibling's. The stream knows which: a point read of
//! the contested sequences, scoped to our client id, from the minimum available version.

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

/// Point-reads the sequences `first..=last` of `client` on `key`. The read starts at version
/// 1 and, when that range was trimmed, once more from the minimum available version.
pub async fn read_seq_owners(
    log: &dyn EventLog,
    key: AggregateKey,
    client: ClientId,
    first: u64,
    last: u64,
) -> Result<SeqOwners, StoreError> {
    let filter = |from_version| ReadFilter {
        from_version,
        min_client_seq: Some(first),
        max_client_seq: Some(last),
        include_client_id: Some(client),
        ..ReadFilter::default()
    };
    match collect_owners(log, key, filter(1), first, last).await {
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
    loop {
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
    use super::*;

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
