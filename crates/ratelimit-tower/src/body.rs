//! [`ResponseBody`]: the inner service's body, or the layer's own for a refusal.

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::meter::Meter;
use crate::slot::SlotGuard;

pin_project! {
    /// The body of a [`RateLimit`](crate::RateLimit) response: the inner service's body
    /// when the request was passed on, or the layer's own bytes when it was refused.
    ///
    /// Wrapping, rather than converting the refusal into the inner service's body type,
    /// is what lets the layer serve any inner service: axum's `Body`, tonic's `Body`,
    /// hyper's `Incoming` or a body of your own. axum's `Router::layer` and
    /// `route_layer` turn it back into an axum `Body` by themselves; tonic's
    /// `Server::builder().layer(..)` takes it as it is. Anything else that needs the
    /// response as a `http_body::Body` gets one: the data are `Bytes` and the error is the
    /// inner body's.
    ///
    /// A refusal to a gRPC call has an empty body, which ends the stream with the headers
    /// (a trailers-only response).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // A metered response's charge, settled when the body ends.
        meter: Option<Box<Meter>>,
        // The body's last frame (`None`: its end), held while the settle is on its way.
        held: Option<Option<Frame<Bytes>>>,
        // A concurrency rule's slot, let go of when the body ends or is dropped.
        slot: Option<SlotGuard>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        // `None` once sent, or from the start when empty: the end of the stream.
        Own { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            meter: None,
            held: None,
            slot: None,
        }
    }

    /// The inner service's body, whose end settles `meter`.
    pub(crate) fn metered(body: B, meter: Box<Meter>) -> Self {
        Self {
            kind: Kind::Inner { body },
            meter: Some(meter),
            held: None,
            slot: None,
        }
    }

    /// The body holding `slot` until it ends or is dropped.
    pub(crate) fn holding(mut self, slot: Option<SlotGuard>) -> Self {
        self.slot = slot;
        self
    }

    pub(crate) fn own(data: Bytes) -> Self {
        Self {
            kind: Kind::Own {
                data: (!data.is_empty()).then_some(data),
            },
            meter: None,
            held: None,
            slot: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(pending) = this.meter.as_mut().and_then(|m| m.pending()) {
            ready!(pending.as_mut().poll(cx));
            *this.meter = None;
            return Poll::Ready(this.held.take().flatten().map(Ok));
        }
        let (frame, end) = match this.kind.project() {
            KindProj::Inner { mut body } => {
                let frame = ready!(body.as_mut().poll_frame(cx));
                let end = body.is_end_stream();
                (frame, end)
            }
            KindProj::Own { data } => return Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        };
        // The end of the stream, or an error that ends it: the slot goes now, not when a
        // server gets round to dropping the body.
        if end || matches!(frame, None | Some(Err(_))) {
            *this.slot = None;
        }
        let Some(meter) = this.meter.as_mut() else {
            return Poll::Ready(frame);
        };
        let last = match frame {
            Some(Ok(frame)) if end => Some(frame),
            None => None,
            // An error ends the body as a drop does: what was reported is settled (by
            // the meter's drop, in the background); a frame before the end goes out.
            Some(Err(_)) => {
                *this.meter = None;
                return Poll::Ready(frame);
            }
            Some(Ok(_)) => return Poll::Ready(frame),
        };
        // The end goes out once the settle is in the store: a client that waits for it
        // before its next request finds the settle made.
        let settled = match meter.finish() {
            None => true,
            Some(pending) => pending.as_mut().poll(cx).is_ready(),
        };
        if settled {
            *this.meter = None;
            return Poll::Ready(last.map(Ok));
        }
        *this.held = Some(last);
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        // A metered body ends through `poll_frame`, which settles it first.
        if self.meter.is_some() {
            return false;
        }
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Own { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Own { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { body } => f.debug_tuple("ResponseBody::Inner").field(body).finish(),
            Kind::Own { data } => f.debug_tuple("ResponseBody::Own").field(data).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn own_bytes_and_inner_body() {
        let own = ResponseBody::<Full<Bytes>>::own(Bytes::from_static(b"slow down"));
        assert_eq!(own.size_hint().exact(), Some(9));
        assert!(!own.is_end_stream());
        assert_eq!(own.collect().await.unwrap().to_bytes(), "slow down");

        let empty = ResponseBody::<Full<Bytes>>::own(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));

        let inner = ResponseBody::inner(Full::new(Bytes::from_static(b"ok")));
        assert_eq!(inner.collect().await.unwrap().to_bytes(), "ok");
    }
}
