//! One run of remembered keys, packed in three columns: 12 bytes a key. Versions and balances
//! are kept relative to the run's first key, so a run holds only keys whose version lies
//! within 2^32 of it and whose balance lies within an `i32` of it; a key that does not fit
//! starts a new run.

use super::Remembered;
use super::segment::SegmentKey;

#[derive(Default)]
pub(super) struct Run {
    base_version: u64,
    base_balance: i64,
    max_version: u64,
    /// The newest commit time (server ms) of a key in it.
    newest_ms: u64,
    /// Sorted by fingerprint once sealed; in version order in the tail.
    fps: Vec<u32>,
    versions: Vec<u32>,
    balances: Vec<i32>,
}

impl Run {
    pub(super) fn len(&self) -> usize {
        self.fps.len()
    }

    pub(super) fn max_version(&self) -> u64 {
        self.max_version
    }

    /// The oldest version a key of it may have (its first key's, or below).
    pub(super) fn min_version(&self) -> u64 {
        self.base_version
    }

    pub(super) fn newest_ms(&self) -> u64 {
        self.newest_ms
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.fps.capacity() * 4 + self.versions.capacity() * 4 + self.balances.capacity() * 4
    }

    /// Whether a key at `version` leaving `balance` fits this run's offsets.
    pub(super) fn fits(&self, version: u64, balance: i64) -> bool {
        self.len() == 0 || self.offsets(version, balance).is_some()
    }

    fn offsets(&self, version: u64, balance: i64) -> Option<(u32, i32)> {
        let v = u32::try_from(version.checked_sub(self.base_version)?).ok()?;
        let b = i32::try_from(balance.checked_sub(self.base_balance)?).ok()?;
        Some((v, b))
    }

    /// Appends a key (the tail only). The caller checked [`Run::fits`].
    pub(super) fn push(&mut self, fp: u32, version: u64, balance: i64, commit_ms: u64) {
        if self.len() == 0 {
            self.base_version = version;
            self.base_balance = balance;
        }
        let (v, b) = self
            .offsets(version, balance)
            .expect("a key is pushed only into a run it fits");
        // Grow by an eighth, not double: the tail is most of a quiet account's keys.
        if self.fps.len() == self.fps.capacity() {
            let more = (self.fps.len() / 8).max(8);
            self.fps.reserve_exact(more);
            self.versions.reserve_exact(more);
            self.balances.reserve_exact(more);
        }
        self.fps.push(fp);
        self.versions.push(v);
        self.balances.push(b);
        self.max_version = self.max_version.max(version);
        self.newest_ms = self.newest_ms.max(commit_ms);
    }

    fn key(&self, i: usize) -> SegmentKey {
        SegmentKey {
            fingerprint: self.fps[i],
            version: self.base_version + u64::from(self.versions[i]),
            balance: self.base_balance + i64::from(self.balances[i]),
        }
    }

    /// Sorts the keys by fingerprint and frees the spare capacity: the run is sealed.
    pub(super) fn sort_sealed(&mut self) {
        let mut order: Vec<u32> = (0..self.len() as u32).collect();
        order.sort_unstable_by_key(|&i| self.fps[i as usize]);
        self.fps = order.iter().map(|&i| self.fps[i as usize]).collect();
        self.versions = order.iter().map(|&i| self.versions[i as usize]).collect();
        self.balances = order.iter().map(|&i| self.balances[i as usize]).collect();
    }

    fn remembered(&self, i: usize) -> Remembered {
        let k = self.key(i);
        Remembered {
            version: k.version,
            balance: k.balance,
        }
    }

    /// Appends the keys matching `fp` in a sealed run: a binary search.
    pub(super) fn matches_sorted(&self, fp: u32, out: &mut Vec<Remembered>) {
        let start = self.fps.partition_point(|&f| f < fp);
        let end = start + self.fps[start..].partition_point(|&f| f == fp);
        out.extend((start..end).map(|i| self.remembered(i)));
    }

    /// Appends the keys matching `fp` in the tail (in version order): a scan.
    pub(super) fn matches_scan(&self, fp: u32, out: &mut Vec<Remembered>) {
        for (i, &f) in self.fps.iter().enumerate() {
            if f == fp {
                out.push(self.remembered(i));
            }
        }
    }

    /// Appends the keys of versions in `(after, through]`.
    pub(super) fn keys_between(&self, after: u64, through: u64, out: &mut Vec<SegmentKey>) {
        if self.len() == 0 || self.max_version <= after || self.base_version > through {
            return;
        }
        out.extend(
            (0..self.len())
                .map(|i| self.key(i))
                .filter(|k| k.version > after && k.version <= through),
        );
    }

    /// The version of the `n`-th oldest key (1-based; `n` at most the run's length).
    pub(super) fn nth_oldest_version(&self, n: usize) -> u64 {
        let mut offsets = self.versions.clone();
        let (_, nth, _) = offsets.select_nth_unstable(n.clamp(1, self.len()) - 1);
        self.base_version + u64::from(*nth)
    }

    /// Drops every key of a version at or below `through`, keeping the others in their
    /// order (a sealed run stays sorted). Returns how many went.
    pub(super) fn drop_through(&mut self, through: u64) -> usize {
        let before = self.len();
        let kept: Vec<usize> = (0..before)
            .filter(|&i| self.base_version + u64::from(self.versions[i]) > through)
            .collect();
        self.fps = kept.iter().map(|&i| self.fps[i]).collect();
        self.versions = kept.iter().map(|&i| self.versions[i]).collect();
        self.balances = kept.iter().map(|&i| self.balances[i]).collect();
        before - self.len()
    }

    /// Two sealed neighbours as one sealed run, when the newer's keys fit the older's
    /// offsets; `None` when they do not.
    pub(super) fn merge(older: &Run, newer: &Run) -> Option<Run> {
        let mut merged = Run {
            base_version: older.base_version,
            base_balance: older.base_balance,
            max_version: older.max_version.max(newer.max_version),
            newest_ms: older.newest_ms.max(newer.newest_ms),
            fps: Vec::with_capacity(older.len() + newer.len()),
            versions: Vec::with_capacity(older.len() + newer.len()),
            balances: Vec::with_capacity(older.len() + newer.len()),
        };
        let rebased: Vec<(u32, i32)> = (0..newer.len())
            .map(|i| {
                let k = newer.key(i);
                merged.offsets(k.version, k.balance)
            })
            .collect::<Option<_>>()?;
        let (mut a, mut b) = (0, 0);
        while a < older.len() || b < newer.len() {
            let take_older = b == newer.len() || (a < older.len() && older.fps[a] <= newer.fps[b]);
            if take_older {
                merged.fps.push(older.fps[a]);
                merged.versions.push(older.versions[a]);
                merged.balances.push(older.balances[a]);
                a += 1;
            } else {
                merged.fps.push(newer.fps[b]);
                merged.versions.push(rebased[b].0);
                merged.balances.push(rebased[b].1);
                b += 1;
            }
        }
        Some(merged)
    }
}
