//! Token bucket: `limit` tokens per `period` refill a bucket of `capacity`, lazily.
//!
//! State: [`RuleState::Tokens`] `{ level, last }`, the tokens scaled by the period in
//! microseconds (so a refill of `elapsed × limit` is exact) as of time `last`. A bucket
//! below empty (in debt after a settle) is the level 0 as of a `last` in the future: the
//! refill resumes then. A clock that went back reads the same way: no refill until
//! `last`.

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// The level (tokens × period_us) at `now`.
#[inline]
fn level_at(rule: &Rule, capacity: u64, state: &RuleState, now: u64) -> u64 {
    let full = capacity * rule.period_us();
    match *state {
        RuleState::Tokens { level, last } => {
            let refill = now.saturating_sub(last).saturating_mul(rule.limit());
            full.min(level.saturating_add(refill))
        }
        _ => full,
    }
}

/// Admits when the bucket holds `cost` tokens.
#[inline(always)]
pub(super) fn evaluate(rule: &Rule, capacity: u64, state: &RuleState, now: u64, cost: u64) -> Eval {
    let period = rule.period_us();
    let level = level_at(rule, capacity, state, now);
    let need = cost * period;
    let allowed = level >= need;
    // A clock that went back refills from the later time.
    let last = match *state {
        RuleState::Tokens { last, .. } => last.max(now),
        _ => now,
    };
    Eval {
        allowed,
        remaining_before: rule.span_div().div(level),
        // In debt, the refill starts at `last`.
        retry_us: if allowed {
            0
        } else {
            (last - now) + (need - level).div_ceil(rule.limit())
        },
        delay_us: 0,
        next: Next::Tokens {
            level: level.saturating_sub(need),
            last,
        },
    }
}

/// Writes the level left after the request.
#[inline(always)]
pub(super) fn commit(state: &mut RuleState, level: u64, last: u64) {
    if let RuleState::Tokens { level: l, last: t } = state {
        (*l, *t) = (level, last);
    } else {
        *state = RuleState::Tokens { level, last };
    }
}

/// When the bucket is full again.
pub(super) fn expires_at(rule: &Rule, capacity: u64, state: &RuleState) -> u64 {
    let RuleState::Tokens { level, last } = *state else {
        return 0;
    };
    let full = capacity * rule.period_us();
    last + rule.limit_div().div_ceil(full - level.min(full))
}

/// The state of a bucket of the same period whose rule changed from `old` to `rule`, at
/// `now`, and whether it was converted: `Fresh` when the old rule has refilled the
/// bucket by now; else what was used, the old capacity less the level at `now` (under
/// the old rule's refill), taken from the new capacity (at least 0 left) as of `now`.
/// Under the same limit and capacity that is the bucket as it is.
pub(super) fn carry(
    old: &Rule,
    old_capacity: u64,
    rule: &Rule,
    state: &RuleState,
    now: u64,
) -> (RuleState, bool) {
    carry_from(old.limit(), old_capacity, old.period_us(), rule, state, now)
}

/// [`carry`] from a state written under a rule of limit `old_limit`, capacity
/// `old_capacity` and period `old_period_us`: all of the old rule a carry needs, as a
/// store that keeps the writer's limit and capacity beside the state has it. The stored
/// values may be anyone's: the arithmetic saturates rather than overflows.
pub(super) fn carry_from(
    old_limit: u64,
    old_capacity: u64,
    old_period_us: u64,
    rule: &Rule,
    state: &RuleState,
    now: u64,
) -> (RuleState, bool) {
    let RuleState::Tokens { level, last } = *state else {
        return (RuleState::Fresh, false);
    };
    // Unchanged, the state is used as it is, refilled or not: a store that reads a
    // state carried earlier carries it again, and must find what a store that kept the
    // carried state holds.
    if old_limit == rule.limit() && old_capacity == rule.capacity() {
        return (RuleState::Tokens { level, last }, false);
    }
    let old_full = old_capacity.saturating_mul(old_period_us);
    let refill = now.saturating_sub(last).saturating_mul(old_limit);
    let held = old_full.min(level.saturating_add(refill));
    if held >= old_full {
        return (RuleState::Fresh, false);
    }
    let used = old_full - held;
    (
        RuleState::Tokens {
            level: (rule.capacity() * rule.period_us()).saturating_sub(used),
            // A clock that went back refills from the later time, as `evaluate` does.
            last: last.max(now),
        },
        true,
    )
}

/// Puts `give` (tokens × period) back, up to the bucket's capacity. A bucket whose
/// refill resumes after `now` (in debt) first has that wait shortened, by whole
/// microseconds of refill (a fraction of one is not given: never more than `give`), and
/// only what is left of `give` once the refill runs from `now` goes into the level:
/// units given back repay a debt before they can be spent. Returns whether the state
/// changed.
pub(super) fn refund(
    rule: &Rule,
    capacity: u64,
    state: &mut RuleState,
    give: u64,
    now: u64,
) -> bool {
    let RuleState::Tokens { level, last } = state else {
        return false;
    };
    let mut give = give;
    let mut changed = false;
    if *last > now && give > 0 {
        // Saturating: a stored `last` may be anyone's.
        let wait = (*last - now).saturating_mul(rule.limit());
        if give < wait {
            let back = rule.limit_div().div(give);
            *last -= back;
            return back > 0;
        }
        give -= wait;
        *last = now;
        changed = true;
    }
    let full = capacity * rule.period_us();
    let before = *level;
    *level = level.saturating_add(give).min(full);
    changed || *level != before
}

/// Puts `give` (tokens × period) back into the level, up to the bucket's capacity,
/// whatever `last`: a lease's unspent units, given back at the lease's end (a time that
/// may lie before the bucket's `last`). Returns whether the state changed.
pub(super) fn refund_level(rule: &Rule, capacity: u64, state: &mut RuleState, give: u64) -> bool {
    let RuleState::Tokens { level, .. } = state else {
        return false;
    };
    let full = capacity * rule.period_us();
    let before = *level;
    *level = level.saturating_add(give).min(full);
    *level != before
}

/// Takes `units` (already capped at the rule's debt cap) unconditionally: from the level
/// at `now` while it holds them, the rest as debt below empty (the level 0, the refill
/// resuming once it has repaid it, rounded up to a whole microsecond), while what is
/// used, debt included, stays at most `capacity + cap` tokens. Returns whether the state
/// changed.
pub(super) fn debit(
    rule: &Rule,
    capacity: u64,
    state: &mut RuleState,
    units: u64,
    cap: u64,
    now: u64,
) -> bool {
    let period = rule.period_us();
    let full = capacity * period;
    let level = level_at(rule, capacity, state, now);
    // When the refill runs from: `last` when it lies ahead (a debt, or a clock that went
    // back), as `evaluate` reads it.
    let base = match *state {
        RuleState::Tokens { last, .. } => last.max(now),
        _ => now,
    };
    // Saturating: a stored `last` may be anyone's.
    let used = (full - level).saturating_add((base - now).saturating_mul(rule.limit()));
    // Both below 2^52: capacity and cap each times the period are at most 2^51.
    let most = (capacity + cap) * period;
    let take = (units * period).min(most.saturating_sub(used));
    if take == 0 {
        return false;
    }
    if level >= take {
        commit(state, level - take, base);
    } else {
        let wait = rule.limit_div().div_ceil(take - level);
        commit(state, 0, base.saturating_add(wait));
    }
    true
}
