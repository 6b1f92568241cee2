//! Limits per customer: a resolver's rules per client key, cached; usage that carries
//! across a customer's change; a resolver that fails or panics gives the tier's rules.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use ratelimit_core::{ManualClock, MemoryStore, RuleSet};
use ratelimit_tower::{ClientKey, HeaderKey, KeySource, PeerIp, RateLimitLayer};
use tokio::sync::Semaphore;
use tower::{Layer, Service, ServiceExt};

const T0: u64 = 1_699_999_200_000_000;

fn ok_service() -> impl Service<
    Request<Body>,
    Response = Response<Body>,
    Error = Infallible,
    Future = std::future::Ready<Result<Response<Body>, Infallible>>,
> + Clone {
    tower::service_fn(|_: Request<Body>| std::future::ready(Ok(Response::new(Body::empty()))))
}

fn req(key: &str) -> Request<Body> {
    Request::get("/")
        .header("x-key", key)
        .body(Body::empty())
        .unwrap()
}

/// 10,000 customers, each with a limit of its own (1 to 7 per minute): each admits exactly
/// its limit, and the resolver is asked once per customer.
#[tokio::test]
async fn ten_thousand_customers_each_admit_exactly_their_own_limit() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
        .rules("100/min fixed-window name=plan")
        .unwrap()
        .namespace("customers")
        .without_deny_cache()
        .limits_for(move |client: ClientKey| {
            counted.fetch_add(1, Ordering::SeqCst);
            let n: u64 = client.as_str().unwrap()[1..].parse().unwrap();
            let rules = format!("{}/min fixed-window name=plan", 1 + n % 7);
            async move { rules.parse::<RuleSet>().map(Some) }
        })
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for n in 0..10_000u64 {
        let key = format!("c{n}");
        let limit = 1 + n % 7;
        for i in 0..limit {
            let res = svc.ready().await.unwrap().call(req(&key)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{key}: request {}", i + 1);
        }
        let res = svc.ready().await.unwrap().call(req(&key)).await.unwrap();
        assert_eq!(
            res.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{key} past {limit}"
        );
        assert_eq!(
            res.headers()["ratelimit-policy"],
            format!(r#""plan";q={limit};w=60"#).as_str()
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 10_000);
}

/// Concurrent requests of an unknown key share one resolver call; a customer the
/// resolver does not know gets the tier's rules; after the time to live the resolver is
/// asked again and a changed limit keeps the usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_share_one_call_and_usage_carries_across_a_change() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let calls = Arc::new(AtomicUsize::new(0));
    // The resolver answers one call per permit.
    let gate = Arc::new(Semaphore::new(0));
    let limit = Arc::new(AtomicUsize::new(5));
    let (counted, opened, current) = (Arc::clone(&calls), Arc::clone(&gate), Arc::clone(&limit));
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
        .rules("2/h fixed-window name=plan")
        .unwrap()
        .namespace("shared-calls")
        .without_deny_cache()
        .customer_cache(1_000, Duration::from_millis(300))
        .limits_for(move |client: ClientKey| {
            counted.fetch_add(1, Ordering::SeqCst);
            let known = client.as_bytes() == b"acme";
            let limit = current.load(Ordering::SeqCst);
            let opened = Arc::clone(&opened);
            async move {
                opened.acquire().await.unwrap().forget();
                Ok::<_, String>(
                    known.then(|| format!("{limit}/h fixed-window name=plan").parse().unwrap()),
                )
            }
        })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let status = |key: &'static str| {
        let svc = svc.clone();
        tokio::spawn(async move { svc.oneshot(req(key)).await.unwrap().status() })
    };
    let waiting: Vec<_> = (0..8).map(|_| status("acme")).collect();
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    gate.add_permits(1);
    let mut admitted = 0;
    for w in waiting {
        if w.await.unwrap() == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "acme's own limit of 5");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one call for 8 concurrent misses"
    );

    // A customer the resolver does not know: the tier's 2/h.
    gate.add_permits(1);
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(status("nobody").await.unwrap());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Raised to 8 once the answer has expired: the 5 used carry, 3 more.
    limit.store(8, Ordering::SeqCst);
    clock.advance(Duration::from_millis(400));
    gate.add_permits(1);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(status("acme").await.unwrap());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// A resolver that fails or panics gives the tier's rules; the service keeps serving.
