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

/// However fast one region asks, it admits no more than the bound: its share, the pool,
/// and what an idle region's share gave it; a block expires ℓ_g after its reservation
/// was sent.
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
    // No time passed on the stores' clock: eu's share (25), at most the pool (50), and
    // what eu's share got from us's (idle) share; never more than the burst.
    let moved = store.stats().units_moved;
    assert!(moved > 0 && moved <= 25, "{moved}");
    assert!(admitted <= 75 + moved, "{admitted}");
    assert!(admitted <= 100, "{admitted}");
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

/// The tower layer's grace after an outage starts from the store's last recovery: a
/// region store answers its own region's store's (where its checks fail), not a link's.
#[tokio::test]
async fn its_recovery_is_the_local_stores() {
    let local = Recording::new();
    let local_recovered = Arc::clone(&local.recovered);
    let far = Recording::new();
    let far_recovered = Arc::clone(&far.recovered);
    let store = RegionStore::builder(two_regions(Duration::from_secs(1)))
        .region("eu")
        .local(local)
        .link("eu", Recording::new())
        .link("us", far)
        .build()
        .unwrap();
    assert_eq!(store.recovered_at_us(), 0, "no loss yet");
    far_recovered.store(7_000_000, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        store.recovered_at_us(),
        0,
        "a link's recovery is not the region's"
    );
    local_recovered.store(5_000_000, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(store.recovered_at_us(), 5_000_000);
}

/// A store that remembers the keys it was asked about, and answers `recovered` for when
/// its connection last came back.
struct Recording {
    keys: std::sync::Mutex<Vec<Vec<u8>>>,
    inner: MemoryStore,
    recovered: Arc<std::sync::atomic::AtomicU64>,
}

impl Recording {
    fn new() -> Self {
        Self {
            keys: std::sync::Mutex::default(),
            inner: MemoryStore::new(),
            recovered: Arc::default(),
        }
    }
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

    fn recovered_at_us(&self) -> u64 {
        self.recovered.load(std::sync::atomic::Ordering::SeqCst)
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
    let store = Arc::new(Recording::new());
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

// Rebalancing base shares (the demarcation protocol): a donor's share is charged first,
// and the recipient's share gets units back only after the donor's grant.

/// What a link to another region answers when its reply is lost.
#[derive(Debug)]
enum NetError {
    Store(<MemoryStore<ManualClock> as Store>::Error),
    Lost,
}

impl std::fmt::Display for NetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NetError::Store(e) => write!(f, "{e}"),
            NetError::Lost => f.write_str("the reply was lost"),
        }
    }
}

impl std::error::Error for NetError {}

/// A region's store as another region sees it: every call takes `delay` first, and while
/// `lose` is set a check that charges is applied there but its reply never arrives.
#[derive(Clone)]
struct Net {
    inner: Mem,
    delay: Duration,
    lose: Arc<std::sync::atomic::AtomicBool>,
}

impl Net {
    fn new(inner: &Mem, delay: Duration) -> Self {
        Self {
            inner: Arc::clone(inner),
            delay,
            lose: Arc::default(),
        }
    }
}

impl Store for Net {
    type Error = NetError;

    async fn check(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Result<Decision, NetError> {
        tokio::time::sleep(self.delay).await;
        let d = self
            .inner
            .check(key, rules, cost)
            .await
            .map_err(NetError::Store)?;
        if cost > 0 && self.lose.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(NetError::Lost);
        }
        Ok(d)
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), NetError> {
        self.inner
            .block(key, duration)
            .await
            .map_err(NetError::Store)
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), NetError> {
        self.inner.unblock(key).await.map_err(NetError::Store)
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), NetError> {
        self.inner.reset(key, rules).await.map_err(NetError::Store)
    }

    async fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Result<bool, NetError> {
        tokio::time::sleep(self.delay).await;
        self.inner
            .refund(key, rules, cost, charged_at)
            .await
            .map_err(NetError::Store)
    }

    fn now_us(&self) -> u64 {
        self.inner.now_us()
    }
}

/// Regions eu and us, no pool (g = 0: the shares are all there is), half the rule each.
fn unpooled(lease: Duration) -> Regions {
    Regions::even(["eu", "us"])
        .unwrap()
        .pooled(0.0)
        .unwrap()
        .pool_lease(lease)
}

