//! Holds: money reserved on an account now and posted, voided or expired later, exactly once.
//!
//! A hold is placed by a `HoldPlaced` event; its id is that event's id (the placing request's
//! key), so a retried placement names the same hold. It resolves by the first of
//! `HoldPosted`, `HoldVoided` or `HoldExpired` to land in the account's stream: the stream's
//! order is the truth, and the fold refuses a second resolution as an impossible state.
//!
//! [`HoldBook`] is the fold's part: the open holds and their sum, and the newest resolutions.
//! It is pure: no clock, no store. Expiry times are the store's server time.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::num::NonZeroU32;

use uuid::Uuid;

use super::AccountId;

/// The most open holds one account carries. A placement past it is refused (422
/// `HOLD_LIMIT`). It bounds the fold's memory and a checkpoint's size (about 48 bytes a hold).
pub const MAX_OPEN_HOLDS_PER_ACCOUNT: usize = 10_000;

/// The newest resolutions an account's fold remembers, so that a second post or void of a
/// resolved hold names how it resolved (409 `HOLD_RESOLVED`). Older ones are forgotten, and
/// such a hold answers 404 `HOLD_NOT_FOUND`: it is not open, which is what keeps it from
/// resolving twice. Checkpoints carry them, so a cold replica answers as a warm one does.
pub const MAX_RESOLUTIONS_KEPT: usize = 1_024;

/// The longest expiry a placement may ask for: 90 days.
pub const MAX_HOLD_EXPIRY_SECS: u32 = 90 * 24 * 3600;

/// A hold's id: the event id of the event that placed it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HoldId(pub Uuid);

impl HoldId {
    pub fn as_u128(self) -> u128 {
        self.0.as_u128()
    }
}

impl fmt::Display for HoldId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for HoldId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// How a hold resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    Posted,
    Voided,
    Expired,
}

impl Resolution {
    /// The name the API uses (`status` of a hold, `resolution` of a refusal).
    pub fn name(self) -> &'static str {
        match self {
            Resolution::Posted => "posted",
            Resolution::Voided => "voided",
            Resolution::Expired => "expired",
        }
    }
}

/// When a hold was placed, server ms: its batch's commit time. A replica's own write learns
/// no commit time from the store's answer, only a lower bound (its estimate of the server's
/// now); the exact time is read from the batch when an expiry depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    Known(u64),
    AtLeast(u64),
}

/// Whether a hold is past its expiry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    No,
    Yes,
    /// Its commit time is not known exactly, and by the lower bound it may be due: read the
    /// placing batch to know.
    Unsure,
}

/// An open hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenHold {
    pub amount: i64,
    /// Where a post moves the money; `None`: a post takes it out of the account.
    pub to: Option<AccountId>,
    /// How long after its placement it expires; `None`: never.
    pub expires_in_secs: Option<NonZeroU32>,
    /// The account version that placed it.
    pub placed_version: u64,
    pub placed: Commit,
}

impl OpenHold {
    /// When it expires, server ms, when that is known exactly.
    pub fn expires_at_ms(&self) -> Option<u64> {
        match (self.expires_in_secs, self.placed) {
            (Some(secs), Commit::Known(at)) => {
                Some(at.saturating_add(u64::from(secs.get()) * 1000))
            }
            _ => None,
        }
    }

    /// The earliest server time it may fall due: its expiry, or the expiry's lower bound.
    pub fn earliest_due_ms(&self) -> Option<u64> {
        let secs = self.expires_in_secs?;
        let (Commit::Known(at) | Commit::AtLeast(at)) = self.placed;
        Some(at.saturating_add(u64::from(secs.get()) * 1000))
    }

    /// Whether it is past its expiry at server time `now_ms`. The expiry is never before
    /// the lower bound's, so below that it is not due either way.
    pub fn due(&self, now_ms: u64) -> Due {
        let Some(secs) = self.expires_in_secs else {
            return Due::No;
        };
        let after = u64::from(secs.get()) * 1000;
        match self.placed {
            Commit::Known(at) if now_ms >= at.saturating_add(after) => Due::Yes,
            Commit::AtLeast(at) if now_ms >= at.saturating_add(after) => Due::Unsure,
            _ => Due::No,
        }
    }
}

