use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use ratelimit_core::{ConfigError, MemoryStore, Rule, RuleSet, Store};
use tower_layer::Layer;

use crate::cost::UnitCost;
use crate::deny_cache::{DenyCache, DenyCacheConfig};
use crate::headers::{policy_names, policy_value};
use crate::metrics::Metrics;
use crate::policy::FailurePolicy;
use crate::rejection::{BlockedStatus, DefaultRejection};
use crate::service::RateLimit;

/// Applies [`RateLimit`] to a service: see the [crate docs](crate).
///
/// Cheap to clone: clones share the store, the rules and the deny cache.
pub struct RateLimitLayer<S, K, C = UnitCost, R = DefaultRejection> {
    pub(crate) shared: Arc<Shared<S, K, C, R>>,
}

impl<S, K, C, R> Clone for RateLimitLayer<S, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K, C, R> fmt::Debug for RateLimitLayer<S, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rules", &self.shared.rules.id())
            .field("failure_policy", &self.shared.failure_policy)
            .field("shadow", &self.shared.shadow)
            .finish_non_exhaustive()
    }
}

impl<S: Store, K> RateLimitLayer<S, K> {
    /// Starts a layer deciding with `store`, keying requests with `key` (a
    /// [`KeyExtractor`](crate::KeyExtractor)). Add at least one rule, then
    /// [`build`](RateLimitLayerBuilder::build).
    pub fn builder(store: S, key: K) -> RateLimitLayerBuilder<S, K> {
        RateLimitLayerBuilder {
            store,
            key,
            cost: UnitCost,
            on_rejection: DefaultRejection,
            rules: Vec::new(),
            failure_policy: FailurePolicy::default(),
            blocked_status: BlockedStatus::default(),
            admitted_headers: true,
            shadow: false,
            max_delay: DEFAULT_MAX_DELAY,
            deny_cache: Some(DenyCacheConfig::default()),
            store_timeout: None,
        }
    }
}

impl<S, K, C, R> RateLimitLayer<S, K, C, R> {
    /// The store the layer decides with (to block or unblock keys, for instance).
    pub fn store(&self) -> &S {
        &self.shared.store
    }

    /// The rules every request is checked against.
    pub fn rules(&self) -> &RuleSet {
        &self.shared.rules
    }
}

impl<Svc, S, K, C, R> Layer<Svc> for RateLimitLayer<S, K, C, R> {
    type Service = RateLimit<Svc, S, K, C, R>;

    fn layer(&self, inner: Svc) -> Self::Service {
        RateLimit::from_shared(inner, Arc::clone(&self.shared))
    }
}

/// The longest a shaping rule may delay a request unless configured otherwise.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(10);

/// Configures a [`RateLimitLayer`]; made by [`RateLimitLayer::builder`].
///
/// ```
/// use ratelimit_core::{MemoryStore, Rule};
/// use ratelimit_tower::{FailurePolicy, PeerIp, RateLimitLayer};
/// use std::time::Duration;
///
/// let layer = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new())
///     .rules("1/s; 5/min")?
///     .rule(Rule::sliding_window(100, Duration::from_secs(3600), 6)?.named("hourly")?)
///     .failure_policy(FailurePolicy::Fallback)
///     .build()?;
/// assert_eq!(layer.rules().len(), 3);
///
/// // Nothing to enforce is a configuration error, not a layer that admits everything.
/// let err = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new()).build().unwrap_err();
/// assert!(err.to_string().contains("at least one rule"));
/// # Ok::<(), ratelimit_core::ConfigError>(())
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct RateLimitLayerBuilder<S, K, C = UnitCost, R = DefaultRejection> {
    store: S,
    key: K,
    cost: C,
    on_rejection: R,
    rules: Vec<Rule>,
    failure_policy: FailurePolicy,
    blocked_status: BlockedStatus,
    admitted_headers: bool,
    shadow: bool,
    max_delay: Duration,
    deny_cache: Option<DenyCacheConfig>,
    store_timeout: Option<Duration>,
}

impl<S, K, C, R> fmt::Debug for RateLimitLayerBuilder<S, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("rules", &self.rules)
            .field("failure_policy", &self.failure_policy)
            .finish_non_exhaustive()
    }
}

impl<S: Store, K, C, R> RateLimitLayerBuilder<S, K, C, R> {
    /// Adds a rule. All rules of a layer are decided together on the request's key: it
    /// is admitted only if every rule admits it.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds the rules of `text`, e.g. `"1/s; 5/min"` (see [`RuleSet`]'s syntax); fails
    /// with the parser's explanation.
    pub fn rules(mut self, text: &str) -> Result<Self, ConfigError> {
        let set: RuleSet = text.parse()?;
        self.rules.extend(set.rules().iter().cloned());
        Ok(self)
    }

    /// Adds the rules of `set`.
    pub fn rule_set(mut self, set: &RuleSet) -> Self {
        self.rules.extend(set.rules().iter().cloned());
        self
    }

