//! One constructor per reason a request is refused.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, StatusCode};
use ratelimit_core::{CapacityError, Decision, Outcome, RuleSet, Store};

use super::state::Limiter;
use super::verdict::Verdict;
use crate::headers::Policy;
use crate::key::KeyDigest;
use crate::rejection::{Refusal, RejectReason, Rejection};
use crate::tier::Tier;

/// The longest `Retry-After` of a request the fallback store cannot hold: it is
/// admissible as soon as the store answers again, which the layer cannot foresee, and
/// outages last seconds (RedisStore tries to reconnect at least every 2 s). Without it, a
/// cost above a daily rule's share would send its client away for a day.
const SHARE_RETRY_MAX: Duration = Duration::from_secs(10);

impl<S: Store, K, C, T> Limiter<S, K, C, T> {
    /// A rule denied the request, or the key is blocked; `policy` is the fields of the
    /// rules that decided.
    pub(super) fn denial(
        &self,
        tier: &Tier,
        policy: &Policy,
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
        self.refusal(rejection, Some((policy, ratelimit)))
    }

    /// A shaping rule admitted the request later than the layer's maximum delay.
    pub(super) fn delay_too_long(
        &self,
        tier: &Tier,
        policy: &Policy,
        key: &[u8],
        decision: Decision,
    ) -> Verdict {
        let delay = decision.delay();
        tracing::debug!(
            key = %KeyDigest(tier.client_key(key)),
            delay_ms = delay.as_millis() as u64,
            max_delay_ms = self.max_delay.as_millis() as u64,
            "rate limit: shaping delay above the maximum; refusing"
        );
        let ratelimit = policy.ratelimit(&decision);
        let rejection = Rejection {
            retry_after: Some(delay),
            decision: Some(decision),
            ..Rejection::new(RejectReason::DelayTooLong, StatusCode::TOO_MANY_REQUESTS)
        };
        self.refusal(rejection, Some((policy, ratelimit)))
    }

    /// The request costs more than a rule can ever grant.
    pub(super) fn cost_exceeded(&self, tier: &Tier, key: &[u8], e: &CapacityError) -> Verdict {
        tracing::debug!(key = %KeyDigest(tier.client_key(key)), error = %e, "rate limit: cost above capacity");
        let reason = RejectReason::CostExceedsCapacity {
            cost: e.cost,
            capacity: e.capacity,
        };
        let rejection = Rejection::new(reason, StatusCode::PAYLOAD_TOO_LARGE);
        self.refusal(rejection, Some((&tier.policy, None)))
    }

    /// The store failed and the request costs more than the fallback store's rule
    /// (`rules`, the rule `e.rule`) grants at once, but no more than the tier's rules do:
    /// unavailable until the store answers, not "never".
    pub(super) fn share_exceeded(
        &self,
        tier: &Tier,
        rules: &RuleSet,
        key: &[u8],
        e: &CapacityError,
    ) -> Verdict {
        tracing::debug!(
            key = %KeyDigest(tier.client_key(key)),
            error = %e,
            "rate limit: the store failed and the cost is above the fallback rules' capacity; \
             refusing with 503"
        );
        let period = (rules.rules().get(e.rule)).map_or(SHARE_RETRY_MAX, |r| r.period());
        let reason = RejectReason::CostExceedsShare {
            cost: e.cost,
            share: e.capacity,
        };
        let rejection = Rejection {
            retry_after: Some(period.min(SHARE_RETRY_MAX)),
            ..Rejection::new(reason, StatusCode::SERVICE_UNAVAILABLE)
        };
        self.refusal(rejection, Some((tier.policy(true), None)))
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

    /// `rejection` with the `RateLimit-Policy` of the rules that decided and the
    /// `RateLimit` field, when the refusal has rules.
    fn refusal(
        &self,
        rejection: Rejection,
        fields: Option<(&Policy, Option<HeaderValue>)>,
    ) -> Verdict {
        let (policy, ratelimit) = match fields {
            Some((policy, ratelimit)) => (policy.header.clone(), ratelimit),
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
