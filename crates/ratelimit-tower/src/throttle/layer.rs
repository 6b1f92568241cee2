use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::{RuleSet, Store};
use tower_layer::Layer;

use super::rules::as_partners_count;
use super::service::{Shared, Throttle};

/// Puts a client service behind a store's limits: each call waits for its turn, at most
/// `max_wait` (see the [module docs](crate::throttle)).
pub struct ThrottleLayer<S> {
    shared: Arc<Shared<S>>,
}

impl<S: Store> ThrottleLayer<S> {
    /// Every call through the layer's services waits for a turn of `rules` under `key`
    /// in `store` (one budget for every instance sharing the store), at most `max_wait`.
    ///
    /// Whatever the rules' algorithm, no window of a rule's period sees more calls than
    /// its limit, as a partner enforcing that limit counts them, unless the rule asks for
    /// a burst above it (`burst=`, `capacity=`): then no more than the burst.
    pub fn new(store: S, key: impl AsRef<[u8]>, rules: RuleSet, max_wait: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                key: key.as_ref().into(),
                rules: as_partners_count(rules),
                max_wait,
            }),
        }
    }
}

impl<S> Clone for ThrottleLayer<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> fmt::Debug for ThrottleLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottleLayer")
            .field("rules", &self.shared.rules)
            .field("max_wait", &self.shared.max_wait)
            .finish_non_exhaustive()
    }
}

impl<S, Svc> Layer<Svc> for ThrottleLayer<S> {
    type Service = Throttle<Svc, S>;

    fn layer(&self, inner: Svc) -> Self::Service {
        Throttle::new(inner, Arc::clone(&self.shared))
    }
}
