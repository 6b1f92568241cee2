//! The local store a layer decides with while its store fails
//! ([`FailurePolicy::Fallback`](crate::policy::FailurePolicy::Fallback)), and its rules.

use std::num::NonZeroU32;
use std::sync::Arc;

use ratelimit_core::{Algorithm, Clock, LeakyMode, MemoryStore, Rule, RuleSet, Store};

use crate::error::BuildError;

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
        self.of(tier, false)
    }

    /// The fallback rules of a customer's own `rules` (a share of them, as a tier's), for
    /// rules that arrive at run time and cannot be refused: a share that rounds to 0 is
    /// 1 (each instance admits one per period, so the fleet up to N: more than the
    /// customer's own limit when it is below N, and the least a share can hold).
    pub(crate) fn for_customer(&self, rules: &RuleSet) -> Result<RuleSet, BuildError> {
        self.of(rules, true)
    }

    fn of(&self, rules: &RuleSet, at_least_one: bool) -> Result<RuleSet, BuildError> {
        match self {
            FallbackRules::Same => Ok(rules.clone()),
            FallbackRules::Rules(own) => Ok(own.clone()),
            FallbackRules::Share(n) => {
                let shared = rules
                    .rules()
                    .iter()
                    .map(|r| share(r, u64::from(n.get()), at_least_one))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(RuleSet::new(shared)?)
            }
        }
    }
}

/// `rule` with its limit and burst divided by `n`, rounded down: N instances enforcing
/// the result admit at most what one instance enforcing `rule` would. A part that
/// rounds to 0 is refused, or is 1 when `at_least_one`.
fn share(rule: &Rule, n: u64, at_least_one: bool) -> Result<Rule, BuildError> {
    let part = |value: u64, field: &'static str| {
        let part = value / n;
        if part == 0 && at_least_one && value > 0 {
            Ok(1)
        } else if part == 0 {
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
        // A share of the slots, held as long.
        Algorithm::Concurrent => Rule::concurrent(limit, period),
    }?;
    Ok(match rule.name() {
        Some(name) => shared.named(name)?,
        None => shared,
    })
}

/// A local store for the fallback policy, on the main store's clock.
pub(crate) type FallbackStore = MemoryStore<StoreClock>;

/// The clock of a store, for what runs beside it.
pub(crate) struct StoreClock(Arc<dyn Fn() -> u64 + Send + Sync>);

impl Clock for StoreClock {
    fn now_us(&self) -> u64 {
        (self.0)()
    }
}

/// A fallback store on the clock of `store`.
pub(crate) fn fallback_store<S: Store>(store: &Arc<S>) -> FallbackStore {
    let clock_of = Arc::clone(store);
    MemoryStore::builder()
        .clock(StoreClock(Arc::new(move || clock_of.now_us())))
        .build()
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
}
