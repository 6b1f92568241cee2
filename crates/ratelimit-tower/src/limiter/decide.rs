//! From a request to a [`Verdict`].

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{Extensions, HeaderValue, Request};
use ratelimit_core::{Decision, Outcome, Store};

use super::state::Limiter;
use super::verdict::{Admitted, Begin, Charged, Deferred, Pass, Verdict};
use crate::admission::{Admission, AdmittedBy, Binding};
use crate::charge::{Charge, ChargeKey, Settle};
use crate::cost::RequestCost;
use crate::customer::{Lookup, Own};
use crate::headers::{Fields, Policy};
use crate::key::{Extraction, KeyDigest, KeyDisplay, KeyExtractor};
use crate::limits::{TierRef, Version};
use crate::policy::{FailurePolicy, MissingKey};
use crate::rejection::RejectReason;
use crate::slot::SlotGuard;
use crate::tier::{SelectTier, StoreKey, Tier};
use crate::usage::Usage;

/// What an instance's share took for a request in the grace after an outage: when (on
/// the store's clock) and the slot.
#[derive(Clone, Copy)]
struct Share {
    at: u64,
    slot: Option<u64>,
}

/// A request ready for the store: its tier, its store key and its cost.
struct Check {
    tier: TierRef,
    key: StoreKey,
    cost: u64,
    /// Where the handler reports the actual cost, when the layer meters by reports.
    usage: Option<Usage>,
}

// Statics, so that the fields of a verdict hold a pointer rather than a header value.
static SHADOW_LIMITED: HeaderValue = HeaderValue::from_static("limited");
static SHADOW_BLOCKED: HeaderValue = HeaderValue::from_static("blocked");
static SHADOW_DELAYED: HeaderValue = HeaderValue::from_static("delayed");
static SHADOW_COST: HeaderValue = HeaderValue::from_static("cost-exceeded");
static SHADOW_STORE: HeaderValue = HeaderValue::from_static("store-unavailable");
static SHADOW_OMITTED: HeaderValue = HeaderValue::from_static("key-omitted");
static SHADOW_MISSING: HeaderValue = HeaderValue::from_static("missing-key");

