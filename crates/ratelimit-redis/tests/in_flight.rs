//! Calls lost with their connection: `CLIENT KILL` under load, over and over. A call
//! that may have run in Redis before its connection broke is sent again as a call
//! decided once (its first run's reply, or a run if there was none): the module keeps
//! the replies of recent calls, the Lua functions a record key per call. For every key
//! Redis holds the units of the checks admitted, plus at most those of the checks
//! reported failed: nothing is charged that the caller was not told about, and nothing
//! twice; settles and releases are neither lost nor applied twice.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::{RedisStore, RedisStoreError};

/// One test of this file at a time: each cuts connections under load, with timeouts of
/// 500 ms, and a dozen of them at once on a 2-core machine (servers, a Cluster, the
/// stores' tasks) stall one another past those timeouts.
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

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

/// Whether a failure is a timeout: on a loaded machine a call can outlast the 500 ms
/// these tests give it whatever the kills do; every other failure here is a call lost
/// with its connection, which must not happen (it is sent again and decided once).
fn timed_out(e: &RedisStoreError) -> bool {
    matches!(e, RedisStoreError::Timeout(_))
}

/// A check of cost 0 of key `k` after a run under kills: the last kill may have cut a
/// connection the store finds broken only now, and a loaded machine may make a peek
/// outlast its timeout; it reads only, so it goes again.
async fn peek(store: &RedisStore, k: usize, rules: &RuleSet) -> ratelimit_core::Decision {
    let mut tries = 0;
    loop {
        match store.check(&key(k), rules, 0).await {
            Ok(d) => return d,
            Err(e) if e.is_unavailable() && tries < 10 => {
                tries += 1;
                wait_connected(store).await;
            }
            Err(e) => panic!("peek: {e}"),
        }
    }
}

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
async fn kills_charge_nothing_unreported(store: RedisStore, kill: impl Fn() + Send + 'static) {
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
                            if !timed_out(&e) {
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
        let d = peek(&store, *k, &rules()).await;
        let charged = LIMIT - d.rules()[0].remaining;
        assert!(
            *admitted <= charged && charged <= admitted + failed,
            "key {k}: {charged} units charged, {admitted} admitted, {failed} in failed \
             checks (errors seen: {errors:?})"
        );
    }
    // Calls lost with their connection are sent again and decided once, on both paths.
    assert!(errors.is_empty(), "checks failed under kills: {errors:?}");
}

async fn store_on(url: &str) -> RedisStore {
    store_under(url, "inflight").await
}

async fn store_under(url: &str, prefix: &str) -> RedisStore {
    let store = RedisStore::builder()
        .prefix(prefix)
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
    let _serial = one_at_a_time().await;
    let server = RedisServer::start();
    let store = store_on(&server.url()).await;
    assert!(!store.uses_module());
    kills_charge_nothing_unreported(store, killer(vec![server.port()])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_in_the_module() {
    let _serial = one_at_a_time().await;
    let server = RedisServer::start_with_module();
    let store = store_on(&server.url()).await;
    assert!(store.uses_module());
    kills_charge_nothing_unreported(store, killer(vec![server.port()])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_on_a_cluster() {
    let _serial = one_at_a_time().await;
    kills_on_a_cluster(RedisCluster::start()).await;
}

/// The same with the module on every node: a node batch sent again to a node that does
/// not serve its first check's slot (the cluster client's slot map out of date after the
/// kills) is refused with `TRYAGAIN` and sent again, never answered as moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_on_a_module_cluster() {
    let _serial = one_at_a_time().await;
    kills_on_a_cluster(RedisCluster::start_with_module_only()).await;
}

async fn kills_on_a_cluster(cluster: RedisCluster) {
    let store = RedisStore::builder()
        .prefix("inflight")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .build_cluster(cluster.urls())
        .await
        .expect("store");
    wait_connected(&store).await;
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    kills_charge_nothing_unreported(store, killer(ports)).await;
}

/// Over the application's own pool too: a dead pooled connection is replaced and the
/// call sent again, decided once, also when the new connection dies as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_charges_no_check_twice_over_a_pool() {
    let _serial = one_at_a_time().await;
    let server = RedisServer::start();
    let pool = ratelimit_redis::bb8::Pool::builder()
        .test_on_check_out(false)
        .max_size(4)
        .build(ratelimit_redis::bb8_redis::RedisConnectionManager::new(server.url()).unwrap())
        .await
        .unwrap();
    let store = RedisStore::builder()
        .prefix("inflight")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .build_with_pool(pool);
    kills_charge_nothing_unreported(store, killer(vec![server.port()])).await;
}

/// Cuts every client connection of the server on `port` every 100 ms until `done`;
/// the thread's result is the number of cuts.
fn kill_every_100ms(port: u16, done: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut kills = 0;
        while !done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            common::kill_clients(port);
            kills += 1;
        }
        kills
    })
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
    let killer = kill_every_100ms(port, done.clone());
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let (mut failed, mut timeouts) = (0, 0);
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
                            if timed_out(&e) {
                                timeouts += 1;
                            } else {
                                failed += 1;
                            }
                        }
                    }
                }
                (tally, failed, timeouts)
            })
        })
        .collect();
    let mut tally = Tally::new();
    let (mut failed, mut timeouts) = (0, 0);
    for task in tasks {
        let (t, f, slow) = task.await.expect("no panic in a checking task");
        failed += f;
        timeouts += slow;
        add(&mut tally, t);
    }
    done.store(true, Ordering::Relaxed);
    let kills = killer.join().expect("killer");
    wait_connected(&store).await;
    let mut twice = 0;
    for (k, (admitted, lost)) in &tally {
        let d = peek(&store, *k, &rules()).await;
        let charged = LIMIT - d.rules()[0].remaining;
        assert!(
            *admitted <= charged,
            "key {k}: {charged} units charged, fewer than the {admitted} admitted"
        );
        twice += charged.saturating_sub(admitted + lost);
    }
    assert_eq!(twice, 0, "units charged beyond every check sent");
    eprintln!(
        "{BACK_TO_BACK} checks under {kills} kills: {failed} failed ({:.2} %), {timeouts} \
         timed out",
        failed as f64 * 100.0 / BACK_TO_BACK as f64
    );
    assert!(
        timeouts * 100 <= BACK_TO_BACK,
        "{timeouts} of {BACK_TO_BACK} checks timed out: the machine is too loaded to tell"
    );
    (failed, kills)
}

