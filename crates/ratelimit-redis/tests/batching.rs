//! Many checks in one Redis call: checks that queue while a call is in flight leave
//! together, each decided as atomically as alone, and one check's failure stays its own.
//!
//! The tests run on a current-thread runtime: every spawned check queues before the
//! store's sending task runs, so the batches they form do not depend on timing.

mod common;

use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_redis::redis;
use ratelimit_redis::testing::{check_script, check_script_args, wait_connected, RedisServer};
use ratelimit_redis::{RedisStore, RedisStoreError};

async fn store(server: &RedisServer, prefix: &str, clock: Option<ManualClock>) -> RedisStore {
    let builder = RedisStore::builder()
        .prefix(prefix)
        .pool_size(1)
        .timeout(Duration::from_secs(5));
    let builder = match clock {
        Some(clock) => builder.clock(clock),
        None => builder,
    };
    let store = builder.build(&server.url()).await.expect("store");
    wait_connected(&store).await;
    store
}

/// Batch calls and single calls since the last reset: FCALLs and scripts (a block's),
/// or on the module its single checks, compact batches and edits, refunds and blocks of
/// their own. On the module, requires that no batch went in the older form (the module
/// has the compact one).
fn calls(con: &mut redis::Connection, module: bool) -> u64 {
    let stats = common::commandstats(con);
    let count = |command: &str| stats.get(command).map_or(0, |s| s.0);
    if !module {
        return count("fcall") + count("evalsha") + count("eval");
    }
    assert_eq!(count("fcall"), 0, "a check went to Lua");
    assert_eq!(
        count("ratelimit.check_many"),
        0,
        "a batch in the older form"
    );
    let edits: u64 = [
        "ratelimit.give_back",
        "ratelimit.debit",
        "ratelimit.release",
        "ratelimit.renew",
        "ratelimit.refund",
        "ratelimit.block",
    ]
    .map(count)
    .iter()
    .sum();
    count("ratelimit.check")
        + count("ratelimit.check_state")
        + count("ratelimit.check_states")
        + edits
}

fn server(module: bool) -> RedisServer {
    if module {
        RedisServer::start_with_module()
    } else {
        RedisServer::start()
    }
}

