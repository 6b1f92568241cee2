//! Checks batched per node on a Redis Cluster: the checks that queue while a call is in
//! flight go to each node as one call, and a slot that moved since the store read the
//! slot map still decides every check exactly once.
//!
//! The tests run on a current-thread runtime: every spawned check queues before the
//! store's sending task runs, so the batches they form do not depend on timing.

mod common;

use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_redis::redis;
use ratelimit_redis::testing::RedisCluster;
use ratelimit_redis::RedisStore;

const CHECKS: usize = 300;

fn key(i: usize) -> Vec<u8> {
    // Keys over many slots of every node, a few of them hot.
    format!("client-{}", (i * 7) % 40 % (1 + i % 13)).into_bytes()
}

fn said(d: &ratelimit_core::Decision) -> (bool, Option<Duration>, Vec<u64>) {
    (
        d.is_allowed(),
        d.retry_after(),
        d.rules().iter().map(|r| r.remaining).collect(),
    )
}

/// The decision calls (FCALLs, and the module's check commands) the nodes served.
fn fcalls(cons: &mut [redis::Connection]) -> u64 {
    cons.iter_mut()
        .map(|con| {
            let stats = common::commandstats(con);
            [
                "fcall",
                "ratelimit.check",
                "ratelimit.check_state",
                "ratelimit.check_local",
                "ratelimit.check_local_states",
            ]
            .iter()
            .map(|name| stats.get(*name).map_or(0, |s| s.0))
            .sum::<u64>()
        })
        .sum()
}

/// Runs a round of concurrent checks on `redis` and the same checks one by one on
/// `memory`; asserts the decisions agree and returns the FCALLs the round took.
async fn round(
    redis: &RedisStore,
    memory: &MemoryStore<ManualClock>,
    rules: &RuleSet,
    cons: &mut [redis::Connection],
) -> u64 {
    let (calls, failed) = round_failing(redis, memory, rules, cons).await;
    assert_eq!(failed, Vec::<String>::new(), "checks failed");
    calls
}

