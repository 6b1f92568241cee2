//! Faults: Redis killed, frozen, restarted, its script cache flushed, a key overwritten
//! with another type. Every failure is a typed error within the timeout, never a panic,
//! and the same store recovers.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, RuleSet, Store};
use ratelimit_redis::redis;
use ratelimit_redis::testing::{
    wait_connected, RedisCluster, RedisSentinel, RedisServer, SENTINEL_SERVICE,
};
use ratelimit_redis::{RedisStore, RedisStoreError};
use tokio::sync::Barrier;

const TIMEOUT: Duration = Duration::from_millis(200);
/// Scheduling jitter on a loaded 2-core CI machine, on top of the timeout.
const SLACK: Duration = Duration::from_millis(250);

fn rules() -> RuleSet {
    "1000/s gcra burst=1000; 10000/h sliding-log"
        .parse()
        .unwrap()
}

async fn store(server: &RedisServer) -> RedisStore {
    let store = RedisStore::builder()
        .timeout(TIMEOUT)
        .build(&server.url())
        .await
        .expect("store");
    wait_connected(&store).await;
    store
}

/// Checks `n` times; every check must fail with a connection or timeout error in time.
async fn all_fail_fast(store: &RedisStore, n: usize, what: &str) {
    for i in 0..n {
        let started = Instant::now();
        let result = store.check(b"k", &rules(), 1).await;
        let took = started.elapsed();
        assert!(
            matches!(
                result,
                Err(RedisStoreError::Connection(_) | RedisStoreError::Timeout(_))
            ),
            "{what}, check {i}: {result:?}"
        );
        assert!(took <= TIMEOUT + SLACK, "{what}, check {i} took {took:?}");
    }
}

#[tokio::test]
async fn killed_redis_gives_typed_errors_in_time_and_a_restart_recovers() {
    let mut server = RedisServer::start();
    let store = store(&server).await;
    for _ in 0..10 {
        assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    }
    assert_eq!(store.recovered_at_us(), 0, "no connection lost yet");
    server.stop();
    all_fail_fast(&store, 8, "Redis killed").await;
    let err = store.check(b"k", &rules(), 1).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert!(
        store.block(b"k", None).await.unwrap_err().is_unavailable()
            && store.unblock(b"k").await.unwrap_err().is_unavailable()
            && store
                .reset(b"k", &rules())
                .await
                .unwrap_err()
                .is_unavailable()
    );

    server.restart();
    // The store reconnects by itself; then checks succeed: the empty script cache is
    // refilled. A check may still time out on a loaded machine (the timeout is short),
    // never fail otherwise.
    wait_connected(&store).await;
    // The return is on record, on the store's clock: what a layer's grace starts from.
    let back = store.recovered_at_us();
    assert!(
        back > 0 && back <= store.now_us(),
        "recovered at {back}, now {}",
        store.now_us()
    );
    let mut admitted = 0;
    for i in 0..20 {
        match store.check(b"k", &rules(), 1).await {
            Ok(d) => {
                assert!(d.is_allowed(), "check {i} after restart: {d:?}");
                admitted += 1;
            }
            Err(e) => assert!(
                matches!(e, RedisStoreError::Timeout(_)),
                "check {i} after restart: {e:?}"
            ),
        }
    }
    assert!(admitted >= 10, "{admitted} of 20 checks after the restart");
}

/// Checks `key` on `store` until one is decided, within 50 attempts: a first call that
/// sets the servers up may outlast a short timeout on a loaded machine.
async fn first_decision(store: &RedisStore, key: &[u8], rules: &RuleSet) {
    for _ in 0..50 {
        match store.check(key, rules, 1).await {
            Ok(_) => return,
            Err(RedisStoreError::Timeout(_)) => {}
            Err(e) => panic!("first check of {key:?}: {e:?}"),
        }
    }
    panic!("no check of {key:?} was decided in 50 attempts");
}

