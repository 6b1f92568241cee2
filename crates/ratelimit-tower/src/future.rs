use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::charge::{Charge, Refund, Settled};
use crate::headers::Fields;
use crate::limiter::{CheckFuture, Pass, Verdict};
use crate::meter::Meter;
use crate::slot::SlotGuard;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit): waits for the store (when
    /// it does not answer at once), then for a shaping delay, then for the inner service,
    /// and adds the rate-limit fields to its response.
    pub struct ResponseFuture<Svc, ReqBody, ResBody>
    where
        Svc: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<Svc, Svc::Future, ReqBody, ResBody>,
        fields: Option<Fields>,
        // Inline rather than boxed: moving it with the future costs less than an
        // allocation per admitted request.
        charge: Option<Charge>,
        // A concurrency rule's slot: released if the future is dropped before its
        // response (cancelled, the handler panicked), else handed to the body.
        slot: Option<SlotGuard>,
    }
}

pin_project! {
    #[project = StateProj]
    // The states of a later call are boxed: they are off the in-process path, and the
    // future is moved several times on its way into the server, at its full size.
    enum State<Svc, Fut, ReqBody, ResBody> {
        Checking {
            check: CheckFuture,
            call: Option<Box<(Svc, Request<ReqBody>)>>,
        },
        Delaying {
            sleep: Pin<Box<Sleep>>,
            call: Option<Box<(Svc, Request<ReqBody>)>>,
        },
        Calling {
            #[pin]
            future: Fut,
        },
        Replied {
            response: Option<Response<ResponseBody<ResBody>>>,
        },
        // The response, held until the units it gave back are back in the store.
        Refunding {
            refund: Refund,
            response: Option<Response<ResponseBody<ResBody>>>,
        },
    }
}

impl<Svc, ReqBody, ResBody> ResponseFuture<Svc, ReqBody, ResBody>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    /// An admitted request: its admission (and the decision, when kept) into its
    /// extensions, then `ready` (polled ready) is called now, or a clone of it after the
    /// delay. Inlined into the service's `call` so the request is moved into the
    /// inner call once rather than through two frames (117 instructions per request).
    #[inline(always)]
    pub(crate) fn pass(
        pass: Pass,
        mut req: Request<ReqBody>,
        ready: &mut Svc,
        charge: Option<Charge>,
    ) -> Self {
        // Built in one expression: a tuple of the state, the fields and the charge would
        // be one more move of the inner future.
        let later = pass.admission.insert_into(req.extensions_mut());
        Self {
            state: if pass.delay_us == 0 {
                State::Calling {
                    future: ready.call(req),
                }
            } else {
                State::Delaying {
                    sleep: Box::pin(tokio::time::sleep(std::time::Duration::from_micros(
                        pass.delay_us,
                    ))),
                    call: Some(Box::new((take_ready(ready), req))),
                }
            },
            fields: pass.fields,
            charge: charge.or_else(|| later.map(|c| *c)),
            slot: pass.slot,
        }
    }

    pub(crate) fn reply(response: Response<ResponseBody<ResBody>>) -> Self {
        Self {
            state: State::Replied {
                response: Some(response),
            },
            fields: None,
            charge: None,
            slot: None,
        }
    }

    pub(crate) fn checking(check: CheckFuture, inner: Svc, req: Request<ReqBody>) -> Self {
        Self {
            state: State::Checking {
                check,
                call: Some(Box::new((inner, req))),
            },
            fields: None,
            charge: None,
            slot: None,
        }
    }
}

/// The service that was polled ready, to be called later; a fresh clone takes its place.
pub(crate) fn take_ready<Svc: Clone>(ready: &mut Svc) -> Svc {
    let clone = ready.clone();
    std::mem::replace(ready, clone)
}

impl<Svc, ReqBody, ResBody> Future for ResponseFuture<Svc, ReqBody, ResBody>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Output = Result<Response<ResponseBody<ResBody>>, Svc::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            match this.state.as_mut().project() {
                StateProj::Checking { check, call } => match ready!(check.as_mut().poll(cx)) {
                    Verdict::Pass(pass) => {
                        let (mut inner, req) = *call.take().expect("polled after completion");
                        self.set(Self::pass(pass, req, &mut inner, None));
                    }
                    Verdict::Refuse(refusal) => {
                        let pending = call.as_ref().expect("polled after completion");
                        return Poll::Ready(Ok(refusal.into_response(pending.1.headers())));
                    }
                },
                StateProj::Delaying { sleep, call } => {
                    ready!(sleep.as_mut().poll(cx));
                    let (mut inner, req) = *call.take().expect("polled after completion");
                    this.state.set(State::Calling {
                        future: inner.call(req),
                    });
                }
                StateProj::Calling { future } => {
                    let mut response = ready!(future.poll(cx))?;
                    // A charge that counts as it is (no predicate, no refusal further in)
                    // is left to go with the future, the response kept whole.
                    let refunds =
                        (this.charge.as_ref()).is_some_and(|c| c.may_refund(response.extensions()));
                    let charge = if refunds { this.charge.take() } else { None };
                    let Some(charge) = charge else {
                        if let Some(fields) = this.fields.take() {
                            fields.apply(response.headers_mut());
                        }
                        let slot = this.slot.take();
                        return Poll::Ready(Ok(
                            response.map(|b| ResponseBody::inner(b).holding(slot))
                        ));
                    };
                    let (parts, body) = response.into_parts();
                    let ratelimit = this.fields.as_mut().map(|f| &mut f.ratelimit);
                    let (response, refund) = match charge.settle(&parts, ratelimit) {
                        Settled::Panicked(refund) => (crate::rejection::internal_error(), refund),
                        settled => {
                            let mut response = Response::from_parts(parts, body);
                            if let Some(fields) = this.fields.take() {
                                fields.apply(response.headers_mut());
                            }
                            let slot = this.slot.take();
                            match settled {
                                Settled::Refunded(refund) | Settled::Metered(refund) => (
                                    response.map(|b| ResponseBody::inner(b).holding(slot)),
                                    refund,
                                ),
                                Settled::AtBodyEnd(charge, usage) => {
                                    let meter = Box::new(Meter::new(charge, usage));
                                    let body = |b| ResponseBody::metered(b, meter).holding(slot);
                                    (response.map(body), None)
                                }
                                Settled::Counts | Settled::Panicked(_) => {
                                    (response.map(|b| ResponseBody::inner(b).holding(slot)), None)
                                }
                            }
                        }
                    };
                    match refund {
                        None => return Poll::Ready(Ok(response)),
                        Some(refund) => this.state.set(State::Refunding {
                            refund,
                            response: Some(response),
                        }),
                    }
                }
                StateProj::Refunding { refund, response } => {
                    ready!(refund.as_mut().poll(cx));
                    return Poll::Ready(Ok(response.take().expect("polled after completion")));
                }
                StateProj::Replied { response } => {
                    return Poll::Ready(Ok(response.take().expect("polled after completion")))
                }
            }
        }
    }
}

impl<Svc, ReqBody, ResBody> fmt::Debug for ResponseFuture<Svc, ReqBody, ResBody>
where
    Svc: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Checking { .. } => "checking",
            State::Delaying { .. } => "delaying",
            State::Calling { .. } => "calling",
            State::Replied { .. } => "replied",
            State::Refunding { .. } => "refunding",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
