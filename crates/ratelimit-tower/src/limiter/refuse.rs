//! One constructor per reason a request is refused.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, StatusCode};
use ratelimit_core::{CapacityError, Decision, Outcome, Store};

use super::state::Limiter;
use super::verdict::Verdict;
use crate::key::KeyDigest;
use crate::rejection::{Refusal, RejectReason, Rejection};
use crate::tier::Tier;

impl<S: Store, K, C, T> Limiter<S, K, C, T> {
    /// A rule denied the request, or the key is blocked.
    pub(super) fn denial(
        &self,
        tier: &Tier,
        key: &[u8],
        decision: Decision,
        retry_after: Option<Duration>,
        ratelimit: Option<HeaderValue>,
    ) -> Verdict {
        let blocked = decision.outcome() == Outcome::Blocked;
        tracing::debug!(
            key = %KeyDigest(tier.client_key(key)),
            outcome = if blocked { "blocked" } else { "limited" },
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            "rate limit: refusing request"
        );
        let (reason, status) = if blocked {
            (RejectReason::Blocked, self.blocked_status.status())
        } else {
            (RejectReason::Limited, StatusCode::TOO_MANY_REQUESTS)
        };
        let rejection = Rejection {
            retry_after,
            decision: Some(decision),
            ..Rejection::new(reason, status)
        };
        self.refusal(rejection, Some((tier, ratelimit)))
    }

    /// A shaping rule admitted the request later than the layer's maximum delay.
    pub(super) fn delay_too_long(&self, tier: &Tier, key: &[u8], decision: Decision) -> Verdict {
        let delay = decision.delay();
        tracing::debug!(
            key = %KeyDigest(tier.client_key(key)),
            delay_ms = delay.as_millis() as u64,
            max_delay_ms = self.max_delay.as_millis() as u64,
            "rate limit: shaping delay above the maximum; refusing"
        );
        let ratelimit = tier.policy.ratelimit(&decision);
        let rejection = Rejection {
            retry_after: Some(delay),
            decision: Some(decision),
            ..Rejection::new(RejectReason::DelayTooLong, StatusCode::TOO_MANY_REQUESTS)
        };
        self.refusal(rejection, Some((tier, ratelimit)))
    }

    /// The request costs more than a rule can ever grant.
    pub(super) fn cost_exceeded(&self, tier: &Tier, key: &[u8], e: &CapacityError) -> Verdict {
        tracing::debug!(key = %KeyDigest(tier.client_key(key)), error = %e, "rate limit: cost above capacity");
        let reason = RejectReason::CostExceedsCapacity {
            cost: e.cost,
            capacity: e.capacity,
        };
        let rejection = Rejection::new(reason, StatusCode::PAYLOAD_TOO_LARGE);
        self.refusal(rejection, Some((tier, None)))
    }

    /// The store failed and the layer fails closed.
    pub(super) fn store_unavailable(&self) -> Verdict {
        let rejection = Rejection::new(
            RejectReason::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
        );
        self.refusal(rejection, None)
    }

    /// The client left out what the key is made of.
    pub(super) fn key_omitted(&self, why: Cow<'static, str>) -> Verdict {
        let rejection = Rejection {
            detail: Some(why),
            ..Rejection::new(RejectReason::KeyOmitted, self.omitted_key_status)
        };
        self.refusal(rejection, None)
    }

    /// No key in the request, and the layer refuses such requests.
    pub(super) fn missing_key(&self, why: Cow<'static, str>) -> Verdict {
        let rejection = Rejection {
            detail: Some(why),
            ..Rejection::new(RejectReason::MissingKey, StatusCode::INTERNAL_SERVER_ERROR)
        };
        self.refusal(rejection, None)
    }

    /// `rejection` with the tier's `RateLimit-Policy` and the `RateLimit` field, when the
    /// refusal has a tier.
    fn refusal(
        &self,
        rejection: Rejection,
        fields: Option<(&Tier, Option<HeaderValue>)>,
    ) -> Verdict {
        let (policy, ratelimit) = match fields {
            Some((tier, ratelimit)) => (tier.policy.header.clone(), ratelimit),
            None => (None, None),
        };
        Verdict::Refuse(Box::new(Refusal {
            rejection,
            policy,
            ratelimit,
            hook: Arc::clone(&self.on_rejection),
        }))
    }
}
