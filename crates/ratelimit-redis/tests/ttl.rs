//! Time comes from Redis, and every key carries a TTL no longer than its state matters.

mod common;

use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, Outcome, RuleSet, Store};
use ratelimit_redis::redis::{self, Connection};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;

const MS: u64 = 1_000;

/// (PTTL of `key`, Redis time in ms), read in one atomic step.
fn pttl_at(con: &mut Connection, key: &str) -> (i64, u64) {
    let (pttl, (secs, micros)): (i64, (u64, u64)) = redis::pipe()
        .atomic()
        .cmd("PTTL")
        .arg(key)
        .cmd("TIME")
        .query(con)
        .unwrap();
    (pttl, secs * 1_000 + micros / 1_000)
}

fn redis_time_us(con: &mut Connection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(con).unwrap();
    secs * 1_000_000 + micros
}

fn state_key(prefix: &str, client_hex: &str) -> String {
    format!("{prefix}:{{k{client_hex}}}:s")
}

fn log_key(prefix: &str, client_hex: &str) -> String {
    format!("{prefix}:{{k{client_hex}}}:l")
}

/// A connected store under prefix `t` on Redis `TIME`.
async fn redis_time_store(server: &RedisServer) -> RedisStore {
    let store = RedisStore::builder()
        .prefix("t")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    store
}

#[tokio::test]
async fn with_redis_time_keys_expire_exactly_when_their_state_stops_mattering() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let store = redis_time_store(&server).await;

    // GCRA, 10/s: one request moves the theoretical arrival time 100 ms past now.
    let gcra: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let before = redis_time_us(&mut con);
    assert!(store.check(b"a", &gcra, 1).await.unwrap().is_allowed());
    let after = redis_time_us(&mut con);
    let (pttl, now_ms) = pttl_at(&mut con, &state_key("t", "61"));
    let expires_ms = now_ms as i64 + pttl;
    // The key expires at ceil((t + 100 ms) / 1 ms) for the script's time t in [before, after].
    let earliest = (before + 100 * MS).div_ceil(MS) as i64;
    let latest = (after + 100 * MS).div_ceil(MS) as i64;
    assert!(
        (earliest - 1..=latest + 1).contains(&expires_ms),
        "expires at {expires_ms} ms, want {earliest}..={latest}"
    );

    // Fixed window of an hour: the key lives to the end of the current window.
    let hourly: RuleSet = "100/h fixed-window".parse().unwrap();
    let before = redis_time_us(&mut con);
    assert!(store.check(b"a", &hourly, 1).await.unwrap().is_allowed());
    let (pttl, now_ms) = pttl_at(&mut con, &state_key("t", "61"));
    let window_end_ms = (before / 3_600_000_000 + 1) * 3_600_000;
    assert!(
        (now_ms as i64 + pttl - window_end_ms as i64).abs() <= 1,
        "{pttl} ms left at {now_ms}, window ends at {window_end_ms}"
    );

    // A log-only rule set: the log and the state (which says until when the log counts)
    // live one longest period.
    let log: RuleSet = "1/s sliding-log; 5/min sliding-log".parse().unwrap();
    let before = redis_time_us(&mut con);
    assert!(store.check(b"a", &log, 1).await.unwrap().is_allowed());
    let after = redis_time_us(&mut con);
    // A minute after the script's time t in [before, after], rounded up to the ms.
    let earliest = (before + 60_000_000).div_ceil(MS) as i64;
    let latest = (after + 60_000_000).div_ceil(MS) as i64;
    for key in [log_key("t", "61"), state_key("t", "61")] {
        let (pttl, now_ms) = pttl_at(&mut con, &key);
        let at = now_ms as i64 + pttl;
        assert!(
            (earliest - 1..=latest + 1).contains(&at),
            "{key} expires at {at} ms, want {earliest}..={latest}"
        );
    }

    // Blocks expire with their duration; a block without end has no TTL.
    store
        .block(b"a", Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let (pttl, _) = pttl_at(&mut con, "t:{k61}:b");
    // Rounded up to the millisecond.
    assert!((29_000..=30_001).contains(&pttl), "{pttl}");
    let d = store.check(b"a", &gcra, 1).await.unwrap();
    assert_eq!(d.outcome(), Outcome::Blocked);
    let left = d.retry_after().unwrap();
    assert!(
        left <= Duration::from_secs(30) && left > Duration::from_secs(29),
        "{left:?}"
    );
    store.block(b"a", None).await.unwrap();
    assert_eq!(
        pttl_at(&mut con, "t:{k61}:b").0,
        -1,
        "no TTL on a block without end"
    );
    store.unblock(b"a").await.unwrap();
    assert_eq!(
        pttl_at(&mut con, "t:{k61}:b").0,
        -2,
        "unblock removes the marker"
    );

    // Every key the store wrote carries a TTL.
    for name in common::all_keys(&mut con) {
        let pttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut con).unwrap();
        assert!(
            pttl > 0,
            "{} has PTTL {pttl}",
            String::from_utf8_lossy(&name)
        );
    }
}

