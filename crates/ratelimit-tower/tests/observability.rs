//! What operators see: `tracing` events for every failure policy, and (feature `metrics`)
//! counters labelled by rule.

mod common;
use common::Down;

use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use ratelimit_tower::{FailurePolicy, GlobalKey, RateLimitLayer};
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a subscriber that keeps the events up to `level`; returns `f`'s result
/// and what the subscriber wrote.
fn with_log<R>(level: tracing::Level, f: impl FnOnce() -> R) -> (R, String) {
    let _turn = one_at_a_time();
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(level)
        .finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    (result, log)
}

/// The tests of this file that send requests take turns: `tracing` keeps one maximum
/// level and one interest per callsite for the whole process, computed from the
/// subscribers alive when a callsite is first hit, so a request sent on another thread
/// (with no subscriber, or one at another level) can hide the events a test looks for.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn run<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn each_failure_policy_is_visible_in_tracing() {
    for (policy, label, status) in [
        (FailurePolicy::FailOpen, "fail_open", StatusCode::OK),
        (
            FailurePolicy::FailClosed,
            "fail_closed",
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (FailurePolicy::Fallback, "fallback", StatusCode::OK),
    ] {
        let (got, log) = with_log(tracing::Level::WARN, || {
            let layer = RateLimitLayer::builder(Down::default(), GlobalKey)
                .rules("5/min")
                .unwrap()
                .failure_policy(policy)
                .build()
                .unwrap();
            let app = Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer);
            run(app.oneshot(Request::get("/").body(Body::empty()).unwrap()))
                .unwrap()
                .status()
        });
        assert_eq!(got, status, "{label}");
        assert!(log.contains("WARN"), "{label}: {log}");
        assert!(log.contains(label), "{label}: {log}");
        assert!(log.contains("connection refused"), "{label}: {log}");
    }
}

#[test]
fn missing_keys_are_logged_at_a_bounded_rate_with_a_count() {
    use ratelimit_core::{ManualClock, MemoryStore};

    #[derive(Clone)]
    struct User(String);
    // Set by an authentication layer that, misplaced, runs after the limiter.
    let by_user = |req: &Request<Body>| req.extensions().get::<User>().map(|u| u.0.clone());
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let ((), log) = with_log(tracing::Level::ERROR, || {
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(RateLimitLayer::new(
                store,
                by_user,
                "5/min".parse().unwrap(),
            ));
        let send = |n: usize| {
            for _ in 0..n {
                let req = Request::get("/").body(Body::empty()).unwrap();
                let res = run(app.clone().oneshot(req)).unwrap();
                assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
            }
        };
        send(50);
        clock.advance(Duration::from_secs(9));
        send(50);
        clock.advance(Duration::from_secs(1));
        send(1);
    });
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "{log}");
    assert!(
        lines[0].contains("ERROR") && lines[0].contains("requests=1"),
        "{log}"
    );
    assert!(lines[0].contains("closure answered `None`"), "{log}");
    assert!(lines[1].contains("requests=100"), "{log}");
}

#[test]
fn an_unnamed_layer_on_a_shared_store_warns_once_at_build() {
    let build = |shared: bool, namespace: Option<&str>| {
        let store = Down {
            shared,
            ..Down::default()
        };
        let (mut builder, line) = (RateLimitLayer::builder(store, GlobalKey), line!());
        if let Some(ns) = namespace {
            builder = builder.namespace(ns);
        }
        (builder.rules("5/min").unwrap().build().unwrap(), line)
    };
    let ((_, line), log) = with_log(tracing::Level::WARN, || build(true, None));
    assert_eq!(log.lines().count(), 1, "{log}");
    let site = format!("tests/observability.rs:{line}:");
    assert!(log.contains(&site), "names where the layer is built: {log}");
    assert!(log.contains(".namespace("), "names the fix: {log}");
    let (_, log) = with_log(tracing::Level::WARN, || build(true, Some("api")));
    assert_eq!(log, "", "a named layer");
    let (_, log) = with_log(tracing::Level::WARN, || build(false, None));
    assert_eq!(log, "", "a store of this process alone");
}

#[test]
fn client_keys_appear_in_logs_above_trace_only_as_a_digest() {
    use ratelimit_core::{ManualClock, MemoryStore};
    use ratelimit_tower::key::log_digest;
    use ratelimit_tower::HeaderKey;

    const SECRET: &str = "k-secret-4711";
    let send = |app: &Router, n: usize| {
        for _ in 0..n {
            let req = Request::get("/")
                .header("x-api-key", SECRET)
                .body(Body::empty())
                .unwrap();
            run(app.clone().oneshot(req)).unwrap();
        }
    };
    let app = |store| {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::builder(store, HeaderKey::new("x-api-key"))
                .rules("1/min")
                .unwrap()
                .without_deny_cache()
                .build()
                .unwrap(),
        )
    };
    let digest = log_digest(SECRET.as_bytes()).to_string();
    // Refused (DEBUG) and, through a store that fails, reported (WARN).
    let ((), log) = with_log(tracing::Level::DEBUG, || {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(1_700_000_000_000_000))
            .build();
        send(&app(store), 3);
    });
    assert!(log.contains("refusing request"), "{log}");
    assert!(log.contains(&digest), "{log}");
    assert!(!log.contains(SECRET), "{log}");
    let ((), log) = with_log(tracing::Level::DEBUG, || {
        let layer = RateLimitLayer::builder(Down::default(), HeaderKey::new("x-api-key"))
            .rules("1/min")
            .unwrap()
            .build()
            .unwrap();
        send(
            &Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer),
            1,
        );
    });
    assert!(log.contains("WARN") && log.contains(&digest), "{log}");
    assert!(!log.contains(SECRET), "{log}");
    // TRACE shows the key itself, for debugging a single client.
    let ((), log) = with_log(tracing::Level::TRACE, || {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(1_700_000_000_000_000))
            .build();
        send(&app(store), 1);
    });
    assert!(log.contains(SECRET), "{log}");
}

