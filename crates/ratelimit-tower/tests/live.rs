//! Limits replaced while the layer runs: every clone sees them, each request is decided
//! under one version, what is derived from the rules follows, bad limits are refused.

mod common;
use common::Down;

use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use ratelimit_core::{Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_tower::{BuildError, GlobalKey, HeaderKey, Limits, RateLimitLayer};
use tokio::sync::Semaphore;
use tower::{Layer, Service, ServiceExt};

// Aligned to the hour, so fixed windows start at T0.
const T0: u64 = 1_699_999_200_000_000;

fn mem(clock: &ManualClock) -> Arc<MemoryStore<ManualClock>> {
    Arc::new(MemoryStore::builder().clock(clock.clone()).build())
}

fn rules(text: &str) -> RuleSet {
    text.parse().unwrap()
}

fn svc<L>(layer: &L) -> L::Service
where
    L: Layer<
        tower::util::ServiceFn<
            fn(Request<Body>) -> std::future::Ready<Result<Response<Body>, Infallible>>,
        >,
    >,
{
    fn ok(_: Request<Body>) -> std::future::Ready<Result<Response<Body>, Infallible>> {
        std::future::ready(Ok(Response::new(Body::from("ok"))))
    }
    layer.layer(tower::service_fn(
        ok as fn(Request<Body>) -> std::future::Ready<Result<Response<Body>, Infallible>>,
    ))
}

async fn send<S, B>(svc: &mut S, req: Request<Body>) -> Response<B>
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    svc.ready().await.unwrap().call(req).await.unwrap()
}

/// The tier named by the `x-plan` header.
fn plan_header(req: &Request<Body>) -> Option<String> {
    req.headers()
        .get("x-plan")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn get() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap()
}

fn field<'r, B>(res: &'r Response<B>, name: &str) -> &'r str {
    res.headers()[name].to_str().unwrap()
}

#[tokio::test]
async fn a_replacement_reaches_every_clone_and_service_already_made() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::new(mem(&clock), GlobalKey, rules("1/min name=a"));
    let clone = layer.clone();
    let mut made_before = svc(&clone);
    let first = send(&mut made_before, get()).await;
    assert_eq!(field(&first, "ratelimit-policy"), r#""a";q=1;w=60"#);

    let old = layer
        .limits()
        .replace(Limits::new(rules("5/min name=b")))
        .unwrap();
    assert_eq!(old, Limits::new(rules("1/min name=a")));
    assert_eq!(clone.rules(), rules("5/min name=b"));
    assert_eq!(clone.limits().current(), Limits::new(rules("5/min name=b")));
    let res = send(&mut made_before, get()).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        field(&res, "ratelimit-policy"),
        r#""b";q=5;w=60"#,
        "the policy field follows the new rules"
    );
}

#[tokio::test]
async fn a_changed_limit_keeps_what_the_client_used() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::new(mem(&clock), GlobalKey, rules("5/h fixed-window"));
    let mut svc = svc(&layer);
    assert_eq!(admitted(&mut svc, 3).await, 3);

    layer
        .limits()
        .replace(Limits::new(rules("10/h fixed-window")))
        .unwrap();
    assert_eq!(admitted(&mut svc, 10).await, 7, "3 of 10 already used");

    layer
        .limits()
        .replace(Limits::new(rules("3/h fixed-window")))
        .unwrap();
    assert_eq!(admitted(&mut svc, 1).await, 0, "10 used, more than 3");

    // A new rule starts empty beside the one that carries.
    layer
        .limits()
        .replace(Limits::new(rules("20/h fixed-window; 2/min")))
        .unwrap();
    assert_eq!(
        admitted(&mut svc, 5).await,
        2,
        "10 of 20 used; 2/min is new"
    );
}

/// How many of `n` requests `svc` admits.
async fn admitted<S, B>(svc: &mut S, n: usize) -> usize
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    let mut ok = 0;
    for _ in 0..n {
        if send(svc, get()).await.status() == StatusCode::OK {
            ok += 1;
        }
    }
    ok
}

