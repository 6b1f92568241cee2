//! The algorithms as pure state transitions: `(state, now, rules, cost) -> (decision, state)`.
//!
//! All arithmetic is on unsigned integers whose every intermediate value stays below 2^53
//! for rules that pass [`Rule`] validation, so the Redis store's Lua translation (which
//! computes with doubles) reaches exactly the same numbers. Times are microseconds since
//! the Unix epoch.

use std::collections::VecDeque;
use std::time::Duration;

use smallvec::SmallVec;

use crate::decision::{Decision, RuleOutcome};
use crate::rule::{Algorithm, LeakyMode, Rule, RuleSet};

/// The stored state of one rule for one key.
///
/// `Fresh` is the state of a key never seen (or whose state expired): every algorithm
/// treats it as "nothing consumed".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RuleState {
    /// Nothing recorded.
    #[default]
    Fresh,
    /// Fixed window: units counted in window number `index` (`now / period`).
    Window {
        /// Window number.
        index: u64,
        /// Units admitted in it.
        count: u64,
    },
    /// Sliding window counter: `counts[i]` is the count of sub-window `index - i`.
    Counters {
        /// Newest sub-window number (`now / (period / precision)`).
        index: u64,
        /// `precision + 1` counts, newest first.
        counts: Box<[u64]>,
    },
    /// Sliding log shared by all sliding-log rules of the set, newest timestamp first,
    /// held in the slot of the first sliding-log rule.
    Log(Box<VecDeque<u64>>),
    /// Token bucket: `level` is tokens × period_us, as of `last`.
    Tokens {
        /// Tokens, scaled by the period in microseconds.
        level: u64,
        /// When `level` was computed.
        last: u64,
    },
    /// GCRA and leaky bucket: theoretical arrival time `us + frac / limit` microseconds.
    Tat {
        /// Whole microseconds.
        us: u64,
        /// Fraction of a microsecond, in units of 1/limit.
        frac: u64,
    },
}

/// The result of [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The answer.
    pub decision: Decision,
    /// Whether the states were changed (an admitted check with cost > 0).
    pub committed: bool,
    /// The time from which the key's state is equivalent to a fresh one: the moment its
    /// store entry may be dropped (or its Redis key expire).
    pub expires_at_us: u64,
}

struct Eval {
    allowed: bool,
    remaining_before: u64,
    reset_before_us: u64,
    retry_us: u64,
    delay_us: u64,
}

#[inline]
fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

fn us(d: u64) -> Duration {
    Duration::from_micros(d)
}

/// Decides a check of `cost` units at `now` against `rules`, whose states are `states`
/// (one per rule, in order). When every rule admits and `cost > 0`, the states are
/// updated in place; otherwise they are left exactly as they were. `cost == 0` peeks: the
/// verdict is the one a request of cost 1 would get, and `remaining` counts what is left.
///
/// The caller must have checked `cost` with [`RuleSet::check_cost`].
pub fn decide(rules: &RuleSet, states: &mut [RuleState], now: u64, cost: u64) -> Transition {
    debug_assert_eq!(states.len(), rules.len());
    let c = cost.max(1);
    let log_slot = states.iter().position(|s| matches!(s, RuleState::Log(_)));
    let evals: SmallVec<[Eval; 4]> = {
        let log = log_slot.and_then(|i| match &states[i] {
            RuleState::Log(log) => Some(&**log),
            _ => None,
        });
        rules
            .rules()
            .iter()
            .zip(states.iter())
            .map(|(rule, state)| eval(rule, state, log, now, c))
            .collect()
    };
    let allowed = evals.iter().all(|e| e.allowed);
    let commit = allowed && cost > 0;
    if commit {
        let mut log_done = false;
        for (i, rule) in rules.rules().iter().enumerate() {
            if rule.algorithm() == Algorithm::SlidingLog {
                // The log lives in the first sliding-log rule's slot and is shared.
                if !log_done {
                    log_done = true;
                    apply_log(&mut states[i], rules.log_limit() as usize, now, cost);
                }
            } else {
                apply(rule, &mut states[i], now, cost);
            }
        }
    }
    let log = states.iter().find_map(|s| match s {
        RuleState::Log(log) => Some(&**log),
        _ => None,
    });
    let delay = evals.iter().map(|e| e.delay_us).max().unwrap_or(0);
    let outcomes = rules
        .rules()
        .iter()
        .zip(states.iter())
        .zip(evals.iter())
        .map(|((rule, state), e)| {
            if commit {
                RuleOutcome {
                    allowed: true,
                    limit: rule.limit(),
                    remaining: e.remaining_before.saturating_sub(cost),
                    reset_after: us(reset_us(rule, state, log, now)),
                    retry_after: None,
                }
            } else {
                RuleOutcome {
                    allowed: e.allowed,
                    limit: rule.limit(),
                    remaining: e.remaining_before,
                    reset_after: us(e.reset_before_us),
                    retry_after: (!e.allowed).then(|| us(e.retry_us)),
                }
            }
        });
    let decision = Decision::from_rules(outcomes, us(delay));
    let expires_at_us = rules
        .rules()
        .iter()
        .zip(states.iter())
        .map(|(rule, state)| expires_at(rule, state, log, rules.log_period_us()))
        .max()
        .unwrap_or(0);
    Transition {
        decision,
        committed: commit,
        expires_at_us,
    }
}