#[tokio::test]
async fn a_failing_or_panicking_resolver_gives_the_tiers_rules() {
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
        .rules("2/h fixed-window name=plan")
        .unwrap()
        .namespace("failing")
        .without_deny_cache()
        .limits_for(|client: ClientKey| {
            if client.as_bytes() == b"boom" {
                panic!("resolver bug");
            }
            let text = if client.as_bytes() == b"typo" {
                "0/h"
            } else {
                "not rules"
            };
            let parsed = text.parse::<RuleSet>();
            async move { parsed.map(Some) }
        })
        .build()
        .unwrap();
    let mut svc = layer.layer(ok_service());
    for key in ["boom", "typo", "junk"] {
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(
                svc.ready()
                    .await
                    .unwrap()
                    .call(req(key))
                    .await
                    .unwrap()
                    .status(),
            );
        }
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS
            ],
            "{key}"
        );
    }
}

/// A store that can be taken down: checks fail while `down` is set.
struct Flaky<S> {
    inner: S,
    down: std::sync::atomic::AtomicBool,
    calls: AtomicUsize,
}

impl<S: ratelimit_core::Store> ratelimit_core::Store for Flaky<S> {
    type Error = std::io::Error;
    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<ratelimit_core::Decision, Self::Error>> + Send
    {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let down = self.down.load(Ordering::SeqCst);
        let check = self.inner.check(key, rules, cost);
        async move {
            if down {
                return Err(std::io::Error::other("connection refused"));
            }
            check
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))
        }
    }
    fn block(
        &self,
        _: &[u8],
        _: Option<Duration>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send {
        std::future::ready(Ok(()))
    }
    fn unblock(
        &self,
        _: &[u8],
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send {
        std::future::ready(Ok(()))
    }
    fn reset(
        &self,
        _: &[u8],
        _: &RuleSet,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send {
        std::future::ready(Ok(()))
    }
    fn now_us(&self) -> u64 {
        self.inner.now_us()
    }
}

/// Every refusal carries the fields of the rules that refused: a customer's, also when
/// the refusal comes from the deny cache, and also while the store is down.
#[tokio::test]
async fn refusals_from_the_deny_cache_carry_the_customers_fields() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(Flaky {
        inner: MemoryStore::builder().clock(clock.clone()).build(),
        down: false.into(),
        calls: AtomicUsize::new(0),
    });
    let layer = RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-key"))
        .rules("2/min fixed-window name=default")
        .unwrap()
        .namespace("contracts")
        .limits_for(|client: ClientKey| async move {
            let own = (client.as_bytes() == b"acme")
                .then(|| "5/min fixed-window name=acme".parse().unwrap());
            Ok::<_, Infallible>(own)
        })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let send = || svc.clone().oneshot(req("acme"));
    for i in 0..5 {
        assert_eq!(send().await.unwrap().status(), StatusCode::OK, "{i}");
    }
    let refusals = [send().await.unwrap(), send().await.unwrap()];
    assert_eq!(
        store.calls.load(Ordering::SeqCst),
        6,
        "the 7th from the cache"
    );
    store.down.store(true, Ordering::SeqCst);
    let during_outage = send().await.unwrap();
    assert_eq!(store.calls.load(Ordering::SeqCst), 6, "from the cache");
    for (i, res) in refusals.iter().chain([&during_outage]).enumerate() {
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "refusal {i}");
        assert_eq!(
            res.headers()["ratelimit-policy"],
            r#""acme";q=5;w=60"#,
            "refusal {i}"
        );
        let field = res.headers()["ratelimit"].to_str().unwrap();
        assert!(
            field.starts_with(r#""acme";r=0;t="#),
            "refusal {i}: {field}"
        );
    }
}

/// The customer cache expires on the store's clock: a test on a `ManualClock` that moves
/// past the time to live gets the resolver's new answer, and not before.
#[tokio::test]
async fn the_customer_cache_expires_on_the_stores_clock() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let calls = Arc::new(AtomicUsize::new(0));
    let limit = Arc::new(AtomicUsize::new(5));
    let (counted, current) = (Arc::clone(&calls), Arc::clone(&limit));
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
        .rules("2/h fixed-window name=plan")
        .unwrap()
        .namespace("ttl")
        .without_deny_cache()
        .customer_cache(1_000, Duration::from_secs(60))
        .limits_for(move |_: ClientKey| {
            counted.fetch_add(1, Ordering::SeqCst);
            let rules = format!(
                "{}/h fixed-window name=plan",
                current.load(Ordering::SeqCst)
            );
            async move { rules.parse::<RuleSet>().map(Some) }
        })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let statuses = |n: usize| {
        let svc = svc.clone();
        async move {
            let mut out = Vec::new();
            for _ in 0..n {
                out.push(
                    svc.clone()
                        .oneshot(req("acme"))
                        .await
                        .unwrap()
                        .status()
                        .as_u16(),
                );
            }
            out
        }
    };
    assert_eq!(statuses(6).await, [200, 200, 200, 200, 200, 429]);
    limit.store(8, Ordering::SeqCst);
    clock.advance(Duration::from_secs(59));
    assert_eq!(statuses(1).await, [429], "the answer is still fresh");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        statuses(4).await,
        [200, 200, 200, 429],
        "past its time to live: the new contract, with the 5 used"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Behind a fallback key (`HeaderKey::new("x-api-key").or(PeerIp::new())`) the resolver
/// is handed the API key as the client sent it and knows an address for one: a contract
/// keyed by an API key applies to that key, never to an address spelled alike.
#[tokio::test]
async fn a_resolver_behind_a_fallback_key_gets_the_key_as_sent_and_its_source() {
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let noted = Arc::clone(&seen);
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-api-key").or(PeerIp::new()))
        .rules("2/min fixed-window name=default")
        .unwrap()
        .namespace("fallback-key")
        .limits_for(move |client: ClientKey| {
            noted.lock().unwrap().push(client.clone());
            async move {
                // The contracts, by API key; one of them spelled like an address.
                let own = match client.header("x-api-key") {
                    Some(b"acme" | b"192.0.2.7") => Some("5/min fixed-window name=contract"),
                    _ => None,
                };
                own.map(str::parse::<RuleSet>).transpose()
            }
        })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let send = |api_key: Option<&str>| {
        let mut req = Request::get("/").body(Body::empty()).unwrap();
        if let Some(api_key) = api_key {
            req.headers_mut()
                .insert("x-api-key", api_key.parse().unwrap());
        }
        let peer: std::net::SocketAddr = "192.0.2.7:4000".parse().unwrap();
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        let svc = svc.clone();
        async move { svc.oneshot(req).await.unwrap().status().as_u16() }
    };
    let mut acme = Vec::new();
    for _ in 0..6 {
        acme.push(send(Some("acme")).await);
    }
    assert_eq!(
        acme,
        [200, 200, 200, 200, 200, 429],
        "acme's contract of 5/min"
    );
    let mut address = Vec::new();
    for _ in 0..3 {
        address.push(send(None).await);
    }
    assert_eq!(address, [200, 200, 429], "the address: the default 2/min");
    assert_eq!(
        *seen.lock().unwrap(),
        [
            ClientKey::new(
                KeySource::Header(http::HeaderName::from_static("x-api-key")),
                &b"acme"[..]
            ),
            ClientKey::new(KeySource::PeerIp, &b"192.0.2.7"[..]),
        ]
    );
}

/// A resolver may hold on to the key it is handed in its future.
#[tokio::test]
async fn a_resolver_future_may_keep_the_key() {
    async fn contract_of(api_key: &[u8]) -> Result<Option<RuleSet>, String> {
        Ok((api_key == b"acme").then(|| "3/min fixed-window name=contract".parse().unwrap()))
    }
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
        .rules("1/min fixed-window name=default")
        .unwrap()
        .namespace("owned-key")
        .limits_for(|client: ClientKey| async move { contract_of(client.as_bytes()).await })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(
            svc.clone()
                .oneshot(req("acme"))
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
}

/// While the store is down, a customer with rules of its own is held to its share of
/// them (`fallback_share(4)`: a quarter), not to the tier's share: a customer above the
/// plan keeps its larger share, one below it its smaller one (at least one a period,
/// its own limit being below the fleet's size), and the fields name the share.
#[tokio::test]
async fn a_customers_own_rules_are_shared_while_the_store_is_down() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(Flaky {
        inner: MemoryStore::builder().clock(clock.clone()).build(),
        down: true.into(),
        calls: AtomicUsize::new(0),
    });
    let layer = RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-key"))
        .rules("100/min fixed-window name=plan")
        .unwrap()
        .namespace("shares")
        .failure_policy(ratelimit_tower::FailurePolicy::Fallback)
        .fallback_share(std::num::NonZeroU32::new(4).unwrap())
        .without_deny_cache()
        .limits_for(|client: ClientKey| async move {
            let own = match client.as_bytes() {
                b"big" => Some("1000/min fixed-window name=big".parse().unwrap()),
                b"small" => Some("2/min fixed-window name=small".parse().unwrap()),
                _ => None,
            };
            Ok::<_, Infallible>(own)
        })
        .build()
        .unwrap();
    let svc = layer.layer(ok_service());
    for (key, share, name) in [
        ("big", 250, "big"),
        ("small", 1, "small"),
        ("plain", 25, "plan"),
    ] {
        for i in 0..share {
            let res = svc.clone().oneshot(req(key)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{key}: request {}", i + 1);
        }
        let res = svc.clone().oneshot(req(key)).await.unwrap();
        assert_eq!(
            res.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{key} past {share}"
        );
        assert_eq!(
            res.headers()["ratelimit-policy"],
            format!(r#""{name}/fallback";q={share};w=60"#).as_str(),
            "{key}"
        );
    }
}
