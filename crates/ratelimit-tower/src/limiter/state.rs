use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use ratelimit_core::util::BoundedLog;

use crate::customer::Customers;
use crate::deny_cache::DenyCache;
use crate::fallback::FallbackStore;
use crate::limits::Live;
use crate::meter::Metering;
use crate::policy::{FailurePolicy, MissingKey};
use crate::rejection::{BlockedStatus, OnRejection};

/// Everything a layer's services share: what the layer was built with, and what it
/// remembers (deny cache, fallback store, bounded logs).
pub(crate) struct Limiter<S, K, C, T> {
    pub(crate) store: Arc<S>,
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) select: T,
    /// The limits, replaceable while the layer runs.
    pub(crate) live: Arc<Live>,
    pub(crate) namespace: Box<str>,
    pub(crate) on_rejection: Arc<dyn OnRejection>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) fallback: Option<FallbackStore>,
    /// What the fallback admitted, to hand to the store when it answers again (with the
    /// fallback policy).
    pub(crate) handover: Option<super::Handover>,
    /// For how long after `last_fallback_us` store admissions must fit the share too, in
    /// µs: 0 without the fallback policy or the handover (whose slot pairs release both
    /// slots of a request admitted by both), or with the grace switched off.
    pub(crate) grace_us: u64,
    /// When this instance last decided by its fallback, on the store's clock (0: never).
    pub(crate) last_fallback_us: AtomicU64,
    /// The status for requests whose client left out the key.
    pub(crate) omitted_key_status: StatusCode,
    pub(crate) missing_key: MissingKey,
    pub(crate) missing_log: BoundedLog,
    pub(crate) tier_log: BoundedLog,
    /// Store failures: an outage fails every request, so one line per request would be a
    /// flood of its own.
    pub(crate) store_error_log: BoundedLog,
    pub(crate) blocked_status: BlockedStatus,
    pub(crate) admitted_headers: bool,
    /// Whether passed requests carry an `Admission`.
    pub(crate) admission_extension: bool,
    /// Whether admitted requests carry the store's whole decision.
    pub(crate) decision_extension: bool,
    pub(crate) shadow: bool,
    pub(crate) max_delay: Duration,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) store_timeout: Option<Duration>,
    /// Whether a response counts (charging by outcome); `None`: every response counts.
    pub(crate) charge_when: Option<ChargeWhen>,
    /// Whether a refusal by a rate-limit layer further in gives this layer's units back.
    pub(crate) refund_refused: bool,
    /// Settling charges to their actual costs.
    pub(crate) metering: Metering,
    /// Refunds and settles that failed.
    pub(crate) refund_log: Arc<BoundedLog>,
    /// Actual costs cut to `max_debt`.
    pub(crate) metering_log: BoundedLog,
    /// Releases of concurrency slots that failed.
    pub(crate) slot_log: BoundedLog,
    /// Limits per customer, when the layer has a resolver.
    pub(crate) customers: Option<Arc<Customers>>,
    /// The namespace, shared with the customers' tiers built later.
    pub(crate) namespace_arc: Arc<str>,
    #[cfg(feature = "metrics")]
    pub(crate) store_latency: crate::metrics::StoreLatency,
}

/// The predicate of [`charge_when`](crate::RateLimitLayerBuilder::charge_when).
pub(crate) type ChargeWhen = Arc<dyn Fn(&http::response::Parts) -> bool + Send + Sync>;

impl<S, K, C, T> Limiter<S, K, C, T> {
    /// Whether an admitted request's charge is kept until its response.
    pub(crate) fn settles(&self) -> bool {
        self.charge_when.is_some() || self.refund_refused || self.metering.is_on()
    }

    /// The store's time when a request the store admits must also fit this instance's
    /// share: within the grace after the instance last decided by its fallback, or after
    /// its store last regained its connection; `None` otherwise (one comparison without
    /// a grace, two atomic loads when neither happened).
    #[inline]
    pub(crate) fn grace_now(&self) -> Option<u64>
    where
        S: ratelimit_core::Store,
    {
        if self.grace_us == 0 {
            return None;
        }
        let last =
            (self.last_fallback_us.load(Ordering::Relaxed)).max(self.store.recovered_at_us());
        if last == 0 {
            return None;
        }
        let now = self.store.now_us();
        (now < last.saturating_add(self.grace_us)).then_some(now)
    }
}
