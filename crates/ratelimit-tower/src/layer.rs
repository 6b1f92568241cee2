use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::panic::Location;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use ratelimit_core::util::BoundedLog;
use ratelimit_core::{ConfigError, Rule, RuleSet, Store};
use tower_layer::Layer;

use crate::cost::UnitCost;
use crate::customer::{self, Customers, Resolver, DEFAULT_CUSTOMER_CACHE, DEFAULT_CUSTOMER_TTL};
use crate::deny_cache::{DenyCache, DenyCacheConfig};
use crate::error::BuildError;
use crate::fallback::{fallback_store, FallbackRules};
use crate::limiter::{ChargeWhen, Handover, Limiter};
use crate::limits::{Limits, LimitsHandle, Live, Settings};
use crate::meter::Metering;
use crate::metrics::DEFAULT_METRICS_TIER_LABELS;
use crate::namespace;
use crate::policy::{FailurePolicy, MissingKey};
use crate::rejection::{BlockedStatus, OnRejection, PlainText};
use crate::service::RateLimit;
use crate::tier::OneTier;

/// Applies [`RateLimit`] to a service: see the [crate docs](crate).
///
/// Cheap to clone: clones share the store, the rules, the budgets and the deny cache.
pub struct RateLimitLayer<S, K, C = UnitCost, T = OneTier> {
    limiter: Arc<Limiter<S, K, C, T>>,
}

impl<S, K, C, T> Clone for RateLimitLayer<S, K, C, T> {
    fn clone(&self) -> Self {
        Self {
            limiter: Arc::clone(&self.limiter),
        }
    }
}

impl<S, K, C, T> fmt::Debug for RateLimitLayer<S, K, C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("namespace", &self.limiter.namespace)
            .field("limits", &self.limiter.live.current.load().limits)
            .field("failure_policy", &self.limiter.failure_policy)
            .field("shadow", &self.limiter.shadow)
            .finish_non_exhaustive()
    }
}

impl<S: Store, K> RateLimitLayer<S, K> {
    /// A layer deciding every request with `store`, keyed by `key` (a
    /// [`KeyExtractor`](crate::key::KeyExtractor)), against `rules`, with every default:
    /// fail open, a 429 with a plain-text body, admitted fields on, the deny cache on,
    /// requests without a key refused with 500, and a budget of its own (see
    /// [namespaces](crate#budgets-and-namespaces)).
    ///
    /// ```
    /// use ratelimit_core::MemoryStore;
    /// use ratelimit_tower::{PeerIp, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), "10/min".parse()?);
    /// # let _ = layer;
    /// # Ok::<(), ratelimit_core::ConfigError>(())
    /// ```
    #[track_caller]
    pub fn new(store: S, key: K, rules: RuleSet) -> Self {
        let location = Location::caller();
        let mut builder = Self::builder(store, key).rule_set(rules);
        builder.location = location;
        builder
            .build()
            .expect("a valid rule set and the defaults always build")
    }

    /// Starts a layer deciding with `store`, keying requests with `key` (a
    /// [`KeyExtractor`](crate::key::KeyExtractor)). Add at least one rule, then
    /// [`build`](RateLimitLayerBuilder::build).
    #[track_caller]
    pub fn builder(store: S, key: K) -> RateLimitLayerBuilder<S, K> {
        RateLimitLayerBuilder {
            store,
            key,
            cost: UnitCost,
            select: OneTier,
            selector_set: false,
            rules: Vec::new(),
            tiers: Vec::new(),
            default_tier: None,
            namespace: None,
            location: Location::caller(),
            on_rejection: Arc::new(PlainText),
            failure_policy: FailurePolicy::default(),
            fallback: FallbackRules::Same,
            handover: true,
            fallback_grace: DEFAULT_FALLBACK_GRACE,
            omitted_key_status: StatusCode::BAD_REQUEST,
            missing_key: MissingKey::default(),
            blocked_status: BlockedStatus::default(),
            admitted_headers: true,
            admission_extension: false,
            decision_extension: false,
            shadow: false,
            max_delay: DEFAULT_MAX_DELAY,
            deny_cache: Some(DenyCacheConfig::default()),
            store_timeout: None,
            charge_when: None,
            refund_refused: true,
            metering: Metering::default(),
            resolver: None,
            customer_cache: (DEFAULT_CUSTOMER_CACHE, DEFAULT_CUSTOMER_TTL),
            metrics_tier_labels: DEFAULT_METRICS_TIER_LABELS,
        }
    }
}

