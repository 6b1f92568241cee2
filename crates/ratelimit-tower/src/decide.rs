//! From a request to a [`Verdict`]: key extraction, tier selection, the store's decision,
//! the deny cache, failure and misconfiguration policies, and shadow mode. The service
//! and its future only carry verdicts out.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, HeaderValue, Request, StatusCode};
use ratelimit_core::{CapacityError, Decision, Outcome, Store};

use crate::cost::RequestCost;
use crate::headers::{ratelimit_value, ratelimit_value_of, Fields};
use crate::key::{Extraction, KeyDisplay, KeyExtractor};
use crate::layer::Shared;
use crate::policy::{FailurePolicy, MissingKey};
use crate::rejection::{Refusal, RejectReason, Rejection};
use crate::tier::{SelectTier, StoreKey, Tier};

/// What becomes of a request.
pub(crate) enum Verdict {
    /// Call the inner service after `delay`, adding `fields` to its response; the
    /// store's decision, if any, goes into the request's extensions. Boxed: only a
    /// decision that arrives later (from a store that is not in process) travels in the
    /// verdict, and a verdict is moved several times.
    Pass {
        delay: Duration,
        fields: Option<Fields>,
        decision: Option<Box<Decision>>,
    },
    /// Answer without calling the inner service.
    Refuse(Box<Refusal>),
}

impl Verdict {
    const UNCHECKED: Verdict = Verdict::Pass {
        delay: Duration::ZERO,
        fields: None,
        decision: None,
    };
}

pub(crate) type CheckFuture = Pin<Box<dyn Future<Output = Verdict> + Send>>;

/// A verdict now, or once the store answers.
pub(crate) enum Begin {
    Now(Verdict),
    Later(CheckFuture),
}

const SHADOW_LIMITED: &str = "limited";
const SHADOW_BLOCKED: &str = "blocked";
const SHADOW_DELAYED: &str = "delayed";
const SHADOW_COST: &str = "cost-exceeded";
const SHADOW_STORE: &str = "store-unavailable";
const SHADOW_MISSING: &str = "missing-key";
const SHADOW_TIER: &str = "unknown-tier";

