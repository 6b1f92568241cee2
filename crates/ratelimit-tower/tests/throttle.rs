//! Outbound throttling as partners count: a partner that allows `limit` calls per period
//! never sees more in any window of that period, whatever the rule's algorithm, unless
//! the rule asks for a burst.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ratelimit_core::{Clock, MemoryStore, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_tower::ThrottleLayer;
use tower::{Layer, ServiceExt};

/// Half a second before a whole second: windows aligned to the epoch turn over during
/// the first second of calls.
const T0: u64 = 1_699_999_200_000_000 - 500_000;

/// The store's clock on tokio's (paused) time: the throttle's sleeps move it.
#[derive(Clone)]
struct TokioClock(tokio::time::Instant);

impl Clock for TokioClock {
    fn now_us(&self) -> u64 {
        T0 + self.0.elapsed().as_micros() as u64
    }
}

/// Sends `calls` calls at once through a throttle of `rules` on `store` to a partner that
/// notes when each arrives; the arrival times, from when the calls were made.
async fn arrivals<S: Store>(store: S, key: &str, rules: &str, calls: usize) -> Vec<Duration> {
    let start = tokio::time::Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let noted = Arc::clone(&seen);
    let partner = tower::service_fn(move |_: ()| {
        noted.lock().unwrap().push(start.elapsed());
        std::future::ready(Ok::<_, Infallible>(()))
    });
    let rules: RuleSet = rules.parse().unwrap();
    let client = ThrottleLayer::new(store, key, rules, Duration::from_secs(30)).layer(partner);
    let sent: Vec<_> = (0..calls)
        .map(|_| tokio::spawn(client.clone().oneshot(())))
        .collect();
    for call in sent {
        call.await.unwrap().expect("every call waits for its turn");
    }
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    seen
}

/// The most calls in any window of `period` (a window starting at each arrival).
fn busiest(arrivals: &[Duration], period: Duration) -> usize {
    arrivals
        .iter()
        .map(|&from| {
            arrivals
                .iter()
                .filter(|&&t| t >= from && t < from + period)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// Calls per whole second since the calls were made, as a partner counting per second sees
/// them.
fn per_second(arrivals: &[Duration]) -> Vec<usize> {
    let last = arrivals.last().map_or(0, Duration::as_secs) as usize;
    let mut counts = vec![0; last + 1];
    for t in arrivals {
        counts[t.as_secs() as usize] += 1;
    }
    counts
}

#[tokio::test(start_paused = true)]
async fn a_throttle_never_sends_more_than_the_limit_in_any_window_in_memory() {
    for rules in [
        "10/s",
        "10/s gcra burst=10",
        "10/s fixed-window",
        "10/s sliding-window",
        "10/s sliding-window precision=10",
        "10/s sliding-log",
        "10/s token-bucket",
        "10/s leaky-bucket",
        "10/s leaky-bucket mode=shaper burst=30",
        "10/s; 100/min",
    ] {
        let clock = TokioClock(tokio::time::Instant::now());
        let store = MemoryStore::builder().clock(clock).build();
        let seen = arrivals(store, rules, rules, 30).await;
        assert_eq!(seen.len(), 30, "{rules}");
        assert!(
            busiest(&seen, Duration::from_secs(1)) <= 10,
            "{rules}: {:?} per second, {seen:?}",
            per_second(&seen)
        );
        // Throttled, not starved: 30 calls at 10/s are all out within 3 s and a margin
        // for the waiters' jitter.
        assert!(
            *seen.last().unwrap() < Duration::from_millis(3_400),
            "{rules}: {seen:?}"
        );
    }
}

/// A burst the rule asks for is the rule's: `burst=15` sends 15 at once.
#[tokio::test(start_paused = true)]
async fn a_burst_asked_for_is_sent() {
    let clock = TokioClock(tokio::time::Instant::now());
    let store = MemoryStore::builder().clock(clock).build();
    let seen = arrivals(store, "partner", "10/s burst=15", 30).await;
    let first = seen.iter().filter(|t| t.is_zero()).count();
    assert_eq!(first, 15, "{seen:?}");
    assert!(busiest(&seen, Duration::from_secs(1)) <= 15, "{seen:?}");
}

/// On Redis, in real time (the store's clock is the server's): a partner counting per
/// second never counts more than 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttle_never_sends_more_than_the_limit_in_a_second_on_redis() {
    let redis = RedisServer::start();
    for rules in ["10/s", "10/s fixed-window"] {
        let store = RedisStore::builder()
            .timeout(Duration::from_secs(5))
            .build(&redis.url())
            .await
            .unwrap();
        wait_connected(&store).await;
        let seen = arrivals(store, rules, rules, 30).await;
        assert_eq!(seen.len(), 30, "{rules}");
        let counts = per_second(&seen);
        assert!(
            counts.iter().all(|&n| n <= 10),
            "{rules}: {counts:?} per second, {seen:?}"
        );
    }
}