#[tokio::test]
async fn app_servers_with_skewed_clocks_agree_through_redis_time() {
    // Nothing in the store reads the app server's clock by default: two stores stand for
    // two app servers, and the only clock is Redis's.
    let server = RedisServer::start();
    let a = RedisStore::connect(&server.url()).await.unwrap();
    wait_connected(&a).await;
    let b = RedisStore::connect(&server.url()).await.unwrap();
    wait_connected(&b).await;
    let rules: RuleSet = "2/min gcra burst=2".parse().unwrap();
    assert!(a.check(b"k", &rules, 1).await.unwrap().is_allowed());
    assert!(b.check(b"k", &rules, 1).await.unwrap().is_allowed());
    for store in [&a, &b] {
        let d = store.check(b"k", &rules, 1).await.unwrap();
        let retry = d.retry_after().expect("denied");
        assert!(
            retry > Duration::from_secs(29) && retry <= Duration::from_secs(30),
            "{retry:?}"
        );
    }
}

#[tokio::test]
async fn with_an_injected_clock_ttls_have_a_floor() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let clock = ManualClock::new(T0_US + 600 * 1_000_000);
    let url = server.url();
    let store = |prefix: &'static str, floor: Duration| {
        RedisStore::builder()
            .prefix(prefix)
            .clock(clock.clone())
            .ttl_floor(floor)
            .timeout(Duration::from_secs(5))
            .build(&url)
    };
    let gcra: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let hourly: RuleSet = "100/h fixed-window".parse().unwrap();

    // A 60 s floor (the default), however short the state's life on the injected clock.
    // Ranges leave a second for a slow machine between the check and PTTL.
    let floored = store("f", Duration::from_secs(60)).await.unwrap();
    wait_connected(&floored).await;
    assert!(floored.check(b"a", &gcra, 1).await.unwrap().is_allowed());
    let (pttl, _) = pttl_at(&mut con, &state_key("f", "61"));
    assert!((59_000..=60_000).contains(&pttl), "{pttl}");
    // Longer lives are measured on the injected clock: 50 minutes left in the hour.
    assert!(floored.check(b"a", &hourly, 1).await.unwrap().is_allowed());
    let (pttl, _) = pttl_at(&mut con, &state_key("f", "61"));
    assert!((2_999_000..=3_000_000).contains(&pttl), "{pttl}");

    // Without a floor the TTL is the state's own life: 100 ms.
    let exact = store("e", Duration::ZERO).await.unwrap();
    wait_connected(&exact).await;
    assert!(exact.check(b"a", &gcra, 1).await.unwrap().is_allowed());
    let (pttl, _) = pttl_at(&mut con, &state_key("e", "61"));
    assert!((1..=100).contains(&pttl), "{pttl}");

    // A block's marker gets the floor too, while the block itself ends on the injected
    // clock.
    floored
        .block(b"a", Some(Duration::from_secs(1)))
        .await
        .unwrap();
    let (pttl, _) = pttl_at(&mut con, "f:{k61}:b");
    assert!((59_000..=60_000).contains(&pttl), "{pttl}");
    assert_eq!(
        floored.check(b"a", &gcra, 1).await.unwrap().outcome(),
        Outcome::Blocked
    );
    clock.advance(Duration::from_secs(1));
    assert!(floored.check(b"a", &gcra, 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn a_clients_state_lives_as_long_as_its_longest_rule_and_no_longer() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let store = redis_time_store(&server).await;
    let expires_at_ms = |con: &mut Connection| {
        let (pttl, now_ms) = pttl_at(con, &state_key("t", "61"));
        assert!(pttl > 0, "{pttl}");
        now_ms as i64 + pttl
    };

    // One key for both rules: it lives to the end of the hour, the longer of the two.
    let both: RuleSet = "10/s gcra burst=5; 100/h fixed-window".parse().unwrap();
    let before = redis_time_us(&mut con);
    assert!(store.check(b"a", &both, 1).await.unwrap().is_allowed());
    let window_end_ms = (before / 3_600_000_000 + 1) * 3_600_000;
    assert!(
        (expires_at_ms(&mut con) - window_end_ms as i64).abs() <= 1,
        "want the end of the hour, {window_end_ms}"
    );

    // The hourly rule removed: the next check that commits writes the GCRA's state
    // alone, with its 100 ms; the removed rule keeps nothing alive.
    let gcra: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let before = redis_time_us(&mut con);
    assert!(store.check(b"a", &gcra, 1).await.unwrap().is_allowed());
    let after = redis_time_us(&mut con);
    let at = expires_at_ms(&mut con);
    // Two requests of 100 ms each, from the first check's time on.
    assert!(
        at <= (after + 200 * MS).div_ceil(MS) as i64 + 1 && at >= (before / MS) as i64,
        "expires at {at}, at most 200 ms after {after} µs"
    );
}

/// A denial under a lowered limit writes the converted state (see the core's `algo`,
/// "Changing rules"), and its key lives as long as that state matters: 3 used of `5/h`
/// owe an hour under `3/h`, where the old state stopped mattering after 36 minutes.
#[tokio::test]
async fn a_denial_that_converts_a_changed_limit_keeps_the_state_while_it_matters() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let store = redis_time_store(&server).await;

    for (client, hex, five, three) in [
        (b"c", "63", "5/h gcra burst=5", "3/h gcra burst=3"),
        (
            b"d",
            "64",
            "5/h token-bucket capacity=5",
            "3/h token-bucket capacity=3",
        ),
    ] {
        let (five, three): (RuleSet, RuleSet) = (five.parse().unwrap(), three.parse().unwrap());
        let before = redis_time_us(&mut con);
        for _ in 0..3 {
            assert!(store.check(client, &five, 1).await.unwrap().is_allowed());
        }
        let (pttl, now_ms) = pttl_at(&mut con, &state_key("t", hex));
        let old_expiry = now_ms as i64 + pttl;
        assert!(
            old_expiry <= now_ms as i64 + 2_160_001,
            "{five}: 3 of 5/h matter 36 minutes, expire at {old_expiry}"
        );
        let d = store.check(client, &three, 1).await.unwrap();
        assert_eq!(d.outcome(), Outcome::Limited, "{three}: {d:?}");
        let after = redis_time_us(&mut con);
        let (pttl, now_ms) = pttl_at(&mut con, &state_key("t", hex));
        let expires_ms = now_ms as i64 + pttl;
        // About an hour after the checks (less what drained in the milliseconds between).
        let earliest = (before / MS) as i64 + 3_590_000;
        let latest = (after / MS) as i64 + 3_600_001;
        assert!(
            (earliest..=latest).contains(&expires_ms),
            "{three}: expires at {expires_ms} ms, want {earliest}..={latest}"
        );
    }
}
