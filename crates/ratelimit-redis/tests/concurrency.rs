//! Four app servers (four stores, each with its own pool) x 16 tasks hammering one key:
//! the exact algorithms admit exactly what the rules allow, never one more.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;

const SERVERS: usize = 4;
const TASKS: usize = 16;

async fn fleet(url: &str, prefix: &str, clock: Option<ManualClock>) -> Vec<RedisStore> {
    let mut stores = Vec::new();
    for _ in 0..SERVERS {
        let builder = RedisStore::builder()
            .prefix(prefix)
            .timeout(Duration::from_secs(5));
        let builder = match &clock {
            Some(clock) => builder.clock(clock.clone()),
            None => builder,
        };
        let store = builder.build(url).await.expect("store");
        wait_connected(&store).await;
        stores.push(store);
    }
    stores
}

/// Every task of every store sends `tries` checks of `cost(task, i)` units; returns the
/// units admitted in total.
async fn hammer(
    stores: &[RedisStore],
    rules: &RuleSet,
    tries: usize,
    cost: fn(usize, usize) -> u64,
) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (s, store) in stores.iter().enumerate() {
        for t in 0..TASKS {
            let (store, rules, admitted) = (store.clone(), rules.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..tries {
                    let units = cost(s * TASKS + t, i);
                    let d = store.check(b"hot-key", &rules, units).await.expect("check");
                    if d.is_allowed() {
                        admitted.fetch_add(units, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("task");
    }
    admitted.load(Ordering::Relaxed)
}

fn one(_: usize, _: usize) -> u64 {
    1
}

fn mixed(task: usize, i: usize) -> u64 {
    1 + ((task + i) % 3) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exact_algorithms_admit_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    // A clock that stands still: no refill, no window boundary, so the allowance is exact.
    let clock = ManualClock::new(T0_US + 1_000_000);
    let cases = [
        ("100/h fixed-window", 100),
        ("100/h sliding-window precision=6", 100),
        ("100/h sliding-log", 100),
        ("1/h token-bucket capacity=100", 100),
        ("1/h gcra burst=100", 100),
        ("1/h leaky-bucket mode=meter capacity=100", 100),
        ("1/h leaky-bucket mode=shaper burst=99 delay=99", 100),
        // Multi-rule: the smallest allowance wins, and denials consume nothing.
        (
            "150/h fixed-window; 100/h sliding-log; 1/h gcra burst=120",
            100,
        ),
    ];
    for (i, (text, limit)) in cases.into_iter().enumerate() {
        let rules: RuleSet = text.parse().unwrap();
        let stores = fleet(&server.url(), &format!("c{i}"), Some(clock.clone())).await;
        let admitted = hammer(&stores, &rules, 3, one).await;
        assert_eq!(admitted, limit, "{text}: {} attempts", SERVERS * TASKS * 3);
        let peek = stores[0].check(b"hot-key", &rules, 0).await.unwrap();
        for (rule, outcome) in rules.rules().iter().zip(peek.rules()) {
            assert_eq!(
                outcome.remaining,
                rule.capacity() - limit,
                "{text}: rule {rule} charged once per admitted request, never for a denied one"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_costs_never_exceed_the_limit_nor_lose_an_update() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0_US + 1_000_000);
    for (i, text) in [
        "200/h sliding-log",
        "200/h sliding-window precision=4",
        "1/h gcra burst=200",
    ]
    .into_iter()
    .enumerate()
    {
        let rules: RuleSet = text.parse().unwrap();
        let stores = fleet(&server.url(), &format!("m{i}"), Some(clock.clone())).await;
        let admitted = hammer(&stores, &rules, 3, mixed).await;
        assert!(admitted <= 200, "{text}: {admitted} units admitted");
        // Units of 1 to 3 from 192 attempts fill all but at most 2 units.
        assert!(admitted >= 198, "{text}: only {admitted} units admitted");
        let left = stores[1]
            .check(b"hot-key", &rules, 0)
            .await
            .unwrap()
            .rules()[0]
            .remaining;
        assert_eq!(
            left,
            200 - admitted,
            "{text}: every admitted unit recorded once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_time_fleet_admits_exactly_the_limit() {
    // With Redis TIME, rates of one per hour cannot refill during the test.
    let server = RedisServer::start();
    for (i, text) in [
        "100/day sliding-log",
        "1/h gcra burst=100",
        "1/h token-bucket capacity=100",
    ]
    .into_iter()
    .enumerate()
    {
        let rules: RuleSet = text.parse().unwrap();
        let stores = fleet(&server.url(), &format!("t{i}"), None).await;
        assert_eq!(hammer(&stores, &rules, 3, one).await, 100, "{text}");
    }
}
