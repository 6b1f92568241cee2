//! Lease mode: several store instances on one redis-server and one manual clock, against
//! the promise that over any interval the fleet admits no more than the exact limiter
//! admits over that interval extended by the lease length.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use proptest::prelude::*;
use ratelimit_core::testing::T0_US;
use ratelimit_core::{Algorithm, Clock, Decision, ManualClock, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::RedisStore;

const LEASE: Duration = Duration::from_millis(20);

fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// A prefix no other case uses.
fn prefix() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("lease{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A server with the native module that cannot run Lua: lease mode there runs every
/// reservation, refund and block through the module.
fn module_server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start_with_module_only)
}

/// Both servers: Lua functions, and the module only.
fn servers() -> [&'static RedisServer; 2] {
    [server(), module_server()]
}

async fn store(prefix: &str, clock: &ManualClock, lease: Option<Duration>) -> RedisStore {
    store_on(&server().url(), prefix, clock, lease).await
}

async fn store_on(
    url: &str,
    prefix: &str,
    clock: &ManualClock,
    lease: Option<Duration>,
) -> RedisStore {
    let builder = RedisStore::builder()
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .clock(clock.clone());
    let builder = match lease {
        Some(length) => builder.lease(length),
        None => builder,
    };
    let store = builder.build(url).await.expect("store");
    wait_connected(&store).await;
    store
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The most units the exact limiter admits for one rule over an interval of `span_us`.
fn exact_bound(rules: &RuleSet, span_us: u64) -> u64 {
    rules
        .rules()
        .iter()
        .map(|rule| {
            let (limit, period) = (rule.limit(), rule.period_us());
            match rule.algorithm() {
                // An interval of length d touches at most floor(d / period) + 2 windows.
                Algorithm::FixedWindow => limit * (span_us / period + 2),
                _ => rule.capacity() + span_us * limit / period,
            }
        })
        .min()
        .expect("a rule")
}

/// Checks the promise on every pair of admitted times.
fn holds(rules: &RuleSet, admitted: &[(u64, u64)]) -> Result<(), TestCaseError> {
    let lease = LEASE.as_micros() as u64;
    for (i, &(a, _)) in admitted.iter().enumerate() {
        let mut units = 0;
        for &(b, cost) in &admitted[i..] {
            units += cost;
            let bound = exact_bound(rules, b - a + lease);
            prop_assert!(
                units <= bound,
                "{units} units admitted in [{a}, {b}], more than {bound} for {rules}"
            );
        }
    }
    Ok(())
}

/// Runs `trace` (clock step in µs, instance, cost) through `instances` stores in lease
/// mode; returns the admitted (time, cost), in time order.
fn run_fleet(rules: &RuleSet, instances: usize, trace: &[(u64, usize, u64)]) -> Vec<(u64, u64)> {
    run_fleet_on(server(), rules, instances, trace)
}

/// [`run_fleet`] on `server`.
fn run_fleet_on(
    server: &RedisServer,
    rules: &RuleSet,
    instances: usize,
    trace: &[(u64, usize, u64)],
) -> Vec<(u64, u64)> {
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let prefix = prefix();
        let mut stores = Vec::new();
        for _ in 0..instances {
            stores.push(store_on(&server.url(), &prefix, &clock, Some(LEASE)).await);
        }
        let mut admitted = Vec::new();
        for &(step, instance, cost) in trace {
            clock.advance(Duration::from_micros(step));
            let decision = stores[instance % instances]
                .check(b"hot", rules, cost)
                .await
                .expect("check");
            if decision.is_allowed() {
                admitted.push((clock.now_us(), cost));
            }
            if step % 7 == 0 {
                // The sweep's work, at points of the trace's choosing.
                stores[instance % instances].sweep_leases().await;
            }
        }
        admitted
    })
}

