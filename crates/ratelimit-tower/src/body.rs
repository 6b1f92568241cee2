//! [`ResponseBody`]: the inner service's body, or the layer's own for a refusal.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

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
        let frame = match this.kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Own { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        };
        // The end of the stream, or an error that ends it: the slot goes now, not when a
        // server gets round to dropping the body.
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            *this.slot = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
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
