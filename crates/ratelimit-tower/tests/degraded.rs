//! While the store is down and a fallback store holds the instance to its share, the
//! answers describe the share: the fields name the fallback's rules, and a request the
//! share cannot hold is unavailable (503), not "never admissible" (413).
#![cfg(feature = "axum")]

mod common;
use common::Down;

use std::num::NonZeroU32;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use ratelimit_core::ManualClock;
use ratelimit_tower::{GlobalKey, HeaderKey, ProblemJson, RateLimitLayer, RateLimitLayerBuilder};
use tower::ServiceExt;

const T0: u64 = 1_699_999_200_000_000;

fn down() -> Down {
    Down {
        clock: Some(ManualClock::new(T0)),
        ..Down::default()
    }
}

fn share(instances: u32) -> NonZeroU32 {
    NonZeroU32::new(instances).unwrap()
}

fn app<C>(builder: RateLimitLayerBuilder<Down, GlobalKey, C>) -> Router
where
    C: ratelimit_tower::RequestCost<Body>,
{
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/fails",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed") }),
        )
        .layer(builder.build().unwrap())
}

fn get_req(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn costing(cost: u64) -> Request<Body> {
    Request::get("/")
        .header("x-cost", cost.to_string())
        .body(Body::empty())
        .unwrap()
}

fn cost_header(req: &Request<Body>) -> u64 {
    req.headers()
        .get("x-cost")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1)
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

async fn body(res: Response<Body>) -> String {
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A 100/min rule shared by 4 instances is enforced as 25/min while the store is down,
/// and every answer says so: admitted, refused, and refused from the deny cache.
#[tokio::test]
async fn the_fields_describe_the_share_while_the_store_is_down() {
    let app = app(RateLimitLayer::builder(down(), GlobalKey)
        .rules("100/min fixed-window name=api; 1000/h fixed-window")
        .unwrap()
        .namespace("shop")
        .fallback_share(share(4)));
    let policy = r#""api/fallback";q=25;w=60, "250-per-1h@shop/fallback";q=250;w=3600"#;
    let first = app.clone().oneshot(get_req("/")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(header(&first, "ratelimit-policy"), Some(policy));
    assert_eq!(
        header(&first, "ratelimit"),
        Some(r#""api/fallback";r=24;t=60, "250-per-1h@shop/fallback";r=249;t=3600"#)
    );
    for i in 2..=25 {
        let res = app.clone().oneshot(get_req("/")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {i}");
    }
    // Refused by the fallback, then by the deny cache: the same share, by the same names.
    for what in ["the fallback", "the deny cache"] {
        let res = app.clone().oneshot(get_req("/")).await.unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{what}");
        assert_eq!(header(&res, "retry-after"), Some("60"), "{what}");
        assert_eq!(header(&res, "ratelimit-policy"), Some(policy), "{what}");
        assert_eq!(
            header(&res, "ratelimit"),
            Some(r#""api/fallback";r=0;t=60, "250-per-1h@shop/fallback";r=225;t=3600"#),
            "{what}"
        );
    }
}

/// The fields a fallback charge wrote are given back as the store's are: a response that
/// does not count shows its unit back in the fallback's item.
#[tokio::test]
async fn a_fallback_charge_given_back_shows_in_the_fallback_item() {
    let app = app(RateLimitLayer::builder(down(), GlobalKey)
        .rules("100/min fixed-window name=api")
        .unwrap()
        .fallback_share(share(4))
        .charge_when(|res: &http::response::Parts| res.status.is_success()));
    let counted = app.clone().oneshot(get_req("/")).await.unwrap();
    assert_eq!(
        header(&counted, "ratelimit"),
        Some(r#""api/fallback";r=24;t=60"#)
    );
    let given_back = app.clone().oneshot(get_req("/fails")).await.unwrap();
    assert_eq!(given_back.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        header(&given_back, "ratelimit"),
        Some(r#""api/fallback";r=24;t=60"#),
        "23 after its own charge, 24 once given back"
    );
}

/// A cost the shared rule holds but the instance's share does not is unavailable until
/// the store is back: 503 with `Retry-After` and a body that says why, never 413. A
/// cost above the shared rule itself stays 413.
#[tokio::test]
async fn a_cost_above_the_share_is_unavailable_not_never() {
    let app = app(RateLimitLayer::builder(down(), GlobalKey)
        .rules("40000/min fixed-window name=tokens")
        .unwrap()
        .fallback_share(share(2))
        .cost(cost_header));
    let res = app.clone().oneshot(costing(30_000)).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The rule's minute, cut to 10 s: the store may be back long before.
    assert_eq!(header(&res, "retry-after"), Some("10"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some(r#""tokens/fallback";q=20000;w=60"#)
    );
    assert_eq!(header(&res, "ratelimit"), None);
    let text = body(res).await;
    assert!(text.contains("store is unreachable"), "{text}");
    assert!(text.contains("20000") && text.contains("30000"), "{text}");
    assert!(!text.contains("never"), "{text}");

    // Nothing was charged: the share still holds its whole 20,000.
    let fits = app.clone().oneshot(costing(20_000)).await.unwrap();
    assert_eq!(fits.status(), StatusCode::OK);

    let never = app.clone().oneshot(costing(50_000)).await.unwrap();
    assert_eq!(never.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        header(&never, "ratelimit-policy"),
        Some(r#""tokens";q=40000;w=60"#),
        "refused by the shared rule, before any store"
    );
    let text = body(never).await;
    assert!(text.contains("can never be admitted"), "{text}");
}

/// `Retry-After` is the period of the rule whose share cannot hold the cost when that is
/// shorter than 10 s; a gRPC call is told UNAVAILABLE, and `ProblemJson` says 503.
#[tokio::test]
async fn a_short_rules_share_retries_within_its_period_in_every_format() {
    let builder = || {
        RateLimitLayer::builder(down(), HeaderKey::new("x-key"))
            .rules("10/s token-bucket capacity=10")
            .unwrap()
            .fallback_share(share(4))
            .cost(cost_header)
    };
    let layer = builder().on_rejection(ProblemJson).build().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let req = |grpc: bool| {
        let mut req = Request::get("/").header("x-key", "k").header("x-cost", "5");
        if grpc {
            req = req.header("content-type", "application/grpc");
        }
        req.body(Body::empty()).unwrap()
    };
    let res = app.clone().oneshot(req(false)).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    let text = body(res).await;
    assert!(
        text.starts_with(r#"{"type":"about:blank","title":"Service Unavailable","status":503,"#),
        "{text}"
    );
    assert!(text.ends_with(r#","retry_after":1}"#), "{text}");

    let res = app.oneshot(req(true)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK, "gRPC refusals are HTTP 200");
    assert_eq!(header(&res, "grpc-status"), Some("14"), "UNAVAILABLE");
    assert_eq!(header(&res, "retry-after"), Some("1"));
}
