//! What a refused request gets: the reason, the status, and the hook that builds the
//! response body ([`PlainText`] by default, [`ProblemJson`] for RFC 9457).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use ratelimit_core::Decision;

use crate::body::ResponseBody;
use crate::charge::Refused;
use crate::grpc::{self, Code};
use crate::headers::{ceil_secs, write_refusal};

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
    /// The store failed, and the request costs more than the fallback store's rules
    /// (this instance's [share](crate::RateLimitLayerBuilder::fallback_share) of the
    /// limit) grant at once, though no more than the layer's rules do (503, with
    /// `Retry-After`): it is admissible again once the store answers, so it is not
    /// refused as [`CostExceedsCapacity`](RejectReason::CostExceedsCapacity).
    CostExceedsShare {
        /// The request's cost.
        cost: u64,
        /// The most the fallback rule grants at once.
        share: u64,
    },
    /// The client left out what the key is made of, such as the header an API key is read
    /// from (400 unless configured, see
    /// [`omitted_key_status`](crate::RateLimitLayerBuilder::omitted_key_status)).
    KeyOmitted,
    /// No key was found in the request and the [`MissingKey`](crate::MissingKey) policy
    /// refuses (500): the layer or the server is misconfigured.
    MissingKey,
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
    pub(crate) detail: Option<Cow<'static, str>>,
}

impl Rejection {
    /// A rejection with nothing known but its reason and status.
    pub(crate) fn new(reason: RejectReason, status: StatusCode) -> Self {
        Self {
            reason,
            status,
            retry_after: None,
            decision: None,
            detail: None,
        }
    }

    /// Why.
    pub fn reason(&self) -> RejectReason {
        self.reason
    }

    /// The status the response gets.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// When the same request would be admitted; `None` when it never will be without a
    /// change (an endless block, a cost above capacity, a store outage, a
    /// misconfiguration).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The store's decision, when there was one.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// The status a gRPC client gets.
    pub(crate) fn grpc_code(&self) -> Code {
        match self.reason {
            RejectReason::Blocked if self.status == StatusCode::FORBIDDEN => Code::PermissionDenied,
            // gRPC itself answers RESOURCE_EXHAUSTED to a message above the receiver's
            // size limit: the nearest thing to a cost above capacity (HTTP 413).
            RejectReason::Limited
            | RejectReason::Blocked
            | RejectReason::DelayTooLong
            | RejectReason::CostExceedsCapacity { .. } => Code::ResourceExhausted,
            RejectReason::StoreUnavailable | RejectReason::CostExceedsShare { .. } => {
                Code::Unavailable
            }
            // The client left out what its key is made of: its own mistake.
            RejectReason::KeyOmitted => Code::InvalidArgument,
            // The server's configuration, not the client's fault.
            RejectReason::MissingKey => Code::Internal,
        }
    }

    /// A one-line explanation for people: "rate limit exceeded, retry in 3 s", or for a
    /// misconfiguration what is missing.
    pub fn message(&self) -> String {
        let retry = self.retry_after.map(|d| ceil_secs(d).max(1));
        match (self.reason, retry) {
            (RejectReason::Limited | RejectReason::DelayTooLong, Some(s)) => {
                format!("rate limit exceeded, retry in {s} s")
            }
            (RejectReason::Limited | RejectReason::DelayTooLong, None) => {
                "rate limit exceeded".into()
            }
            (RejectReason::Blocked, Some(s)) => format!("access blocked, retry in {s} s"),
            (RejectReason::Blocked, None) => "access blocked".into(),
            (RejectReason::CostExceedsCapacity { cost, capacity }, _) => format!(
                "request cost {cost} exceeds the rate limit's capacity of {capacity}; \
                 it can never be admitted"
            ),
            (RejectReason::StoreUnavailable, _) => "rate limiter unavailable, retry later".into(),
            (RejectReason::CostExceedsShare { cost, share }, retry) => format!(
                "the shared rate-limit store is unreachable, and this instance's share of \
                 the limit ({share}) cannot admit a request of cost {cost}; retry in {} s",
                retry.unwrap_or(1)
            ),
            (RejectReason::KeyOmitted, _) => format!(
                "the request cannot be rate limited: {}",
                self.detail.as_deref().unwrap_or("no key")
            ),
            (RejectReason::MissingKey, _) => format!(
                "rate limiting is misconfigured: {}",
                self.detail.as_deref().unwrap_or("no key")
            ),
        }
    }
}

/// Builds the response for a refused request. The layer then sets its status and adds
/// `Retry-After`, `RateLimit-Policy` and `RateLimit`, so the hook only chooses the body
/// and any headers of its own.
///
/// Implemented for closures `Fn(&Rejection) -> Response<T>` where the body `T` converts
/// into [`Bytes`] (`String`, `&'static str`, `Vec<u8>`), and by [`PlainText`] (the
/// default) and [`ProblemJson`]. The hook is held boxed, so it is not part of the
/// layer's type.
///
/// ```
/// use http::Response;
/// use ratelimit_tower::{OnRejection, Rejection};
///
/// let json = |r: &Rejection| {
///     let secs = r.retry_after().map_or(0, |d| d.as_secs());
///     Response::builder()
///         .header("content-type", "application/json")
///         .body(format!(r#"{{"error":"slow down","retry_after":{secs}}}"#))
///         .unwrap()
/// };
/// # fn takes<H: OnRejection>(_: H) {}
/// # takes(json);
/// ```
pub trait OnRejection: Send + Sync + 'static {
    /// The response for `rejection`.
    fn rejection(&self, rejection: &Rejection) -> Response<Bytes>;
}

