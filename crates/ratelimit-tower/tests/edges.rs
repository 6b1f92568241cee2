//! The layer as a new user meets it: `new`, tests on a manual clock with default settings,
//! missing keys, separate budgets, tiers, readable refusals, the decision in the
//! request, and the fleet share of the fallback.
#![cfg(feature = "axum")]

mod common;
use common::Down;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_tower::{
    Admission, FailurePolicy, GlobalKey, HeaderKey, MissingKey, PeerIp, ProblemJson, RateLimitLayer,
};
use tower::ServiceExt;

const T0: u64 = 1_699_999_200_000_000;

fn store() -> (ManualClock, Arc<MemoryStore<ManualClock>>) {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    (clock, store)
}

fn from(path: &str, ip: &str) -> Request<Body> {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    let addr: SocketAddr = format!("{ip}:40000").parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

async fn status(app: &Router, req: Request<Body>) -> u16 {
    app.clone().oneshot(req).await.unwrap().status().as_u16()
}

async fn body(res: Response<Body>) -> String {
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test]
async fn new_with_defaults_on_a_manual_clock() -> Result<(), Box<dyn std::error::Error>> {
    let (clock, store) = store();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(store, PeerIp::new(), "10/min".parse()?));
    for _ in 0..10 {
        assert_eq!(status(&app, from("/", "203.0.113.9")).await, 200);
    }
    let limited = app.clone().oneshot(from("/", "203.0.113.9")).await?;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    // The denial is now in the deny cache; it must expire with the store's clock.
    assert_eq!(status(&app, from("/", "203.0.113.9")).await, 429);
    clock.advance(Duration::from_secs(120));
    assert_eq!(status(&app, from("/", "203.0.113.9")).await, 200);
    Ok(())
}

#[tokio::test]
async fn no_peer_address_is_a_500_that_says_what_to_do() {
    let (_, store) = store();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            store.clone(),
            PeerIp::new(),
            "10/min".parse().unwrap(),
        ));
    let res = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let text = body(res).await;
    assert!(
        text.contains("into_make_service_with_connect_info"),
        "{text}"
    );

    // Admitting is a choice one makes explicitly.
    let admit = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(store, PeerIp::new())
            .rules("1/min")
            .unwrap()
            .on_missing_key(MissingKey::Admit)
            .build()
            .unwrap(),
    );
    for _ in 0..3 {
        let req = Request::get("/").body(Body::empty()).unwrap();
        assert_eq!(status(&admit, req).await, 200);
    }
}

#[tokio::test]
async fn an_extension_set_by_a_layer_in_the_wrong_order_is_a_500() {
    #[derive(Clone)]
    struct User(String);
    let (_, store) = store();
    let by_user = |req: &Request<Body>| req.extensions().get::<User>().map(|u| u.0.clone());
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            store,
            by_user,
            "1/min".parse().unwrap(),
        ));
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body(res).await.contains("found no key"));
}

#[tokio::test]
async fn exempt_networks_pass_without_fields_or_store_state() {
    let (_, store) = store();
    let layer = RateLimitLayer::new(
        store.clone(),
        PeerIp::new().exempt(["10.0.0.0/8"]).unwrap(),
        "1/min".parse().unwrap(),
    );
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..5 {
        let res = app.clone().oneshot(from("/", "10.1.2.3")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("ratelimit").is_none());
    }
    assert!(store.is_empty());
    assert_eq!(status(&app, from("/", "192.0.2.1")).await, 200);
    assert_eq!(status(&app, from("/", "192.0.2.1")).await, 429);
}

#[tokio::test]
async fn separately_built_layers_have_separate_budgets() {
    let (_, store) = store();
    // The issue's case: "2/min" on each route, built separately, one store.
    let app = Router::new()
        .route(
            "/a",
            get(|| async { "a" }).route_layer(RateLimitLayer::new(
                store.clone(),
                PeerIp::new(),
                "2/min".parse().unwrap(),
            )),
        )
        .route(
            "/b",
            get(|| async { "b" }).route_layer(RateLimitLayer::new(
                store.clone(),
                PeerIp::new(),
                "2/min".parse().unwrap(),
            )),
        );
    let mut codes = Vec::new();
    for path in ["/a", "/a", "/b", "/b", "/a", "/b"] {
        codes.push(status(&app, from(path, "192.0.2.1")).await);
    }
    assert_eq!(codes, [200, 200, 200, 200, 429, 429]);

    let one = |ns: &str| {
        RateLimitLayer::builder(store.clone(), PeerIp::new())
            .rules("2/min")
            .unwrap()
            .namespace(ns)
            .build()
            .unwrap()
    };
    let separate = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(one("a")))
        .route("/b", get(|| async { "b" }).route_layer(one("b")));
    let mut codes = Vec::new();
    for path in ["/a", "/a", "/b", "/b", "/a"] {
        codes.push(status(&separate, from(path, "192.0.2.2")).await);
    }
    assert_eq!(codes, [200, 200, 200, 200, 429]);

    // Sharing is explicit: the same namespace, or a clone of one layer.
    let shared = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(one("both")))
        .route("/b", get(|| async { "b" }).route_layer(one("both")));
    let mut codes = Vec::new();
    for path in ["/a", "/a", "/b"] {
        codes.push(status(&shared, from(path, "192.0.2.3")).await);
    }
    assert_eq!(codes, [200, 200, 429]);
    let layer = RateLimitLayer::new(store, PeerIp::new(), "2/min".parse().unwrap());
    let cloned = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(layer.clone()))
        .route("/b", get(|| async { "b" }).route_layer(layer));
    let mut codes = Vec::new();
    for path in ["/a", "/b", "/b"] {
        codes.push(status(&cloned, from(path, "192.0.2.4")).await);
    }
    assert_eq!(codes, [200, 200, 429]);
}