#[tokio::test]
async fn limits_the_layer_cannot_use_are_refused_and_the_running_ones_stay() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::new(mem(&clock), GlobalKey, rules("1/min"));
    let handle = layer.limits();
    let err = handle
        .replace(Limits::tiered().tier("pro", rules("5/min")))
        .unwrap_err();
    assert_eq!(err, BuildError::TiersWithoutSelector);
    let err = handle.replace(Limits::tiered()).unwrap_err();
    assert!(err.to_string().contains("at least one rule"), "{err}");
    let err = handle
        .replace(Limits::new(rules("5/min")).default_tier("gold"))
        .unwrap_err();
    assert_eq!(err, BuildError::UnknownDefaultTier("gold".into()));
    assert_eq!(handle.current(), Limits::new(rules("1/min")));

    let mut svc = svc(&layer);
    assert_eq!(send(&mut svc, get()).await.status(), StatusCode::OK);
    let second = send(&mut svc, get()).await;
    assert_eq!(
        second.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "1/min still holds"
    );
}

#[tokio::test]
async fn tiers_come_and_go_with_the_limits() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .limits(Limits::new(rules("1/min name=base")))
        .select_tier(plan_header)
        .build()
        .unwrap();
    let pro = || {
        Request::get("/")
            .header("x-plan", "pro")
            .body(Body::empty())
            .unwrap()
    };
    let mut svc = svc(&layer);
    let res = send(&mut svc, pro()).await;
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "no tier pro yet: the default tier"
    );
    assert_eq!(field(&res, "ratelimit-policy"), r#""base";q=1;w=60"#);

    layer
        .limits()
        .replace(Limits::new(rules("1/min name=base")).tier("pro", rules("9/min name=pro")))
        .unwrap();
    let res = send(&mut svc, pro()).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(field(&res, "ratelimit-policy"), r#""pro";q=9;w=60"#);
    assert_eq!(layer.tier_rules("pro"), Some(rules("9/min name=pro")));
}

#[tokio::test]
async fn a_denial_cached_under_old_limits_does_not_answer_under_new_ones() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::new(mem(&clock), GlobalKey, rules("1/h fixed-window"));
    let mut svc = svc(&layer);
    assert_eq!(send(&mut svc, get()).await.status(), StatusCode::OK);
    let denied = send(&mut svc, get()).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);

    layer
        .limits()
        .replace(Limits::new(rules("100/h fixed-window")))
        .unwrap();
    let res = send(&mut svc, get()).await;
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "decided by the store under 100/h"
    );
}

#[tokio::test]
async fn fallback_shares_follow_the_new_rules() {
    let clock = ManualClock::new(T0);
    let store = Down {
        clock: Some(clock.clone()),
        ..Down::default()
    };
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules("4/min")
        .unwrap()
        .fallback_share(NonZeroU32::new(2).unwrap())
        .without_deny_cache()
        .build()
        .unwrap();
    // Shared by 2, a limit of 1 leaves nothing: refused, and 4/min stays.
    let err = layer
        .limits()
        .replace(Limits::new(rules("1/min")))
        .unwrap_err();
    assert!(err.to_string().contains("fallback_rules"), "{err}");
    layer.limits().replace(Limits::new(rules("6/h"))).unwrap();
    let mut svc = svc(&layer);
    for _ in 0..3 {
        let res = send(&mut svc, get()).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = send(&mut svc, get()).await;
    assert_eq!(
        res.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "6/h shared by 2 is 3/h"
    );
}

/// A memory store whose checks wait for a permit, to hold a request mid-decision.
struct Gated {
    inner: MemoryStore<ManualClock>,
    gate: Arc<Semaphore>,
}

impl Store for Gated {
    type Error = <MemoryStore<ManualClock> as Store>::Error;
    async fn check(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Result<Decision, Self::Error> {
        self.gate.acquire().await.unwrap().forget();
        self.inner.check(key, rules, cost).await
    }
    fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.block(key, duration)
    }
    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.unblock(key)
    }
    fn reset(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.reset(key, rules)
    }
}

