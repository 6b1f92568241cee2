//! Metered costs: charges settled to the actual cost read from the response head
//! (`settle_with`) or reported through `Usage` before the response body ends.
#![cfg(feature = "axum")]

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Extension;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use ratelimit_core::{CapacityError, Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_tower::{
    FailurePolicy, HeaderKey, RateLimitLayer, RateLimitLayerBuilder, RequestCost, Usage,
};
use tower::ServiceExt;

mod common;

// Aligned to the hour, so fixed windows start at T0.
const T0: u64 = 1_699_999_200_000_000;

/// A memory store that answers through futures (as a remote store does), counts the
/// settles it is asked for, and fails the next `fail` of them.
struct Remote {
    inner: MemoryStore<ManualClock>,
    settles: AtomicUsize,
    fail: AtomicUsize,
    /// The `(charged, actual)` of each settle.
    seen: Mutex<Vec<(u64, u64)>>,
}

impl Remote {
    fn new(clock: &ManualClock) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::builder().clock(clock.clone()).build(),
            settles: AtomicUsize::new(0),
            fail: AtomicUsize::new(0),
            seen: Mutex::new(Vec::new()),
        })
    }
    fn settles(&self) -> usize {
        self.settles.load(Ordering::SeqCst)
    }
}

type Error = std::io::Error;

fn ready<T>(result: Result<T, CapacityError>) -> impl Future<Output = Result<T, Error>> + Send
where
    T: Send,
{
    let result = result.map_err(Error::other);
    async move {
        tokio::task::yield_now().await;
        result
    }
}

impl Store for Remote {
    type Error = Error;
    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Error>> + Send {
        ready(self.inner.check_now(key, rules, cost))
    }
    fn block(
        &self,
        key: &[u8],
        d: Option<Duration>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.inner.block_now(key, d);
        ready(Ok(()))
    }
    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Error>> + Send {
        self.inner.unblock_now(key);
        ready(Ok(()))
    }
    fn reset(&self, key: &[u8], r: &RuleSet) -> impl Future<Output = Result<(), Error>> + Send {
        self.inner.reset_now(key, r);
        ready(Ok(()))
    }
    fn refund(
        &self,
        key: &[u8],
        r: &RuleSet,
        cost: u64,
        at: u64,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        ready(Ok(self.inner.refund_now(key, r, cost, at)))
    }
    fn settle(
        &self,
        key: &[u8],
        r: &RuleSet,
        charged: u64,
        actual: u64,
        at: u64,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        self.settles.fetch_add(1, Ordering::SeqCst);
        let failing = self
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let result = if failing {
            Err(Error::other("connection reset"))
        } else {
            self.seen.lock().unwrap().push((charged, actual));
            self.inner
                .settle_sync(key, r, charged, actual, at)
                .unwrap()
                .map_err(Error::other)
        };
        async move {
            tokio::task::yield_now().await;
            result
        }
    }
    fn now_us(&self) -> u64 {
        self.inner.now_us()
    }
}

/// The builder of a layer of `rules` on the `tokens` budget of each `x-api-key`, with
/// `estimate` reserved at the door.
fn tokens<S: Store>(
    store: S,
    rules: &str,
    estimate: u64,
) -> RateLimitLayerBuilder<S, HeaderKey, impl RequestCost<Body>> {
    RateLimitLayer::builder(store, HeaderKey::new("x-api-key"))
        .rules(rules)
        .unwrap()
        .namespace("tokens")
        .cost(move |_: &Request<Body>| estimate)
}

