//! Charging by outcome: an admitted request's units given back once its response shows it
//! should not count, by the layer's own predicate
//! ([`charge_when`](crate::RateLimitLayerBuilder::charge_when)) or because a rate-limit
//! layer further in refused it ([`Refused`]).
//!
//! The check before the handler charges as always, so concurrent requests never pass the
//! limit; the refund then returns what that check took, through
//! [`Store::refund`](ratelimit_core::Store::refund): never more, never into another window.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::response::Parts;
use http::HeaderValue;

use crate::limits::{TierRef, Version};
use crate::usage::Usage;

/// Marks a response refused by a [`RateLimitLayer`](crate::RateLimitLayer) (a 429, a
/// block, a store outage failing closed, any refusal): the layers around it give back
/// what they charged the request, so a refused request consumes nothing from any
/// budget. It is in the response's extensions; a handler's own refusals can carry it too
/// (`response.extensions_mut().insert(Refused)`) to have the layers give their units
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Refused;

/// A charge's copy of its store key, copied at its length: inline up to 64 bytes (an
/// implicit namespace's prefix with an IP key fits), so that the charge stays one
/// allocation for such keys, and smaller than the check's store key, which every request
/// builds and which is inline up to 96.
pub(crate) type ChargeKey = smallvec::SmallVec<[u8; 64]>;

/// What the response future needs to give a request's units back.
pub(crate) struct Charge {
    pub(crate) settle: Arc<dyn Settle>,
    pub(crate) version: Arc<Version>,
    pub(crate) tier: TierRef,
    pub(crate) key: ChargeKey,
    pub(crate) cost: u64,
    /// The store's clock, read before the check.
    pub(crate) charged_at: u64,
    /// Charged by the local fallback store (the store had failed), under its rules.
    pub(crate) by_fallback: bool,
    /// The layer judges responses (`charge_when`) or meters them (`settle_with`,
    /// `usage_extension`): every response is settled on its head.
    pub(crate) judged: bool,
    /// Where the handler reports the actual cost, when the layer puts a [`Usage`] in
    /// its requests.
    pub(crate) usage: Option<Usage>,
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charge")
            .field("cost", &self.cost)
            .field("charged_at", &self.charged_at)
            .field("by_fallback", &self.by_fallback)
            .finish_non_exhaustive()
    }
}

/// The layer's side of a charge: whether a response counts, and the refund.
pub(crate) trait Settle: Send + Sync + 'static {
    /// Whether the response counts; `Err` when the predicate panicked.
    fn counts(&self, parts: &Parts) -> Result<bool, ()>;
    /// Whether a refusal further in gives the units back.
    fn refunds_refused(&self) -> bool;
    /// Gives the charge back: at once for a store that answers in process (`None`),
    /// else the store call to wait for before the response goes out, so that a client's
    /// next request finds its units back.
    fn refund(&self, charge: Charge) -> Option<Refund>;
    /// The `RateLimit` field of the charge's tier with `cost` more units left.
    fn refunded_field(&self, charge: &Charge, value: &HeaderValue) -> Option<HeaderValue>;
    /// The actual cost the response head shows (`settle_with`), if the layer reads one.
    fn actual_from_head(&self, parts: &Parts) -> Option<u64>;
    /// Settles the charge to `actual`: at once for a store that answers in process
    /// (`None`), else the store call to wait for.
    fn settle_actual(&self, charge: Charge, actual: u64) -> Option<Refund>;
}

/// A refund on its way to the store.
pub(crate) type Refund = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What became of a charge once its response arrived.
pub(crate) enum Settled {
    /// The response counts: nothing to do.
    Counts,
    /// Given back, or on its way back.
    Refunded(Option<Refund>),
    /// The predicate panicked: the request fails with 500; its units are given back.
    Panicked(Option<Refund>),
    /// Settled to the actual cost the head shows, or on its way.
    Metered(Option<Refund>),
    /// To be settled to what its [`Usage`] reports when the response body ends.
    AtBodyEnd(Charge, Usage),
}

impl Charge {
    /// Whether the response with `extensions` may give the charge back: with no predicate
    /// to ask, only a refusal further in does. Otherwise the charge counts as it is, and
    /// the response is not taken apart to settle it (two moves of its head).
    #[inline]
    pub(crate) fn may_refund(&self, extensions: &http::Extensions) -> bool {
        self.judged || extensions.get::<Refused>().is_some()
    }

    /// A charge that counts, settled to the actual cost if the layer meters it.
    fn meter(mut self, parts: &Parts) -> Settled {
        if let Some(actual) = self.settle.actual_from_head(parts) {
            let settle = Arc::clone(&self.settle);
            return Settled::Metered(settle.settle_actual(self, actual));
        }
        match self.usage.take() {
            Some(usage) => Settled::AtBodyEnd(self, usage),
            None => Settled::Counts,
        }
    }

    /// Settles the charge on `parts`: gives it back when a refusal further in marked the
    /// response or the predicate says it does not count; rewrites the `RateLimit` field
    /// in `ratelimit` (the layer's own, still to be sent) to match.
    pub(crate) fn settle(
        self,
        parts: &Parts,
        ratelimit: Option<&mut Option<HeaderValue>>,
    ) -> Settled {
        let refused = parts.extensions.get::<Refused>().is_some() && self.settle.refunds_refused();
        if !refused {
            match self.settle.counts(parts) {
                Ok(true) => return self.meter(parts),
                Ok(false) => {}
                Err(()) => {
                    let settle = Arc::clone(&self.settle);
                    return Settled::Panicked(settle.refund(self));
                }
            }
        }
        if let Some(Some(value)) = ratelimit.map(|slot| slot.as_mut()) {
            if let Some(v) = self.settle.refunded_field(&self, value) {
                *value = v;
            }
        }
        let settle = Arc::clone(&self.settle);
        Settled::Refunded(settle.refund(self))
    }
}
