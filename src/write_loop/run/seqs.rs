//! Step 4 of an attempt, the sequences: which client sequence each event of a write carries,
//! and when a held one is released.

use super::Run;
use super::member::SeqHold;
use crate::projection::{MAX_OWN_CLIENT_SEQ, ProjectionError};
use crate::write_loop::error::{WriteError, invariant};

impl Run<'_> {
    /// Sequences for this write. A member that holds sequences keeps them; every other member
    /// of the batch (one that joins after a deferral, or any after a release) gets fresh ones
    /// above both the fold's highest and every sequence the run still holds, so no event is
    /// ever sent without a sequence or with one another member of the run holds. Each
    /// account's events in write order get consecutive sequences.
    pub(super) fn assign_seqs(&mut self, batch: &[usize]) -> Result<(), WriteError> {
        let mut next: Vec<u64> = self
            .accounts
            .iter()
            .map(|t| t.snap.max_client_seq + 1)
            .collect();
        for m in &self.members {
            if let Some(seqs) = m.hold.seqs() {
                let legs = m.legs.as_slice().len();
                for (&ai, &seq) in m.accounts.iter().zip(&seqs).take(legs) {
                    next[ai] = next[ai].max(seq + 1);
                }
            }
        }
        for &mi in batch {
            let m = &mut self.members[mi];
            if m.hold != SeqHold::Free {
                continue;
            }
            let (mut seqs, mut floor) = ([0; 2], [1; 2]);
            for li in 0..m.legs.as_slice().len() {
                let ai = m.accounts[li];
                seqs[li] = next[ai];
                next[ai] += 1;
                floor[li] = self.accounts[ai].snap.version + 1;
            }
            m.hold = SeqHold::Held { seqs, floor };
        }
        // Sequence 0 is no sequence: on Celeriant it skips the idempotency mark, and the
        // write could land twice.
        let all_carry_one = batch.iter().all(|&mi| {
            let m = &self.members[mi];
            m.hold
                .seqs()
                .is_some_and(|s| s[..m.legs.as_slice().len()].iter().all(|&s| s > 0))
        });
        if all_carry_one {
            Ok(())
        } else {
            Err(invariant("every event of a write carries a sequence"))
        }
    }

    /// Refuses an account whose highest sequence of ours is past [`MAX_OWN_CLIENT_SEQ`]
    /// (something else wrote under our client id; the fold poisons such a stream, but a
    /// Postgres row or our own write above a sequence at the bound can still carry one): the
    /// sequences [`Run::assign_seqs`] derives, a few thousand above it at most, then never
    /// overflow.
    pub(super) fn check_seq_room(&self) -> Result<(), WriteError> {
        match self
            .accounts
            .iter()
            .find(|t| t.snap.max_client_seq > MAX_OWN_CLIENT_SEQ)
        {
            None => Ok(()),
            Some(t) => Err(WriteError::Account(ProjectionError::Poisoned {
                account: t.account,
                version: t.snap.version,
                reason: format!(
                    "client sequence {} of ours is past {MAX_OWN_CLIENT_SEQ}: no next one can be derived",
                    t.snap.max_client_seq
                ),
            })),
        }
    }

    /// Releases every sequence the run holds: a write with them was rejected, proven a
    /// sibling's, or landed. The next write derives fresh ones.
    pub(super) fn release_seqs(&mut self) {
        for m in &mut self.members {
            m.hold = SeqHold::Free;
        }
    }

    /// Releases the sequences of a write that was rejected, except those an earlier write
    /// carried with an unknown outcome ([`SeqHold::Unanswered`]): that write may have
    /// landed, and only its own sequence proves it (2002, then the point read).
    pub(super) fn release_seqs_of_answered(&mut self) {
        for m in &mut self.members {
            if let SeqHold::Held { .. } = m.hold {
                m.hold = SeqHold::Free;
            }
        }
    }
}