/// As [`round`], where a check may fail (its slot is being migrated): a failed check
/// must have charged nothing, so `memory` skips it and later rounds still agree. Returns
/// the calls and the failures.
async fn round_failing(
    redis: &RedisStore,
    memory: &MemoryStore<ManualClock>,
    rules: &RuleSet,
    cons: &mut [redis::Connection],
) -> (u64, Vec<String>) {
    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    let tasks: Vec<_> = (0..CHECKS)
        .map(|i| {
            let (redis, rules) = (redis.clone(), rules.clone());
            tokio::spawn(async move { redis.check(&key(i), &rules, 1 + (i % 3) as u64).await })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let calls = fcalls(cons);
    let (mut decided, mut expected, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(d) => {
                decided.push(said(&d));
                let d = memory.check(&key(i), rules, 1 + (i % 3) as u64).await;
                expected.push(said(&d.unwrap()));
            }
            Err(e) => failed.push(format!("{}: {e}", String::from_utf8_lossy(&key(i)))),
        }
    }
    assert_eq!(decided, expected, "{rules}");
    (calls, failed)
}

/// The checks of a round one at a time, each a call of its own; asserts the decisions
/// agree with `memory`'s.
async fn lone_round(redis: &RedisStore, memory: &MemoryStore<ManualClock>, rules: &RuleSet) {
    for i in 0..CHECKS {
        let cost = 1 + (i % 3) as u64;
        let decided = redis.check(&key(i), rules, cost).await.unwrap();
        let expected = memory.check(&key(i), rules, cost).await.unwrap();
        assert_eq!(said(&decided), said(&expected), "check {i}");
    }
}

/// Requires that masters 0 and 2 decided with the module only and master 1 with Lua only
/// since the stats were reset.
fn each_master_on_its_path(cons: &mut [redis::Connection]) {
    for (i, con) in cons.iter_mut().enumerate() {
        let stats = common::commandstats(con);
        let count = |names: &[&str]| {
            names
                .iter()
                .map(|name| stats.get(*name).map_or(0, |s| s.0))
                .sum::<u64>()
        };
        let lua = count(&["fcall", "evalsha", "eval"]);
        let module = count(&[
            "ratelimit.check",
            "ratelimit.check_state",
            "ratelimit.check_local",
            "ratelimit.check_local_states",
        ]);
        if i == 1 {
            assert!(
                lua > 0 && module == 0,
                "master {i}: {lua} Lua, {module} module"
            );
        } else {
            assert!(
                lua == 0 && module > 0,
                "master {i}: {lua} Lua, {module} module"
            );
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_checks_go_one_call_per_node_and_decide_as_the_memory_store() {
    let cluster = RedisCluster::start();
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    for rules in [
        "20/s gcra burst=40; 100/min fixed-window",
        "30/min sliding-log; 45/h sliding-log",
    ] {
        let rules: RuleSet = rules.parse().unwrap();
        let clock = ManualClock::new(T0_US);
        let (redis, memory) = common::cluster_stores(&cluster, &clock, "cb").await;
        for _ in 0..3 {
            let calls = round(&redis, &memory, &rules, &mut cons).await;
            assert!(
                calls < CHECKS as u64 / 10,
                "{rules}: {calls} calls for {CHECKS} checks: not batched per node"
            );
            clock.advance(Duration::from_millis(700));
        }
    }
}

fn cmd<T: redis::FromRedisValue>(con: &mut redis::Connection, args: &[&str]) -> T {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query(con)
        .unwrap_or_else(|e| panic!("{}: {e}", args.join(" ")))
}

#[tokio::test(flavor = "current_thread")]
async fn a_slot_moved_since_the_map_was_read_still_decides_each_check_once() {
    slot_moved_since_the_map_was_read(RedisCluster::start(), Path::Lua, false).await;
}

/// The same on Valkey, whose slot migration and redirections are its own code.
#[tokio::test(flavor = "current_thread")]
async fn a_slot_moved_on_valkey_still_decides_each_check_once() {
    slot_moved_since_the_map_was_read(RedisCluster::start_valkey(), Path::Lua, false).await;
}

/// The same in the native module: its `RATELIMIT.CHECK_LOCAL` answers the moved checks
/// `RLMOVED` untouched, and their resent `RATELIMIT.CHECK`, routed by the key with the
/// store's stale map, is redirected by the server to the node the slot moved to.
#[tokio::test(flavor = "current_thread")]
async fn a_slot_moved_under_the_module_still_decides_each_check_once() {
    slot_moved_since_the_map_was_read(RedisCluster::start_with_module(), Path::Module, false).await;
}

/// The same in the module on Valkey.
#[tokio::test(flavor = "current_thread")]
async fn a_slot_moved_under_the_module_on_valkey_still_decides_each_check_once() {
    slot_moved_since_the_map_was_read(
        RedisCluster::start_valkey_with_module(),
        Path::Module,
        false,
    )
    .await;
}

/// The same in the module, with checks sent while the slot is migrating (`MIGRATING` on
/// the first node and `IMPORTING` on the second), before and after its keys moved.
#[tokio::test(flavor = "current_thread")]
async fn checks_while_a_slot_migrates_under_the_module_are_decided_at_most_once() {
    slot_moved_since_the_map_was_read(RedisCluster::start_with_module(), Path::Module, true).await;
}

/// The same on Valkey.
#[tokio::test(flavor = "current_thread")]
async fn checks_while_a_slot_migrates_under_the_module_on_valkey_are_decided_at_most_once() {
    slot_moved_since_the_map_was_read(RedisCluster::start_valkey_with_module(), Path::Module, true)
        .await;
}

/// The calls of `command` each node refused (a redirection), from `INFO commandstats`.
fn rejected(con: &mut redis::Connection, command: &str) -> u64 {
    let info: String = cmd(con, &["INFO", "commandstats"]);
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:")))
        .and_then(|fields| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix("rejected_calls="))
        })
        .map_or(0, |n| n.parse().expect("rejected_calls"))
}

/// A round of checks while a slot is migrating: a check of that slot is refused by both
/// nodes until the move ends (its keys are not all on one node: the server answers ASK,
/// then TRYAGAIN: a block key rarely exists), so it may fail; one that fails must have
/// charged nothing, and every check that is decided agrees with the memory store. (The
/// store sends a check refused with ASK or TRYAGAIN again until the move ends, which
/// these rounds do not see: such a check fails by the store's timeout.)
async fn checks_while_migrating(
    redis: &RedisStore,
    memory: &MemoryStore<ManualClock>,
    rules: &RuleSet,
    clock: &ManualClock,
    cons: &mut [redis::Connection],
) {
    clock.advance(Duration::from_millis(700));
    let (_, failed) = round_failing(redis, memory, rules, cons).await;
    for failure in &failed {
        assert!(
            failure.contains("did not answer") || failure.contains("TRYAGAIN"),
            "{failure}"
        );
    }
}

/// A Cluster in the middle of the module's rollout (masters 0 and 2 have it, master 1
/// does not) where a slot moves from master 0 to master 1: its checks go to Lua on
/// master 1, and everything else stays on the module.
#[tokio::test(flavor = "current_thread")]
async fn a_slot_moved_to_a_master_without_the_module_leaves_the_rest_on_it() {
    slot_moved_since_the_map_was_read(
        RedisCluster::start_with_module_on([true, false, true]),
        Path::Mixed,
        false,
    )
    .await;
}

/// A Cluster whose masters all have the module, one of which loses it (unloaded, as a
/// restart without it would leave it): that master's checks go to Lua and the others'
/// stay on the module, without the store reconnecting.
#[tokio::test(flavor = "current_thread")]
async fn a_master_that_loses_the_module_goes_to_lua_alone() {
    let module = ratelimit_redis::testing::module_file();
    let cluster = RedisCluster::try_start_kind_with(
        ratelimit_redis::testing::ServerKind::Redis,
        &[
            "--loadmodule",
            &module.to_string_lossy(),
            "--enable-module-command",
            "yes",
        ],
    )
    .expect("a Cluster with the module");
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let rules: RuleSet = "20/s gcra burst=40; 100/min fixed-window".parse().unwrap();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "lost").await;
    assert!(redis.uses_module());
    round(&redis, &memory, &rules, &mut cons).await;
    let _: () = cmd(&mut cons[1], &["MODULE", "UNLOAD", "ratelimit"]);
    // Checks one at a time, then batched: each meets master 1 without the module.
    clock.advance(Duration::from_millis(700));
    lone_round(&redis, &memory, &rules).await;
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory, &rules, &mut cons).await;
    // From then on, each master on its own path.
    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    clock.advance(Duration::from_millis(700));
    lone_round(&redis, &memory, &rules).await;
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory, &rules, &mut cons).await;
    each_master_on_its_path(&mut cons);
    assert!(!redis.uses_module(), "not every master has the module");
}