impl<S: Store, K, C, T> RateLimitLayer<S, K, C, T> {
    /// The store the layer decides with.
    pub fn store(&self) -> &S {
        &self.limiter.store
    }

    /// The rules in force for the default tier.
    pub fn rules(&self) -> RuleSet {
        let version = self.limiter.live.current.load();
        version.tiers[version.default_tier].rules.clone()
    }

    /// The rules in force for the tier `name` (`""` is the tier of
    /// [`rules`](RateLimitLayerBuilder::rules)).
    pub fn tier_rules(&self, name: &str) -> Option<RuleSet> {
        self.limiter
            .live
            .current
            .load()
            .limits
            .tier_rules(name)
            .cloned()
    }

    /// A handle that replaces this layer's rules and tiers while it runs (see
    /// [Changing limits](crate#changing-limits)). Every clone of the layer, and every
    /// service made from one, sees the replacement.
    pub fn limits(&self) -> LimitsHandle {
        LimitsHandle {
            live: Arc::clone(&self.limiter.live),
        }
    }

    /// The namespace that sets this layer's budgets apart (see
    /// [namespaces](crate#budgets-and-namespaces)).
    pub fn namespace(&self) -> &str {
        &self.limiter.namespace
    }

    /// The key `client` is held under in the store for the tier `tier` (`""` for the
    /// tier of [`rules`](RateLimitLayerBuilder::rules)), to find it with `redis-cli`, say.
    pub fn store_key(&self, tier: &str, client: &[u8]) -> Option<Vec<u8>> {
        let version = self.limiter.live.current.load();
        let tier = version.tiers.iter().find(|t| &*t.name == tier)?;
        Some(tier.store_key(client).to_vec())
    }

    /// Blocks the client key `client` (as the key extractor gives it, e.g.
    /// `b"203.0.113.9"`) in every tier of this layer, for `duration` or until
    /// [`unblock`](Self::unblock). Layers with other namespaces are not affected.
    pub async fn block(&self, client: &[u8], duration: Option<Duration>) -> Result<(), S::Error> {
        let version = self.limiter.live.current.load_full();
        for tier in version.tiers.iter() {
            self.limiter
                .store
                .block(&tier.store_key(client), duration)
                .await?;
        }
        Ok(())
    }

    /// Lifts a block of `client` in every tier of this layer. Requests denied in the
    /// last moments may still be answered from the deny cache until their entry expires
    /// (at most [`DenyCacheConfig::max_ttl`]).
    pub async fn unblock(&self, client: &[u8]) -> Result<(), S::Error> {
        let version = self.limiter.live.current.load_full();
        for tier in version.tiers.iter() {
            self.limiter.store.unblock(&tier.store_key(client)).await?;
        }
        Ok(())
    }

    /// Forgets what `client` consumed in every tier of this layer.
    pub async fn reset(&self, client: &[u8]) -> Result<(), S::Error> {
        let version = self.limiter.live.current.load_full();
        for tier in version.tiers.iter() {
            self.limiter
                .store
                .reset(&tier.store_key(client), &tier.rules)
                .await?;
        }
        Ok(())
    }
}

impl<Svc, S, K, C, T> Layer<Svc> for RateLimitLayer<S, K, C, T> {
    type Service = RateLimit<Svc, S, K, C, T>;

    fn layer(&self, inner: Svc) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter))
    }
}

/// The longest a shaping rule may delay a request unless configured otherwise.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(10);

/// How long after an instance last decided by its fallback its store admissions must also
/// fit its share ([`RateLimitLayerBuilder::fallback_grace`]): 1 s, well above the spread
/// of a fleet's returns from an outage under traffic (`RedisStore` reconnects at most
/// 250 ms apart while requests ask for it).
pub const DEFAULT_FALLBACK_GRACE: Duration = Duration::from_secs(1);

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
///     .namespace("api")
///     .failure_policy(FailurePolicy::Fallback)
///     .build()?;
/// assert_eq!(layer.rules().len(), 3);
///
/// // Nothing to enforce is a configuration error, not a layer that admits everything.
/// let err = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new()).build().unwrap_err();
/// assert!(err.to_string().contains("at least one rule"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct RateLimitLayerBuilder<S, K, C = UnitCost, T = OneTier> {
    store: S,
    key: K,
    cost: C,
    select: T,
    selector_set: bool,
    rules: Vec<Rule>,
    tiers: Vec<(String, RuleSet)>,
    default_tier: Option<String>,
    namespace: Option<String>,
    location: &'static Location<'static>,
    on_rejection: Arc<dyn OnRejection>,
    failure_policy: FailurePolicy,
    fallback: FallbackRules,
    handover: bool,
    fallback_grace: Duration,
    omitted_key_status: StatusCode,
    missing_key: MissingKey,
    blocked_status: BlockedStatus,
    admitted_headers: bool,
    admission_extension: bool,
    decision_extension: bool,
    shadow: bool,
    max_delay: Duration,
    deny_cache: Option<DenyCacheConfig>,
    store_timeout: Option<Duration>,
    charge_when: Option<ChargeWhen>,
    refund_refused: bool,
    metering: Metering,
    resolver: Option<Resolver>,
    customer_cache: (u64, Duration),
    metrics_tier_labels: usize,
}

