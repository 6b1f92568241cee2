//! Over real HTTP: requests without a key (issue 8, item 3), separate budgets (item 4),
//! per-route limits that 404/405 answers do not spend (item 8), and forwarded headers
//! poisoned by the client (item 9).

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{client, one, TestServer};
use ratelimit_tower::{ClientIp, ForwardedHeader, PeerIp, RateLimitLayer};
use reqwest::header::HeaderValue;

fn store() -> Arc<MemoryStore<ManualClock>> {
    Arc::new(
        MemoryStore::builder()
            .clock(ManualClock::new(1_699_999_200_000_000))
            .build(),
    )
}

async fn codes(server: &TestServer, requests: &[(&str, &str)]) -> Vec<u16> {
    let http = client();
    let mut out = Vec::new();
    for (method, path) in requests {
        let req = match *method {
            "GET" => http.get(server.url(path)),
            "POST" => http.post(server.url(path)),
            other => panic!("{other}"),
        };
        out.push(req.send().await.unwrap().status().as_u16());
    }
    out
}

#[tokio::test]
async fn served_without_peer_addresses_every_request_is_a_500_that_says_why() {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            store(),
            PeerIp::new(),
            "10/min".parse().unwrap(),
        ));
    let server = TestServer::start_without_peer_addresses(app).await;
    let http = client();
    for _ in 0..20 {
        let res = http.get(server.url("/")).send().await.unwrap();
        assert_eq!(res.status(), 500);
        assert_eq!(
            one(&res, "content-type").as_deref(),
            Some("text/plain; charset=utf-8")
        );
        let body = res.text().await.unwrap();
        assert!(
            body.contains("into_make_service_with_connect_info"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn exempt_networks_are_not_limited_over_http() {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            store(),
            PeerIp::new().exempt(["127.0.0.0/8"]).unwrap(),
            "1/min".parse().unwrap(),
        ));
    let server = TestServer::start(app).await;
    let got = codes(&server, &[("GET", "/"), ("GET", "/"), ("GET", "/")]).await;
    assert_eq!(got, [200, 200, 200]);
}

#[tokio::test]
async fn two_layers_built_separately_keep_separate_budgets() {
    let store = store();
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
                store,
                PeerIp::new(),
                "2/min".parse().unwrap(),
            )),
        );
    let server = TestServer::start(app).await;
    let got = codes(
        &server,
        &[
            ("GET", "/a"),
            ("GET", "/a"),
            ("GET", "/b"),
            ("GET", "/b"),
            ("GET", "/b"),
        ],
    )
    .await;
    assert_eq!(got, [200, 200, 200, 200, 429]);
}

#[tokio::test]
async fn a_shared_namespace_shares_the_budget_over_http() {
    let store = store();
    let layer = |store| {
        RateLimitLayer::builder(store, PeerIp::new())
            .rules("2/min")
            .unwrap()
            .namespace("writes")
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route(
            "/a",
            post(|| async { "a" }).route_layer(layer(store.clone())),
        )
        .route("/b", post(|| async { "b" }).route_layer(layer(store)));
    let server = TestServer::start(app).await;
    let got = codes(&server, &[("POST", "/a"), ("POST", "/b"), ("POST", "/a")]).await;
    assert_eq!(got, [200, 200, 429]);
}

#[tokio::test]
async fn unmatched_methods_and_paths_spend_no_login_budget() {
    let login = RateLimitLayer::new(store(), PeerIp::new(), "5/min name=login".parse().unwrap());
    let app = Router::new().route("/login", post(|| async { "welcome" }).route_layer(login));
    let server = TestServer::start(app).await;
    let wrong: Vec<(&str, &str)> = vec![("GET", "/login"); 6];
    assert_eq!(codes(&server, &wrong).await, [405; 6]);
    assert_eq!(codes(&server, &[("GET", "/nope")]).await, [404]);
    let http = client();
    let res = http.get(server.url("/login")).send().await.unwrap();
    assert_eq!(res.status(), 405);
    assert!(one(&res, "ratelimit").is_none());
    let res = http.post(server.url("/login")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        one(&res, "ratelimit").as_deref(),
        Some(r#""login";r=4;t=12"#)
    );
}

/// The test client plays the trusted proxy (127.0.0.1): it forwards for 203.0.113.9,
/// whose own header (left of what the proxy appends) is poisoned every other time.
async fn poisoned(header: ForwardedHeader, name: &str, clean: &[u8], poison: &[u8]) {
    let key = ClientIp::trusting(["127.0.0.1"]).unwrap().header(header);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(store(), key, "5/min".parse().unwrap()));
    let server = TestServer::start(app).await;
    let http = client();
    let mut admitted = 0;
    for i in 0..20 {
        let value = if i % 2 == 0 { clean } else { poison };
        let res = http
            .get(server.url("/"))
            .header(name, HeaderValue::from_bytes(value).unwrap())
            .send()
            .await
            .unwrap();
        if res.status() == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "{name}: the client gets its limit, no more");
    // The proxy's own key, and so everyone else behind it, is untouched.
    let other = if name == "forwarded" {
        &b"for=198.51.100.1"[..]
    } else {
        &b"198.51.100.1"[..]
    };
    let res = http
        .get(server.url("/"))
        .header(name, HeaderValue::from_bytes(other).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
}

#[tokio::test]
async fn poisoned_x_forwarded_for_keeps_the_client_key() {
    poisoned(
        ForwardedHeader::XForwardedFor,
        "x-forwarded-for",
        b"203.0.113.9",
        b"\xff, 203.0.113.9",
    )
    .await;
}

#[tokio::test]
async fn poisoned_forwarded_keeps_the_client_key() {
    poisoned(
        ForwardedHeader::Forwarded,
        "forwarded",
        b"for=203.0.113.9",
        br#"for="x, for=203.0.113.9"#,
    )
    .await;
}

#[tokio::test]
async fn forty_thousand_client_entries_change_nothing() {
    let key = ClientIp::trusting(["127.0.0.1"]).unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(store(), key, "2/min".parse().unwrap()));
    let server = TestServer::start(app).await;
    let mut long = "1.1.1.1,".repeat(40_000);
    long.push_str("203.0.113.9");
    let http = client();
    let mut got = Vec::new();
    for _ in 0..3 {
        let res = http
            .get(server.url("/"))
            .header("x-forwarded-for", &long)
            .send()
            .await
            .unwrap();
        got.push(res.status().as_u16());
    }
    assert_eq!(got, [200, 200, 429]);
    let res = http
        .get(server.url("/"))
        .header("x-forwarded-for", "203.0.113.9")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 429, "the same client key as the long header");
}
