//! Charging by outcome over real HTTP: the `login` example's guard (5 failed logins per 15
//! minutes per IP, successful ones free) on a MemoryStore and on a real redis-server, and
//! stacked layers giving back what a refused request was charged.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode as AxumStatus;
use axum::routing::{get, post};
use axum::Router;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{all, client, one, TestServer};
use ratelimit_examples::login::{app, PASSWORD};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_tower::{PeerIp, RateLimitLayer};

const T0: u64 = 1_699_999_200_000_000;

async fn login(server: &TestServer, password: &str) -> u16 {
    client()
        .post(server.url("/login"))
        .header("x-password", password)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// 100 successful logins all pass; then 5 failures get 401 and the 6th 429.
async fn successes_are_free(server: &TestServer) {
    for i in 0..100 {
        assert_eq!(login(server, PASSWORD).await, 200, "success {}", i + 1);
    }
    for i in 0..5 {
        assert_eq!(login(server, "guess").await, 401, "failure {}", i + 1);
    }
    assert_eq!(login(server, "guess").await, 429, "the 6th failure");
    // Out of failures, even the right password waits: the check comes first.
    assert_eq!(login(server, PASSWORD).await, 429);
}

/// 50 concurrent failures on a fresh key: exactly 5 tries.
async fn concurrent_failures_get_exactly_five(server: &TestServer) {
    let url = server.url("/login");
    let tries: Vec<_> = (0..50)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                client()
                    .post(url)
                    .header("x-password", "guess")
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tries {
        statuses.push(t.await.unwrap());
    }
    let count = |s| statuses.iter().filter(|&&x| x == s).count();
    assert_eq!((count(401), count(429)), (5, 45), "{statuses:?}");
}

fn memory() -> Arc<MemoryStore<ManualClock>> {
    Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build())
}