fn trace() -> impl Strategy<Value = Vec<(u64, usize, u64)>> {
    // Mostly a busy key, now and then idle long enough to refill.
    let step = prop_oneof![9 => 0u64..3_000, 1 => 0u64..1_500_000];
    prop::collection::vec((step, 0usize..3, 1u64..=3), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn gcra_fleet_keeps_the_promise(trace in trace()) {
        let rules: RuleSet = "100/s gcra burst=80".parse().unwrap();
        holds(&rules, &run_fleet(&rules, 3, &trace))?;
    }

    #[test]
    fn token_bucket_fleet_keeps_the_promise(trace in trace()) {
        let rules: RuleSet = "100/s token-bucket capacity=80".parse().unwrap();
        holds(&rules, &run_fleet(&rules, 3, &trace))?;
    }

    #[test]
    fn fixed_window_fleet_keeps_the_promise(trace in trace()) {
        let rules: RuleSet = "80/50ms fixed-window".parse().unwrap();
        holds(&rules, &run_fleet(&rules, 3, &trace))?;
    }

    #[test]
    fn multi_rule_fleet_keeps_the_promise(trace in trace()) {
        let rules: RuleSet = "100/s gcra burst=80; 160/50ms fixed-window; 50/s leaky-bucket capacity=64"
            .parse()
            .unwrap();
        holds(&rules, &run_fleet(&rules, 3, &trace))?;
    }

    /// The same fleet on the module: its reservations, refunds and blocks never touch Lua.
    #[test]
    fn module_fleet_keeps_the_promise(trace in trace()) {
        let rules: RuleSet = "100/s gcra burst=80; 160/50ms fixed-window; 100/s token-bucket capacity=80"
            .parse()
            .unwrap();
        holds(&rules, &run_fleet_on(module_server(), &rules, 3, &trace))?;
    }

    /// A key seen once is decided exactly: one instance in lease mode answers as the
    /// exact store does for keys checked once each.
    #[test]
    fn keys_seen_once_are_exact(costs in prop::collection::vec((0u64..3_000, 0u64..=3), 1..40)) {
        let rules: RuleSet = "1000/s gcra burst=40; 1000/s token-bucket capacity=40".parse().unwrap();
        let (leased, exact) = runtime().block_on(async {
            let clock = ManualClock::new(T0_US);
            let lease = store(&prefix(), &clock, Some(LEASE)).await;
            let exact = store(&prefix(), &clock, None).await;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (i, &(step, cost)) in costs.iter().enumerate() {
                clock.advance(Duration::from_micros(step));
                let key = format!("key{i}");
                a.push(lease.check(key.as_bytes(), &rules, cost).await.expect("check"));
                b.push(exact.check(key.as_bytes(), &rules, cost).await.expect("check"));
            }
            (a, b)
        });
        prop_assert_eq!(leased, exact);
    }
}

fn function_calls(con: &mut ratelimit_redis::redis::Connection) -> u64 {
    common::commandstats(con)
        .iter()
        .filter(|(name, _)| name.contains("fcall") || name.contains("eval"))
        .map(|(_, &(calls, _))| calls)
        .sum()
}

/// A hot key is spent locally, and a refused one refused locally: far fewer calls than
/// checks.
#[test]
fn a_hot_key_costs_few_calls() {
    // A server of its own: the test counts its calls.
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "20000/s gcra burst=4000".parse().unwrap();
    let (calls, admitted) = runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let lease = Some(Duration::from_millis(100));
        let store = store_on(&server.url(), "hot", &clock, lease).await;
        let before = function_calls(&mut con);
        let mut admitted = 0;
        // 4,000 checks at 10,000/s, all within the limit: blocks of 4000 / 8 = 500.
        for _ in 0..4_000 {
            clock.advance(Duration::from_micros(100));
            if store
                .check(b"hot", &rules, 1)
                .await
                .expect("check")
                .is_allowed()
            {
                admitted += 1;
            }
        }
        (function_calls(&mut con) - before, admitted)
    });
    assert!(calls * 20 <= 4_000, "{calls} calls for 4,000 checks");
    assert_eq!(admitted, 4_000);
}

fn remaining(decision: &Decision) -> u64 {
    decision.rules()[0].remaining
}

/// Units a lease did not spend go back when it ends (on Lua, and on the module).
#[test]
fn unspent_units_are_given_back() {
    let rules: RuleSet = "10/s token-bucket capacity=40".parse().unwrap();
    for server in servers() {
        unspent_units_are_given_back_on(server, &rules);
    }
}

fn unspent_units_are_given_back_on(server: &RedisServer, rules: &RuleSet) {
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let prefix = prefix();
        let leased = store_on(&server.url(), &prefix, &clock, Some(LEASE)).await;
        let exact = store_on(&server.url(), &prefix, &clock, None).await;
        // Seen 3 times: exact. The 4th: a block of 4 is reserved, 1 spent.
        for _ in 0..4 {
            assert!(leased.check(b"k", rules, 1).await.unwrap().is_allowed());
        }
        assert_eq!(remaining(&exact.check(b"k", rules, 0).await.unwrap()), 33);
        clock.advance(LEASE);
        leased.sweep_leases().await;
        assert_eq!(remaining(&exact.check(b"k", rules, 0).await.unwrap()), 36);
    });
}

/// The same on a Cluster whose nodes have the module and cannot run Lua: the
/// reservations, the refund and the exact store's peeks all run in the module.
#[test]
fn unspent_units_are_given_back_on_a_module_cluster() {
    let cluster = RedisCluster::start_with_module_only();
    let rules: RuleSet = "10/s token-bucket capacity=40".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let make = |lease: Option<Duration>| {
            let builder = RedisStore::builder()
                .prefix("leasecluster")
                .timeout(Duration::from_secs(5))
                .clock(clock.clone());
            let builder = match lease {
                Some(length) => builder.lease(length),
                None => builder,
            };
            let urls = cluster.urls();
            async move {
                let store = builder.build_cluster(&urls).await.expect("cluster store");
                wait_connected(&store).await;
                assert!(store.uses_module());
                store
            }
        };
        let leased = make(Some(LEASE)).await;
        let exact = make(None).await;
        for key in [&b"a"[..], b"b", b"c"] {
            for _ in 0..4 {
                assert!(leased.check(key, &rules, 1).await.unwrap().is_allowed());
            }
            assert_eq!(remaining(&exact.check(key, &rules, 0).await.unwrap()), 33);
        }
        clock.advance(LEASE);
        leased.sweep_leases().await;
        for key in [&b"a"[..], b"b", b"c"] {
            assert_eq!(remaining(&exact.check(key, &rules, 0).await.unwrap()), 36);
        }
    });
}

