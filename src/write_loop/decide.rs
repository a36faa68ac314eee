//! Deciding a run's open requests on one attempt's state: a pure function from the state
//! and the members to a plan, with the rule that makes a refusal final in one place.

use crate::account::holds::{HoldId, HoldStatus, Resolution};
use crate::account::rules::{Legs, decide_leg};
use crate::account::{AccountEvent, AccountsMode, RuleError, Standing};

/// What [`decide`] needs of one open request.
pub(super) struct Candidate {
    pub legs: Legs,
    /// Each leg's account, as an index into the run's accounts.
    pub accounts: [usize; 2],
    pub landing: Landing,
    /// What the attempt's state shows of the hold its first leg resolves (a post, void or
    /// expiry); `None` for any other request.
    pub hold: Option<HoldStatus>,
}

/// What is known of a candidate's own landing, which decides what a refusal of it means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Landing {
    /// No earlier attempt can land: a refusal on current state is final.
    Impossible,
    /// An earlier attempt may still land: a refusal is not the truth.
    Possible,
    /// Proven in the stream (a point read or the index found our event): no rule decides
    /// it now.
    Proven,
}

/// The decision for one open request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Write it; each leg's balance right after it.
    Write { balances: [i64; 2] },
    /// Already in the stream: not written again; a fold that reaches the landing answers it.
    AlreadyLanded,
    /// Refused only on top of earlier requests of this batch that have not landed: not final
    /// and not written; decided again on the state after them.
    Deferred,
    /// Refused on a state the account really had, and no earlier attempt can land: final.
    Refused(RuleError),
    /// Refused, but an earlier attempt of it may yet land: the refusal is not the truth.
    Unverifiable,
}

/// How a state stands to the store's tip, which decides whether a refusal on it is final.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Freshness {
    /// A catch-up that reached the store's tip: a refusal on it can be final.
    AtTip,
    /// A local fold, or a read that may lag: it may hide an earlier landing of the very
    /// request being refused.
    MaybeBehind,
}

/// A rule said no on a state not known to be current: decide again on current state.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct NeedsCurrentState;

/// How a run's members stand to one another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Members {
    /// Each lands on its own (a lane's batch): a refusal on top of earlier members that have
    /// not landed is no verdict on the account, only deferred.
    Independent,
    /// A linked group, landing together or not at all: a refusal on top of earlier members
    /// is the group's, and as final as any refusal on current state.
    Together,
}

/// Decides every candidate in order, each on top of the ones before it (`accounts` is each
/// account in the loaded state). A refusal is final only on a state at the store's tip
/// ([`Freshness::AtTip`]), and only on a state the account really had: one decided on top
/// of unlanded batch members is deferred, unless the members land together.
pub(super) fn decide(
    accounts: &[Standing],
    candidates: &[Candidate],
    freshness: Freshness,
    mode: AccountsMode,
    members: Members,
) -> Result<Vec<Verdict>, NeedsCurrentState> {
    let mut running = accounts.to_vec();
    // `running` includes requests that have not landed (or not visibly), and so do the
    // holds resolved by earlier candidates.
    let mut speculative = false;
    let mut resolved_here: Vec<(HoldId, Resolution)> = Vec::new();
    let mut verdicts = Vec::with_capacity(candidates.len());
    for c in candidates {
        let mut next = running.clone();
        let mut after = [0i64; 2];
        let mut broke: Option<RuleError> = None;
        let resolving = c.legs.as_slice()[0].event.resolves();
        let hold = match resolving.and_then(|id| resolved_here.iter().find(|(h, _)| *h == id)) {
            Some(&(_, how)) => Some(HoldStatus::Resolved(how)),
            None => c.hold,
        };
        for (li, leg) in c.legs.as_slice().iter().enumerate() {
            let ai = c.accounts[li];
            match decide_leg(next[ai], leg, mode, hold) {
                Ok(b) => {
                    next[ai] = b;
                    after[li] = b.balance;
                }
                Err(e) => {
                    broke = Some(e);
                    break;
                }
            }
        }
        let verdict = match broke {
            None => {
                running = next;
                speculative = true;
                if let Some(id) = resolving {
                    resolved_here.push((id, resolution_of(&c.legs.as_slice()[0].event)));
                }
                if c.landing == Landing::Proven {
                    Verdict::AlreadyLanded
                } else {
                    Verdict::Write { balances: after }
                }
            }
            Some(_) if c.landing == Landing::Proven => Verdict::AlreadyLanded,
            Some(_) if freshness == Freshness::MaybeBehind => return Err(NeedsCurrentState),
            Some(_) if speculative && members == Members::Independent => Verdict::Deferred,
            Some(_) if c.landing == Landing::Possible => Verdict::Unverifiable,
            Some(e) => Verdict::Refused(e),
        };
        verdicts.push(verdict);
    }
    Ok(verdicts)
}

