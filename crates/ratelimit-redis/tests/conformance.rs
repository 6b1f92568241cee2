//! The core conformance suite and random traces: RedisStore on one server and on a Cluster must
//! make exactly the decisions MemoryStore makes, on Redis and on Valkey, through the Lua
//! functions and through the native module.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use ratelimit_core::testing::{self, run_trace, strategy, Step, T0_US};
use ratelimit_core::{Clock, Decision, ManualClock, MemoryStore, Rule, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer, ServerKind};
use ratelimit_redis::{RedisStore, RedisStoreError};
use tokio::runtime::Runtime;

static PREFIXES: AtomicU64 = AtomicU64::new(0);

fn fresh_prefix(tag: &str) -> String {
    format!("{tag}{}", PREFIXES.fetch_add(1, Ordering::Relaxed))
}

/// Generous: a loaded CI machine must not turn a slow reply into a failed case.
const TIMEOUT: Duration = Duration::from_secs(5);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn single(
    url: String,
    tag: &'static str,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    move |clock| {
        let url = url.clone();
        Box::pin(async move {
            let store = RedisStore::builder()
                .prefix(&fresh_prefix(tag))
                .clock(clock)
                .timeout(TIMEOUT)
                .build(&url)
                .await
                .expect("store");
            wait_connected(&store).await;
            store
        })
    }
}

/// The stores `make` builds, each required to be on the module (`uses_module`) or on
/// the Lua functions.
fn expecting(
    mut make: impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>>,
    uses_module: bool,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    move |clock| {
        let pending = make(clock);
        Box::pin(async move {
            let store = pending.await;
            assert_eq!(
                store.uses_module(),
                uses_module,
                "the store should use the {}",
                if uses_module {
                    "module"
                } else {
                    "Lua functions"
                }
            );
            store
        })
    }
}

/// As [`single`], for a server with the native module: the store must be using it.
fn on_module(
    url: String,
    tag: &'static str,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    expecting(single(url, tag), true)
}

/// As [`clustered`], for a cluster whose nodes have the module: the store must be
/// using it.
fn clustered_on_module(
    urls: Vec<String>,
    tag: &'static str,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    expecting(clustered(urls, tag), true)
}

/// Two stores on the same server and keys taking turns, check by check: one forced onto
/// the Lua functions, one on the native module (a rollout of the module).
struct Alternating {
    stores: [RedisStore; 2],
    turn: AtomicU64,
}

impl Alternating {
    fn next(&self) -> &RedisStore {
        &self.stores[(self.turn.fetch_add(1, Ordering::Relaxed) % 2) as usize]
    }
}

impl Store for Alternating {
    type Error = RedisStoreError;

    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send {
        self.next().check(key, rules, cost)
    }

    fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.next().block(key, duration)
    }

    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.next().unblock(key)
    }

    fn reset(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.next().reset(key, rules)
    }

    fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        self.next().refund(key, rules, cost, charged_at)
    }

    fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        self.next().settle(key, rules, charged, actual, charged_at)
    }

    fn release(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        self.next().release(key, rules, slot)
    }

    // No `release_detached` or `settle_detached`: an edit queued in one store's batcher
    // is ordered before that store's next check only, not the other store's, so the
    // alternating pair awaits them (the defaults).

    fn renew(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        self.next().renew(key, rules, slot)
    }

    fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<Option<u64>, Self::Error>> + Send {
        self.next().take_slot(key, rules)
    }

    fn now_us(&self) -> u64 {
        self.stores[0].now_us()
    }
}

