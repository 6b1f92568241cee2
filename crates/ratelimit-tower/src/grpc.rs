//! Refusals as a gRPC client expects them: a trailers-only response (HTTP 200, the
//! status in the headers, no body), never an HTTP error status, which gRPC clients turn
//! into UNAVAILABLE or INTERNAL.
//!
//! The retry delay travels twice: as `retry-after` metadata (whole seconds, as in HTTP)
//! for any client that reads metadata, and as a `google.rpc.RetryInfo` in
//! `grpc-status-details-bin` (exact, the richer error model of AIP-193 that tonic-types,
//! grpcio-status and the Google client libraries decode). The few protobuf messages
//! involved are encoded here by hand: four messages of scalar and length-delimited
//! fields, fixed in shape, against a protobuf runtime and code generator (prost,
//! prost-derive and their dependencies) in every build of the crate, gRPC or not.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine as _;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use http::Response;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");

const APPLICATION_GRPC: &[u8] = b"application/grpc";

/// What the gRPC spec leaves unencoded in `grpc-message` is printable ASCII other than
/// `%`: control characters, `%` and (always) every non-ASCII byte are encoded.
const GRPC_MESSAGE_SET: &AsciiSet = &CONTROLS.add(b'%');

const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// The gRPC status codes a refusal maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Code {
    InvalidArgument = 3,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Internal = 13,
    Unavailable = 14,
}

/// Whether a request is a gRPC call: content type `application/grpc`, or
/// `application/grpc+proto` and the like (`application/grpc-web` is not: a grpc-web
/// proxy in front of the layer translates it).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= APPLICATION_GRPC.len()
            && v[..APPLICATION_GRPC.len()].eq_ignore_ascii_case(APPLICATION_GRPC)
            && matches!(v.get(APPLICATION_GRPC.len()), None | Some(b'+' | b';'))
    })
}

/// The trailers-only response for a refusal: HTTP 200, `content-type:
/// application/grpc`, `grpc-status`, `grpc-message` and, when the call can be retried
/// later, `grpc-status-details-bin` with a `google.rpc.RetryInfo`. The caller adds the
/// rate-limit fields and `retry-after` as metadata.
pub(crate) fn trailers_only(
    code: Code,
    message: &str,
    retry_after: Option<Duration>,
) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(&GRPC_STATUS, HeaderValue::from(code as u16));
    let encoded = utf8_percent_encode(message, GRPC_MESSAGE_SET).to_string();
    headers.insert(
        &GRPC_MESSAGE,
        HeaderValue::try_from(encoded).expect("percent-encoded text is a valid header value"),
    );
    if let Some(delay) = retry_after {
        let details = STANDARD_NO_PAD.encode(status_with_retry_info(code, message, delay));
        headers.insert(
            &GRPC_STATUS_DETAILS,
            HeaderValue::try_from(details).expect("base64 is a valid header value"),
        );
    }
    response
}

/// `google.rpc.Status { code, message, details: [Any(RetryInfo { retry_delay })] }`.
fn status_with_retry_info(code: Code, message: &str, delay: Duration) -> Vec<u8> {
    // google.protobuf.Duration { int64 seconds = 1; int32 nanos = 2; }
    let mut duration = Vec::with_capacity(16);
    varint_field(&mut duration, 1, delay.as_secs());
    varint_field(&mut duration, 2, u64::from(delay.subsec_nanos()));
    // google.rpc.RetryInfo { Duration retry_delay = 1; }
    let mut retry_info = Vec::with_capacity(duration.len() + 2);
    bytes_field(&mut retry_info, 1, &duration);
    // google.protobuf.Any { string type_url = 1; bytes value = 2; }
    let mut any = Vec::with_capacity(RETRY_INFO_TYPE.len() + retry_info.len() + 4);
    bytes_field(&mut any, 1, RETRY_INFO_TYPE.as_bytes());
    bytes_field(&mut any, 2, &retry_info);
    // google.rpc.Status { int32 code = 1; string message = 2; repeated Any details = 3; }
    let mut status = Vec::with_capacity(message.len() + any.len() + 8);
    varint_field(&mut status, 1, code as u64);
    bytes_field(&mut status, 2, message.as_bytes());
    bytes_field(&mut status, 3, &any);
    status
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A varint field (wire type 0); proto3 leaves a zero out.
fn varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
    if value != 0 {
        varint(out, field << 3);
        varint(out, value);
    }
}

/// A length-delimited field (wire type 2): strings, bytes, messages.
fn bytes_field(out: &mut Vec<u8>, field: u64, value: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, value.len() as u64);
    out.extend_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(content_type: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        h
    }

    #[test]
    fn grpc_content_types() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc;charset=utf-8",
        ] {
            assert!(is_grpc(&headers(ct)), "{ct}");
        }
        for ct in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grp",
            "application/json",
        ] {
            assert!(!is_grpc(&headers(ct)), "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn varints() {
        let enc = |v| {
            let mut out = Vec::new();
            varint(&mut out, v);
            out
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(1), [1]);
        assert_eq!(enc(127), [127]);
        // The protobuf encoding guide's example: 150 is 96 01.
        assert_eq!(enc(150), [0x96, 0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
    }
}