/// The store of an instance in `region` of `regions`, reaching `other` (the other
/// region's store) through `link`.
fn instance(regions: Regions, region: &str, own: &Mem, link: Net) -> RegionStore<Net> {
    let other = if region == "eu" { "us" } else { "eu" };
    RegionStore::builder(regions)
        .region(region)
        .local(Net::new(own, Duration::ZERO))
        .link(region, Net::new(own, Duration::ZERO))
        .link(other, link)
        .rebalance_every(Duration::from_secs(1))
        .build()
        .unwrap()
}

/// An instance in eu and one in us of `regions`, each reaching the other region 30 ms
/// away.
fn linked(regions: &Regions, eu: &Mem, us: &Mem) -> (RegionStore<Net>, RegionStore<Net>) {
    let far = Duration::from_millis(30);
    (
        instance(regions.clone(), "eu", eu, Net::new(us, far)),
        instance(regions.clone(), "us", us, Net::new(eu, far)),
    )
}

async fn admit(store: &RegionStore<Net>, rules: &RuleSet, n: u32) -> u32 {
    let mut admitted = 0;
    for _ in 0..n {
        admitted += u32::from(store.check(b"k", rules, 1).await.unwrap().is_allowed());
    }
    admitted
}

/// What `store`'s region's share has free for `k` (a peek).
async fn free(store: &RegionStore<Net>, rules: &RuleSet) -> u64 {
    let d = store.check(b"k", rules, 0).await.unwrap();
    d.rules().iter().map(|r| r.remaining).min().unwrap()
}

