//! The rules a throttle waits under: the caller's, bounded the way a partner counts.
//!
//! A partner that allows `limit` calls per period refuses any call beyond `limit` in a
//! window of that period. Most algorithms admit more than that in some window: a fixed
//! window up to twice the limit across a boundary, a sliding window counter a little
//! more than the limit, a token bucket, a leaky meter or GCRA (burst = limit, the
//! default) a full bucket and then the refill, nearly twice the limit in the first
//! period. So a throttle adds, per such rule, an exact sliding log of what the rule may
//! send at once and no more in a period: its limit, or its burst (capacity) when the
//! caller asked for one above the limit. Checked in the same atomic step as the rules
//! it bounds, it costs no extra store call.

use ratelimit_core::{Algorithm, LeakyMode, Rule, RuleSet, MAX_LOG_LIMIT};

/// `rules` with a bound per period for each rule that can exceed it; `rules` as they are
/// when none can (a sliding log is exact; a shaper paces at its rate, and its `delay`
/// is a burst asked for).
pub(super) fn as_partners_count(rules: RuleSet) -> RuleSet {
    let rules = without_slots(rules);
    let mut bounds: Vec<Rule> = Vec::new();
    for rule in rules.rules() {
        if matches!(
            rule.algorithm(),
            Algorithm::SlidingLog
                | Algorithm::LeakyBucket(LeakyMode::Shaper { .. })
                | Algorithm::Concurrent
        ) {
            continue;
        }
        let most = rule.limit().max(rule.capacity());
        let bounded = rules.rules().iter().chain(&bounds).any(|r| {
            r.algorithm() == Algorithm::SlidingLog
                && r.period_us() == rule.period_us()
                && r.limit() <= most
        });
        if bounded {
            continue;
        }
        // A log keeps one timestamp per unit: above its cap, evenly spaced calls (GCRA
        // without a burst) bound every window as well, at a rate where a burst is lost
        // in the crowd.
        let bound = if most <= MAX_LOG_LIMIT {
            Rule::sliding_log(most, rule.period())
        } else {
            Rule::gcra(most, rule.period(), 1)
        };
        bounds.extend(bound.ok());
    }
    if bounds.is_empty() {
        return rules;
    }
    match RuleSet::new(rules.rules().iter().cloned().chain(bounds)) {
        Ok(bounded) => bounded,
        Err(error) => {
            tracing::warn!(
                %error,
                rules = %rules,
                "throttle: the rules leave no room for the bounds per period (at most \
                 {} rules in all); calls may exceed a limit within one period",
                ratelimit_core::MAX_RULES
            );
            rules
        }
    }
}

/// `rules` without a `N concurrent` rule, with a `WARN`: a throttle waits for a turn and
/// holds nothing while the call runs, so a slot it took would never be released (only
/// its deadline would free it). Kept, with the same `WARN`, when it is the only rule.
fn without_slots(rules: RuleSet) -> RuleSet {
    let Some(at) = rules.concurrent() else {
        return rules;
    };
    let rest = rules
        .rules()
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != at)
        .map(|(_, r)| r.clone());
    let kept = RuleSet::new(rest).ok();
    tracing::warn!(
        rules = %rules,
        "throttle: a `concurrent` rule limits calls in flight, which a throttle does not \
         track (it holds no slot while a call runs); {}",
        if kept.is_some() {
            "the rule is left out"
        } else {
            "each call holds a slot until its timeout"
        }
    );
    kept.unwrap_or(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounded(text: &str) -> String {
        as_partners_count(text.parse().unwrap()).to_string()
    }

    #[test]
    fn a_concurrency_rule_is_left_out_of_a_throttle() {
        assert_eq!(
            bounded("10/s sliding-log; 4 concurrent"),
            "10/1s sliding-log"
        );
        // Alone, kept: each call then holds a slot until its timeout.
        assert_eq!(bounded("4 concurrent"), "4 concurrent timeout=1m");
    }

    #[test]
    fn each_rule_that_can_exceed_its_limit_gets_a_bound() {
        assert_eq!(bounded("10/s"), "10/1s gcra burst=10; 10/1s sliding-log");
        assert_eq!(
            bounded("10/s burst=15"),
            "10/1s gcra burst=15; 15/1s sliding-log",
            "a burst asked for is the most in a period"
        );
        assert_eq!(bounded("10/s sliding-log"), "10/1s sliding-log");
        assert_eq!(
            bounded("10/s leaky-bucket mode=shaper burst=30"),
            "10/1s leaky-bucket mode=shaper burst=30 delay=0"
        );
        // One bound per period suffices.
        assert_eq!(
            bounded("10/s fixed-window; 10/s token-bucket"),
            "10/1s fixed-window; 10/1s token-bucket capacity=10; 10/1s sliding-log"
        );
        // Beyond what a log keeps: evenly spaced.
        assert_eq!(
            bounded("100000/h fixed-window"),
            "100000/1h fixed-window; 100000/1h gcra burst=1"
        );
    }
}