fn with_key(path: &str, key: &str) -> Request<Body> {
    Request::get(path)
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

/// Whether one more unit (or, `cost` 0, a peek) of `rules` is admitted for `key` now.
async fn admits<S: Store>(store: &S, key: &[u8], rules: &str, cost: u64) -> bool {
    let rules: RuleSet = rules.parse().unwrap();
    store
        .check(key, &rules, cost)
        .await
        .ok()
        .unwrap()
        .is_allowed()
}

/// The worked example, exact: `1000/h fixed-window`, an estimate of 100 and an
/// actual of 300 admit requests 1 to 4 and refuse the 5th, with the window at 1,200.
#[tokio::test]
async fn sequential_settles_are_exact() {
    let clock = ManualClock::new(T0);
    let memory = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    sequential(Arc::clone(&memory), &memory).await;
    let remote = Remote::new(&clock);
    sequential(Arc::clone(&remote), &remote.inner).await;
    assert_eq!(remote.settles(), 4, "one settle per admitted request");
}

async fn sequential<S: Store>(store: Arc<S>, held: &MemoryStore<ManualClock>) {
    let rules = "1000/h fixed-window name=tokens";
    let layer = tokens(store, rules, 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let key = layer.store_key("", b"k").unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|| async { ([("x-usage-tokens", "300")], "answer") }),
        )
        .layer(layer);
    for n in 1..=4 {
        let res = app.clone().oneshot(with_key("/", "k")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {n}");
        res.into_body().collect().await.unwrap();
    }
    let fifth = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(fifth.status(), StatusCode::TOO_MANY_REQUESTS);
    // The debt lasts to the end of the hour's window: Retry-After covers it.
    assert_eq!(header(&fifth, "retry-after"), Some("3600"));
    // The window holds exactly 1,200: 200 back leave it full, 201 back let a unit in.
    let rules: RuleSet = rules.parse().unwrap();
    let admits = |cost| held.check_now(&key, &rules, cost).unwrap().is_allowed();
    assert!(held.refund_now(&key, &rules, 200, T0));
    assert!(!admits(1), "1,000 of 1,000");
    assert!(held.refund_now(&key, &rules, 1, T0));
    assert!(admits(1));
}

/// An actual below the estimate gives the difference back before the response goes out:
/// the next request's `RateLimit` field shows it.
#[tokio::test]
async fn an_actual_below_the_estimate_gives_the_rest_back() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window name=tokens", 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { ([("x-usage-tokens", "10")], "short") }))
        .route("/unknown", get(|| async { "no header" }))
        .layer(layer);
    let first = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert!(header(&first, "ratelimit").unwrap().contains(";r=900;"));
    let second = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    // 10 used by the first, 100 reserved by the second (which is settled to 10 too).
    assert!(
        header(&second, "ratelimit").unwrap().contains(";r=890;"),
        "{:?}",
        header(&second, "ratelimit")
    );
    // No header: the estimate stands, and no store call is made for it.
    let settles = store.settles();
    app.clone()
        .oneshot(with_key("/unknown", "k"))
        .await
        .unwrap();
    assert_eq!(store.settles(), settles);
    let fourth = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    // 10 + 10 + 100 (the estimate that stood) + 100 reserved.
    assert!(
        header(&fourth, "ratelimit").unwrap().contains(";r=780;"),
        "{:?}",
        header(&fourth, "ratelimit")
    );
    assert_eq!(store.settles(), settles + 1);
}

/// A header that is not a decimal count is ignored (the estimate stands), whatever it
/// holds.
#[tokio::test]
async fn a_bad_usage_header_keeps_the_estimate() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window", 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/{value}",
            get(
                |axum::extract::Path(value): axum::extract::Path<String>| async move {
                    ([("x-usage-tokens", value)], "ok")
                },
            ),
        )
        .layer(layer);
    for value in ["-5", "12.5", "lots", " ", "+7", "99999999999999999999999"] {
        let path = format!("/{}", urlencoding(value));
        let res = app.clone().oneshot(with_key(&path, "k")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{value:?}");
    }
    assert_eq!(store.settles(), 0);
}

fn urlencoding(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A hostile actual is cut to the estimate plus `max_debt`: the key is locked out for
/// one window, not for years.
#[tokio::test]
async fn a_huge_actual_is_capped() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "100/min gcra", 1)
        .settle_with(|_: &http::response::Parts| Some(u64::MAX))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let res = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(store.seen.lock().unwrap().as_slice(), &[(1, 101)]);
    let refused = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = header(&refused, "retry-after").unwrap().parse().unwrap();
    assert!(
        retry <= 61,
        "at most a period's debt plus the unit: {retry}"
    );
    clock.advance(Duration::from_secs(retry));
    let later = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(later.status(), StatusCode::OK);
}

/// `Usage` reported by the handler settles when the body ends; reported twice, the last
/// report counts; never reported, the estimate stands with no store call.
#[tokio::test]
async fn a_handler_report_settles_at_the_body_end() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window", 100)
        .usage_extension(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|Extension(usage): Extension<Usage>| async move {
                usage.report(500);
                usage.report(40);
                "ok"
            }),
        )
        .route("/silent", get(|| async { "ok" }))
        .layer(layer);
    let first = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    first.into_body().collect().await.unwrap();
    assert_eq!(store.seen.lock().unwrap().as_slice(), &[(100, 40)]);
    let silent = app.clone().oneshot(with_key("/silent", "k")).await.unwrap();
    silent.into_body().collect().await.unwrap();
    let third = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    // 40 + 100 (the silent request's estimate) + 100 reserved.
    assert!(
        header(&third, "ratelimit").unwrap().contains(";r=760;"),
        "{:?}",
        header(&third, "ratelimit")
    );
    assert_eq!(store.settles(), 1);
}