impl<F, T> OnRejection for F
where
    F: Fn(&Rejection) -> Response<T> + Send + Sync + 'static,
    T: Into<Bytes>,
{
    fn rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        self(rejection).map(Into::into)
    }
}

/// A short `text/plain` body: `rate limit exceeded, retry in 3 s` (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainText;

impl OnRejection for PlainText {
    fn rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        let mut body = rejection.message();
        body.push('\n');
        let mut response = Response::new(Bytes::from(body));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
    }
}

/// An RFC 9457 `application/problem+json` body:
/// `{"type":"about:blank","title":"Too Many Requests","status":429,"detail":"rate limit
/// exceeded, retry in 3 s","retry_after":3}` (`retry_after` only when known).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemJson;

impl OnRejection for ProblemJson {
    fn rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        let status = rejection.status;
        let mut body = format!(
            r#"{{"type":"about:blank","title":"{}","status":{},"detail":""#,
            status.canonical_reason().unwrap_or("Error"),
            status.as_u16()
        );
        json_escape_into(&rejection.message(), &mut body);
        body.push('"');
        if let Some(retry) = rejection.retry_after {
            body.push_str(&format!(r#","retry_after":{}"#, ceil_secs(retry).max(1)));
        }
        body.push('}');
        let mut response = Response::new(Bytes::from(body));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

fn json_escape_into(text: &str, out: &mut String) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

/// A refusal as decided, turned into a response only where the response body type is
/// known.
pub(crate) struct Refusal {
    pub(crate) rejection: Rejection,
    pub(crate) policy: Option<HeaderValue>,
    pub(crate) ratelimit: Option<HeaderValue>,
    pub(crate) hook: Arc<dyn OnRejection>,
}

impl Refusal {
    /// The response to the request whose headers are `request`: trailers-only for a gRPC
    /// call (the hook is not asked: such a response has no body), else the hook's with
    /// the refusal's status.
    pub(crate) fn into_response<B>(self, request: &HeaderMap) -> Response<ResponseBody<B>> {
        let mut response = if grpc::is_grpc(request) {
            let rejection = &self.rejection;
            grpc::trailers_only(
                rejection.grpc_code(),
                &rejection.message(),
                rejection.retry_after,
            )
        } else {
            let mut response = self.hook.rejection(&self.rejection);
            *response.status_mut() = self.rejection.status;
            response
        };
        write_refusal(
            response.headers_mut(),
            self.rejection.retry_after,
            self.policy,
            self.ratelimit,
        );
        // The layers around this one give back what they charged.
        response.extensions_mut().insert(Refused);
        response.map(ResponseBody::own)
    }
}

/// The answer to a request whose charge predicate panicked.
pub(crate) fn internal_error<B>() -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::own(Bytes::from_static(
        b"internal error while rate limiting\n",
    )));
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_and_problem_json() {
        let mut r = Rejection::new(RejectReason::Limited, StatusCode::TOO_MANY_REQUESTS);
        r.retry_after = Some(Duration::from_millis(2500));
        let plain = PlainText.rejection(&r);
        assert_eq!(plain.headers()[CONTENT_TYPE], "text/plain; charset=utf-8");
        assert_eq!(plain.body(), "rate limit exceeded, retry in 3 s\n");
        let json = ProblemJson.rejection(&r);
        assert_eq!(json.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(
            json.body(),
            r#"{"type":"about:blank","title":"Too Many Requests","status":429,"detail":"rate limit exceeded, retry in 3 s","retry_after":3}"#
        );
        let mut m = Rejection::new(RejectReason::MissingKey, StatusCode::INTERNAL_SERVER_ERROR);
        m.detail = Some("no \"peer\" address".into());
        let json = ProblemJson.rejection(&m);
        assert_eq!(
            json.body(),
            r#"{"type":"about:blank","title":"Internal Server Error","status":500,"detail":"rate limiting is misconfigured: no \"peer\" address"}"#
        );
    }

    #[test]
    fn grpc_codes_by_reason_and_status() {
        let code_of = |reason, status| Rejection::new(reason, status).grpc_code();
        let cases = [
            (
                RejectReason::Limited,
                StatusCode::TOO_MANY_REQUESTS,
                Code::ResourceExhausted,
            ),
            (
                RejectReason::DelayTooLong,
                StatusCode::TOO_MANY_REQUESTS,
                Code::ResourceExhausted,
            ),
            (
                RejectReason::Blocked,
                StatusCode::TOO_MANY_REQUESTS,
                Code::ResourceExhausted,
            ),
            (
                RejectReason::Blocked,
                StatusCode::FORBIDDEN,
                Code::PermissionDenied,
            ),
            (
                RejectReason::StoreUnavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
            ),
            (
                RejectReason::CostExceedsShare { cost: 3, share: 2 },
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
            ),
            (
                RejectReason::MissingKey,
                StatusCode::INTERNAL_SERVER_ERROR,
                Code::Internal,
            ),
            (
                RejectReason::KeyOmitted,
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
            ),
            (
                RejectReason::KeyOmitted,
                StatusCode::UNAUTHORIZED,
                Code::InvalidArgument,
            ),
        ];
        for (reason, status, want) in cases {
            assert_eq!(code_of(reason, status), want, "{reason:?} {status}");
        }
    }
}
