//! The key memory of one account: every key that landed on it within the retention, a few
//! bytes each, enough to find the write again with one store read.
//!
//! The recent-writes index (`index/`) answers a retry from memory alone, for the window. Past
//! the window a key is only remembered here: a 32-bit fingerprint of its event id, and the
//! version and balance its event left. A retry that matches a fingerprint reads the batch at
//! that version and looks for its own event id there (`Projection::confirm_remembered`), so
//! a collision costs one read and never replays a wrong answer. A new key that matches no
//! fingerprint costs nothing but the look.
//!
//! Layout: keys are appended in version order to a tail of at most [`TAIL_KEYS`]. A full
//! tail is sorted by fingerprint and sealed into a run; two neighbouring runs of like size
//! merge (as a binary counter carries) up to [`MAX_RUN_KEYS`]. So a look is a short scan of
//! the tail and a search in each of a few dozen runs (from where the fingerprint should sit),
//! and the oldest keys sit in the oldest run, dropped whole when they age past the retention
//! or a cap needs room. A cold replica's load builds whole runs at once
//! ([`KeyMemory::load_chain`]).
//!
//! Files: this one (the memory and its rules), `run` (one run's packed columns), `segment`
//! (the keys of a version range as a checkpoint carries them) and `tests`.

mod run;
mod segment;
#[cfg(test)]
mod tests;

use std::borrow::Borrow;
use std::collections::VecDeque;

use run::Run;
pub use segment::{MAX_SEGMENT_KEYS, Segment, SegmentKey, UNKNOWN_MS};

/// The keys the unsorted tail holds before it is sealed into a run: a look scans them all.
pub const TAIL_KEYS: usize = 1_024;
/// The largest run a merge makes: what a cap or the retention drops at once, at most.
pub const MAX_RUN_KEYS: usize = 65_536;
/// A cap forgets down to this fraction below it: the slack that keeps a memory at its cap
/// from forgetting on every push.
pub const CAP_SLACK_DIVISOR: usize = 64;
/// The most keys one look returns; more matches than that are refused as unanswerable.
pub const MAX_CANDIDATES: usize = 8;