/// The node batches the masters took in compact form (`RATELIMIT.CHECK_LOCAL_STATES`)
/// and in the older form (`RATELIMIT.CHECK_LOCAL`), since the stats were reset.
fn batch_forms(cons: &mut [redis::Connection]) -> (u64, u64) {
    cons.iter_mut().fold((0, 0), |(compact, older), con| {
        let stats = common::commandstats(con);
        let count = |command: &str| stats.get(command).map_or(0, |s| s.0);
        (
            compact + count("ratelimit.check_local_states"),
            older + count("ratelimit.check_local"),
        )
    })
}

/// A Cluster amid a rollout of the module's versions: master 0's module is of the
/// protocol before the compact form. The store sends every master the older form (the
/// compact one only where every module master has it) and decides as the memory store.
#[tokio::test(flavor = "current_thread")]
async fn masters_of_two_module_versions_get_the_older_batches() {
    let cluster = RedisCluster::start_with_module_protocols([0, 1, 1]);
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let rules: RuleSet = "20/s gcra burst=40; 100/min fixed-window".parse().unwrap();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "versions").await;
    assert!(redis.uses_module());
    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    for _ in 0..3 {
        clock.advance(Duration::from_millis(700));
        round(&redis, &memory, &rules, &mut cons).await;
    }
    let (compact, older) = batch_forms(&mut cons);
    assert_eq!(compact, 0, "compact batches beside a module without them");
    assert!(older > 0, "no batch");
    for con in cons.iter_mut() {
        let stats = common::commandstats(con);
        assert_eq!(stats.get("fcall"), None, "a check went through Lua");
        assert!(
            stats.contains_key("ratelimit.check_local"),
            "every master took batches"
        );
    }
}