impl<S, K, C, T> fmt::Debug for RateLimitLayerBuilder<S, K, C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("rules", &self.rules)
            .field("tiers", &self.tiers)
            .field("namespace", &self.namespace)
            .field("failure_policy", &self.failure_policy)
            .finish_non_exhaustive()
    }
}

impl<S: Store, K, C, T> RateLimitLayerBuilder<S, K, C, T> {
    fn retype<C2, T2>(
        self,
        f: impl FnOnce(C, T) -> (C2, T2),
    ) -> RateLimitLayerBuilder<S, K, C2, T2> {
        let (cost, select) = f(self.cost, self.select);
        RateLimitLayerBuilder {
            store: self.store,
            key: self.key,
            cost,
            select,
            selector_set: self.selector_set,
            rules: self.rules,
            tiers: self.tiers,
            default_tier: self.default_tier,
            namespace: self.namespace,
            location: self.location,
            on_rejection: self.on_rejection,
            failure_policy: self.failure_policy,
            fallback: self.fallback,
            handover: self.handover,
            fallback_grace: self.fallback_grace,
            omitted_key_status: self.omitted_key_status,
            missing_key: self.missing_key,
            blocked_status: self.blocked_status,
            admitted_headers: self.admitted_headers,
            admission_extension: self.admission_extension,
            decision_extension: self.decision_extension,
            shadow: self.shadow,
            max_delay: self.max_delay,
            deny_cache: self.deny_cache,
            store_timeout: self.store_timeout,
            charge_when: self.charge_when,
            refund_refused: self.refund_refused,
            metering: self.metering,
            resolver: self.resolver,
            customer_cache: self.customer_cache,
            metrics_tier_labels: self.metrics_tier_labels,
        }
    }

    /// Adds a rule. All rules of a layer are decided together on the request's key: it
    /// is admitted only if every rule admits it.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds the rules of `text`, e.g. `"1/s; 5/min"` (see [`RuleSet`]'s syntax); fails
    /// with the parser's explanation.
    pub fn rules(self, text: &str) -> Result<Self, ConfigError> {
        let set: RuleSet = text.parse()?;
        Ok(self.rule_set(set))
    }

    /// Adds the rules of `set` (a `RuleSet` or a `&RuleSet`).
    pub fn rule_set(mut self, set: impl Borrow<RuleSet>) -> Self {
        self.rules.extend(set.borrow().rules().iter().cloned());
        self
    }