/// A key's 32-bit fingerprint: a fixed mix of its event id, the same in every build (the
/// checkpoints carry fingerprints from one release to the next).
pub fn fingerprint(event_id: u128) -> u32 {
    let folded = (event_id as u64) ^ ((event_id >> 64) as u64).rotate_left(29);
    (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

/// What a remembered key points at: the batch that carried its event, and the balance right
/// after that event. Unconfirmed until that batch is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remembered {
    pub version: u64,
    pub balance: i64,
}

/// The keys one account remembers. Empty, it costs one pointer.
#[derive(Default)]
pub struct KeyMemory {
    inner: Option<Box<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// Sealed runs, oldest first, each sorted by fingerprint.
    runs: VecDeque<Run>,
    /// The newest keys, in version order.
    tail: Run,
    len: usize,
    /// Every key of a version above this that the fold took is here: a cap dropped the keys
    /// up to it, or the memory was loaded from a segment that starts there.
    floor: u64,
    /// The commit time (server ms) of the batch at the floor, or [`UNKNOWN_MS`].
    floor_ms: u64,
    /// The newest commit time (server ms) of a key a cap dropped (0: none). Keys committed
    /// after it are remembered for the whole retention.
    forgotten_ms: u64,
}

impl KeyMemory {
    /// Remembers `event_id`, whose event in the batch at `version` (committed at server time
    /// `commit_ms`) left `balance`. Keys come in version order.
    pub fn push(&mut self, event_id: u128, version: u64, balance: i64, commit_ms: u64) {
        let inner = self.inner.get_or_insert_with(Box::default);
        debug_assert!(
            version >= inner.newest_version(),
            "keys are remembered in version order"
        );
        inner.append(fingerprint(event_id), version, balance, commit_ms);
    }

    /// Every remembered key whose fingerprint matches `event_id`'s, at most
    /// [`MAX_CANDIDATES`] (`Err` with how many matched beyond that: an account whose keys
    /// were made to collide is refused, never answered on a guess).
    pub fn candidates(&self, event_id: u128) -> Result<Vec<Remembered>, usize> {
        let Some(inner) = self.inner.as_ref() else {
            return Ok(Vec::new());
        };
        let fp = fingerprint(event_id);
        let mut out = Vec::new();
        for run in &inner.runs {
            run.matches_sorted(fp, &mut out);
        }
        inner.tail.matches_scan(fp, &mut out);
        if out.len() > MAX_CANDIDATES {
            return Err(out.len());
        }
        Ok(out)
    }

    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| i.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The newest version a key was remembered at (0: none).
    pub fn newest_version(&self) -> u64 {
        self.inner.as_ref().map_or(0, |i| i.newest_version())
    }

    /// See [`Inner::floor`].
    pub fn floor(&self) -> u64 {
        self.inner.as_ref().map_or(0, |i| i.floor)
    }

    /// The commit time of the batch at the floor ([`UNKNOWN_MS`] when not known; 0 with no
    /// floor).
    pub fn floor_ms(&self) -> u64 {
        self.inner.as_ref().map_or(0, |i| i.floor_ms)
    }

    /// The newest commit time of a key a cap made this account forget (0: none).
    pub fn forgotten_ms(&self) -> u64 {
        self.inner.as_ref().map_or(0, |i| i.forgotten_ms)
    }

    /// No earlier than the commit time of the newest key at or below `version` (the newest
    /// commit of the run that holds it): what a segment cut there says it forgot.
    pub fn commit_ms_through(&self, version: u64) -> u64 {
        self.inner.as_ref().map_or(0, |i| {
            i.runs
                .iter()
                .chain(std::iter::once(&i.tail))
                .filter(|r| r.len() > 0 && r.min_version() <= version)
                .map(|r| r.newest_ms())
                .max()
                .unwrap_or(0)
        })
    }

    /// Bytes held on the heap (what a remembered key costs, measured).
    pub fn heap_bytes(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| {
            std::mem::size_of::<Inner>()
                + i.runs.capacity() * std::mem::size_of::<Run>()
                + i.runs.iter().map(Run::heap_bytes).sum::<usize>()
                + i.tail.heap_bytes()
        })
    }

    /// Drops the runs whose every key was committed before `oldest_ms` (past the retention).
    /// Returns how many keys went. Not a cap: nothing is forgotten that was promised.
    pub fn expire(&mut self, oldest_ms: u64) -> usize {
        let Some(inner) = self.inner.as_mut() else {
            return 0;
        };
        let mut dropped = 0;
        while inner.oldest_ms().is_some_and(|ms| ms < oldest_ms) {
            dropped += inner.drop_oldest().len();
        }
        inner.len -= dropped;
        self.clear_if_empty();
        dropped
    }

    /// Over `max` keys, forgets the oldest down to [`CAP_SLACK_DIVISOR`] below it (so a
    /// memory at its cap does not forget a few keys on every push): whole runs while they
    /// fit, then the oldest keys of the next run. The forgotten horizon moves. Returns how
    /// many keys went.
    pub fn cap(&mut self, max: usize) -> usize {
        if self.len() <= max {
            return 0;
        }
        let target = max - max / CAP_SLACK_DIVISOR;
        let mut dropped = 0;
        while let Some(inner) = self.inner.as_mut() {
            let excess = inner.len.saturating_sub(target);
            let Some(oldest) = inner
                .runs
                .front()
                .or(Some(&inner.tail))
                .filter(|r| r.len() > 0)
            else {
                break;
            };
            if excess == 0 {
                break;
            }
            if oldest.len() <= excess {
                dropped += self.forget_oldest();
                continue;
            }
            dropped += inner.forget_oldest_keys(excess);
            break;
        }
        dropped
    }

    /// Drops the oldest run (a replica-wide cap's step); the forgotten horizon moves.
    /// Returns how many keys went.
    pub fn forget_oldest(&mut self) -> usize {
        let Some(inner) = self.inner.as_mut() else {
            return 0;
        };
        let run = inner.drop_oldest();
        if run.max_version() >= inner.floor {
            inner.floor = run.max_version();
            inner.floor_ms = run.newest_ms();
        }
        inner.forgotten_ms = inner.forgotten_ms.max(run.newest_ms());
        inner.len -= run.len();
        run.len()
    }

    /// Commit time of the newest key in the oldest run (`None`: no keys): what a
    /// replica-wide cap compares accounts by.
    pub fn oldest_ms(&self) -> Option<u64> {
        self.inner.as_ref().and_then(|i| i.oldest_ms())
    }

    /// The keys of versions in `(after, through]`, in version order, for a checkpoint to carry
    /// (`after_ms`: the commit time at `after`). `None` when this memory does not hold all of
    /// them (a cap dropped some, or it was loaded from a later segment): the checkpoint then
    /// starts its segment at the floor.
    pub fn segment(&self, after: u64, after_ms: u64, through: u64) -> Option<Segment> {
        let floor = self.floor();
        if after < floor {
            return None;
        }
        let mut keys = Vec::new();
        if let Some(inner) = self.inner.as_ref() {
            for run in inner.runs.iter().chain(std::iter::once(&inner.tail)) {
                run.keys_between(after, through, &mut keys);
            }
        }
        keys.sort_by_key(|k: &SegmentKey| k.version);
        Some(Segment {
            after,
            after_ms,
            forgotten: false,
            keys,
        })
    }

    /// Loads a segment's keys, oldest segment first, into an empty memory or after its
    /// newest key (`commit_ms`: the commit time of its checkpoint's version). The first
    /// segment loaded sets the floor: nothing below it is known here.
    pub fn load(&mut self, segment: &Segment, commit_ms: u64) {
        let inner = self.inner.get_or_insert_with(Box::default);
        if inner.len == 0 && inner.floor == 0 {
            inner.floor = segment.after;
            inner.floor_ms = segment.after_ms;
        }
        // Segments may overlap one another, never themselves: a batch's keys share its
        // version, so only what an earlier segment already gave is skipped.
        let loaded = if inner.len > 0 {
            inner.newest_version()
        } else {
            0
        };
        for k in &segment.keys {
            if k.version <= loaded {
                continue;
            }
            inner.append(k.fingerprint, k.version, k.balance, commit_ms);
        }
    }

    /// Loads a chain's segments, oldest first, each with its checkpoint's commit time: as
    /// [`KeyMemory::load`] of each in turn. Into an empty memory it gathers whole runs of
    /// [`MAX_RUN_KEYS`] and sorts each once, then cuts what is left as the pushes would have
    /// left it (runs of halving size, then the tail). So a cold replica's million keys cost
    /// one sort a run, not a sort a tail and a merge a level.
    ///
    /// Owned segments are dropped as soon as they are loaded, so their memory serves the
    /// runs that follow.
    pub fn load_chain<S: Borrow<Segment>>(&mut self, segments: impl IntoIterator<Item = (S, u64)>) {
        let mut segments = segments.into_iter();
        if !self.is_empty() {
            for (seg, commit_ms) in segments {
                self.load(seg.borrow(), commit_ms);
            }
            return;
        }
        let inner = self.inner.get_or_insert_with(Box::default);
        let mut gathered = Gathered::default();
        for (seg, commit_ms) in segments.by_ref() {
            let seg = seg.borrow();
            let held = inner.len + gathered.run.len();
            if held == 0 && inner.floor == 0 {
                inner.floor = seg.after;
                inner.floor_ms = seg.after_ms;
            }
            // As `load`: only what an earlier segment already gave is skipped.
            let loaded = if held > 0 { gathered.newest_version } else { 0 };
            gathered.commits.push((gathered.run.len(), commit_ms));
            for k in seg.keys.iter().filter(|k| k.version > loaded) {
                if gathered.run.len() == MAX_RUN_KEYS {
                    gathered.seal_whole(inner, commit_ms);
                }
                gathered.make_room();
                let (fp, ms) = (k.fingerprint, commit_ms);
                if !gathered.run.try_push(fp, k.version, k.balance, ms) {
                    gathered.seal_whole(inner, commit_ms);
                    gathered.make_room();
                    let pushed = gathered.run.try_push(fp, k.version, k.balance, ms);
                    debug_assert!(pushed, "a key fits an empty run");
                }
                gathered.newest_version = k.version;
            }
        }
        gathered.finish(inner);
        self.clear_if_empty();
    }

    /// Marks versions up to `version` (committed at `commit_ms`) as not remembered here: a
    /// fold that started above keys past the retention.
    pub fn raise_floor(&mut self, version: u64, commit_ms: u64) {
        let inner = self.inner.get_or_insert_with(Box::default);
        if version >= inner.floor {
            inner.floor = version;
            inner.floor_ms = commit_ms;
        }
    }

    /// As [`KeyMemory::raise_floor`], for keys inside the retention that a cap made this
    /// account forget: the horizon its answers state moves too.
    pub fn forget_below(&mut self, version: u64, commit_ms: u64) {
        self.raise_floor(version, commit_ms);
        if let Some(inner) = self.inner.as_mut() {
            inner.forgotten_ms = inner.forgotten_ms.max(commit_ms);
        }
    }

    fn clear_if_empty(&mut self) {
        if self
            .inner
            .as_ref()
            .is_some_and(|i| i.len == 0 && i.floor == 0 && i.forgotten_ms == 0)
        {
            self.inner = None;
        }
    }
}

