//! Bulk appends: a fold appends a page's records as it goes and they are indexed in one pass
//! when the guard drops, with a mark to take back a batch that did not fold whole.

use super::table::Inner;
use super::{RecentIndex, RecentWrite};

/// Bulk appends to a [`RecentIndex`], indexed on drop. See [`RecentIndex::bulk`].
pub struct Bulk<'a> {
    pub(super) index: &'a mut RecentIndex,
}

/// Where a [`Bulk`] stood: [`Bulk::rollback`] takes back what was appended after it.
#[derive(Clone, Copy, Debug)]
pub struct BulkMark {
    records: usize,
    parties: usize,
}

impl Bulk<'_> {
    /// Where the bulk stands now.
    #[inline]
    pub fn mark(&self) -> BulkMark {
        self.index.inner.as_deref().map_or(
            BulkMark {
                records: 0,
                parties: 0,
            },
            |inner| BulkMark {
                records: inner.records.len(),
                parties: inner.parties.len(),
            },
        )
    }

    /// Takes back every record appended since `mark`: none of them is indexed yet.
    pub fn rollback(&mut self, mark: BulkMark) {
        let Some(inner) = self.index.inner.as_mut() else {
            return;
        };
        let appended = inner.records.len() - mark.records;
        assert!(
            appended <= inner.pending_tags.len(),
            "only records a bulk appended and has not indexed are taken back"
        );
        inner.records.truncate(mark.records);
        inner
            .pending_tags
            .truncate(inner.pending_tags.len() - appended);
        inner.parties.truncate(mark.parties);
    }

    /// Records `write` under `event_id`, after every record appended before it.
    #[inline]
    pub fn push(&mut self, event_id: u128, write: RecentWrite) {
        self.index
            .inner
            .get_or_insert_with(|| Box::new(Inner::new()))
            .append(event_id, write);
    }
}

impl Drop for Bulk<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.index.inner.as_mut() {
            inner.commit();
        }
    }
}
