//! The layer driven in process (no sockets): statuses, fields, policies, shaping on a
//! paused clock, the deny cache.
// The peer address comes from axum's `ConnectInfo`, read with the `axum` feature.
#![cfg(feature = "axum")]

mod common;
use common::Down;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use ratelimit_core::{Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_tower::{
    BlockedStatus, DenyCacheConfig, FailurePolicy, GlobalKey, HeaderKey, PeerIp, RateLimitLayer,
    RejectReason, Rejection,
};
use tower::ServiceExt;

// Aligned to the hour, so fixed windows start at T0.
const T0: u64 = 1_699_999_200_000_000;

fn clock() -> ManualClock {
    ManualClock::new(T0)
}

fn mem(clock: &ManualClock) -> Arc<MemoryStore<ManualClock>> {
    Arc::new(MemoryStore::builder().clock(clock.clone()).build())
}

fn get_from(path: &str, ip: &str) -> Request<Body> {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    let addr: SocketAddr = format!("{ip}:40000").parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

fn app<L>(layer: L) -> Router
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower::Service<Request<Body>, Error = std::convert::Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as tower::Service<Request<Body>>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower::Service<Request<Body>>>::Future: Send + 'static,
{
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

/// A store that counts calls and answers through a future (not the in-process path).
struct Counting<S> {
    inner: S,
    calls: AtomicUsize,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: AtomicUsize::new(0),
        })
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl<S: Store> Store for Counting<S> {
    type Error = S::Error;
    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, S::Error>> + Send {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.check(key, rules, cost)
    }
    fn block(
        &self,
        key: &[u8],
        d: Option<Duration>,
    ) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.block(key, d)
    }
    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.unblock(key)
    }
    fn reset(&self, key: &[u8], r: &RuleSet) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.reset(key, r)
    }
    fn refund(
        &self,
        key: &[u8],
        r: &RuleSet,
        cost: u64,
        at: u64,
    ) -> impl Future<Output = Result<bool, S::Error>> + Send {
        self.inner.refund(key, r, cost, at)
    }
    fn now_us(&self) -> u64 {
        self.inner.now_us()
    }
}

#[tokio::test]
async fn admitted_and_limited_fields_are_exact() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), PeerIp::new())
        .rules("2/10s fixed-window name=short; 100/h fixed-window")
        .unwrap()
        .namespace("site")
        .build()
        .unwrap();
    let app = app(layer);
    // 3.5 s into a 10 s window (T0 is a multiple of 10 s).
    clock.advance(Duration::from_millis(3_500));

    let first = app
        .clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        header(&first, "ratelimit-policy"),
        Some(r#""short";q=2;w=10, "100-per-1h@site";q=100;w=3600"#)
    );
    assert_eq!(
        header(&first, "ratelimit"),
        Some(r#""short";r=1;t=7, "100-per-1h@site";r=99;t=3597"#)
    );
    assert_eq!(header(&first, "retry-after"), None);
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "ok");

    app.clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    let denied = app
        .clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // 6.5 s left in the window: rounded up.
    assert_eq!(header(&denied, "retry-after"), Some("7"));
    assert_eq!(
        header(&denied, "ratelimit"),
        Some(r#""short";r=0;t=7, "100-per-1h@site";r=98;t=3597"#)
    );
    assert_eq!(
        header(&denied, "content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(
        denied.into_body().collect().await.unwrap().to_bytes(),
        "rate limit exceeded, retry in 7 s\n"
    );

    // Another client is not affected.
    let other = app.oneshot(get_from("/", "192.0.2.2")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
}

#[tokio::test]
async fn retry_after_is_never_zero() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), PeerIp::new())
        .rules("1/s fixed-window")
        .unwrap()
        .without_deny_cache()
        .build()
        .unwrap();
    let app = app(layer);
    clock.advance(Duration::from_micros(999_999));
    app.clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    let denied = app.oneshot(get_from("/", "192.0.2.1")).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // One microsecond left: still "1", not "0".
    assert_eq!(header(&denied, "retry-after"), Some("1"));
}

