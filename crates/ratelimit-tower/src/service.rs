use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use ratelimit_core::{CapacityError, Decision, Outcome, Store};
use tower_service::Service;

use crate::cost::RequestCost;
use crate::deny_cache::Hit;
use crate::future::ResponseFuture;
use crate::headers::{
    ratelimit_value, ratelimit_value_of, retry_after_value, RATELIMIT, RATELIMIT_POLICY,
};
use crate::key::{KeyDisplay, KeyExtractor};
use crate::layer::Shared;
use crate::policy::FailurePolicy;
use crate::rejection::{OnRejection, RejectReason, Rejection};

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// `poll_ready` is the inner service's; a refusal is a response (429, 403, 413 or 503),
/// never an error, so `Error` is the inner service's error.
pub struct RateLimit<Svc, S, K, C, R> {
    inner: Svc,
    shared: Arc<Shared<S, K, C, R>>,
}

impl<Svc, S, K, C, R> RateLimit<Svc, S, K, C, R> {
    pub(crate) fn from_shared(inner: Svc, shared: Arc<Shared<S, K, C, R>>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &Svc {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut Svc {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> Svc {
        self.inner
    }
}

impl<Svc: Clone, S, K, C, R> Clone for RateLimit<Svc, S, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<Svc: fmt::Debug, S, K, C, R> fmt::Debug for RateLimit<Svc, S, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.shared.rules.id())
            .finish_non_exhaustive()
    }
}

impl<Svc, S, K, C, R, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<Svc, S, K, C, R>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    S: Store,
    K: KeyExtractor<ReqBody>,
    C: RequestCost<ReqBody>,
    R: OnRejection<ResBody>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Svc::Error;
    type Future = ResponseFuture<Svc, ReqBody, ResBody>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let Some(key) = self.shared.key.extract(&req) else {
            return ResponseFuture::called(self.inner.call(req), None);
        };
        let cost = self.shared.cost.cost(&req);
        match Shared::begin(&self.shared, key, cost) {
            // Decided at once and nothing to wait for: the ready service is called here,
            // without cloning it.
            Begin::Decided(Plan::Forward { delay, headers }) if delay.is_zero() => {
                ResponseFuture::called(self.inner.call(req), headers)
            }
            Begin::Decided(Plan::Forward { delay, headers }) => {
                ResponseFuture::delayed(self.take_ready(), req, delay, headers)
            }
            Begin::Decided(Plan::Reply(response)) => ResponseFuture::reply(response),
            Begin::Checking(check) => ResponseFuture::checking(check, self.take_ready(), req),
        }
    }
}

