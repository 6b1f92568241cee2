//! Sliding window counter: `precision` sub-windows per period, the oldest one weighted by
//! the part of it still inside the window (precision 1 is the classic two-counter scheme).
//!
//! State: [`RuleState::Counters`] `{ index, counts }`, the newest sub-window number
//! `now / sub` (with `sub = period / precision`) and `precision + 1` counts, newest
//! first. A request at `elapsed` µs into sub-window `cur` sees
//! `old × (sub − elapsed) + sub × (recent + cost) ≤ limit × sub`, where `old` is the count
//! of sub-window `cur − precision` and `recent` the sum of the `precision` newer ones.

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// The count of sub-window `k`.
fn sub_count(state: &RuleState, k: u64) -> u64 {
    match state {
        RuleState::Counters { index, counts } if k <= *index => {
            counts.get((*index - k) as usize).copied().unwrap_or(0)
        }
        _ => 0,
    }
}

/// `(old, recent)` as seen from sub-window `w`: the count to be weighted and the sum of
/// the newer ones.
fn window_sums(state: &RuleState, precision: u64, w: u64) -> (u64, u64) {
    let p = precision;
    match state {
        RuleState::Counters { index, counts } if *index <= w => {
            let Some(keep) = p.checked_sub(w - index) else {
                return (0, 0);
            };
            let keep = keep as usize;
            (counts[keep], counts[..keep].iter().sum())
        }
        _ => {
            let old = if w >= p { sub_count(state, w - p) } else { 0 };
            let recent = (0..p.min(w + 1)).map(|i| sub_count(state, w - i)).sum();
            (old, recent)
        }
    }
}

/// Admits when the weighted count plus `cost` stays within the limit.
#[inline(always)]
pub(super) fn evaluate(
    rule: &Rule,
    precision: u64,
    state: &RuleState,
    now: u64,
    cost: u64,
) -> Eval {
    let limit = rule.limit();
    // The sub-window, period / precision.
    let sub = rule.span_div().get();
    let (cur, elapsed) = rule.span_div().div_rem(now);
    let (old, recent) = window_sums(state, precision, cur);
    // Saturating: stored counts may be anyone's (a value that fits the layout); the
    // counts this crate writes keep every product below 2^53.
    let weighted = old.saturating_mul(sub - elapsed);
    let allowed =
        weighted.saturating_add(sub.saturating_mul(recent.saturating_add(cost))) <= limit * sub;
    let remaining_before = rule
        .span_div()
        .div((limit * sub).saturating_sub(weighted))
        .saturating_sub(recent);
    Eval {
        allowed,
        remaining_before,
        retry_us: if allowed {
            0
        } else {
            retry_after(rule, precision, state, now, cost)
        },
        delay_us: 0,
        next: Next::Counters { cur },
    }
}

/// The first instant after `now` at which `cost` units fit: in each sub-window from the
/// current one on, the weighted count falls linearly, so the admitting instant within it
/// is solved for directly; at most `precision + 2` sub-windows are looked at.
fn retry_after(rule: &Rule, precision: u64, state: &RuleState, now: u64, cost: u64) -> u64 {
    let limit = rule.limit();
    // The sub-window, period / precision.
    let sub = rule.span_div().get();
    let cur = now / sub;
    for j in 0..=precision + 1 {
        let w = cur + j;
        let (old, recent) = window_sums(state, precision, w);
        let Some(room) = limit.checked_sub(recent.saturating_add(cost)) else {
            continue;
        };
        // With no weighted sub-window left, the window's start admits.
        let start = match (room * sub).checked_div(old) {
            None => 0,
            Some(0) => continue,
            Some(q) => sub.saturating_sub(q),
        };
        let t = w * sub + start;
        if t > now {
            return t - now;
        }
    }
    0
}

/// Counts `cost` units into sub-window `cur`, shifting out the sub-windows that left.
pub(super) fn commit(precision: u64, state: &mut RuleState, cur: u64, cost: u64) {
    let len = precision as usize + 1;
    match state {
        RuleState::Counters { index, counts } => {
            // A clock that went back counts into the newest sub-window.
            if *index < cur {
                let shift = (cur - *index).min(len as u64) as usize;
                counts.rotate_right(shift);
                counts[..shift].fill(0);
                *index = cur;
            }
            counts[0] += cost;
        }
        _ => {
            let mut counts = vec![0; len].into_boxed_slice();
            counts[0] = cost;
            *state = RuleState::Counters { index: cur, counts };
        }
    }
}

/// The end of the last window that still sees the newest non-zero count.
pub(super) fn expires_at(rule: &Rule, precision: u64, state: &RuleState) -> u64 {
    let RuleState::Counters { index, counts } = state else {
        return 0;
    };
    // The sub-window, period / precision.
    let sub = rule.span_div().get();
    match counts.iter().position(|c| *c > 0) {
        // Saturating: a stored index may be anyone's.
        Some(i) => index
            .saturating_sub(i as u64)
            .saturating_add(precision + 1)
            .saturating_mul(sub),
        None => 0,
    }
}

/// Gives back `cost` units into the sub-window `charged_at` falls in, while the state
/// still counts it. A check counts into the newest sub-window when the clock went back, so
/// the charge sits in that sub-window or a later one: giving back to an earlier one, which
/// weighs less from then on, never gives back more than was taken. Returns whether the
/// state changed.
pub(super) fn refund(
    rule: &Rule,
    precision: u64,
    state: &mut RuleState,
    cost: u64,
    charged_at: u64,
) -> bool {
    let k = rule.span_div().div(charged_at);
    match state {
        RuleState::Counters { index, counts } if k <= *index && *index - k <= precision => {
            let slot = &mut counts[(*index - k) as usize];
            let before = *slot;
            *slot = slot.saturating_sub(cost);
            *slot != before
        }
        _ => false,
    }
}

/// Charges `units` (already capped at the rule's debt cap) unconditionally into the
/// sub-window `now` falls in, as a check's commit counts them, while the counts the
/// window sees at `now` (the oldest one whole, unweighted) stay at most `limit + cap`:
/// the debt is what they hold above the limit, and it leaves with its sub-window.
/// Returns whether the state changed.
pub(super) fn debit(
    rule: &Rule,
    precision: u64,
    state: &mut RuleState,
    units: u64,
    cap: u64,
    now: u64,
) -> bool {
    let cur = rule.span_div().div(now);
    let (old, recent) = window_sums(state, precision, cur);
    let used = old.saturating_add(recent);
    let add = units.min((rule.limit() + cap).saturating_sub(used));
    if add == 0 {
        return false;
    }
    commit(precision, state, cur, add);
    true
}