/// The donor has 5 units free of its 50: the recipient asks for half of them (the
/// donor keeps some for its own demand), gets exactly that, and admits exactly that
/// many more. Nothing else moves.
#[tokio::test(start_paused = true)]
async fn a_recipient_gains_only_what_the_donor_had_free() {
    let clock = ManualClock::new(1_000_000);
    let (eu, us) = (mem(&clock), mem(&clock));
    let regions = unpooled(Duration::from_secs(1));
    let rules: RuleSet = "100/min gcra burst=100".parse().unwrap();
    let (eu_side, us_side) = linked(&regions, &eu, &us);
    assert_eq!(admit(&us_side, &rules, 45).await, 45);
    assert_eq!(admit(&eu_side, &rules, 50).await, 50);
    // eu's share is spent: this denial starts a round in the background.
    assert_eq!(admit(&eu_side, &rules, 1).await, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stats = eu_side.stats();
    assert_eq!(
        (
            stats.transfers_asked,
            stats.transfers_granted,
            stats.units_moved
        ),
        (1, 1, 2),
        "{stats:?}"
    );
    assert_eq!(free(&us_side, &rules).await, 3, "the donor gave 2 of its 5");
    assert_eq!(admit(&eu_side, &rules, 10).await, 2);
    assert_eq!(admit(&us_side, &rules, 10).await, 3);
    // 45 + 50 + 2 + 3: the whole burst, not a unit more.
}

/// A donor with nothing free is not asked; one whose units went to its own demand
/// between the peek and the ask refuses, and a refusal consumes nothing: neither share
/// changes.
#[tokio::test(start_paused = true)]
async fn a_refused_transfer_moves_nothing() {
    let clock = ManualClock::new(1_000_000);
    let rules: RuleSet = "100/min gcra burst=100".parse().unwrap();
    for race in [false, true] {
        let (eu, us) = (mem(&clock), mem(&clock));
        let regions = unpooled(Duration::from_secs(1));
        let (eu_side, us_side) = linked(&regions, &eu, &us);
        let spent = if race { 10 } else { 50 };
        assert_eq!(admit(&us_side, &rules, spent).await, spent);
        assert_eq!(admit(&eu_side, &rules, 51).await, 50);
        if race {
            // The peek (30 ms away) saw 40 free and eu asks for 20; before the ask
            // arrives (at 60 ms), us's own demand takes 35.
            tokio::time::sleep(Duration::from_millis(45)).await;
            assert_eq!(admit(&us_side, &rules, 35).await, 35);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = eu_side.stats();
        assert_eq!(stats.transfers_asked, u64::from(race), "{stats:?}");
        assert_eq!(
            (stats.transfers_granted, stats.units_moved, stats.units_lost),
            (0, 0, 0)
        );
        assert_eq!(admit(&eu_side, &rules, 5).await, 0);
        assert_eq!(free(&us_side, &rules).await, if race { 5 } else { 0 });
    }
}

/// A reply lost after the donor charged (a reset, a timeout), or one that comes after
/// the transfer's deadline: the donor's units are gone, the recipient gets nothing. The
/// regions then admit less than the limit, never more.
#[tokio::test(start_paused = true)]
async fn a_lost_reply_loses_capacity_and_never_creates_it() {
    let clock = ManualClock::new(1_000_000);
    let rules: RuleSet = "100/min gcra burst=100".parse().unwrap();
    for late in [false, true] {
        let (eu, us) = (mem(&clock), mem(&clock));
        let lease = Duration::from_millis(100);
        let regions = unpooled(lease);
        let link = Net::new(
            &us,
            if late {
                // Slower than the transfer's deadline (ℓ_g), on the local clock.
                Duration::from_millis(150)
            } else {
                Duration::from_millis(30)
            },
        );
        link.lose.store(!late, std::sync::atomic::Ordering::Relaxed);
        let lose = Arc::clone(&link.lose);
        let eu_side = instance(regions.clone(), "eu", &eu, link);
        let us_side = instance(regions, "us", &us, Net::new(&eu, Duration::from_millis(30)));
        assert_eq!(admit(&eu_side, &rules, 51).await, 50);
        // The local clock moves with the link's delay (a peek, then the ask).
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            clock.advance(Duration::from_millis(10));
        }
        lose.store(false, std::sync::atomic::Ordering::Relaxed);
        let stats = eu_side.stats();
        if late {
            assert_eq!(
                (stats.transfers_granted, stats.units_lost),
                (1, 25),
                "{stats:?}"
            );
        } else {
            assert_eq!(stats.transfers_failed, 1, "{stats:?}");
        }
        assert_eq!(stats.units_moved, 0, "{stats:?}");
        // 400 ms at 50/min refills nothing in either share: eu gets nothing more, and
        // us lost the 25 units it was charged.
        assert_eq!(admit(&eu_side, &rules, 10).await, 0);
        assert_eq!(admit(&us_side, &rules, 50).await, 25);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Shares as configured.
    Static,
    /// Rebalanced every 100 ms per key (donor first).
    Rebalance,
    /// A broken rebalancing, for the checker to catch: the region whose share denies
    /// gives itself 5 units first and asks a donor for them afterwards, whatever the
    /// donor answers (a recipient that credits before the donor's reply).
    CreditFirst,
}

const STEP: Duration = Duration::from_millis(10);

/// Three regions 30 ms apart, one instance each, g = 0.5, ℓ_g = 250 ms, on one manual
/// clock that moves with tokio's paused time; `rate(t, region)` requests per second at
/// `t` seconds. Answers every admission's time (µs) and the instances' stats summed.
async fn simulate(
    rules: &RuleSet,
    mode: Mode,
    seconds: u32,
    rate: impl Fn(f64, usize) -> f64,
) -> (Vec<u64>, u64, u64) {
    let clock = ManualClock::new(1_000_000);
    let mems: Vec<Mem> = (0..3).map(|_| mem(&clock)).collect();
    let names = ["r0", "r1", "r2"];
    let regions = Regions::even(names)
        .unwrap()
        .pool_lease(Duration::from_millis(250));
    let shares = regions.split(rules).unwrap();
    let mut stores = Vec::new();
    for (r, name) in names.iter().enumerate() {
        let mut builder = RegionStore::builder(regions.clone())
            .region(name)
            .local(Net::new(&mems[r], Duration::ZERO));
        for (to, other) in names.iter().enumerate() {
            let delay = if to == r {
                Duration::ZERO
            } else {
                Duration::from_millis(30)
            };
            builder = builder.link(other, Net::new(&mems[to], delay));
        }
        builder = match mode {
            Mode::Rebalance => builder.rebalance_every(Duration::from_millis(100)),
            Mode::Static | Mode::CreditFirst => builder.no_rebalance(),
        };
        stores.push(builder.build().unwrap());
    }
    let mut owed = [0.0f64; 3];
    let mut last_credit = [0u64; 3];
    let mut admitted = Vec::new();
    let mut moved = 0;
    for step in 0..seconds * 100 {
        let t = f64::from(step) / 100.0;
        for r in 0..3 {
            owed[r] += rate(t, r) / 100.0;
            while owed[r] >= 1.0 {
                owed[r] -= 1.0;
                let now = mems[r].now_us();
                if stores[r].check(b"k", rules, 1).await.unwrap().is_allowed() {
                    admitted.push(now);
                } else if mode == Mode::CreditFirst && now >= last_credit[r] + 100_000 {
                    last_credit[r] = now;
                    let own = shares.base(r).unwrap();
                    mems[r].refund(b"bk", own, 5, now).await.unwrap();
                    let donor = (r + 1) % 3;
                    let theirs = shares.base(donor).unwrap();
                    let _ = mems[donor].check(b"bk", theirs, 5).await.unwrap();
                    moved += 5;
                }
            }
        }
        tokio::time::sleep(STEP).await;
        clock.advance(STEP);
    }
    for s in &stores {
        moved += s.stats().units_moved;
    }
    let calls = stores.iter().map(|s| s.stats().cross_region_calls).sum();
    (admitted, moved, calls)
}

/// Intervals [t_i, t_j] of `times` that admit more than `B + ⌊(t_j − t_i + slack)·L/P⌋`.
fn rate_violations(times: &[u64], b: u64, limit: u64, period_us: u64, slack_us: u64) -> u64 {
    let mut violations = 0;
    for i in 0..times.len() {
        for j in i..times.len() {
            let allowed = b + (times[j] - times[i] + slack_us) * limit / period_us;
            if (j - i + 1) as u64 > allowed {
                violations += 1;
            }
        }
    }
    violations
}

/// Windows of `period_us` that admit more than `limit`.
fn window_violations(times: &[u64], limit: u64, period_us: u64) -> u64 {
    let mut counts = std::collections::HashMap::<u64, u64>::new();
    for t in times {
        *counts.entry(t / period_us).or_default() += 1;
    }
    counts.values().filter(|&&c| c > limit).count() as u64
}

/// Demand moving between the regions every 2 s (200/s in the hot one, 5/s in the
/// others), and every region overloaded (a donor has nothing free): rebalancing keeps
/// the bound, GCRA's and a fixed window's, and moves units only where a donor has them;
/// a recipient that credits itself before the donor's reply breaks the bound, and the
/// same checker says so.
#[tokio::test(start_paused = true)]
async fn rebalancing_keeps_the_bound() {
    let gcra: RuleSet = "6000/min gcra burst=60".parse().unwrap();
    let fixed: RuleSet = "100/s fixed-window".parse().unwrap();
    let moving = |t: f64, r: usize| {
        if (t / 2.0) as usize % 3 == r {
            200.0
        } else {
            5.0
        }
    };
    let busy = |_: f64, _: usize| 100.0;
    // g·ℓ_g: half of 250 ms (the regions' stores are exact: ℓ_i = 0).
    let slack = 125_000;
    let mut admitted = Vec::new();
    for mode in [Mode::Static, Mode::Rebalance] {
        let (times, moved, _) = simulate(&gcra, mode, 12, moving).await;
        assert_eq!(
            rate_violations(&times, 60, 100, 1_000_000, slack),
            0,
            "{mode:?}"
        );
        if mode == Mode::Rebalance {
            assert!(moved > 0, "nothing moved");
        }
        admitted.push(times.len());
        let (times, _, _) = simulate(&fixed, mode, 12, moving).await;
        assert_eq!(window_violations(&times, 100, 1_000_000), 0, "{mode:?}");
    }
    assert!(
        admitted[1] > admitted[0],
        "rebalancing admits more of the moving demand: {admitted:?}"
    );

    // Every region overloaded: donors have (nearly) nothing free, (nearly) nothing
    // moves, the bound holds.
    let (times, moved, calls) = simulate(&gcra, Mode::Rebalance, 6, busy).await;
    assert_eq!(rate_violations(&times, 60, 100, 1_000_000, slack), 0);
    assert!(calls > 0, "no round ran");
    assert!(moved < 30, "{moved} units moved");
    // The negative control: crediting first creates capacity, which the checker sees.
    let (times, _, _) = simulate(&gcra, Mode::CreditFirst, 6, busy).await;
    assert!(rate_violations(&times, 60, 100, 1_000_000, slack) > 0);
}