/// What an account's fold knows of one hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldStatus {
    Open(OpenHold),
    Resolved(Resolution),
    /// Never placed here, or resolved longer ago than [`MAX_RESOLUTIONS_KEPT`] resolutions.
    Unknown,
}

/// One hold event, as the book applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldChange {
    Placed {
        hold: HoldId,
        amount: i64,
        to: Option<AccountId>,
        expires_in_secs: Option<NonZeroU32>,
        version: u64,
        placed: Commit,
    },
    Resolved {
        hold: HoldId,
        how: Resolution,
        /// A post's amount (at most the held amount); 0 otherwise.
        posted: i64,
    },
}

/// Why the book cannot take a hold event: the stream holds something no correct writer
/// writes. The fold stops on it, as on any event it cannot apply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HoldFoldError {
    #[error("hold {0} is placed twice")]
    PlacedTwice(HoldId),
    #[error("hold {hold} resolves ({how}) but is not open")]
    NotOpen { hold: HoldId, how: &'static str },
    #[error("hold {hold} posts {posted} cents of {held} held")]
    PostsMoreThanHeld {
        hold: HoldId,
        posted: i64,
        held: i64,
    },
    #[error("the held sum overflows")]
    Overflow,
}

/// An account's holds: the open ones, their sum, and the newest resolutions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HoldBook {
    open: HashMap<HoldId, OpenHold>,
    held: i64,
    /// Oldest first, each with the hold as it was open; at most [`MAX_RESOLUTIONS_KEPT`].
    resolved: VecDeque<Resolved>,
    /// [`HoldBook::next_due_ms`], kept as the open holds change: a write asks it every time.
    next_due: Option<u64>,
}

/// A resolved hold the book still remembers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub hold: HoldId,
    pub how: Resolution,
    /// What a post took (0 for a void or an expiry).
    pub posted: i64,
    /// The hold as it was while open.
    pub was: OpenHold,
}