/// When Redis refuses, the refusal is repeated locally until it may change, with the
/// time left as `retry_after`.
#[test]
fn refusals_are_answered_locally() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "10/s gcra burst=16".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let store = store_on(&server.url(), "refused", &clock, Some(LEASE)).await;
        let mut refused = None;
        for _ in 0..40 {
            let d = store.check(b"k", &rules, 1).await.unwrap();
            if !d.is_allowed() {
                refused = Some(d);
                break;
            }
        }
        let first = refused.expect("a refusal");
        let retry = first.retry_after().expect("retry_after");
        let before = function_calls(&mut con);
        clock.advance(retry / 2);
        let d = store.check(b"k", &rules, 1).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(retry - retry / 2));
        assert_eq!(function_calls(&mut con), before);
        clock.advance(retry - retry / 2);
        assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    });
}

/// An instance dropped while it holds a lease strands at most its block: the others are
/// admitted again within the lease length plus the rule's own refill of that block.
#[test]
fn a_dropped_instance_strands_at_most_its_block() {
    let rules: RuleSet = "100/s gcra burst=40".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let prefix = prefix();
        let gone = store(&prefix, &clock, Some(LEASE)).await;
        let other = store(&prefix, &clock, Some(LEASE)).await;
        // `gone` holds a lease (a block of at most 40 / 8 = 5), then the others take the rest.
        for _ in 0..5 {
            assert!(gone.check(b"k", &rules, 1).await.unwrap().is_allowed());
        }
        drop(gone);
        while other.check(b"k", &rules, 1).await.unwrap().is_allowed() {}
        // 5 units at 100/s refill in 50 ms.
        clock.advance(LEASE + Duration::from_millis(50));
        assert!(other.check(b"k", &rules, 1).await.unwrap().is_allowed());
    });
}

/// A block placed through any instance reaches a leasing instance at its next
/// reservation, at most one lease length later.
#[test]
fn a_block_is_noticed_within_a_lease() {
    for server in servers() {
        a_block_is_noticed_within_a_lease_on(server);
    }
}

fn a_block_is_noticed_within_a_lease_on(server: &RedisServer) {
    let rules: RuleSet = "1000/s gcra burst=400".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let prefix = prefix();
        let leasing = store_on(&server.url(), &prefix, &clock, Some(LEASE)).await;
        let admin = store_on(&server.url(), &prefix, &clock, None).await;
        for _ in 0..10 {
            assert!(leasing.check(b"k", &rules, 1).await.unwrap().is_allowed());
        }
        admin
            .block(b"k", Some(Duration::from_secs(60)))
            .await
            .unwrap();
        clock.advance(LEASE);
        let d = leasing.check(b"k", &rules, 1).await.unwrap();
        assert_eq!(d.outcome(), ratelimit_core::Outcome::Blocked);
    });
}

/// With Redis gone, an instance spends what it holds, then fails as in exact mode.
#[test]
fn redis_down_spends_what_is_leased_then_fails() {
    let mut server = RedisServer::start();
    let rules: RuleSet = "1000/s gcra burst=400".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let store = store_on(&server.url(), "down", &clock, Some(LEASE)).await;
        // Warm: 3 exact checks, then a block of 4 (1 spent at once).
        for _ in 0..4 {
            assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
        }
        server.stop();
        for _ in 0..3 {
            let d = store.check(b"k", &rules, 1).await.expect("spent locally");
            assert!(d.is_allowed());
        }
        assert!(store.check(b"k", &rules, 1).await.is_err());
    });
}

/// A block without end is answered locally for a lease length at a time, as a refusal
/// with an end is until then: no call per check, no retry time made up, and an unblock
/// noticed within a lease.
#[test]
fn an_endless_block_is_answered_locally() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "1000/s gcra burst=400".parse().unwrap();
    runtime().block_on(async {
        let clock = ManualClock::new(T0_US);
        let store = store_on(&server.url(), "endless", &clock, Some(LEASE)).await;
        for _ in 0..10 {
            assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
        }
        store.block(b"k", None).await.unwrap();
        clock.advance(LEASE);
        let blocked = |d: &Decision| {
            assert_eq!(d.outcome(), ratelimit_core::Outcome::Blocked);
            assert_eq!(d.retry_after(), None, "an endless block has no retry time");
        };
        // The first checks after the lease went to Redis (its rate fell while idle).
        for _ in 0..5 {
            blocked(&store.check(b"k", &rules, 1).await.unwrap());
            clock.advance(LEASE / 20);
        }
        let before = function_calls(&mut con);
        for _ in 0..10 {
            clock.advance(LEASE / 20);
            blocked(&store.check(b"k", &rules, 1).await.unwrap());
        }
        assert_eq!(function_calls(&mut con), before);
        store.unblock(b"k").await.unwrap();
        clock.advance(LEASE);
        assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    });
}