impl Inner {
    /// Appends one key to the tail, sealing it first when the key does not fit its offsets
    /// and after when it is full.
    fn append(&mut self, fp: u32, version: u64, balance: i64, commit_ms: u64) {
        if !self.tail.fits(version, balance) {
            self.seal();
        }
        self.tail.push(fp, version, balance, commit_ms);
        self.len += 1;
        if self.tail.len() == TAIL_KEYS {
            self.seal();
        }
    }

    fn newest_version(&self) -> u64 {
        if self.tail.len() > 0 {
            return self.tail.max_version();
        }
        self.runs.back().map_or(0, Run::max_version)
    }

    fn oldest_ms(&self) -> Option<u64> {
        match self.runs.front() {
            Some(run) => Some(run.newest_ms()),
            None => (self.tail.len() > 0).then(|| self.tail.newest_ms()),
        }
    }

    /// Forgets the `n` oldest keys of the oldest run (fewer than it holds), and any others at
    /// the same version: the floor moves to that version. Their own commit times are not
    /// kept, so the forgotten horizon moves to the run's newest: an answer may state a
    /// shorter horizon than kept, never a longer one.
    fn forget_oldest_keys(&mut self, n: usize) -> usize {
        let run = match self.runs.front_mut() {
            Some(run) => run,
            None => &mut self.tail,
        };
        let through = run.nth_oldest_version(n);
        let dropped = run.drop_through(through);
        if through >= self.floor {
            self.floor = through;
            self.floor_ms = run.newest_ms();
        }
        self.forgotten_ms = self.forgotten_ms.max(run.newest_ms());
        self.len -= dropped;
        dropped
    }

