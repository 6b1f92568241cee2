//! From a request to a [`Verdict`].

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, Request};
use ratelimit_core::{Decision, Outcome, Store};

use super::state::Limiter;
use super::verdict::{Begin, Pass, Verdict};
use crate::cost::RequestCost;
use crate::headers::Fields;
use crate::key::{Extraction, KeyDigest, KeyDisplay, KeyExtractor};
use crate::limits::Version;
use crate::policy::{FailurePolicy, MissingKey};
use crate::rejection::RejectReason;
use crate::tier::{SelectTier, StoreKey, Tier};

/// A request ready for the store: its tier, its store key and its cost.
struct Check {
    tier: usize,
    key: StoreKey,
    cost: u64,
}

const SHADOW_LIMITED: &str = "limited";
const SHADOW_BLOCKED: &str = "blocked";
const SHADOW_DELAYED: &str = "delayed";
const SHADOW_COST: &str = "cost-exceeded";
const SHADOW_STORE: &str = "store-unavailable";
const SHADOW_OMITTED: &str = "key-omitted";
const SHADOW_MISSING: &str = "missing-key";

impl<S, K, C, T> Limiter<S, K, C, T>
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
        // The whole decision runs on the version loaded here, however the limits change
        // meanwhile.
        let version = this.live.current.load();
        let check = match this.prepare(&version, req) {
            Ok(check) => check,
            Err(verdict) => return Begin::Now(this.finish(verdict)),
        };
        let tier = &version.tiers[check.tier];
        // `Store::check`'s future borrows the key and the rules, so a named response future
        // could only hold it boxed; a store that decides in process answers here instead
        // and the request costs no allocation.
        match this.store.check_sync(&check.key, &tier.rules, check.cost) {
            Some(result) => {
                let result = result.map_err(|e| e.to_string());
                let verdict = this.decided(tier, &check, result, Some(req.extensions_mut()));
                Begin::Now(this.finish(verdict))
            }
            None => Begin::Later(Self::check_later(
                this,
                arc_swap::Guard::into_inner(version),
                check,
            )),
        }
    }

    /// Extracts the key, selects the tier and prices the request; or the verdict that
    /// needs no store call (an exemption, a misconfiguration, a cost above capacity, a
    /// denial still in the deny cache).
    fn prepare<B>(&self, version: &Version, req: &Request<B>) -> Result<Check, Verdict>
    where
        K: KeyExtractor<B>,
        C: RequestCost<B>,
        T: SelectTier<B>,
    {
        let client = match self.key.extract(req) {
            Extraction::Key(key) => key,
            Extraction::Exempt => {
                tracing::trace!("rate limit: exempt request");
                return Err(Verdict::UNCHECKED);
            }
            Extraction::Omitted(why) => return Err(self.omitted(why)),
            Extraction::Missing(why) => return Err(self.missing(why)),
        };
        let tier_index = self.select_tier(version, req);
        let tier = &version.tiers[tier_index];
        let cost = self.cost.cost(req);
        let key = tier.store_key(client.as_ref());
        if cost > tier.min_capacity {
            if let Err(e) = tier.rules.check_cost(cost) {
                return Err(self.cost_exceeded(tier, &key, &e));
            }
        }
        if let Some(verdict) = self.cached_denial(tier, &key, cost) {
            return Err(verdict);
        }
        Ok(Check {
            tier: tier_index,
            key,
            cost,
        })
    }

    /// The store's answer for a store that does not decide in process, with the store
    /// timeout, inside a span so that its latency shows in traces.
    fn check_later(this: &Arc<Self>, version: Arc<Version>, check: Check) -> super::CheckFuture {
        let limiter = Arc::clone(this);
        let tier = &version.tiers[check.tier];
        let span = tracing::debug_span!(
            "ratelimit_check",
            key = %KeyDigest(tier.client_key(&check.key)),
            cost = check.cost
        );
        let future = async move {
            let tier = &version.tiers[check.tier];
            #[cfg(feature = "metrics")]
            let started = std::time::Instant::now();
            let call = limiter.store.check(&check.key, &tier.rules, check.cost);
            let result = match limiter.store_timeout {
                None => call.await.map_err(|e| e.to_string()),
                Some(t) => match tokio::time::timeout(t, call).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
                },
            };
            #[cfg(feature = "metrics")]
            limiter.store_latency.record(started.elapsed(), &result);
            let verdict = limiter.decided(tier, &check, result, None);
            limiter.finish(verdict)
        };
        Box::pin(tracing::Instrument::instrument(future, span))
    }

    fn decided(
        &self,
        tier: &Tier,
        check: &Check,
        result: Result<Decision, String>,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        match result {
            Ok(decision) => self.plan(tier, &check.key, check.cost, decision, extensions),
            Err(error) => self.store_failed(tier, &check.key, check.cost, &error, extensions),
        }
    }

    /// A denial of this key still in force, answered without the store.
    fn cached_denial(&self, tier: &Tier, key: &[u8], cost: u64) -> Option<Verdict> {
        let hit = self
            .deny_cache
            .as_ref()?
            .get(key, tier.generation, cost, || self.store.now_us())?;
        let client = tier.client_key(key);
        tracing::trace!(key = %KeyDigest(client), client = %KeyDisplay(client), "rate limit: denied from the local deny cache");
        #[cfg(feature = "metrics")]
        tier.metrics.decision(&hit.decision);
        let ratelimit = tier.policy.ratelimit_of(hit.decision.rules(), hit.elapsed);
        Some(self.denial(tier, key, hit.decision, hit.retry_after, ratelimit))
    }

    /// The index of the request's tier: the default tier's for no tier or for a tier the
    /// limits lack (with a `WARN`, see [`Version::tier_named`]).
    fn select_tier<B>(&self, version: &Version, req: &Request<B>) -> usize
    where
        T: SelectTier<B>,
    {
        match self.select.select(req) {
            None => version.default_tier,
            Some(name) => version.tier_named(name.as_ref(), &self.tier_log, || self.store.now_us()),
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
        if decision.outcome() == Outcome::Allowed {
            return self.admitted(tier, key, decision, extensions);
        }
        if let Some(cache) = &self.deny_cache {
            cache.insert(key, tier.generation, cost, &decision, self.store.now_us());
        }
        let ratelimit = tier.policy.ratelimit(&decision);
        let retry_after = decision.retry_after();
        self.denial(tier, key, decision, retry_after, ratelimit)
    }

    fn admitted(
        &self,
        tier: &Tier,
        key: &[u8],
        decision: Decision,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        let delay = decision.delay();
        if delay > self.max_delay {
            return self.delay_too_long(tier, key, decision);
        }
        if !delay.is_zero() {
            tracing::debug!(
                key = %KeyDigest(tier.client_key(key)),
                delay_ms = delay.as_millis() as u64,
                "rate limit: delaying request"
            );
        } else {
            let client = tier.client_key(key);
            tracing::trace!(key = %KeyDigest(client), client = %KeyDisplay(client), "rate limit: admitted");
        }
        let fields = self.admitted_headers.then(|| Fields {
            policy: Some(tier.policy.header.clone()),
            ratelimit: tier.policy.ratelimit(&decision),
            shadow: None,
        });
        let decision = match extensions {
            Some(extensions) => {
                extensions.insert(decision);
                None
            }
            None => Some(Box::new(decision)),
        };
        Verdict::Pass(Pass {
            delay,
            fields,
            decision,
        })
    }

    fn store_failed(
        &self,
        tier: &Tier,
        key: &StoreKey,
        cost: u64,
        error: &str,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        self.report_store_failure(tier, key, error);
        match self.failure_policy {
            FailurePolicy::FailOpen => Verdict::UNCHECKED,
            FailurePolicy::FailClosed => self.store_unavailable(),
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

    /// Counts a store failure and logs it at a bounded rate.
    fn report_store_failure(&self, tier: &Tier, key: &[u8], error: &str) {
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
                key = %KeyDigest(tier.client_key(key)),
                action,
                "rate-limit store failed \
                 (reported at most every 10 s, with the requests since the last report)"
            );
        }
    }

    /// The client's mistake, not the server's: refused at `DEBUG`, like a limited request.
    fn omitted(&self, why: Cow<'static, str>) -> Verdict {
        tracing::debug!(
            error = %why,
            namespace = &*self.namespace,
            status = self.omitted_key_status.as_u16(),
            "rate limit: the request has no key; refusing"
        );
        self.key_omitted(why)
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
        self.missing_key(why)
    }

    /// Applies shadow mode: the one place where a refusal or a delay becomes a pass.
    fn finish(&self, verdict: Verdict) -> Verdict {
        if !self.shadow {
            return verdict;
        }
        let label = match verdict {
            // Admitted anyway: nothing to report, and no rate-limit fields in shadow mode.
            Verdict::Pass(pass) if pass.delay.is_zero() => {
                return Verdict::Pass(Pass {
                    fields: None,
                    ..pass
                });
            }
            Verdict::Pass(_) => SHADOW_DELAYED,
            Verdict::Refuse(refusal) => match refusal.rejection.reason {
                RejectReason::Limited => SHADOW_LIMITED,
                RejectReason::Blocked => SHADOW_BLOCKED,
                RejectReason::DelayTooLong => SHADOW_DELAYED,
                RejectReason::CostExceedsCapacity { .. } => SHADOW_COST,
                RejectReason::StoreUnavailable => SHADOW_STORE,
                RejectReason::KeyOmitted => SHADOW_OMITTED,
                RejectReason::MissingKey => SHADOW_MISSING,
            },
        };
        tracing::info!(
            verdict = label,
            namespace = &*self.namespace,
            "rate limit (shadow mode): would have refused or delayed; passing"
        );
        Verdict::Pass(Pass {
            delay: Duration::ZERO,
            fields: Some(Fields {
                shadow: Some(label),
                ..Fields::default()
            }),
            decision: None,
        })
    }
}