#[tokio::test]
async fn a_request_in_flight_is_decided_under_the_limits_it_arrived_with() {
    let clock = ManualClock::new(T0);
    let gate = Arc::new(Semaphore::new(0));
    let store = Gated {
        inner: MemoryStore::builder().clock(clock.clone()).build(),
        gate: Arc::clone(&gate),
    };
    let layer = RateLimitLayer::new(store, HeaderKey::new("x-key"), rules("3/min name=old"));
    let req = || {
        Request::get("/")
            .header("x-key", "k")
            .body(Body::empty())
            .unwrap()
    };
    let mut svc = svc(&layer);
    let in_flight = tokio::spawn(svc.ready().await.unwrap().call(req()));
    tokio::task::yield_now().await;
    layer
        .limits()
        .replace(Limits::new(rules("7/min name=new")))
        .unwrap();
    gate.add_permits(2);
    let res = in_flight.await.unwrap().unwrap();
    assert_eq!(field(&res, "ratelimit-policy"), r#""old";q=3;w=60"#);
    assert!(field(&res, "ratelimit").starts_with(r#""old";r=2;"#));
    let res = send(&mut svc, req()).await;
    assert_eq!(field(&res, "ratelimit-policy"), r#""new";q=7;w=60"#);
}

#[cfg(feature = "serde")]
#[test]
fn limits_read_from_toml_name_the_line_of_a_mistake() {
    let limits: Limits = toml::from_str(
        "rules = \"10/s; 200/min\"\ndefault_tier = \"free\"\n\n[tiers]\nfree = \"100/h\"\npro = \"10000/h\"\n",
    )
    .unwrap();
    assert_eq!(
        limits,
        Limits::new(rules("10/s; 200/min"))
            .tier("free", rules("100/h"))
            .tier("pro", rules("10000/h"))
            .default_tier("free")
    );
    let back: Limits = toml::from_str(&toml::to_string(&limits).unwrap()).unwrap();
    assert_eq!(back, limits);

    let err =
        toml::from_str::<Limits>("rules = \"1/s\"\n[tiers]\npro = \"10/fortnight\"\n").unwrap_err();
    assert!(err.to_string().contains("line 3"), "{err}");
    let err = toml::from_str::<Limits>("rules = \"1/s\"\n[tiers]\n\"pro plan\" = \"10/s\"\n")
        .unwrap_err();
    // The table that holds the bad name.
    assert!(err.to_string().contains("line 2"), "{err}");
    assert!(err.to_string().contains("tier name \"pro plan\""), "{err}");
    let err = toml::from_str::<Limits>("rules = \"1/s\"\nrule = \"1/s\"\n").unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
}

#[tokio::test]
async fn limits_that_drop_a_tier_in_use_send_it_to_the_default_tier() {
    let clock = ManualClock::new(T0);
    let layer = RateLimitLayer::builder(mem(&clock), GlobalKey)
        .limits(
            Limits::tiered()
                .tier("free", rules("2/min name=free"))
                .tier("pro", rules("9/min name=pro"))
                .default_tier("free"),
        )
        .select_tier(plan_header)
        .build()
        .unwrap();
    let handle = layer.limits();
    let plan = |name: &str| {
        Request::get("/")
            .header("x-plan", name)
            .body(Body::empty())
            .unwrap()
    };
    let mut svc = svc(&layer);
    let res = send(&mut svc, plan("pro")).await;
    assert_eq!(field(&res, "ratelimit-policy"), r#""pro";q=9;w=60"#);

    // Limits without any default tier are refused while a selector chooses tiers: a
    // request in a tier they lack would have no rules.
    let err = handle
        .replace(Limits::tiered().tier("pro", rules("9/min name=pro")))
        .unwrap_err();
    assert_eq!(err, BuildError::NoDefaultTier);
    assert_eq!(layer.tier_rules("pro"), Some(rules("9/min name=pro")));

    // "pro" is gone: its requests take the default tier's rules and budget.
    handle
        .replace(
            Limits::tiered()
                .tier("free", rules("2/min name=free"))
                .default_tier("free"),
        )
        .unwrap();
    let codes = [
        send(&mut svc, plan("pro")).await.status(),
        send(&mut svc, plan("pro")).await.status(),
        send(&mut svc, plan("free")).await.status(),
    ];
    assert_eq!(
        codes,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ],
        "one free budget of 2, never 500"
    );
    let res = send(&mut svc, plan("pro")).await;
    assert_eq!(field(&res, "ratelimit-policy"), r#""free";q=2;w=60"#);
}
