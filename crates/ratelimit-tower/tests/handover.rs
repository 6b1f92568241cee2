//! Switching back from the fallback, in process and step by step: a store that fails
//! and comes back (a `MemoryStore` behind a switch, on a manual clock), and one layer
//! with `fallback_share(4)`. What the fallback admitted is in the store before the store
//! decides the key again; its slots still held are taken in the store and released
//! there. For a while after an instance's return (`fallback_grace`), the store's
//! admissions must fit its share too: two instances, one back while the other is still
//! down. The live version, four instances on a real redis-server, is `recovery.rs`.
#![cfg(feature = "axum")]

use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use ratelimit_core::{Clock, Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_tower::{Admission, AdmittedBy, GlobalKey, RateLimitLayer};
use tokio::task::JoinHandle;
use tower::ServiceExt;

/// A minute's start, so that a test's minute window holds all of it.
const T0: u64 = 1_699_999_200_000_000;

/// A `MemoryStore` that fails every call while `down`; without `takes`, it takes no
/// slot whatever the limit (as a store without [`Store::take_slot`]). It keeps the last
/// key and rules a check asked for.
#[derive(Clone)]
struct Switch {
    store: Arc<MemoryStore<ManualClock>>,
    down: Arc<AtomicBool>,
    takes: bool,
    seen: Arc<Mutex<Option<Seen>>>,
    /// What [`Store::recovered_at_us`] answers.
    recovered: Arc<AtomicU64>,
}

/// A key and the rules a check asked for.
type Seen = (Vec<u8>, RuleSet);

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection refused")
    }
}

impl std::error::Error for Refused {}

impl Switch {
    fn new() -> Self {
        Self {
            store: Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build()),
            down: Arc::default(),
            takes: true,
            seen: Arc::default(),
            recovered: Arc::default(),
        }
    }

    fn up(&self) -> Result<(), Refused> {
        if self.down.load(Ordering::SeqCst) {
            Err(Refused)
        } else {
            Ok(())
        }
    }
}

impl Store for Switch {
    type Error = Refused;

    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Refused>> + Send {
        *self.seen.lock().unwrap() = Some((key.to_vec(), rules.clone()));
        let result = self
            .up()
            .and_then(|()| self.store.check_now(key, rules, cost).map_err(|_| Refused));
        std::future::ready(result)
    }

    fn block(
        &self,
        _: &[u8],
        _: Option<Duration>,
    ) -> impl Future<Output = Result<(), Refused>> + Send {
        std::future::ready(self.up())
    }

    fn unblock(&self, _: &[u8]) -> impl Future<Output = Result<(), Refused>> + Send {
        std::future::ready(self.up())
    }

    fn reset(&self, _: &[u8], _: &RuleSet) -> impl Future<Output = Result<(), Refused>> + Send {
        std::future::ready(self.up())
    }

    fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Refused>> + Send {
        let result = (self.up()).map(|()| {
            self.store
                .settle_now(key, rules, charged, actual, charged_at)
        });
        std::future::ready(result)
    }

