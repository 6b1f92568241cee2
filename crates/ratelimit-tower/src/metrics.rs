//! Counters and the store-latency histogram (feature `metrics`), registered once per layer
//! so that counting a request is an atomic add, not a lookup.
//!
//! The metrics and their labels are listed in the [crate docs](crate#metrics).
//!
//! Install the recorder before building the layer: handles are taken at build time (and
//! when limits are replaced).

/// Histogram buckets for `ratelimit_store_duration_seconds`, in seconds: 50 µs (a Redis
/// call on the same host) to 1 s (far beyond any store timeout worth having), about three
/// per decade. Exporters take buckets per metric, e.g. `metrics-exporter-prometheus`'s
/// `PrometheusBuilder::set_buckets_for_metric(Matcher::Full("ratelimit_store_duration_seconds".into()), STORE_DURATION_BUCKETS)`.
pub const STORE_DURATION_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// The default [`metrics_tier_labels`](crate::RateLimitLayerBuilder::metrics_tier_labels).
pub const DEFAULT_METRICS_TIER_LABELS: usize = 100;

#[cfg(feature = "metrics")]
mod enabled {
    use std::collections::HashSet;
    use std::time::Duration;

    use metrics::{counter, histogram, Counter, Histogram};
    use parking_lot::Mutex;
    use ratelimit_core::{Decision, Outcome};

    use crate::policy::FailurePolicy;

    /// The label of tiers past a layer's [`TierLabels`] cap, and of their rules.
    pub(crate) const OTHER: &str = "other";

    /// The tier names a layer has given labels of their own: at most `cap`, first come,
    /// for the layer's life (replaced limits keep the names labelled before), so that a
    /// file with thousands of tiers, or many reloads with new names, cannot grow the
    /// series without bound.
    pub(crate) struct TierLabels {
        cap: usize,
        named: Mutex<HashSet<Box<str>>>,
    }

    impl TierLabels {
        pub(crate) fn new(cap: usize) -> Self {
            Self {
                cap,
                named: Mutex::default(),
            }
        }

        /// The label of tier `name`: its name, or [`OTHER`] past the cap.
        pub(crate) fn label<'a>(&self, name: &'a str) -> &'a str {
            let mut named = self.named.lock();
            if named.contains(name) || (named.len() < self.cap && named.insert(name.into())) {
                name
            } else {
                OTHER
            }
        }
    }

    pub(crate) struct Metrics {
        admitted: Box<[Counter]>,
        limited: Box<[Counter]>,
        /// One `rule="other"` counter stands for all rules (a tier labelled `other`).
        collapsed: bool,
        blocked: Counter,
        store_errors: Counter,
    }

    impl Metrics {
        /// The counters of the tier labelled `tier` of the layer `namespace`, with the
        /// names of its rules (one `other` for a tier labelled `other`).
        pub(crate) fn new(
            namespace: &str,
            tier: &str,
            rules: &[String],
            policy: FailurePolicy,
        ) -> Self {
            let collapsed = tier == OTHER;
            let other = [OTHER.to_owned()];
            let rules = if collapsed { &other[..] } else { rules };
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
                collapsed,
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
                Outcome::Allowed => self.admitted.iter().for_each(|c| c.increment(1)),
                Outcome::Limited if self.collapsed => self.limited[0].increment(1),
                Outcome::Limited => {
                    for (c, r) in self.limited.iter().zip(decision.rules()) {
                        if !r.allowed {
                            c.increment(1);
                        }
                    }
                }
                Outcome::Blocked => self.blocked.increment(1),
            }
        }

        pub(crate) fn store_error(&self) {
            self.store_errors.increment(1);
        }
    }

    /// `ratelimit_store_duration_seconds` of one layer, by outcome: how long the store
    /// took to answer a check that went to it asynchronously (a store that decides in
    /// process answers in nanoseconds and is not timed).
    pub(crate) struct StoreLatency {
        admitted: Histogram,
        limited: Histogram,
        blocked: Histogram,
        error: Histogram,
    }

    impl StoreLatency {
        pub(crate) fn new(namespace: &str) -> Self {
            let outcome = |outcome: &'static str| {
                histogram!(
                    "ratelimit_store_duration_seconds",
                    "layer" => namespace.to_owned(),
                    "outcome" => outcome
                )
            };
            Self {
                admitted: outcome("admitted"),
                limited: outcome("limited"),
                blocked: outcome("blocked"),
                error: outcome("error"),
            }
        }

        pub(crate) fn record<E>(&self, elapsed: Duration, result: &Result<Decision, E>) {
            let histogram = match result.as_ref().map(Decision::outcome) {
                Ok(Outcome::Allowed) => &self.admitted,
                Ok(Outcome::Limited) => &self.limited,
                Ok(Outcome::Blocked) => &self.blocked,
                Err(_) => &self.error,
            };
            histogram.record(elapsed.as_secs_f64());
        }
    }
}

// Without the feature there is no `Metrics` at all: the field that holds it and the calls
// that count are compiled out with it.
#[cfg(feature = "metrics")]
pub(crate) use enabled::{Metrics, StoreLatency, TierLabels};
