use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use ratelimit_core::Store;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::cost::{RequestCost, UnitCost};
use crate::future::{take_ready, ResponseFuture};
use crate::key::KeyExtractor;
use crate::limiter::{Begin, Limiter, Verdict};
use crate::tier::{OneTier, SelectTier};

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// `poll_ready` is the inner service's; a refusal is a response (429, 403, 413, 500 or
/// 503), never an error, so `Error` is the inner service's error.
pub struct RateLimit<Svc, S, K, C = UnitCost, T = OneTier> {
    inner: Svc,
    limiter: Arc<Limiter<S, K, C, T>>,
}

impl<Svc, S, K, C, T> RateLimit<Svc, S, K, C, T> {
    pub(crate) fn new(inner: Svc, limiter: Arc<Limiter<S, K, C, T>>) -> Self {
        Self { inner, limiter }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &Svc {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut Svc {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> Svc {
        self.inner
    }
}

impl<Svc: Clone, S, K, C, T> Clone for RateLimit<Svc, S, K, C, T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            limiter: Arc::clone(&self.limiter),
        }
    }
}

impl<Svc: fmt::Debug, S, K, C, T> fmt::Debug for RateLimit<Svc, S, K, C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("namespace", &self.limiter.namespace)
            .finish_non_exhaustive()
    }
}

impl<Svc, S, K, C, T, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<Svc, S, K, C, T>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    S: Store,
    K: KeyExtractor<ReqBody>,
    C: RequestCost<ReqBody>,
    T: SelectTier<ReqBody>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = Svc::Error;
    type Future = ResponseFuture<Svc, ReqBody, ResBody>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let mut charge = None;
        match Limiter::begin(&self.limiter, &mut req, &mut charge) {
            Begin::Now(Verdict::Pass(pass)) => {
                ResponseFuture::pass(pass, req, &mut self.inner, charge)
            }
            Begin::Now(Verdict::Refuse(refusal)) => {
                ResponseFuture::reply(refusal.into_response(req.headers()))
            }
            Begin::Later(check) => {
                ResponseFuture::checking(check, take_ready(&mut self.inner), req)
            }
        }
    }
}