/// A master whose module is replaced by one of the protocol before the compact form
/// (a restart with an older version): its compact batches are answered as unknown and
/// resent in the older form, charged once; from then on every master gets the older
/// form, and nothing goes to Lua.
#[tokio::test(flavor = "current_thread")]
async fn a_master_whose_module_turns_older_gets_the_older_batches() {
    let module = ratelimit_redis::testing::module_file();
    let module = module.to_string_lossy();
    let cluster = RedisCluster::try_start_kind_with(
        ratelimit_redis::testing::ServerKind::Redis,
        &["--loadmodule", &module, "--enable-module-command", "yes"],
    )
    .expect("a Cluster with the module");
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let rules: RuleSet = "20/s gcra burst=40; 100/min fixed-window".parse().unwrap();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "older").await;
    round(&redis, &memory, &rules, &mut cons).await;
    let (compact, older) = batch_forms(&mut cons);
    assert!(
        compact > 0 && older == 0,
        "{compact} compact, {older} older"
    );
    let _: () = cmd(&mut cons[1], &["MODULE", "UNLOAD", "ratelimit"]);
    let _: () = cmd(&mut cons[1], &["MODULE", "LOAD", &module, "protocol", "0"]);
    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    // Decided as the memory store decides: the batch master 1 refused was charged once.
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory, &rules, &mut cons).await;
    // Master 1 refused its compact batch (an unknown command, counted in no
    // commandstat) and took it in the older form.
    let stats = common::commandstats(&mut cons[1]);
    assert!(stats.contains_key("ratelimit.check_local"), "{stats:?}");
    assert_eq!(stats.get("ratelimit.check_local_states"), None);
    for con in cons.iter_mut() {
        common::reset_stats(con);
    }
    clock.advance(Duration::from_millis(700));
    round(&redis, &memory, &rules, &mut cons).await;
    let (compact, older) = batch_forms(&mut cons);
    assert!(
        compact == 0 && older > 0,
        "{compact} compact, {older} older"
    );
    for con in cons.iter_mut() {
        let stats = common::commandstats(con);
        assert_eq!(stats.get("fcall"), None, "a check went through Lua");
    }
    assert!(redis.uses_module());
}

/// Where a Cluster's checks are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// No master has the module.
    Lua,
    /// Every master has it.
    Module,
    /// Masters 0 and 2 have it, master 1 does not.
    Mixed,
}

async fn slot_moved_since_the_map_was_read(cluster: RedisCluster, path: Path, during: bool) {
    let module = path == Path::Module;
    let urls = cluster.urls();
    let mut cons: Vec<_> = urls.iter().map(|u| common::conn(u)).collect();
    let rules: RuleSet = "20/s gcra burst=40; 100/min fixed-window".parse().unwrap();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "cb").await;
    assert_eq!(redis.uses_module(), module);
    round(&redis, &memory, &rules, &mut cons).await;

    // Move the slot of a client key the first node holds to the second node, behind the
    // store's back: its slot map (and the connection's) is stale now.
    let names: Vec<String> = cmd(&mut cons[0], &["KEYS", "cb*"]);
    let slot: i64 = cmd(&mut cons[0], &["CLUSTER", "KEYSLOT", &names[0]]);
    let slot = slot.to_string();
    let source: String = cmd(&mut cons[0], &["CLUSTER", "MYID"]);
    let target: String = cmd(&mut cons[1], &["CLUSTER", "MYID"]);
    let _: () = cmd(
        &mut cons[1],
        &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source],
    );
    let _: () = cmd(
        &mut cons[0],
        &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target],
    );
    let moving: Vec<String> = cmd(&mut cons[0], &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
    if during {
        checks_while_migrating(&redis, &memory, &rules, &clock, &mut cons).await;
    }
    let port = cluster.nodes()[1].port().to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(moving.iter().map(String::as_str));
    let _: () = cmd(&mut cons[0], &migrate);
    if during {
        checks_while_migrating(&redis, &memory, &rules, &clock, &mut cons).await;
    }
    for con in cons.iter_mut() {
        let _: () = cmd(con, &["CLUSTER", "SETSLOT", &slot, "NODE", &target]);
    }
    assert!(!moving.is_empty());

    if path == Path::Mixed {
        // One check at a time first: a moved check is refused by master 0 and followed
        // to master 1, which has no module; the others must stay on it all the same.
        for con in cons.iter_mut() {
            common::reset_stats(con);
        }
        clock.advance(Duration::from_millis(700));
        lone_round(&redis, &memory, &rules).await;
        each_master_on_its_path(&mut cons);
    }
    for i in 0..3 {
        clock.advance(Duration::from_millis(700));
        let calls = round(&redis, &memory, &rules, &mut cons).await;
        assert!(calls < CHECKS as u64 / 5, "{calls} calls: not batched");
        if i == 0 && module && !during {
            // The first round after the move resent the moved checks alone, by key, to
            // the node the store's stale map named: the server redirected them.
            let moved = rejected(&mut cons[0], "ratelimit.check_state");
            assert!(moved > 0, "no RATELIMIT.CHECK_STATE was redirected");
        }
    }
    if module {
        assert!(redis.uses_module());
        for con in cons.iter_mut() {
            let stats = common::commandstats(con);
            assert_eq!(stats.get("fcall"), None, "a check went through Lua");
        }
        // Every master's module takes the compact form: no batch went in the older one.
        assert_eq!(batch_forms(&mut cons).1, 0, "a batch in the older form");
    }
    if path == Path::Mixed {
        each_master_on_its_path(&mut cons);
    }
    for name in &moving {
        let on_target: bool = cmd(&mut cons[1], &["EXISTS", name]);
        assert!(on_target, "{name} stays on the node it moved to");
    }
}

