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
    /// When committed: the time from which the key's state is equivalent to a fresh one,
    /// the moment its store entry may be dropped (or its Redis key expire). 0 otherwise.
    pub expires_at_us: u64,
}

/// One rule's verdict, with the state it writes if the whole check commits. Values only
/// a denial needs (`retry_us`) are computed only on denial: 64-bit divisions dominate the
/// cost of a decision.
struct Eval {
    allowed: bool,
    remaining_before: u64,
    retry_us: u64,
    delay_us: u64,
    next: Next,
}

/// The state a rule writes on commit.
enum Next {
    Window { index: u64, count: u64 },
    Counters { cur: u64 },
    Log,
    Tokens { level: u64, last: u64 },
    Tat { us: u64, frac: u64 },
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
    if let ([rule], [state]) = (rules.rules(), &mut *states) {
        return decide_one(rule, state, rules.log_limit(), now, cost);
    }
    // Plain loops and pushes: iterator adaptors collecting into SmallVec cost more than
    // the arithmetic of a decision.
    let mut evals: SmallVec<[Eval; 4]> = SmallVec::new();
    let mut allowed = true;
    let mut delay = 0;
    {
        let log = shared_log(states);
        for (rule, state) in rules.rules().iter().zip(states.iter()) {
            let e = eval(rule, state, log, now, c);
            allowed &= e.allowed;
            delay = delay.max(e.delay_us);
            evals.push(e);
        }
    }
    let mut outcomes: SmallVec<[RuleOutcome; 2]> = SmallVec::new();
    if cost == 0 || !allowed {
        let log = shared_log(states);
        for ((rule, state), e) in rules.rules().iter().zip(states.iter()).zip(&evals) {
            outcomes.push(RuleOutcome {
                allowed: e.allowed,
                limit: rule.limit(),
                remaining: e.remaining_before,
                reset_after: us(expires_at(rule, state, log).saturating_sub(now)),
                retry_after: (!e.allowed).then(|| us(e.retry_us)),
            });
        }
        return Transition {
            decision: Decision::from_outcomes(outcomes, us(delay)),
            committed: false,
            expires_at_us: 0,
        };
    }
    let mut log_done = false;
    for ((rule, state), e) in rules.rules().iter().zip(states.iter_mut()).zip(&evals) {
        // The log lives in the first sliding-log rule's slot and is shared.
        if matches!(e.next, Next::Log) {
            if log_done {
                continue;
            }
            log_done = true;
        }
        apply(rule, state, &e.next, rules.log_limit(), now, cost);
    }
    let log = shared_log(states);
    let mut expires_at_us = 0;
    for ((rule, state), e) in rules.rules().iter().zip(states.iter()).zip(&evals) {
        let expires = expires_at(rule, state, log);
        expires_at_us = expires_at_us.max(expires);
        outcomes.push(RuleOutcome {
            allowed: true,
            limit: rule.limit(),
            remaining: e.remaining_before - cost,
            reset_after: us(expires.saturating_sub(now)),
            retry_after: None,
        });
    }
    Transition {
        decision: Decision::from_outcomes(outcomes, us(delay)),
        committed: true,
        expires_at_us,
    }
}

/// [`decide`] for the most common case, one rule: no per-rule buffers.
fn decide_one(
    rule: &Rule,
    state: &mut RuleState,
    log_limit: u64,
    now: u64,
    cost: u64,
) -> Transition {
    let e = eval(
        rule,
        state,
        shared_log(std::slice::from_ref(state)),
        now,
        cost.max(1),
    );
    let committed = cost > 0 && e.allowed;
    if committed {
        apply(rule, state, &e.next, log_limit, now, cost);
    }
    let expires = expires_at(rule, state, shared_log(std::slice::from_ref(state)));
    let outcome = RuleOutcome {
        allowed: e.allowed,
        limit: rule.limit(),
        remaining: if committed {
            e.remaining_before - cost
        } else {
            e.remaining_before
        },
        reset_after: us(expires.saturating_sub(now)),
        retry_after: (!e.allowed).then(|| us(e.retry_us)),
    };
    let mut outcomes = SmallVec::new();
    outcomes.push(outcome);
    Transition {
        decision: Decision::from_outcomes(outcomes, us(e.delay_us)),
        committed,
        expires_at_us: if committed { expires } else { 0 },
    }
}

fn shared_log(states: &[RuleState]) -> Option<&VecDeque<u64>> {
    states.iter().find_map(|s| match s {
        RuleState::Log(log) => Some(&**log),
        _ => None,
    })
}

