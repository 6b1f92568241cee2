//! Calls lost with their connection: `CLIENT KILL` under load, over and over. A check
//! whose call may have run in Redis before its connection broke is sent again only as a
//! call the module decides once (its first run's reply, or a run if there was none);
//! on Lua it fails. Either way, for every key Redis holds the units of the checks
//! admitted, plus at most those of the checks reported failed: nothing is charged that
//! the caller was not told about, and nothing twice.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::RedisStore;

const KEYS: usize = 24;
const TASKS: usize = 16;
const KILLS: usize = 30;
const LIMIT: u64 = 1_000_000;

fn rules() -> RuleSet {
    // The clock stands still: the window never turns, so its count is every unit
    // charged.
    format!("{LIMIT}/h fixed-window").parse().unwrap()
}

fn key(i: usize) -> Vec<u8> {
    format!("in-flight-{i}").into_bytes()
}

/// Per key: (units admitted, units of checks that failed).
type Tally = HashMap<usize, (u64, u64)>;

/// Adds one task's tally to the whole.
fn add(tally: &mut Tally, task: Tally) {
    for (k, (admitted, failed)) in task {
        let entry = tally.entry(k).or_default();
        entry.0 += admitted;
        entry.1 += failed;
    }
}

/// `TASKS` tasks check keys at random while `kill` cuts the store's connections `KILLS`
/// times; then each key's charge must lie between what was admitted and that plus what
/// failed.
async fn kills_charge_nothing_unreported(
    store: RedisStore,
    kill: impl Fn() + Send + 'static,
    fail_some: bool,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let mut state = 0x9e37_79b9_u64.wrapping_mul(t as u64 + 1);
                let mut errors = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    let k = usize::try_from(state >> 33).unwrap() % KEYS;
                    let cost = 1 + (state >> 20) % 3;
                    let entry = tally.entry(k).or_default();
                    match store.check(&key(k), &rules(), cost).await {
                        Ok(d) => {
                            assert!(d.is_allowed(), "nothing is near the limit");
                            entry.0 += cost;
                        }
                        Err(e) => {
                            assert!(e.is_unavailable(), "{e}");
                            entry.1 += cost;
                            if errors.len() < 3 {
                                errors.push(e.to_string());
                            }
                        }
                    }
                }
                (tally, errors)
            })
        })
        .collect();
    let killer = tokio::task::spawn_blocking(move || {
        for _ in 0..KILLS {
            std::thread::sleep(Duration::from_millis(15));
            kill();
        }
    });
    killer.await.expect("killer");
    // Let the store reconnect and the tasks run on a working connection for a while.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::new();
    let mut errors = Vec::new();
    for task in tasks {
        let (t, e) = task.await.expect("no panic in a checking task");
        add(&mut tally, t);
        errors.extend(e);
    }
    wait_connected(&store).await;
    for (k, (admitted, failed)) in &tally {
        // A check of cost 0 reads without charging.
        let d = store.check(&key(*k), &rules(), 0).await.expect("peek");
        let charged = LIMIT - d.rules()[0].remaining;
        assert!(
            *admitted <= charged && charged <= admitted + failed,
            "key {k}: {charged} units charged, {admitted} admitted, {failed} in failed \
             checks (errors seen: {errors:?})"
        );
    }
    // Where calls lost with their connection fail (Lua), a test whose kills failed
    // none tested nothing; on the module they are sent again and decided once.
    let failed: u64 = tally.values().map(|t| t.1).sum();
    assert!(
        failed > 0 || !fail_some,
        "the kills failed no check: the test tests nothing"
    );
}

async fn store_on(url: &str) -> RedisStore {
    let store = RedisStore::builder()
        .prefix("inflight")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .build(url)
        .await
        .expect("store");
    wait_connected(&store).await;
    store
}

