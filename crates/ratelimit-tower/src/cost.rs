//! How many units a request consumes.

use http::Request;

/// The units a request consumes (1 unless configured). A cost of 0 checks without
/// consuming; a cost above what a rule can ever grant is answered 413.
///
/// Implemented for closures `Fn(&Request<B>) -> u64`.
///
/// ```
/// use axum::body::Body;
/// use http::{Method, Request};
/// use ratelimit_tower::RequestCost;
///
/// // Writes cost five times a read.
/// let cost = |req: &Request<Body>| if req.method() == Method::GET { 1 } else { 5 };
/// assert_eq!(cost.cost(&Request::new(Body::empty())), 1);
/// ```
pub trait RequestCost<B>: Send + Sync + 'static {
    /// The cost of `req`.
    fn cost(&self, req: &Request<B>) -> u64;
}

impl<B, F> RequestCost<B> for F
where
    F: Fn(&Request<B>) -> u64 + Send + Sync + 'static,
{
    fn cost(&self, req: &Request<B>) -> u64 {
        self(req)
    }
}

/// Every request costs 1 (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct UnitCost;

impl<B> RequestCost<B> for UnitCost {
    #[inline]
    fn cost(&self, _: &Request<B>) -> u64 {
        1
    }
}
