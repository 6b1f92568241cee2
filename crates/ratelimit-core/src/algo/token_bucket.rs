//! Token bucket: `limit` tokens per `period` refill a bucket of `capacity`, lazily.
//!
//! State: [`RuleState::Tokens`] `{ level, last }`, the tokens scaled by the period in
//! microseconds (so a refill of `elapsed × limit` is exact) as of time `last`.

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
        retry_us: if allowed {
            0
        } else {
            (need - level).div_ceil(rule.limit())
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
/// `now`: `Fresh` when the old rule has refilled the bucket by now; else the tokens as of
/// the last check, at most the new capacity, refilled from then on at the new rate. It
/// does not depend on `now` until the old bucket is full, so a check that writes nothing
/// (a denial, a peek) leaves nothing to write: the next one carries the same state.
pub(super) fn carry(
    old: &Rule,
    old_capacity: u64,
    rule: &Rule,
    state: &RuleState,
    now: u64,
) -> RuleState {
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
) -> RuleState {
    let RuleState::Tokens { level, last } = *state else {
        return RuleState::Fresh;
    };
    let full = old_capacity.saturating_mul(old_period_us);
    let refill = now.saturating_sub(last).saturating_mul(old_limit);
    if level.saturating_add(refill) >= full {
        return RuleState::Fresh;
    }
    RuleState::Tokens {
        level: level.min(rule.capacity() * rule.period_us()),
        last,
    }
}