    fn release(
        &self,
        key: &[u8],
        _: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Refused>> + Send {
        let result = self.up().map(|()| self.store.release_now(key, slot));
        std::future::ready(result)
    }

    fn renew(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Refused>> + Send {
        let result = self.up().map(|()| self.store.renew_now(key, rules, slot));
        std::future::ready(result)
    }

    fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<Option<u64>, Refused>> + Send {
        let result = (self.up()).map(|()| {
            self.takes
                .then(|| self.store.take_slot_now(key, rules))
                .flatten()
        });
        std::future::ready(result)
    }

    fn now_us(&self) -> u64 {
        self.store.clock().now_us()
    }

    fn recovered_at_us(&self) -> u64 {
        self.recovered.load(Ordering::SeqCst)
    }
}

/// One instance's app, without the grace after an outage (which `grace` tests).
fn app(store: Switch, rules: &str, handover: bool) -> Router {
    app_with_grace(store, rules, handover, Duration::ZERO)
}

fn app_with_grace(store: Switch, rules: &str, handover: bool, grace: Duration) -> Router {
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules(rules)
        .unwrap()
        .namespace("handover")
        .fallback_share(NonZeroU32::new(4).unwrap())
        .fallback_handover(handover)
        .fallback_grace(grace)
        .admission_extension(true)
        .without_deny_cache()
        .build()
        .unwrap();
    Router::new()
        .route(
            "/",
            get(|req: Request<Body>| async move {
                match req.extensions().get::<Admission>().unwrap().by() {
                    AdmittedBy::Store => "store",
                    AdmittedBy::Fallback => "fallback",
                    _ => "other",
                }
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "slow"
            }),
        )
        .layer(layer)
}

/// Sends `n` requests; answers how many were admitted, by whom.
async fn send(app: &Router, n: usize) -> (usize, usize) {
    let (mut store, mut fallback) = (0, 0);
    for _ in 0..n {
        let res = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        if res.status() != StatusCode::OK {
            continue;
        }
        let body = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        match &body[..] {
            b"store" => store += 1,
            b"fallback" => fallback += 1,
            other => panic!("{other:?}"),
        }
    }
    (store, fallback)
}

/// `100/min` shared by 4: the fallback admits its 25, and once the store answers it has
/// them, so it admits 75 more in the minute, not 100; without the handover, 100.
#[tokio::test]
async fn the_store_gets_what_the_fallback_admitted_before_it_decides_again() {
    for (handover, after) in [(true, 75), (false, 100)] {
        let store = Switch::new();
        let app = app(store.clone(), "100/min fixed-window", handover);
        assert_eq!(send(&app, 10).await, (10, 0), "the store decides");
        store.down.store(true, Ordering::SeqCst);
        assert_eq!(send(&app, 40).await, (0, 25), "the instance's share");
        store.down.store(false, Ordering::SeqCst);
        store.store.clock().advance(Duration::from_secs(1));
        let (by_store, by_fallback) = send(&app, 200).await;
        assert_eq!(by_fallback, 0);
        assert_eq!(
            by_store,
            after - 10,
            "handover {handover}: the store admits the limit less what it had and what \
             the fallback admitted"
        );
    }
}

/// A store that comes back empty (restarted without persistence) is re-seeded with
/// what the fallback admitted in the window still open, and only that: units of a
/// window that closed meanwhile are not charged.
#[tokio::test]
async fn an_empty_store_is_reseeded_with_what_still_counts() {
    let store = Switch::new();
    let app = app(store.clone(), "20/s fixed-window", true);
    store.down.store(true, Ordering::SeqCst);
    assert_eq!(send(&app, 3).await, (0, 3), "the share is 5 a second");
    store.store.clock().advance(Duration::from_secs(1));
    assert_eq!(send(&app, 2).await, (0, 2));
    store.down.store(false, Ordering::SeqCst);
    // 2 of the 5 count in this second: the store admits 18.
    assert_eq!(send(&app, 30).await, (18, 0));
}

/// A slot the fallback gave and its request still holds is taken in the store when the
/// store answers again: the store admits `N - 1` at once meanwhile, and gets it back
/// when the request ends. Without the handover it admits `N` beside it.
#[tokio::test]
async fn a_fallback_slot_still_held_is_taken_in_the_store() {
    slots(true).await;
    slots(false).await;
}

async fn slots(handover: bool) {
    let store = Switch::new();
    let app = app(store.clone(), "4 concurrent", handover);
    let slow = slow_by_the_fallback(&store, &app).await;
    // Four requests hold their slots at once: the store has room for three.
    let statuses = slow_at_once(&app, 4).await;
    let last = if handover {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::OK, StatusCode::OK, last],
        "handover {handover}: the fallback's slot counts in the store"
    );
    let first = slow.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let _ = axum::body::to_bytes(first.into_body(), usize::MAX).await;
    // Every slot released (in tasks), the store's copy of the fallback's too: four at
    // once again.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(slow_at_once(&app, 4).await, [StatusCode::OK; 4]);
}

/// A store full of requests of other instances (or of releases that failed in the
/// outage) when it answers again: the fallback's slot is taken all the same, over the
/// limit, so the store admits again only once fewer than `N` run, the fallback's
/// request among them. A store that takes no slot over the limit leaves it local (the
/// `WARN`), and admits one more beside it.
#[tokio::test]
async fn a_fallback_slot_is_taken_in_a_store_that_is_full() {
    for takes in [true, false] {
        let store = Switch {
            takes,
            ..Switch::new()
        };
        let app = app(store.clone(), "4 concurrent", true);
        assert_eq!(send(&app, 1).await, (1, 0));
        // Its slot released (in a task).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (key, rules) = store.seen.lock().unwrap().clone().unwrap();
        let others: Vec<u64> = (0..4)
            .map(|_| {
                store
                    .store
                    .check_now(&key, &rules, 1)
                    .unwrap()
                    .slot()
                    .unwrap()
            })
            .collect();
        let slow = slow_by_the_fallback(&store, &app).await;
        // Handed over: the store holds five, or four and the fallback one of its own.
        assert_eq!(send(&app, 1).await, (0, 0), "takes {takes}: full");
        store.store.release_now(&key, others[0]);
        store.store.release_now(&key, others[1]);
        // Two of the others and the fallback's request run: room for one more, not two.
        let statuses = slow_at_once(&app, 2).await;
        let second = if takes {
            StatusCode::TOO_MANY_REQUESTS
        } else {
            StatusCode::OK
        };
        assert_eq!(
            statuses,
            [StatusCode::OK, second],
            "takes {takes}: the fallback's request counts in the store"
        );
        assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
    }
}

/// Two instances of a fleet of four, sharing one store: `b` stays down after `a` is back.
fn pair() -> (Switch, Switch) {
    let a = Switch::new();
    let b = Switch {
        down: Arc::default(),
        ..a.clone()
    };
    (a, b)
}

/// Sends a `/slow` request (300 ms) in a task of its own.
fn spawn_slow(app: &Router) -> JoinHandle<Result<Response<Body>, Infallible>> {
    tokio::spawn(
        app.clone()
            .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
    )
}

/// A `/slow` request the fallback admits while `store` is down; the store answers again
/// once it runs.
async fn slow_by_the_fallback(
    store: &Switch,
    app: &Router,
) -> JoinHandle<Result<Response<Body>, Infallible>> {
    store.down.store(true, Ordering::SeqCst);
    let slow = spawn_slow(app);
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.down.store(false, Ordering::SeqCst);
    slow
}

/// Sends `n` `/slow` requests at once; answers their statuses, sorted.
async fn slow_at_once(app: &Router, n: usize) -> Vec<StatusCode> {
    let held: Vec<_> = (0..n).map(|_| spawn_slow(app)).collect();
    let mut statuses = Vec::new();
    for h in held {
        statuses.push(h.await.unwrap().unwrap().status());
    }
    statuses.sort();
    statuses
}

/// `4 concurrent` shared by 4: each instance's fallback holds one slot. `a` is back and
/// hands its slot over while `b` still runs its own: in the grace, `a` is held to its
/// share (its own request runs), so the fleet has 2 in flight, not 5 (the store's 3
/// free slots beside `b`'s, which the store cannot see). After the grace, the store
/// alone decides.
#[tokio::test]
async fn in_the_grace_an_instance_back_leaves_the_others_shares_free() {
    let grace = Duration::from_secs(1);
    for with_grace in [true, false] {
        let (a, b) = pair();
        let g = if with_grace { grace } else { Duration::ZERO };
        let (app_a, app_b) = (
            app_with_grace(a.clone(), "4 concurrent", true, g),
            app_with_grace(b.clone(), "4 concurrent", true, g),
        );
        a.down.store(true, Ordering::SeqCst);
        b.down.store(true, Ordering::SeqCst);
        let first = [&app_a, &app_b].map(spawn_slow);
        tokio::time::sleep(Duration::from_millis(50)).await;
        a.down.store(false, Ordering::SeqCst);
        let statuses = slow_at_once(&app_a, 3).await;
        let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
        assert_eq!(
            admitted,
            if with_grace { 0 } else { 3 },
            "grace {with_grace}: {statuses:?}"
        );
        for h in first {
            assert_eq!(h.await.unwrap().unwrap().status(), StatusCode::OK);
        }
        if !with_grace {
            continue;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Still in the grace: one at once, the share's.
        assert_eq!(
            slow_at_once(&app_a, 2).await,
            [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]
        );
        // Both slots of that request went back, the store's with the share's.
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.store.clock().advance(grace);
        assert_eq!(slow_at_once(&app_a, 4).await, [StatusCode::OK; 4]);
    }
}

/// `100/min fixed-window` shared by 4: `a` and `b` each admit their 25 while the store
/// is down; `a` comes back first. In the grace `a` admits nothing more (its share is
/// spent), `b` comes back within it and hands its 25 over, and after the grace the store
/// admits the 50 left: 100 in the minute. Without the grace, `a` admits 75 before `b`'s
/// 25 arrive: 125.
#[tokio::test]
async fn in_the_grace_a_window_admits_no_more_than_its_limit() {
    let grace = Duration::from_secs(1);
    for (with_grace, total) in [(true, 100), (false, 125)] {
        let (a, b) = pair();
        let g = if with_grace { grace } else { Duration::ZERO };
        let rules = "100/min fixed-window";
        let (app_a, app_b) = (
            app_with_grace(a.clone(), rules, true, g),
            app_with_grace(b.clone(), rules, true, g),
        );
        a.down.store(true, Ordering::SeqCst);
        b.down.store(true, Ordering::SeqCst);
        assert_eq!(send(&app_a, 40).await, (0, 25));
        assert_eq!(send(&app_b, 40).await, (0, 25));
        a.down.store(false, Ordering::SeqCst);
        let (mut admitted, _) = send(&app_a, 100).await;
        b.down.store(false, Ordering::SeqCst);
        admitted += send(&app_b, 100).await.0;
        a.store.clock().advance(grace);
        admitted += send(&app_a, 100).await.0;
        admitted += send(&app_b, 100).await.0;
        assert_eq!(50 + admitted, total, "grace {with_grace}");
    }
}

/// An instance that decided nothing by its fallback (no request of its own failed) but
/// whose store regained its connection is held to its share in the grace too: `b`
/// admits its 25 while down, `c`'s store reconnects, and `c` admits 25 in the grace, then
/// (`b` back meanwhile) the 50 left. Without the reconnection on record, `c` admits 75
/// at once beside `b`'s unseen 25.
#[tokio::test]
async fn an_instance_whose_store_came_back_is_held_to_its_share_in_the_grace() {
    let grace = Duration::from_secs(1);
    for (on_record, total) in [(true, 100), (false, 125)] {
        let (b, c) = pair();
        let rules = "100/min fixed-window";
        let (app_b, app_c) = (
            app_with_grace(b.clone(), rules, true, grace),
            app_with_grace(c.clone(), rules, true, grace),
        );
        b.down.store(true, Ordering::SeqCst);
        assert_eq!(send(&app_b, 40).await, (0, 25));
        if on_record {
            c.recovered.store(c.now_us(), Ordering::SeqCst);
        }
        let (mut admitted, by_fallback) = send(&app_c, 100).await;
        assert_eq!(by_fallback, 0);
        b.down.store(false, Ordering::SeqCst);
        admitted += send(&app_b, 100).await.0;
        c.store.clock().advance(grace);
        admitted += send(&app_c, 100).await.0;
        assert_eq!(25 + admitted, total, "on record {on_record}");
    }
}
