//! gRPC calls through the layer, at the HTTP level: an inner service whose body is
//! tonic's (which does not convert from bytes), trailers-only refusals with the headers
//! the gRPC spec requires, and the status codes of each refusal.

mod common;
use common::Down;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_tower::{FailurePolicy, PeerIp, RateLimitLayer, ResponseBody};
use tonic::body::Body;
use tonic_types::StatusExt;
use tower::{service_fn, Layer, Service, ServiceExt};

const T0: u64 = 1_699_999_200_000_000;

/// A gRPC service answering every call OK, with tonic's body type.
fn ok_service() -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone
{
    service_fn(|_req: Request<Body>| async {
        let mut res = Response::new(Body::empty());
        res.headers_mut()
            .insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
        res.headers_mut()
            .insert("grpc-status", "0".parse().unwrap());
        Ok::<_, Infallible>(res)
    })
}

fn call(content_type: &str, peer: Option<&str>) -> Request<Body> {
    let mut req = Request::post("/grpc.health.v1.Health/Check")
        .header(CONTENT_TYPE, content_type)
        .header("te", "trailers")
        .body(Body::empty())
        .unwrap();
    if let Some(peer) = peer {
        req.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
    }
    req
}

async fn send<Svc>(svc: &Svc, req: Request<Body>) -> Response<ResponseBody<Body>>
where
    Svc:
        Service<Request<Body>, Response = Response<ResponseBody<Body>>, Error = Infallible> + Clone,
{
    svc.clone().oneshot(req).await.unwrap()
}