#[tokio::test]
async fn admitted_fields_can_be_turned_off() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), PeerIp::new())
        .rules("1/min")
        .unwrap()
        .admitted_headers(false)
        .build()
        .unwrap();
    let app = app(layer);
    let ok = app
        .clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(ok.headers().get("ratelimit").is_none());
    assert!(ok.headers().get("ratelimit-policy").is_none());
    let denied = app.oneshot(get_from("/", "192.0.2.1")).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.headers().get("ratelimit").is_some());
}

/// Without `charge_when`, a response counts unless it carries `Refused`: a handler's own
/// refusal marked so gives its unit back, an unmarked one keeps it.
#[tokio::test]
async fn a_handler_refusal_marked_refused_gives_its_unit_back() {
    use axum::response::IntoResponse;
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), PeerIp::new())
        .rules("1/min")
        .unwrap()
        .build()
        .unwrap();
    let refused = || async {
        let mut res = (StatusCode::CONFLICT, "taken").into_response();
        res.extensions_mut().insert(ratelimit_tower::Refused);
        res
    };
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/refused", get(refused))
        .route("/conflict", get(|| async { StatusCode::CONFLICT }))
        .layer(layer);
    let call = |path: &'static str| app.clone().oneshot(get_from(path, "192.0.2.1"));
    for _ in 0..3 {
        let res = call("/refused").await.unwrap();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        let field = header(&res, "ratelimit").unwrap();
        assert!(field.contains(";r=1;"), "the unit shows back: {field}");
    }
    assert_eq!(
        call("/conflict").await.unwrap().status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        call("/").await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS,
        "an unmarked refusal counts"
    );
}

