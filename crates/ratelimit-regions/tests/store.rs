//! The region store on in-process stores: shares, refusals, the pool, no wait on home,
//! and the tower layer on top.

use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::{Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_regions::{RegionStore, Regions, RegionsError};

type Mem = Arc<MemoryStore<ManualClock>>;

/// A store whose every call takes `delay` first: another region, far away.
struct Far<S> {
    inner: S,
    delay: Duration,
}

impl<S: Store> Store for Far<S> {
    type Error = S::Error;

    async fn check(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Result<Decision, S::Error> {
        tokio::time::sleep(self.delay).await;
        self.inner.check(key, rules, cost).await
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), S::Error> {
        tokio::time::sleep(self.delay).await;
        self.inner.block(key, duration).await
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), S::Error> {
        self.inner.unblock(key).await
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), S::Error> {
        self.inner.reset(key, rules).await
    }

    async fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Result<bool, S::Error> {
        tokio::time::sleep(self.delay).await;
        self.inner.refund(key, rules, cost, charged_at).await
    }

    fn now_us(&self) -> u64 {
        self.inner.now_us()
    }
}

fn mem(clock: &ManualClock) -> Mem {
    Arc::new(MemoryStore::builder().clock(clock.clone()).build())
}

fn two_regions(lease: Duration) -> Regions {
    Regions::even(["eu", "us"])
        .unwrap()
        .pool_lease(lease)
        .home_by(|_| 1) // every key's pool in us
}

fn eu_store(regions: Regions, eu: &Mem, us: &Mem, delay: Duration) -> RegionStore<Far<Mem>> {
    RegionStore::builder(regions)
        .region("eu")
        .local(Far {
            inner: Arc::clone(eu),
            delay: Duration::ZERO,
        })
        .link(
            "eu",
            Far {
                inner: Arc::clone(eu),
                delay: Duration::ZERO,
            },
        )
        .link(
            "us",
            Far {
                inner: Arc::clone(us),
                delay,
            },
        )
        .build()
        .unwrap()
}

#[test]
fn shares_round_down_and_refuse_what_cannot_be_bounded() {
    let regions = Regions::new([("a", 1), ("b", 1), ("c", 1)]).unwrap();
    let shares = regions
        .split(
            &"100/s gcra burst=10 name=api; 10/h fixed-window"
                .parse()
                .unwrap(),
        )
        .unwrap();
    // (1 - 0.5) / 3 of 100 is 16.67: 16; of 10, 1; of the window's 10, 1.
    assert_eq!(
        shares.base(0).unwrap().id(),
        "16/1s gcra burst=1 name=api; 1/1h fixed-window"
    );
    assert_eq!(
        shares.pool().unwrap().id(),
        "50/1s gcra burst=5 name=api; 5/1h fixed-window"
    );

    // Sliding windows and logs pool nothing: the whole limit is divided among regions.
    let log = regions
        .split(&"30/min sliding-log".parse().unwrap())
        .unwrap();
    assert!(log.pool().is_none());
    assert_eq!(log.base(2).unwrap().id(), "10/1m sliding-log");

    for (text, says) in [
        ("4 concurrent", "in flight"),
        ("10/s leaky-bucket mode=shaper burst=5", "shaper"),
    ] {
        let err = regions.split(&text.parse().unwrap()).unwrap_err();
        assert!(matches!(err, RegionsError::Unbounded(_)), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    let err = regions.split(&"5/s gcra".parse().unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("rounds its `limit` (5) to 0"),
        "{err}"
    );
}

#[tokio::test]
async fn a_rule_that_cannot_be_bounded_is_refused_at_build_time() {
    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let err = RegionStore::builder(two_regions(Duration::from_secs(1)))
        .region("eu")
        .local(Arc::clone(&eu))
        .link("eu", Arc::clone(&eu))
        .link("us", Arc::clone(&us))
        .rules(&"10/s gcra; 2 concurrent".parse().unwrap())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("concurrent"), "{err}");
    let err = RegionStore::builder(two_regions(Duration::from_secs(1)))
        .region("eu")
        .local(Arc::clone(&eu))
        .link("eu", Arc::clone(&eu))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("\"us\""), "{err}");
}

/// Home is a second away; every check still returns at once, and pool units arrive in
/// the background.
#[tokio::test(start_paused = true)]
async fn no_decision_waits_for_the_home_region() {
    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let store = eu_store(
        two_regions(Duration::from_secs(10)),
        &eu,
        &us,
        Duration::from_secs(1),
    );
    let rules: RuleSet = "100/min gcra burst=100".parse().unwrap();
    let mut admitted = 0;
    for _ in 0..40 {
        let d = tokio::time::timeout(Duration::from_millis(1), store.check(b"k", &rules, 1))
            .await
            .expect("a decision waited for another region")
            .unwrap();
        admitted += u32::from(d.is_allowed());
    }
    // eu's share: a quarter of the burst; the pool's reservation is still in flight.
    assert_eq!(admitted, 25);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let d = store.check(b"k", &rules, 1).await.unwrap();
    assert!(d.is_allowed(), "pool units arrived: {d:?}");
    assert!(store.stats().pool_admitted >= 1);
}

/// However fast one region asks, it admits no more than the bound: its share plus the
/// pool, and a block expires ℓ_g after its reservation was sent.
#[tokio::test(start_paused = true)]
async fn one_region_alone_stays_within_the_bound_and_blocks_expire() {
    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let lease = Duration::from_millis(500);
    let store = eu_store(two_regions(lease), &eu, &us, Duration::from_millis(30));
    let rules: RuleSet = "100/min gcra burst=100".parse().unwrap();
    let mut admitted = 0u64;
    for _ in 0..400 {
        if store.check(b"k", &rules, 1).await.unwrap().is_allowed() {
            admitted += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // No time passed on the stores' clock: eu's share (25) plus at most the pool (50).
    assert!(admitted <= 75, "{admitted}");
    assert!(admitted > 25, "the pool was never used: {admitted}");
    assert!(store.pool_units() > 0 || store.stats().units_reserved > 0);
    // A block's expiry is on the local clock: past it, nothing is spent from it, and what
    // it held goes back to home.
    clock.advance(lease);
    let before = store.stats().pool_admitted;
    let _ = store.check(b"k", &rules, 1).await.unwrap();
    assert_eq!(store.stats().pool_admitted, before);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.pool_units(), 0);
}

#[tokio::test]
async fn blocks_reach_every_region() {
    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let regions = two_regions(Duration::from_secs(1));
    let eu_side = eu_store(regions.clone(), &eu, &us, Duration::ZERO);
    let us_side = RegionStore::builder(regions)
        .region("us")
        .local(Arc::clone(&us))
        .link("eu", Arc::clone(&eu))
        .link("us", Arc::clone(&us))
        .build()
        .unwrap();
    let rules: RuleSet = "100/min gcra".parse().unwrap();
    eu_side
        .block(b"k", Some(Duration::from_secs(60)))
        .await
        .unwrap();
    let d = us_side.check(b"k", &rules, 1).await.unwrap();
    assert_eq!(d.outcome(), ratelimit_core::Outcome::Blocked);
    us_side.unblock(b"k").await.unwrap();
    assert!(eu_side.check(b"k", &rules, 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn the_tower_layer_works_on_it_unchanged() {
    use axum::body::Body;
    use http::{Request, StatusCode};
    use ratelimit_tower::key::HeaderKey;
    use ratelimit_tower::RateLimitLayer;
    use tower::ServiceExt;

    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let store = eu_store(
        two_regions(Duration::from_secs(1)),
        &eu,
        &us,
        Duration::ZERO,
    );
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            store,
            HeaderKey::new("x-api-key"),
            "8/min gcra".parse().unwrap(),
        ));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let request = Request::get("/")
            .header("x-api-key", "k-1")
            .body(Body::empty())
            .unwrap();
        statuses.push(app.clone().oneshot(request).await.unwrap().status());
    }
    // eu's share of 8 is 2; the rest waits for pool units.
    assert_eq!(&statuses[..2], &[StatusCode::OK, StatusCode::OK]);
    assert_eq!(statuses[2], StatusCode::TOO_MANY_REQUESTS);
}

/// A store that remembers the keys it was asked about.
struct Recording {
    keys: std::sync::Mutex<Vec<Vec<u8>>>,
    inner: MemoryStore,
}

impl Store for Recording {
    type Error = <MemoryStore as Store>::Error;

    async fn check(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Result<Decision, Self::Error> {
        self.keys.lock().unwrap().push(key.to_vec());
        self.inner.check(key, rules, cost).await
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), Self::Error> {
        self.inner.block(key, duration).await
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), Self::Error> {
        self.inner.unblock(key).await
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), Self::Error> {
        self.inner.reset(key, rules).await
    }
}

/// `home_by_tier` reads the tier out of the key as the layer composes it.
#[tokio::test]
async fn a_tier_pinned_to_a_region_is_homed_there() {
    use axum::body::Body;
    use http::Request;
    use ratelimit_tower::key::HeaderKey;
    use ratelimit_tower::RateLimitLayer;
    use tower::ServiceExt;

    let regions = Regions::even(["eu", "us", "ap"])
        .unwrap()
        .home_by_tier([("gold", "ap"), ("silver", "us")])
        .unwrap();
    let store = Arc::new(Recording {
        keys: std::sync::Mutex::default(),
        inner: MemoryStore::new(),
    });
    let rules: RuleSet = "60/min gcra".parse().unwrap();
    let layer = RateLimitLayer::builder(Arc::clone(&store), HeaderKey::new("x-api-key"))
        .namespace("api")
        .tier("gold", rules.clone())
        .tier("silver", rules.clone())
        .default_tier("silver")
        .select_tier(|req: &Request<Body>| {
            req.headers()
                .get("x-plan")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    for plan in ["gold", "silver"] {
        for client in ["k-1", "k-2", "k-3"] {
            let request = Request::get("/")
                .header("x-api-key", client)
                .header("x-plan", plan)
                .body(Body::empty())
                .unwrap();
            app.clone().oneshot(request).await.unwrap();
        }
    }
    let keys = store.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 6);
    for key in &keys[..3] {
        assert_eq!(regions.home(key), 2, "gold is homed in ap: {key:?}");
    }
    for key in &keys[3..] {
        assert_eq!(regions.home(key), 1, "silver is homed in us: {key:?}");
    }
    assert!(Regions::even(["eu"])
        .unwrap()
        .home_by_tier([("gold", "mars")])
        .is_err());
}