impl<S, K, C, T> Limiter<S, K, C, T>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    /// Decides `req`; the admission of a request decided at once goes straight into its
    /// extensions (when the layer puts admissions there), and the store's decision is read
    /// where the store wrote it (it is 160 bytes: moving it through the verdict costs a
    /// copy per step).
    ///
    /// What an admitted request decided at once was charged goes into `charge`, to be kept
    /// in the response future itself: a box for it would cost an allocation per request.
    pub(crate) fn begin<B>(
        this: &Arc<Self>,
        req: &mut Request<B>,
        charge: &mut Option<Charge>,
    ) -> Begin
    where
        K: KeyExtractor<B>,
        C: RequestCost<B>,
        T: SelectTier<B>,
    {
        // The whole decision runs on the version loaded here, however the limits change
        // meanwhile.
        let version = this.live.current.load();
        // Filled in place: the store key is 104 bytes, a move of it costs a copy.
        let mut check = Check {
            tier: TierRef::Index(0),
            key: StoreKey::new(),
            cost: 0,
            usage: None,
        };
        if let Err(verdict) = this.prepare(&version, req, &mut check) {
            return Begin::Now(this.finish(verdict));
        }
        if this.metering.usage_extension {
            check.usage = Some(crate::usage::shared(req.extensions_mut()));
        }
        // Read before the check, so that it is at or before the moment the store decides.
        let charged_at = if this.settles() {
            this.store.now_us()
        } else {
            0
        };
        if let Some(customers) = &this.customers {
            let tier = check.tier.get(&version);
            let TierRef::Index(index) = check.tier else {
                unreachable!("prepare gives one of the version's tiers")
            };
            let now_us = this.store.now_us();
            match customers.lookup(tier.generation, index, tier.client_key(&check.key), now_us) {
                Lookup::Known(own) => {
                    if let Err(verdict) = this.own_tier(&mut check, &version, own) {
                        return Begin::Now(this.finish(verdict));
                    }
                }
                Lookup::Unknown => {
                    let prefix = tier.prefix.len();
                    let version = arc_swap::Guard::into_inner(version);
                    let client = &check.key[prefix..];
                    let resolve = customers.resolve(
                        &version,
                        index,
                        Arc::clone(&this.namespace_arc),
                        this.failure_policy,
                        client,
                        || this.key.source(client),
                        now_us,
                    );
                    return Begin::Later(Self::check_later(
                        this,
                        version,
                        check,
                        charged_at,
                        Some(Box::pin(resolve)),
                    ));
                }
            }
        }
        let tier = check.tier.get(&version);
        // A key whose fallback usage waits to be handed to the store is handed over first,
        // in the check's future; in the grace after an outage the share is asked there
        // too, around the store's call.
        let pending = (this.handover.as_ref()).is_some_and(|h| h.is_pending(&check.key));
        if pending || this.grace_now().is_some() {
            return Begin::Later(Self::check_later(
                this,
                arc_swap::Guard::into_inner(version),
                check,
                charged_at,
                None,
            ));
        }
        // `Store::check`'s future borrows the key and the rules, so a named response future
        // could only hold it boxed; a store that decides in process answers here instead
        // and the request costs no allocation.
        match this.store.check_sync(&check.key, &tier.rules, check.cost) {
            Some(result) => {
                let charged = this.charged(&result);
                // Decided where the store wrote it: the decision is not moved.
                let result = result.as_ref().map_err(|e| e as &dyn fmt::Display);
                let verdict = this.decided(tier, &check, result, Some(req.extensions_mut()));
                let mut verdict = this.finish(verdict);
                if let Verdict::Pass(pass) = &mut verdict {
                    Self::bind_slot(this, pass, charged, tier, &check);
                    *charge = Self::charge(this, charged, &check, charged_at, || {
                        arc_swap::Guard::into_inner(version)
                    });
                }
                Begin::Now(verdict)
            }
            None => Begin::Later(Self::check_later(
                this,
                arc_swap::Guard::into_inner(version),
                check,
                charged_at,
                None,
            )),
        }
    }

    /// Puts a customer's own tier, if it has one, in the check's place; or the refusal of
    /// a cost above what its rules can grant.
    fn own_tier(&self, check: &mut Check, version: &Version, own: Own) -> Result<(), Verdict> {
        if let Some(own) = own {
            check.tier = TierRef::Own(own);
        }
        let tier = check.tier.get(version);
        if check.cost > tier.min_capacity {
            if let Err(e) = tier.rules.check_cost(check.cost) {
                return Err(self.cost_exceeded(tier, &check.key, &e));
            }
        }
        Ok(())
    }

    /// What an admitted request was charged, when the layer settles charges on the
    /// response (charging by outcome, refusals further in). The check is borrowed: its
    /// store key is copied at its length into the charge rather than moved at its full
    /// inline size.
    fn charge(
        this: &Arc<Self>,
        charged: Charged,
        check: &Check,
        charged_at: u64,
        version: impl FnOnce() -> Arc<Version>,
    ) -> Option<Charge> {
        // A metered request is settled even from an estimate of 0.
        let priced = check.cost > 0 || this.metering.is_on();
        (charged != Charged::No && this.settles() && priced).then(|| Charge {
            settle: Arc::clone(this) as Arc<dyn Settle>,
            version: version(),
            tier: check.tier.clone(),
            key: ChargeKey::from_slice(&check.key),
            cost: check.cost,
            charged_at,
            by_fallback: charged == Charged::Fallback,
            judged: this.charge_when.is_some() || this.metering.is_on(),
            usage: check.usage.clone(),
        })
    }

    /// Binds the slot an admitted request took, if any, to the store that gave it (the
    /// fallback store's rules when it was that one), so that it is released there; keeps
    /// what the fallback admitted, to hand it to the store once it answers.
    fn bind_slot(this: &Arc<Self>, pass: &mut Pass, charged: Charged, tier: &Tier, check: &Check) {
        let by_fallback = charged == Charged::Fallback;
        // Shadow mode passes what the fallback refused: that admitted nothing.
        let refused = pass.fields.as_ref().is_some_and(|f| f.shadow.is_some());
        if by_fallback && !refused && (check.cost > 0 || pass.slot.is_some()) {
            if let Some(fallback_rules) = &tier.fallback_rules {
                let slot = pass.slot.as_ref().map(SlotGuard::slot);
                Self::record_fallback(
                    this,
                    &check.key,
                    &tier.rules,
                    fallback_rules,
                    check.cost,
                    slot,
                );
            }
        }
        let Some(slot) = &mut pass.slot else {
            return;
        };
        slot.bind(
            Arc::clone(this) as Arc<dyn crate::slot::Slots>,
            &check.key,
            tier.rules(by_fallback),
            by_fallback,
        );
    }

    /// Who charges a request on the store's answer `result`, should the layer pass it.
    fn charged<E>(&self, result: &Result<Decision, E>) -> Charged {
        match result {
            Ok(decision) if decision.is_allowed() => Charged::Store,
            Err(_) if self.failure_policy == FailurePolicy::Fallback => Charged::Fallback,
            Ok(_) | Err(_) => Charged::No,
        }
    }

    /// Extracts the key, selects the tier and prices the request, into `check`; or the
    /// verdict that needs no store call (an exemption, a misconfiguration, a cost above
    /// capacity, a denial still in the deny cache).
    fn prepare<B>(
        &self,
        version: &Version,
        req: &Request<B>,
        check: &mut Check,
    ) -> Result<(), Verdict>
    where
        K: KeyExtractor<B>,
        C: RequestCost<B>,
        T: SelectTier<B>,
    {
        let client = match self.key.extract(req) {
            Extraction::Key(key) => key,
            Extraction::Exempt => {
                tracing::trace!("rate limit: exempt request");
                return Err(Verdict::unchecked(
                    AdmittedBy::Exempt,
                    self.admission_extension,
                ));
            }
            Extraction::Omitted(why) => return Err(self.omitted(why)),
            Extraction::Missing(why) => return Err(self.missing(why)),
        };
        let tier_index = self.select_tier(version, req);
        let tier = &version.tiers[tier_index];
        let cost = self.cost.cost(req);
        tier.write_store_key(client.as_ref(), &mut check.key);
        let key = &check.key;
        // A customer's own rules are priced once they are known.
        if cost > tier.min_capacity && self.customers.is_none() {
            if let Err(e) = tier.rules.check_cost(cost) {
                return Err(self.cost_exceeded(tier, key, &e));
            }
        }
        if let Some(verdict) = self.cached_denial(tier, key, cost) {
            return Err(verdict);
        }
        check.tier = TierRef::Index(tier_index);
        check.cost = cost;
        Ok(())
    }

    /// The store's answer for a store that does not decide in process, with the store
    /// timeout, inside a span so that its latency shows in traces.
    fn check_later(
        this: &Arc<Self>,
        version: Arc<Version>,
        mut check: Check,
        charged_at: u64,
        resolve: Option<Pin<Box<dyn Future<Output = Own> + Send>>>,
    ) -> super::CheckFuture {
        let limiter = Arc::clone(this);
        let tier = check.tier.get(&version);
        let span = tracing::debug_span!(
            "ratelimit_check",
            key = %KeyDigest(tier.client_key(&check.key)),
            cost = check.cost
        );
        let future = async move {
            if let Some(resolve) = resolve {
                let own = resolve.await;
                if let Err(verdict) = limiter.own_tier(&mut check, &version, own) {
                    return limiter.finish(verdict);
                }
            }
            let tier = check.tier.get(&version);
            #[cfg(feature = "metrics")]
            let started = std::time::Instant::now();
            // What the fallback admitted for this key goes to the store before the store
            // decides it again; a store that fails that fails the check too.
            let handed = match &limiter.handover {
                Some(h) if h.is_pending(&check.key) => limiter.hand_over_key(&check.key).await,
                _ => Ok(()),
            };
            // In the grace after an outage, the instance's share first (see
            // `fallback_grace`): a request it refuses goes no further.
            let share = match handed {
                Ok(()) => match limiter.grace_share(tier, &check) {
                    Ok(share) => share,
                    Err(verdict) => return limiter.finish(verdict),
                },
                Err(_) => None,
            };
            let result = match handed {
                Err(e) => Err(e),
                Ok(()) => {
                    let call = limiter.store.check(&check.key, &tier.rules, check.cost);
                    match limiter.store_timeout {
                        None => call.await.map_err(|e| e.to_string()),
                        Some(t) => match tokio::time::timeout(t, call).await {
                            Ok(r) => r.map_err(|e| e.to_string()),
                            Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
                        },
                    }
                }
            };
            #[cfg(feature = "metrics")]
            limiter.store_latency.record(started.elapsed(), &result);
            let charged = limiter.charged(&result);
            // What the share took stays only beside an admission of the store's.
            let share = share.and_then(|share| {
                if charged == Charged::Store {
                    Some(share)
                } else {
                    limiter.give_share_back(tier, &check, share);
                    None
                }
            });
            let result = result.as_ref().map_err(|e| e as &dyn fmt::Display);
            let verdict = limiter.decided(tier, &check, result, None);
            let mut verdict = limiter.finish(verdict);
            if let Verdict::Pass(pass) = &mut verdict {
                let paired =
                    share.is_some_and(|s| Self::pair_share_slot(&limiter, pass, tier, &check, s));
                if !paired {
                    Self::bind_slot(&limiter, pass, charged, tier, &check);
                }
                if let Some(charge) =
                    Self::charge(&limiter, charged, &check, charged_at, || version)
                {
                    pass.admission.keep(Box::new(charge));
                }
            }
            verdict
        };
        Box::pin(tracing::Instrument::instrument(future, span))
    }

    // Inlined for the same reason as `finish`.
    #[inline]
    fn decided(
        &self,
        tier: &Tier,
        check: &Check,
        result: Result<&Decision, &dyn fmt::Display>,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        match result {
            Ok(decision) => self.plan(
                tier,
                own(&check.tier),
                &check.key,
                check.cost,
                decision,
                AdmittedBy::Store,
                extensions,
            ),
            Err(error) => self.store_failed(tier, check, error, extensions),
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
        // The fields of the rules that refused: a customer's own, when they did, and the
        // fallback rules, when the fallback store did.
        let tier = hit.own.as_deref().unwrap_or(tier);
        #[cfg(feature = "metrics")]
        tier.metrics.decision(&hit.decision);
        let policy = tier.policy(hit.by_fallback);
        let ratelimit = policy.ratelimit_of(hit.decision.rules(), hit.elapsed);
        Some(self.denial(tier, policy, key, hit.decision, hit.retry_after, ratelimit))
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

    /// Turns the decision of the store `by` names into a verdict. An admitted request's
    /// admission (and the decision, when kept for handlers) goes into `extensions` when
    /// given, else into the verdict. `own` is `tier` when it is a customer's.
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        tier: &Tier,
        own: Option<&Arc<Tier>>,
        key: &[u8],
        cost: u64,
        decision: &Decision,
        by: AdmittedBy,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        #[cfg(feature = "metrics")]
        tier.metrics.decision(decision);
        // The fields describe the rules that decided: while the store fails, the
        // fallback's (an instance's share), not the limit the fleet shares.
        let by_fallback = by == AdmittedBy::Fallback;
        let policy = tier.policy(by_fallback);
        if decision.outcome() == Outcome::Allowed {
            return self.admitted(tier, policy, key, decision, by, extensions);
        }
        // A refusal for want of a slot is not remembered: its retry time is a hint, and a
        // slot released meanwhile admits the next request at once.
        let by_slots = tier
            .rules(by_fallback)
            .concurrent()
            .is_some_and(|at| decision.rules().get(at).is_some_and(|r| !r.allowed));
        if let (Some(cache), false) = (&self.deny_cache, by_slots) {
            cache.insert(
                key,
                tier.generation,
                cost,
                decision,
                own,
                by_fallback,
                self.store.now_us(),
            );
        }
        let ratelimit = policy.ratelimit(decision);
        let retry_after = decision.retry_after();
        self.denial(tier, policy, key, decision.clone(), retry_after, ratelimit)
    }

    fn admitted(
        &self,
        tier: &Tier,
        policy: &Policy,
        key: &[u8],
        decision: &Decision,
        by: AdmittedBy,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        let delay = decision.delay();
        if delay > self.max_delay {
            return self.delay_too_long(tier, policy, key, decision.clone());
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
            policy: policy.header.clone(),
            ratelimit: policy.ratelimit(decision),
            shadow: None,
        });
        let slot = decision.slot().map(SlotGuard::taken);
        let admission = self
            .admission_extension
            .then(|| Admission::decided(by, decision));
        let decision = self.decision_extension.then(|| decision.clone());
        // Shadow mode may yet replace the admission: then it travels in the verdict.
        let admission = match extensions {
            _ if admission.is_none() && decision.is_none() => Admitted::Inserted,
            Some(extensions) if !self.shadow => {
                if let Some(admission) = admission {
                    extensions.insert(admission);
                }
                if let Some(decision) = decision {
                    extensions.insert(decision);
                }
                Admitted::Inserted
            }
            _ => Admitted::Later(Box::new(Deferred {
                admission,
                decision,
                charge: None,
            })),
        };
        Verdict::Pass(Pass {
            // At most `max_delay`, far below `u64::MAX` µs.
            delay_us: delay.as_micros() as u64,
            fields,
            admission,
            slot,
        })
    }

    /// The instance's share of a request in the grace after an outage (see
    /// [`fallback_grace`](crate::RateLimitLayerBuilder::fallback_grace)): what it took
    /// when it admits (`None` out of the grace, or for a cost only the share cannot
    /// hold, which the store decides alone), or the refusal, with the share's fields.
    /// Not remembered by the deny cache: the share binds only until the grace ends.
    fn grace_share(&self, tier: &Tier, check: &Check) -> Result<Option<Share>, Verdict> {
        let Some(at) = self.grace_now() else {
            return Ok(None);
        };
        let (Some(fallback), Some(rules)) = (&self.fallback, &tier.fallback_rules) else {
            return Ok(None);
        };
        match fallback.check_now(&check.key, rules, check.cost) {
            Ok(decision) if decision.is_allowed() => Ok(Some(Share {
                at,
                slot: decision.slot(),
            })),
            Ok(decision) => {
                tracing::debug!(
                    key = %KeyDigest(tier.client_key(&check.key)),
                    "rate limit: refused by the instance's share, in the grace after an outage \
                     (other instances may still be deciding by theirs)"
                );
                #[cfg(feature = "metrics")]
                tier.metrics.decision(&decision);
                let policy = tier.policy(true);
                let ratelimit = policy.ratelimit(&decision);
                let retry_after = decision.retry_after();
                Err(self.denial(tier, policy, &check.key, decision, retry_after, ratelimit))
            }
            Err(_) => Ok(None),
        }
    }

    /// Gives back what the share took for a request the store did not admit.
    fn give_share_back(&self, tier: &Tier, check: &Check, share: Share) {
        let (Some(fallback), Some(rules)) = (&self.fallback, &tier.fallback_rules) else {
            return;
        };
        fallback.refund_now(&check.key, rules, check.cost, share.at);
        if let Some(slot) = share.slot {
            fallback.release_now(&check.key, slot);
        }
    }

    /// Makes the request's slot the share's, paired with the store's (which is not bound
    /// yet): the request then releases both, and renews the store's (as a slot handed
    /// over after an outage). Answers whether it did; a share's slot without the store's
    /// goes back at once.
    fn pair_share_slot(
        this: &Arc<Self>,
        pass: &mut Pass,
        tier: &Tier,
        check: &Check,
        share: Share,
    ) -> bool {
        let (Some(local), Some(handover), Some(rules), Some(fallback)) = (
            share.slot,
            &this.handover,
            &tier.fallback_rules,
            &this.fallback,
        ) else {
            return false;
        };
        let Some(store) = pass.slot.as_ref().map(SlotGuard::slot) else {
            fallback.release_now(&check.key, local);
            return false;
        };
        handover.pair(&check.key, local, store);
        // The store's guard, not bound, releases nothing as it drops.
        let mut guard = SlotGuard::taken(local);
        guard.bind(
            Arc::clone(this) as Arc<dyn crate::slot::Slots>,
            &check.key,
            rules,
            true,
        );
        pass.slot = Some(guard);
        true
    }

    fn store_failed(
        &self,
        tier: &Tier,
        check: &Check,
        error: &dyn fmt::Display,
        extensions: Option<&mut Extensions>,
    ) -> Verdict {
        let (key, cost) = (&check.key, check.cost);
        self.report_store_failure(tier, key, error);
        match self.failure_policy {
            FailurePolicy::FailOpen => {
                Verdict::unchecked(AdmittedBy::FailOpen, self.admission_extension)
            }
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
                let now = self.store.now_us();
                self.last_fallback_us.store(now.max(1), Ordering::Relaxed);
                match fallback.check_now(key, rules, cost) {
                    Ok(decision) => self.plan(
                        tier,
                        own(&check.tier),
                        key,
                        cost,
                        &decision,
                        AdmittedBy::Fallback,
                        extensions,
                    ),
                    // The tier's rules priced the request before the store was asked: a
                    // cost only its share cannot hold waits for the store, not forever.
                    Err(e) => self.share_exceeded(tier, rules, key, &e),
                }
            }
        }
    }

    /// Counts a store failure and logs it at a bounded rate.
    fn report_store_failure(&self, tier: &Tier, key: &[u8], error: &dyn fmt::Display) {
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
                %error,
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
            return Verdict::unchecked(AdmittedBy::MissingKey, self.admission_extension);
        }
        self.missing_key(why)
    }

    /// Applies shadow mode: the one place where a refusal or a delay becomes a pass.
    /// Inlined, with shadow mode out of line: the verdict is then built in its final
    /// place instead of being copied out of a call (about 100 instructions a request).
    #[inline]
    fn finish(&self, verdict: Verdict) -> Verdict {
        if self.shadow {
            self.shadowed(verdict)
        } else {
            verdict
        }
    }

    #[inline(never)]
    fn shadowed(&self, verdict: Verdict) -> Verdict {
        let (label, binding) = match verdict {
            // Admitted anyway: nothing to report, and no rate-limit fields in shadow mode.
            Verdict::Pass(pass) if pass.delay_us == 0 => {
                return Verdict::Pass(Pass {
                    fields: None,
                    ..pass
                });
            }
            Verdict::Pass(pass) => (&SHADOW_DELAYED, pass.admission.binding()),
            Verdict::Refuse(refusal) => {
                let rejection = &refusal.rejection;
                let label = match rejection.reason {
                    RejectReason::Limited => &SHADOW_LIMITED,
                    RejectReason::Blocked => &SHADOW_BLOCKED,
                    RejectReason::DelayTooLong => &SHADOW_DELAYED,
                    RejectReason::CostExceedsCapacity { .. } => &SHADOW_COST,
                    RejectReason::StoreUnavailable | RejectReason::CostExceedsShare { .. } => {
                        &SHADOW_STORE
                    }
                    RejectReason::KeyOmitted => &SHADOW_OMITTED,
                    RejectReason::MissingKey => &SHADOW_MISSING,
                };
                (label, rejection.decision.as_ref().and_then(Binding::of))
            }
        };
        tracing::info!(
            verdict = label.to_str().unwrap_or_default(),
            namespace = &*self.namespace,
            "rate limit (shadow mode): would have refused or delayed; passing"
        );
        Verdict::Pass(Pass {
            delay_us: 0,
            fields: Some(Fields {
                shadow: Some(label),
                ..Fields::default()
            }),
            admission: if self.admission_extension {
                Admitted::Later(Box::new(Deferred {
                    admission: Some(Admission::unchecked(AdmittedBy::Shadow, binding)),
                    decision: None,
                    charge: None,
                }))
            } else {
                Admitted::Inserted
            },
            slot: None,
        })
    }
}

/// The customer's own tier a check is decided under, if any.
fn own(tier: &TierRef) -> Option<&Arc<Tier>> {
    match tier {
        TierRef::Own(own) => Some(own),
        TierRef::Index(_) => None,
    }
}
