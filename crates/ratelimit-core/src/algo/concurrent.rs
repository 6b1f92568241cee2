//! `N concurrent`: slots with deadlines, at most `limit` held per key at once.
//!
//! State: [`RuleState::Slots`], the held slots (deadline, identity) and the identity the
//! next slot is numbered from. A slot whose deadline has passed is free, whether or not
//! it is still listed: every transition counts only live slots, and drops the others
//! when it writes.
//!
//! Identities: a slot acquired at `now` is numbered `max(next, now)`, and `next` becomes
//! that plus one. Numbers only grow while the state lives, and a state that has become
//! fresh (every slot past its deadline, `next` not ahead of the clock) numbers its next
//! slot from the clock, above every number it gave before: a release of a slot that is
//! gone, resent or late, never frees another. The numbering is a function of the state
//! and the time alone, so every store and path gives the same numbers for one trace.

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// The largest `retry_after` of a refusal for want of a slot: the earliest deadline is
/// when a slot frees at the latest, but most are released long before theirs, so it is
/// only a hint.
pub const RETRY_HINT_CAP_US: u64 = 1_000_000;

/// Admits while fewer than `limit` slots are live at `now`; a request takes one slot
/// whatever its cost. A refusal's retry is the earliest live deadline, capped at
/// [`RETRY_HINT_CAP_US`].
#[inline]
pub(super) fn evaluate(rule: &Rule, state: &RuleState, now: u64) -> Eval {
    let limit = rule.limit();
    let (live, earliest) = match state {
        RuleState::Slots(table) => table.live(now),
        _ => (0, u64::MAX),
    };
    let allowed = live < limit;
    Eval {
        allowed,
        remaining_before: limit.saturating_sub(live),
        retry_us: if allowed {
            0
        } else {
            earliest.saturating_sub(now).min(RETRY_HINT_CAP_US)
        },
        delay_us: 0,
        next: Next::Slot,
    }
}

/// Takes a slot until `now + timeout`, dropping the slots past their deadline; returns
/// the new slot's identity.
pub(super) fn commit(rule: &Rule, state: &mut RuleState, now: u64) -> u64 {
    if !matches!(state, RuleState::Slots(_)) {
        *state = RuleState::Slots(Box::default());
    }
    let RuleState::Slots(table) = state else {
        unreachable!("set above")
    };
    table.held.retain(|&(deadline, _)| deadline > now);
    let id = table.next.max(now);
    table.next = id.saturating_add(1);
    table.held.push((now.saturating_add(rule.period_us()), id));
    id
}

/// When the state is as good as fresh: every slot past its deadline, and the numbering
/// not ahead of the clock.
pub(super) fn expires_at(state: &RuleState) -> u64 {
    match state {
        RuleState::Slots(table) => table
            .held
            .iter()
            .map(|&(deadline, _)| deadline)
            .max()
            .unwrap_or(0)
            .max(table.next),
        _ => 0,
    }
}

/// Frees slot `id` if it is live; returns whether it was. Nothing else changes: a slot
/// past its deadline is free already, and the others are dropped when a check writes.
/// Freeing a slot that is gone does nothing, so a release sent twice frees one slot.
pub(super) fn release(state: &mut RuleState, id: u64, now: u64) -> bool {
    let RuleState::Slots(table) = state else {
        return false;
    };
    match table
        .held
        .iter()
        .position(|&(deadline, held)| held == id && deadline > now)
    {
        Some(at) => {
            table.held.remove(at);
            true
        }
        None => false,
    }
}

/// Moves the deadline of live slot `id` to `now + timeout_us`; returns whether it was
/// live. A slot past its deadline is not renewed: it was free, and may have been taken
/// by another request since, so renewing it could hold one slot more than the limit.
pub(super) fn renew(state: &mut RuleState, id: u64, timeout_us: u64, now: u64) -> bool {
    let RuleState::Slots(table) = state else {
        return false;
    };
    match table
        .held
        .iter_mut()
        .find(|(deadline, held)| *held == id && *deadline > now)
    {
        Some((deadline, _)) => {
            *deadline = (*deadline).max(now.saturating_add(timeout_us));
            true
        }
        None => false,
    }
}