fn killer(servers: Vec<u16>) -> impl Fn() + Send + 'static {
    move || {
        for &port in &servers {
            common::kill_clients(port);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice() {
    let server = RedisServer::start();
    let store = store_on(&server.url()).await;
    assert!(!store.uses_module());
    kills_charge_nothing_unreported(store, killer(vec![server.port()]), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_in_the_module() {
    let server = RedisServer::start_with_module();
    let store = store_on(&server.url()).await;
    assert!(store.uses_module());
    kills_charge_nothing_unreported(store, killer(vec![server.port()]), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_on_a_cluster() {
    let cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .prefix("inflight")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .build_cluster(cluster.urls())
        .await
        .expect("store");
    wait_connected(&store).await;
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    kills_charge_nothing_unreported(store, killer(ports), true).await;
}

/// Checks that tasks issue back to back in the decided-once test, all told.
const BACK_TO_BACK: u64 = 8_000;

/// `BACK_TO_BACK` checks from 64 tasks (so that they queue and leave in batches) while
/// every connection is cut every 100 ms: per key, Redis holds exactly the units of the
/// checks admitted plus at most those of the checks that failed, and returns how many
/// failed.
async fn back_to_back_under_kills(store: RedisStore, port: u16) -> (u64, u64) {
    const TASKS: u64 = 64;
    let done = Arc::new(AtomicBool::new(false));
    let killer = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut kills = 0;
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                common::kill_clients(port);
                kills += 1;
            }
            kills
        })
    };
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let mut failed = 0;
                for i in 0..BACK_TO_BACK / TASKS {
                    let k = ((t * 7 + i) % KEYS as u64) as usize;
                    let entry = tally.entry(k).or_default();
                    match store.check(&key(k), &rules(), 1).await {
                        Ok(d) => {
                            assert!(d.is_allowed());
                            entry.0 += 1;
                        }
                        Err(e) => {
                            assert!(e.is_unavailable(), "{e}");
                            entry.1 += 1;
                            failed += 1;
                        }
                    }
                }
                (tally, failed)
            })
        })
        .collect();
    let mut tally = Tally::new();
    let mut failed = 0;
    for task in tasks {
        let (t, f) = task.await.expect("no panic in a checking task");
        failed += f;
        add(&mut tally, t);
    }
    done.store(true, Ordering::Relaxed);
    let kills = killer.join().expect("killer");
    wait_connected(&store).await;
    let mut twice = 0;
    for (k, (admitted, lost)) in &tally {
        // The last kill may have cut a connection the store finds broken only now.
        let mut peek = store.check(&key(*k), &rules(), 0).await;
        if peek.is_err() {
            wait_connected(&store).await;
            peek = store.check(&key(*k), &rules(), 0).await;
        }
        let d = peek.expect("peek");
        let charged = LIMIT - d.rules()[0].remaining;
        assert!(
            *admitted <= charged,
            "key {k}: {charged} units charged, fewer than the {admitted} admitted"
        );
        twice += charged.saturating_sub(admitted + lost);
    }
    assert_eq!(twice, 0, "units charged beyond every check sent");
    eprintln!(
        "{BACK_TO_BACK} checks under {kills} kills: {failed} failed ({:.2} %)",
        failed as f64 * 100.0 / BACK_TO_BACK as f64
    );
    (failed, kills)
}

/// On the module, a call lost with its connection is sent again and decided once: at
/// most 1 % of the checks fail, none is charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kills_every_100ms_fail_at_most_1_percent_in_the_module() {
    let server = RedisServer::start_with_module();
    let store = store_on(&server.url()).await;
    assert!(store.uses_module());
    let (failed, kills) = back_to_back_under_kills(store, server.port()).await;
    assert!(
        kills >= 2,
        "only {kills} kills: the checks ran too fast to test anything"
    );
    assert!(
        failed * 100 <= BACK_TO_BACK,
        "{failed} of {BACK_TO_BACK} checks failed under {kills} kills"
    );
}

/// The Lua functions keep no record of replies: a call lost with its connection fails
/// (nothing charged that was not reported); measured here beside the module.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kills_every_100ms_on_lua_fail_what_was_in_flight() {
    let server = RedisServer::start();
    let store = store_on(&server.url()).await;
    assert!(!store.uses_module());
    back_to_back_under_kills(store, server.port()).await;
}

/// A 3+3 Cluster on the module fails a master over (`CLUSTER FAILOVER`) while 32 tasks
/// check keys of every slot back to back: never more admitted than the limit per key,
/// nothing charged twice, and the checks failed meanwhile counted (errors that prove
/// nothing ran are sent again within the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_under_load_over_admits_nothing() {
    const TASKS: usize = 32;
    const PER_KEY: u64 = 300;
    let cluster = RedisCluster::start_with_module_and_replicas();
    let store = RedisStore::builder()
        .prefix("failover")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .build_cluster(cluster.urls()[..3].to_vec())
        .await
        .expect("store");
    wait_connected(&store).await;
    assert!(store.uses_module());
    // A limit the load goes past: over-admission would show.
    let rules: RuleSet = format!("{PER_KEY}/h fixed-window").parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, stop, rules) = (store.clone(), stop.clone(), rules.clone());
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let (mut failed, mut i) = (0u64, t);
                while !stop.load(Ordering::Relaxed) {
                    i += 7;
                    let k = i % KEYS;
                    let entry = tally.entry(k).or_default();
                    match store.check(&key(k), &rules, 1).await {
                        Ok(d) if d.is_allowed() => entry.0 += 1,
                        Ok(_) => {}
                        Err(e) => {
                            assert!(e.is_unavailable(), "{e}");
                            entry.1 += 1;
                            failed += 1;
                        }
                    }
                }
                (tally, failed)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let promote = tokio::task::spawn_blocking(move || {
        cluster.failover(0);
        cluster
    });
    let cluster = promote.await.expect("failover");
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::new();
    let mut failed = 0;
    for task in tasks {
        let (t, f) = task.await.expect("no panic in a checking task");
        failed += f;
        add(&mut tally, t);
    }
    for (k, (admitted, lost)) in &tally {
        assert!(
            *admitted <= PER_KEY,
            "key {k}: {admitted} admitted over {PER_KEY}"
        );
        let d = store.check(&key(*k), &rules, 0).await.expect("peek");
        let charged = PER_KEY - d.rules()[0].remaining;
        assert!(
            *admitted <= charged && charged <= (admitted + lost).min(PER_KEY),
            "key {k}: {charged} charged, {admitted} admitted, {lost} failed"
        );
    }
    eprintln!("a failover under load: {failed} checks failed");
    drop(cluster);
}