#[tokio::test]
async fn blocked_keys_429_or_403() {
    let clock = clock();
    let store = mem(&clock);
    let layer = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .rules("10/s")
        .unwrap()
        .namespace("site")
        .build()
        .unwrap();
    layer
        .block(b"192.0.2.9", Some(Duration::from_millis(90_500)))
        .await
        .unwrap();
    layer.block(b"192.0.2.10", None).await.unwrap();
    // A block is per namespace: the raw client key is not the store key.
    assert_eq!(
        layer.store_key("", b"192.0.2.9").unwrap(),
        b"\x04site\x00192.0.2.9"
    );
    let default = app(layer);
    let res = default
        .clone()
        .oneshot(get_from("/", "192.0.2.9"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("91"));
    assert!(res.headers().get("ratelimit").is_none());
    let endless = default.oneshot(get_from("/", "192.0.2.10")).await.unwrap();
    assert_eq!(endless.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&endless, "retry-after"), None);

    let forbidden = app(RateLimitLayer::builder(store, PeerIp::new())
        .rules("10/s")
        .unwrap()
        .namespace("site")
        .blocked_status(BlockedStatus::Forbidden)
        .build()
        .unwrap());
    let res = forbidden.oneshot(get_from("/", "192.0.2.9")).await.unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn cost_above_capacity_is_413_without_a_store_call() {
    let clock = clock();
    let store = Counting::new(mem(&clock));
    let layer = RateLimitLayer::builder(store.clone(), GlobalKey)
        .rules("10/min fixed-window")
        .unwrap()
        .namespace("units")
        .cost(|req: &Request<Body>| {
            req.headers()
                .get("x-units")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let app = app(layer);
    let req = |units: &str| {
        Request::get("/")
            .header("x-units", units)
            .body(Body::empty())
            .unwrap()
    };
    let res = app.clone().oneshot(req("11")).await.unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(header(&res, "retry-after"), None);
    assert!(res.headers().get("ratelimit-policy").is_some());
    assert_eq!(store.calls(), 0);
    let res = app.clone().oneshot(req("10")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit"),
        Some(r#""10-per-1min@units";r=0;t=60"#)
    );
    let res = app.oneshot(req("1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(store.calls(), 2);
}

#[tokio::test]
async fn a_request_without_the_key_header_is_a_client_error_that_says_what_is_missing() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), HeaderKey::new("x-api-key"))
        .rules("1/min")
        .unwrap()
        .build()
        .unwrap();
    let app = app(layer);
    for _ in 0..3 {
        let res = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert!(res.headers().get("ratelimit").is_none());
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            body,
            "the request cannot be rate limited: the request has no `x-api-key` header\n"
        );
    }
    let keyed = || {
        Request::get("/")
            .header("x-api-key", "k1")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        app.clone().oneshot(keyed()).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        app.oneshot(keyed()).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn the_status_for_an_omitted_key_is_configurable_and_a_client_error() {
    let clock = clock();
    let build = |status| {
        RateLimitLayer::builder(mem(&clock), HeaderKey::new("x-api-key"))
            .rules("1/min")
            .unwrap()
            .omitted_key_status(status)
            .build()
    };
    let app = app(build(StatusCode::UNAUTHORIZED).unwrap());
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    let err = build(StatusCode::INTERNAL_SERVER_ERROR).unwrap_err();
    assert!(err.to_string().contains("client error (4xx)"), "{err}");
}

#[tokio::test]
async fn a_key_header_falls_back_to_the_peer_address() {
    let clock = clock();
    let layer = RateLimitLayer::new(
        mem(&clock),
        HeaderKey::new("x-api-key").or(PeerIp::new()),
        "2/min".parse().unwrap(),
    );
    let app = app(layer);
    let with_key = |key: &str| {
        let mut req = get_from("/", "192.0.2.1");
        req.headers_mut().insert("x-api-key", key.parse().unwrap());
        req
    };
    let status = |req: Request<Body>| {
        let app = app.clone();
        async move { app.oneshot(req).await.unwrap().status() }
    };
    // Anonymous requests from one address share its budget.
    assert_eq!(status(get_from("/", "192.0.2.1")).await, StatusCode::OK);
    assert_eq!(status(get_from("/", "192.0.2.1")).await, StatusCode::OK);
    assert_eq!(
        status(get_from("/", "192.0.2.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A key has a budget of its own, from the same address too, even a key that spells
    // the address.
    for key in ["k1", "192.0.2.1"] {
        assert_eq!(status(with_key(key)).await, StatusCode::OK, "{key}");
        assert_eq!(status(with_key(key)).await, StatusCode::OK, "{key}");
        assert_eq!(
            status(with_key(key)).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{key}"
        );
    }
    // Neither a key nor a peer address: the server's configuration, still a 500.
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn custom_rejection_body_keeps_the_standard_fields() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .rules("1/min fixed-window")
        .unwrap()
        .on_rejection(|r: &Rejection| {
            assert_eq!(r.reason(), RejectReason::Limited);
            let secs = r.retry_after().unwrap().as_secs();
            Response::builder()
                .status(StatusCode::OK) // the layer sets the real status
                .header("content-type", "application/json")
                .body(format!(r#"{{"retry_after":{secs}}}"#))
                .unwrap()
        })
        .build()
        .unwrap();
    let app = app(layer);
    app.clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "content-type"), Some("application/json"));
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(
        res.into_body().collect().await.unwrap().to_bytes(),
        r#"{"retry_after":60}"#
    );
}

#[tokio::test]
async fn failure_policies() {
    let build = |policy| {
        app(RateLimitLayer::builder(Down::default(), GlobalKey)
            .rules("1/min")
            .unwrap()
            .failure_policy(policy)
            .build()
            .unwrap())
    };
    let req = || Request::get("/").body(Body::empty()).unwrap();

    let open = build(FailurePolicy::FailOpen);
    for _ in 0..3 {
        let res = open.clone().oneshot(req()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("ratelimit").is_none());
    }

    let closed = build(FailurePolicy::FailClosed);
    let res = closed.oneshot(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);

    let fallback = build(FailurePolicy::Fallback);
    let res = fallback.clone().oneshot(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get("ratelimit").is_some());
    let res = fallback.oneshot(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(start_paused = true)]
async fn store_timeout_applies_the_policy() {
    let app = app(RateLimitLayer::builder(
        Down {
            hang: true,
            ..Down::default()
        },
        GlobalKey,
    )
    .rules("1/min")
    .unwrap()
    .failure_policy(FailurePolicy::FailClosed)
    .store_timeout(Duration::from_millis(250))
    .build()
    .unwrap());
    let start = tokio::time::Instant::now();
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(250));
}

/// Three requests at the same instant through `2/s leaky-bucket mode=shaper burst=2`:
/// the first passes at once, the next two wait one and two leak intervals.
#[tokio::test(start_paused = true)]
async fn shaping_delays_on_a_paused_clock() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .rules("2/s leaky-bucket mode=shaper burst=2")
        .unwrap()
        .build()
        .unwrap();
    let app = app(layer);
    let start = tokio::time::Instant::now();
    let timed = |app: Router| async move {
        let res = app
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        (res.status(), start.elapsed())
    };
    let (a, b, c) = tokio::join!(timed(app.clone()), timed(app.clone()), timed(app.clone()));
    assert_eq!(a, (StatusCode::OK, Duration::ZERO));
    assert_eq!(b, (StatusCode::OK, Duration::from_millis(500)));
    assert_eq!(c, (StatusCode::OK, Duration::from_millis(1000)));
    // The queue is full: the fourth is refused rather than delayed.
    let (d, waited) = timed(app).await;
    assert_eq!(d, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(waited, Duration::from_millis(1000));
}

#[tokio::test(start_paused = true)]
async fn shaping_delay_is_bounded() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .rules("1/s leaky-bucket mode=shaper burst=5")
        .unwrap()
        .max_delay(Duration::from_millis(1500))
        .build()
        .unwrap();
    let app = app(layer);
    let start = tokio::time::Instant::now();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let app = app.clone();
        statuses.push(tokio::spawn(async move {
            app.oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap()
        }));
    }
    let mut results = Vec::new();
    for s in statuses {
        results.push(s.await.unwrap());
    }
    let codes: Vec<_> = results.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(codes, [200, 200, 429, 429]);
    assert_eq!(header(&results[2], "retry-after"), Some("2"));
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

#[tokio::test]
async fn shadow_mode_reports_but_never_refuses() {
    let clock = clock();
    let store = mem(&clock);
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .rules("1/min")
        .unwrap()
        .shadow(true)
        .build()
        .unwrap();
    layer.block(b"192.0.2.66", None).await.unwrap();
    let app = app(layer);
    let first = app
        .clone()
        .oneshot(get_from("/", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers().get("ratelimit-shadow").is_none());
    assert!(first.headers().get("ratelimit").is_none());
    for _ in 0..3 {
        let res = app
            .clone()
            .oneshot(get_from("/", "192.0.2.1"))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(&res, "ratelimit-shadow"), Some("limited"));
        assert!(res.headers().get("retry-after").is_none());
    }
    let res = app.oneshot(get_from("/", "192.0.2.66")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit-shadow"), Some("blocked"));
}

/// A flood from one key: with the deny cache, the store sees the one admitted request,
/// the first denial, and nothing more until the retry time.
#[tokio::test]
async fn deny_cache_cuts_store_calls_under_a_flood() {
    const FLOOD: usize = 20_000;
    let run = |cache: bool| async move {
        let clock = clock();
        let store = Counting::new(mem(&clock));
        let builder = RateLimitLayer::builder(store.clone(), PeerIp::new())
            .rules("1/min")
            .unwrap();
        let layer = if cache {
            builder
        } else {
            builder.without_deny_cache()
        }
        .build()
        .unwrap();
        let app = app(layer);
        let mut limited = 0;
        for _ in 0..FLOOD {
            let res = app
                .clone()
                .oneshot(get_from("/", "198.51.100.1"))
                .await
                .unwrap();
            if res.status() == StatusCode::TOO_MANY_REQUESTS {
                limited += 1;
                assert!(res.headers().get("retry-after").is_some());
            }
        }
        assert_eq!(limited, FLOOD - 1);
        store.calls()
    };
    let with_cache = run(true).await;
    let without = run(false).await;
    assert_eq!(without, FLOOD);
    assert_eq!(
        with_cache, 2,
        "one admitted, one denied, the rest from the cache"
    );
    assert!(without / with_cache >= 1000);
}

/// No paused tokio time: the cache runs on the store's clock.
#[tokio::test]
async fn deny_cache_expires_with_the_retry_time() {
    let clock = clock();
    let store = Counting::new(mem(&clock));
    let layer = RateLimitLayer::builder(store.clone(), GlobalKey)
        .rules("1/2s fixed-window")
        .unwrap()
        .namespace("cache")
        .deny_cache(DenyCacheConfig::default().max_keys(100))
        .build()
        .unwrap();
    let app = app(layer);
    let req = || Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        app.clone().oneshot(req()).await.unwrap().status(),
        StatusCode::OK
    );
    let denied = app.clone().oneshot(req()).await.unwrap();
    assert_eq!(header(&denied, "retry-after"), Some("2"));
    clock.advance(Duration::from_millis(1500));
    let cached = app.clone().oneshot(req()).await.unwrap();
    assert_eq!(cached.status(), StatusCode::TOO_MANY_REQUESTS);
    // The cached answer counts down like the store's would.
    assert_eq!(header(&cached, "retry-after"), Some("1"));
    assert_eq!(
        header(&cached, "ratelimit"),
        Some(r#""1-per-2s@cache";r=0;t=1"#)
    );
    assert_eq!(store.calls(), 2);
    clock.advance(Duration::from_millis(500));
    assert_eq!(app.oneshot(req()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(store.calls(), 3);
}

#[tokio::test]
async fn layers_stack_per_route() {
    let clock = clock();
    let store = mem(&clock);
    let global = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .rules("3/min fixed-window")
        .unwrap()
        .namespace("global")
        .build()
        .unwrap();
    let login = RateLimitLayer::builder(store, PeerIp::new())
        .rules("1/min fixed-window name=login")
        .unwrap()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "home" }))
        .route("/login", get(|| async { "login" }).layer(login))
        .layer(global);
    let ok = app
        .clone()
        .oneshot(get_from("/login", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let policies: Vec<_> = ok.headers().get_all("ratelimit-policy").iter().collect();
    assert_eq!(
        policies,
        [r#""login";q=1;w=60"#, r#""3-per-1min@global";q=3;w=60"#]
    );
    let denied = app
        .clone()
        .oneshot(get_from("/login", "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // The refused login gave the global rule's unit back: two left for the rest of the
    // site.
    assert_eq!(
        denied
            .headers()
            .get_all("ratelimit")
            .iter()
            .collect::<Vec<_>>(),
        [r#""login";r=0;t=60"#, r#""3-per-1min@global";r=2;t=60"#]
    );
    for _ in 0..2 {
        assert_eq!(
            app.clone()
                .oneshot(get_from("/", "192.0.2.1"))
                .await
                .unwrap()
                .status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        app.oneshot(get_from("/", "192.0.2.1"))
            .await
            .unwrap()
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn route_layer_only_limits_matched_routes() {
    let clock = clock();
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .rules("1/min")
        .unwrap()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/a", get(|| async { "a" }))
        .route_layer(layer);
    let req = |p: &str| Request::get(p).body(Body::empty()).unwrap();
    assert_eq!(
        app.clone().oneshot(req("/a")).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        app.clone().oneshot(req("/a")).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Unmatched paths are answered 404, not counted or refused.
    assert_eq!(
        app.oneshot(req("/nowhere")).await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
}

#[test]
fn invalid_configuration_does_not_build() {
    let err = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
        .rules("0/s")
        .unwrap_err();
    assert!(
        err.to_string().contains("`limit` must be at least 1"),
        "{err}"
    );
    let err = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
        .rules(
            "1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s; 1/s",
        )
        .unwrap_err();
    assert!(err.to_string().contains("at most 16"), "{err}");
    assert!(RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
        .build()
        .is_err());
}