/// A handler extracting `Usage` from a layer built without `usage_extension(true)` is
/// answered 500 with a body that names the switch, and is not run (its report would
/// settle nothing); `Option<Usage>` extracts `None` there; with the switch on, the
/// extracted `Usage` is the one the layer settles from.
#[tokio::test]
async fn a_handler_extracting_usage_without_the_extension_is_told_to_turn_it_on() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let ran = Arc::new(AtomicUsize::new(0));
    let app = |enabled: bool| {
        let ran = Arc::clone(&ran);
        Router::new()
            .route(
                "/",
                get(move |usage: Usage| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    usage.report(40);
                    "ok"
                }),
            )
            .route(
                "/optional",
                get(|usage: Option<Usage>| async move { format!("{}", usage.is_some()) }),
            )
            .layer(
                tokens(Arc::clone(&store), "1000/h fixed-window", 100)
                    .usage_extension(enabled)
                    .build()
                    .unwrap(),
            )
    };
    let off = app(false).oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(off.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = off.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(body.contains(".usage_extension(true)"), "{body}");
    assert!(body.contains("Usage"), "{body}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    for (enabled, want) in [(false, "false"), (true, "true")] {
        let res = app(enabled)
            .oneshot(with_key("/optional", "k"))
            .await
            .unwrap();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, want);
    }
    let on = app(true).oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(on.status(), StatusCode::OK);
    on.into_body().collect().await.unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(store.seen.lock().unwrap().as_slice(), &[(100, 40)]);
}

/// A stream that reports its usage in its last event is settled once, when it ends, and
/// before its end reaches the client; a stream dropped early settles what it reported.
#[tokio::test]
async fn a_streamed_report_is_settled_once_and_a_dropped_stream_settles_what_it_reported() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window", 100)
        .usage_extension(true)
        .build()
        .unwrap();
    let stream = |Extension(usage): Extension<Usage>| async move {
        let events = futures_util::stream::iter(0..5u64).then(move |i| {
            let usage = usage.clone();
            async move {
                tokio::task::yield_now().await;
                if i == 4 {
                    usage.report(250);
                    Ok::<_, Infallible>(Bytes::from("data: {\"usage\": 250}\n\n"))
                } else {
                    Ok(Bytes::from(format!("data: {i}\n\n")))
                }
            }
        });
        Body::from_stream(events)
    };
    let stalls = |Extension(usage): Extension<Usage>| async move {
        let events = futures_util::stream::iter(0..2u64).then(move |i| {
            let usage = usage.clone();
            async move {
                if i == 1 {
                    std::future::pending::<()>().await;
                }
                usage.report(70);
                Ok::<_, Infallible>(Bytes::from("data: partial\n\n"))
            }
        });
        Body::from_stream(events)
    };
    let app = Router::new()
        .route("/stream", get(stream))
        .route("/stalls", get(stalls))
        .layer(layer);
    let res = app.clone().oneshot(with_key("/stream", "k")).await.unwrap();
    let mut body = res.into_body();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        frame.unwrap();
        frames += 1;
        // Settled at the end, not at the event that reported.
        assert_eq!(store.settles(), 0);
    }
    // The end reached the client once the settle was made.
    assert_eq!(frames, 5);
    assert_eq!(store.settles(), 1);
    assert_eq!(store.seen.lock().unwrap().as_slice(), &[(100, 250)]);

    // The client reads one event and goes away.
    let res = app.clone().oneshot(with_key("/stalls", "k")).await.unwrap();
    let mut body = res.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    for _ in 0..100 {
        if store.settles() == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        store.seen.lock().unwrap().as_slice(),
        &[(100, 250), (100, 70)]
    );
    let next = app.clone().oneshot(with_key("/stream", "k")).await.unwrap();
    // 250 + 70 + 100 reserved.
    assert!(
        header(&next, "ratelimit").unwrap().contains(";r=580;"),
        "{:?}",
        header(&next, "ratelimit")
    );
}