/// A check whose slot is moving between two nodes (its keys already moved, the move not
/// yet ended) is refused by both (`ASK`, then `TRYAGAIN`: its block marker is on neither
/// side) and ran nowhere: the store sends it again until the move ends, within its
/// timeout, and it is decided once, as the memory store decides it.
#[tokio::test(flavor = "current_thread")]
async fn a_check_that_meets_a_moving_slot_is_decided_once_the_move_ends() {
    let cluster = RedisCluster::start();
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let rules: RuleSet = "3/s gcra burst=3".parse().unwrap();
    let clock = ManualClock::new(T0_US);
    let (redis, memory) = common::cluster_stores(&cluster, &clock, "mv").await;
    for _ in 0..2 {
        let (r, m) = (
            redis.check(b"k", &rules, 1).await,
            memory.check(b"k", &rules, 1).await,
        );
        assert_eq!(r.unwrap(), m.unwrap());
    }
    // The node holding the key's state, and another.
    let from = (0..3)
        .find(|&i| !cmd::<Vec<String>>(&mut cons[i], &["KEYS", "mv*"]).is_empty())
        .expect("a node holds the state");
    let to = (from + 1) % 3;
    let names: Vec<String> = cmd(&mut cons[from], &["KEYS", "mv*"]);
    let slot: i64 = cmd(&mut cons[from], &["CLUSTER", "KEYSLOT", &names[0]]);
    let slot = slot.to_string();
    let source: String = cmd(&mut cons[from], &["CLUSTER", "MYID"]);
    let target: String = cmd(&mut cons[to], &["CLUSTER", "MYID"]);
    let _: () = cmd(
        &mut cons[to],
        &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source],
    );
    let _: () = cmd(
        &mut cons[from],
        &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target],
    );
    let port = cluster.nodes()[to].port().to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(names.iter().map(String::as_str));
    let _: () = cmd(&mut cons[from], &migrate);

    let check = tokio::spawn({
        let redis = redis.clone();
        let rules = rules.clone();
        async move { redis.check(b"k", &rules, 1).await }
    });
    // Let the check meet the move (it is refused, and waits) before the move ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!check.is_finished(), "the check waits for the move to end");
    for con in cons.iter_mut() {
        let _: () = cmd(con, &["CLUSTER", "SETSLOT", &slot, "NODE", &target]);
    }
    let decided = check.await.unwrap().expect("decided once the move ended");
    assert_eq!(decided, memory.check(b"k", &rules, 1).await.unwrap());
    // Decided once: the third unit of the burst is used, the fourth refused.
    assert!(decided.is_allowed());
    let (r, m) = (
        redis.check(b"k", &rules, 1).await,
        memory.check(b"k", &rules, 1).await,
    );
    let m = m.unwrap();
    assert_eq!(r.unwrap(), m);
    assert!(!m.is_allowed());
}