#[test]
fn store_failures_are_logged_at_a_bounded_rate_with_a_count() {
    use ratelimit_core::ManualClock;

    let clock = ManualClock::new(1_700_000_000_000_000);
    let ((), log) = with_log(tracing::Level::WARN, || {
        let layer = RateLimitLayer::builder(
            Down {
                clock: Some(clock.clone()),
                ..Down::default()
            },
            GlobalKey,
        )
        .rules("5/min")
        .unwrap()
        .failure_policy(FailurePolicy::FailOpen)
        .build()
        .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        let send = |n: usize| {
            for _ in 0..n {
                let req = Request::get("/").body(Body::empty()).unwrap();
                assert_eq!(
                    run(app.clone().oneshot(req)).unwrap().status(),
                    StatusCode::OK
                );
            }
        };
        send(200);
        clock.advance(Duration::from_secs(9));
        send(200);
        clock.advance(Duration::from_secs(1));
        send(1);
    });
    let lines: Vec<&str> = log.lines().collect();
    // An outage fails every request: one line per 10 s, not one per request.
    assert_eq!(lines.len(), 2, "{log}");
    assert!(
        lines[0].contains("WARN") && lines[0].contains("requests=1"),
        "{log}"
    );
    assert!(lines[0].contains("admitted unchecked"), "{log}");
    assert!(lines[1].contains("requests=400"), "{log}");
}

#[cfg(feature = "metrics")]
mod counters {
    use super::*;
    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use ratelimit_core::MemoryStore;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Counters(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

    impl Counters {
        fn get(&self, name: &str) -> u64 {
            self.0
                .lock()
                .unwrap()
                .get(name)
                .map_or(0, |c| c.load(Ordering::SeqCst))
        }
    }

    impl Recorder for Counters {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            let counter = self.0.lock().unwrap().entry(name).or_default().clone();
            Counter::from_arc(counter)
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn counters_labelled_by_layer_tier_and_rule() {
        let _turn = super::one_at_a_time();
        let counters = Counters::default();
        let store = Arc::new(MemoryStore::new());
        let by_header =
            |req: &Request<Body>| req.headers().get("x-key").map(|v| v.as_bytes().to_vec());
        let (app, twin, down, layer) = metrics::with_local_recorder(&counters, || {
            let build = |namespace: &str| {
                RateLimitLayer::builder(store.clone(), by_header)
                    .rules("2/min fixed-window name=minute; 10/h fixed-window name=hour")
                    .unwrap()
                    .namespace(namespace)
                    .build()
                    .unwrap()
            };
            let layer = build("api");
            let down = RateLimitLayer::builder(Down::default(), GlobalKey)
                .rules("2/min name=other")
                .unwrap()
                .namespace("down")
                .build()
                .unwrap();
            let route = || Router::new().route("/", get(|| async { "ok" }));
            (
                route().layer(layer.clone()),
                route().layer(build("api2")),
                route().layer(down),
                layer,
            )
        });
        run(layer.block(b"blocked", None)).unwrap();
        let req = |key: &str| {
            Request::get("/")
                .header("x-key", key)
                .body(Body::empty())
                .unwrap()
        };
        run(async {
            for _ in 0..5 {
                app.clone().oneshot(req("a")).await.unwrap();
            }
            app.clone().oneshot(req("blocked")).await.unwrap();
            // The same rule names on another layer count apart.
            twin.oneshot(req("a")).await.unwrap();
            down.oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
        });
        let api = |name: &str, rule: &str| format!("{name}{{layer=api,tier=,rule={rule}}}");
        assert_eq!(counters.get(&api("ratelimit_admitted_total", "minute")), 2);
        assert_eq!(counters.get(&api("ratelimit_admitted_total", "hour")), 2);
        assert_eq!(
            counters.get("ratelimit_admitted_total{layer=api2,tier=,rule=minute}"),
            1
        );
        // Only the rule that denied is counted as limiting (three denials, one cached).
        assert_eq!(counters.get(&api("ratelimit_limited_total", "minute")), 3);
        assert_eq!(counters.get(&api("ratelimit_limited_total", "hour")), 0);
        assert_eq!(counters.get("ratelimit_blocked_total{layer=api,tier=}"), 1);
        assert_eq!(
            counters.get("ratelimit_store_errors_total{layer=down,tier=,policy=fail_open}"),
            1
        );
    }
}
