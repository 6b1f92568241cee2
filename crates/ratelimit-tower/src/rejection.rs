//! What a refused request gets: the reason, the status, and the hook that builds the
//! response body.

use std::time::Duration;

use http::{Response, StatusCode};
use ratelimit_core::Decision;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// A rule denied it (429).
    Limited,
    /// The key is blocked (429 or 403, see [`BlockedStatus`]).
    Blocked,
    /// The request costs more than a rule can ever grant at once (413): no wait would
    /// help, so it is not reported as a 429.
    CostExceedsCapacity {
        /// The request's cost.
        cost: u64,
        /// The most the rule grants at once.
        capacity: u64,
    },
    /// A shaping rule admitted it, but later than the layer's maximum delay (429).
    DelayTooLong,
    /// The store failed and the failure policy is fail closed (503).
    StoreUnavailable,
}

/// The status for blocked keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockedStatus {
    /// 429, with `Retry-After` the time left on the block: the client cannot tell a
    /// block from a limit (the default).
    #[default]
    TooManyRequests,
    /// 403: the client is told it is banned.
    Forbidden,
}

impl BlockedStatus {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            BlockedStatus::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            BlockedStatus::Forbidden => StatusCode::FORBIDDEN,
        }
    }
}

/// A refused request, as shown to [`OnRejection`].
#[derive(Debug, Clone)]
pub struct Rejection {
    pub(crate) reason: RejectReason,
    pub(crate) status: StatusCode,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) decision: Option<Decision>,
}

impl Rejection {
    /// Why.
    pub fn reason(&self) -> RejectReason {
        self.reason
    }

    /// The status the response gets.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// When the same request would be admitted; `None` when it never will be without a
    /// change (an endless block, a cost above capacity, a store outage).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The store's decision, when there was one.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }
}

/// Builds the response for a refused request. The layer then sets its status and adds
/// `Retry-After`, `RateLimit-Policy` and `RateLimit`, so the hook only chooses the body
/// and any headers of its own.
///
/// Implemented for closures `Fn(&Rejection) -> Response<B>`.
///
/// ```
/// use axum::body::Body;
/// use http::Response;
/// use ratelimit_tower::{OnRejection, Rejection};
///
/// let json = |r: &Rejection| {
///     let secs = r.retry_after().map_or(0, |d| d.as_secs());
///     Response::builder()
///         .header("content-type", "application/json")
///         .body(Body::from(format!(r#"{{"error":"slow down","retry_after":{secs}}}"#)))
///         .unwrap()
/// };
/// # fn takes<H: OnRejection<Body>>(_: H) {}
/// # takes(json);
/// ```
pub trait OnRejection<B>: Send + Sync + 'static {
    /// The response for `rejection`.
    fn rejection(&self, rejection: &Rejection) -> Response<B>;
}

impl<B, F> OnRejection<B> for F
where
    F: Fn(&Rejection) -> Response<B> + Send + Sync + 'static,
{
    fn rejection(&self, rejection: &Rejection) -> Response<B> {
        self(rejection)
    }
}

/// An empty body.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRejection;

impl<B: Default> OnRejection<B> for DefaultRejection {
    fn rejection(&self, _: &Rejection) -> Response<B> {
        Response::new(B::default())
    }
}
