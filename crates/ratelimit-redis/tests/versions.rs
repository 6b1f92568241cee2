//! Versions sharing a Redis: each loads its own function library (`ratelimit_<tag>`);
//! `unload_other_versions` removes the others' on every primary and leaves the store's
//! own and other applications' libraries; a store whose library was removed (by a newer
//! version's run) loads it again, and a store that cannot get its function back from a
//! reload still decides, through the script form, every check exactly once.
//!
//! The Cluster tests run on a current-thread runtime: every spawned check queues before
//! the store's sending task runs, so batches form whatever the timing.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{Decision, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_redis::redis::{self, Connection};
use ratelimit_redis::testing::{
    check_script, wait_connected, RedisCluster, RedisSentinel, RedisServer, SENTINEL_SERVICE,
};
use ratelimit_redis::RedisStore;

/// A library as an earlier version would have left it: named `ratelimit_<tag>`, with
/// its check function.
const OLD: &str = "ratelimit_0123456789abcdef";

fn old_library() -> String {
    format!(
        "#!lua name={OLD}\n\
         redis.register_function('ratelimit_check_0123456789abcdef', function() return 1 end)\n"
    )
}

/// Another application's library, which must survive.
const FOREIGN: &str = "ratelimit_tools";

fn foreign_library() -> String {
    format!(
        "#!lua name={FOREIGN}\nredis.register_function('tools_ping', function() return 1 end)\n"
    )
}

/// The library this version loads, by name.
fn own() -> String {
    let library = check_script().library;
    let first = library
        .lines()
        .next()
        .expect("a library starts with its shebang");
    first
        .strip_prefix("#!lua name=")
        .expect("#!lua name=...")
        .to_owned()
}

/// A library of this version's name without its functions: reloading the library cannot
/// bring them back.
fn hollow_library() -> String {
    format!(
        "#!lua name={}\nredis.register_function('hollow_{}', function() return 1 end)\n",
        own(),
        own()
    )
}

fn load(con: &mut Connection, library: &str) {
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(library)
        .query(con)
        .expect("FUNCTION LOAD");
}

fn delete(con: &mut Connection, library: &str) {
    let _: () = redis::cmd("FUNCTION")
        .arg("DELETE")
        .arg(library)
        .query(con)
        .expect("FUNCTION DELETE");
}

fn libraries(con: &mut Connection) -> BTreeSet<String> {
    let listed: Vec<Vec<redis::Value>> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query(con)
        .expect("FUNCTION LIST");
    listed
        .iter()
        .map(|fields| {
            let at = fields
                .iter()
                .position(|f| *f == redis::Value::BulkString(b"library_name".to_vec()))
                .expect("library_name");
            redis::from_redis_value_ref(&fields[at + 1]).expect("a name")
        })
        .collect()
}

fn calls(con: &mut Connection, command: &str) -> u64 {
    common::commandstats(con).get(command).map_or(0, |s| s.0)
}

fn rules() -> RuleSet {
    "20/s gcra burst=40; 100/min fixed-window".parse().unwrap()
}

fn set_of<const N: usize>(names: [&str; N]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

async fn store(server: &RedisServer) -> RedisStore {
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .expect("store");
    wait_connected(&store).await;
    store
}

#[tokio::test]
async fn other_versions_are_removed_and_the_own_library_stays() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let store = store(&server).await;
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    load(&mut con, &old_library());
    load(&mut con, &foreign_library());
    assert_eq!(libraries(&mut con), set_of([&own(), OLD, FOREIGN]));

    assert_eq!(store.unload_other_versions().await.unwrap(), [OLD]);
    assert_eq!(libraries(&mut con), set_of([&own(), FOREIGN]));
    assert!(store.unload_other_versions().await.unwrap().is_empty());

    // The store's own functions were never touched: no reload.
    common::reset_stats(&mut con);
    for _ in 0..3 {
        assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    }
    assert_eq!(calls(&mut con, "function|load"), 0);
    assert_eq!(calls(&mut con, "fcall"), 3);
}

/// Through Sentinel, the current primary is cleaned; its replica follows it.
#[tokio::test]
async fn through_sentinel_the_primary_and_so_its_replica_are_cleaned() {
    let set = RedisSentinel::start();
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build_sentinel([set.url()], SENTINEL_SERVICE)
        .await
        .unwrap();
    wait_connected(&store).await;
    let mut primary = common::conn(&set.primary().url());
    let mut replica = common::conn(&set.replica().url());
    // WAIT covers this connection's writes, and so all that the stream carried before.
    let replicated = |primary: &mut Connection| {
        let _: () = redis::cmd("SET")
            .arg("v:marker")
            .arg(1)
            .query(primary)
            .unwrap();
        let copies: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(primary).unwrap();
        assert_eq!(copies, 1, "the replica acknowledged");
    };
    load(&mut primary, &old_library());
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    replicated(&mut primary);
    assert_eq!(libraries(&mut replica), set_of([&own(), OLD]));

    assert_eq!(store.unload_other_versions().await.unwrap(), [OLD]);
    assert_eq!(libraries(&mut primary), set_of([&own()]));
    replicated(&mut primary);
    assert_eq!(libraries(&mut replica), set_of([&own()]));
}

