//! [`Usage`]: what a request turned out to cost, reported by the handler or its body.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What an admitted request actually cost, when that is known only once it has been
/// served: the tokens an LLM answered with, the rows a query scanned, the bytes sent.
///
/// A layer built with [`usage_extension(true)`](crate::RateLimitLayerBuilder::usage_extension)
/// puts one in every request it admits; the handler (axum: `usage: Usage`), or the
/// streaming body it returns, calls [`report`](Self::report) at any time before the
/// response body ends. The layer settles the request's charge **when the response body
/// ends**: the check at the door charged the layer's [`cost`](crate::RateLimitLayerBuilder::cost)
/// (the estimate); the settle gives back what the estimate overstated, or charges the
/// excess as debt that the key repays before it is admitted again
/// ([`Store::settle`](ratelimit_core::Store::settle)).
///
/// * Reported twice: the last report counts.
/// * Never reported: the estimate stands, and no store call is made.
/// * The body dropped before its end (the client went away, the connection broke): what
///   was reported by then is settled; nothing reported, the estimate stands.
///
/// Clones share one report: the handler keeps one, a stream it returns another. Several
/// metered layers around one request (a per-key and a global token budget, say) share
/// one `Usage` too, so one report settles every one of them.
///
/// Without `usage_extension(true)` (the default) no request carries one, and an axum
/// handler extracting `Usage` is answered 500 with a body that says so ([`MissingUsage`];
/// `Extension<Usage>` reads the same entry, with axum's generic message).
///
/// ```
/// use ratelimit_tower::Usage;
///
/// let usage = Usage::new();
/// assert_eq!(usage.reported(), None);
/// let in_the_stream = usage.clone();
/// in_the_stream.report(120);
/// in_the_stream.report(342); // the last report counts
/// assert_eq!(usage.reported(), Some(342));
/// ```
#[derive(Clone, Default)]
pub struct Usage(Arc<Reported>);

/// The report: `actual + 1`, or 0 for none, so that one atomic word holds both (a
/// report of `u64::MAX` is kept as `u64::MAX - 1`, far above any cap a settle applies).
#[derive(Default)]
struct Reported(AtomicU64);

impl Usage {
    /// A usage with nothing reported.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports the request's actual cost, in the units of the layer's rules; replaces any
    /// earlier report.
    pub fn report(&self, actual: u64) {
        (self.0)
            .0
            .store(actual.saturating_add(1), Ordering::Release);
    }

    /// The last report, if any.
    pub fn reported(&self) -> Option<u64> {
        (self.0).0.load(Ordering::Acquire).checked_sub(1)
    }
}

impl fmt::Debug for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Usage").field(&self.reported()).finish()
    }
}

/// The request's [`Usage`]: the one an outer metered layer put there if any, so that one
/// report settles both; else a new one, put there.
pub(crate) fn shared(extensions: &mut http::Extensions) -> Usage {
    if let Some(usage) = extensions.get::<Usage>() {
        return usage.clone();
    }
    let usage = Usage::new();
    extensions.insert(usage.clone());
    usage
}

/// The message of [`MissingUsage`].
#[cfg(feature = "axum")]
const MISSING_USAGE: &str = "this request carries no rate-limit Usage: build the \
    RateLimitLayer in front of this route with `.usage_extension(true)` (off by default), \
    or extract `Option<Usage>` where a route may have no such layer";

/// The rejection of a handler that extracts a [`Usage`] the request does not carry:
/// answered 500, with a body that says what to change (the layer was built without
/// [`usage_extension(true)`](crate::RateLimitLayerBuilder::usage_extension), or the
/// route has no metered rate-limit layer). A report made into a `Usage` of its own would
/// settle nothing, so the handler is not run without one.
#[cfg(feature = "axum")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingUsage;

#[cfg(feature = "axum")]
impl fmt::Display for MissingUsage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MISSING_USAGE)
    }
}

#[cfg(feature = "axum")]
impl std::error::Error for MissingUsage {}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for MissingUsage {
    fn into_response(self) -> axum::response::Response {
        tracing::error!("{MISSING_USAGE}");
        (http::StatusCode::INTERNAL_SERVER_ERROR, MISSING_USAGE).into_response()
    }
}

/// `usage: Usage` in an axum handler: the request's usage to report to, or a 500 that
/// says what to change when the layer was built without
/// [`usage_extension(true)`](crate::RateLimitLayerBuilder::usage_extension).
/// (`Extension<Usage>` reads the same entry, with axum's generic message.)
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Usage {
    type Rejection = MissingUsage;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Usage>().cloned().ok_or(MissingUsage)
    }
}

/// `usage: Option<Usage>`: `None` for a request no layer with
/// [`usage_extension(true)`](crate::RateLimitLayerBuilder::usage_extension) passed.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for Usage {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Usage>().cloned())
    }
}