    /// Names the budgets of this layer. Layers with the same namespace (on the same store)
    /// share budgets, within a process and across a fleet; a layer without one gets a
    /// namespace of its own derived from where it is built in the source (see
    /// [namespaces](crate#budgets-and-namespaces)). At most 255 bytes.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Sets the rules, tiers and default tier from `limits`, in place of any given
    /// before (for limits read from a file: see [`Limits`]).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.rules = limits.rules.map(|r| r.rules().to_vec()).unwrap_or_default();
        self.tiers = limits.tiers;
        self.default_tier = limits.default_tier;
        self
    }

    /// Adds a tier (a plan): requests the [tier selector](Self::select_tier) puts in
    /// tier `name` are decided against `rules`, with budgets and a `RateLimit-Policy` of
    /// their own. The rules of [`rules`](Self::rules), if any, form the tier `""`.
    pub fn tier(mut self, name: &str, rules: RuleSet) -> Self {
        self.tiers.push((name.to_owned(), rules));
        self
    }

    /// The tier for requests the selector puts in no tier or in a tier the limits lack
    /// (`""`, the tier of [`rules`](Self::rules), by default, when there are such rules).
    /// A layer with a selector and neither rules nor a default tier does not build
    /// ([`BuildError::NoDefaultTier`]).
    pub fn default_tier(mut self, name: &str) -> Self {
        self.default_tier = Some(name.to_owned());
        self
    }

    /// Chooses the tier of each request with `select` (a [`SelectTier`], e.g. a closure
    /// `|req| req.extensions().get::<Plan>().map(|p| p.name())`). A name that is not a
    /// tier of the limits in force is decided under the [default tier](Self::default_tier),
    /// with a `WARN` once per name (see [tiers](crate#tiers-rules-per-request)): replaced
    /// limits that drop a plan still in use limit it, they never answer 500.
    ///
    /// [`SelectTier`]: crate::SelectTier
    pub fn select_tier<T2>(mut self, select: T2) -> RateLimitLayerBuilder<S, K, C, T2> {
        self.selector_set = true;
        self.retype(|cost, _| (cost, select))
    }

    /// Charges each request `cost` units (a [`RequestCost`](crate::RequestCost), e.g. a
    /// closure over the request) instead of 1.
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayerBuilder<S, K, C2, T> {
        self.retype(|_, select| (cost, select))
    }

    /// Builds refusal bodies with `hook` (an [`OnRejection`]; [`PlainText`] by default,
    /// [`ProblemJson`](crate::ProblemJson) for RFC 9457). The layer still sets the status
    /// and the rate-limit fields.
    pub fn on_rejection(mut self, hook: impl OnRejection) -> Self {
        self.on_rejection = Arc::new(hook);
        self
    }

    /// What to do when the store fails ([`FailurePolicy::FailOpen`] by default).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// Falls back to a local store (as [`FailurePolicy::Fallback`], which this sets)
    /// holding each rule's limit and burst divided by `instances`, rounded down: a fleet
    /// of that many instances then admits at most the limit while the store is down
    /// (a rule that would be left nothing fails [`build`](Self::build)). A `N concurrent`
    /// rule is shared alike: each instance holds `N / instances` slots.
    ///
    /// While it decides, the response fields announce the share under names of their own
    /// (`"api/fallback";q=25;w=60` for `100/min name=api` shared by 4), and a request
    /// whose cost the share cannot hold, though the rule can, is refused with 503 and
    /// `Retry-After`, not 413: see [the crate docs](crate#while-the-store-is-down).
    pub fn fallback_share(mut self, instances: NonZeroU32) -> Self {
        self.failure_policy = FailurePolicy::Fallback;
        self.fallback = FallbackRules::Share(instances);
        self
    }

    /// Falls back to a local store (as [`FailurePolicy::Fallback`], which this sets)
    /// deciding with `rules`, for every tier.
    pub fn fallback_rules(mut self, rules: RuleSet) -> Self {
        self.failure_policy = FailurePolicy::Fallback;
        self.fallback = FallbackRules::Rules(rules);
        self
    }

    /// Whether the fallback's usage is handed to the store when it answers again (on by
    /// default; see [the crate docs](crate#while-the-store-is-down)). Off, the store
    /// resumes as if the outage had admitted nothing: for tests that show what the
    /// handover bounds, not for production.
    #[doc(hidden)]
    pub fn fallback_handover(mut self, on: bool) -> Self {
        self.handover = on;
        self
    }

    /// For how long after this instance last decided by its fallback (or its store last
    /// regained a lost connection) a request the store admits must also fit the
    /// instance's share (1 s by default; zero switches it off).
    ///
    /// The instances of a fleet return from an outage one by one, each when its own
    /// connection does: an instance back decides with the store while another still
    /// admits its share locally, which the store cannot count until that instance hands
    /// it over. Held to its share for this long after its own return, each instance
    /// leaves the others' shares free, so that a key admits no more than its limit (and
    /// has no more than `N` in flight) across the switch as long as the instances return
    /// within this time of each other. A request whose cost only the share cannot hold is
    /// decided by the store alone. See [the crate docs](crate#while-the-store-is-down).
    pub fn fallback_grace(mut self, grace: Duration) -> Self {
        self.fallback_grace = grace;
        self
    }

    /// The status for a request whose client left out what the key is made of
    /// ([`Extraction::Omitted`](crate::key::Extraction::Omitted), e.g. the header of a
    /// [`HeaderKey`](crate::HeaderKey)): 400 by default; 401 suits a missing API key.
    /// Must be a client error (4xx). To key such requests another way instead, give the
    /// extractor a fallback ([`or`](crate::KeyExtractorExt::or)).
    pub fn omitted_key_status(mut self, status: StatusCode) -> Self {
        self.omitted_key_status = status;
        self
    }

    /// What to do with a request in which the server provided no key
    /// ([`Extraction::Missing`](crate::key::Extraction::Missing), [`MissingKey::Refuse`]
    /// by default).
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
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

    /// Whether every request the layer passes on carries an [`Admission`](crate::Admission)
    /// in its extensions: how it was admitted and the rule nearest to its limit, for
    /// handlers to read as `admission: Admission`. Off by default: an extensions entry
    /// costs every admitted request an allocation and a map insert (about 250
    /// instructions) whether or not a handler reads it. With it on, the admission is
    /// there under every policy (see [`Admission`](crate::Admission)); with it off, a
    /// handler that extracts `Admission` is answered 500 with a body that says to turn
    /// this on ([`MissingAdmission`](crate::MissingAdmission)).
    pub fn admission_extension(mut self, enabled: bool) -> Self {
        self.admission_extension = enabled;
        self
    }

    /// Whether a request the store admitted also carries the store's whole
    /// [`Decision`](ratelimit_core::Decision) (every rule's outcome) in its extensions.
    /// Off by default: the decision is a few hundred bytes to copy into every request,
    /// and an [`Admission`](crate::Admission) ([`admission_extension`](Self::admission_extension))
    /// names the rule nearest to its limit. With it on, a handler reads
    /// `Option<Extension<Decision>>`: a request passed unchecked (fail-open, an exempt
    /// key, a missing key admitted, shadow mode overriding a refusal) has no decision.
    /// Independent of `admission_extension`: each puts its own entry.
    pub fn decision_extension(mut self, enabled: bool) -> Self {
        self.decision_extension = enabled;
        self
    }

    /// Shadow mode: decide, count and report, but never refuse or delay. A request that
    /// would have been refused or delayed passes with a `RateLimit-Shadow` field
    /// (`limited`, `blocked`, `delayed`, `cost-exceeded`, `store-unavailable`,
    /// `key-omitted`, `missing-key`, `unknown-tier`) and an `INFO` event; no other rate-limit field is
    /// sent. For trying new limits on real traffic before enforcing them.
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
    /// has passed on the store's clock. A request of lower cost than the denied one
    /// still asks the store.
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

    /// Charges by outcome: a response for which `counts` answers `false` gives its
    /// request's units back at once (a successful login, when only failures are limited).
    ///
    /// The check before the handler still charges and still refuses when the budget is
    /// spent, so concurrent requests never pass the limit (the charge is given back, not
    /// lent); a response that does not count then returns what its check took, through
    /// [`Store::refund`](ratelimit_core::Store::refund): never more, and never into
    /// another window (see [`algo`](ratelimit_core::algo#giving-units-back)). The
    /// `RateLimit` field of such a response shows the units back. The predicate sees the
    /// response head: its status, its headers (a gRPC call's `grpc-status` when the call
    /// failed at once) and its extensions. A predicate that panics fails that request
    /// with 500 and an `ERROR`, and gives its units back.
    ///
    /// ```
    /// use ratelimit_core::MemoryStore;
    /// use ratelimit_tower::{key::PeerIp, RateLimitLayer};
    ///
    /// // 5 failed logins per 15 minutes per address; successful ones are free.
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new())
    ///     .rules("5/15min fixed-window name=failed-logins")?
    ///     .namespace("login")
    ///     .charge_when(|res: &http::response::Parts| !res.status.is_success())
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn charge_when(
        mut self,
        counts: impl Fn(&http::response::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.charge_when = Some(Arc::new(counts));
        self
    }

    /// Whether a request refused by a rate-limit layer further in (a stacked
    /// `route_layer`, say: its response carries [`Refused`](crate::Refused)) gives back
    /// what this layer charged it. On by default, so that a refused request consumes
    /// nothing from any budget; off, the outer layer's charge stays (and its admitted
    /// requests cost no allocation for the refund they might need).
    pub fn refund_refused(mut self, enabled: bool) -> Self {
        self.refund_refused = enabled;
        self
    }

    /// Settles each admitted request's charge to its actual cost read from the response
    /// head: `actual` answers it (from a header such as `x-usage-tokens`, or a gRPC
    /// trailer in a trailers-only head), `None` keeps the estimate. For costs known only
    /// as the body streams, see [`usage_extension`](Self::usage_extension); for a header
    /// holding a decimal count, [`settle_from_header`](Self::settle_from_header).
    ///
    /// The check at the door charges the layer's [`cost`](Self::cost), the estimate (0 is
    /// allowed: the request is then admitted while the key has a unit left, as a peek is). Once
    /// the actual is known the store settles in one atomic call
    /// ([`Store::settle`](ratelimit_core::Store::settle)): an actual below the estimate
    /// gives the difference back, as [`charge_when`](Self::charge_when) gives a whole
    /// charge back; an actual above it charges the excess **unconditionally**, as debt
    /// that the key repays before it is admitted again, at most
    /// [`max_debt`](Self::max_debt) per request. The response waits for the settle (as
    /// for a refund), so the client's next request sees it in its `RateLimit` field,
    /// and a key in debt is refused with a `Retry-After` that covers the debt.
    /// See [metered costs](crate#metered-costs) for the bound this keeps.
    ///
    /// A settle that fails leaves the estimate charged, with a `WARN` at most every
    /// 10 s: the key is limited by the estimate, not by nothing. A debt that fails is
    /// retried once first (should the first call have run after all, its answer lost
    /// with the connection, the key is charged twice: limited more, never less); a
    /// give-back is not, as a refund is not.
    /// A response that does not count ([`charge_when`](Self::charge_when), or refused
    /// further in) gives the whole charge back instead and is not settled.
    ///
    /// ```
    /// use ratelimit_core::MemoryStore;
    /// use ratelimit_tower::{HeaderKey, RateLimitLayer};
    ///
    /// // 40,000 tokens a minute per API key: 500 reserved at the door, settled to the
    /// // count the upstream reports in `x-usage-tokens`.
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), HeaderKey::new("x-api-key"))
    ///     .rules("40000/min fixed-window name=tokens")?
    ///     .namespace("tokens")
    ///     .cost(|_: &http::Request<axum::body::Body>| 500)
    ///     .settle_with(|res: &http::response::Parts| {
    ///         res.headers.get("x-usage-tokens")?.to_str().ok()?.parse().ok()
    ///     })
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn settle_with(
        mut self,
        actual: impl Fn(&http::response::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.metering.settle_with = Some(Arc::new(actual));
        self
    }

    /// [`settle_with`](Self::settle_with) the decimal count in the response header
    /// `name`. A response without the header keeps its estimate; a value that is not a
    /// decimal count (negative, fractional, text) keeps it too, with a `WARN` at most
    /// every 10 s, since it means the upstream and the layer disagree on the header.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name: it is a constant of the program.
    pub fn settle_from_header(mut self, name: &str) -> Self {
        self.metering.settle_with = Some(crate::meter::from_header(name));
        self
    }

    /// Puts a [`Usage`](crate::Usage) into every admitted request, for the handler or its
    /// streaming body to report the actual cost with, and settles each request's charge
    /// when its response body ends, as [`settle_with`](Self::settle_with) settles on the
    /// head. Off by default.
    ///
    /// The last frame of the body (its end, its trailers) is held until the settle is
    /// in the store, so a client that waits for the end of a response before its next
    /// request finds the settle made. A body dropped before its end (the client went
    /// away) settles what was reported by then, in the background; nothing reported,
    /// the estimate stands. With both, a value from [`settle_with`](Self::settle_with)
    /// settles on the head and the body's report is not consulted. An axum handler reads
    /// it as `usage: Usage`; with this off, such a handler is answered 500 with a body
    /// that says to turn this on ([`MissingUsage`](crate::MissingUsage)).
    pub fn usage_extension(mut self, enabled: bool) -> Self {
        self.metering.usage_extension = enabled;
        self
    }

    /// The most one settle charges beyond the request's estimate, in the rules' units:
    /// a larger actual is cut to the estimate plus this, with a `WARN` at most every
    /// 10 s. By default the most the store takes: the largest
    /// [`debt_cap`](ratelimit_core::algo::debt_cap) of the tier's rules (one period's
    /// limit). Whatever this says, the store never adds more than a rule's `debt_cap` to
    /// it in one settle, so a hostile actual (`u64::MAX`) cannot lock a key out for
    /// years; set it lower to bound what one response can cost a key.
    pub fn max_debt(mut self, units: u64) -> Self {
        self.metering.max_debt = Some(units);
        self
    }

    /// Limits per customer: `resolve` answers a client key's own rules (from a database,
    /// a config service), `None` for the tier's rules. A customer with a contract of its
    /// own (A 1,000/min, B 50/min, thousands of them) needs no rebuild of the limits.
    ///
    /// Answers are cached per client key and tier, at most
    /// [`customer_cache`](Self::customer_cache) of them (100,000 by default), each for its
    /// time to live (60 s by default, on the store's clock, as everything the layer keeps
    /// in time): the hot path reads the cache without a lock, and
    /// the resolver runs at most once per key per time to live, concurrent requests of an
    /// unknown key sharing one call. A customer's rules decide on the client's state in
    /// the tier it stands in (the same store keys), so usage carries when the customer's
    /// limits change or go, as it does for [changed limits](crate#changing-limits).
    /// Metric labels stay those of the tier (rules named by position), whatever the
    /// number of customers.
    ///
    /// A resolver that fails or panics gives the tier's rules, with a `WARN` at most every
    /// 10 s; its answer is cached like any other (it is asked again after the time to
    /// live). A rule set it answers has passed [`RuleSet`]'s validation, as any rule text
    /// must: parse the customer's rule text in the resolver and answer the parse error as
    /// its error, which gives the tier's rules. A store outage falls back on the tier's
    /// fallback rules. Put the resolver behind authentication, or every unknown key
    /// costs a resolver call.
    ///
    /// The resolver is handed a [`ClientKey`](crate::key::ClientKey), owned (its future
    /// may keep it): the key as the client sent it and the extractor that found it
    /// ([`KeySource`](crate::key::KeySource)). Behind a fallback,
    /// `HeaderKey::new("x-api-key").or(PeerIp::new())`, an API key comes as the header's
    /// value (not the tagged bytes the store counts against) and an address as an
    /// address, so [`header`](crate::key::ClientKey::header) never looks an address up as
    /// an API key.
    ///
    /// ```
    /// use ratelimit_core::{MemoryStore, RuleSet};
    /// use ratelimit_tower::key::ClientKey;
    /// use ratelimit_tower::{HeaderKey, PeerIp, RateLimitLayer};
    ///
    /// # async fn contract_of(api_key: &[u8]) -> Result<Option<String>, std::io::Error> {
    /// #     Ok((api_key == b"acme").then(|| "1000/min name=plan".to_owned()))
    /// # }
    /// let key = HeaderKey::new("x-api-key").or(PeerIp::new());
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), key)
    ///     .rules("100/min name=plan")?
    ///     .namespace("api")
    ///     .limits_for(|client: ClientKey| async move {
    ///         // Addresses (the fallback) have no contract.
    ///         let Some(api_key) = client.header("x-api-key") else {
    ///             return Ok(None);
    ///         };
    ///         // A database, a config service: `contract_of` is the application's.
    ///         let rules = match contract_of(api_key).await? {
    ///             Some(text) => Some(text.parse::<RuleSet>()?),
    ///             None => None,
    ///         };
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(rules)
    ///     })
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn limits_for<F, Fut, E>(mut self, resolve: F) -> Self
    where
        F: Fn(crate::key::ClientKey) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<RuleSet>, E>> + Send + 'static,
        E: fmt::Display,
    {
        self.resolver = Some(customer::resolver(resolve));
        self
    }

    /// The size and time to live of the cache of [`limits_for`](Self::limits_for)'s
    /// answers (100,000 and 60 s by default). The time to live runs on the store's clock:
    /// a store on a [`ManualClock`](ratelimit_core::ManualClock) expires the answers as
    /// the test moves it.
    pub fn customer_cache(mut self, max_entries: u64, ttl: Duration) -> Self {
        self.customer_cache = (max_entries, ttl);
        self
    }

    /// With the `metrics` feature: the most tier names that get a `tier` label of their
    /// own (100 by default, [`DEFAULT_METRICS_TIER_LABELS`]), first come for the layer's
    /// life; the metrics of further tiers carry `tier="other"` and `rule="other"`, so
    /// limits with thousands of tiers, or reloads that bring new names, cannot multiply
    /// the series without bound. 0 labels every tier `other`.
    pub fn metrics_tier_labels(mut self, tiers: usize) -> Self {
        self.metrics_tier_labels = tiers;
        self
    }

    /// The layer; fails when there is no rule, more than the core accepts in one set,
    /// or the namespace, tiers or fallback share cannot work.
    pub fn build(self) -> Result<RateLimitLayer<S, K, C, T>, BuildError> {
        let implicit = self.namespace.is_none();
        let namespace = namespace::resolve(self.namespace, self.location)?;
        if !self.omitted_key_status.is_client_error() {
            return Err(BuildError::OmittedKeyStatus(self.omitted_key_status));
        }
        let rules = if !self.rules.is_empty() || self.tiers.is_empty() {
            Some(RuleSet::new(self.rules)?)
        } else {
            None
        };
        let limits = Limits {
            rules,
            tiers: self.tiers,
            default_tier: self.default_tier,
        };
        let fallback = self.failure_policy == FailurePolicy::Fallback;
        // A customer's own rules are shared as the tiers' are.
        let customer_fallback = fallback.then(|| self.fallback.clone());
        let settings = Settings::new(
            namespace.as_str().into(),
            self.failure_policy,
            self.fallback,
            self.selector_set,
            self.metrics_tier_labels,
        );
        let live = Live::new(settings, limits)?;
        #[cfg(feature = "metrics")]
        let store_latency = crate::metrics::StoreLatency::new(namespace.as_str());
        if implicit && self.store.is_shared() {
            namespace::warn_implicit(self.location);
        }
        let store = Arc::new(self.store);
        let namespace_arc: Arc<str> = namespace.as_str().into();
        let limiter = Limiter {
            fallback: fallback.then(|| fallback_store(&store)),
            handover: fallback.then(|| Handover::new(self.handover)),
            grace_us: if fallback && self.handover {
                u64::try_from(self.fallback_grace.as_micros()).unwrap_or(u64::MAX)
            } else {
                0
            },
            last_fallback_us: AtomicU64::new(0),
            store,
            key: self.key,
            cost: self.cost,
            select: self.select,
            live: Arc::new(live),
            namespace: namespace.as_str().into(),
            on_rejection: self.on_rejection,
            failure_policy: self.failure_policy,
            omitted_key_status: self.omitted_key_status,
            missing_key: self.missing_key,
            missing_log: BoundedLog::new(),
            tier_log: BoundedLog::new(),
            store_error_log: BoundedLog::new(),
            blocked_status: self.blocked_status,
            admitted_headers: self.admitted_headers,
            admission_extension: self.admission_extension,
            decision_extension: self.decision_extension,
            shadow: self.shadow,
            max_delay: self.max_delay,
            deny_cache: self.deny_cache.map(DenyCache::new),
            store_timeout: self.store_timeout,
            charge_when: self.charge_when,
            refund_refused: self.refund_refused,
            metering: self.metering,
            refund_log: Arc::new(BoundedLog::new()),
            metering_log: BoundedLog::new(),
            slot_log: BoundedLog::new(),
            customers: self.resolver.map(|r| {
                Arc::new(Customers::new(
                    r,
                    self.customer_cache.0,
                    self.customer_cache.1,
                    customer_fallback,
                ))
            }),
            namespace_arc,
            #[cfg(feature = "metrics")]
            store_latency,
        };
        Ok(RateLimitLayer {
            limiter: Arc::new(limiter),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::GlobalKey;
    use ratelimit_core::MemoryStore;

    #[test]
    fn implicit_namespaces_differ_by_call_site_and_are_stable() {
        let a = RateLimitLayer::new(MemoryStore::new(), GlobalKey, "2/min".parse().unwrap());
        let b = RateLimitLayer::new(MemoryStore::new(), GlobalKey, "2/min".parse().unwrap());
        assert_ne!(a.namespace(), b.namespace());
        assert_eq!(a.namespace().len(), 6);
        assert_eq!(a.clone().namespace(), a.namespace());
    }

    #[test]
    fn bad_configuration_says_what_to_change() {
        let tiers = || {
            RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
                .tier("free", "100/h".parse().unwrap())
        };
        let err = tiers().build().unwrap_err();
        assert!(err.to_string().contains("select_tier"), "{err}");
        let select = |_: &http::Request<()>| Some("free");
        let err = tiers()
            .tier("free", "5/h".parse().unwrap())
            .select_tier(select)
            .build()
            .unwrap_err();
        assert_eq!(err, BuildError::DuplicateTier("free".into()));
        let err = tiers()
            .default_tier("gold")
            .select_tier(select)
            .build()
            .unwrap_err();
        assert_eq!(err, BuildError::UnknownDefaultTier("gold".into()));
        let err = tiers().select_tier(select).build().unwrap_err();
        assert_eq!(err, BuildError::NoDefaultTier);
        assert!(err.to_string().contains("default_tier"), "{err}");
        let err = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
            .rules("1/s")
            .unwrap()
            .namespace("")
            .build()
            .unwrap_err();
        assert!(matches!(err, BuildError::BadNamespace(_)));
        let err = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
            .rules("1/s")
            .unwrap()
            .fallback_share(NonZeroU32::new(2).unwrap())
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("fallback_rules"), "{err}");
    }
}
