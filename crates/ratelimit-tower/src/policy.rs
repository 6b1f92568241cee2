//! What the layer does when its store cannot answer, and when a request has no key.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use ratelimit_core::{Algorithm, LeakyMode, Rule, RuleSet};

use crate::layer::BuildError;

/// What to do with a request when the store fails (unreachable, timed out).
///
/// Whichever is chosen, every failure is counted (`ratelimit_store_errors_total`, feature
/// `metrics`) and logged (`WARN`, target `ratelimit_tower`, with the policy, the action
/// and the error) at most once per 10 seconds of the store's clock, with the number of
/// failed requests since the last report: an outage fails every request, and one line
/// per request would bury the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Admit the request unlimited: an outage of the limiter is not an outage of the
    /// service (the default).
    #[default]
    FailOpen,
    /// Answer 503: nothing passes that was not counted.
    FailClosed,
    /// Decide with a MemoryStore local to this layer (on the store's clock). By default
    /// with the same rules, so a fleet of N instances admits up to N × the limit during
    /// an outage; give the local store a share of the limit
    /// ([`fallback_share`](crate::RateLimitLayerBuilder::fallback_share)) or rules of its
    /// own ([`fallback_rules`](crate::RateLimitLayerBuilder::fallback_rules)) to keep the
    /// fleet within the limit.
    Fallback,
}

impl FailurePolicy {
    pub(crate) fn label(self) -> &'static str {
        match self {
            FailurePolicy::FailOpen => "fail_open",
            FailurePolicy::FailClosed => "fail_closed",
            FailurePolicy::Fallback => "fallback",
        }
    }
}

/// The rules the local fallback store decides with.
#[derive(Debug, Clone, Default)]
pub(crate) enum FallbackRules {
    /// The layer's own rules.
    #[default]
    Same,
    /// Each rule's limit and burst divided by this many instances, rounded down.
    Share(NonZeroU32),
    /// Rules of their own, for every tier.
    Rules(RuleSet),
}

impl FallbackRules {
    pub(crate) fn for_tier(&self, tier: &RuleSet) -> Result<RuleSet, BuildError> {
        match self {
            FallbackRules::Same => Ok(tier.clone()),
            FallbackRules::Rules(rules) => Ok(rules.clone()),
            FallbackRules::Share(n) => {
                let shared = tier
                    .rules()
                    .iter()
                    .map(|r| share(r, u64::from(n.get())))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(RuleSet::new(shared)?)
            }
        }
    }
}

/// `rule` with its limit and burst divided by `n`, rounded down: N instances enforcing
/// the result admit at most what one instance enforcing `rule` would.
fn share(rule: &Rule, n: u64) -> Result<Rule, BuildError> {
    let part = |value: u64, field: &'static str| {
        let part = value / n;
        if part == 0 {
            Err(BuildError::ShareTooSmall {
                rule: rule.to_string(),
                field,
                value,
                instances: n,
            })
        } else {
            Ok(part)
        }
    };
    let (limit, period) = (part(rule.limit(), "limit")?, rule.period());
    let shared = match rule.algorithm() {
        Algorithm::FixedWindow => Rule::fixed_window(limit, period),
        Algorithm::SlidingWindow { precision } => Rule::sliding_window(limit, period, precision),
        Algorithm::SlidingLog => Rule::sliding_log(limit, period),
        Algorithm::TokenBucket { capacity } => {
            Rule::token_bucket(limit, period, part(capacity, "capacity")?)
        }
        Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => {
            Rule::leaky_meter(limit, period, part(capacity, "capacity")?)
        }
        Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
            let burst = burst / n;
            Rule::leaky_shaper(limit, period, burst, delay.min(burst))
        }
        Algorithm::Gcra { burst } => Rule::gcra(limit, period, part(burst, "burst")?),
    }?;
    Ok(match rule.name() {
        Some(name) => shared.named(name)?,
        None => shared,
    })
}

/// What to do with a request in which the key extractor found no key (see
/// [`Extraction::Missing`](crate::key::Extraction::Missing)).
///
/// Either way the layer logs at `ERROR` at most once per 10 seconds (of the store's
/// clock), with the number of such requests since the last report, so a misconfiguration
/// is seen at once and keeps being seen without flooding the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingKey {
    /// Answer 500 with a body that says what is missing (the default): a server started
    /// without peer addresses, or an authentication layer placed after the limiter, is
    /// found on the first request rather than after an abuse.
    #[default]
    Refuse,
    /// Pass the request unlimited (still logged and counted).
    Admit,
}

/// Counts events and lets one report through per interval.
#[derive(Debug, Default)]
pub(crate) struct BoundedLog {
    last_us: AtomicU64,
    pending: AtomicU64,
}

impl BoundedLog {
    const INTERVAL_US: u64 = 10_000_000;

    /// Counts one event at `now_us`; returns the events to report when a report is due.
    pub(crate) fn hit(&self, now_us: u64) -> Option<u64> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let last = self.last_us.load(Ordering::Relaxed);
        let due = last == 0 || now_us.saturating_sub(last) >= Self::INTERVAL_US;
        if due
            && self
                .last_us
                .compare_exchange(last, now_us.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.pending.swap(0, Ordering::Relaxed));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_divide_limits_and_bursts() {
        let rules: RuleSet = "100/s gcra burst=10 name=api; 10/min sliding-window precision=6; 7/h sliding-log; 4/s token-bucket capacity=9"
            .parse()
            .unwrap();
        let two = FallbackRules::Share(NonZeroU32::new(2).unwrap())
            .for_tier(&rules)
            .unwrap();
        let texts: Vec<String> = two.rules().iter().map(ToString::to_string).collect();
        let want: RuleSet = "50/s gcra burst=5 name=api; 5/min sliding-window precision=6; 3/h sliding-log; 2/s token-bucket capacity=4"
            .parse()
            .unwrap();
        let want: Vec<String> = want.rules().iter().map(ToString::to_string).collect();
        assert_eq!(texts, want);
        let err = FallbackRules::Share(NonZeroU32::new(8).unwrap())
            .for_tier(&rules)
            .unwrap_err();
        assert!(err.to_string().contains("7/1h sliding-log"), "{err}");
    }

    #[test]
    fn bounded_log_reports_once_per_interval_with_a_count() {
        let log = BoundedLog::default();
        let t = 5_000_000_000;
        assert_eq!(log.hit(t), Some(1));
        for i in 1..100 {
            assert_eq!(log.hit(t + i), None);
        }
        assert_eq!(log.hit(t + 10_000_000), Some(100));
        assert_eq!(log.hit(t + 10_000_001), None);
    }
}
