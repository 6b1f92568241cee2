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
fn a_tier_the_limits_lack_warns_once_per_name_at_a_bounded_rate() {
    use ratelimit_core::{ManualClock, MemoryStore};

    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let plan = |req: &Request<Body>| {
        req.headers()
            .get("x-plan")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let ((), log) = with_log(tracing::Level::WARN, || {
        let layer = RateLimitLayer::builder(store, GlobalKey)
            .rules("1000/min name=base")
            .unwrap()
            .tier("pro", "1000/min name=pro".parse().unwrap())
            .select_tier(plan)
            .build()
            .unwrap();
        let handle = layer.limits();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        let send = |name: &str| {
            let req = Request::get("/")
                .header("x-plan", name)
                .body(Body::empty())
                .unwrap();
            let res = run(app.clone().oneshot(req)).unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{name}");
            assert_eq!(res.headers()["ratelimit-policy"], r#""base";q=1000;w=60"#);
        };
        for name in ["gold", "gold", "silver", "gold", "silver"] {
            send(name);
        }
        // A client making up names: 64 names get a line each, the rest one line per 10 s.
        let long = "x".repeat(10_000);
        send(&long);
        for i in 0..200 {
            send(&format!("made-up-{i}"));
        }
        clock.advance(Duration::from_secs(10));
        send("made-up-last");
        // New limits, a new version: "gold" is reported again if still missing.
        handle
            .replace(ratelimit_tower::Limits::new(
                "1000/min name=base".parse().unwrap(),
            ))
            .unwrap();
        send("gold");
    });
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.iter().all(|l| l.contains("WARN") && l.len() < 1024),
        "{log}"
    );
    assert!(
        lines.iter().all(|l| l.contains(r#"default_tier="""#)),
        "{log}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("tier=gold ")).count(),
        2,
        "{log}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("tier=silver ")).count(),
        1,
        "{log}"
    );
    assert!(log.contains("…[9800 more bytes]"), "{log}");
    // gold, silver, the long name and 61 made-up names; then two bounded reports.
    assert_eq!(
        lines.iter().filter(|l| l.contains("made-up-")).count(),
        61 + 2,
        "{log}"
    );
    let bounded: Vec<&&str> = lines.iter().filter(|l| l.contains("requests=")).collect();
    assert_eq!(bounded.len(), 2, "{log}");
    assert!(bounded[0].ends_with("requests=1"), "{log}");
    assert!(bounded[1].ends_with("requests=139"), "{log}");
    assert_eq!(lines.len(), 64 + 2 + 1, "{log}");
}

#[cfg(feature = "serde")]
mod limits_file {
    use super::*;
    use ratelimit_tower::{Limits, LimitsFile, LimitsHandle, LoadError};

    /// TOML, the error's message without the source line toml quotes.
    fn parse(text: &str) -> Result<Limits, String> {
        toml::from_str(text).map_err(|e: toml::de::Error| e.message().to_owned())
    }

    fn handle() -> LimitsHandle {
        RateLimitLayer::builder(ratelimit_core::MemoryStore::new(), GlobalKey)
            .rules("5/min name=base")
            .unwrap()
            .select_tier(|_: &Request<Body>| None::<&str>)
            .build()
            .unwrap()
            .limits()
    }

    /// A file of its own, removed on drop.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str, bytes: &[u8]) -> Self {
            let path = std::env::temp_dir().join(format!(
                "ratelimit-tower-{}-{name}.toml",
                std::process::id()
            ));
            std::fs::write(&path, bytes).unwrap();
            Self(path)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// Reloads `path` into `handle` and returns the error and the log.
    fn refused(handle: &LimitsHandle, file: &LimitsFile) -> (LoadError, String) {
        let (result, log) = with_log(tracing::Level::INFO, || run(file.reload(handle)));
        (result.unwrap_err(), log)
    }

    fn one_error_line(log: &str) {
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 1, "{log}");
        assert!(lines[0].contains("ERROR"), "{log}");
        assert!(lines[0].len() < 1024, "{} bytes: {log}", lines[0].len());
        assert!(lines[0].contains("the running ones stay"), "{log}");
    }

    #[test]
    fn a_file_above_the_size_cap_is_refused_reading_at_most_the_cap() {
        let handle = handle();
        let before = handle.current();
        // 50 MB of rule text: refused on its size, never parsed.
        let big = Scratch::new(
            "big",
            format!("rules = \"{}\"", "1".repeat(50 << 20)).as_bytes(),
        );
        let (err, log) = refused(&handle, &LimitsFile::new(&big.0, parse));
        assert!(
            matches!(
                err,
                LoadError::TooLarge {
                    max_bytes: 1_048_576
                }
            ),
            "{err}"
        );
        one_error_line(&log);
        assert_eq!(handle.current(), before);
        // A file without end: only a reader that stops at the cap comes back at all.
        let (err, log) = refused(
            &handle,
            &LimitsFile::new("/dev/zero", parse).max_bytes(4096),
        );
        assert!(
            matches!(err, LoadError::TooLarge { max_bytes: 4096 }),
            "{err}"
        );
        one_error_line(&log);
        assert_eq!(handle.current(), before);
    }

    #[test]
    fn long_values_and_many_tiers_are_refused_in_one_short_line() {
        let handle = handle();
        let before = handle.current();
        let name = "n".repeat(1_000_000);
        let rule = format!("{}/s", "9".repeat(600_000));
        let many = (0..1025).fold("rules = \"1/s\"\n[tiers]\n".to_owned(), |mut t, i| {
            t.push_str(&format!("t{i} = \"{}/s\"\n", i + 1));
            t
        });
        let cases = [
            (
                "name",
                format!("rules = \"1/s\"\n[tiers]\n{name} = \"1/s\"\n"),
                "tier name",
            ),
            ("rule", format!("rules = \"{rule}\"\n"), "more than 2048"),
            (
                "list",
                format!("rules = [\"1/s\", \"{rule}\"]\n"),
                "more than 2048",
            ),
            ("many", many, "1025 tiers, more than 1024"),
            ("binary", "rules = \"\u{1}\"\0\u{ff}".into(), "line"),
        ];
        for (tag, text, says) in cases {
            let file = Scratch::new(tag, text.as_bytes());
            let (err, log) = refused(&handle, &LimitsFile::new(&file.0, parse));
            assert!(err.to_string().contains(says), "{tag}: {err}");
            one_error_line(&log);
            assert_eq!(handle.current(), before, "{tag}");
        }
        let bad_utf8 = Scratch::new("utf8", b"rules = \"1/s\xff\"");
        let (err, log) = refused(&handle, &LimitsFile::new(&bad_utf8.0, parse));
        assert!(matches!(err, LoadError::NotUtf8 { at: 12 }), "{err}");
        one_error_line(&log);
    }

    #[test]
    fn a_reload_logs_its_changes_in_one_bounded_line() {
        let handle = handle();
        let tiers = (0..1024).fold(
            "rules = \"5/min name=base\"\n[tiers]\n".to_owned(),
            |mut t, i| {
                t.push_str(&format!("t{i} = \"{}/s\"\n", i + 1));
                t
            },
        );
        let file = Scratch::new("tiers", tiers.as_bytes());
        let file = LimitsFile::new(&file.0, parse);
        let (changes, log) = with_log(tracing::Level::INFO, || run(file.reload(&handle)));
        let changes = changes.unwrap();
        assert_eq!(changes.iter().count(), 1024);
        assert_eq!(handle.current().tiers().count(), 1024);
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 1, "{log}");
        assert!(
            lines[0].contains("INFO") && lines[0].contains("and 1016 more"),
            "{log}"
        );
        assert!(lines[0].len() < 1024, "{log}");
        // The same file again: nothing changed.
        let (changes, log) = with_log(tracing::Level::INFO, || run(file.reload(&handle)));
        assert!(changes.unwrap().is_empty());
        assert!(log.contains("limits reloaded: no change"), "{log}");
    }
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

    /// Counters, and histograms' samples, by name and labels.
    #[derive(Default)]
    #[allow(clippy::type_complexity)]
    struct Counters(
        Mutex<BTreeMap<String, Arc<AtomicU64>>>,
        Mutex<BTreeMap<String, Arc<Samples>>>,
    );

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
            let name = format!("{}{{{}}}", key.name(), labels(key));
            let counter = self.0.lock().unwrap().entry(name).or_default().clone();
            Counter::from_arc(counter)
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            let name = format!("{}{{{}}}", key.name(), labels(key));
            let samples = self.1.lock().unwrap().entry(name).or_default().clone();
            Histogram::from_arc(samples)
        }
    }

    fn labels(key: &Key) -> String {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.join(",")
    }

    /// A histogram's samples.
    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl metrics::HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    /// A `MemoryStore` answering through a future, as a networked store does.
    struct Remote(MemoryStore);

    impl ratelimit_core::Store for Remote {
        type Error = ratelimit_core::CapacityError;
        fn check(
            &self,
            key: &[u8],
            rules: &ratelimit_core::RuleSet,
            cost: u64,
        ) -> impl Future<Output = Result<ratelimit_core::Decision, Self::Error>> + Send {
            self.0.check(key, rules, cost)
        }
        fn block(
            &self,
            key: &[u8],
            d: Option<Duration>,
        ) -> impl Future<Output = Result<(), Self::Error>> + Send {
            self.0.block(key, d)
        }
        fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
            self.0.unblock(key)
        }
        fn reset(
            &self,
            key: &[u8],
            rules: &ratelimit_core::RuleSet,
        ) -> impl Future<Output = Result<(), Self::Error>> + Send {
            self.0.reset(key, rules)
        }
    }

    #[test]
    fn store_latency_by_layer_and_outcome() {
        let _turn = super::one_at_a_time();
        let counters = Counters::default();
        let (remote, down, local) = metrics::with_local_recorder(&counters, || {
            let build = |namespace: &str, rules: &str| {
                RateLimitLayer::builder(Remote(MemoryStore::new()), GlobalKey)
                    .rules(rules)
                    .unwrap()
                    .namespace(namespace)
                    .without_deny_cache()
                    .build()
                    .unwrap()
            };
            let remote = build("remote", "2/min");
            let down = RateLimitLayer::builder(Down::default(), GlobalKey)
                .rules("2/min")
                .unwrap()
                .namespace("down")
                .build()
                .unwrap();
            let local = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
                .rules("2/min")
                .unwrap()
                .namespace("local")
                .build()
                .unwrap();
            let route = || Router::new().route("/", get(|| async { "ok" }));
            (
                route().layer(remote),
                route().layer(down),
                route().layer(local),
            )
        });
        run(async {
            for app in [&remote, &down, &local] {
                for _ in 0..3 {
                    let req = Request::get("/").body(Body::empty()).unwrap();
                    app.clone().oneshot(req).await.unwrap();
                }
            }
        });
        let samples = |name: &str| {
            let all = counters.1.lock().unwrap();
            all.get(&format!("ratelimit_store_duration_seconds{{{name}}}"))
                .map_or(0, |s| s.0.lock().unwrap().len())
        };
        assert_eq!(samples("layer=remote,outcome=admitted"), 2);
        assert_eq!(samples("layer=remote,outcome=limited"), 1);
        assert_eq!(samples("layer=down,outcome=error"), 3);
        // An in-process store is not timed.
        assert_eq!(samples("layer=local,outcome=admitted"), 0);
        let buckets = ratelimit_tower::STORE_DURATION_BUCKETS;
        assert!(buckets.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((buckets[0], buckets[buckets.len() - 1]), (0.000_05, 1.0));
    }

    #[test]
    fn tier_labels_are_capped_so_thousands_of_tiers_stay_few_series() {
        use ratelimit_tower::Limits;

        let _turn = super::one_at_a_time();
        let many = |prefix: &str| {
            (0..5000).fold(Limits::new("5/min name=base".parse().unwrap()), |l, i| {
                l.tier(
                    format!("{prefix}{i}"),
                    format!("{}/min name={prefix}r{i}", i + 1).parse().unwrap(),
                )
            })
        };
        let counters = Counters::default();
        let layer = metrics::with_local_recorder(&counters, || {
            let layer = RateLimitLayer::builder(MemoryStore::new(), GlobalKey)
                .limits(many("t"))
                .select_tier(|req: &Request<Body>| {
                    req.headers()
                        .get("x-plan")
                        .map(|v| v.to_str().unwrap().to_owned())
                })
                .namespace("tiers")
                .metrics_tier_labels(10)
                .build()
                .unwrap();
            // New names in new limits do not add series either.
            layer.limits().replace(many("u")).unwrap();
            layer
        });
        let series = || counters.0.lock().unwrap().len();
        // 10 tiers ("" and t0..t8) with one rule each, and "other": admitted, limited,
        // blocked and store errors.
        assert_eq!(series(), 11 * 4, "{:#?}", counters.0.lock().unwrap().keys());
        assert!(counters
            .0
            .lock()
            .unwrap()
            .contains_key("ratelimit_admitted_total{layer=tiers,tier=other,rule=other}"));
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        run(async {
            for plan in ["u4999", "u4999", "u4998", "t3"] {
                let req = Request::get("/")
                    .header("x-plan", plan)
                    .body(Body::empty())
                    .unwrap();
                app.clone().oneshot(req).await.unwrap();
            }
        });
        // u4999 and u4998 count as "other", once per request; t3 (labelled before the
        // replacement, gone since) takes the default tier.
        assert_eq!(
            counters.get("ratelimit_admitted_total{layer=tiers,tier=other,rule=other}"),
            3
        );
        assert_eq!(
            counters.get("ratelimit_admitted_total{layer=tiers,tier=,rule=base}"),
            1
        );
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
