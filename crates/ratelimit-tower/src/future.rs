use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::decide::{CheckFuture, Verdict};
use crate::headers::Fields;

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
    }
}

impl<Svc, ReqBody, ResBody> ResponseFuture<Svc, ReqBody, ResBody>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    pub(crate) fn called(future: Svc::Future, fields: Option<Fields>) -> Self {
        Self {
            state: State::Calling { future },
            fields,
        }
    }

    pub(crate) fn delayed(
        inner: Svc,
        req: Request<ReqBody>,
        delay: Duration,
        fields: Option<Fields>,
    ) -> Self {
        Self {
            state: State::Delaying {
                sleep: Box::pin(tokio::time::sleep(delay)),
                call: Some(Box::new((inner, req))),
            },
            fields,
        }
    }

    pub(crate) fn reply(response: Response<ResponseBody<ResBody>>) -> Self {
        Self {
            state: State::Replied {
                response: Some(response),
            },
            fields: None,
        }
    }

    pub(crate) fn checking(check: CheckFuture, inner: Svc, req: Request<ReqBody>) -> Self {
        Self {
            state: State::Checking {
                check,
                call: Some(Box::new((inner, req))),
            },
            fields: None,
        }
    }
}

impl<Svc, ReqBody, ResBody> Future for ResponseFuture<Svc, ReqBody, ResBody>
where
    Svc: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, Svc::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { check, call } => match ready!(check.as_mut().poll(cx)) {
                    Verdict::Pass {
                        delay,
                        fields,
                        decision,
                    } => {
                        *this.fields = fields;
                        let mut pending = call.take().expect("polled after completion");
                        if let Some(decision) = decision {
                            pending.1.extensions_mut().insert(*decision);
                        }
                        if delay.is_zero() {
                            let (mut inner, req) = *pending;
                            this.state.set(State::Calling {
                                future: inner.call(req),
                            });
                        } else {
                            this.state.set(State::Delaying {
                                sleep: Box::pin(tokio::time::sleep(delay)),
                                call: Some(pending),
                            });
                        }
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
                    if let Some(fields) = this.fields.take() {
                        fields.apply(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
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
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
