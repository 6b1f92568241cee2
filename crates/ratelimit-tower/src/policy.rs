//! What the layer does when its store cannot answer, and when a request has no key.

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
    ///
    /// A request it decides is told the rules it enforces (`RateLimit-Policy` items
    /// named `<name>/fallback`); a cost above what they grant at once, though not above
    /// the layer's rules, is refused with 503 and `Retry-After`
    /// ([`RejectReason::CostExceedsShare`](crate::RejectReason::CostExceedsShare)). What
    /// it does to concurrency slots and metered charges, during the outage and after: see
    /// [the crate docs](crate#while-the-store-is-down).
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