/// Requires that `key` has exactly `left` of its units left, through `patient`, a store
/// with a long timeout on the same servers and prefix: the stores under test have short
/// ones, which a loaded machine may outlast.
async fn units_left(patient: &RedisStore, key: &[u8], rules: &RuleSet, left: usize) {
    for i in 0..=left {
        let d = patient.check(key, rules, 1).await.unwrap();
        assert_eq!(d.is_allowed(), i < left, "check {i}: {d:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load() {
    let mut server = RedisServer::start();
    let store = store(&server).await;
    let warm = Arc::new(Barrier::new(9));
    // 8 tasks check in a loop: warm up, then keep going until each has seen 3 errors.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, warm) = (store.clone(), warm.clone());
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                // Warm up: 5 admitted checks; a check that timed out on a loaded machine
                // is tried again, so that the barrier below is always reached.
                let mut warmed = 0;
                for _ in 0..100 {
                    match store.check(b"k", &rules(), 1).await {
                        Ok(d) => {
                            assert!(d.is_allowed());
                            warmed += 1;
                            if warmed == 5 {
                                break;
                            }
                        }
                        Err(e) => assert!(e.is_unavailable(), "{e}"),
                    }
                }
                warm.wait().await;
                assert_eq!(warmed, 5, "5 checks admitted before Redis is killed");
                let mut errors = 0;
                while errors < 3 {
                    let started = Instant::now();
                    let result = store.check(b"k", &rules(), 1).await;
                    errors += usize::from(result.is_err());
                    outcomes.push((result.map(|d| d.is_allowed()), started.elapsed()));
                }
                outcomes
            })
        })
        .collect();
    // Bounded, so that a task that failed before the barrier fails the test, not hangs it.
    tokio::time::timeout(Duration::from_secs(60), warm.wait())
        .await
        .expect("every task warmed up");
    server.stop();
    for task in tasks {
        for (result, took) in task.await.expect("no panic in any task") {
            match result {
                Ok(allowed) => assert!(allowed),
                Err(e) => assert!(e.is_unavailable(), "{e}"),
            }
            assert!(took <= TIMEOUT + SLACK, "a check took {took:?}");
        }
    }
    server.restart();
    wait_connected(&store).await;
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn a_frozen_redis_times_out_within_the_timeout() {
    let server = RedisServer::start();
    let store = store(&server).await;
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    server.pause();
    for _ in 0..3 {
        let started = Instant::now();
        let result = store.check(b"k", &rules(), 1).await;
        let took = started.elapsed();
        assert!(
            matches!(result, Err(RedisStoreError::Timeout(t)) if t == TIMEOUT),
            "{result:?}"
        );
        assert!(took >= TIMEOUT && took <= TIMEOUT + SLACK, "took {took:?}");
    }
    server.resume();
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
}

/// Long enough for a Cluster to agree on its state again on a loaded machine.
const RECONNECT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_store_starts_without_redis_and_uses_it_once_it_is_up() {
    let mut server = RedisServer::start();
    server.stop();
    let store = RedisStore::builder()
        .timeout(TIMEOUT)
        .connect_timeout(Duration::from_millis(300))
        .build(&server.url())
        .await
        .expect("an unreachable Redis is no reason to fail the build");
    assert!(!store.is_connected());
    all_fail_fast(&store, 5, "Redis never up").await;
    let err = store.check(b"k", &rules(), 1).await.unwrap_err();
    assert!(matches!(err, RedisStoreError::Connection(_)), "{err:?}");
    assert!(err.to_string().contains("cannot reach Redis"), "{err}");
    assert_eq!(store.maxmemory_policy(), None);

    server.restart();
    wait_connected(&store).await;
    // The connection came with the scripts, the clock and the policy read.
    assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));
    for i in 0..5 {
        let d = store.check(b"k", &rules(), 1).await;
        assert!(d.as_ref().is_ok_and(|d| d.is_allowed()), "check {i}: {d:?}");
    }

    let err = RedisStore::connect("http://example.invalid/")
        .await
        .unwrap_err();
    assert!(matches!(err, RedisStoreError::InvalidConfig(_)), "{err:?}");
}

