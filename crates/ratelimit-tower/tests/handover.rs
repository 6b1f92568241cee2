//! Switching back from the fallback, in process and step by step: a store that fails
//! and comes back (a `MemoryStore` behind a switch, on a manual clock), and one layer
//! with `fallback_share(4)`. What the fallback admitted is in the store before the store
//! decides the key again; its slots still held are taken in the store and released
//! there. The live version, four instances on a real redis-server, is `recovery.rs`.
#![cfg(feature = "axum")]

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use ratelimit_core::{Clock, Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_tower::{Admission, AdmittedBy, GlobalKey, RateLimitLayer};
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
}

fn app(store: Switch, rules: &str, handover: bool) -> Router {
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules(rules)
        .unwrap()
        .namespace("handover")
        .fallback_share(NonZeroU32::new(4).unwrap())
        .fallback_handover(handover)
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
    store.down.store(true, Ordering::SeqCst);
    let slow = tokio::spawn(
        app.clone()
            .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.down.store(false, Ordering::SeqCst);
    // Four requests hold their slots at once: the store has room for three.
    let held: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(
                app.clone()
                    .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
            )
        })
        .collect();
    let mut statuses = Vec::new();
    for h in held {
        statuses.push(h.await.unwrap().unwrap().status());
    }
    statuses.sort();
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
    let again: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(
                app.clone()
                    .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
            )
        })
        .collect();
    for h in again {
        assert_eq!(h.await.unwrap().unwrap().status(), StatusCode::OK);
    }
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
        store.down.store(true, Ordering::SeqCst);
        let slow = tokio::spawn(
            app.clone()
                .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        store.down.store(false, Ordering::SeqCst);
        // Handed over: the store holds five, or four and the fallback one of its own.
        assert_eq!(send(&app, 1).await, (0, 0), "takes {takes}: full");
        store.store.release_now(&key, others[0]);
        store.store.release_now(&key, others[1]);
        // Two of the others and the fallback's request run: room for one more, not two.
        let both: Vec<_> = (0..2)
            .map(|_| {
                tokio::spawn(
                    app.clone()
                        .oneshot(Request::get("/slow").body(Body::empty()).unwrap()),
                )
            })
            .collect();
        let mut statuses = Vec::new();
        for h in both {
            statuses.push(h.await.unwrap().unwrap().status());
        }
        statuses.sort();
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
