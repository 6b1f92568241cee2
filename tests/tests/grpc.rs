//! gRPC over loopback: a real tonic server (tonic's health service) behind the layer, a
//! real tonic client, and an axum route on the same store sharing the budget. State in a
//! MemoryStore on a manual clock, so every delay is exact.

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{client, TestServer};
use ratelimit_tower::{PeerIp, RateLimitLayer};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;

/// Aligned to the hour, so fixed windows start here.
const T0: u64 = 1_699_999_200_000_000;

/// Serves tonic's health service behind `$layer` on a free loopback port; gives a client
/// connected to it and the server's task (aborted by the caller).
macro_rules! serve_health {
    ($layer:expr) => {{
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_reporter, health) = tonic_health::server::health_reporter();
        let router = Server::builder().layer($layer).add_service(health);
        let task = tokio::spawn(async move {
            router
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        (HealthClient::new(channel), task)
    }};
}

async fn check(
    client: &mut HealthClient<Channel>,
) -> Result<tonic::Response<ServingStatus>, tonic::Status> {
    let res = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    let (metadata, body, extensions) = res.into_parts();
    Ok(tonic::Response::from_parts(
        metadata,
        body.status(),
        extensions,
    ))
}

#[tokio::test]
async fn grpc_calls_and_an_axum_route_share_one_budget() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    // One layer, cloned onto both servers: one budget per peer address.
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .rules("4/min fixed-window name=api")
        .unwrap()
        .build()
        .unwrap();
    let (mut grpc, grpc_task) = serve_health!(layer.clone());
    let http_server = TestServer::start(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .route_layer(layer),
    )
    .await;
    let http = client();

    for remaining in [3, 2, 1] {
        let ok = check(&mut grpc).await.expect("admitted");
        assert_eq!(*ok.get_ref(), ServingStatus::Serving);
        // The rate-limit fields arrive as initial metadata.
        assert_eq!(
            ok.metadata().get("ratelimit-policy").unwrap(),
            r#""api";q=4;w=60"#
        );
        assert_eq!(
            ok.metadata().get("ratelimit").unwrap(),
            &*format!(r#""api";r={remaining};t=60"#)
        );
    }
    // The fourth unit of the budget, spent over HTTP by the same peer.
    let res = http.get(http_server.url("/")).send().await.unwrap();
    assert_eq!(res.status(), 200);

    clock.advance(Duration::from_millis(250));
    let limited = check(&mut grpc).await.expect_err("the budget is spent");
    assert_eq!(limited.code(), Code::ResourceExhausted);
    assert_eq!(limited.message(), "rate limit exceeded, retry in 60 s");
    // The delay, twice: whole seconds as metadata, exact in a google.rpc.RetryInfo.
    assert_eq!(limited.metadata().get("retry-after").unwrap(), "60");
    let retry = limited
        .get_details_retry_info()
        .expect("a RetryInfo detail");
    assert_eq!(retry.retry_delay, Some(Duration::from_millis(59_750)));
    assert_eq!(
        limited.metadata().get("ratelimit").unwrap(),
        r#""api";r=0;t=60"#
    );

    // The HTTP route sees the same spent budget.
    let res = http.get(http_server.url("/")).send().await.unwrap();
    assert_eq!(res.status(), 429);

    // A new window admits again.
    clock.advance(Duration::from_secs(60));
    check(&mut grpc).await.expect("admitted in the next window");
    grpc_task.abort();
}

/// The tenant an authentication layer should have put into the request.
#[derive(Clone)]
struct Tenant(String);

#[tokio::test]
async fn misconfiguration_is_internal() {
    // The authentication layer that sets the tenant is missing: the server's fault.
    let layer = RateLimitLayer::new(
        MemoryStore::new(),
        |req: &http::Request<tonic::body::Body>| {
            req.extensions().get::<Tenant>().map(|t| t.0.clone())
        },
        "4/min".parse().unwrap(),
    );
    let (mut grpc, grpc_task) = serve_health!(layer);
    let status = check(&mut grpc).await.expect_err("refused");
    assert_eq!(status.code(), Code::Internal);
    assert!(
        status
            .message()
            .starts_with("rate limiting is misconfigured"),
        "{}",
        status.message()
    );
    // Nothing to wait for: no retry delay.
    assert!(status.get_details_retry_info().is_none());
    assert!(status.metadata().get("retry-after").is_none());
    grpc_task.abort();
}

/// A server-streaming call (health `Watch`) holds its concurrency slot to the stream's
/// end: a unary call meanwhile is refused with `RESOURCE_EXHAUSTED`, and admitted once
/// the client drops the stream.
#[tokio::test]
async fn a_server_stream_holds_its_slot_to_its_end() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .rules("100/min; 1 concurrent")
        .unwrap()
        .without_deny_cache()
        .build()
        .unwrap();
    let (mut grpc, task) = serve_health!(layer);
    let mut watch = grpc
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().is_some(), "the first status");
    let refused = check(&mut grpc).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    drop(watch);
    // The server sees the stream's end once the client's reset arrives.
    let mut admitted = false;
    for _ in 0..100 {
        if check(&mut grpc).await.is_ok() {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(admitted, "the stream's slot was never released");
    task.abort();
}