/// A response that does not count (`charge_when`) gives its whole charge back and is
/// not settled; a refusal further in does the same for a metered outer layer.
#[tokio::test]
async fn responses_that_do_not_count_are_given_back_not_settled() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let outer = tokens(Arc::clone(&store), "1000/h fixed-window", 100)
        .settle_from_header("x-usage-tokens")
        .charge_when(|res: &http::response::Parts| res.status.is_success())
        .build()
        .unwrap();
    let inner = RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-api-key"))
        .rules("1/h fixed-window")
        .unwrap()
        .namespace("requests")
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/fails",
            get(|| async { (StatusCode::BAD_GATEWAY, [("x-usage-tokens", "300")]) }),
        )
        .route(
            "/",
            get(|| async { ([("x-usage-tokens", "300")], "ok") }).route_layer(inner),
        )
        .layer(outer);
    let failed = app.clone().oneshot(with_key("/fails", "k")).await.unwrap();
    assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(store.settles(), 0);
    let ok = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(store.settles(), 1);
    // Refused by the inner layer's 1/h: the outer layer's 100 come back, unsettled.
    let refused = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(store.settles(), 1);
    let rules = "1000/h fixed-window";
    let key = {
        let layer = RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-api-key"))
            .rules(rules)
            .unwrap()
            .namespace("tokens")
            .build()
            .unwrap();
        layer.store_key("", b"k").unwrap()
    };
    // 300 settled, nothing else: 700 left.
    assert!(admits(&*store, &key, rules, 700).await);
    assert!(!admits(&*store, &key, rules, 701).await);
}

/// Two metered layers around one request share its `Usage`: one report settles both.
#[tokio::test]
async fn stacked_metered_layers_share_one_report() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = |namespace: &str, rules: &str| {
        RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-api-key"))
            .rules(rules)
            .unwrap()
            .namespace(namespace)
            .cost(|_: &Request<Body>| 10)
            .usage_extension(true)
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route(
            "/",
            get(|Extension(usage): Extension<Usage>| async move {
                usage.report(30);
                "ok"
            }),
        )
        .layer(layer("per-key", "1000/h fixed-window"))
        .layer(layer("global", "5000/h fixed-window"));
    let res = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(store.seen.lock().unwrap().as_slice(), &[(10, 30), (10, 30)]);
}

/// With the store down and the fallback policy, the charge and its settle both go to the
/// local fallback store.
#[tokio::test]
async fn a_fallback_charge_is_settled_in_the_fallback() {
    let clock = ManualClock::new(T0);
    let down = common::Down {
        clock: Some(clock.clone()),
        ..Default::default()
    };
    let layer = RateLimitLayer::builder(down, HeaderKey::new("x-api-key"))
        .rules("1000/h fixed-window")
        .unwrap()
        .namespace("tokens")
        .failure_policy(FailurePolicy::Fallback)
        .cost(|_: &Request<Body>| 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { ([("x-usage-tokens", "600")], "ok") }))
        .layer(layer);
    let first = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let second = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    // 600 + 600: the third's 100 do not fit.
    let third = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// An estimate of 0 admits while the key is not over its limit and charges the actual.
#[tokio::test]
async fn an_estimate_of_zero_admits_until_the_key_is_over() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window", 0)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { ([("x-usage-tokens", "400")], "ok") }))
        .layer(layer);
    for n in 1..=3 {
        let res = app.clone().oneshot(with_key("/", "k")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {n}");
    }
    let res = app.clone().oneshot(with_key("/", "k")).await.unwrap();
    assert_eq!(
        res.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "1,200 of 1,000"
    );
}

use futures_util::StreamExt;

/// A customer's own rules (`limits_for`) are the ones its settles charge: 500/h where
/// the tier says 1,000/h.
#[tokio::test]
async fn a_customer_is_settled_under_its_own_rules() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window name=tokens", 100)
        .settle_from_header("x-usage-tokens")
        .limits_for(|client: ratelimit_tower::key::ClientKey| {
            let own = client.as_bytes() == b"small";
            async move {
                Ok::<_, String>(own.then(|| "500/h fixed-window name=tokens".parse().unwrap()))
            }
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { ([("x-usage-tokens", "300")], "ok") }))
        .layer(layer);
    let statuses = |key: &'static str| {
        let app = app.clone();
        async move {
            let mut statuses = Vec::new();
            for _ in 0..5 {
                let res = app.clone().oneshot(with_key("/", key)).await.unwrap();
                statuses.push(res.status().as_u16());
            }
            statuses
        }
    };
    // 300 + 300 of 500: the third does not fit its 100.
    assert_eq!(statuses("small").await, [200, 200, 429, 429, 429]);
    // 900 + 100 fit 1,000.
    assert_eq!(statuses("large").await, [200, 200, 200, 200, 429]);
}