#[tokio::test]
async fn tiers_have_their_own_rules_budgets_and_policies() {
    let (_, store) = store();
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-api-key"))
        .tier("free", "2/h name=free".parse().unwrap())
        .tier("pro", "5/h name=pro".parse().unwrap())
        .default_tier("free")
        .select_tier(|req: &Request<Body>| {
            req.headers()
                .get("x-plan")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let req = |key: &str, plan: Option<&str>| {
        let mut b = Request::get("/").header("x-api-key", key);
        if let Some(plan) = plan {
            b = b.header("x-plan", plan);
        }
        b.body(Body::empty()).unwrap()
    };
    let res = app.clone().oneshot(req("k1", None)).await.unwrap();
    assert_eq!(res.headers()["ratelimit-policy"], r#""free";q=2;w=3600"#);
    assert_eq!(status(&app, req("k1", None)).await, 200);
    assert_eq!(status(&app, req("k1", None)).await, 429);
    // The same key on another plan has a budget of its own.
    for i in 0..5 {
        let res = app.clone().oneshot(req("k1", Some("pro"))).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "pro request {i}");
        assert_eq!(res.headers()["ratelimit-policy"], r#""pro";q=5;w=3600"#);
    }
    assert_eq!(status(&app, req("k1", Some("pro"))).await, 429);
    // A plan the limits lack is decided under the default tier: neither a free pass nor
    // a 500.
    let res = app.clone().oneshot(req("k2", Some("gold"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["ratelimit-policy"], r#""free";q=2;w=3600"#);
    assert_eq!(status(&app, req("k2", Some("gold"))).await, 200);
    assert_eq!(status(&app, req("k2", None)).await, 429, "one free budget");
}

#[tokio::test]
async fn problem_json_on_request() {
    let (_, store) = store();
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules("1/min fixed-window")
        .unwrap()
        .on_rejection(ProblemJson)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let get = || Request::get("/").body(Body::empty()).unwrap();
    app.clone().oneshot(get()).await.unwrap();
    let res = app.oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert_eq!(res.headers()["retry-after"], "60");
    assert_eq!(
        body(res).await,
        r#"{"type":"about:blank","title":"Too Many Requests","status":429,"detail":"rate limit exceeded, retry in 60 s","retry_after":60}"#
    );
}

#[tokio::test]
async fn handlers_see_the_decision() {
    let (_, store) = store();
    let app = Router::new()
        .route(
            "/",
            get(|Extension(a): Extension<Admission>| async move {
                let r = a.binding().unwrap();
                format!(
                    "remaining={} reset={}s",
                    r.remaining,
                    r.reset_after.as_secs()
                )
            }),
        )
        .layer(
            RateLimitLayer::builder(store, GlobalKey)
                .rules("3/min fixed-window")
                .unwrap()
                .admission_extension(true)
                .build()
                .unwrap(),
        );
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(body(res).await, "remaining=2 reset=60s");
}

/// Two instances, the store down, each one's traffic from the same client: what the
/// fleet admits in one window.
async fn fleet_admits(share: bool) -> usize {
    let instance = || {
        let builder = RateLimitLayer::builder(
            Down {
                clock: Some(ManualClock::new(T0)),
                ..Down::default()
            },
            GlobalKey,
        )
        .rules("10/min sliding-window")
        .unwrap()
        .namespace("api");
        let builder = if share {
            builder.fallback_share(NonZeroU32::new(2).unwrap())
        } else {
            builder.failure_policy(FailurePolicy::Fallback)
        };
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(builder.build().unwrap())
    };
    let fleet = [instance(), instance()];
    let mut admitted = 0;
    for i in 0..100 {
        let req = Request::get("/").body(Body::empty()).unwrap();
        if status(&fleet[i % 2], req).await == 200 {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test]
async fn a_fleet_sharing_the_limit_stays_within_it_during_an_outage() {
    assert_eq!(
        fleet_admits(false).await,
        20,
        "the same rules on each: 2 × the limit"
    );
    assert_eq!(
        fleet_admits(true).await,
        10,
        "half the limit each: the limit"
    );
}