/// How a resolving event resolves its hold.
fn resolution_of(event: &AccountEvent) -> Resolution {
    match event {
        AccountEvent::HoldPosted { .. } => Resolution::Posted,
        AccountEvent::HoldVoided { .. } => Resolution::Voided,
        _ => Resolution::Expired,
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;
    use crate::account::{AccountId, AmountCents, Operation};

    /// Decides on existing accounts with these balances, accounts implicit.
    fn decide(
        balances: &[i64],
        candidates: &[Candidate],
        freshness: Freshness,
    ) -> Result<Vec<Verdict>, NeedsCurrentState> {
        let accounts: Vec<Standing> = balances
            .iter()
            .map(|&balance| Standing {
                balance,
                exists: true,
                ..Standing::default()
            })
            .collect();
        super::decide(
            &accounts,
            candidates,
            freshness,
            AccountsMode::Implicit,
            Members::Independent,
        )
    }

    fn withdraw(cents: i64) -> Candidate {
        let op = Operation::Withdraw {
            account: AccountId(Uuid::from_u128(1)),
            amount: AmountCents::new(cents).expect("amount"),
        };
        Candidate {
            legs: op.legs(),
            accounts: [0, 0],
            landing: Landing::Impossible,
            hold: None,
        }
    }

    /// Simulation seed 4197: on replica 0 a batch [withdraw 55, withdraw 28] was decided on
    /// a balance of 57. The 28 was refused on top of the 55 ("balance 2"), but the 55's write
    /// conflicted and never landed in that run; the account went 57, 104, 171, ... and never
    /// had 2. Such a refusal is deferred, not answered, and not written; it is decided again
    /// once the requests before it are settled.
    #[test]
    fn a_refusal_on_top_of_unlanded_batch_members_is_deferred_not_answered() {
        let both = [withdraw(55), withdraw(28)];
        let verdicts = decide(&[57], &both, Freshness::AtTip).expect("current state decides");
        assert_eq!(verdicts[0], Verdict::Write { balances: [2, 0] });
        assert_eq!(
            verdicts[1],
            Verdict::Deferred,
            "not final on a speculative balance, and not written with the first"
        );

        // The first gave up without landing; a deposit landed meanwhile. The second is
        // decided on the balance the account has, and goes through.
        let verdicts = decide(&[104], &both[1..], Freshness::AtTip).expect("current state decides");
        assert_eq!(verdicts[0], Verdict::Write { balances: [76, 0] });
    }

    /// A refusal with nothing speculative before it is final at once.
    #[test]
    fn a_refusal_on_the_loaded_state_is_final() {
        let verdicts = decide(&[26], &[withdraw(55), withdraw(18)], Freshness::AtTip)
            .expect("current state decides");
        assert_eq!(
            verdicts[0],
            Verdict::Refused(RuleError::InsufficientFunds { balance: 26 })
        );
        assert_eq!(verdicts[1], Verdict::Write { balances: [8, 0] });
    }

    /// Rule: a refusal is final only on state known to be current; on any other state the
    /// caller must make sure of it first.
    #[test]
    fn a_refusal_on_state_not_known_current_asks_for_current_state() {
        assert_eq!(
            decide(&[26], &[withdraw(55)], Freshness::MaybeBehind),
            Err(NeedsCurrentState)
        );
        assert!(decide(&[26], &[withdraw(20)], Freshness::MaybeBehind).is_ok());
    }

    /// Rule: never a final 4xx for a request an earlier attempt of which may still land.
    #[test]
    fn a_refusal_of_a_request_that_may_have_landed_is_unverifiable_not_final() {
        let mut c = withdraw(55);
        c.landing = Landing::Possible;
        assert_eq!(
            decide(&[26], &[c], Freshness::AtTip),
            Ok(vec![Verdict::Unverifiable])
        );
    }

    /// Rule: a write to an account never opened is refused like any rule's refusal: final
    /// only on current state, and never for a request an earlier attempt of which may land.
    #[test]
    fn a_write_to_an_account_never_opened_is_refused_only_on_current_state() {
        let missing = [Standing::default()];
        let explicit = AccountsMode::Explicit;
        let not_found = RuleError::AccountNotFound {
            account: AccountId(Uuid::from_u128(1)),
        };
        let deposit = || {
            let op = Operation::Deposit {
                account: AccountId(Uuid::from_u128(1)),
                amount: AmountCents::new(5).expect("amount"),
            };
            Candidate {
                legs: op.legs(),
                accounts: [0, 0],
                landing: Landing::Impossible,
                hold: None,
            }
        };
        assert_eq!(
            super::decide(
                &missing,
                &[deposit()],
                Freshness::MaybeBehind,
                explicit,
                Members::Independent
            ),
            Err(NeedsCurrentState)
        );
        assert_eq!(
            super::decide(
                &missing,
                &[deposit()],
                Freshness::AtTip,
                explicit,
                Members::Independent
            ),
            Ok(vec![Verdict::Refused(not_found)])
        );
        let mut held = deposit();
        held.landing = Landing::Possible;
        assert_eq!(
            super::decide(
                &missing,
                &[held],
                Freshness::AtTip,
                explicit,
                Members::Independent
            ),
            Ok(vec![Verdict::Unverifiable])
        );
    }

    /// Rule: in a linked group a refusal on top of earlier members is the group's own and
    /// final on current state; in a lane's batch it is only deferred.
    #[test]
    fn a_linked_groups_refusal_on_top_of_its_earlier_members_is_final() {
        let accounts = vec![
            Standing {
                balance: 10,
                exists: true,
                ..Standing::default()
            };
            1
        ];
        let candidates = [withdraw(5), withdraw(6)];
        let mode = AccountsMode::Implicit;
        let apart = super::decide(
            &accounts,
            &candidates,
            Freshness::AtTip,
            mode,
            Members::Independent,
        );
        assert_eq!(apart.unwrap()[1], Verdict::Deferred);
        let together = super::decide(
            &accounts,
            &candidates,
            Freshness::AtTip,
            mode,
            Members::Together,
        );
        assert!(matches!(
            together.unwrap()[1],
            Verdict::Refused(RuleError::InsufficientFunds { .. })
        ));
    }

    /// Rule: two requests resolving one hold in one run: the second sees it resolved by the
    /// first, and since that has not landed, its refusal is deferred, never final.
    #[test]
    fn a_second_resolution_of_a_hold_in_one_run_is_deferred() {
        use crate::account::holds::{Commit, OpenHold};
        let account = AccountId(Uuid::from_u128(1));
        let hold = HoldId(Uuid::from_u128(7));
        let open = HoldStatus::Open(OpenHold {
            amount: 10,
            to: None,
            expires_in_secs: None,
            placed_version: 1,
            placed: Commit::Known(0),
        });
        let resolve = |op: Operation| Candidate {
            legs: op.legs(),
            accounts: [0, 0],
            landing: Landing::Impossible,
            hold: Some(open),
        };
        let post = resolve(Operation::PostHold {
            account,
            hold,
            amount: AmountCents::new(4).expect("amount"),
            to: None,
        });
        let void = resolve(Operation::VoidHold { account, hold });
        let accounts = [Standing {
            balance: 50,
            exists: true,
            held: 10,
            open_holds: 1,
        }];
        let verdicts = super::decide(
            &accounts,
            &[post, void],
            Freshness::AtTip,
            AccountsMode::Implicit,
            Members::Independent,
        )
        .expect("current state decides");
        assert_eq!(verdicts[0], Verdict::Write { balances: [46, 0] });
        assert_eq!(verdicts[1], Verdict::Deferred);
    }
}