#[tokio::test]
async fn a_limited_call_is_a_trailers_only_resource_exhausted() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let layer = RateLimitLayer::new(
        store,
        PeerIp::new(),
        "2/min fixed-window name=rpc".parse().unwrap(),
    );
    let svc = layer.layer(ok_service());

    for _ in 0..2 {
        let ok = send(&svc, call("application/grpc", Some("192.0.2.1:5000"))).await;
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(ok.headers()["grpc-status"], "0");
        assert_eq!(ok.headers()["ratelimit-policy"], r#""rpc";q=2;w=60"#);
    }
    clock.advance(Duration::from_millis(250));
    let limited = send(&svc, call("application/grpc+proto", Some("192.0.2.1:5000"))).await;

    // Trailers-only: HTTP 200, the status in the headers, and no body at all.
    assert_eq!(limited.status(), StatusCode::OK);
    assert!(limited.body().is_end_stream());
    let mut names: Vec<&str> = limited.headers().keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "content-type",
            "grpc-message",
            "grpc-status",
            "grpc-status-details-bin",
            "ratelimit",
            "ratelimit-policy",
            "retry-after"
        ]
    );
    let h = limited.headers();
    assert_eq!(h[CONTENT_TYPE], "application/grpc");
    assert_eq!(h["grpc-status"], "8");
    assert_eq!(h["grpc-message"], "rate limit exceeded, retry in 60 s");
    assert_eq!(h["retry-after"], "60");
    assert_eq!(h["ratelimit-policy"], r#""rpc";q=2;w=60"#);
    assert_eq!(h["ratelimit"], r#""rpc";r=0;t=60"#);

    // What a tonic client makes of it: the code, the message, and the exact delay.
    let status = tonic::Status::from_header_map(h).expect("a grpc-status header");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(status.message(), "rate limit exceeded, retry in 60 s");
    let retry = status.get_details_retry_info().expect("a RetryInfo detail");
    assert_eq!(retry.retry_delay, Some(Duration::from_millis(59_750)));

    let body = limited.into_body().collect().await.unwrap().to_bytes();
    assert!(body.is_empty());

    // The same client over plain HTTP gets the 429 and its text body.
    let http = send(&svc, call("application/json", Some("192.0.2.1:5000"))).await;
    assert_eq!(http.status(), StatusCode::TOO_MANY_REQUESTS);
    let text = http.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(text, "rate limit exceeded, retry in 60 s\n");
}

#[tokio::test]
async fn misconfiguration_is_internal_and_a_closed_store_failure_unavailable() {
    let store = Arc::new(MemoryStore::new());
    let svc =
        RateLimitLayer::new(store, PeerIp::new(), "2/min".parse().unwrap()).layer(ok_service());
    // No peer address anywhere: the server's configuration, not the client's fault.
    let missing = send(&svc, call("application/grpc", None)).await;
    assert_eq!(missing.status(), StatusCode::OK);
    assert_eq!(missing.headers()["grpc-status"], "13");
    let status = tonic::Status::from_header_map(missing.headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::Internal);
    assert!(
        status
            .message()
            .starts_with("rate limiting is misconfigured: "),
        "{}",
        status.message()
    );
    // No delay to tell: no details.
    assert!(!missing.headers().contains_key("grpc-status-details-bin"));
    assert!(missing.body().is_end_stream());

    let down = RateLimitLayer::builder(Down::default(), PeerIp::new())
        .rules("2/min")
        .unwrap()
        .failure_policy(FailurePolicy::FailClosed)
        .build()
        .unwrap()
        .layer(ok_service());
    let unavailable = send(&down, call("application/grpc", Some("192.0.2.1:5000"))).await;
    assert_eq!(unavailable.status(), StatusCode::OK);
    let status = tonic::Status::from_header_map(unavailable.headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn messages_are_percent_encoded() {
    use ratelimit_tower::key::Extraction;

    // What a key extractor says is missing travels into the message: quotes, a percent
    // sign and non-ASCII text must arrive as sent.
    let key = |_: &Request<Body>| Extraction::<String>::Missing("\"100% gratuit é\"".into());
    let layer = RateLimitLayer::builder(MemoryStore::new(), key)
        .rules("2/min")
        .unwrap()
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let res = send(&svc, call("application/grpc", Some("192.0.2.1:5000"))).await;
    let raw = res.headers()["grpc-message"].to_str().unwrap();
    assert!(raw.contains("100%25 gratuit %C3%A9"), "{raw}");
    let status = tonic::Status::from_header_map(res.headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::Internal);
    assert!(
        status.message().contains("100% gratuit é"),
        "{}",
        status.message()
    );
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn peer_ip_reads_tonic_connect_info() {
    use ratelimit_tower::key::{Extraction, KeyExtractor};
    use tonic::transport::server::TcpConnectInfo;

    let mut req = call("application/grpc", None);
    req.extensions_mut().insert(TcpConnectInfo {
        local_addr: None,
        remote_addr: Some("198.51.100.7:6000".parse().unwrap()),
    });
    let Extraction::Key(key) = PeerIp::new().extract(&req) else {
        panic!("no key from tonic's connect info")
    };
    assert_eq!(key.to_string(), "198.51.100.7");
    // A connection without a known peer is still no key.
    let mut req = call("application/grpc", None);
    req.extensions_mut().insert(TcpConnectInfo {
        local_addr: None,
        remote_addr: None,
    });
    assert!(matches!(
        PeerIp::new().extract(&req),
        Extraction::Missing(_)
    ));
}

/// A shaping rule delays a gRPC call as it delays any request, and a call beyond the
/// queue is refused as RESOURCE_EXHAUSTED with the delay to wait.
#[tokio::test(start_paused = true)]
async fn shaping_delays_grpc_calls() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock).build());
    let svc = RateLimitLayer::new(
        store,
        ratelimit_tower::GlobalKey,
        "2/s leaky-bucket mode=shaper burst=1".parse().unwrap(),
    )
    .layer(ok_service());
    let start = tokio::time::Instant::now();
    let timed = |svc| async move {
        let res = send(&svc, call("application/grpc", None)).await;
        (res, start.elapsed())
    };
    let (a, b, c) = tokio::join!(timed(svc.clone()), timed(svc.clone()), timed(svc));
    assert_eq!(
        (a.0.headers()["grpc-status"].to_str().unwrap(), a.1),
        ("0", Duration::ZERO)
    );
    assert_eq!(
        (b.0.headers()["grpc-status"].to_str().unwrap(), b.1),
        ("0", Duration::from_millis(500))
    );
    // The queue is full: refused at once, not delayed.
    let (refused, waited) = c;
    assert_eq!(waited, Duration::ZERO);
    assert_eq!(refused.status(), StatusCode::OK);
    let status = tonic::Status::from_header_map(refused.headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    let retry = status.get_details_retry_info().expect("a RetryInfo detail");
    assert_eq!(retry.retry_delay, Some(Duration::from_millis(500)));
}

#[tokio::test]
async fn a_call_without_its_key_header_is_invalid_argument() {
    let svc = RateLimitLayer::new(
        MemoryStore::new(),
        ratelimit_tower::HeaderKey::new("x-api-key"),
        "2/min".parse().unwrap(),
    )
    .layer(ok_service());
    let res = send(&svc, call("application/grpc", None)).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.body().is_end_stream());
    let status = tonic::Status::from_header_map(res.headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("x-api-key"),
        "{}",
        status.message()
    );

    let mut with_key = call("application/grpc", None);
    with_key
        .headers_mut()
        .insert("x-api-key", "k-1".parse().unwrap());
    let res = send(&svc, with_key).await;
    assert_eq!(res.headers()["grpc-status"], "0");
}

/// Charging by outcome on gRPC: a call that failed at once is a trailers-only response,
/// its `grpc-status` in the head the predicate reads; only failed calls count.
#[tokio::test]
async fn charge_when_sees_the_status_of_a_trailers_only_call() {
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .rules("2/min fixed-window name=failures")
        .unwrap()
        .charge_when(|res: &http::response::Parts| {
            res.headers.get("grpc-status").is_some_and(|s| s != "0")
        })
        .build()
        .unwrap();
    // The method names the status the call ends with.
    let svc = layer.layer(service_fn(|req: Request<Body>| async move {
        let status = if req.uri().path().ends_with("Fail") {
            "16"
        } else {
            "0"
        };
        let mut res = Response::new(Body::empty());
        res.headers_mut()
            .insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
        res.headers_mut()
            .insert("grpc-status", status.parse().unwrap());
        Ok::<_, Infallible>(res)
    }));
    let at = |path: &str| {
        let mut req = call("application/grpc", Some("192.0.2.7:5000"));
        *req.uri_mut() = path.parse().unwrap();
        req
    };
    for _ in 0..10 {
        let res = send(&svc, at("/pkg.Svc/Ok")).await;
        assert_eq!(res.headers()["grpc-status"], "0");
    }
    for _ in 0..2 {
        assert_eq!(
            send(&svc, at("/pkg.Svc/Fail")).await.headers()["grpc-status"],
            "16"
        );
    }
    // Two failures spent the budget: the next call is refused, whatever its method.
    let refused = send(&svc, at("/pkg.Svc/Ok")).await;
    assert_eq!(refused.status(), StatusCode::OK);
    assert_eq!(refused.headers()["grpc-status"], "8");
}

/// A server-streaming call reports its usage as it sends its trailers: the layer settles
/// it once, when the stream ends, before the end reaches the client.
#[tokio::test]
async fn a_streamed_call_is_settled_when_its_stream_ends() {
    use bytes::Bytes;
    use futures_util::StreamExt;
    use http::HeaderMap;
    use http_body::Frame;
    use ratelimit_tower::Usage;

    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let layer = RateLimitLayer::builder(Arc::clone(&store), PeerIp::new())
        .rules("1000/h fixed-window name=tokens")
        .unwrap()
        .cost(|_: &Request<Body>| 100)
        .usage_extension(true)
        .build()
        .unwrap();
    let streaming = service_fn(|req: Request<Body>| async move {
        let usage = req
            .extensions()
            .get::<Usage>()
            .cloned()
            .expect("the layer's Usage");
        let frames = futures_util::stream::iter(0..4u8).map(move |i| {
            Ok::<_, Infallible>(if i < 3 {
                Frame::data(Bytes::from(vec![0, 0, 0, 0, 1, i]))
            } else {
                usage.report(640);
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", "0".parse().unwrap());
                Frame::trailers(trailers)
            })
        });
        let mut res = Response::new(Body::new(http_body_util::StreamBody::new(frames)));
        res.headers_mut()
            .insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
        Ok::<_, Infallible>(res)
    });
    let svc = layer.layer(streaming);
    let res = send(&svc, call("application/grpc", Some("192.0.2.1:5000"))).await;
    assert!(res.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .contains(";r=900;"));
    let collected = res.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
    let next = send(&svc, call("application/grpc", Some("192.0.2.1:5000"))).await;
    // 640 settled, 100 reserved.
    assert!(
        next.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains(";r=260;"),
        "{:?}",
        next.headers()["ratelimit"]
    );
}
