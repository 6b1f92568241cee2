//! Counters (feature `metrics`), registered once per layer so that counting a request is
//! an atomic add, not a lookup.
//!
//! The counters and their labels are listed in the [crate docs](crate#metrics).
//!
//! Install the recorder before building the layer: handles are taken at build time.

#[cfg(feature = "metrics")]
mod enabled {
    use metrics::{counter, Counter};
    use ratelimit_core::Decision;

    use crate::policy::FailurePolicy;

    pub(crate) struct Metrics {
        admitted: Box<[Counter]>,
        limited: Box<[Counter]>,
        blocked: Counter,
        store_errors: Counter,
    }

    impl Metrics {
        /// The counters of the tier `tier` of the layer `namespace`, with the names of
        /// its rules.
        pub(crate) fn new(
            namespace: &str,
            tier: &str,
            rules: &[String],
            policy: FailurePolicy,
        ) -> Self {
            let (layer, tier) = (namespace.to_owned(), tier.to_owned());
            let per_rule = |name: &'static str| -> Box<[Counter]> {
                rules
                    .iter()
                    .map(|rule| {
                        counter!(
                            name,
                            "layer" => layer.clone(),
                            "tier" => tier.clone(),
                            "rule" => rule.clone()
                        )
                    })
                    .collect()
            };
            Self {
                admitted: per_rule("ratelimit_admitted_total"),
                limited: per_rule("ratelimit_limited_total"),
                blocked: counter!(
                    "ratelimit_blocked_total",
                    "layer" => layer.clone(),
                    "tier" => tier.clone()
                ),
                store_errors: counter!(
                    "ratelimit_store_errors_total",
                    "layer" => layer,
                    "tier" => tier,
                    "policy" => policy.label()
                ),
            }
        }

        pub(crate) fn decision(&self, decision: &Decision) {
            match decision.outcome() {
                ratelimit_core::Outcome::Allowed => {
                    self.admitted.iter().for_each(|c| c.increment(1))
                }
                ratelimit_core::Outcome::Limited => {
                    for (c, r) in self.limited.iter().zip(decision.rules()) {
                        if !r.allowed {
                            c.increment(1);
                        }
                    }
                }
                ratelimit_core::Outcome::Blocked => self.blocked.increment(1),
            }
        }

        pub(crate) fn store_error(&self) {
            self.store_errors.increment(1);
        }
    }
}

// Without the feature there is no `Metrics` at all: the field that holds it and the calls
// that count are compiled out with it.
#[cfg(feature = "metrics")]
pub(crate) use enabled::Metrics;
