//! What the layer does when its store cannot answer.

/// What to do with a request when the store fails (unreachable, timed out).
///
/// Whichever is chosen, every failure is logged (`WARN`, target `ratelimit_tower::service`, with
/// the policy and the error) and counted (`ratelimit_store_errors_total`, feature
/// `metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Admit the request unlimited: an outage of the limiter is not an outage of the
    /// service (the default).
    #[default]
    FailOpen,
    /// Answer 503: nothing passes that was not counted.
    FailClosed,
    /// Decide with a MemoryStore local to this layer, with the same rules: each instance
    /// then enforces the limits on its own share of the traffic until the store is back.
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
