//! Leaky bucket, leaking `limit` per `period`, as a meter or as a shaper (nginx
//! `limit_req`). Both run on the GCRA's theoretical arrival time (see [`super::gcra`]):
//! a bucket's level is how far that time lies ahead of now.
//!
//! * Meter: a bucket of `capacity`; a request that does not fit is rejected.
//! * Shaper: the request being served plus a queue of `burst`; the first `delay` queued
//!   requests pass at once, later ones wait until the bucket has leaked down to them.

use super::{gcra, Eval, RuleState};
use crate::rule::{LeakyMode, Rule};

/// The meter's verdict, or the shaper's with the delay an admitted request waits.
#[inline(always)]
pub(super) fn evaluate(
    rule: &Rule,
    mode: LeakyMode,
    state: &RuleState,
    now: u64,
    cost: u64,
) -> Eval {
    match mode {
        LeakyMode::Meter { capacity } => gcra::arrival(rule, capacity, state, now, cost).0,
        LeakyMode::Shaper { burst, delay } => {
            let (mut eval, ahead) = gcra::arrival(rule, burst + 1, state, now, cost);
            if eval.allowed {
                eval.delay_us = shaper_delay(rule, delay, ahead);
            }
            eval
        }
    }
}

/// The wait for a request whose admission puts the bucket `ahead` (in 1/limit µs) above
/// empty: none within the request being served and the `delay` queued ones that pass at
/// once, the excess drained at the leak rate otherwise.
fn shaper_delay(rule: &Rule, delay: u64, ahead: u64) -> u64 {
    let free = (delay + 1) * rule.period_us();
    if ahead > free {
        rule.limit_div().div_ceil(ahead - free)
    } else {
        0
    }
}