#[tokio::test]
async fn a_cluster_store_starts_while_the_nodes_are_down() {
    let mut cluster = RedisCluster::start();
    for node in cluster.nodes_mut() {
        node.stop();
    }
    let store = RedisStore::builder()
        .timeout(TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .build_cluster(cluster.urls())
        .await
        .expect("an unreachable Cluster is no reason to fail the build");
    all_fail_fast(&store, 3, "Cluster down").await;
    for node in cluster.nodes_mut() {
        node.restart();
    }
    wait_connected(&store).await;
    // The nodes may still be agreeing on the cluster's state: the first checks may fail.
    let deadline = Instant::now() + RECONNECT;
    let mut allowed = 0;
    while allowed < 5 {
        match store.check(b"k", &rules(), 1).await {
            Ok(d) => {
                assert!(d.is_allowed());
                allowed += 1;
            }
            Err(e) => {
                assert!(e.is_unavailable(), "{e:?}");
                assert!(Instant::now() < deadline, "the Cluster never served: {e}");
                tokio::task::yield_now().await;
            }
        }
    }
    let err = RedisStore::builder()
        .build_cluster(Vec::<String>::new())
        .await
        .unwrap_err();
    assert!(matches!(err, RedisStoreError::InvalidConfig(_)), "{err:?}");
}

#[tokio::test]
async fn a_sentinel_store_starts_while_the_primary_is_down() {
    let mut set = RedisSentinel::start();
    set.primary_mut().stop();
    let store = RedisStore::builder()
        .timeout(TIMEOUT)
        .connect_timeout(Duration::from_millis(300))
        .build_sentinel([set.url()], SENTINEL_SERVICE)
        .await
        .expect("an unreachable primary is no reason to fail the build");
    // The Sentinel promotes the replica after a second; the store asks it again.
    wait_connected(&store).await;
    assert_eq!(set.current_primary_port().unwrap(), set.replica().port());
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn script_and_function_flush_are_transparent() {
    let server = RedisServer::start();
    let store = store(&server).await;
    let mut con = common::conn(&server.url());
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut con).unwrap();
    let _: () = redis::cmd("FUNCTION").arg("FLUSH").query(&mut con).unwrap();
    common::reset_stats(&mut con);
    for _ in 0..5 {
        assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    }
    store
        .block(b"b", Some(Duration::from_secs(5)))
        .await
        .unwrap();
    let stats = common::commandstats(&mut con);
    // Checks are FCALLs: the first finds no function, the library is loaded once and the
    // call resent. The block is an FCALL of the same library too (it rides the checks'
    // batch function), so no script is needed.
    assert_eq!(
        stats.get("function|load").map(|s| s.0),
        Some(1),
        "{stats:?}"
    );
    assert_eq!(stats.get("eval").map(|s| s.0), None, "{stats:?}");
    assert_eq!(stats.get("evalsha").map(|s| s.0), None, "{stats:?}");
    let d = store.check(b"b", &rules(), 1).await.unwrap();
    assert_eq!(d.outcome(), ratelimit_core::Outcome::Blocked);
}

#[tokio::test]
async fn foreign_values_at_limiter_keys_heal() {
    foreign_values_heal(&RedisServer::start(), false).await;
}

/// The same on the native module: the same healing, never a crash of the server.
#[tokio::test]
async fn foreign_values_at_limiter_keys_heal_in_the_module() {
    foreign_values_heal_in_the_module(&RedisServer::start_with_module()).await;
}

/// The same on Valkey: its module API answers a wrong type as Redis's does.
#[tokio::test]
async fn foreign_values_at_limiter_keys_heal_on_valkey() {
    foreign_values_heal(&RedisServer::start_valkey(), false).await;
    foreign_values_heal_in_the_module(&RedisServer::start_valkey_with_module()).await;
}

async fn foreign_values_heal_in_the_module(server: &RedisServer) {
    foreign_values_heal(server, true).await;
    let pong: String = redis::cmd("PING")
        .query(&mut common::conn(&server.url()))
        .unwrap();
    assert_eq!(pong, "PONG");
}

async fn foreign_values_heal(server: &RedisServer, module: bool) {
    let store = RedisStore::builder()
        .prefix("wt")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    assert_eq!(store.uses_module(), module);
    let mut con = common::conn(&server.url());
    let rules = rules();
    // The documented layout: "wt:{k<hex of b"k">}:...".
    let (block, state, log) = (
        "wt:{k6b}:b".to_owned(),
        "wt:{k6b}:s".to_owned(),
        "wt:{k6b}:l".to_owned(),
    );
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    let exists: (bool, bool) = redis::pipe()
        .exists(&state)
        .exists(&log)
        .query(&mut con)
        .unwrap();
    assert_eq!(exists, (true, true), "the layout the crate documents");

    let types = |con: &mut redis::Connection| -> (String, String) {
        redis::pipe()
            .cmd("TYPE")
            .arg(&state)
            .cmd("TYPE")
            .arg(&log)
            .query(con)
            .unwrap()
    };
    let mut expect_healed = async |setup: &dyn Fn(&mut redis::Connection)| {
        let _: () = redis::cmd("DEL")
            .arg(&block)
            .arg(&state)
            .arg(&log)
            .query(&mut con)
            .unwrap();
        setup(&mut con);
        // The next check decides on a fresh state and replaces what it found.
        let d = store.check(b"k", &rules, 1).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(types(&mut con), ("string".to_owned(), "list".to_owned()));
        // And the state counts again from there.
        let d = store.check(b"k", &rules, 1).await.unwrap();
        assert_eq!(d.rules()[1].remaining, 10_000 - 2);
    };
    expect_healed(&|c| {
        redis::cmd("DEL").arg(&state).exec(c).unwrap();
        redis::cmd("HSET")
            .arg(&state)
            .arg("1")
            .arg("2")
            .exec(c)
            .unwrap()
    })
    .await;
    expect_healed(&|c| redis::cmd("SET").arg(&state).arg("12 x").exec(c).unwrap()).await;
    // Bytes of the right length (the layout, the GCRA's entry of 6 values, the log
    // marker's 3) that are not non-negative integers.
    expect_healed(&|c| {
        redis::cmd("SET")
            .arg(&state)
            .arg(&[0xff_u8; 80][..])
            .exec(c)
            .unwrap()
    })
    .await;
    expect_healed(&|c| redis::cmd("SET").arg(&log).arg("x").exec(c).unwrap()).await;
    expect_healed(&|c| {
        redis::cmd("LPUSH")
            .arg(&log)
            .arg("yesterday")
            .exec(c)
            .unwrap()
    })
    .await;
    // A block marker that is not a time is dropped.
    redis::cmd("SET")
        .arg(&block)
        .arg("soon")
        .exec(&mut con)
        .unwrap();
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    let gone: bool = redis::cmd("EXISTS").arg(&block).query(&mut con).unwrap();
    assert!(!gone);
    // A block marker of another type reads as "not blocked" (MGET answers nil for it).
    redis::cmd("RPUSH")
        .arg(&block)
        .arg("x")
        .exec(&mut con)
        .unwrap();
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    redis::cmd("DEL").arg(&block).exec(&mut con).unwrap();

    // An entry deep in the log that is not a timestamp: on Lua, reported once, with the
    // log dropped, so the check after it starts clean; the module reads the log as no
    // one's (it answers no error after a write) and replaces it, as any foreign value.
    let deep = "10/s sliding-log; 10000/h sliding-log"
        .parse::<RuleSet>()
        .unwrap();
    for _ in 0..3 {
        assert!(store.check(b"k", &deep, 1).await.unwrap().is_allowed());
    }
    redis::cmd("RPUSH")
        .arg(&log)
        .arg("yesterday")
        .exec(&mut con)
        .unwrap();
    let mut errors = 0;
    for _ in 0..3 {
        match store.check(b"k", &deep, 1).await {
            Err(RedisStoreError::WrongType(text)) => {
                assert!(text.contains("RLSTATE"), "{text}");
                errors += 1;
            }
            Ok(d) => assert!(d.is_allowed()),
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(
        errors,
        u32::from(!module),
        "reported once on Lua, then healed"
    );

    // Blocking does not overwrite someone else's key either.
    redis::cmd("RPUSH")
        .arg(&block)
        .arg("x")
        .exec(&mut con)
        .unwrap();
    let err = store.block(b"k", None).await.unwrap_err();
    assert!(matches!(err, RedisStoreError::WrongType(_)), "{err:?}");
    let kept: Vec<String> = redis::cmd("LRANGE")
        .arg(&block)
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .unwrap();
    assert_eq!(kept, ["x"]);
    redis::cmd("DEL").arg(&block).exec(&mut con).unwrap();
}

/// A check whose caller timed out while Redis was stalled (a slow command, a fork,
/// `DEBUG SLEEP`) still reaches Redis afterwards; it must not charge the client.
#[tokio::test]
async fn checks_that_timed_out_in_a_stalled_redis_charge_nothing() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(100))
        .build(&server.url())
        .await
        .unwrap();
    stalled_checks_charge_nothing(&server, &store, RedisStore::builder()).await;
}

/// As above, for a store on an injected clock: the deadline on Redis's clock goes
/// beside the injected time.
#[tokio::test]
async fn checks_that_timed_out_charge_nothing_on_an_injected_clock() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let clock = ManualClock::new(T0_US);
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(100))
        .clock(clock.clone())
        .build(&server.url())
        .await
        .unwrap();
    stalled_checks_charge_nothing(&server, &store, RedisStore::builder().clock(clock)).await;
}