    /// Takes the oldest run (the tail when no run is sealed).
    fn drop_oldest(&mut self) -> Run {
        match self.runs.pop_front() {
            Some(run) => run,
            None => std::mem::take(&mut self.tail),
        }
    }

    /// Sorts the tail into a run, then merges like-sized neighbours.
    fn seal(&mut self) {
        if self.tail.len() == 0 {
            return;
        }
        let mut run = std::mem::take(&mut self.tail);
        run.sort_sealed();
        self.runs.push_back(run);
        while self.runs.len() >= 2 {
            let n = self.runs.len();
            let (older, newer) = (&self.runs[n - 2], &self.runs[n - 1]);
            if older.len() > newer.len() || older.len() + newer.len() > MAX_RUN_KEYS {
                break;
            }
            let Some(merged) = Run::merge(older, newer) else {
                break;
            };
            self.runs.pop_back();
            self.runs.pop_back();
            self.runs.push_back(merged);
        }
    }
}

/// Keys a load gathers in version order, not yet sealed into runs.
#[derive(Default)]
struct Gathered {
    run: Run,
    /// Where each segment's keys start in `run`, with its commit time.
    commits: Vec<(usize, u64)>,
    newest_version: u64,
}

impl Gathered {
    /// The newest commit time among the keys at `from..to`.
    fn newest_ms(&self, from: usize, to: usize) -> u64 {
        self.commits
            .iter()
            .enumerate()
            .filter(|&(i, &(start, _))| {
                let end = self.commits.get(i + 1).map_or(usize::MAX, |&(s, _)| s);
                start < to && end > from && start < end
            })
            .map(|(_, &(_, ms))| ms)
            .max()
            .unwrap_or(0)
    }

    /// Room for the next key: doubling, up to a whole run (a run's pushes grow by an
    /// eighth, which a load of thousands of keys would pay for in copies).
    fn make_room(&mut self) {
        let n = self.run.len();
        if n == self.run.capacity() {
            self.run.reserve(n.max(TAIL_KEYS).min(MAX_RUN_KEYS - n));
        }
    }

    /// Seals every key gathered into one run (full, or the next key does not fit it); the
    /// keys gathered next start a segment committed at `commit_ms`.
    fn seal_whole(&mut self, inner: &mut Inner, commit_ms: u64) {
        let mut run = std::mem::take(&mut self.run);
        let n = run.len();
        if n > 0 {
            run.sort_sealed();
            inner.runs.push_back(run);
            inner.len += n;
        }
        self.commits.clear();
        self.commits.push((0, commit_ms));
    }

    /// Seals what is left as a binary counter of pushes would hold it: runs of halving size
    /// from [`MAX_RUN_KEYS`] down to [`TAIL_KEYS`], then the rest as the tail, in version
    /// order.
    fn finish(mut self, inner: &mut Inner) {
        let n = self.run.len();
        if n == MAX_RUN_KEYS {
            self.seal_whole(inner, 0);
            return;
        }
        let mut from = 0;
        let mut size = MAX_RUN_KEYS / 2;
        while size >= TAIL_KEYS {
            if n - from >= size {
                let mut run = self
                    .run
                    .slice(from..from + size, self.newest_ms(from, from + size));
                run.sort_sealed();
                inner.runs.push_back(run);
                from += size;
            }
            size /= 2;
        }
        if from < n {
            inner.tail = self.run.slice(from..n, self.newest_ms(from, n));
        }
        inner.len += n;
    }
}
