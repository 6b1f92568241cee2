use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ratelimit_core::{Store, StoreExt, WaitError};
use tower_service::Service;

use ratelimit_core::RuleSet;

/// What a layer's services share.
pub(super) struct Shared<S> {
    pub(super) store: S,
    pub(super) key: Box<[u8]>,
    /// The rules as the throttle waits under them, bounds per period included.
    pub(super) rules: RuleSet,
    pub(super) max_wait: Duration,
}

/// The service made by [`ThrottleLayer`](super::ThrottleLayer).
pub struct Throttle<Svc, S> {
    inner: Svc,
    shared: Arc<Shared<S>>,
}

impl<Svc, S> Throttle<Svc, S> {
    pub(super) fn new(inner: Svc, shared: Arc<Shared<S>>) -> Self {
        Self { inner, shared }
    }
}

impl<Svc: Clone, S> Clone for Throttle<Svc, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<Svc: fmt::Debug, S> fmt::Debug for Throttle<Svc, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Throttle")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Why a throttled call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ThrottleError<E> {
    /// The call's turn is further away than the maximum wait; it was not made and
    /// nothing was charged.
    #[error("not sent: the next turn is {wait:?} away, beyond the maximum wait of {max_wait:?}")]
    TooLong {
        /// How long the call would have had to wait (at least).
        wait: Duration,
        /// The maximum wait.
        max_wait: Duration,
    },
    /// The call can never get a turn (a cost above a rule's capacity, a key blocked
    /// without end); it was not made.
    #[error("not sent: {0}")]
    Never(&'static str),
    /// The rate-limit store failed; the call was not made.
    #[error("not sent: the rate-limit store failed")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The inner service failed.
    #[error(transparent)]
    Inner(E),
}

impl<E> ThrottleError<E> {
    /// How long the call would have had to wait, when that is why it failed.
    pub fn wait(&self) -> Option<Duration> {
        match self {
            ThrottleError::TooLong { wait, .. } => Some(*wait),
            _ => None,
        }
    }
}

impl<Svc, S, Req> Service<Req> for Throttle<Svc, S>
where
    Svc: Service<Req> + Clone + Send + 'static,
    Svc::Future: Send,
    S: Store,
    Req: Send + 'static,
{
    type Response = Svc::Response;
    type Error = ThrottleError<Svc::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Svc::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ThrottleError::Inner)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The ready service goes with the call; its clone waits for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let s = &*shared;
            s.store
                .until_ready(&s.key, &s.rules, 1, s.max_wait)
                .await
                .map_err(not_sent)?;
            inner.call(req).await.map_err(ThrottleError::Inner)
        })
    }
}

fn not_sent<E, Se: std::error::Error + Send + Sync + 'static>(
    e: WaitError<Se>,
) -> ThrottleError<E> {
    match e {
        WaitError::Store(e) => ThrottleError::Store(Box::new(e)),
        WaitError::TooLong { wait, max_wait } => ThrottleError::TooLong { wait, max_wait },
        WaitError::Never(why) => ThrottleError::Never(why),
    }
}
