//! One round trip per check: `INFO commandstats` counts exactly one FCALL per check (one
//! EVALSHA on a server without functions), for 1, 2 and 4 rules, and nothing else sent by
//! the store.

mod common;

use std::time::Duration;

use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;

#[tokio::test]
async fn one_call_per_check_whatever_the_number_of_rules() {
    let server = RedisServer::start();
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let mut con = common::conn(&server.url());
    let sets = [
        "10/s gcra burst=10",
        "10/s gcra burst=10; 100/min sliding-window precision=6",
        "1/s sliding-log; 20/min sliding-log; 200/h sliding-log; 800/day sliding-log",
        "5/s fixed-window; 50/min token-bucket capacity=60; 10/s leaky-bucket mode=shaper burst=5 delay=2; 500/h sliding-log",
    ];
    for text in sets {
        let rules: RuleSet = text.parse().unwrap();
        common::reset_stats(&mut con);
        let checks = 40;
        for i in 0..checks {
            // Admitted, denied and peeking checks alike; several client keys.
            let key = format!("client-{}", i % 3);
            let _ = store.check(key.as_bytes(), &rules, i % 2).await.unwrap();
        }
        let stats = common::commandstats(&mut con);
        assert_eq!(
            stats.get("fcall").map(|s| s.0),
            Some(checks),
            "{} rules: {stats:?}",
            rules.len()
        );
        // TIME runs inside the script, once per check (the store's clock is Redis's), and
        // one MGET reads block marker and state together.
        assert_eq!(stats.get("time").map(|s| s.0), Some(checks), "{stats:?}");
        assert_eq!(stats.get("mget").map(|s| s.0), Some(checks), "{stats:?}");
        // Everything else counted was run by the script itself (or is this test's own
        // CONFIG RESETSTAT): the store sent no EVAL, PING, SCRIPT, MULTI or plain reads.
        assert!(
            stats.keys().all(|cmd| [
                "fcall",
                "config|resetstat",
                "time",
                "mget",
                "del",
                "set",
                "pexpireat",
                "llen",
                "lindex",
                "lpush",
                "ltrim",
            ]
            .contains(&cmd.as_str())),
            "{stats:?}"
        );
    }
}

/// Redis before 7.0 has no functions: a server without FUNCTION and FCALL gets EVALSHA,
/// whether the store learns it at connect or on its first call.
#[tokio::test]
async fn without_functions_checks_use_evalsha() {
    let server = RedisServer::start_with(&[
        "--rename-command",
        "FUNCTION",
        "hidden-function",
        "--rename-command",
        "FCALL",
        "hidden-fcall",
    ]);
    let rules: RuleSet = "2/min gcra burst=2".parse().unwrap();
    let mut con = common::conn(&server.url());
    let connected = RedisStore::builder()
        .prefix("a")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&connected).await;
    let pool = ratelimit_redis::bb8::Pool::builder()
        .build(ratelimit_redis::bb8_redis::RedisConnectionManager::new(server.url()).unwrap())
        .await
        .unwrap();
    let pooled = RedisStore::builder()
        .prefix("b")
        .timeout(Duration::from_secs(5))
        .build_with_pool(pool);
    for store in [&connected, &pooled] {
        common::reset_stats(&mut con);
        for expected in [true, true, false] {
            let d = store.check(b"k", &rules, 1).await.unwrap();
            assert_eq!(d.is_allowed(), expected);
        }
        let stats = common::commandstats(&mut con);
        assert!(stats.get("evalsha").map(|s| s.0) >= Some(3), "{stats:?}");
        // No function libraries to remove, and no error for it.
        assert_eq!(
            store.unload_other_versions().await.unwrap(),
            Vec::<String>::new()
        );
    }
}
