use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::{RuleSet, Store};
use tower_layer::Layer;

use super::service::Throttle;

/// Puts a client service behind a store's limits: each call waits for its turn, at most
/// `max_wait` (see the [module docs](crate::throttle)).
pub struct ThrottleLayer<S> {
    pub(crate) shared: Arc<Shared<S>>,
}

/// What a layer's services share.
pub(crate) struct Shared<S> {
    pub(crate) store: S,
    pub(crate) key: Box<[u8]>,
    pub(crate) rules: RuleSet,
    pub(crate) max_wait: Duration,
}

impl<S: Store> ThrottleLayer<S> {
    /// Every call through the layer's services waits for a turn of `rules` under `key`
    /// in `store` (one budget for every instance sharing the store), at most `max_wait`.
    pub fn new(store: S, key: impl AsRef<[u8]>, rules: RuleSet, max_wait: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                key: key.as_ref().into(),
                rules,
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
        Throttle {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}