/// The counts of a sliding window counter as seen at sub-window `cur`: `count(k)` for
/// sub-window `k`.
fn sub_count(state: &RuleState, k: u64) -> u64 {
    match state {
        RuleState::Counters { index, counts } if k <= *index => {
            counts.get((*index - k) as usize).copied().unwrap_or(0)
        }
        _ => 0,
    }
}

/// Capacity (in units of the emission interval) and no-delay allowance of the
/// TAT-based algorithms.
fn tat_params(rule: &Rule) -> (u64, Option<u64>) {
    match rule.algorithm() {
        Algorithm::Gcra { burst } => (burst, None),
        Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => (capacity, None),
        Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => (burst + 1, Some(delay + 1)),
        _ => unreachable!("not a TAT algorithm"),
    }
}

/// `max(tat, now)` as (whole µs, fraction in 1/limit µs).
fn tat_base(state: &RuleState, now: u64) -> (u64, u64) {
    match *state {
        RuleState::Tat { us, frac } if us > now || (us == now && frac > 0) => (us, frac),
        _ => (now, 0),
    }
}

fn tat_add(base: (u64, u64), cost: u64, rule: &Rule) -> (u64, u64) {
    let total = base.1 + cost * rule.period_us();
    (base.0 + total / rule.limit(), total % rule.limit())
}

/// Token bucket level (tokens × period_us) at `now`.
fn token_level(rule: &Rule, capacity: u64, state: &RuleState, now: u64) -> u64 {
    let full = capacity * rule.period_us();
    match *state {
        RuleState::Tokens { level, last } => {
            let elapsed = now.saturating_sub(last);
            let need = full - level.min(full);
            if elapsed >= div_ceil(need, rule.limit()) {
                full
            } else {
                level + elapsed * rule.limit()
            }
        }
        _ => full,
    }
}

fn eval(rule: &Rule, state: &RuleState, log: Option<&VecDeque<u64>>, now: u64, c: u64) -> Eval {
    let limit = rule.limit();
    let period = rule.period_us();
    match rule.algorithm() {
        Algorithm::FixedWindow => {
            let index = now / period;
            let count = match *state {
                RuleState::Window { index: i, count } if i == index => count,
                _ => 0,
            };
            let reset = (index + 1) * period - now;
            Eval {
                allowed: count + c <= limit,
                remaining_before: limit.saturating_sub(count),
                reset_before_us: if count > 0 { reset } else { 0 },
                retry_us: reset,
                delay_us: 0,
            }
        }
        Algorithm::SlidingWindow { precision: p } => {
            let sub = period / p;
            let cur = now / sub;
            let elapsed = now - cur * sub;
            let window_sums = |w: u64| -> (u64, u64) {
                let old = if w >= p { sub_count(state, w - p) } else { 0 };
                let recent = (0..p)
                    .filter(|i| *i <= w)
                    .map(|i| sub_count(state, w - i))
                    .sum::<u64>();
                (old, recent)
            };
            let (old, recent) = window_sums(cur);
            let weighted = old * (sub - elapsed);
            let allowed = weighted + sub * (recent + c) <= limit * sub;
            let remaining_before = (limit * sub)
                .saturating_sub(weighted)
                .checked_div(sub)
                .unwrap_or(0)
                .saturating_sub(recent);
            let mut retry_us = 0;
            if !allowed {
                for j in 0..=p + 1 {
                    let w = cur + j;
                    let (old_j, recent_j) = window_sums(w);
                    let Some(room) = limit.checked_sub(recent_j + c) else {
                        continue;
                    };
                    let x = room * sub;
                    // With no weighted sub-window left, the window's start admits.
                    let start = match x.checked_div(old_j) {
                        None => 0,
                        Some(0) => continue,
                        Some(q) => sub.saturating_sub(q),
                    };
                    let t = w * sub + start;
                    if t > now {
                        retry_us = t - now;
                        break;
                    }
                }
            }
            Eval {
                allowed,
                remaining_before,
                reset_before_us: reset_us(rule, state, log, now),
                retry_us,
                delay_us: 0,
            }
        }
        Algorithm::SlidingLog => {
            let empty = VecDeque::new();
            let log = log.unwrap_or(&empty);
            let nth = log.get((limit - c) as usize).copied();
            let allowed = nth.is_none_or(|ts| ts + period <= now);
            let in_window = log
                .partition_point(|ts| ts + period > now)
                .min(limit as usize);
            Eval {
                allowed,
                remaining_before: limit - in_window as u64,
                reset_before_us: reset_us(rule, state, Some(log), now),
                retry_us: nth.map_or(0, |ts| (ts + period).saturating_sub(now)),
                delay_us: 0,
            }
        }
        Algorithm::TokenBucket { capacity } => {
            let level = token_level(rule, capacity, state, now);
            let need = c * period;
            let full = capacity * period;
            Eval {
                allowed: level >= need,
                remaining_before: level / period,
                reset_before_us: div_ceil(full - level, limit),
                retry_us: div_ceil(need.saturating_sub(level), limit),
                delay_us: 0,
            }
        }
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
            let (cap, no_delay) = tat_params(rule);
            let base = tat_base(state, now);
            let next = tat_add(base, c, rule);
            let diff_base = (base.0 - now) * limit + base.1;
            let diff_next = (next.0 - now) * limit + next.1;
            let max = cap * period;
            let allowed = diff_next <= max;
            let delay_us = match no_delay {
                Some(n) if allowed => div_ceil(diff_next.saturating_sub(n * period), limit),
                _ => 0,
            };
            Eval {
                allowed,
                remaining_before: max.saturating_sub(diff_base) / period,
                reset_before_us: div_ceil(diff_base, limit),
                retry_us: div_ceil(diff_next.saturating_sub(max), limit),
                delay_us,
            }
        }
    }
}