impl<Svc: Clone, S, K, C, R> RateLimit<Svc, S, K, C, R> {
    /// The service that was polled ready, to be called later from the future; a fresh
    /// clone takes its place.
    fn take_ready(&mut self) -> Svc {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

/// Fields added to the inner service's response.
#[derive(Debug, Default)]
pub(crate) struct AddHeaders {
    pub(crate) policy: Option<HeaderValue>,
    pub(crate) ratelimit: Option<HeaderValue>,
    pub(crate) shadow: Option<HeaderValue>,
}

impl AddHeaders {
    pub(crate) fn apply<B>(self, response: &mut Response<B>) {
        let headers = response.headers_mut();
        // Appended, not inserted: a stacked layer further in adds its own policies.
        if let Some(v) = self.policy {
            headers.append(&RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.ratelimit {
            headers.append(&RATELIMIT, v);
        }
        if let Some(v) = self.shadow {
            headers.append(&crate::headers::RATELIMIT_SHADOW, v);
        }
    }
}

/// What becomes of a request once decided.
pub(crate) enum Plan<ResBody> {
    /// Call the inner service after `delay`, adding `headers` to its response.
    Forward {
        delay: Duration,
        headers: Option<AddHeaders>,
    },
    /// Answer without calling the inner service.
    Reply(Response<ResBody>),
}

pub(crate) type CheckFuture<ResBody> = Pin<Box<dyn Future<Output = Plan<ResBody>> + Send>>;

pub(crate) enum Begin<ResBody> {
    Decided(Plan<ResBody>),
    Checking(CheckFuture<ResBody>),
}

const SHADOW_LIMITED: HeaderValue = HeaderValue::from_static("limited");
const SHADOW_BLOCKED: HeaderValue = HeaderValue::from_static("blocked");
const SHADOW_DELAYED: HeaderValue = HeaderValue::from_static("delayed");
const SHADOW_COST: HeaderValue = HeaderValue::from_static("cost-exceeded");
const SHADOW_STORE: HeaderValue = HeaderValue::from_static("store-unavailable");

impl<S, K, C, R> Shared<S, K, C, R>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
{
    pub(crate) fn begin<Key, ResBody>(this: &Arc<Self>, key: Key, cost: u64) -> Begin<ResBody>
    where
        Key: AsRef<[u8]> + Send + Sync + 'static,
        R: OnRejection<ResBody>,
        ResBody: Send + 'static,
    {
        let k = key.as_ref();
        if let Err(e) = this.rules.check_cost(cost) {
            return Begin::Decided(this.cost_exceeded(k, &e));
        }
        if let Some(hit) = this.deny_cache.as_ref().and_then(|c| c.get(k, cost)) {
            return Begin::Decided(this.cached_denial(k, hit));
        }
        // `Store::check`'s future borrows the key and the rules, so a named response future
        // could only hold it boxed; a store that decides in process (MemoryStore, whatever
        // its clock) answers here instead and the request costs no allocation.
        if let Some(result) = this.store.check_sync(k, &this.rules, cost) {
            return Begin::Decided(match result {
                Ok(decision) => this.plan(k, cost, decision),
                Err(error) => this.store_failed(k, cost, &error.to_string()),
            });
        }
        let shared = Arc::clone(this);
        // A span around the store round trip, so that its latency shows in traces.
        let span = tracing::debug_span!("ratelimit_check", key = %KeyDisplay(k), cost);
        let check = async move {
            let k = key.as_ref();
            let check = shared.store.check(k, &shared.rules, cost);
            let result = match shared.store_timeout {
                None => check.await.map_err(|e| e.to_string()),
                Some(t) => match tokio::time::timeout(t, check).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
                },
            };
            match result {
                Ok(decision) => shared.plan(k, cost, decision),
                Err(error) => shared.store_failed(k, cost, &error),
            }
        };
        Begin::Checking(Box::pin(tracing::Instrument::instrument(check, span)))
    }

    /// Turns the store's decision into a plan.
    fn plan<ResBody>(&self, key: &[u8], cost: u64, decision: Decision) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        self.metrics.decision(&decision);
        match decision.outcome() {
            Outcome::Allowed => {
                let delay = decision.delay();
                if delay > self.max_delay {
                    tracing::debug!(
                        key = %KeyDisplay(key),
                        delay_ms = delay.as_millis() as u64,
                        max_delay_ms = self.max_delay.as_millis() as u64,
                        "rate limit: shaping delay above the maximum; refusing"
                    );
                    if self.shadow {
                        return self.shadow_pass(key, SHADOW_DELAYED);
                    }
                    let ratelimit = ratelimit_value(&decision, &self.names);
                    return self.reject(
                        RejectReason::DelayTooLong,
                        StatusCode::TOO_MANY_REQUESTS,
                        Some(delay),
                        Some(decision),
                        ratelimit,
                    );
                }
                if self.shadow {
                    if delay.is_zero() {
                        return Plan::Forward {
                            delay: Duration::ZERO,
                            headers: None,
                        };
                    }
                    return self.shadow_pass(key, SHADOW_DELAYED);
                }
                if !delay.is_zero() {
                    tracing::debug!(
                        key = %KeyDisplay(key),
                        delay_ms = delay.as_millis() as u64,
                        "rate limit: delaying request"
                    );
                } else {
                    tracing::trace!(key = %KeyDisplay(key), "rate limit: admitted");
                }
                let headers = self.admitted_headers.then(|| AddHeaders {
                    policy: Some(self.policy_header.clone()),
                    ratelimit: ratelimit_value(&decision, &self.names),
                    shadow: None,
                });
                Plan::Forward { delay, headers }
            }
            Outcome::Limited | Outcome::Blocked => {
                if let Some(cache) = &self.deny_cache {
                    cache.insert(key, cost, &decision);
                }
                let ratelimit = ratelimit_value(&decision, &self.names);
                let retry_after = decision.retry_after();
                self.denial(key, decision, retry_after, ratelimit)
            }
        }
    }

    fn cached_denial<ResBody>(&self, key: &[u8], hit: Hit) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        tracing::trace!(key = %KeyDisplay(key), "rate limit: denied from the local deny cache");
        self.metrics.decision(&hit.decision);
        let ratelimit = ratelimit_value_of(hit.decision.rules(), &self.names, hit.elapsed);
        self.denial(key, hit.decision, hit.retry_after, ratelimit)
    }

    fn denial<ResBody>(
        &self,
        key: &[u8],
        decision: Decision,
        retry_after: Option<Duration>,
        ratelimit: Option<HeaderValue>,
    ) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        let blocked = decision.outcome() == Outcome::Blocked;
        tracing::debug!(
            key = %KeyDisplay(key),
            outcome = if blocked { "blocked" } else { "limited" },
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            "rate limit: refusing request"
        );
        if self.shadow {
            return self.shadow_pass(
                key,
                if blocked {
                    SHADOW_BLOCKED
                } else {
                    SHADOW_LIMITED
                },
            );
        }
        let (reason, status) = if blocked {
            (RejectReason::Blocked, self.blocked_status.status())
        } else {
            (RejectReason::Limited, StatusCode::TOO_MANY_REQUESTS)
        };
        self.reject(reason, status, retry_after, Some(decision), ratelimit)
    }