impl HoldBook {
    /// The sum of the open holds.
    pub fn held(&self) -> i64 {
        self.held
    }

    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty() && self.resolved.is_empty()
    }

    pub fn status(&self, hold: HoldId) -> HoldStatus {
        if let Some(h) = self.open.get(&hold) {
            return HoldStatus::Open(*h);
        }
        match self.resolved(hold) {
            Some(r) => HoldStatus::Resolved(r.how),
            None => HoldStatus::Unknown,
        }
    }

    /// A resolved hold, while the book remembers it.
    pub fn resolved(&self, hold: HoldId) -> Option<&Resolved> {
        self.resolved.iter().rev().find(|r| r.hold == hold)
    }

    /// The hold as it was placed, open or resolved (while remembered).
    pub fn placed(&self, hold: HoldId) -> Option<OpenHold> {
        self.open
            .get(&hold)
            .copied()
            .or_else(|| self.resolved(hold).map(|r| r.was))
    }

    /// The open holds, ordered by id (a stable order for lists and checkpoints).
    pub fn open(&self) -> Vec<(HoldId, OpenHold)> {
        let mut all: Vec<_> = self.open.iter().map(|(&id, &h)| (id, h)).collect();
        all.sort_unstable_by_key(|(id, _)| *id);
        all
    }

    /// The newest resolutions, oldest first.
    pub fn resolutions(&self) -> impl Iterator<Item = &Resolved> {
        self.resolved.iter()
    }

    /// The earliest server time an open hold may fall due: its lower bound when the commit
    /// time is not known exactly. `None` when no open hold expires.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.next_due
    }

    /// Recomputes [`HoldBook::next_due_ms`] from the open holds.
    fn scan_next_due(&self) -> Option<u64> {
        self.open
            .values()
            .filter_map(OpenHold::earliest_due_ms)
            .min()
    }

    /// Whether any open hold may be due at server time `now_ms`.
    pub fn any_due(&self, now_ms: u64) -> bool {
        self.next_due.is_some_and(|at| now_ms >= at)
    }

    /// The open holds due, or maybe due, at server time `now_ms`, at most `limit`, in
    /// placement order.
    pub fn due(&self, now_ms: u64, limit: usize) -> Vec<(HoldId, Due)> {
        let mut due: Vec<(u64, HoldId, Due)> = self
            .open
            .iter()
            .map(|(&id, h)| (h.placed_version, id, h.due(now_ms)))
            .filter(|(_, _, d)| *d != Due::No)
            .collect();
        due.sort_unstable_by_key(|(v, id, _)| (*v, *id));
        due.into_iter()
            .take(limit)
            .map(|(_, id, d)| (id, d))
            .collect()
    }

    /// Learns the exact commit time of the batch at `version`: the holds it placed, open or
    /// remembered as resolved.
    pub fn learn_commit(&mut self, version: u64, commit_ms: u64) {
        let resolved = self.resolved.iter_mut().map(|r| &mut r.was);
        for h in self.open.values_mut().chain(resolved) {
            if h.placed_version == version {
                h.placed = Commit::Known(commit_ms);
            }
        }
        self.next_due = self.scan_next_due();
    }

    /// The placing versions of the holds with an expiry whose commit time is only bounded
    /// (a replica's own placements), open or remembered as resolved; only `hold`'s when given.
    pub fn unknown_commits(&self, hold: Option<HoldId>) -> Vec<u64> {
        let resolved = self.resolved.iter().map(|r| (r.hold, r.was));
        let mut versions: Vec<u64> = self
            .open
            .iter()
            .map(|(&id, &h)| (id, h))
            .chain(resolved)
            .filter(|(id, _)| hold.is_none_or(|only| only == *id))
            .filter(|(_, h)| h.expires_in_secs.is_some() && matches!(h.placed, Commit::AtLeast(_)))
            .map(|(_, h)| h.placed_version)
            .collect();
        versions.sort_unstable();
        versions.dedup();
        versions
    }

    /// Applies one hold event. On an error the book is unchanged.
    pub fn apply(&mut self, change: HoldChange) -> Result<(), HoldFoldError> {
        match change {
            HoldChange::Placed {
                hold,
                amount,
                to,
                expires_in_secs,
                version,
                placed,
            } => {
                if self.open.contains_key(&hold) || self.resolved(hold).is_some() {
                    return Err(HoldFoldError::PlacedTwice(hold));
                }
                self.held = self
                    .held
                    .checked_add(amount)
                    .ok_or(HoldFoldError::Overflow)?;
                let open = OpenHold {
                    amount,
                    to,
                    expires_in_secs,
                    placed_version: version,
                    placed,
                };
                if let Some(at) = open.earliest_due_ms() {
                    self.next_due = Some(self.next_due.map_or(at, |n| n.min(at)));
                }
                self.open.insert(hold, open);
            }
            HoldChange::Resolved { hold, how, posted } => {
                let Some(open) = self.open.get(&hold) else {
                    return Err(HoldFoldError::NotOpen {
                        hold,
                        how: how.name(),
                    });
                };
                if posted > open.amount {
                    return Err(HoldFoldError::PostsMoreThanHeld {
                        hold,
                        posted,
                        held: open.amount,
                    });
                }
                let was = *open;
                self.held -= was.amount;
                self.open.remove(&hold);
                if was.earliest_due_ms().is_some() && was.earliest_due_ms() == self.next_due {
                    self.next_due = self.scan_next_due();
                }
                if self.resolved.len() == MAX_RESOLUTIONS_KEPT {
                    self.resolved.pop_front();
                }
                self.resolved.push_back(Resolved {
                    hold,
                    how,
                    posted,
                    was,
                });
            }
        }
        debug_assert!(self.held >= 0, "the held sum is never negative");
        Ok(())
    }

    /// Applies one batch's changes in order, all or none: they are checked on a copy of
    /// the holds they touch first, so a batch that fails half-way leaves the book as it was.
    pub fn apply_all(&mut self, changes: &[HoldChange]) -> Result<(), HoldFoldError> {
        if let [one] = changes {
            return self.apply(*one);
        }
        let mut trial = HoldBook::default();
        let mut held = self.held;
        for change in changes {
            let id = match *change {
                HoldChange::Placed { hold, .. } | HoldChange::Resolved { hold, .. } => hold,
            };
            if let HoldStatus::Open(h) = self.status(id)
                && !trial.open.contains_key(&id)
                && trial.resolved(id).is_none()
            {
                trial.open.insert(id, h);
                trial.held += h.amount;
            }
            if let HoldChange::Placed { hold, .. } = *change
                && self.status(hold) != HoldStatus::Unknown
            {
                return Err(HoldFoldError::PlacedTwice(hold));
            }
            let before = trial.held;
            trial.apply(*change)?;
            held = held
                .checked_add(trial.held - before)
                .ok_or(HoldFoldError::Overflow)?;
        }
        for change in changes {
            self.apply(*change)?;
        }
        debug_assert_eq!(self.held, held);
        Ok(())
    }

    /// A book of these open holds and resolutions (a checkpoint's): `None` when they
    /// contradict each other (a hold both open and resolved, or listed twice), or overflow.
    pub fn from_parts(open: Vec<(HoldId, OpenHold)>, resolved: Vec<Resolved>) -> Option<Self> {
        let mut book = HoldBook::default();
        for (id, h) in open {
            if h.amount <= 0 || book.open.insert(id, h).is_some() {
                return None;
            }
            book.held = book.held.checked_add(h.amount)?;
        }
        if resolved.len() > MAX_RESOLUTIONS_KEPT {
            return None;
        }
        for r in resolved {
            if book.open.contains_key(&r.hold) || book.resolved(r.hold).is_some() {
                return None;
            }
            book.resolved.push_back(r);
        }
        book.next_due = book.scan_next_due();
        Some(book)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> HoldId {
        HoldId(Uuid::from_u128(n))
    }

    fn place(n: u128, amount: i64, expires_in_secs: Option<u32>) -> HoldChange {
        HoldChange::Placed {
            hold: id(n),
            amount,
            to: None,
            expires_in_secs: expires_in_secs.and_then(NonZeroU32::new),
            version: n as u64,
            placed: Commit::Known(0),
        }
    }

    fn resolve(n: u128, how: Resolution, posted: i64) -> HoldChange {
        HoldChange::Resolved {
            hold: id(n),
            how,
            posted,
        }
    }

    /// Rule: a hold resolves once; a second resolution of any kind is an impossible state,
    /// and the book is unchanged by it.
    #[test]
    fn a_hold_resolves_exactly_once() {
        let mut book = HoldBook::default();
        book.apply(place(1, 50, None)).unwrap();
        book.apply(place(2, 20, None)).unwrap();
        assert_eq!(book.held(), 70);
        book.apply(resolve(1, Resolution::Posted, 30)).unwrap();
        assert_eq!(book.held(), 20);
        assert_eq!(book.status(id(1)), HoldStatus::Resolved(Resolution::Posted));
        for how in [Resolution::Posted, Resolution::Voided, Resolution::Expired] {
            let before = book.clone();
            assert!(matches!(
                book.apply(resolve(1, how, 0)),
                Err(HoldFoldError::NotOpen { .. })
            ));
            assert_eq!(book, before);
        }
        assert_eq!(
            book.apply(place(1, 5, None)),
            Err(HoldFoldError::PlacedTwice(id(1)))
        );
        assert_eq!(book.status(id(9)), HoldStatus::Unknown);
    }

    #[test]
    fn a_post_never_takes_more_than_was_held() {
        let mut book = HoldBook::default();
        book.apply(place(1, 50, None)).unwrap();
        assert!(matches!(
            book.apply(resolve(1, Resolution::Posted, 51)),
            Err(HoldFoldError::PostsMoreThanHeld { .. })
        ));
        assert_eq!(book.held(), 50);
    }

    /// Rule: a hold is due at or past its expiry in server time; one whose commit time is
    /// only bounded below is "unsure" until the batch is read, never due before the bound.
    #[test]
    fn holds_fall_due_at_their_expiry_in_server_time() {
        let mut book = HoldBook::default();
        book.apply(place(1, 5, Some(2))).unwrap();
        book.apply(place(2, 5, Some(1))).unwrap();
        book.apply(place(3, 5, None)).unwrap();
        assert_eq!(book.due(999, 10), vec![]);
        assert_eq!(book.due(1_000, 10), vec![(id(2), Due::Yes)]);
        assert_eq!(
            book.due(5_000, 10),
            vec![(id(1), Due::Yes), (id(2), Due::Yes)]
        );
        assert_eq!(book.due(5_000, 1), vec![(id(1), Due::Yes)]);
        let mut own = HoldBook::default();
        own.apply(HoldChange::Placed {
            hold: id(4),
            amount: 5,
            to: None,
            expires_in_secs: NonZeroU32::new(1),
            version: 4,
            placed: Commit::AtLeast(10_000),
        })
        .unwrap();
        assert!(!own.any_due(10_999));
        assert_eq!(own.due(11_000, 10), vec![(id(4), Due::Unsure)]);
        own.learn_commit(4, 10_500);
        assert_eq!(own.due(11_000, 10), vec![]);
        assert_eq!(own.due(11_500, 10), vec![(id(4), Due::Yes)]);
    }

    #[test]
    fn the_newest_resolutions_are_kept_and_the_oldest_forgotten() {
        let mut book = HoldBook::default();
        let n = MAX_RESOLUTIONS_KEPT as u128 + 1;
        for i in 0..n {
            book.apply(place(i, 1, None)).unwrap();
            book.apply(resolve(i, Resolution::Voided, 0)).unwrap();
        }
        assert_eq!(book.status(id(0)), HoldStatus::Unknown);
        assert_eq!(
            book.status(id(n - 1)),
            HoldStatus::Resolved(Resolution::Voided)
        );
        assert_eq!(book.resolutions().count(), MAX_RESOLUTIONS_KEPT);
        let again = HoldBook::from_parts(book.open(), book.resolutions().copied().collect());
        assert_eq!(again.as_ref(), Some(&book));
    }

    #[test]
    fn a_book_from_contradicting_parts_is_refused() {
        let h = OpenHold {
            amount: 5,
            to: None,
            expires_in_secs: None,
            placed_version: 1,
            placed: Commit::Known(0),
        };
        assert!(HoldBook::from_parts(vec![(id(1), h), (id(1), h)], vec![]).is_none());
        let voided = Resolved {
            hold: id(1),
            how: Resolution::Voided,
            posted: 0,
            was: h,
        };
        assert!(HoldBook::from_parts(vec![(id(1), h)], vec![voided]).is_none());
        let book = HoldBook::from_parts(vec![(id(1), h), (id(2), h)], vec![]).unwrap();
        assert_eq!(book.held(), 10);
    }

    proptest::proptest! {
        /// Rule: the kept earliest due time is always what a scan of the open holds gives,
        /// whatever the order of placements and resolutions.
        #[test]
        fn the_kept_earliest_due_time_matches_a_scan(ops in proptest::collection::vec((0u128..12, proptest::option::of(1u32..100), 0u64..10_000, proptest::bool::ANY), 1..80)) {
            let mut book = HoldBook::default();
            for (n, secs, ms, exact) in ops {
                let change = match book.status(id(n)) {
                    HoldStatus::Open(_) => resolve(n, Resolution::Voided, 0),
                    _ => HoldChange::Placed {
                        hold: id(n),
                        amount: 1,
                        to: None,
                        expires_in_secs: secs.and_then(NonZeroU32::new),
                        version: ms,
                        placed: if exact { Commit::Known(ms) } else { Commit::AtLeast(ms) },
                    },
                };
                let _ = book.apply(change);
                if !exact {
                    book.learn_commit(ms, ms + 5);
                }
                proptest::prop_assert_eq!(book.next_due_ms(), book.scan_next_due());
            }
        }
    }
}