/// A Lua store and a module store on `url` sharing their keys, taking turns.
fn lua_and_module(
    url: String,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = Alternating>>> {
    move |clock| {
        let url = url.clone();
        Box::pin(async move {
            let prefix = fresh_prefix("shared");
            let mut stores = Vec::new();
            for force_lua in [true, false] {
                let store = RedisStore::builder()
                    .prefix(&prefix)
                    .clock(clock.clone())
                    .timeout(TIMEOUT)
                    .force_lua(force_lua)
                    .build(&url)
                    .await
                    .expect("store");
                wait_connected(&store).await;
                assert_eq!(store.uses_module(), !force_lua);
                stores.push(store);
            }
            let [lua, module] = <[RedisStore; 2]>::try_from(stores).expect("two stores");
            Alternating {
                stores: [lua, module],
                turn: AtomicU64::new(0),
            }
        })
    }
}

fn clustered(
    urls: Vec<String>,
    tag: &'static str,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    clustered_with(urls, tag, false)
}

/// As [`clustered`], the store forced onto the Lua functions when `force_lua` (on a
/// cluster whose nodes have the module: the Lua path beside the module's).
fn clustered_with(
    urls: Vec<String>,
    tag: &'static str,
    force_lua: bool,
) -> impl FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>> {
    move |clock| {
        let urls = urls.clone();
        Box::pin(async move {
            let store = RedisStore::builder()
                .prefix(&fresh_prefix(tag))
                .clock(clock)
                .timeout(TIMEOUT)
                .force_lua(force_lua)
                .build_cluster(&urls)
                .await
                .expect("cluster store");
            wait_connected(&store).await;
            store
        })
    }
}

/// Replays random traces against MemoryStore and against a store made by `make` (a
/// fresh one per trace), requiring identical results step by step; proptest shrinks a
/// failing trace to a minimal one.
fn traces_agree<St, F>(
    rt: &Runtime,
    cases: u32,
    traces: impl Strategy<Value = (Vec<RuleSet>, Vec<Step>)>,
    make: F,
) where
    St: Store,
    F: FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = St>>>,
{
    let segments = traces.prop_map(|(sets, steps)| (sets, vec![(steps, 0)]));
    segmented_traces_agree(rt, cases, segments, make);
}

/// How many times the cases each trace test names run: `RATELIMIT_TRACE_SCALE`, 10 by
/// default (what CI runs), more for a soak (`scripts/soak-traces`). Every run draws a
/// fresh seed; a failure is shrunk and kept in `proptest-regressions/conformance.txt`,
/// replayed first from then on.
fn trace_scale() -> u32 {
    std::env::var("RATELIMIT_TRACE_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
}

/// Traces run in this test binary, all told (printed by each trace test).
static CASES_RUN: AtomicU64 = AtomicU64::new(0);

/// As [`traces_agree`], for traces in segments: after each segment both clocks are set
/// back by its number of µs (an injected clock can go back; never before `T0_US`).
///
/// One store serves every case (a store per case would cost more than the case): each
/// case has keys of its own and starts its clock at `T0_US` again.
fn segmented_traces_agree<St, F>(
    rt: &Runtime,
    cases: u32,
    traces: impl Strategy<Value = (Vec<RuleSet>, Vec<(Vec<Step>, u64)>)>,
    mut make: F,
) where
    St: Store,
    F: FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = St>>>,
{
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(cases.saturating_mul(trace_scale()));
    // Shrunk failures are kept, and replayed first on later runs.
    let mut runner = TestRunner::new(testing::proptest_config(
        cases,
        "proptest-regressions/conformance.txt",
    ));
    let clock = ManualClock::new(T0_US);
    let store = rt.block_on(make(clock.clone()));
    let case = std::cell::Cell::new(0u64);
    let result = runner.run(&traces, |(sets, segments)| {
        case.set(case.get() + 1);
        let prefix = format!("c{}:", case.get()).into_bytes();
        let (want, got) = rt.block_on(async {
            let mem_clock = ManualClock::new(T0_US);
            let memory = MemoryStore::builder().clock(mem_clock.clone()).build();
            clock.set(T0_US);
            let (mut want, mut got) = (Vec::new(), Vec::new());
            for (steps, back) in &segments {
                want.extend(run_trace(&memory, &mem_clock, &prefix, &sets, steps).await);
                got.extend(run_trace(&store, &clock, &prefix, &sets, steps).await);
                for c in [&mem_clock, &clock] {
                    c.set(c.now_us().saturating_sub(*back).max(T0_US));
                }
            }
            (want, got)
        });
        prop_assert_eq!(
            want,
            got,
            "rule sets: {:?}",
            sets.iter().map(ToString::to_string).collect::<Vec<_>>()
        );
        Ok(())
    });
    let all = CASES_RUN.fetch_add(case.get(), Ordering::Relaxed) + case.get();
    eprintln!(
        "{} random traces agreed with MemoryStore ({all} in this binary so far)",
        case.get()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Up to three rule sets of one to four rules of any algorithm, with a random trace.
fn traces() -> impl Strategy<Value = (Vec<RuleSet>, Vec<Step>)> {
    proptest::collection::vec(strategy::rule_set(), 1..=3).prop_flat_map(|sets| {
        let n = sets.len();
        (Just(sets), strategy::steps(n, 60))
    })
}

/// Three versions of one rule set (limits raised and lowered, rules added, dropped,
/// moved to another algorithm or period, reordered; see
/// [`strategy::rule_set_versions`]) under a random trace: the rules change under the
/// keys' state at every step that picks another version, as a fleet rolling from one
/// version to the next does.
fn version_traces() -> impl Strategy<Value = (Vec<RuleSet>, Vec<Step>)> {
    (strategy::rule_set_versions(3), strategy::steps(3, 80))
}

/// Traces whose clock moves (forward and back) in whole milliseconds and whole periods,
/// so that requests land exactly on window edges, log entries' expiry instants and
/// bucket refill points, where a `<` for a `<=` would show.
fn aligned_traces() -> impl Strategy<Value = (Vec<RuleSet>, Vec<Step>)> {
    proptest::collection::vec(strategy::rule_set(), 1..=2).prop_flat_map(|sets| {
        let n = sets.len();
        let step = prop_oneof![
            6 => (0u8..2, 0..n, prop_oneof![4 => Just(1u64), 1 => Just(0), 1 => 2u64..=3])
                .prop_map(|(key, rules, cost)| Step::Check { key, rules, cost }),
            4 => prop_oneof![
                (0u64..=8).prop_map(|ms| ms * 1_000),
                Just(7_000),
                Just(100_000),
                Just(1_000_000),
            ]
            .prop_map(Step::Advance),
            1 => prop_oneof![(1u64..=8).prop_map(|ms| ms * 1_000), Just(1_000_000)]
                .prop_map(Step::Rewind),
            1 => (0u8..2, proptest::option::of(1u64..20)).prop_map(|(key, ms)| Step::Block { key, ms }),
            1 => strategy::settle(n),
        ];
        (Just(sets), proptest::collection::vec(step, 1..80))
    })
}

/// Sliding window counters with hundreds of sub-windows next to other rules: the
/// script's O(precision) retry search against the core's direct one.
fn fine_sliding_windows() -> impl Strategy<Value = (Vec<RuleSet>, Vec<Step>)> {
    let fine = (
        1u64..=40,
        prop_oneof![Just(1u64), Just(60)],
        prop_oneof![Just(100u64), Just(250), Just(1_000)],
    )
        .prop_map(|(limit, secs, precision)| {
            Rule::sliding_window(limit, Duration::from_secs(secs), precision).expect("valid")
        });
    (fine, proptest::option::of(strategy::rule()))
        .prop_map(|(fine, other)| {
            vec![RuleSet::new(std::iter::once(fine).chain(other)).expect("valid")]
        })
        .prop_flat_map(|sets| (Just(sets), strategy::steps(1, 80)))
}

/// Single rules of the algorithms the script decides without its general loop (GCRA,
/// leaky bucket meter, sliding window counter of precision 1), with a shaper (general
/// loop) beside them, on traces whose clock also steps back.
fn one_rule_traces() -> impl Strategy<Value = (Vec<RuleSet>, Vec<(Vec<Step>, u64)>)> {
    let period = prop_oneof![Just(1_000u64), Just(7_000), Just(1_000_000)];
    let rule = (1u64..=12, period, 0u8..4, 1u64..=6).prop_map(|(limit, period_us, algo, p)| {
        let period = Duration::from_micros(period_us);
        let rule = match algo {
            0 => Rule::gcra(limit, period, p),
            1 => Rule::leaky_meter(limit, period, p),
            2 => Rule::sliding_window(limit, period, 1),
            _ => Rule::leaky_shaper(limit, period, p, p - 1),
        };
        RuleSet::new(vec![rule.expect("valid")]).expect("valid")
    });
    proptest::collection::vec(rule, 1..=2).prop_flat_map(|sets| {
        let n = sets.len();
        let back = prop_oneof![Just(0u64), 1u64..2_000, 0u64..2_000_000];
        let segments = proptest::collection::vec((strategy::steps(n, 30), back), 1..4);
        (Just(sets), segments)
    })
}

// Each conformance case its own test, against its own redis-server.
ratelimit_core::conformance_tests! {
    mod redis_store {
        setup: {
            let server = RedisServer::start();
        },
        run: |test| runtime().block_on(test),
        store: single(server.url(), "conf"),
    }
}

// The same cases on a server with the native module and no way to run Lua: blocks and
// refunds included, nothing falls back to the Lua functions.
ratelimit_core::conformance_tests! {
    mod module_store {
        setup: {
            let server = RedisServer::start_with_module_only();
        },
        run: |test| runtime().block_on(test),
        store: on_module(server.url(), "modconf"),
    }
}

// The same cases on a Lua store and a module store taking turns on the same keys: a
// refund or a block by one is the other's.
ratelimit_core::conformance_tests! {
    mod lua_and_module_store {
        setup: {
            let server = RedisServer::start_with_module();
        },
        run: |test| runtime().block_on(test),
        store: lua_and_module(server.url()),
    }
}

#[test]
fn module_traces_agree_with_memory_store() {
    let server = RedisServer::start_with_module_only();
    let rt = runtime();
    traces_agree(&rt, 256, traces(), on_module(server.url(), "modtrace"));
    traces_agree(
        &rt,
        128,
        version_traces(),
        on_module(server.url(), "modversions"),
    );
    segmented_traces_agree(
        &rt,
        128,
        one_rule_traces(),
        on_module(server.url(), "modone"),
    );
    traces_agree(
        &rt,
        24,
        fine_sliding_windows(),
        on_module(server.url(), "modfine"),
    );
}

/// A rollout: a store on Lua and a store on the module take turns on the same keys, and
/// every decision is the exact limiter's (MemoryStore's) for the whole trace, rule
/// changes included.
#[test]
fn lua_and_module_stores_share_keys() {
    let server = RedisServer::start_with_module();
    let rt = runtime();
    traces_agree(&rt, 192, traces(), lua_and_module(server.url()));
    traces_agree(&rt, 96, version_traces(), lua_and_module(server.url()));
}

#[test]
fn module_cluster_store_passes_the_conformance_suite_and_random_traces() {
    let cluster = RedisCluster::start_with_module_only();
    let rt = runtime();
    rt.block_on(testing::conformance(clustered_on_module(
        cluster.urls(),
        "modconf",
    )));
    traces_agree(
        &rt,
        32,
        traces(),
        clustered_on_module(cluster.urls(), "modtrace"),
    );
    segmented_traces_agree(
        &rt,
        32,
        one_rule_traces(),
        clustered_on_module(cluster.urls(), "modone"),
    );
}

#[test]
fn random_traces_agree_with_memory_store() {
    let server = RedisServer::start();
    traces_agree(&runtime(), 256, traces(), single(server.url(), "trace"));
}

#[test]
fn rule_changes_mid_trace_agree_with_memory_store() {
    let server = RedisServer::start();
    traces_agree(
        &runtime(),
        256,
        version_traces(),
        single(server.url(), "versions"),
    );
}

/// Two app servers on two versions of the rules at once (a rolling deploy), each with
/// its own store, alternate on one client key: no error, and every decision is the one
/// MemoryStore makes for the same alternation, each under its own rules (a state one
/// store could not read would start fresh and show).
#[test]
fn two_rule_versions_at_once_share_one_key() {
    let server = RedisServer::start();
    let rt = runtime();
    let old: RuleSet = "5/h fixed-window; 10/min gcra burst=3; 4/min sliding-log; \
                        2/s sliding-window precision=2; 30/min token-bucket capacity=5"
        .parse()
        .unwrap();
    let new: RuleSet = "8/h fixed-window; 10/min gcra burst=5; 6/min sliding-log; \
                        2/s sliding-window precision=2; 1/s leaky-bucket mode=meter capacity=2"
        .parse()
        .unwrap();
    rt.block_on(async {
        let clock = ManualClock::new(T0_US);
        let (prefix, url) = (fresh_prefix("fleet"), server.url());
        let store = || {
            RedisStore::builder()
                .prefix(&prefix)
                .clock(clock.clone())
                .timeout(TIMEOUT)
                .build(&url)
        };
        let (a, b) = (store().await.unwrap(), store().await.unwrap());
        wait_connected(&a).await;
        wait_connected(&b).await;
        let mem_clock = ManualClock::new(T0_US);
        let memory = MemoryStore::builder().clock(mem_clock.clone()).build();
        let mut admitted = [0; 2];
        for i in 0..60u64 {
            let (store, rules, n) = if i % 2 == 0 {
                (&a, &old, 0)
            } else {
                (&b, &new, 1)
            };
            let cost = [1, 1, 2, 0, 1][i as usize % 5];
            let got = store.check(b"client", rules, cost).await.expect("no error");
            let want = memory.check(b"client", rules, cost).await.unwrap();
            assert_eq!(got, want, "step {i}, {rules}");
            admitted[n] += u64::from(got.is_allowed() && cost > 0);
            let step = [0, 700_000, 20_000_000][i as usize % 3];
            for c in [&clock, &mem_clock] {
                c.advance(Duration::from_micros(step));
            }
        }
        // Both versions admitted some, and the hourly window counted both: no more than
        // the larger limit in the hour, whoever decided.
        assert!(admitted.iter().all(|n| *n > 0), "{admitted:?}");
        let d = memory.check(b"client", &new, 0).await.unwrap();
        assert!(d.rules()[0].remaining < 8, "{d:?}");
    });
}

#[test]
fn traces_on_exact_edges_agree_with_memory_store() {
    let server = RedisServer::start();
    traces_agree(
        &runtime(),
        128,
        aligned_traces(),
        single(server.url(), "edge"),
    );
}

/// Hand-picked traces that stop exactly on an edge and peek there.
#[test]
fn peeks_on_exact_edges_agree_with_memory_store() {
    use Step::{Advance, Check};
    let server = RedisServer::start();
    let rt = runtime();
    let mut make = single(server.url(), "peek");
    let ms = |n: u64| Advance(n * 1_000);
    let check = |cost| Check {
        key: 0,
        rules: 0,
        cost,
    };
    let cases: [(&str, Vec<Step>); 5] = [
        // The log's second-newest entry leaves the window exactly at the peek.
        (
            "2/s sliding-log",
            vec![
                check(1),
                ms(500),
                check(1),
                ms(500),
                check(0),
                check(1),
                ms(500),
                check(0),
            ],
        ),
        (
            "3/s sliding-log; 1/h fixed-window",
            vec![
                check(1),
                ms(250),
                check(1),
                ms(250),
                check(1),
                ms(500),
                check(0),
                check(2),
            ],
        ),
        (
            "4/s sliding-window precision=2",
            vec![
                check(3),
                ms(500),
                check(1),
                ms(500),
                check(0),
                check(1),
                ms(250),
                check(0),
            ],
        ),
        (
            "2/s token-bucket capacity=3",
            vec![
                check(3),
                ms(500),
                check(0),
                check(2),
                ms(500),
                check(0),
                check(1),
            ],
        ),
        (
            "2/s leaky-bucket mode=shaper burst=2 delay=1; 4/s gcra burst=2",
            vec![
                check(1),
                check(1),
                check(0),
                ms(250),
                check(0),
                check(1),
                ms(500),
                check(0),
            ],
        ),
    ];
    for (text, steps) in cases {
        let sets = vec![text.parse::<RuleSet>().unwrap()];
        let (want, got) = rt.block_on(async {
            let mem_clock = ManualClock::new(T0_US);
            let memory = MemoryStore::builder().clock(mem_clock.clone()).build();
            let want = run_trace(&memory, &mem_clock, b"k", &sets, &steps).await;
            let clock = ManualClock::new(T0_US);
            let store = make(clock.clone()).await;
            (want, run_trace(&store, &clock, b"k", &sets, &steps).await)
        });
        assert_eq!(want, got, "{text}");
    }
}

/// Traces that long random runs found drifting, each kept as it was shrunk, replayed on
/// the Lua functions and on the module: (rule sets, steps).
fn found_traces() -> Vec<(Vec<&'static str>, Vec<Step>)> {
    use Step::{Check, Settle};
    vec![
        // A give-back under rules of another layout than the state's (the same rules,
        // reordered), after a third rule set's check wrote the log and bucket.
        (
            vec![
                "1/1s sliding-log; 1/1ms token-bucket capacity=1",
                "1/1ms token-bucket capacity=1; 1/1s sliding-log",
                "2/1s sliding-log; 1/1ms token-bucket capacity=2",
            ],
            vec![
                Check {
                    key: 0,
                    rules: 0,
                    cost: 1,
                },
                Check {
                    key: 0,
                    rules: 2,
                    cost: 1,
                },
                Check {
                    key: 0,
                    rules: 1,
                    cost: 1,
                },
                Settle {
                    key: 0,
                    rules: 1,
                    charged: 2,
                    actual: 0,
                    ago_us: 0,
                    detached: false,
                },
            ],
        ),
        // A state written by a meter, read by a set whose shaper has the meter's identity
        // beside rules without a state: a settle's give-back found a sliding window
        // counter with no entry in the carried state.
        (
            vec![
                "1/1ms leaky-bucket mode=meter capacity=5",
                "8/100ms fixed-window; 2/7ms sliding-window precision=2; \
                 8/1ms leaky-bucket mode=shaper burst=0 delay=0; 1 concurrent timeout=1s",
            ],
            vec![
                Check {
                    key: 0,
                    rules: 0,
                    cost: 1,
                },
                Check {
                    key: 0,
                    rules: 1,
                    cost: 1,
                },
                Settle {
                    key: 0,
                    rules: 1,
                    charged: 1,
                    actual: 0,
                    ago_us: 0,
                    detached: false,
                },
                // The same carried state, settled above the estimate (debit reads it
                // alike).
                Check {
                    key: 1,
                    rules: 0,
                    cost: 1,
                },
                Check {
                    key: 1,
                    rules: 1,
                    cost: 1,
                },
                Settle {
                    key: 1,
                    rules: 1,
                    charged: 1,
                    actual: 4,
                    ago_us: 0,
                    detached: false,
                },
                Check {
                    key: 1,
                    rules: 1,
                    cost: 1,
                },
            ],
        ),
    ]
}

#[test]
fn traces_found_by_long_runs_agree_with_memory_store() {
    let lua = RedisServer::start();
    let module = RedisServer::start_with_module();
    let rt = runtime();
    type Make = Box<dyn FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = RedisStore>>>>;
    let mut makes: [Make; 2] = [
        Box::new(expecting(single(lua.url(), "found"), false)),
        Box::new(on_module(module.url(), "modfound")),
    ];
    // Each trace as found, then with its settles handed to the store (detached).
    let detached = found_traces().into_iter().map(|(texts, steps)| {
        let steps = steps
            .into_iter()
            .map(|step| match step {
                Step::Settle {
                    key,
                    rules,
                    charged,
                    actual,
                    ago_us,
                    ..
                } => Step::Settle {
                    key,
                    rules,
                    charged,
                    actual,
                    ago_us,
                    detached: true,
                },
                other => other,
            })
            .collect();
        (texts, steps)
    });
    for (texts, steps) in found_traces().into_iter().chain(detached) {
        let sets: Vec<RuleSet> = texts.iter().map(|t| t.parse().unwrap()).collect();
        for (path, make) in ["Lua", "module"].into_iter().zip(&mut makes) {
            let (want, got) = rt.block_on(async {
                let mem_clock = ManualClock::new(T0_US);
                let memory = MemoryStore::builder().clock(mem_clock.clone()).build();
                let want = run_trace(&memory, &mem_clock, b"k", &sets, &steps).await;
                let clock = ManualClock::new(T0_US);
                let store = make(clock.clone()).await;
                (want, run_trace(&store, &clock, b"k", &sets, &steps).await)
            });
            assert_eq!(want, got, "{path}: {texts:?}");
        }
    }
}

#[test]
fn one_rule_checks_agree_with_memory_store() {
    let server = RedisServer::start();
    segmented_traces_agree(
        &runtime(),
        192,
        one_rule_traces(),
        single(server.url(), "one"),
    );
}

#[test]
fn fine_sliding_windows_agree_with_memory_store() {
    let server = RedisServer::start();
    traces_agree(
        &runtime(),
        48,
        fine_sliding_windows(),
        single(server.url(), "fine"),
    );
}

#[test]
fn cluster_store_passes_the_conformance_suite_and_random_traces() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    rt.block_on(testing::conformance(clustered(cluster.urls(), "conf")));
    // Fewer traces: the cluster adds routing, not arithmetic.
    traces_agree(&rt, 32, traces(), clustered(cluster.urls(), "trace"));
    segmented_traces_agree(&rt, 32, one_rule_traces(), clustered(cluster.urls(), "one"));
    traces_agree(
        &rt,
        32,
        version_traces(),
        clustered(cluster.urls(), "versions"),
    );
}

// Valkey: the conformance suite through the Lua functions and through the module, each
// case its own test against its own valkey-server.
ratelimit_core::conformance_tests! {
    mod valkey_store {
        setup: {
            let server = RedisServer::start_valkey();
        },
        run: |test| runtime().block_on(test),
        store: expecting(single(server.url(), "vconf"), false),
    }
}

ratelimit_core::conformance_tests! {
    mod valkey_module_store {
        setup: {
            let server = RedisServer::start_valkey_with_module();
        },
        run: |test| runtime().block_on(test),
        store: on_module(server.url(), "vmodconf"),
    }
}

/// Every trace strategy of this file, `cases` of each (fewer of the slow ones), against
/// stores `make(tag)` builds: a second server kind, whose arithmetic is the same
/// functions' or module's and whose traces need not be as many as Redis's.
fn all_traces<St, F>(rt: &Runtime, cases: u32, mut make: impl FnMut(&'static str) -> F)
where
    St: Store,
    F: FnMut(ManualClock) -> std::pin::Pin<Box<dyn Future<Output = St>>>,
{
    traces_agree(rt, cases, traces(), make("trace"));
    traces_agree(rt, cases, version_traces(), make("versions"));
    traces_agree(rt, cases / 2, aligned_traces(), make("edge"));
    segmented_traces_agree(rt, cases, one_rule_traces(), make("one"));
    traces_agree(rt, cases / 8, fine_sliding_windows(), make("fine"));
}

#[test]
fn valkey_traces_agree_with_memory_store() {
    let server = RedisServer::start_valkey();
    all_traces(&runtime(), 64, |tag| {
        expecting(single(server.url(), tag), false)
    });
}

#[test]
fn valkey_module_traces_agree_with_memory_store() {
    let server = RedisServer::start_valkey_with_module();
    all_traces(&runtime(), 64, |tag| on_module(server.url(), tag));
}

/// A rollout on Valkey: a Lua store and a module store take turns on the same keys.
#[test]
fn valkey_lua_and_module_stores_share_keys() {
    let server = RedisServer::start_valkey_with_module();
    let rt = runtime();
    traces_agree(&rt, 48, traces(), lua_and_module(server.url()));
    traces_agree(&rt, 24, version_traces(), lua_and_module(server.url()));
}

/// A Valkey Cluster whose nodes have the module: the suite and traces through the
/// module, and through the Lua functions on the same nodes.
#[test]
fn valkey_cluster_store_passes_the_conformance_suite_and_random_traces() {
    let cluster = RedisCluster::start_valkey_with_module();
    assert!(cluster
        .nodes()
        .iter()
        .all(|n| n.kind() == ServerKind::Valkey));
    let rt = runtime();
    for force_lua in [false, true] {
        let make = |tag| expecting(clustered_with(cluster.urls(), tag, force_lua), !force_lua);
        rt.block_on(testing::conformance(make("vconf")));
        traces_agree(&rt, 16, traces(), make("vtrace"));
        segmented_traces_agree(&rt, 16, one_rule_traces(), make("vone"));
    }
}

/// Calls of `command` a node has run, by its `INFO commandstats`.
fn calls(node: &RedisServer, command: &str) -> u64 {
    let stats = node
        .command("INFO commandstats")
        .expect("INFO commandstats");
    stats
        .lines()
        .find_map(|line| {
            let rest = line.strip_prefix(&format!("cmdstat_{command}:calls="))?;
            rest.split(',').next()?.parse().ok()
        })
        .unwrap_or(0)
}

/// Requires that the module took every batch of `nodes` in its compact form
/// (`RATELIMIT.CHECK_STATES`, on a Cluster node `RATELIMIT.CHECK_LOCAL_STATES`) and
/// none in the older one: the store found the compact form and used it.
fn compact_batches_only(nodes: &[&RedisServer]) {
    let count = |command: &str| nodes.iter().map(|&n| calls(n, command)).sum::<u64>();
    let compact = count("ratelimit.check_states") + count("ratelimit.check_local_states");
    let older = count("ratelimit.check_many") + count("ratelimit.check_local");
    assert!(compact > 0, "no batch in compact form");
    assert_eq!(
        older, 0,
        "batches in the older form beside {compact} compact ones"
    );
}

/// A Cluster in the middle of a rollout of the module: masters 0 and 2 have it, master 1
/// does not. One store decides exactly as MemoryStore does, each node on its own path:
/// the module where it is loaded (no Lua call there), the Lua functions elsewhere.
#[test]
fn mixed_cluster_store_decides_each_node_on_its_path() {
    let cluster = RedisCluster::start_with_module_on([true, false, true]);
    let rt = runtime();
    rt.block_on(testing::conformance(clustered(cluster.urls(), "mixconf")));
    traces_agree(&rt, 32, traces(), clustered(cluster.urls(), "mixtrace"));
    segmented_traces_agree(
        &rt,
        32,
        one_rule_traces(),
        clustered(cluster.urls(), "mixone"),
    );
    // Many checks at once: per-node batches (`check_local`) on every node.
    rt.block_on(async {
        let store = clustered(cluster.urls(), "mixbatch")(ManualClock::new(T0_US)).await;
        let rules: RuleSet = "2/s gcra burst=2".parse().unwrap();
        let keys: Vec<Vec<u8>> = (0..96).map(|k| format!("k{k}").into_bytes()).collect();
        // At one instant: a burst of 2 admitted per key, the third check refused.
        for admitted in [true, true, false] {
            let decided =
                futures::future::join_all(keys.iter().map(|key| store.check(key, &rules, 1))).await;
            assert!(decided
                .into_iter()
                .all(|d| d.expect("check").is_allowed() == admitted));
        }
    });
    let nodes = cluster.nodes();
    let mut on_module = [0; 2];
    for (i, node) in nodes.iter().enumerate() {
        let mut module =
            ["ratelimit.check", "ratelimit.check_local_states"].map(|c| calls(node, c));
        // A check alone goes as `RATELIMIT.CHECK_STATE` to a module of protocol 2, and so
        // do give-backs, debt, slot edits and blocks to one of protocol 5 (edits in
        // batches).
        module[0] += calls(node, "ratelimit.check_state");
        assert_eq!(
            [
                "ratelimit.give_back",
                "ratelimit.debit",
                "ratelimit.release",
                "ratelimit.block"
            ]
            .map(|c| calls(node, c)),
            [0; 4],
            "node {i}: edits of their own"
        );
        assert_eq!(
            calls(node, "ratelimit.check_local"),
            0,
            "node {i}: older batches"
        );
        let lua = calls(node, "fcall") + calls(node, "evalsha") + calls(node, "eval");
        if i == 1 {
            assert_eq!(module, [0; 2], "node {i} has no module");
            assert!(lua > 0, "node {i} decides with Lua");
        } else {
            assert!(module[0] > 0 && module[1] > 0, "node {i}: {module:?}");
            assert_eq!(lua, 0, "node {i} has the module: no Lua call");
            for (sum, n) in on_module.iter_mut().zip(module) {
                *sum += n;
            }
        }
    }
    // Checks, edits and blocks of keys on the module's nodes went to it.
    assert!(on_module.iter().all(|&n| n > 0), "{on_module:?}");
    compact_batches_only(&[&nodes[0], &nodes[2]]);
}