    fn cost_exceeded<ResBody>(&self, key: &[u8], e: &CapacityError) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        tracing::debug!(key = %KeyDisplay(key), error = %e, "rate limit: cost above capacity");
        if self.shadow {
            return self.shadow_pass(key, SHADOW_COST);
        }
        let reason = RejectReason::CostExceedsCapacity {
            cost: e.cost,
            capacity: e.capacity,
        };
        self.reject(reason, StatusCode::PAYLOAD_TOO_LARGE, None, None, None)
    }

    fn store_failed<ResBody>(&self, key: &[u8], cost: u64, error: &str) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        self.metrics.store_error();
        let policy = self.failure_policy.label();
        match self.failure_policy {
            FailurePolicy::FailOpen => {
                tracing::warn!(policy, error, key = %KeyDisplay(key), "rate-limit store failed; admitting the request unchecked");
                Plan::Forward {
                    delay: Duration::ZERO,
                    headers: None,
                }
            }
            FailurePolicy::FailClosed => {
                tracing::warn!(policy, error, key = %KeyDisplay(key), "rate-limit store failed; refusing the request with 503");
                if self.shadow {
                    return self.shadow_pass(key, SHADOW_STORE);
                }
                self.reject(
                    RejectReason::StoreUnavailable,
                    StatusCode::SERVICE_UNAVAILABLE,
                    None,
                    None,
                    None,
                )
            }
            FailurePolicy::Fallback => {
                tracing::warn!(policy, error, key = %KeyDisplay(key), "rate-limit store failed; deciding with the local fallback store");
                let fallback = self
                    .fallback
                    .as_ref()
                    .expect("built with the fallback policy");
                match fallback.check_now(key, &self.rules, cost) {
                    Ok(decision) => self.plan(key, cost, decision),
                    Err(e) => self.cost_exceeded(key, &e),
                }
            }
        }
    }

    fn shadow_pass<ResBody>(&self, key: &[u8], verdict: HeaderValue) -> Plan<ResBody> {
        tracing::info!(
            key = %KeyDisplay(key),
            verdict = verdict.to_str().unwrap_or_default(),
            rules = self.rules.id(),
            "rate limit (shadow mode): would have refused or delayed; passing"
        );
        Plan::Forward {
            delay: Duration::ZERO,
            headers: Some(AddHeaders {
                shadow: Some(verdict),
                ..AddHeaders::default()
            }),
        }
    }

    fn reject<ResBody>(
        &self,
        reason: RejectReason,
        status: StatusCode,
        retry_after: Option<Duration>,
        decision: Option<Decision>,
        ratelimit: Option<HeaderValue>,
    ) -> Plan<ResBody>
    where
        R: OnRejection<ResBody>,
    {
        let rejection = Rejection {
            reason,
            status,
            retry_after,
            decision,
        };
        let mut response = self.on_rejection.rejection(&rejection);
        *response.status_mut() = status;
        let headers = response.headers_mut();
        if let Some(retry) = retry_after {
            headers.insert(RETRY_AFTER, retry_after_value(retry));
        }
        if reason != RejectReason::StoreUnavailable {
            headers.append(&RATELIMIT_POLICY, self.policy_header.clone());
        }
        if let Some(v) = ratelimit {
            headers.append(&RATELIMIT, v);
        }
        Plan::Reply(response)
    }
}