/// As above, for a store over the application's pool: it reads Redis's clock on its
/// first call.
#[tokio::test]
async fn checks_that_timed_out_charge_nothing_over_a_pool() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let pool = ratelimit_redis::bb8::Pool::builder()
        .test_on_check_out(false)
        .build(ratelimit_redis::bb8_redis::RedisConnectionManager::new(server.url()).unwrap())
        .await
        .unwrap();
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(100))
        .build_with_pool(pool);
    stalled_checks_charge_nothing(&server, &store, RedisStore::builder()).await;
}

/// As above, for a store over the application's cluster connection: it reads every
/// master's clock on its first call. Every master is stalled, wherever the key lives.
#[tokio::test]
async fn checks_that_timed_out_charge_nothing_over_a_given_cluster_connection() {
    let cluster = RedisCluster::start();
    let conn = redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(100))
        .build_with_cluster_connection(conn);
    let rules: RuleSet = "5/min fixed-window".parse().unwrap();
    first_decision(&store, b"warm", &rules).await;
    let mut probes: Vec<_> = cluster
        .nodes()
        .iter()
        .map(|node| {
            let probe = common::conn(&node.url());
            probe
                .set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            probe
        })
        .collect();
    let stalls: Vec<_> = cluster
        .nodes()
        .iter()
        .map(|node| {
            let url = node.url();
            std::thread::spawn(move || {
                let mut con = common::conn(&url);
                redis::cmd("DEBUG").arg("SLEEP").arg("3").exec(&mut con)
            })
        })
        .collect();
    for probe in &mut probes {
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis::cmd("PING").query::<String>(probe).is_ok() {
            assert!(Instant::now() < deadline, "DEBUG SLEEP never began");
        }
    }
    for _ in 0..10 {
        let err = store.check(b"k", &rules, 1).await.unwrap_err();
        assert!(matches!(err, RedisStoreError::Timeout(_)), "{err:?}");
    }
    for stall in stalls {
        stall.join().unwrap().unwrap();
    }
    // The checks queued on the node's connection ahead of these ones: none was charged.
    let patient = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build_cluster(cluster.urls())
        .await
        .unwrap();
    wait_connected(&patient).await;
    units_left(&patient, b"k", &rules, 5).await;
}