impl<S, K, C, T> Shared<S, K, C, T>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    /// Decides `req`; an admitted decision known at once goes straight into its
    /// extensions (a decision is a few hundred bytes: moving it through the verdict would
    /// cost more than the rest of the layer's own work).
    pub(crate) fn begin<B>(this: &Arc<Self>, req: &mut Request<B>) -> Begin
    where
        K: KeyExtractor<B>,
        C: RequestCost<B>,
        T: SelectTier<B>,
    {
        let client = match this.key.extract(&*req) {
            Extraction::Key(key) => key,
            Extraction::Exempt => {
                tracing::trace!("rate limit: exempt request");
                return Begin::Now(Verdict::UNCHECKED);
            }
            Extraction::Missing(why) => return Begin::Now(this.finish(this.missing(why))),
        };
        let tier_index = match this.select_tier(&*req) {
            Ok(i) => i,
            Err(verdict) => return Begin::Now(this.finish(verdict)),
        };
        let tier = &this.tiers[tier_index];
        let cost = this.cost.cost(&*req);
        let key = tier.store_key(client.as_ref());
        if cost > tier.min_capacity {
            if let Err(e) = tier.rules.check_cost(cost) {
                return Begin::Now(this.finish(this.cost_exceeded(tier, &key, &e)));
            }
        }
        if let Some(cache) = &this.deny_cache {
            if let Some(hit) = cache.get(&key, cost, || this.store.now_us()) {
                tracing::trace!(key = %KeyDisplay(tier.client_key(&key)), "rate limit: denied from the local deny cache");
                #[cfg(feature = "metrics")]
                tier.metrics.decision(&hit.decision);
                let ratelimit = ratelimit_value_of(hit.decision.rules(), &tier.names, hit.elapsed);
                let verdict = this.denial(tier, &key, hit.decision, hit.retry_after, ratelimit);
                return Begin::Now(this.finish(verdict));
            }
        }
        // `Store::check`'s future borrows the key and the rules, so a named response future
        // could only hold it boxed; a store that decides in process answers here instead
        // and the request costs no allocation.
        if let Some(result) = this.store.check_sync(&key, &tier.rules, cost) {
            let verdict = match result {
                Ok(decision) => this.plan(tier, &key, cost, decision, Some(req.extensions_mut())),
                Err(error) => this.store_failed(
                    tier,
                    &key,
                    cost,
                    &error.to_string(),
                    Some(req.extensions_mut()),
                ),
            };
            return Begin::Now(this.finish(verdict));
        }
        let shared = Arc::clone(this);
        // A span around the store round trip, so that its latency shows in traces.
        let span =
            tracing::debug_span!("ratelimit_check", key = %KeyDisplay(tier.client_key(&key)), cost);
        let check = async move {
            let tier = &shared.tiers[tier_index];
            let check = shared.store.check(&key, &tier.rules, cost);
            let result = match shared.store_timeout {
                None => check.await.map_err(|e| e.to_string()),
                Some(t) => match tokio::time::timeout(t, check).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
                },
            };
            let verdict = match result {
                Ok(decision) => shared.plan(tier, &key, cost, decision, None),
                Err(error) => shared.store_failed(tier, &key, cost, &error, None),
            };
            shared.finish(verdict)
        };
        Begin::Later(Box::pin(tracing::Instrument::instrument(check, span)))
    }

    /// The index of the request's tier, or the refusal of a misconfigured selector.
    fn select_tier<B>(&self, req: &Request<B>) -> Result<usize, Verdict>
    where
        T: SelectTier<B>,
    {
        let (found, why) = match self.select.select(req) {
            None => (
                self.default_tier,
                Cow::Borrowed("the tier selector chose no tier and the layer has no default tier"),
            ),
            Some(name) => {
                let name = name.as_ref();
                match self.tiers.iter().position(|t| &*t.name == name) {
                    Some(i) => return Ok(i),
                    None => (
                        None,
                        Cow::Owned(format!(
                            "the tier selector chose tier {:?}, which is not configured",
                            KeyDisplay(name.as_bytes()).to_string()
                        )),
                    ),
                }
            }
        };
        found.ok_or_else(|| {
            if let Some(count) = self.tier_log.hit(self.store.now_us()) {
                tracing::error!(
                    error = %why,
                    requests = count,
                    "rate limit misconfigured: no tier for the request; refusing with 500 \
                     (reported at most every 10 s, with the requests since the last report)"
                );
            }
            self.refuse(
                None,
                RejectReason::UnknownTier,
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                None,
                None,
                Some(why),
            )
        })
    }

    /// Applies shadow mode: the one place where a refusal or a delay becomes a pass.
    fn finish(&self, verdict: Verdict) -> Verdict {
        if !self.shadow {
            return verdict;
        }
        let label = match verdict {
            // Admitted anyway: nothing to report, and no rate-limit fields in shadow mode.
            Verdict::Pass {
                delay, decision, ..
            } if delay.is_zero() => {
                return Verdict::Pass {
                    delay,
                    fields: None,
                    decision,
                };
            }
            Verdict::Pass { .. } => SHADOW_DELAYED,
            Verdict::Refuse(refusal) => match refusal.rejection.reason {
                RejectReason::Limited => SHADOW_LIMITED,
                RejectReason::Blocked => SHADOW_BLOCKED,
                RejectReason::DelayTooLong => SHADOW_DELAYED,
                RejectReason::CostExceedsCapacity { .. } => SHADOW_COST,
                RejectReason::StoreUnavailable => SHADOW_STORE,
                RejectReason::MissingKey => SHADOW_MISSING,
                RejectReason::UnknownTier => SHADOW_TIER,
            },
        };
        tracing::info!(
            verdict = label,
            namespace = &*self.namespace,
            "rate limit (shadow mode): would have refused or delayed; passing"
        );
        Verdict::Pass {
            delay: Duration::ZERO,
            fields: Some(Fields {
                shadow: Some(label),
                ..Fields::default()
            }),
            decision: None,
        }
    }

    /// Turns the store's decision into a verdict. An admitted decision goes into
    /// `extensions` when given, else into the verdict.
    fn plan(
        &self,
        tier: &Tier,
        key: &[u8],
        cost: u64,
        decision: Decision,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        #[cfg(feature = "metrics")]
        tier.metrics.decision(&decision);
        match decision.outcome() {
            Outcome::Allowed => {
                let delay = decision.delay();
                if delay > self.max_delay {
                    tracing::debug!(
                        key = %KeyDisplay(tier.client_key(key)),
                        delay_ms = delay.as_millis() as u64,
                        max_delay_ms = self.max_delay.as_millis() as u64,
                        "rate limit: shaping delay above the maximum; refusing"
                    );
                    let ratelimit = ratelimit_value(&decision, &tier.names);
                    return self.refuse(
                        Some(tier),
                        RejectReason::DelayTooLong,
                        StatusCode::TOO_MANY_REQUESTS,
                        Some(delay),
                        Some(decision),
                        ratelimit,
                        None,
                    );
                }
                if !delay.is_zero() {
                    tracing::debug!(
                        key = %KeyDisplay(tier.client_key(key)),
                        delay_ms = delay.as_millis() as u64,
                        "rate limit: delaying request"
                    );
                } else {
                    tracing::trace!(key = %KeyDisplay(tier.client_key(key)), "rate limit: admitted");
                }
                let fields = self.admitted_headers.then(|| Fields {
                    policy: Some(tier.policy_header.clone()),
                    ratelimit: ratelimit_value(&decision, &tier.names),
                    shadow: None,
                });
                let decision = match extensions {
                    Some(extensions) => {
                        extensions.insert(decision);
                        None
                    }
                    None => Some(Box::new(decision)),
                };
                Verdict::Pass {
                    delay,
                    fields,
                    decision,
                }
            }
            Outcome::Limited | Outcome::Blocked => {
                if let Some(cache) = &self.deny_cache {
                    cache.insert(key, cost, &decision, self.store.now_us());
                }
                let ratelimit = ratelimit_value(&decision, &tier.names);
                let retry_after = decision.retry_after();
                self.denial(tier, key, decision, retry_after, ratelimit)
            }
        }
    }

    fn denial(
        &self,
        tier: &Tier,
        key: &[u8],
        decision: Decision,
        retry_after: Option<Duration>,
        ratelimit: Option<HeaderValue>,
    ) -> Verdict {
        let blocked = decision.outcome() == Outcome::Blocked;
        tracing::debug!(
            key = %KeyDisplay(tier.client_key(key)),
            outcome = if blocked { "blocked" } else { "limited" },
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            "rate limit: refusing request"
        );
        let (reason, status) = if blocked {
            (RejectReason::Blocked, self.blocked_status.status())
        } else {
            (RejectReason::Limited, StatusCode::TOO_MANY_REQUESTS)
        };
        self.refuse(
            Some(tier),
            reason,
            status,
            retry_after,
            Some(decision),
            ratelimit,
            None,
        )
    }

    fn cost_exceeded(&self, tier: &Tier, key: &[u8], e: &CapacityError) -> Verdict {
        tracing::debug!(key = %KeyDisplay(tier.client_key(key)), error = %e, "rate limit: cost above capacity");
        let reason = RejectReason::CostExceedsCapacity {
            cost: e.cost,
            capacity: e.capacity,
        };
        self.refuse(
            Some(tier),
            reason,
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
            None,
            None,
            None,
        )
    }

    fn store_failed(
        &self,
        tier: &Tier,
        key: &StoreKey,
        cost: u64,
        error: &str,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        #[cfg(feature = "metrics")]
        tier.metrics.store_error();
        if let Some(count) = self.store_error_log.hit(self.store.now_us()) {
            let action = match self.failure_policy {
                FailurePolicy::FailOpen => "admitted unchecked",
                FailurePolicy::FailClosed => "refused with 503",
                FailurePolicy::Fallback => "decided by the local fallback store",
            };
            tracing::warn!(
                policy = self.failure_policy.label(),
                error,
                requests = count,
                key = %KeyDisplay(tier.client_key(key)),
                action,
                "rate-limit store failed \
                 (reported at most every 10 s, with the requests since the last report)"
            );
        }
        match self.failure_policy {
            FailurePolicy::FailOpen => Verdict::UNCHECKED,
            FailurePolicy::FailClosed => self.refuse(
                None,
                RejectReason::StoreUnavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                None,
                None,
                None,
            ),
            FailurePolicy::Fallback => {
                let fallback = self
                    .fallback
                    .as_ref()
                    .expect("built with the fallback policy");
                let rules = tier
                    .fallback_rules
                    .as_ref()
                    .expect("built with the fallback policy");
                match fallback.check_now(key, rules, cost) {
                    Ok(decision) => self.plan(tier, key, cost, decision, extensions),
                    Err(e) => self.cost_exceeded(tier, key, &e),
                }
            }
        }
    }

    fn missing(&self, why: Cow<'static, str>) -> Verdict {
        let refuse = self.missing_key == MissingKey::Refuse;
        if let Some(count) = self.missing_log.hit(self.store.now_us()) {
            tracing::error!(
                error = %why,
                requests = count,
                namespace = &*self.namespace,
                action = if refuse { "refused with 500" } else { "admitted unlimited" },
                "rate limit misconfigured: no key found in the request \
                 (reported at most every 10 s, with the requests since the last report)"
            );
        }
        if !refuse {
            return Verdict::UNCHECKED;
        }
        self.refuse(
            None,
            RejectReason::MissingKey,
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            None,
            None,
            Some(why),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn refuse(
        &self,
        tier: Option<&Tier>,
        reason: RejectReason,
        status: StatusCode,
        retry_after: Option<Duration>,
        decision: Option<Decision>,
        ratelimit: Option<HeaderValue>,
        detail: Option<Cow<'static, str>>,
    ) -> Verdict {
        Verdict::Refuse(Box::new(Refusal {
            rejection: Rejection {
                reason,
                status,
                retry_after,
                decision,
                detail,
            },
            policy: tier.map(|t| t.policy_header.clone()),
            ratelimit,
            hook: Arc::clone(&self.on_rejection),
        }))
    }
}