/// What a decision says, to compare two stores'.
fn said(d: &ratelimit_core::Decision) -> (bool, Option<Duration>, Vec<u64>) {
    (
        d.is_allowed(),
        d.retry_after(),
        d.rules().iter().map(|r| r.remaining).collect(),
    )
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_checks_decide_as_the_memory_store_decides_them_one_by_one() {
    concurrent_checks_decide_as_alone(false).await;
}

/// The same on the module, whose batches go in its compact form: one argument per
/// check, the packed values once (each check's deadline beside its reference).
#[tokio::test(flavor = "current_thread")]
async fn module_batches_decide_as_the_memory_store_decides_them_one_by_one() {
    concurrent_checks_decide_as_alone(true).await;
}

async fn concurrent_checks_decide_as_alone(module: bool) {
    const CHECKS: usize = 300;
    // Most checks on one hot key, the others on a few more, mixed in every batch.
    fn key(i: usize) -> &'static [u8] {
        [&b"hot"[..], b"hot", b"hot", b"warm", b"hot", b"cool"][i % 6]
    }
    let server = server(module);
    let mut con = common::conn(&server.url());
    for rules in [
        "50/min sliding-window precision=1",
        "20/s gcra burst=40; 100/min fixed-window",
        "30/min sliding-log; 45/h sliding-log",
        "10/s token-bucket capacity=25; 60/min sliding-window precision=4",
    ] {
        let rules: RuleSet = rules.parse().unwrap();
        let clock = ManualClock::new(T0_US);
        let memory = MemoryStore::builder().clock(clock.clone()).build();
        let redis = store(&server, "one-key", Some(clock.clone())).await;
        for round in 0..3 {
            common::reset_stats(&mut con);
            let tasks: Vec<_> = (0..CHECKS)
                .map(|i| {
                    let (redis, rules) = (redis.clone(), rules.clone());
                    tokio::spawn(
                        async move { redis.check(key(i), &rules, 1 + (i % 3) as u64).await },
                    )
                })
                .collect();
            let mut decided = Vec::new();
            for task in tasks {
                decided.push(said(&task.await.unwrap().expect("check")));
            }
            let fcalls = calls(&mut con, module);
            assert!(
                fcalls < CHECKS as u64 / 10,
                "{rules}: {fcalls} calls for {CHECKS} checks: they were not batched"
            );
            // The same checks, in the order the batch decided them, one at a time.
            let mut expected = Vec::new();
            for i in 0..CHECKS {
                let d = memory.check(key(i), &rules, 1 + (i % 3) as u64).await;
                expected.push(said(&d.unwrap()));
            }
            let admitted = |all: &[(bool, _, _)]| all.iter().filter(|d| d.0).count();
            assert_eq!(
                admitted(&decided),
                admitted(&expected),
                "{rules}, round {round}: never more than alone"
            );
            assert_eq!(decided, expected, "{rules}, round {round}");
            clock.advance(Duration::from_millis(700));
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_failing_check_in_a_batch_does_not_fail_its_mates() {
    a_failing_check_does_not_fail_its_mates(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_failing_check_in_a_module_batch_does_not_fail_its_mates() {
    a_failing_check_does_not_fail_its_mates(true).await;
}

async fn a_failing_check_does_not_fail_its_mates(module: bool) {
    let server = server(module);
    let mut con = common::conn(&server.url());
    let store = store(&server, "mates", None).await;
    let deep: RuleSet = "10/s sliding-log; 10000/h sliding-log".parse().unwrap();
    for _ in 0..3 {
        assert!(store.check(b"bad", &deep, 1).await.unwrap().is_allowed());
    }
    // An entry deep in the log that this store did not write.
    let log = "mates:{k626164}:l";
    redis::cmd("RPUSH")
        .arg(log)
        .arg("yesterday")
        .exec(&mut con)
        .unwrap();
    common::reset_stats(&mut con);
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let (store, deep) = (store.clone(), deep.clone());
            tokio::spawn(async move {
                let key = if i == 10 {
                    b"bad".to_vec()
                } else {
                    format!("good-{i}").into_bytes()
                };
                store.check(&key, &deep, 1).await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let result = task.await.unwrap();
        if i == 10 && !module {
            assert!(
                matches!(&result, Err(RedisStoreError::WrongType(text)) if text.contains("RLSTATE")),
                "{result:?}"
            );
        } else if i == 10 {
            // The module reads a log holding an entry it did not write as no one's, as
            // any foreign value: empty, replaced by the check (which answers no error
            // after dropping it). Its failing checks are tests/bad_input.rs's panics.
            assert!(result.expect("the log replaced").is_allowed());
            let entries: Vec<String> = redis::cmd("LRANGE")
                .arg(log)
                .arg(0)
                .arg(-1)
                .query(&mut con)
                .unwrap();
            assert!(
                entries.iter().all(|e| e.parse::<u64>().is_ok()),
                "{entries:?}"
            );
        } else {
            assert!(result.expect("a mate of the failing check").is_allowed());
        }
    }
    // The first check found no call in flight and went alone; the 19 that queued
    // meanwhile went together.
    assert_eq!(
        calls(&mut con, module),
        2,
        "the 20 checks went in two calls"
    );
    // The failing check charged nothing and healed its key; its mates were charged.
    assert!(store.check(b"bad", &deep, 1).await.unwrap().is_allowed());
    let d = store.check(b"good-3", &deep, 1).await.unwrap();
    assert_eq!(d.rules()[1].remaining, 10_000 - 2);
}

#[tokio::test(flavor = "current_thread")]
async fn settles_and_releases_ride_the_checks_batches() {
    edits_ride_the_batches(false, false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn settles_and_releases_ride_the_module_checks_batches() {
    edits_ride_the_batches(true, false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn detached_settles_and_releases_ride_the_checks_batches() {
    edits_ride_the_batches(false, true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn detached_settles_and_releases_ride_the_module_checks_batches() {
    edits_ride_the_batches(true, true).await;
}

/// A metered gateway's operations: each task checks an estimate of 2 units under a
/// concurrency rule, then settles at its actual and releases its slot. The settles and
/// releases queue with the checks and leave in their calls, decided in order: the
/// state ends as if each had been a call of its own. `detached`: the settles and
/// releases are handed to the store (`settle_detached`, `release_detached`) and not
/// awaited; a check queued after them is decided after them.
async fn edits_ride_the_batches(module: bool, detached: bool) {
    const TASKS: usize = 64;
    let server = server(module);
    let mut con = common::conn(&server.url());
    let clock = ManualClock::new(T0_US);
    let store = store(&server, "edits", Some(clock.clone())).await;
    let rules: RuleSet = "1000/min fixed-window; 100/min sliding-log; 8 concurrent timeout=30s"
        .parse()
        .unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    common::reset_stats(&mut con);
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(async move {
                let key = [b"a", b"b"][i % 2];
                let at = store.now_us();
                let d = store.check(key, &rules, 2).await.expect("check");
                let actual = (i % 4) as u64;
                if d.is_allowed() {
                    let slot = d.slot().expect("a slot");
                    if detached {
                        assert!(store.settle_detached(key, &rules, 2, actual, at));
                        assert!(store.release_detached(key, &rules, slot));
                        return Some(actual);
                    }
                    let changed = store.settle(key, &rules, 2, actual, at).await;
                    assert_eq!(changed.expect("settle"), actual != 2);
                    assert!(store.release(key, &rules, slot).await.expect("release"));
                    Some(actual)
                } else {
                    None
                }
            })
        })
        .collect();
    let mut settled = [0u64; 2];
    let mut admitted = [0usize; 2];
    for (i, task) in tasks.into_iter().enumerate() {
        if let Some(actual) = task.await.unwrap() {
            settled[i % 2] += actual;
            admitted[i % 2] += 1;
        }
    }
    // The peeks below queue behind the last detached edits, and are answered after them.
    let peeks: Vec<_> = [b"a", b"b"]
        .map(|key| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(async move { store.check(key, &rules, 0).await.unwrap() })
        })
        .into_iter()
        .collect();
    let mut peeked = Vec::new();
    for peek in peeks {
        peeked.push(peek.await.unwrap());
    }
    let calls = calls(&mut con, module);
    let operations = TASKS + 2 * admitted.iter().sum::<usize>();
    assert!(
        calls <= 8,
        "{calls} calls for {operations} checks, settles and releases: the edits went alone"
    );
    // Every slot free again, every key charged exactly its actuals; a memory store given
    // the same operations one by one agrees.
    for (k, (key, peek)) in [b"a", b"b"].into_iter().zip(peeked).enumerate() {
        let remaining: Vec<u64> = peek.rules().iter().map(|r| r.remaining).collect();
        assert_eq!(remaining[0], 1000 - settled[k], "key {k}: {remaining:?}");
        assert_eq!(remaining[2], 8, "key {k}: every slot released");
        let mut slots = Vec::new();
        for i in (0..TASKS).filter(|i| i % 2 == k) {
            let at = memory.now_us();
            let d = memory.check(key, &rules, 2).await.unwrap();
            if d.is_allowed() {
                memory
                    .settle(key, &rules, 2, (i % 4) as u64, at)
                    .await
                    .unwrap();
                slots.push(d.slot().unwrap());
            }
        }
        for slot in slots {
            memory.release(key, &rules, slot).await.unwrap();
        }
        let expected: Vec<u64> = memory
            .check(key, &rules, 0)
            .await
            .unwrap()
            .rules()
            .iter()
            .map(|r| r.remaining)
            .collect();
        assert_eq!(remaining[..2], expected[..2], "key {k}");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_check_after_a_detached_release_is_decided_after_it() {
    check_after_detached_edits(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_check_after_a_detached_release_is_decided_after_it_on_the_module() {
    check_after_detached_edits(true).await;
}

/// A check made right after a release handed to the store (as the layer hands one
/// over when a response ends, and the client's next request follows at once) does not
/// overtake it, though no call is in flight and it could go alone at once: it finds the
/// slot free. The same for a settle's give-back.
async fn check_after_detached_edits(module: bool) {
    let server = server(module);
    let store = store(&server, "after", None).await;
    let rules: RuleSet = "2/min fixed-window; 1 concurrent timeout=30s"
        .parse()
        .unwrap();
    for round in 0..20 {
        let key = format!("k{round}");
        let at = store.now_us();
        let d = store.check(key.as_bytes(), &rules, 2).await.unwrap();
        assert!(d.is_allowed(), "round {round}: {d:?}");
        assert!(store.settle_detached(key.as_bytes(), &rules, 2, 1, at));
        assert!(store.release_detached(key.as_bytes(), &rules, d.slot().unwrap()));
        let next = store.check(key.as_bytes(), &rules, 1).await.unwrap();
        assert!(
            next.is_allowed(),
            "round {round}: the check overtook the detached settle or release: {next:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn flush_waits_for_every_detached_edit() {
    flushed_edits(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn flush_waits_for_every_detached_edit_on_the_module() {
    flushed_edits(true).await;
}

/// What a server shutting down does: the releases and settles handed to the store are
/// all in Redis once `flush` resolves, as another store (its own queue, which orders
/// nothing after them) reads them.
async fn flushed_edits(module: bool) {
    const KEYS: usize = 16;
    let server = server(module);
    let other = store(&server, "flush", None).await;
    let store = store(&server, "flush", None).await;
    let rules: RuleSet = "100/min fixed-window; 2 concurrent timeout=1h"
        .parse()
        .unwrap();
    let mut taken = Vec::new();
    for k in 0..KEYS {
        let key = format!("k{k}");
        let at = store.now_us();
        let d = store.check(key.as_bytes(), &rules, 5).await.unwrap();
        assert!(d.is_allowed());
        taken.push((key, at, d.slot().unwrap()));
    }
    for (key, at, slot) in &taken {
        assert!(store.settle_detached(key.as_bytes(), &rules, 5, 1, *at));
        assert!(store.release_detached(key.as_bytes(), &rules, *slot));
    }
    store.flush().await;
    for (key, _, _) in &taken {
        let peek = other.check(key.as_bytes(), &rules, 0).await.unwrap();
        let remaining: Vec<u64> = peek.rules().iter().map(|r| r.remaining).collect();
        assert_eq!(
            remaining,
            [99, 2],
            "{key}: the settle and the release reached Redis"
        );
    }
    // Nothing handed over: at once.
    tokio::time::timeout(Duration::from_secs(1), store.flush())
        .await
        .expect("a flush with nothing under way resolves at once");
}

#[tokio::test(flavor = "current_thread")]
async fn blocks_ride_the_checks_batches() {
    blocks_ride_the_batches(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn blocks_ride_the_module_checks_batches() {
    blocks_ride_the_batches(true).await;
}

/// An operator blocks 16 keys (half of them for good) while 48 checks of them queue: the
/// blocks leave in the checks' calls, each decided in its turn (a check queued after its
/// key's block is refused by it), and every key is blocked at the end.
async fn blocks_ride_the_batches(module: bool) {
    const KEYS: usize = 16;
    let server = server(module);
    let mut con = common::conn(&server.url());
    let store = store(&server, "blocks", Some(ManualClock::new(T0_US))).await;
    let rules: RuleSet = "1000/min".parse().unwrap();
    common::reset_stats(&mut con);
    let key = |i: usize| format!("blocked-{}", i % KEYS).into_bytes();
    let tasks: Vec<_> = (0..4 * KEYS)
        .map(|i| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(async move {
                if i < KEYS {
                    let length = (i % 2 == 0).then_some(Duration::from_secs(60));
                    store.block(&key(i), length).await.expect("block");
                    None
                } else {
                    Some(store.check(&key(i), &rules, 1).await.expect("check"))
                }
            })
        })
        .collect();
    for task in tasks {
        if let Some(d) = task.await.unwrap() {
            // Queued after every block: each is refused by its key's block.
            assert!(!d.is_allowed(), "a check after its key's block");
        }
    }
    let calls = calls(&mut con, module);
    assert!(
        calls <= 4,
        "{calls} calls for {KEYS} blocks and {} checks",
        3 * KEYS
    );
    for i in 0..KEYS {
        let d = store.check(&key(i), &rules, 1).await.unwrap();
        assert!(!d.is_allowed(), "key {i} is blocked");
        let retry = d.retry_after();
        if i % 2 == 0 {
            assert_eq!(retry, Some(Duration::from_secs(60)), "key {i}");
        } else {
            assert_eq!(retry, None, "key {i}: blocked for good");
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn lease_refunds_ride_the_checks_batches() {
    lease_refunds_ride_the_batches(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn lease_refunds_ride_the_module_checks_batches() {
    lease_refunds_ride_the_batches(true).await;
}

/// A lease store's refunds of 16 hot keys at the end of their leases leave together,
/// and each key gets back what its lease did not spend.
async fn lease_refunds_ride_the_batches(module: bool) {
    const KEYS: usize = 16;
    const LEASE: Duration = Duration::from_millis(100);
    let server = server(module);
    let mut con = common::conn(&server.url());
    let clock = ManualClock::new(T0_US);
    let leased = RedisStore::builder()
        .prefix("refunds")
        .timeout(Duration::from_secs(5))
        .clock(clock.clone())
        .lease(LEASE)
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&leased).await;
    let exact = store(&server, "refunds", Some(clock.clone())).await;
    let rules: RuleSet = "10/s token-bucket capacity=40; 1000/min fixed-window"
        .parse()
        .unwrap();
    let key = |i: usize| format!("hot-{i}").into_bytes();
    for i in 0..KEYS {
        // Seen 3 times: exact. The 4th reserves a block of 4 and spends 1.
        for _ in 0..4 {
            assert!(leased.check(&key(i), &rules, 1).await.unwrap().is_allowed());
        }
        let d = exact.check(&key(i), &rules, 0).await.unwrap();
        assert_eq!(
            d.rules()[0].remaining,
            33,
            "key {i}: the lease's block reserved"
        );
    }
    common::reset_stats(&mut con);
    clock.advance(LEASE);
    leased.sweep_leases().await;
    let calls = calls(&mut con, module);
    assert!(
        calls <= 4,
        "{calls} calls for {KEYS} refunds: they went alone"
    );
    for i in 0..KEYS {
        let d = exact.check(&key(i), &rules, 0).await.unwrap();
        let remaining: Vec<u64> = d.rules().iter().map(|r| r.remaining).collect();
        // The bucket: 33 left, 3 unspent given back, 1 refilled in the lease's 100 ms.
        // The window: the 3 exact checks and the spent unit.
        assert_eq!(
            remaining,
            [37, 996],
            "key {i}: the 3 unspent units given back"
        );
    }
}

/// The batch function itself: a check whose caller's deadline has passed is answered
/// "too late" and charged nothing, and the checks beside it are decided.
#[test]
fn a_deadline_passed_inside_a_batch_fails_only_that_check() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let script = check_script();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(script.library)
        .query(&mut con)
        .unwrap();
    let rules: RuleSet = "1/min fixed-window".parse().unwrap();
    let fresh = check_script_args(&rules, 1).remove(0);
    // The same values with a deadline (the header's 10th value) 1 µs after the epoch:
    // long past.
    let mut late = fresh.clone();
    late[72..80].copy_from_slice(&1.0f64.to_le_bytes());
    let run = |con: &mut redis::Connection, args: [&[u8]; 3]| -> Vec<f64> {
        let reply: Vec<u8> = redis::cmd("FCALL")
            .arg(script.batch_function)
            .arg(6)
            .arg(
                &[
                    "d:{a}:b", "d:{a}:s", "d:{b}:b", "d:{b}:s", "d:{c}:b", "d:{c}:s",
                ][..],
            )
            .arg(b"222")
            .arg(&args[..])
            .query(con)
            .unwrap();
        reply
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let reply = run(&mut con, [&fresh, &late, &fresh]);
    // a: admitted; b: too late, with the Redis time; c: admitted.
    assert_eq!(reply.len(), 6 + 2 + 6, "{reply:?}");
    assert_eq!(&reply[..3], &[0.0, 0.0, 1.0]);
    assert_eq!(reply[6], 3.0);
    assert!(reply[7] > 1.7e15, "Redis time in µs: {}", reply[7]);
    assert_eq!(&reply[8..11], &[0.0, 0.0, 1.0]);
    // b charged nothing: sent in time, its one unit is there; a's and c's are gone.
    let reply = run(&mut con, [&fresh, &fresh, &fresh]);
    assert_eq!(
        [reply[2], reply[8], reply[14]],
        [0.0, 1.0, 0.0],
        "allowed flags of a, b, c: {reply:?}"
    );
}