/// Stalls `server` with `DEBUG SLEEP` while 10 checks of `store` time out, lets Redis
/// run them once it wakes, and requires that none was charged, as a store from `patient`
/// (given `store`'s clock) with a long timeout reads it.
async fn stalled_checks_charge_nothing(
    server: &RedisServer,
    store: &RedisStore,
    patient: ratelimit_redis::RedisStoreBuilder,
) {
    wait_connected(store).await;
    let rules: RuleSet = "5/min fixed-window".parse().unwrap();
    // A first call on another key, as any store makes before a stall in production.
    first_decision(store, b"warm", &rules).await;
    let mut con = common::conn(&server.url());
    common::reset_stats(&mut con);
    let mut probe = common::conn(&server.url());
    probe
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let url = server.url();
    let stall = std::thread::spawn(move || {
        let mut con = common::conn(&url);
        redis::cmd("DEBUG").arg("SLEEP").arg("3").exec(&mut con)
    });
    // Wait until the stall has begun: PING stops being answered within 300 ms.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if redis::cmd("PING").query::<String>(&mut probe).is_err() {
            break;
        }
        assert!(Instant::now() < deadline, "DEBUG SLEEP never began");
    }
    for _ in 0..10 {
        let err = store.check(b"k", &rules, 1).await.unwrap_err();
        assert!(matches!(err, RedisStoreError::Timeout(_)), "{err:?}");
    }
    stall.join().unwrap().unwrap();
    // Redis runs the queued checks once it wakes up; wait until it has. (Checks whose
    // caller gave up before a call could take them are not sent at all: the store's one
    // call in flight waits for its late reply, twice the timeout, and is the first.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::commandstats(&mut con)
        .get("fcall")
        .map_or(0, |s| s.0)
        < 1
    {
        assert!(Instant::now() < deadline, "the queued checks never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    // None of them was charged: the client still has its 5.
    let patient = patient
        .prefix(store.prefix())
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&patient).await;
    units_left(&patient, b"k", &rules, 5).await;
}