fn apply(rule: &Rule, state: &mut RuleState, now: u64, cost: u64) {
    let period = rule.period_us();
    match rule.algorithm() {
        Algorithm::FixedWindow => {
            let index = now / period;
            *state = match *state {
                RuleState::Window { index: i, count } if i == index => RuleState::Window {
                    index,
                    count: count + cost,
                },
                _ => RuleState::Window { index, count: cost },
            };
        }
        Algorithm::SlidingWindow { precision: p } => {
            let sub = period / p;
            let cur = now / sub;
            let len = p as usize + 1;
            match state {
                RuleState::Counters { index, counts } if *index <= cur => {
                    let shift = (cur - *index).min(len as u64) as usize;
                    counts.rotate_right(shift);
                    counts[..shift].fill(0);
                    *index = cur;
                    counts[0] += cost;
                }
                RuleState::Counters { index, counts } => {
                    // The clock went back: count the units in the newest sub-window.
                    counts[0] += cost;
                    let _ = index;
                }
                _ => {
                    let mut counts = vec![0; len].into_boxed_slice();
                    counts[0] = cost;
                    *state = RuleState::Counters { index: cur, counts };
                }
            }
        }
        Algorithm::SlidingLog => unreachable!("the shared log is applied once per check"),
        Algorithm::TokenBucket { capacity } => {
            let level = token_level(rule, capacity, state, now);
            let last = match *state {
                RuleState::Tokens { last, .. } => last.max(now),
                _ => now,
            };
            *state = RuleState::Tokens {
                level: level - cost * period,
                last,
            };
        }
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
            let (us, frac) = tat_add(tat_base(state, now), cost, rule);
            *state = RuleState::Tat { us, frac };
        }
    }
}

fn apply_log(state: &mut RuleState, keep: usize, now: u64, cost: u64) {
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

/// Time until the rule's full quota is back, in microseconds.
fn reset_us(rule: &Rule, state: &RuleState, log: Option<&VecDeque<u64>>, now: u64) -> u64 {
    expires_at(rule, state, log, rule.period_us()).saturating_sub(now)
}

/// The moment from which the rule's state is equivalent to `Fresh`.
fn expires_at(rule: &Rule, state: &RuleState, log: Option<&VecDeque<u64>>, log_period: u64) -> u64 {
    let period = rule.period_us();
    match (rule.algorithm(), state) {
        (Algorithm::FixedWindow, RuleState::Window { index, .. }) => (index + 1) * period,
        (Algorithm::SlidingWindow { precision: p }, RuleState::Counters { index, counts }) => {
            let sub = period / p;
            match counts.iter().position(|c| *c > 0) {
                Some(i) => (index - i as u64 + p + 1) * sub,
                None => 0,
            }
        }
        (Algorithm::SlidingLog, _) => log
            .and_then(|l| l.front())
            .map_or(0, |newest| newest + log_period),
        (Algorithm::TokenBucket { capacity }, RuleState::Tokens { level, last }) => {
            let full = capacity * period;
            last + div_ceil(full - (*level).min(full), rule.limit())
        }
        (Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_), RuleState::Tat { us, frac }) => {
            us + u64::from(*frac > 0)
        }
        _ => 0,
    }
}