#[tokio::test]
async fn login_example_counts_failures_only_in_memory() {
    let server = TestServer::start(app(memory())).await;
    successes_are_free(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_failed_logins_get_exactly_five_in_memory() {
    let server = TestServer::start(app(memory())).await;
    concurrent_failures_get_exactly_five(&server).await;
}

/// A store with a timeout long enough for a loaded machine: the layer fails open on a
/// store timeout by default, which would admit unchecked failures.
async fn redis_store(server: &RedisServer) -> RedisStore {
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .expect("connect to the test redis-server");
    wait_connected(&store).await;
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_example_counts_failures_only_on_redis() {
    let redis = RedisServer::start();
    let server = TestServer::start(app(redis_store(&redis).await)).await;
    successes_are_free(&server).await;
    let other = TestServer::start(app(redis_store(&redis).await)).await;
    // A second instance on the same server shares the budget: the address is spent.
    assert_eq!(login(&other, "guess").await, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_failed_logins_get_exactly_five_on_redis() {
    let redis = RedisServer::start();
    let server = TestServer::start(app(redis_store(&redis).await)).await;
    concurrent_failures_get_exactly_five(&server).await;
}

/// A site-wide layer around a route's own: requests the route's layer refuses give the
/// site's unit back (on by default), so the site counts admitted requests only; with
/// `refund_refused(false)` it counts every request that reached it.
#[tokio::test]
async fn a_refusal_further_in_gives_back_the_outer_charge() {
    for refund in [true, false] {
        let store = memory();
        let login = RateLimitLayer::builder(store.clone(), PeerIp::new())
            .rules("2/min fixed-window name=login")
            .unwrap()
            .build()
            .unwrap();
        let site = RateLimitLayer::builder(store, PeerIp::new())
            .rules("100/h fixed-window name=site")
            .unwrap()
            .refund_refused(refund)
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "home" }))
            .route("/login", post(|| async { "welcome" }).route_layer(login))
            .layer(site);
        let server = TestServer::start(app).await;
        for _ in 0..5 {
            client().post(server.url("/login")).send().await.unwrap();
        }
        let home = client().get(server.url("/")).send().await.unwrap();
        // 2 logins admitted, 3 refused, and this request.
        let expected = if refund { 97 } else { 94 };
        assert_eq!(
            one(&home, "ratelimit").unwrap(),
            format!(r#""site";r={expected};t=3600"#),
            "refund_refused({refund})"
        );
        // The refused login's own 429 carries the site's field, with the unit back.
        let refused = client().post(server.url("/login")).send().await.unwrap();
        assert_eq!(refused.status(), 429);
        let fields = all(&refused, "ratelimit");
        let site_field = if refund { 97 } else { 93 };
        assert!(
            fields.contains(&format!(r#""site";r={site_field};t=3600"#)),
            "refund_refused({refund}): {fields:?}"
        );
    }
}

/// The predicate sees the response head: the admitted response's `RateLimit` field shows
/// the unit back; a panicking predicate fails the request with 500 and gives it back.
#[tokio::test]
async fn the_field_shows_the_unit_back_and_a_panicking_predicate_is_a_500() {
    let store = memory();
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .rules("3/min fixed-window name=errors")
        .unwrap()
        .charge_when(|res: &axum::http::response::Parts| {
            if res.headers.contains_key("x-panic") {
                panic!("predicate bug");
            }
            res.status.is_server_error()
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/ok", get(|| async { "fine" }))
        .route(
            "/fail",
            get(|| async { (AxumStatus::BAD_GATEWAY, "upstream down") }),
        )
        .route(
            "/panic",
            get(|| async { ([("x-panic", "1")], "never seen") }),
        )
        .layer(layer);
    let server = TestServer::start(app).await;
    let ok = client().get(server.url("/ok")).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    // The unit given back: the quota whole, nothing to wait for.
    assert_eq!(one(&ok, "ratelimit").unwrap(), r#""errors";r=3;t=0"#);
    let fail = client().get(server.url("/fail")).send().await.unwrap();
    assert_eq!(fail.status(), 502);
    assert_eq!(one(&fail, "ratelimit").unwrap(), r#""errors";r=2;t=60"#);
    let panic = client().get(server.url("/panic")).send().await.unwrap();
    assert_eq!(panic.status(), 500);
    let ok = client().get(server.url("/ok")).send().await.unwrap();
    assert_eq!(
        one(&ok, "ratelimit").unwrap(),
        r#""errors";r=2;t=60"#,
        "the panicking request's unit came back"
    );
}

/// Two instances sharing a RedisStore, 20 callers each, call a local partner for 5 s
/// through a `ThrottleLayer` of `10/s leaky-bucket mode=shaper burst=20`: no second gets
/// more than 10 plus the burst, at least 90 % of the rate is used, and no caller fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_an_outbound_rate_and_wait_for_their_turns() {
    use ratelimit_examples::outbound::{callers, partner};
    let redis = RedisServer::start();
    let (addr, arrivals) = partner(0).await.unwrap();
    let length = Duration::from_secs(5);
    let a = tokio::spawn(callers(redis_store(&redis).await, addr, 20, length));
    let b = tokio::spawn(callers(redis_store(&redis).await, addr, 20, length));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!((a.failed, b.failed), (0, 0), "{a:?} {b:?}");
    let per_second = arrivals.lock().unwrap().clone();
    let total: u32 = per_second.values().sum();
    assert_eq!(u64::from(total), a.ok + b.ok, "{per_second:?}");
    assert!(
        per_second.values().all(|&n| n <= 10 + 20),
        "a second above the rate plus the burst: {per_second:?}"
    );
    // Callers start at once and keep going until 5 s have passed: at least 45 calls.
    assert!(total >= 45, "{total} calls in 5 s at 10/s: {per_second:?}");
    // And never more than the shaper lets through: 10/s over the run, plus the one call
    // served at once.
    let seconds = per_second.len() as u32;
    assert!(
        total <= 10 * seconds + 1,
        "{total} calls in {seconds} s: {per_second:?}"
    );
}
