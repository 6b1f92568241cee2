//! A request's slot under a `N concurrent` rule, held from its admission to the end of
//! its response body.
//!
//! The [`SlotGuard`] travels with the request: in the verdict, in the response future,
//! then in the response body. Whichever holds it last lets go of it: the body when it
//! ends or is dropped (the client gone), the future when it is dropped before a response
//! (cancelled, or the handler panicked). Letting go releases the slot in one store call
//! ([`Store::release`](ratelimit_core::Store::release)); a store that fails it is asked
//! again a few times, then the slot is left to its deadline, with a `WARN` at a bounded
//! rate. While held, a task renews the slot every third of its timeout, so that a long
//! stream keeps it; a renewal that finds the slot gone (the store lost it, or it was
//! not renewed in time) stops renewing and says so.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::RuleSet;

use crate::charge::ChargeKey;

/// How a layer releases and renews slots, whatever its store.
pub(crate) trait Slots: Send + Sync + 'static {
    /// Releases the slot, now when the store answers in process, else in a task (with
    /// retries): never waited for by the response.
    fn release(self: Arc<Self>, held: Held);
    /// Renews the slot: whether it was still held, or why the store could not tell.
    fn renew(
        self: Arc<Self>,
        held: &Held,
    ) -> Pin<Box<dyn Future<Output = Result<bool, String>> + Send>>;
    /// Reports a slot found gone when renewed, at a bounded rate.
    fn lost(&self, held: &Held);
}

/// What a release or renewal needs: the store key, the rules, the slot's number and
/// which store holds it.
pub(crate) struct Held {
    pub(crate) key: ChargeKey,
    pub(crate) rules: RuleSet,
    pub(crate) slot: u64,
    /// Taken from the local fallback store while the store failed.
    pub(crate) by_fallback: bool,
}

/// A slot an admitted request holds; dropping it releases the slot (see the module
/// docs). Created with the slot's number when a decision admits ([`SlotGuard::taken`]),
/// bound to the layer's store once the limiter knows which store decided.
pub(crate) struct SlotGuard(Box<Inner>);

struct Inner {
    slot: u64,
    bound: Option<Bound>,
}

struct Bound {
    slots: Arc<dyn Slots>,
    held: Option<Held>,
    renewal: Option<tokio::task::AbortHandle>,
}

impl SlotGuard {
    /// Slot `slot`, not yet bound: dropped as it is, it releases nothing.
    pub(crate) fn taken(slot: u64) -> Self {
        Self(Box::new(Inner { slot, bound: None }))
    }

    /// The slot's number.
    pub(crate) fn slot(&self) -> u64 {
        self.0.slot
    }

    /// Binds the slot to `slots`, which releases it when the guard drops, and starts
    /// renewing it every third of `timeout` (when a Tokio runtime runs).
    pub(crate) fn bind(
        &mut self,
        slots: Arc<dyn Slots>,
        key: &[u8],
        rules: &RuleSet,
        by_fallback: bool,
    ) {
        let held = Held {
            key: ChargeKey::from_slice(key),
            rules: rules.clone(),
            slot: self.0.slot,
            by_fallback,
        };
        let renewal = rules
            .concurrent()
            .map(|at| rules.rules()[at].period() / 3)
            .and_then(|every| renew_every(Arc::clone(&slots), &held, every));
        self.0.bound = Some(Bound {
            slots,
            held: Some(held),
            renewal,
        });
    }
}

/// Renews `held` every `every` until aborted, or until a renewal finds it gone.
fn renew_every(
    slots: Arc<dyn Slots>,
    held: &Held,
    every: Duration,
) -> Option<tokio::task::AbortHandle> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let copy = Held {
        key: held.key.clone(),
        rules: held.rules.clone(),
        slot: held.slot,
        by_fallback: held.by_fallback,
    };
    let task = runtime.spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match Arc::clone(&slots).renew(&copy).await {
                Ok(true) => {}
                Ok(false) => {
                    slots.lost(&copy);
                    return;
                }
                // Tried again at the next tick: the deadline is three ticks away.
                Err(error) => tracing::debug!(%error, "rate limit: renewing a slot failed"),
            }
        }
    });
    Some(task.abort_handle())
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(mut bound) = self.0.bound.take() {
            if let Some(renewal) = bound.renewal.take() {
                renewal.abort();
            }
            if let Some(held) = bound.held.take() {
                bound.slots.release(held);
            }
        }
    }
}

impl std::fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotGuard")
            .field("slot", &self.0.slot)
            .field("bound", &self.0.bound.is_some())
            .finish()
    }
}