/// The count of sub-window `k` of a sliding window counter.
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

/// Token bucket level (tokens × period_us) at `now`.
fn token_level(rule: &Rule, capacity: u64, state: &RuleState, now: u64) -> u64 {
    let full = capacity * rule.period_us();
    match *state {
        RuleState::Tokens { level, last } => {
            let refill = now.saturating_sub(last).saturating_mul(rule.limit());
            full.min(level.saturating_add(refill))
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
            Eval {
                allowed: count + c <= limit,
                remaining_before: limit.saturating_sub(count),
                retry_us: (index + 1) * period - now,
                delay_us: 0,
                next: Next::Window {
                    index,
                    count: count + c,
                },
            }
        }
        Algorithm::SlidingWindow { precision: p } => {
            let sub = period / p;
            let cur = now / sub;
            let elapsed = now - cur * sub;
            // (oldest count, to be weighted; sum of the newer ones) as seen in sub-window `w`.
            let window_sums = |w: u64| -> (u64, u64) {
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
            };
            let (old, recent) = window_sums(cur);
            let weighted = old * (sub - elapsed);
            let allowed = weighted + sub * (recent + c) <= limit * sub;
            let remaining_before =
                ((limit * sub).saturating_sub(weighted) / sub).saturating_sub(recent);
            let mut retry_us = 0;
            if !allowed {
                for j in 0..=p + 1 {
                    let w = cur + j;
                    let (old_j, recent_j) = window_sums(w);
                    let Some(room) = limit.checked_sub(recent_j + c) else {
                        continue;
                    };
                    // With no weighted sub-window left, the window's start admits.
                    let start = match (room * sub).checked_div(old_j) {
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
                retry_us,
                delay_us: 0,
                next: Next::Counters { cur },
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
                retry_us: nth.map_or(0, |ts| (ts + period).saturating_sub(now)),
                delay_us: 0,
                next: Next::Log,
            }
        }
        Algorithm::TokenBucket { capacity } => {
            let level = token_level(rule, capacity, state, now);
            let need = c * period;
            let allowed = level >= need;
            let last = match *state {
                RuleState::Tokens { last, .. } => last.max(now),
                _ => now,
            };
            Eval {
                allowed,
                remaining_before: level / period,
                retry_us: if allowed {
                    0
                } else {
                    div_ceil(need - level, limit)
                },
                delay_us: 0,
                next: Next::Tokens {
                    level: level.saturating_sub(need),
                    last,
                },
            }
        }
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
            let (cap, no_delay) = tat_params(rule);
            let base = tat_base(state, now);
            let total = base.1 + c * period;
            let next = (base.0 + total / limit, total % limit);
            let diff_base = (base.0 - now) * limit + base.1;
            let diff_next = (next.0 - now) * limit + next.1;
            let max = cap * period;
            let allowed = diff_next <= max;
            let delay_us = match no_delay {
                Some(n) if allowed && diff_next > n * period => {
                    div_ceil(diff_next - n * period, limit)
                }
                _ => 0,
            };
            Eval {
                allowed,
                remaining_before: max.saturating_sub(diff_base) / period,
                retry_us: if allowed {
                    0
                } else {
                    div_ceil(diff_next - max, limit)
                },
                delay_us,
                next: Next::Tat {
                    us: next.0,
                    frac: next.1,
                },
            }
        }
    }
}

/// Writes the state a rule decided on, once the whole check commits.
fn apply(rule: &Rule, state: &mut RuleState, next: &Next, log_limit: u64, now: u64, cost: u64) {
    match *next {
        Next::Log => apply_log(state, log_limit as usize, now, cost),
        Next::Counters { cur } => apply_counters(rule, state, cur, cost),
        Next::Window { index, count } => *state = RuleState::Window { index, count },
        Next::Tokens { level, last } => *state = RuleState::Tokens { level, last },
        Next::Tat { us, frac } => *state = RuleState::Tat { us, frac },
    }
}

fn apply_counters(rule: &Rule, state: &mut RuleState, cur: u64, cost: u64) {
    let Algorithm::SlidingWindow { precision: p } = rule.algorithm() else {
        unreachable!("counters belong to the sliding window counter")
    };
    let len = p as usize + 1;
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

/// The moment from which the rule's state is equivalent to `Fresh`.
fn expires_at(rule: &Rule, state: &RuleState, log: Option<&VecDeque<u64>>) -> u64 {
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
        // Per rule: the log as a whole expires with its longest rule.
        (Algorithm::SlidingLog, _) => log
            .and_then(|l| l.front())
            .map_or(0, |newest| newest + period),
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
