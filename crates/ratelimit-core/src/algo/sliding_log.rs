//! Sliding log: exact; the timestamps of the last admitted units, newest first.
//!
//! State: [`RuleState::Log`], one log shared by every sliding-log rule of a rule set (held
//! in the slot of the first one) and kept to the largest of their limits. A rule of limit
//! `L` admits `cost` units when the `(L − cost + 1)`-th newest entry has left its window.
//!
//! Under a clock that steps back, the log's time is never before its newest entry (the
//! [module docs](super#a-clock-that-steps-back) of `algo`).

use std::collections::VecDeque;

use super::{Eval, Next, RuleState};
use crate::rule::Rule;

/// Admits when the entry that `cost` new ones would push past the limit is out of the
/// window.
#[inline(always)]
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
    // The reported durations count from `now`; the verdict from the log's time.
    let at = log_time(log, now);
    let nth = log.get((limit - cost) as usize).copied();
    let allowed = nth.is_none_or(|ts| ts + period <= at);
    let in_window = in_window(log, period, at).min(limit as usize);
    Eval {
        allowed,
        remaining_before: limit - in_window as u64,
        retry_us: nth.map_or(0, |ts| (ts + period).saturating_sub(now)),
        delay_us: 0,
        next: Next::Log,
    }
}

/// The number of entries still inside a window of `period` at `now`. Entries leave the
/// window from the oldest end, and few of them between two checks, so the boundary is
/// searched for from that end (galloping, then bisecting): O(log k) for k expired
/// entries, where a bisection of the whole log touches entries all over it.
fn in_window(log: &VecDeque<u64>, period: u64, now: u64) -> usize {
    let len = log.len();
    // `expired(e)`: the e-th oldest entry (0-based) has left the window; true for every e
    // below the count of expired entries, false from it on.
    let expired = |e: usize| log[len - 1 - e] + period <= now;
    let (mut lo, mut step) = (0, 1);
    let mut hi = len;
    while lo < len {
        let probe = (lo + step - 1).min(len - 1);
        if expired(probe) {
            lo = probe + 1;
            step *= 2;
        } else {
            hi = probe;
            break;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if expired(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    len - lo
}

/// The log's time at a check at `now`: never before its newest entry.
#[inline(always)]
fn log_time(log: &VecDeque<u64>, now: u64) -> u64 {
    log.front().map_or(now, |&newest| newest.max(now))
}

/// Logs `cost` entries at the log's time at `now`, keeping the newest `keep`.
pub(super) fn commit(state: &mut RuleState, keep: u64, now: u64, cost: u64) {
    let keep = keep as usize;
    if !matches!(state, RuleState::Log(_)) {
        *state = RuleState::Log(Box::new(VecDeque::with_capacity(keep.min(64))));
    }
    if let RuleState::Log(log) = state {
        let now = log_time(log, now);
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

/// Removes `cost` entries of a charge made at `charged_at` or later: the oldest of the
/// entries logged since then. The charge's own entries are among them (a check logs at
/// its own time, or later when the clock went back); where another check's entries are
/// taken in their place, they are older ones, which leave the window no later than the
/// charge's would have. Returns whether the log changed.
pub(super) fn refund(state: &mut RuleState, cost: u64, charged_at: u64) -> bool {
    let RuleState::Log(log) = state else {
        return false;
    };
    // Newest first: the entries at or after `charged_at` are a prefix.
    let since = log.partition_point(|&t| t >= charged_at);
    let take = since.min(usize::try_from(cost).unwrap_or(usize::MAX));
    log.drain(since - take..since);
    take > 0
}

/// Logs `units` entries unconditionally at the log's time at `now`, at most `keep` (the
/// log's length, the largest sliding-log limit): the log holds no more, so a full log
/// of entries logged now is the most debt it holds, and each entry leaves with its
/// window. Returns whether the log changed.
pub(super) fn debit(state: &mut RuleState, keep: u64, units: u64, now: u64) -> bool {
    let add = units.min(keep);
    if add == 0 {
        return false;
    }
    commit(state, keep, now, add);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The search from the oldest end counts what a bisection of the whole log counts.
        #[test]
        fn in_window_matches_a_plain_bisection(
            mut stamps in proptest::collection::vec(0u64..10_000, 0..300),
            period in 1u64..5_000,
            now in 0u64..15_000,
        ) {
            stamps.sort_unstable_by(|a, b| b.cmp(a));
            let log: VecDeque<u64> = stamps.into_iter().collect();
            let want = log.partition_point(|ts| ts + period > now);
            prop_assert_eq!(in_window(&log, period, now), want);
        }
    }
}