    /// Charges each request `cost` units (a [`RequestCost`](crate::RequestCost), e.g. a
    /// closure over the request) instead of 1.
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayerBuilder<S, K, C2, R> {
        RateLimitLayerBuilder {
            store: self.store,
            key: self.key,
            cost,
            on_rejection: self.on_rejection,
            rules: self.rules,
            failure_policy: self.failure_policy,
            blocked_status: self.blocked_status,
            admitted_headers: self.admitted_headers,
            shadow: self.shadow,
            max_delay: self.max_delay,
            deny_cache: self.deny_cache,
            store_timeout: self.store_timeout,
        }
    }

    /// Builds refusal responses with `hook` (an [`OnRejection`](crate::OnRejection))
    /// instead of an empty body. The layer still sets the status and the rate-limit
    /// fields.
    pub fn on_rejection<R2>(self, hook: R2) -> RateLimitLayerBuilder<S, K, C, R2> {
        RateLimitLayerBuilder {
            store: self.store,
            key: self.key,
            cost: self.cost,
            on_rejection: hook,
            rules: self.rules,
            failure_policy: self.failure_policy,
            blocked_status: self.blocked_status,
            admitted_headers: self.admitted_headers,
            shadow: self.shadow,
            max_delay: self.max_delay,
            deny_cache: self.deny_cache,
            store_timeout: self.store_timeout,
        }
    }

    /// What to do when the store fails ([`FailurePolicy::FailOpen`] by default).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// The status for blocked keys (429 by default).
    pub fn blocked_status(mut self, status: BlockedStatus) -> Self {
        self.blocked_status = status;
        self
    }

    /// Whether admitted responses carry `RateLimit-Policy` and `RateLimit` (they do by
    /// default; refusals always do).
    pub fn admitted_headers(mut self, enabled: bool) -> Self {
        self.admitted_headers = enabled;
        self
    }

    /// Shadow mode: decide, count and report, but never refuse or delay. A request that
    /// would have been refused or delayed passes with a `RateLimit-Shadow` field
    /// (`limited`, `blocked`, `delayed`, `cost-exceeded`, `store-unavailable`) and an
    /// `INFO` event; no other rate-limit field is sent. For trying new limits on real
    /// traffic before enforcing them.
    pub fn shadow(mut self, enabled: bool) -> Self {
        self.shadow = enabled;
        self
    }

    /// The longest a shaping rule may delay a request (10 s by default). A request the
    /// store admits later than that is answered 429 instead; its place in the queue
    /// stays consumed.
    pub fn max_delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// Configures the local deny cache (on by default, see [`DenyCacheConfig`]): a key
    /// denied with retry time T is answered in process, without a store call, until T
    /// has passed. A request of lower cost than the denied one still asks the store.
    pub fn deny_cache(mut self, config: DenyCacheConfig) -> Self {
        self.deny_cache = Some(config);
        self
    }

    /// Asks the store about every request, denied keys included.
    pub fn without_deny_cache(mut self) -> Self {
        self.deny_cache = None;
        self
    }

    /// Gives up on a store call after `timeout` and applies the failure policy. Stores
    /// with a timeout of their own (such as the Redis store) need none.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = Some(timeout);
        self
    }

    /// The layer; fails when there is no rule or more than the core accepts in one set.
    pub fn build(self) -> Result<RateLimitLayer<S, K, C, R>, ConfigError> {
        let rules = RuleSet::new(self.rules)?;
        let names = policy_names(&rules);
        let shared = Shared {
            policy_header: policy_value(&rules, &names),
            metrics: Metrics::new(&names, self.failure_policy),
            names,
            fallback: (self.failure_policy == FailurePolicy::Fallback).then(MemoryStore::new),
            store: self.store,
            key: self.key,
            cost: self.cost,
            on_rejection: self.on_rejection,
            rules,
            failure_policy: self.failure_policy,
            blocked_status: self.blocked_status,
            admitted_headers: self.admitted_headers,
            shadow: self.shadow,
            max_delay: self.max_delay,
            deny_cache: self.deny_cache.map(DenyCache::new),
            store_timeout: self.store_timeout,
        };
        Ok(RateLimitLayer {
            shared: Arc::new(shared),
        })
    }
}

/// Everything a layer's services share.
pub(crate) struct Shared<S, K, C, R> {
    pub(crate) store: S,
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) on_rejection: R,
    pub(crate) rules: RuleSet,
    pub(crate) names: Vec<String>,
    pub(crate) policy_header: HeaderValue,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) fallback: Option<MemoryStore>,
    pub(crate) blocked_status: BlockedStatus,
    pub(crate) admitted_headers: bool,
    pub(crate) shadow: bool,
    pub(crate) max_delay: Duration,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) store_timeout: Option<Duration>,
    pub(crate) metrics: Metrics,
}