/// What an instance of an older version lives through when a newer one removes its
/// library mid-deploy: its next check loads the library again, once, and is decided.
#[tokio::test]
async fn a_store_whose_library_was_removed_loads_it_again() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let store = store(&server).await;
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    delete(&mut con, &own());
    common::reset_stats(&mut con);
    for i in 0..4 {
        let d = store.check(b"k", &rules(), 1).await.unwrap();
        assert_eq!(d.rules()[1].remaining, 100 - 2 - i);
    }
    assert_eq!(calls(&mut con, "function|load"), 1);
    // The first check's FCALL found nothing and was sent again after the load.
    assert_eq!(calls(&mut con, "fcall"), 5);
    assert_eq!(libraries(&mut con), set_of([&own()]));
}

/// A library of the store's name that lacks its functions (removed again between the
/// reload and the resend looks the same): the call goes as the script form instead of
/// failing, and nothing loops.
#[tokio::test]
async fn a_store_that_cannot_get_its_function_back_still_decides() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    load(&mut con, &hollow_library());
    let store = store(&server).await;
    common::reset_stats(&mut con);
    for i in 0..3 {
        let d = store.check(b"k", &rules(), 1).await.unwrap();
        assert_eq!(d.rules()[1].remaining, 100 - 1 - i);
    }
    // Per check: FCALL, FUNCTION LOAD (already there), FCALL, EVALSHA (EVAL the first
    // time only, which caches the script).
    assert_eq!(calls(&mut con, "fcall"), 6);
    assert_eq!(calls(&mut con, "function|load"), 3);
    assert_eq!(calls(&mut con, "evalsha"), 3);
    assert!(calls(&mut con, "eval") <= 1);
}

const CHECKS: usize = 120;

fn key(i: usize) -> Vec<u8> {
    format!("client-{}", i % 17).into_bytes()
}

fn said(d: &Decision) -> (bool, Option<Duration>, Vec<u64>) {
    (
        d.is_allowed(),
        d.retry_after(),
        d.rules().iter().map(|r| r.remaining).collect(),
    )
}

/// Runs `CHECKS` concurrent checks on `redis` and the same checks one by one on
/// `memory`: each is decided, and exactly once.
async fn round(redis: &RedisStore, memory: &MemoryStore<ManualClock>) {
    let tasks: Vec<_> = (0..CHECKS)
        .map(|i| {
            let redis = redis.clone();
            tokio::spawn(async move { redis.check(&key(i), &rules(), 1).await })
        })
        .collect();
    let mut decided = Vec::new();
    for task in tasks {
        decided.push(said(&task.await.unwrap().expect("check")));
    }
    let mut expected = Vec::new();
    for i in 0..CHECKS {
        expected.push(said(&memory.check(&key(i), &rules(), 1).await.unwrap()));
    }
    assert_eq!(decided, expected);
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_cluster_other_versions_are_removed_from_every_master() {
    let cluster = RedisCluster::start();
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "v").await;
    round(&redis, &memory).await;
    // An old version's library on two of the three masters, another application's on
    // the third.
    load(&mut cons[0], &old_library());
    load(&mut cons[2], &old_library());
    load(&mut cons[1], &foreign_library());

    assert_eq!(redis.unload_other_versions().await.unwrap(), [OLD]);
    assert_eq!(libraries(&mut cons[0]), set_of([&own()]));
    assert_eq!(libraries(&mut cons[1]), set_of([&own(), FOREIGN]));
    assert_eq!(libraries(&mut cons[2]), set_of([&own()]));
    assert!(redis.unload_other_versions().await.unwrap().is_empty());

    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory).await;
    let loads: u64 = cons.iter_mut().map(|c| calls(c, "function|load")).sum();
    assert_eq!(loads, 0, "the store's own library stayed on every master");
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_cluster_a_store_whose_library_was_removed_still_decides_each_check_once() {
    let cluster = RedisCluster::start();
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "v").await;
    round(&redis, &memory).await;

    // Removed, as a newer version's run does: reloaded on every master.
    for con in cons.iter_mut() {
        delete(con, &own());
    }
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory).await;
    for con in cons.iter_mut() {
        assert_eq!(libraries(con), set_of([&own()]));
    }

    // Hollow: the reload cannot bring the functions back; batches fall back to checks
    // sent alone, as the script form.
    for con in cons.iter_mut() {
        delete(con, &own());
        load(con, &hollow_library());
        common::reset_stats(con);
    }
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory).await;
    let evalsha: u64 = cons.iter_mut().map(|c| calls(c, "evalsha")).sum();
    assert!(evalsha > 0, "the script form decided");
}
