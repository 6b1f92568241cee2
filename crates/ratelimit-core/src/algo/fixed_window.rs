//! Fixed window: one counter per window of `period`, windows aligned to the Unix epoch.
//!
//! State: [`RuleState::Window`] `{ index, count }`, the window number `now / period` and
//! the units admitted in it. A count from an earlier window reads as 0.

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// Admits `cost` units when the current window's count plus `cost` stays within the
/// limit; a denied request waits for the next window.
#[inline(always)]
pub(super) fn evaluate(rule: &Rule, state: &RuleState, now: u64, cost: u64) -> Eval {
    let limit = rule.limit();
    let period = rule.period_us();
    let index = rule.span_div().div(now);
    let count = match *state {
        RuleState::Window { index: i, count } if i == index => count,
        _ => 0,
    };
    Eval {
        allowed: count + cost <= limit,
        remaining_before: limit.saturating_sub(count),
        retry_us: (index + 1) * period - now,
        delay_us: 0,
        next: Next::Window {
            index,
            count: count + cost,
        },
    }
}

/// Writes the window's new count.
#[inline(always)]
pub(super) fn commit(state: &mut RuleState, index: u64, count: u64) {
    // Overwriting the fields of a state of the same kind skips dropping the old one.
    if let RuleState::Window { index: i, count: c } = state {
        (*i, *c) = (index, count);
    } else {
        *state = RuleState::Window { index, count };
    }
}

/// The end of the counted window.
#[inline]
pub(super) fn expires_at(rule: &Rule, state: &RuleState) -> u64 {
    match *state {
        // Saturating: a stored index may be anyone's.
        RuleState::Window { index, .. } => index.saturating_add(1).saturating_mul(rule.period_us()),
        _ => 0,
    }
}

/// Gives back `cost` units charged at `charged_at`, only while the counted window is the
/// one `charged_at` falls in: a unit charged in a window that has ended is not given to
/// the next one. Returns whether the state changed.
pub(super) fn refund(rule: &Rule, state: &mut RuleState, cost: u64, charged_at: u64) -> bool {
    match state {
        RuleState::Window { index, count } if *index == rule.span_div().div(charged_at) => {
            let before = *count;
            *count = count.saturating_sub(cost);
            *count != before
        }
        _ => false,
    }
}

/// Charges `units` (already capped at the rule's debt cap) unconditionally into the
/// window `now` falls in, the count held at most `limit + cap`: the debt is what the
/// count holds above the limit, and it ends with the window. Returns whether the state
/// changed.
pub(super) fn debit(rule: &Rule, state: &mut RuleState, units: u64, cap: u64, now: u64) -> bool {
    let index = rule.span_div().div(now);
    let count = match *state {
        RuleState::Window { index: i, count } if i == index => count,
        _ => 0,
    };
    let add = units.min((rule.limit() + cap).saturating_sub(count));
    if add == 0 {
        return false;
    }
    commit(state, index, count + add);
    true
}