/// A store and a script of different versions (another argument layout) answer with an
/// `RLARGS` error that names the skew, never a decision made on misread arguments.
#[test]
fn a_script_of_another_version_is_refused_by_name() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let script = ratelimit_redis::testing::check_script();
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script.body)
        .query(&mut con)
        .unwrap();
    let rules: RuleSet = "10/s gcra".parse().unwrap();
    let args = ratelimit_redis::testing::check_script_args(&rules, 1);
    let run = |con: &mut redis::Connection, extra: &[&[u8]], cut: usize| {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.sha).arg(2).arg("v:b").arg("v:s");
        for arg in &args {
            cmd.arg(&arg[..arg.len() - cut]);
        }
        for arg in extra {
            cmd.arg(*arg);
        }
        cmd.query::<redis::Value>(con)
    };
    assert!(run(&mut con, &[], 0).is_ok());
    for (extra, cut) in [(&[&b"<dd"[..]][..], 0), (&[][..], 8), (&[][..], 3)] {
        let err = run(&mut con, extra, cut).unwrap_err().to_string();
        assert!(
            err.contains("RLARGS") && err.contains("different versions"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn a_detached_release_is_retried_until_redis_is_back() {
    detached_release_retried(RedisServer::start()).await;
}

#[tokio::test]
async fn a_detached_release_is_retried_until_the_module_is_back() {
    detached_release_retried(RedisServer::start_with_module()).await;
}

/// A release handed to the store (`release_detached`, as the tower layer hands one over)
/// while Redis is down is tried again once Redis is back within about a second, as the
/// layer retries one it awaits: the slot is free again, not left to its deadline.
async fn detached_release_retried(mut server: RedisServer) {
    let rules: RuleSet = "1 concurrent timeout=1h".parse().unwrap();
    let store = store(&server).await;
    let taken = store.check(b"k", &rules, 1).await.unwrap();
    let slot = taken.slot().expect("a slot");
    let saved = server.command("SAVE").unwrap();
    assert!(saved.starts_with("+OK"), "SAVE answered {saved:?}");
    server.stop();
    assert!(store.release_detached(b"k", &rules, slot));
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Started again with its data: the slot is still taken there.
    server.restart();
    // A flush waits for the retries too.
    tokio::time::timeout(Duration::from_secs(4), store.flush())
        .await
        .expect("the retries end within about 1.3 s");
    let peek = store.check(b"k", &rules, 0).await.expect("Redis is back");
    assert_eq!(
        peek.rules()[0].remaining,
        1,
        "the release was not retried: {peek:?}"
    );
}
