//! Sliding log: exact; the timestamps of the last admitted units, newest first.
//!
//! State: [`RuleState::Log`], one log shared by every sliding-log rule of a rule set (held
//! in the slot of the first one) and kept to the largest of their limits. A rule of limit
//! `L` admits `cost` units when the `(L − cost + 1)`-th newest entry has left its window.

use std::collections::VecDeque;

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// Admits when the entry that `cost` new ones would push past the limit is out of the
/// window.
#[inline]
pub(super) fn evaluate(rule: &Rule, log: Option<&VecDeque<u64>>, now: u64, cost: u64) -> Eval {
    let limit = rule.limit();
    let period = rule.period_us();
    let Some(log) = log else {
        return Eval {
            allowed: true,
            remaining_before: limit,
            retry_us: 0,
            delay_us: 0,
            next: Next::Log,
        };
    };
    let nth = log.get((limit - cost) as usize).copied();
    let allowed = nth.is_none_or(|ts| ts + period <= now);
    let in_window = log
        .partition_point(|ts| ts + period > now)
        .min(limit as usize);
    Eval {
        allowed,
        remaining_before: limit - in_window as u64,
        retry_us: nth.map_or(0, |ts| (ts + period).saturating_sub(now)),
        delay_us: 0,
        next: Next::Log,
    }
}

/// Logs `cost` entries at `now`, keeping the newest `keep`.
pub(super) fn commit(state: &mut RuleState, keep: u64, now: u64, cost: u64) {
    let keep = keep as usize;
    if !matches!(state, RuleState::Log(_)) {
        *state = RuleState::Log(Box::new(VecDeque::with_capacity(keep.min(64))));
    }
    if let RuleState::Log(log) = state {
        for _ in 0..cost {
            log.push_front(now);
        }
        log.truncate(keep);
    }
}

/// When the newest entry leaves this rule's window (the log as a whole expires with its
/// longest rule).
pub(super) fn expires_at(rule: &Rule, log: Option<&VecDeque<u64>>) -> u64 {
    log.and_then(|l| l.front())
        .map_or(0, |newest| newest + rule.period_us())
}
