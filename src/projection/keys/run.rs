//! One run of remembered keys, packed in three columns: 12 bytes a key. Versions and balances
//! are kept relative to the run's first key, so a run holds only keys whose version lies
//! within 2^32 of it and whose balance lies within an `i32` of it; a key that does not fit
//! starts a new run.

use super::Remembered;
use super::segment::SegmentKey;

/// Bits of the fingerprint a radix pass sorts by: 2,048 counters, which sit in the L1 cache.
const RADIX_BITS: u32 = 11;
/// Passes over a 32-bit fingerprint.
const RADIX_PASSES: usize = 3;
/// Below this a comparison sort is cheaper than the radix sort's counters.
const RADIX_MIN_KEYS: usize = 256;
/// Fingerprints a tail scan compares at once.
const SCAN_CHUNK: usize = 64;

/// The first position in `fps` (sorted) whose fingerprint is not below `fp`. Fingerprints
/// are spread evenly over 32 bits, so `fp` sits near `fp / 2^32` of the way along: the
/// search starts there and gallops out, touching a cache line or two where a binary search
/// touches a line a step. Fingerprints made to bunch up cost at most about twice a binary
/// search's steps.
pub(super) fn lower_bound(fps: &[u32], fp: u32) -> usize {
    let n = fps.len();
    if n == 0 {
        return 0;
    }
    let guess = ((u64::from(fp) * n as u64) >> 32) as usize;
    let (lo, hi) = if fps[guess] < fp {
        // The answer lies in (guess, n].
        let (mut lo, mut step) = (guess + 1, 1);
        let hi = loop {
            let probe = guess + step;
            if probe >= n {
                break n;
            }
            if fps[probe] >= fp {
                break probe;
            }
            lo = probe + 1;
            step *= 2;
        };
        (lo, hi)
    } else {
        // The answer lies in [0, guess].
        let (mut hi, mut step) = (guess, 1);
        let lo = loop {
            if step > guess {
                break 0;
            }
            let probe = guess - step;
            if fps[probe] < fp {
                break probe + 1;
            }
            hi = probe;
            step *= 2;
        };
        (lo, hi)
    };
    lo + fps[lo..hi].partition_point(|&f| f < fp)
}

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

    /// Appends a key when it fits this run's offsets (a load's gathering); `false` when not.
    pub(super) fn try_push(&mut self, fp: u32, version: u64, balance: i64, commit_ms: u64) -> bool {
        if self.len() == 0 {
            self.base_version = version;
            self.base_balance = balance;
        }
        let Some((v, b)) = self.offsets(version, balance) else {
            return false;
        };
        self.fps.push(fp);
        self.versions.push(v);
        self.balances.push(b);
        self.max_version = self.max_version.max(version);
        self.newest_ms = self.newest_ms.max(commit_ms);
        true
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

    /// Sorts the keys by fingerprint and frees the spare capacity: the run is sealed. Keys
    /// of one fingerprint keep their order.
    pub(super) fn sort_sealed(&mut self) {
        let n = self.len();
        if n < RADIX_MIN_KEYS {
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.sort_by_key(|&i| self.fps[i as usize]);
            self.fps = order.iter().map(|&i| self.fps[i as usize]).collect();
            self.versions = order.iter().map(|&i| self.versions[i as usize]).collect();
            self.balances = order.iter().map(|&i| self.balances[i as usize]).collect();
            return;
        }
        self.radix_sort();
    }

    /// A least-significant-digit radix sort by fingerprint, in [`RADIX_PASSES`] stable
    /// passes over (fingerprint, position) pairs, then one gather of the other two columns:
    /// linear in the keys, where a comparison sort of a loaded run of 65,536 costs sixteen
    /// compares a key. Written by hand because it sorts three columns by one of them, which
    /// no sorting crate's API takes.
    fn radix_sort(&mut self) {
        const BUCKETS: usize = 1 << RADIX_BITS;
        const MASK: u64 = (1 << RADIX_BITS) - 1;
        let n = self.len();
        let digit =
            |pair: u64, pass: usize| ((pair >> (32 + pass as u32 * RADIX_BITS)) & MASK) as usize;
        let mut pairs: Vec<u64> = self
            .fps
            .iter()
            .enumerate()
            .map(|(i, &fp)| (u64::from(fp) << 32) | i as u64)
            .collect();
        let mut counts = [[0u32; BUCKETS]; RADIX_PASSES];
        for &pair in &pairs {
            for (pass, c) in counts.iter_mut().enumerate() {
                c[digit(pair, pass)] += 1;
            }
        }
        let mut into = vec![0u64; n];
        for (pass, c) in counts.iter().enumerate() {
            // A digit every key shares leaves the order as it is.
            if c.iter().any(|&k| k as usize == n) {
                continue;
            }
            let mut at = [0u32; BUCKETS];
            let mut sum = 0;
            for (slot, &k) in at.iter_mut().zip(c) {
                *slot = sum;
                sum += k;
            }
            for &pair in &pairs {
                let d = digit(pair, pass);
                into[at[d] as usize] = pair;
                at[d] += 1;
            }
            std::mem::swap(&mut pairs, &mut into);
        }
        self.fps = pairs.iter().map(|&p| (p >> 32) as u32).collect();
        self.versions = pairs
            .iter()
            .map(|&p| self.versions[p as u32 as usize])
            .collect();
        self.balances = pairs
            .iter()
            .map(|&p| self.balances[p as u32 as usize])
            .collect();
    }

    /// A run of its own (in this one's order, not yet sealed) holding the keys at `range`,
    /// the newest of them committed at `newest_ms`.
    pub(super) fn slice(&self, range: std::ops::Range<usize>, newest_ms: u64) -> Run {
        let max_offset = self.versions[range.clone()].iter().max().copied();
        Run {
            base_version: self.base_version,
            base_balance: self.base_balance,
            max_version: max_offset.map_or(0, |v| self.base_version + u64::from(v)),
            newest_ms,
            fps: self.fps[range.clone()].to_vec(),
            versions: self.versions[range.clone()].to_vec(),
            balances: self.balances[range].to_vec(),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        self.fps.capacity()
    }

    /// Room for `more` keys beyond those it holds.
    pub(super) fn reserve(&mut self, more: usize) {
        self.fps.reserve_exact(more);
        self.versions.reserve_exact(more);
        self.balances.reserve_exact(more);
    }

    fn remembered(&self, i: usize) -> Remembered {
        let k = self.key(i);
        Remembered {
            version: k.version,
            balance: k.balance,
        }
    }

    /// Appends the keys matching `fp` in a sealed run: a search from where `fp` should sit.
    pub(super) fn matches_sorted(&self, fp: u32, out: &mut Vec<Remembered>) {
        let start = lower_bound(&self.fps, fp);
        let end = start + self.fps[start..].iter().take_while(|&&f| f == fp).count();
        out.extend((start..end).map(|i| self.remembered(i)));
    }

    /// Appends the keys matching `fp` in the tail (in version order): a scan. Every new
    /// write looks, and nearly every look finds nothing, so a first pass without an early
    /// exit (which the compiler vectorises) answers most of them.
    pub(super) fn matches_scan(&self, fp: u32, out: &mut Vec<Remembered>) {
        let any = self
            .fps
            .chunks(SCAN_CHUNK)
            .any(|c| c.iter().fold(false, |hit, &f| hit | (f == fp)));
        if !any {
            return;
        }
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