/// A call lost with its connection is sent again and decided once: no check fails,
/// none is charged twice, in three runs.
async fn no_check_fails_under_kills(server: &RedisServer, module: bool) {
    for run in 0..3 {
        let store = store_under(&server.url(), &format!("run{run}")).await;
        assert_eq!(store.uses_module(), module);
        let (failed, kills) = back_to_back_under_kills(store, server.port()).await;
        assert!(
            kills >= 2,
            "only {kills} kills: the checks ran too fast to test anything"
        );
        assert_eq!(
            failed, 0,
            "run {run}: {failed} of {BACK_TO_BACK} checks failed under {kills} kills"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kills_every_100ms_fail_no_check_in_the_module() {
    let _serial = one_at_a_time().await;
    no_check_fails_under_kills(&RedisServer::start_with_module(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kills_every_100ms_fail_no_check_on_lua() {
    let _serial = one_at_a_time().await;
    no_check_fails_under_kills(&RedisServer::start(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kills_every_100ms_fail_no_check_on_valkey() {
    let _serial = one_at_a_time().await;
    no_check_fails_under_kills(&RedisServer::start_valkey(), false).await;
    no_check_fails_under_kills(&RedisServer::start_valkey_with_module(), true).await;
}

/// What a metered, concurrency-limited gateway does per request, `BACK_TO_BACK` times
/// from 64 tasks while every connection is cut every 100 ms: a check holding a slot of
/// `4 concurrent`, a settle of its estimate of 2 to an actual of 0 to 4, and a release.
/// Afterwards every slot is free (no release lost: a lost one holds its slot for its
/// minute), and each key's count is exactly what its admitted requests settled to (no
/// settle lost or applied twice, no unit charged twice); no operation failed.
/// `detached`: each release is handed to the store (as the tower layer hands them over)
/// and `flush` waits for them before the tally.
async fn gateway_under_kills(server: &RedisServer, module: bool, detached: bool) {
    const TASKS: u64 = 64;
    const ESTIMATE: u64 = 2;
    let rules: RuleSet = format!("{LIMIT}/h fixed-window; 4 concurrent timeout=60s")
        .parse()
        .unwrap();
    let store = store_on(&server.url()).await;
    assert_eq!(store.uses_module(), module);
    let port = server.port();
    let done = Arc::new(AtomicBool::new(false));
    let killer = kill_every_100ms(port, done.clone());
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(async move {
                // Per key: units settled; the operations that failed (a timed-out one
                // leaves its key's count unknown: the key is left out of the tally).
                let mut settled: HashMap<usize, u64> = HashMap::new();
                let mut failures = Vec::new();
                let mut unsure = std::collections::HashSet::new();
                let mut refused = 0u64;
                let mut fail = |k: usize, what: &str, e: RedisStoreError| {
                    if timed_out(&e) {
                        unsure.insert(k);
                    } else {
                        failures.push(format!("{what}: {e}"));
                    }
                };
                for i in 0..BACK_TO_BACK / TASKS {
                    let k = ((t * 7 + i) % KEYS as u64) as usize;
                    let at = store.now_us();
                    let d = match store.check(&key(k), &rules, ESTIMATE).await {
                        Ok(d) => d,
                        Err(e) => {
                            fail(k, "check", e);
                            continue;
                        }
                    };
                    if !d.is_allowed() {
                        // All 4 slots of the key in use: nothing charged.
                        refused += 1;
                        continue;
                    }
                    let actual = (t + i) % 5;
                    match store.settle(&key(k), &rules, ESTIMATE, actual, at).await {
                        Ok(_) => *settled.entry(k).or_default() += actual,
                        Err(e) => fail(k, "settle", e),
                    }
                    let slot = d.slot().expect("a slot");
                    if detached {
                        assert!(store.release_detached(&key(k), &rules, slot));
                    } else if let Err(e) = store.release(&key(k), &rules, slot).await {
                        fail(k, "release", e);
                    }
                }
                (settled, failures, unsure, refused)
            })
        })
        .collect();
    let mut settled: HashMap<usize, u64> = HashMap::new();
    let mut failures = Vec::new();
    let mut unsure = std::collections::HashSet::new();
    let mut refused = 0;
    for task in tasks {
        let (s, f, u, r) = task.await.expect("no panic in a task");
        for (k, units) in s {
            *settled.entry(k).or_default() += units;
        }
        failures.extend(f);
        unsure.extend(u);
        refused += r;
    }
    if detached {
        // Under the kills still: resends and retries included.
        tokio::time::timeout(Duration::from_secs(20), store.flush())
            .await
            .expect("every release handed over answered or given up");
    }
    done.store(true, Ordering::Relaxed);
    let kills = killer.join().expect("killer");
    wait_connected(&store).await;
    assert!(kills >= 2, "only {kills} kills: the run was too short");
    assert!(
        failures.is_empty(),
        "{} operations failed under {kills} kills: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        unsure.len() * 4 <= KEYS,
        "operations on {} keys timed out: the machine is too loaded to tell",
        unsure.len()
    );
    for (k, units) in settled.iter().filter(|(k, _)| !unsure.contains(*k)) {
        let d = peek(&store, *k, &rules).await;
        let charged = LIMIT - d.rules()[0].remaining;
        assert_eq!(charged, *units, "key {k}: charged against settled");
        assert_eq!(d.rules()[1].remaining, 4, "key {k}: a slot is still held");
    }
    eprintln!(
        "{BACK_TO_BACK} requests (check, settle, release) under {kills} kills: 0 failed, \
         {refused} refused for want of a slot, {} keys with a timed-out call",
        unsure.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_under_client_kills_loses_no_settle_or_release() {
    let _serial = one_at_a_time().await;
    gateway_under_kills(&RedisServer::start(), false, false).await;
    gateway_under_kills(&RedisServer::start_with_module(), true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_under_client_kills_loses_no_release_handed_over() {
    let _serial = one_at_a_time().await;
    gateway_under_kills(&RedisServer::start(), false, true).await;
    gateway_under_kills(&RedisServer::start_with_module(), true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_under_client_kills_loses_no_settle_or_release_on_valkey() {
    let _serial = one_at_a_time().await;
    gateway_under_kills(&RedisServer::start_valkey(), false, false).await;
    gateway_under_kills(&RedisServer::start_valkey_with_module(), true, false).await;
}

/// A 3+3 Cluster fails a master over (`CLUSTER FAILOVER`) while 32 tasks check keys of
/// every slot back to back, on the module and on the Lua functions: never more admitted
/// than the limit per key, nothing charged twice, and at most 0.1 % of the checks
/// failed meanwhile (errors that prove nothing ran are sent again within the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_under_load_over_admits_nothing() {
    let _serial = one_at_a_time().await;
    failover_under_load(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_under_load_over_admits_nothing_on_lua() {
    let _serial = one_at_a_time().await;
    failover_under_load(true).await;
}

async fn failover_under_load(force_lua: bool) {
    const TASKS: usize = 32;
    const PER_KEY: u64 = 300;
    let cluster = RedisCluster::start_with_module_and_replicas();
    let store = RedisStore::builder()
        .prefix("failover")
        .clock(ManualClock::new(T0_US))
        .timeout(Duration::from_millis(500))
        .force_lua(force_lua)
        .build_cluster(cluster.urls()[..3].to_vec())
        .await
        .expect("store");
    wait_connected(&store).await;
    assert_eq!(store.uses_module(), !force_lua);
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
    let checks: u64 = tally.values().map(|(a, l)| a + l).sum();
    for (k, (admitted, lost)) in &tally {
        assert!(
            *admitted <= PER_KEY,
            "key {k}: {admitted} admitted over {PER_KEY}"
        );
        let d = peek(&store, *k, &rules).await;
        let charged = PER_KEY - d.rules()[0].remaining;
        assert!(
            *admitted <= charged && charged <= (admitted + lost).min(PER_KEY),
            "key {k}: {charged} charged, {admitted} admitted, {lost} failed"
        );
    }
    eprintln!("a failover under load: {failed} checks failed, {checks} admitted or failed");
    assert!(
        failed * 1000 <= checks.max(1000),
        "{failed} checks failed of {checks}"
    );
    drop(cluster);
}
