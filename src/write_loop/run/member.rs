//! One request inside a run: where it stands ([`Phase`]), the client sequences it holds
//! ([`SeqHold`]), and what the run knows of its earlier attempts ([`EarlierAttempts`]).

use crate::account::rules::Legs;
use crate::projection::index::write_tag;
use crate::write_loop::{Answer, WriteRequest};

/// Where one request of a run stands.
#[derive(Debug)]
pub(super) enum Phase {
    /// Not answered and not proven landed: decided again on each attempt's state.
    Open,
    /// Proven in the stream, not answered yet: our event stands on these legs, at these
    /// versions (a point read, or an index hit on a fold that had not reached it). Never
    /// written again; answered once a fold reaches the landing.
    Proven { at: [Option<u64>; 2] },
    /// Answered.
    Done(Answer),
}

/// The client sequences (Celeriant's idempotency key) a request holds, one per leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SeqHold {
    /// None: the next write derives fresh ones from the fold.
    Free,
    /// Held from the write that carries them until a write with them is rejected (2003),
    /// proven a sibling's, or lands.
    Held { seqs: [u64; 2], floor: [u64; 2] },
    /// Held, and a write that carried them had an unknown outcome: they may stand in the
    /// stream, so a rejection never releases them (only a 2002's point read, or a landing,
    /// settles them, whatever the index holds: it keeps a landing for its window only, and
    /// a run can outlast it).
    Unanswered { seqs: [u64; 2], floor: [u64; 2] },
}

// `floor`, in both held states: each leg's lowest version at which its sequence can stand,
// one above the fold it was derived on (that fold saw every sequence of ours below it). A
// 2002's point read starts there, not at version 1.

impl SeqHold {
    pub fn seqs(self) -> Option<[u64; 2]> {
        match self {
            SeqHold::Free => None,
            SeqHold::Held { seqs, .. } | SeqHold::Unanswered { seqs, .. } => Some(seqs),
        }
    }

    /// Leg `li`'s floor; 1 (the whole stream) when nothing is held.
    pub fn floor(self, li: usize) -> u64 {
        match self {
            SeqHold::Free => 1,
            SeqHold::Held { floor, .. } | SeqHold::Unanswered { floor, .. } => floor[li],
        }
    }
}

/// What the run knows of a request's earlier attempts: whether one may stand in the stream.
/// It only grows, over the whole run: releasing a sequence does not undo an earlier write
/// that may have landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum EarlierAttempts {
    /// None can have landed: a refusal on later state can be final.
    CannotHaveLanded,
    /// One may have landed (a 2013, a failed ownership read, a proven landing), but no
    /// write of this run that carried the request had an unknown outcome: a landing found
    /// in the index is another request's result, a replay.
    MayHaveLanded,
    /// Writes of this run that carried the request had an unknown outcome, under these
    /// write tags (per leg, one per such write): a landing in the index under one of them
    /// may be this run's own; under any other tag it is another request's, a replay, even so.
    SentUnknown { tags: Vec<[u32; 2]> },
}

impl EarlierAttempts {
    /// A refusal on later state is not final.
    pub fn may_have_landed(&self) -> bool {
        !matches!(self, EarlierAttempts::CannotHaveLanded)
    }

    pub fn note_may_have_landed(&mut self) {
        if !self.may_have_landed() {
            *self = EarlierAttempts::MayHaveLanded;
        }
    }

    /// A write that carried the request, under `tags` when it carried sequences, had an
    /// unknown outcome.
    pub fn note_sent_unknown(&mut self, tags: Option<[u32; 2]>) {
        match self {
            EarlierAttempts::SentUnknown { tags: known } => {
                if let Some(tags) = tags
                    && !known.contains(&tags)
                {
                    known.push(tags);
                }
            }
            _ => {
                *self = EarlierAttempts::SentUnknown {
                    tags: tags.into_iter().collect(),
                };
            }
        }
    }
}

/// One request inside a run.
pub(super) struct Member {
    pub req: WriteRequest,
    pub legs: Legs,
    /// Each leg's account, as an index into the run's accounts.
    pub accounts: [usize; 2],
    pub phase: Phase,
    pub hold: SeqHold,
    /// Each leg's balance after this request, as decided on this attempt's state.
    pub balances: [i64; 2],
    pub earlier: EarlierAttempts,
}

impl Member {
    pub fn new(req: WriteRequest, accounts: [usize; 2]) -> Self {
        Member {
            req,
            legs: req.op.legs(),
            accounts,
            phase: Phase::Open,
            hold: SeqHold::Free,
            balances: [0; 2],
            earlier: EarlierAttempts::CannotHaveLanded,
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done(_))
    }

    pub fn proven_at(&self) -> [Option<u64>; 2] {
        match self.phase {
            Phase::Proven { at } => at,
            _ => [None; 2],
        }
    }

    /// Records that the stream holds this request's event on leg `li` at `version`.
    pub fn mark_proven(&mut self, li: usize, version: u64) {
        let mut at = self.proven_at();
        at[li] = Some(version);
        self.phase = Phase::Proven { at };
    }

    /// A write that carried this request, sent at `now_ms`, had an unknown outcome: the
    /// sequences it carried may stand in the stream, so they stay held until settled, and a
    /// landing found later under their write tags may be this run's own. The one place a
    /// sequence becomes [`SeqHold::Unanswered`], so an unanswered sequence always comes with
    /// [`EarlierAttempts::SentUnknown`].
    pub fn sent_unknown(&mut self, now_ms: u64) {
        let tags = self
            .hold
            .seqs()
            .map(|[s0, s1]| [write_tag(s0, now_ms), write_tag(s1, now_ms)]);
        self.earlier.note_sent_unknown(tags);
        if let SeqHold::Held { seqs, floor } = self.hold {
            self.hold = SeqHold::Unanswered { seqs, floor };
        }
    }

    /// Leg `li`'s sequence for a write (0, no sequence, when none is held).
    pub fn seq(&self, li: usize) -> u64 {
        self.hold.seqs().map_or(0, |s| s[li])
    }
}
