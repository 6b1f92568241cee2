//! GCRA: one theoretical arrival time (TAT) per key; the leaky bucket runs on the same
//! arithmetic.
//!
//! State: [`RuleState::Tat`] `{ us, frac }`, the TAT as `us + frac / limit` µs, so an
//! emission interval of `period / limit` µs that is not a whole microsecond stays exact.
//! A request of `cost` units moves the TAT to `max(tat, now) + cost × period / limit`
//! and is admitted when the new TAT is at most `burst × period / limit` ahead of `now`.

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// Admits up to `burst` units at once from idle.
#[inline(always)]
pub(super) fn evaluate(rule: &Rule, burst: u64, state: &RuleState, now: u64, cost: u64) -> Eval {
    arrival(rule, burst, state, now, cost).0
}

/// The GCRA step for a bucket of `capacity` emission intervals: the verdict and, beside
/// it, how far the new TAT lies ahead of `now` in 1/limit µs (the leaky shaper's delay
/// is measured from it).
#[inline(always)]
pub(super) fn arrival(
    rule: &Rule,
    capacity: u64,
    state: &RuleState,
    now: u64,
    cost: u64,
) -> (Eval, u64) {
    let limit = rule.limit();
    let period = rule.period_us();
    // max(tat, now)
    let (base_us, base_frac) = match *state {
        RuleState::Tat { us, frac } if us > now || (us == now && frac > 0) => (us, frac),
        _ => (now, 0),
    };
    let total = base_frac + cost * period;
    let (whole, next_frac) = rule.limit_div().div_rem(total);
    let next_us = base_us + whole;
    // Saturating: a stored TAT may be anyone's (a value at the store's key that fits the
    // layout), and no TAT this crate writes is far enough ahead to come near.
    let ahead_before = (base_us - now)
        .saturating_mul(limit)
        .saturating_add(base_frac);
    let ahead = (next_us - now)
        .saturating_mul(limit)
        .saturating_add(next_frac);
    let max = capacity * period;
    let allowed = ahead <= max;
    let eval = Eval {
        allowed,
        remaining_before: rule.span_div().div(max.saturating_sub(ahead_before)),
        retry_us: if allowed {
            0
        } else {
            (ahead - max).div_ceil(limit)
        },
        delay_us: 0,
        next: Next::Tat {
            us: next_us,
            frac: next_frac,
        },
    };
    (eval, ahead)
}

/// Writes the new TAT.
#[inline(always)]
pub(super) fn commit(state: &mut RuleState, us: u64, frac: u64) {
    if let RuleState::Tat { us: u, frac: f } = state {
        (*u, *f) = (us, frac);
    } else {
        *state = RuleState::Tat { us, frac };
    }
}

/// The TAT, rounded up to a whole microsecond: from then on the key is idle.
#[inline]
pub(super) fn expires_at(state: &RuleState) -> u64 {
    match *state {
        RuleState::Tat { us, frac } => us + u64::from(frac > 0),
        _ => 0,
    }
}

/// The state of a rule of the same algorithm and period changed from `old` to `rule`, at
/// `now` (GCRA, or either leaky bucket mode), and whether it was converted: `Fresh` once
/// the TAT has passed; else what is owed, `(tat − now) × old limit` in 1/old-limit µs,
/// which is the units used × the period whatever the limit (a unit moves the TAT by
/// period / limit µs), as a TAT under the new limit: `now + owed / limit` µs, the
/// remainder its fraction in 1/limit µs (exact, no rounding). Under the same limit that
/// is the TAT as it is. A TAT further ahead than the new capacity is kept: the new rule
/// denies until it is within it, as a window whose count is above a lowered limit does.
pub(super) fn carry(old: &Rule, rule: &Rule, state: &RuleState, now: u64) -> (RuleState, bool) {
    carry_from(old.limit(), rule, state, now)
}

/// [`carry`] from a state written under a rule of limit `old_limit`: all of the old rule
/// a carry needs, as a store that keeps the writer's limit beside the state has it. The
/// stored values may be anyone's: the arithmetic saturates rather than overflows.
pub(super) fn carry_from(
    old_limit: u64,
    rule: &Rule,
    state: &RuleState,
    now: u64,
) -> (RuleState, bool) {
    let RuleState::Tat { us, frac } = *state else {
        return (RuleState::Fresh, false);
    };
    // Unchanged, the state is used as it is, past or not (see token_bucket::carry_from).
    if old_limit == rule.limit() {
        return (RuleState::Tat { us, frac }, false);
    }
    if !(us > now || (us == now && frac > 0)) {
        return (RuleState::Fresh, false);
    }
    let owed = (us - now).saturating_mul(old_limit).saturating_add(frac);
    let (whole, frac) = rule.limit_div().div_rem(owed);
    (
        RuleState::Tat {
            us: now.saturating_add(whole),
            frac,
        },
        true,
    )
}

/// Moves the TAT back by `give` (in 1/limit µs), never before `now` (a TAT in the past is
/// an idle key already). Returns whether the state changed.
pub(super) fn refund(rule: &Rule, state: &mut RuleState, give: u64, now: u64) -> bool {
    let RuleState::Tat { us, frac } = *state else {
        return false;
    };
    if !(us > now || (us == now && frac > 0)) {
        return false;
    }
    // How far ahead of now the TAT is, in 1/limit µs: units used × period. Saturating:
    // a stored state is read from a store others can write, and no state this crate
    // writes comes near.
    let ahead = (us - now).saturating_mul(rule.limit()).saturating_add(frac);
    if give == 0 {
        return false;
    }
    let left = ahead.saturating_sub(give);
    let (whole, frac) = rule.limit_div().div_rem(left);
    *state = RuleState::Tat {
        us: now.saturating_add(whole),
        frac,
    };
    true
}

/// Moves the TAT on by `units` (already capped at the rule's debt cap) emission
/// intervals, unconditionally, from `max(tat, now)`, while it stays at most `capacity +
/// cap` intervals ahead of `now`: the debt is how far it lies past the capacity. Returns
/// whether the state changed.
pub(super) fn debit(
    rule: &Rule,
    capacity: u64,
    state: &mut RuleState,
    units: u64,
    cap: u64,
    now: u64,
) -> bool {
    let limit = rule.limit();
    let period = rule.period_us();
    let (base_us, base_frac) = match *state {
        RuleState::Tat { us, frac } if us > now || (us == now && frac > 0) => (us, frac),
        _ => (now, 0),
    };
    // Saturating: a stored TAT may be anyone's.
    let ahead = (base_us - now)
        .saturating_mul(limit)
        .saturating_add(base_frac);
    // Both below 2^52: capacity and cap each times the period are at most 2^51.
    let most = (capacity + cap) * period;
    let add = (units * period).min(most.saturating_sub(ahead));
    if add == 0 {
        return false;
    }
    let (whole, frac) = rule.limit_div().div_rem(base_frac + add);
    commit(state, base_us.saturating_add(whole), frac);
    true
}