/// A debt whose settle fails is retried once; a give-back is not (twice would lend).
/// Either way a settle that fails leaves the estimate charged.
#[tokio::test]
async fn a_failed_debt_is_retried_once_and_a_failed_give_back_is_not() {
    let clock = ManualClock::new(T0);
    let store = Remote::new(&clock);
    let layer = tokens(Arc::clone(&store), "1000/h fixed-window", 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/more",
            get(|| async { ([("x-usage-tokens", "300")], "ok") }),
        )
        .route(
            "/less",
            get(|| async { ([("x-usage-tokens", "40")], "ok") }),
        )
        .layer(layer);
    let left = |res: &Response<Body>| header(res, "ratelimit").unwrap().to_owned();
    store.fail.store(1, Ordering::SeqCst);
    app.clone().oneshot(with_key("/more", "k")).await.unwrap();
    assert_eq!(store.settles(), 2, "the debt retried");
    let next = app.clone().oneshot(with_key("/less", "k")).await.unwrap();
    assert!(left(&next).contains(";r=600;"), "{}", left(&next));
    // This one's give-back fails: its 100 stay charged.
    store.fail.store(1, Ordering::SeqCst);
    let settles = store.settles();
    let third = app.clone().oneshot(with_key("/less", "k")).await.unwrap();
    assert_eq!(store.settles(), settles + 1, "a give-back is not retried");
    // 300 + 40 (the second, settled) + 100 (the third: its give-back failed), + 100.
    let fourth = app.clone().oneshot(with_key("/more", "k")).await.unwrap();
    assert!(
        left(&fourth).contains(";r=460;"),
        "{} then {}",
        left(&third),
        left(&fourth)
    );
    // Both settles failing leaves the estimate.
    store.fail.store(2, Ordering::SeqCst);
    let fifth = app.clone().oneshot(with_key("/more", "k")).await.unwrap();
    assert_eq!(fifth.status(), StatusCode::OK);
    let sixth = app.clone().oneshot(with_key("/less", "k")).await.unwrap();
    // The fourth settled to 300, the fifth's 100 stood: 300 + 40 + 100 + 300 + 100 + 100.
    assert!(left(&sixth).contains(";r=60;"), "{}", left(&sixth));
}

#[tokio::test]
async fn settles_and_releases_ride_the_batches_on_redis() {
    settles_and_releases_on_redis(ratelimit_redis::testing::RedisServer::start()).await;
}

#[tokio::test]
async fn settles_and_releases_ride_the_batches_on_the_module() {
    let server = ratelimit_redis::testing::RedisServer::start_with_module();
    settles_and_releases_on_redis(server).await;
}

/// The worked example above on a `RedisStore`, with `1 concurrent` beside it: each
/// settle rides the store's batches before the response ends, each release is handed to
/// the store after it (no task of its own), and the client's next request is decided
/// after both, so every request finds the slot free and the fifth finds 1,200 charged.
/// On the module, none went as a call of its own.
async fn settles_and_releases_on_redis(server: ratelimit_redis::testing::RedisServer) {
    let store = ratelimit_redis::RedisStore::builder()
        .prefix("metered")
        .build(&server.url())
        .await
        .unwrap();
    ratelimit_redis::testing::wait_connected(&store).await;
    let rules = "1000/h fixed-window name=tokens; 1 concurrent timeout=1m";
    let layer = tokens(store, rules, 100)
        .settle_from_header("x-usage-tokens")
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|| async { ([("x-usage-tokens", "300")], "answer") }),
        )
        .layer(layer);
    for round in 0..3 {
        let key = format!("k{round}");
        for n in 1..=4 {
            let res = app.clone().oneshot(with_key("/", &key)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK, "round {round}, request {n}");
            res.into_body().collect().await.unwrap();
        }
        let fifth = app.clone().oneshot(with_key("/", &key)).await.unwrap();
        assert_eq!(
            fifth.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "round {round}"
        );
        let body = fifth.into_body().collect().await.unwrap().to_bytes();
        assert!(
            !String::from_utf8_lossy(&body).contains("concurren"),
            "round {round}: refused by the slot, not the tokens: {body:?}"
        );
    }
    let stats = server.command("INFO commandstats").unwrap();
    for alone in [
        "ratelimit.release",
        "ratelimit.debit",
        "ratelimit.give_back",
    ] {
        assert!(
            !stats.contains(&format!("cmdstat_{alone}:")),
            "a {alone} went as a call of its own: {stats}"
        );
    }
}
