//! The native module (crate `ratelimit-redis-module`) under what a store never sends and
//! what no test trace covers: malformed arguments, oversized keys, writes that must
//! reach a replica. Every case is an error for that check only or a decision; the server
//! stays up. (Its decisions are the conformance suite's, in tests/conformance.rs; foreign
//! values at its keys, in tests/faults.rs.)

mod common;

use std::time::Duration;

use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::redis::{self, Value};
use ratelimit_redis::testing::{
    check_script_args, module_file, wait_connected, RedisCluster, RedisServer, ServerKind,
};
use ratelimit_redis::RedisStore;

fn alive(server: &RedisServer) {
    let pong: String = redis::cmd("PING")
        .query(&mut common::conn(&server.url()))
        .expect("the server answers");
    assert_eq!(pong, "PONG");
}

/// A store on the server at `url` (under `prefix`, or the default one), connected, with a
/// timeout no test machine reaches.
async fn connected(url: &str, prefix: Option<&str>) -> RedisStore {
    let mut builder = RedisStore::builder().timeout(Duration::from_secs(5));
    if let Some(prefix) = prefix {
        builder = builder.prefix(prefix);
    }
    let store = builder.build(url).await.unwrap();
    wait_connected(&store).await;
    store
}

fn doubles(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn the_module_reports_its_version_and_state_format() {
    let server = RedisServer::start_with_module();
    let reply: Value = redis::cmd("RATELIMIT.VERSION")
        .query(&mut common::conn(&server.url()))
        .unwrap();
    let Value::Array(items) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(items.len(), 3);
    assert_eq!(
        items[1],
        Value::Int(ratelimit_core::packed::STATE_FORMAT as i64)
    );
    // The batch protocol: 5, the compact batches, calls decided once, debt, edits
    // decided once and edits in batches.
    assert_eq!(items[2], Value::Int(5));
}

/// Loaded with `protocol 0`, the module answers as the modules before the compact form:
/// `RATELIMIT.VERSION` of two elements, and no compact commands. An unknown load
/// argument refuses the load.
#[test]
fn a_module_loaded_with_protocol_0_is_one_before_the_compact_form() {
    let module = module_file();
    let server =
        RedisServer::start_with(&["--loadmodule", &module.to_string_lossy(), "protocol", "0"]);
    let mut con = common::conn(&server.url());
    let reply: Value = redis::cmd("RATELIMIT.VERSION").query(&mut con).unwrap();
    let Value::Array(items) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(items.len(), 2);
    for command in ["RATELIMIT.CHECK_STATES", "RATELIMIT.CHECK_LOCAL_STATES"] {
        let err = redis::cmd(command)
            .arg(0)
            .arg("")
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(
            err.to_string().contains("unknown command"),
            "{command}: {err}"
        );
    }
    // A server refusing the module aborts at startup: with no TCP port, nothing else
    // can go wrong with it.
    for args in [&["protocol", "5"][..], &["protocol"], &["compact", "0"]] {
        let mut server = std::process::Command::new(ServerKind::Redis.program().unwrap())
            .args(["--port", "0", "--save", "", "--loadmodule"])
            .arg(&module)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = server.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = server.kill();
                panic!("loaded with {args:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(!status.success(), "loaded with {args:?}");
    }
}

/// `refs` of a compact batch: per check, the index of its packed value and its deadline
/// (0: none).
fn refs(entries: &[(u8, u64)]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|&(i, deadline)| std::iter::once(i).chain(deadline.to_le_bytes()))
        .collect()
}

/// The entries of a batch reply of one-rule decisions.
fn entries(reply: &[u8]) -> Vec<Result<(f64, f64), String>> {
    let mut rest = reply;
    let mut all = Vec::new();
    while !rest.is_empty() {
        let (one, more) = entry(rest);
        all.push(one);
        rest = more;
    }
    all
}

/// The compact batches under what a store never sends: a state name the module cannot
/// derive the others from fails that check alone; `refs` of the wrong length or out of
/// range, and a wrong `numkeys`, fail the call before anything is read; a 64 KiB key is
/// decided; a value of another type at a state key is replaced as in the older form; a
/// panic fails its check alone. Nothing is charged twice or by a failed call.
#[test]
fn compact_batches_refuse_malformed_input_check_by_check() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "2/h gcra".parse().unwrap();
    let good = check_script_args(&rules, 1).remove(0);
    let states = |con: &mut redis::Connection, names: &[&str], refs: &[u8], packs: &[&[u8]]| {
        redis::cmd("RATELIMIT.CHECK_STATES")
            .arg(names.len())
            .arg(names)
            .arg(refs)
            .arg(packs)
            .query::<Vec<u8>>(con)
    };
    let many = |n: usize| refs(&vec![(0, 0); n]);
    let raw = |con: &mut redis::Connection, args: &[&[u8]]| {
        redis::cmd("RATELIMIT.CHECK_STATES")
            .arg(args)
            .query::<Vec<u8>>(con)
    };
    let reply = states(
        &mut con,
        &[
            "m:{a}:s",
            "m:{a}:x",
            "m:a}:s",
            "m:{}:s",
            "m:{a}:s",
            "m:{rlpanic}:s",
            "m:{a}",
        ],
        &many(7),
        &[&good],
    )
    .unwrap();
    let got = entries(&reply);
    assert_eq!(got.len(), 7, "{got:?}");
    assert_eq!(got[0], Ok((1.0, 1.0)));
    for bad in [1, 2, 3, 6] {
        let message = got[bad].as_ref().expect_err("a bad name");
        assert!(
            message.starts_with("RLARGS") && message.contains("}:s"),
            "{message}"
        );
    }
    // The same key again, after the first: charged once each.
    assert_eq!(got[4], Ok((1.0, 0.0)));
    let panicked = got[5].as_ref().expect_err("a panic");
    assert!(panicked.starts_with("RLPANIC"), "{panicked}");
    let keys: Vec<String> = redis::cmd("KEYS").arg("m:*").query(&mut con).unwrap();
    assert_eq!(keys, ["m:{a}:s"], "only the decided check wrote");

    // Malformed calls: refused whole, nothing read or charged.
    let call_errors: [(&str, Result<Vec<u8>, redis::RedisError>); 7] = [
        (
            "refs out of range",
            states(&mut con, &["m:{b}:s"], &refs(&[(1, 0)]), &[&good]),
        ),
        (
            "refs too short",
            states(&mut con, &["m:{b}:s"], &many(1)[..8], &[&good]),
        ),
        (
            "refs too long",
            states(&mut con, &["m:{b}:s", "m:{c}:s"], &many(3), &[&good]),
        ),
        (
            "no packed value",
            states(&mut con, &["m:{b}:s"], &many(1), &[]),
        ),
        (
            "numkeys past the arguments",
            raw(&mut con, &[b"5", b"m:{b}:s", &many(1), &good]),
        ),
        (
            "numkeys short of the names",
            raw(&mut con, &[b"1", b"m:{b}:s", b"m:{c}:s", &many(2), &good]),
        ),
        (
            "numkeys not a number",
            raw(&mut con, &[b"x", b"m:{b}:s", &many(1), &good]),
        ),
    ];
    for (what, reply) in call_errors {
        let err = reply.expect_err(what);
        assert!(err.to_string().contains("RLARGS"), "{what}: {err}");
    }
    for (what, args) in [
        (
            "refs out of range",
            vec![refs(&[(3, 0)]), good.clone(), b"m:{b}:s".to_vec()],
        ),
        (
            "refs of a check too many",
            vec![many(2), good.clone(), b"m:{b}:s".to_vec()],
        ),
        (
            "refs not whole",
            vec![many(1)[..5].to_vec(), good.clone(), b"m:{b}:s".to_vec()],
        ),
        ("no refs", vec![]),
    ] {
        let err = redis::cmd("RATELIMIT.CHECK_LOCAL_STATES")
            .arg(0)
            .arg(args)
            .query::<Vec<u8>>(&mut con)
            .expect_err(what);
        assert!(err.to_string().contains("RLARGS"), "{what}: {err}");
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("m:*").query(&mut con).unwrap();
    assert_eq!(keys, ["m:{a}:s"], "a refused call wrote nothing");

    // A 64 KiB state name: decided, its block marker's name derived from it.
    let long = format!("m:{{{}}}:s", "x".repeat(64 * 1024));
    for expect in [1.0, 1.0, 0.0] {
        let reply = states(&mut con, &[&long], &many(1), &[&good]).unwrap();
        assert_eq!(entries(&reply)[0].as_ref().map(|d| d.0), Ok(expect));
    }
    let blocked = format!("{}b", &long[..long.len() - 1]);
    redis::cmd("SET")
        .arg(&blocked)
        .arg("inf")
        .exec(&mut con)
        .unwrap();
    let reply = states(&mut con, &[&long], &many(1), &[&good]).unwrap();
    assert_eq!(
        f64::from_le_bytes(reply[..8].try_into().unwrap()),
        1.0,
        "blocked"
    );

    // Values of another type: at the state, replaced when the check commits; at the
    // block marker, read as no marker and left.
    redis::cmd("LPUSH")
        .arg("m:{f}:s")
        .arg("x")
        .exec(&mut con)
        .unwrap();
    redis::cmd("HSET")
        .arg("m:{f}:b")
        .arg("x")
        .arg("y")
        .exec(&mut con)
        .unwrap();
    let reply = states(&mut con, &["m:{f}:s"], &many(1), &[&good]).unwrap();
    assert_eq!(entries(&reply)[0], Ok((1.0, 1.0)));
    let kinds: Vec<String> = ["m:{f}:s", "m:{f}:b"]
        .iter()
        .map(|k| redis::cmd("TYPE").arg(k).query(&mut con).unwrap())
        .collect();
    assert_eq!(kinds, ["string", "hash"]);

    // Deadlines from `refs`, not from the packed value: a past one is answered late and
    // charges nothing, beside a check of the same packed value without one.
    let reply = states(
        &mut con,
        &["m:{d}:s", "m:{d}:s"],
        &refs(&[(0, 1), (0, 0)]),
        &[&good],
    )
    .unwrap();
    assert_eq!(
        f64::from_le_bytes(reply[..8].try_into().unwrap()),
        3.0,
        "too late"
    );
    assert_eq!(entries(&reply[16..])[0], Ok((1.0, 1.0)), "the first charge");
    alive(&server);
}

/// A settle above the estimate goes to `RATELIMIT.DEBIT` on a module of protocol 3, to
/// the Lua function on an older module (which keeps every other call), and to the Lua
/// function, charged once, when the module turns older under the store; a settle at
/// the estimate makes no call at all.
#[tokio::test(flavor = "current_thread")]
async fn settles_go_to_the_module_where_it_has_debit() {
    let module = module_file();
    let module = module.to_string_lossy().into_owned();
    let rules: RuleSet = "10/h gcra burst=10".parse().unwrap();
    let calls = |con: &mut redis::Connection| {
        let stats = common::commandstats(con);
        [
            "ratelimit.debit",
            "ratelimit.give_back",
            "fcall",
            "ratelimit.check_state",
        ]
        .map(|c| stats.get(c).map_or(0, |s| s.0))
    };
    // An injected clock: a charge's time is then exact (a store's reading of the Redis
    // clock may lag the server's, which a refund counts as drained).
    let clock = ratelimit_core::ManualClock::new(ratelimit_core::testing::T0_US);
    let store_on = |url: String| {
        let clock = clock.clone();
        async move {
            let store = RedisStore::builder()
                .clock(clock)
                .timeout(Duration::from_secs(5))
                .build(&url)
                .await
                .unwrap();
            wait_connected(&store).await;
            store
        }
    };
    let left = |store: &RedisStore, key: &'static [u8]| {
        let (store, rules) = (store.clone(), rules.clone());
        async move { store.check(key, &rules, 0).await.unwrap().rules()[0].remaining }
    };

    // Protocol 4: each settle that needs one is a command of its own. Protocol 5: a
    // settle is an edit the check commands carry (alone here: nothing else queued with
    // it). The second server stays for what follows.
    let mut last = None;
    for (load, expected, what) in [
        (
            &["--loadmodule", &module, "protocol", "4"][..],
            [1, 1, 0, 0],
            "one call per settle that needs one",
        ),
        (
            &["--loadmodule", &module, "--enable-module-command", "yes"][..],
            [0, 0, 0, 2],
            "settles in the check commands",
        ),
    ] {
        let server = RedisServer::start_with(load);
        let mut con = common::conn(&server.url());
        let store = store_on(server.url()).await;
        let at = store.now_us();
        assert!(store.check(b"k", &rules, 2).await.unwrap().is_allowed());
        common::reset_stats(&mut con);
        assert!(!store.settle(b"k", &rules, 2, 2, at).await.unwrap());
        assert!(store.settle(b"k", &rules, 2, 5, at).await.unwrap());
        assert!(store.settle(b"k", &rules, 2, 1, at).await.unwrap());
        assert_eq!(calls(&mut con), expected, "{what}");
        assert_eq!(left(&store, b"k").await, 6);
        last = Some((server, con, store, at));
    }
    let (_server, mut con, store, at) = last.expect("two servers");

    // Loaded again of protocol 2: the store, told protocol 5 at its connection, finds
    // its edit refused (nothing written) and sends it as a command of its own; DEBIT is
    // unknown too, so it goes to Lua, and the module keeps the checks.
    for args in [
        &["UNLOAD", "ratelimit"][..],
        &["LOAD", &module, "protocol", "2"],
    ] {
        redis::cmd("MODULE").arg(args).exec(&mut con).unwrap();
    }
    common::reset_stats(&mut con);
    assert!(store.settle(b"k", &rules, 0, 2, at).await.unwrap());
    assert_eq!(left(&store, b"k").await, 4, "charged once");
    assert!(store.settle(b"k", &rules, 0, 1, at).await.unwrap());
    let [debit, _, fcall, checks] = calls(&mut con);
    assert_eq!(debit, 0);
    assert!(checks >= 1, "the checks stay on the module");
    assert!(fcall >= 2, "{fcall} function calls");
    assert!(store.uses_module());
    assert_eq!(left(&store, b"k").await, 3);

    // A store that connects to a module of protocol 2 sends debt to Lua from the start.
    let old = RedisServer::start_with(&["--loadmodule", &module, "protocol", "2"]);
    let mut con = common::conn(&old.url());
    let store = store_on(old.url()).await;
    assert!(store.uses_module());
    let at = store.now_us();
    assert!(store.settle(b"k", &rules, 0, 3, at).await.unwrap());
    assert_eq!(left(&store, b"k").await, 7);
    assert_eq!(calls(&mut con)[0], 0);
}

/// A store on a module without the compact form (loaded with `protocol 0`) sends its
/// batches in the older form, and one whose module turns older under it (unloaded,
/// loaded again of protocol 0) resends the refused compact batch in the older form,
/// charged once; a batch whose server lost the module goes on to Lua.
#[tokio::test(flavor = "current_thread")]
async fn stores_fall_back_to_the_older_batches() {
    let module = module_file();
    let module = module.to_string_lossy().into_owned();
    let rules: RuleSet = "10/h gcra burst=10".parse().unwrap();
    let batch = |store: &RedisStore, key: &'static [u8], n: usize| {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (store, rules) = (store.clone(), rules.clone());
                tokio::spawn(async move { store.check(key, &rules, 1).await })
            })
            .collect();
        async move {
            let mut remaining = Vec::new();
            for task in tasks {
                remaining.push(task.await.unwrap().expect("check").rules()[0].remaining);
            }
            remaining.sort_unstable();
            remaining
        }
    };
    let stats = |con: &mut redis::Connection| {
        let stats = common::commandstats(con);
        ["ratelimit.check_states", "ratelimit.check_many", "fcall"]
            .map(|c| stats.get(c).map_or(0, |s| s.0))
    };
    let store_on = |url: String| async move {
        let store = RedisStore::builder()
            .pool_size(1)
            .timeout(Duration::from_secs(5))
            .build(&url)
            .await
            .unwrap();
        wait_connected(&store).await;
        store
    };

    let old = RedisServer::start_with(&["--loadmodule", &module, "protocol", "0"]);
    let mut con = common::conn(&old.url());
    let store = store_on(old.url()).await;
    assert!(store.uses_module());
    assert_eq!(batch(&store, b"a", 5).await, [5, 6, 7, 8, 9]);
    let [compact, older, lua] = stats(&mut con);
    assert_eq!((compact, lua), (0, 0));
    assert_eq!(
        older, 1,
        "the 4 checks queued behind the first went as one batch"
    );

    let server =
        RedisServer::start_with(&["--loadmodule", &module, "--enable-module-command", "yes"]);
    let mut con = common::conn(&server.url());
    let store = store_on(server.url()).await;
    assert_eq!(batch(&store, b"a", 3).await, [7, 8, 9]);
    assert_eq!(stats(&mut con), [1, 0, 0]);
    redis::cmd("MODULE")
        .arg("UNLOAD")
        .arg("ratelimit")
        .exec(&mut con)
        .unwrap();
    redis::cmd("MODULE")
        .arg("LOAD")
        .arg(&module)
        .arg("protocol")
        .arg("0")
        .exec(&mut con)
        .unwrap();
    common::reset_stats(&mut con);
    assert_eq!(batch(&store, b"a", 3).await, [4, 5, 6], "charged once");
    assert_eq!(stats(&mut con), [0, 1, 0]);
    assert!(store.uses_module());
    // The module gone: the older form is refused too, and Lua decides.
    redis::cmd("MODULE")
        .arg("UNLOAD")
        .arg("ratelimit")
        .exec(&mut con)
        .unwrap();
    common::reset_stats(&mut con);
    assert_eq!(batch(&store, b"a", 3).await, [1, 2, 3], "charged once");
    // The module served every call, so the function library was never loaded: the
    // first check finds its function missing, loads the library and goes again.
    assert_eq!(
        stats(&mut con)[2],
        3,
        "the first check alone, again after loading the library, then the batch"
    );
    assert!(!store.uses_module());
}

/// Arguments no store sends: each answered with an error that names the problem (in a
/// batch, that check's failure entry beside the others' decisions).
#[test]
fn malformed_arguments_are_errors_not_crashes() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let good = check_script_args(&rules, 1).remove(0);
    let mut bad_code = good.clone();
    bad_code[80..88].copy_from_slice(&99f64.to_le_bytes());
    let mut huge_cost = good.clone();
    huge_cost[16..24].copy_from_slice(&1e15f64.to_le_bytes());
    let mut nan = good.clone();
    nan[8..16].copy_from_slice(&f64::NAN.to_le_bytes());
    let mut negative_limit = good.clone();
    negative_limit[88..96].copy_from_slice(&(-3f64).to_le_bytes());
    let mut many_rules = good.clone();
    many_rules[32..40].copy_from_slice(&1e9f64.to_le_bytes());
    for (what, packed) in [
        ("empty", Vec::new()),
        ("truncated", good[..good.len() - 8].to_vec()),
        ("unknown code", bad_code),
        ("cost above capacity", huge_cost),
        ("not an integer", nan),
        ("negative limit", negative_limit),
        ("rule count", many_rules),
        ("text", b"hello world!".to_vec()),
        ("header only", doubles(&[0.0; 10])),
    ] {
        let err = redis::cmd("RATELIMIT.CHECK")
            .arg("m:{k}:b")
            .arg("m:{k}:s")
            .arg(&packed[..])
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{what}: {err}");
    }
    // Arity: too few, too many.
    for args in [vec!["a"], vec!["a", "b", "c", "d", "e"]] {
        let err = redis::cmd("RATELIMIT.CHECK")
            .arg(&args)
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{err}");
    }
    // In a batch the bad check fails alone.
    let reply: Vec<u8> = redis::cmd("RATELIMIT.CHECK_MANY")
        .arg(4)
        .arg(&["m:{a}:b", "m:{a}:s", "m:{b}:b", "m:{b}:s"])
        .arg("22")
        .arg(&b"junk"[..])
        .arg(&good[..])
        .query(&mut con)
        .unwrap();
    assert_eq!(f64::from_le_bytes(reply[..8].try_into().unwrap()), -1.0);
    let n = f64::from_le_bytes(reply[8..16].try_into().unwrap()) as usize;
    assert!(String::from_utf8_lossy(&reply[16..16 + n]).contains("RLARGS"));
    let second = &reply[16 + n..];
    assert_eq!(second.len(), 16 + 32, "a decision of one rule follows");
    assert_eq!(f64::from_le_bytes(second[16..24].try_into().unwrap()), 1.0);
    // Key counts that do not add up.
    for (counts, keys) in [("2", 3), ("9", 2), ("22", 2)] {
        let err = redis::cmd("RATELIMIT.CHECK_MANY")
            .arg(keys)
            .arg(vec!["k"; keys])
            .arg(counts)
            .arg(&good[..])
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{counts}: {err}");
    }
    alive(&server);
}

/// A 64 KiB key name and client key: decided like any other.
#[tokio::test]
async fn sixty_four_kib_keys_are_decided() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    // No window edge to cross on the server's clock: a burst of 2, one more per 30 min.
    let rules: RuleSet = "2/h gcra".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let long = format!("m:{{{}}}", "x".repeat(64 * 1024));
    for expect in [1.0, 1.0, 0.0] {
        let reply: Vec<u8> = redis::cmd("RATELIMIT.CHECK")
            .arg(format!("{long}:b"))
            .arg(format!("{long}:s"))
            .arg(&packed[..])
            .query(&mut con)
            .unwrap();
        assert_eq!(
            f64::from_le_bytes(reply[16..24].try_into().unwrap()),
            expect
        );
    }
    let store = connected(&server.url(), None).await;
    assert!(store.uses_module());
    let client = vec![b'y'; 64 * 1024];
    assert!(store.check(&client, &rules, 1).await.unwrap().is_allowed());
    assert!(store.check(&client, &rules, 1).await.unwrap().is_allowed());
    assert!(!store.check(&client, &rules, 1).await.unwrap().is_allowed());
    alive(&server);
}

/// The module's writes reach a replica as their effects: the replica holds the
/// primary's state, byte for byte, with an expiry, and a store on it (after a failover)
/// goes on from where the primary was.
#[tokio::test]
async fn a_replica_holds_what_the_primary_decided() {
    replica_holds_what_the_primary_decided(ServerKind::Redis, true, &[]).await;
}

/// The same on Valkey, whose replication of a module's effects is its own code.
#[tokio::test]
async fn a_valkey_replica_holds_what_the_primary_decided() {
    replica_holds_what_the_primary_decided(ServerKind::Valkey, true, &[]).await;
}

/// A replica without the module holds the same: the writes reach it as commands every
/// server runs, and a store on it after a failover goes on with the Lua functions.
#[tokio::test]
async fn a_replica_without_the_module_holds_what_the_primary_decided() {
    replica_holds_what_the_primary_decided(ServerKind::Redis, false, &[]).await;
    replica_holds_what_the_primary_decided(ServerKind::Valkey, false, &[]).await;
}

/// A primary whose `EVAL` is renamed away replicates each write as a `SET` of its own,
/// and its replica holds the same.
#[tokio::test]
async fn a_primary_without_eval_replicates_each_write() {
    let renamed = ["--rename-command", "EVAL", ""];
    replica_holds_what_the_primary_decided(ServerKind::Redis, false, &renamed).await;
}

/// Every key under `prefix` on `con`: its value (a list's items, or a string) and its
/// expiry in ms since the epoch.
fn dump_keys(con: &mut redis::Connection, prefix: &str) -> Vec<(String, Value, i64)> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(con)
        .unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(con).unwrap();
            let value = if kind == "list" {
                redis::cmd("LRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .query(con)
                    .unwrap()
            } else {
                redis::cmd("GET").arg(&key).query(con).unwrap()
            };
            let at: i64 = redis::cmd("PEXPIRETIME").arg(&key).query(con).unwrap();
            (key, value, at)
        })
        .collect()
}

/// What a store on a primary writes, through every kind of write the module makes: 64
/// keys checked at once (batches of many keys, a sliding log among their rules, a
/// denial), a block, a charge given back, slots taken and one freed.
async fn decide_some(store: &RedisStore) -> (RuleSet, RuleSet) {
    let rules: RuleSet = "5/min gcra burst=5; 3/min sliding-log".parse().unwrap();
    for _ in 0..3 {
        assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    }
    assert!(!store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    let many = (0..64).map(|i| {
        let (key, rules) = (format!("many-{}", i % 16), &rules);
        async move { store.check(key.as_bytes(), rules, 1).await.unwrap() }
    });
    let admitted = futures::future::join_all(many)
        .await
        .iter()
        .filter(|d| d.is_allowed())
        .count();
    assert_eq!(admitted, 16 * 3);
    store
        .block(b"b", Some(Duration::from_secs(600)))
        .await
        .unwrap();
    let refunded: RuleSet = "5/min token-bucket capacity=5".parse().unwrap();
    let charged_at = store.now_us();
    for _ in 0..3 {
        assert!(store.check(b"r", &refunded, 1).await.unwrap().is_allowed());
    }
    assert!(store.refund(b"r", &refunded, 2, charged_at).await.unwrap());
    // Slots taken and freed: the state grows and shrinks in place on the primary, and
    // the replica holds the same bytes.
    let slots: RuleSet = "10/min gcra burst=10; 3 concurrent timeout=60s"
        .parse()
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        let decision = store.check(b"c", &slots, 1).await.unwrap();
        held.push(decision.slot().expect("a slot"));
    }
    assert!(store.release(b"c", &slots, held[1]).await.unwrap());
    (rules, refunded)
}

async fn replica_holds_what_the_primary_decided(
    kind: ServerKind,
    replica_module: bool,
    primary_args: &[&str],
) {
    let module = module_file();
    let module = module.to_string_lossy();
    let mut args = vec!["--loadmodule", &module];
    args.extend(primary_args);
    let primary = RedisServer::start_kind_with(kind, &args);
    let port = primary.port().to_string();
    let mut replica_args = vec!["--replicaof", "127.0.0.1", &port];
    if replica_module {
        replica_args.extend(["--loadmodule", &module]);
    }
    let replica = RedisServer::start_kind_with(kind, &replica_args);
    // The replica has synced before the primary decides anything.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !replica
        .command("INFO replication")
        .unwrap_or_default()
        .contains("master_link_status:up")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica did not sync"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let store = connected(&primary.url(), Some("rep")).await;
    assert!(store.uses_module());
    let (rules, refunded) = decide_some(&store).await;
    let mut p = common::conn(&primary.url());
    let mut r = common::conn(&replica.url());
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut p).unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the writes");
    let on_primary = dump_keys(&mut p, "rep");
    // 5 keys of their own, 16 keys of the 64 checks, each a state and a log.
    assert_eq!(on_primary.len(), 5 + 16 * 2, "{on_primary:?}");
    for (key, value, at) in &on_primary {
        assert_ne!(*value, Value::Nil, "{key}");
        assert!(*at > 0, "{key} expires");
    }
    assert_eq!(on_primary, dump_keys(&mut r, "rep"));
    // Fail over: the replica becomes the primary, and the limit holds there.
    let _: Value = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut r)
        .unwrap();
    let promoted = connected(&replica.url(), Some("rep")).await;
    assert_eq!(promoted.uses_module(), replica_module);
    assert!(!promoted.check(b"k", &rules, 1).await.unwrap().is_allowed());
    assert!(!promoted
        .check(b"many-3", &rules, 1)
        .await
        .unwrap()
        .is_allowed());
    let blocked = promoted.check(b"b", &rules, 1).await.unwrap();
    assert_eq!(blocked.outcome(), ratelimit_core::Outcome::Blocked);
    // 3 charged, 2 given back: 4 of 5 left.
    let left = promoted.check(b"r", &refunded, 0).await.unwrap();
    assert_eq!(left.rules()[0].remaining, 4);
}

/// The AOF holds what the module wrote: a server that reloads its AOF holds the same
/// keys, values and expiries.
#[tokio::test]
async fn the_aof_holds_what_the_module_decided() {
    let module = module_file();
    let module = module.to_string_lossy();
    for kind in [ServerKind::Redis, ServerKind::Valkey] {
        let server = RedisServer::start_kind_with(
            kind,
            &[
                "--loadmodule",
                &module,
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--enable-debug-command",
                "yes",
            ],
        );
        let store = connected(&server.url(), Some("aof")).await;
        assert!(store.uses_module());
        decide_some(&store).await;
        let mut con = common::conn(&server.url());
        let before = dump_keys(&mut con, "aof");
        assert_eq!(before.len(), 5 + 16 * 2, "{before:?}");
        let _: Value = redis::cmd("DEBUG").arg("LOADAOF").query(&mut con).unwrap();
        assert_eq!(before, dump_keys(&mut con, "aof"), "{}", kind.name());
    }
}

/// A state cut short or grown by a few bytes (a partial write by hand, another tool):
/// the module reads it as the Lua functions do, as fresh, replaced on commit with a
/// state of the right length, and the two paths decide alike on it.
#[tokio::test]
async fn truncated_and_oversized_states_are_replaced_as_lua_replaces_them() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "3/min gcra burst=3; 5/h fixed-window".parse().unwrap();
    let mut decisions = Vec::new();
    for force_lua in [true, false] {
        let prefix = if force_lua { "lua" } else { "mod" };
        let store = RedisStore::builder()
            .prefix(prefix)
            .clock(ratelimit_core::ManualClock::new(
                ratelimit_core::testing::T0_US,
            ))
            .timeout(Duration::from_secs(5))
            .force_lua(force_lua)
            .build(&server.url())
            .await
            .unwrap();
        wait_connected(&store).await;
        assert_eq!(store.uses_module(), !force_lua);
        let state = format!("{prefix}:{{k6b}}:s");
        let mut seen = Vec::new();
        for edit in [
            |raw: &mut Vec<u8>| raw.truncate(raw.len() - 8),
            |raw: &mut Vec<u8>| raw.truncate(raw.len() - 3),
            |raw: &mut Vec<u8>| raw.extend_from_slice(&[0; 8]),
            |raw: &mut Vec<u8>| raw.truncate(12),
        ] {
            seen.push(store.check(b"k", &rules, 1).await.unwrap());
            let mut raw: Vec<u8> = redis::cmd("GET").arg(&state).query(&mut con).unwrap();
            let len = raw.len();
            edit(&mut raw);
            redis::cmd("SET")
                .arg(&state)
                .arg(raw)
                .exec(&mut con)
                .unwrap();
            seen.push(store.check(b"k", &rules, 1).await.unwrap());
            let healed: Vec<u8> = redis::cmd("GET").arg(&state).query(&mut con).unwrap();
            assert_eq!(
                healed.len(),
                len,
                "replaced with a state of the right length"
            );
        }
        decisions.push(seen);
    }
    assert_eq!(
        decisions[0], decisions[1],
        "Lua and the module decide alike"
    );
    alive(&server);
}

/// A server that loses the module (`MODULE UNLOAD`, a restart or a failover without it)
/// is answered by the Lua functions on the same keys: the check goes on, the state
/// carries, and the store stays on Lua until it reconnects.
#[tokio::test]
async fn a_server_that_loses_the_module_is_answered_by_lua() {
    let module = module_file();
    let server = RedisServer::start_with(&[
        "--loadmodule",
        &module.to_string_lossy(),
        "--enable-module-command",
        "yes",
    ]);
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .clock(ratelimit_core::ManualClock::new(
            ratelimit_core::testing::T0_US,
        ))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    assert!(store.uses_module());
    let rules: RuleSet = "3/min fixed-window".parse().unwrap();
    let first = store.check(b"k", &rules, 1).await.unwrap();
    assert_eq!(first.rules()[0].remaining, 2);
    let _: Value = redis::cmd("MODULE")
        .arg("UNLOAD")
        .arg("ratelimit")
        .query(&mut common::conn(&server.url()))
        .unwrap();
    let second = store.check(b"k", &rules, 1).await.unwrap();
    assert_eq!(
        second.rules()[0].remaining,
        1,
        "the module's state, read by Lua"
    );
    assert!(!store.uses_module());
    let third = store.check(b"k", &rules, 1).await.unwrap();
    assert_eq!(third.rules()[0].remaining, 0);
    assert!(!store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    alive(&server);
}

/// `RATELIMIT.CHECK_LOCAL` on a Cluster node decides the checks whose slot the node
/// serves and answers the others `RLMOVED` without touching them: a check on another
/// node's slot, and a check whose keys are in two slots.
#[test]
fn check_local_turns_away_keys_of_slots_the_node_does_not_serve() {
    let cluster = RedisCluster::start_with_module();
    let node = &cluster.nodes()[0];
    let mut con = common::conn(&node.url());
    // A hash tag this node serves and one it does not, as Redis itself answers them.
    let served = |con: &mut redis::Connection, tag: &str| {
        redis::cmd("EXISTS")
            .arg(format!("t:{{{tag}}}:s"))
            .query::<i64>(con)
            .is_ok()
    };
    let mine = (0..)
        .map(|i| i.to_string())
        .find(|t| served(&mut con, t))
        .unwrap();
    let theirs = (0..)
        .map(|i| i.to_string())
        .find(|t| !served(&mut con, t))
        .unwrap();
    let rules: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let key = |tag: &str, kind: &str| format!("t:{{{tag}}}:{kind}");
    let reply: Vec<u8> = redis::cmd("RATELIMIT.CHECK_LOCAL")
        .arg(0)
        .arg("222")
        .arg(&packed[..])
        .arg(&packed[..])
        .arg(&packed[..])
        .arg(key(&mine, "b"))
        .arg(key(&mine, "s"))
        .arg(key(&theirs, "b"))
        .arg(key(&theirs, "s"))
        .arg(key(&mine, "b"))
        .arg(key(&theirs, "s"))
        .query(&mut con)
        .unwrap();
    let value = |at: usize| f64::from_le_bytes(reply[at..at + 8].try_into().unwrap());
    // The first check is decided: a status, a delay, then one rule's four values.
    assert_eq!(value(0), 0.0, "{reply:?}");
    assert_eq!(value(16), 1.0, "admitted");
    // Then two failure entries, {-1, n} and n bytes of message.
    let mut at = 48;
    for expected in ["RLMOVED", "CROSSSLOT"] {
        assert_eq!(value(at), -1.0, "a failure entry at {at}");
        let n = value(at + 8) as usize;
        let message = String::from_utf8_lossy(&reply[at + 16..at + 16 + n]).into_owned();
        assert!(message.starts_with("RLMOVED"), "{message}");
        assert!(message.contains(expected), "{message}");
        at += 16 + n;
    }
    assert_eq!(at, reply.len());
    // Only the decided check wrote: its state.
    let keys: i64 = redis::cmd("DBSIZE").query(&mut con).unwrap();
    assert_eq!(keys, 1);
    alive(node);
}

/// `RATELIMIT.CHECK_LOCAL` on one Cluster node with a check of a slot the node does not
/// serve between two it serves: those two are decided, the other is answered `RLMOVED`
/// and touches nothing, neither on this node nor on the node that serves it; so is a
/// check of a slot the node is migrating away.
#[test]
fn check_local_answers_an_unserved_check_moved_between_served_ones() {
    check_local_with_an_unserved_check(&RedisCluster::start_with_module());
}

/// The same on Valkey, whose slot checks are its own code.
#[test]
fn check_local_on_valkey_answers_an_unserved_check_moved_between_served_ones() {
    check_local_with_an_unserved_check(&RedisCluster::start_valkey_with_module());
}

/// A node asks itself whether it serves a slot once per call when the answer proves the
/// slot stable (a check's block key absent yet served), and again for every check of a
/// slot that is migrating away, where only a key still on the node is served.
#[test]
fn check_local_asks_once_per_stable_slot_and_per_check_of_a_moving_one() {
    let cluster = RedisCluster::start_with_module();
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    let tag = (0..100)
        .map(|i| format!("s{i}"))
        .find(|tag| {
            redis::cmd("EXISTS")
                .arg(format!("{{{tag}}}"))
                .query::<i64>(&mut cons[0])
                .is_ok()
        })
        .expect("node 0 serves some tag");
    let key = |name: &str| format!("m:{{{tag}}}:{name}");
    let rules: RuleSet = "100/h gcra".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let check_local = |con: &mut redis::Connection, checks: &[[String; 2]]| {
        let mut cmd = redis::cmd("RATELIMIT.CHECK_LOCAL");
        cmd.arg(0).arg("2".repeat(checks.len()));
        for _ in checks {
            cmd.arg(&packed[..]);
        }
        for names in checks {
            cmd.arg(names);
        }
        let reply: Vec<u8> = cmd.query(con).unwrap();
        let mut rest = &reply[..];
        let mut entries = Vec::new();
        while !rest.is_empty() {
            let (one, more) = entry(rest);
            entries.push(one);
            rest = more;
        }
        entries
    };
    let exists_calls = |con: &mut redis::Connection| {
        common::commandstats(con)
            .get("exists")
            .map_or(0, |stats| stats.0)
    };

    // Eight checks of one client key: one question.
    common::reset_stats(&mut cons[0]);
    let checks: Vec<[String; 2]> = (0..8).map(|_| [key("b"), key("s")]).collect();
    let entries = check_local(&mut cons[0], &checks);
    assert_eq!(entries.len(), 8);
    assert!(
        entries.iter().all(|e| matches!(e, Ok((1.0, _)))),
        "{entries:?}"
    );
    assert_eq!(exists_calls(&mut cons[0]), 1);

    // The slot migrating away: a check whose block key is here is decided (the server
    // serves an existing key), one of the same slot whose block key is not is turned
    // away; the first answer must not vouch for the second.
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key("b"))
        .query(&mut cons[0])
        .unwrap();
    let to: String = redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut cons[1])
        .unwrap();
    // A block that ended long ago: the key exists, and the check decides past it.
    redis::cmd("SET")
        .arg(key("b"))
        .arg("1")
        .exec(&mut cons[0])
        .unwrap();
    redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(&to)
        .exec(&mut cons[0])
        .unwrap();
    common::reset_stats(&mut cons[0]);
    let entries = check_local(
        &mut cons[0],
        &[[key("b"), key("s")], [key("absent"), key("s2")]],
    );
    redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("STABLE")
        .exec(&mut cons[0])
        .unwrap();
    assert!(
        entries[0].is_ok(),
        "the check of a key still here: {entries:?}"
    );
    let moved = entries[1]
        .as_ref()
        .expect_err("the check of a key not here");
    assert!(moved.starts_with("RLMOVED"), "{moved}");
}

/// One entry of a batch reply of one-rule decisions: `Ok((allowed, remaining))` or
/// `Err(message)`; the rest of the reply.
fn entry(reply: &[u8]) -> (Result<(f64, f64), String>, &[u8]) {
    let value = |at: usize| f64::from_le_bytes(reply[at..at + 8].try_into().unwrap());
    if value(0) == -1.0 {
        let n = value(8) as usize;
        let message = String::from_utf8_lossy(&reply[16..16 + n]).into_owned();
        (Err(message), &reply[16 + n..])
    } else {
        (Ok((value(16), value(24))), &reply[16 + 32..])
    }
}

fn check_local_with_an_unserved_check(cluster: &RedisCluster) {
    let mut cons: Vec<_> = cluster.urls().iter().map(|u| common::conn(u)).collect();
    // Which node serves a tag: the one that does not redirect a read of it.
    let owner = |cons: &mut [redis::Connection], tag: &str| {
        cons.iter_mut()
            .position(|con| {
                redis::cmd("EXISTS")
                    .arg(format!("m:{{{tag}}}:s"))
                    .query::<i64>(con)
                    .is_ok()
            })
            .expect("a node serves every slot")
    };
    let tags: Vec<String> = (0..100).map(|i| format!("t{i}")).collect();
    let served: Vec<&String> = tags.iter().filter(|t| owner(&mut cons, t) == 0).collect();
    let unserved = tags
        .iter()
        .find(|t| owner(&mut cons, t) != 0)
        .expect("another node serves some tag");
    let elsewhere = owner(&mut cons, unserved);
    // On the server's clock: no window edge to cross (one more unit per 12 min).
    let rules: RuleSet = "5/h gcra".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let names = |tag: &str| [format!("m:{{{tag}}}:b"), format!("m:{{{tag}}}:s")];

    // The unserved key has a state on its own node, which must stay as it is.
    let _: Vec<u8> = redis::cmd("RATELIMIT.CHECK")
        .arg(&names(unserved))
        .arg(&packed[..])
        .query(&mut cons[elsewhere])
        .unwrap();
    let state_of = |con: &mut redis::Connection| -> (Option<Vec<u8>>, i64) {
        let name = &names(unserved)[1];
        (
            redis::cmd("GET").arg(name).query(con).unwrap(),
            redis::cmd("PEXPIRETIME").arg(name).query(con).unwrap(),
        )
    };
    let before = state_of(&mut cons[elsewhere]);
    assert!(before.0.is_some());

    let batch = [served[0], unserved, served[1]];
    for remaining in [4.0, 3.0] {
        let mut cmd = redis::cmd("RATELIMIT.CHECK_LOCAL");
        cmd.arg(0).arg("222");
        for _ in batch {
            cmd.arg(&packed[..]);
        }
        for tag in batch {
            cmd.arg(&names(tag));
        }
        let reply: Vec<u8> = cmd.query(&mut cons[0]).unwrap();
        let (first, rest) = entry(&reply);
        let (second, rest) = entry(rest);
        let (third, rest) = entry(rest);
        assert!(rest.is_empty(), "three entries");
        assert_eq!(first, Ok((1.0, remaining)), "the first served check");
        assert_eq!(third, Ok((1.0, remaining)), "the second served check");
        let message = second.expect_err("the unserved check is refused");
        assert!(message.starts_with("RLMOVED"), "{message}");
    }
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&names(unserved)[1])
        .query(&mut cons[0])
        .unwrap();
    let here: i64 = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query(&mut cons[0])
        .unwrap();
    assert_eq!(
        here, 0,
        "nothing written for the unserved check on this node"
    );
    assert_eq!(
        state_of(&mut cons[elsewhere]),
        before,
        "its state untouched"
    );

    // A slot this node serves but is migrating away: its check is not decided here
    // either (its block key is missing, so the server would send a client elsewhere),
    // and its state stays as it was; the check beside it is decided.
    let migrating: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&names(served[0])[1])
        .query(&mut cons[0])
        .unwrap();
    let to: String = redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut cons[elsewhere])
        .unwrap();
    redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(migrating)
        .arg("MIGRATING")
        .arg(&to)
        .exec(&mut cons[0])
        .unwrap();
    let kept: Vec<u8> = redis::cmd("GET")
        .arg(&names(served[0])[1])
        .query(&mut cons[0])
        .unwrap();
    let reply: Vec<u8> = redis::cmd("RATELIMIT.CHECK_LOCAL")
        .arg(0)
        .arg("22")
        .arg(&packed[..])
        .arg(&packed[..])
        .arg(&names(served[0]))
        .arg(&names(served[1]))
        .query(&mut cons[0])
        .unwrap();
    let (first, rest) = entry(&reply);
    let (second, rest) = entry(rest);
    assert!(rest.is_empty(), "two entries");
    let message = first.expect_err("the migrating check is refused");
    assert!(message.starts_with("RLMOVED"), "{message}");
    assert_eq!(second, Ok((1.0, 2.0)), "the served check");
    let after: Vec<u8> = redis::cmd("GET")
        .arg(&names(served[0])[1])
        .query(&mut cons[0])
        .unwrap();
    assert_eq!(after, kept, "the migrating check's state untouched");
}

/// One step of [`lua_and_module_write_the_same_bytes`].
#[derive(Debug, Clone)]
enum Op {
    /// A check of `key` under rule set `rules` through the leasing store or the exact one.
    Check {
        key: u8,
        rules: usize,
        cost: u64,
        leased: bool,
    },
    /// A charge of one unit given back, made `ago_us` before now.
    GiveBack {
        key: u8,
        rules: usize,
        ago_us: u64,
    },
    Block {
        key: u8,
        ms: Option<u64>,
    },
    /// The leasing store's sweep: ended leases refunded.
    Sweep,
    /// A charge of `charged` units made `ago_us` before now, settled to `actual`.
    Settle {
        key: u8,
        rules: usize,
        charged: u64,
        actual: u64,
        ago_us: u64,
    },
}

fn op() -> impl proptest::strategy::Strategy<Value = (u64, Op)> {
    use proptest::prelude::*;
    let op = prop_oneof![
        // Mostly one hot key through the leasing store, for leases to be granted.
        8 => (0u8..2, 0usize..2, 0u64..=3, prop::bool::weighted(0.8))
            .prop_map(|(key, rules, cost, leased)| Op::Check { key, rules, cost, leased }),
        2 => (0u8..3, 0usize..2, 0u64..200_000)
            .prop_map(|(key, rules, ago_us)| Op::GiveBack { key, rules, ago_us }),
        1 => (0u8..3, proptest::option::of(1u64..300)).prop_map(|(key, ms)| Op::Block { key, ms }),
        2 => Just(Op::Sweep),
        2 => (0u8..3, 0usize..2, 0u64..=3, prop_oneof![4 => 0u64..8, 1 => Just(u64::MAX)], 0u64..200_000)
            .prop_map(|(key, rules, charged, actual, ago_us)| Op::Settle { key, rules, charged, actual, ago_us }),
    ];
    (prop_oneof![6 => 0u64..3_000, 1 => 0u64..300_000], op)
}

/// Every key under `prefix` and its value (a string's bytes, a list's items), the
/// prefix cut off; but for the records of calls decided once on the Lua functions (the
/// module keeps its replies in memory).
fn values_under(con: &mut redis::Connection, prefix: &str) -> Vec<(String, Value)> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(con)
        .unwrap();
    keys.retain(|key| !common::is_record(key.as_bytes()));
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(con).unwrap();
            let value: Value = if kind == "list" {
                redis::cmd("LRANGE").arg(&key).arg(0).arg(-1).query(con)
            } else {
                redis::cmd("GET").arg(&key).query(con)
            }
            .unwrap();
            (key[prefix.len()..].to_owned(), value)
        })
        .collect()
}

/// A rollout's other half: the same trace of checks (leased and exact), charges given
/// back, settles, blocks and lease sweeps through stores on the Lua functions and
/// through stores on the module, each on keys of their own, gets the same decisions and
/// leaves the same bytes at every key: the module's refunds, debits, lease refunds and
/// blocks are the Lua functions' twins.
#[test]
fn lua_and_module_write_the_same_bytes() {
    use proptest::prelude::*;
    use ratelimit_core::{testing::T0_US, Clock, ManualClock};

    let server = RedisServer::start_with_module();
    let rule_sets: [RuleSet; 2] = [
        // Each rule lets an instance reserve a block (an eighth of its capacity, >= 2).
        "200/s gcra burst=40; 80/100ms fixed-window; 200/s token-bucket capacity=40; \
         200/s leaky-bucket capacity=32"
            .parse()
            .unwrap(),
        "20/s sliding-window precision=4; 10/s sliding-log; 30/s gcra burst=5"
            .parse()
            .unwrap(),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let con = std::cell::RefCell::new(common::conn(&server.url()));
    let cases = std::cell::Cell::new(0);
    proptest!(ProptestConfig::with_cases(48), |(trace in prop::collection::vec(op(), 1..60))| {
        let case = cases.get() + 1;
        cases.set(case);
        let (decided, prefixes) = rt.block_on(async {
            let clock = ManualClock::new(T0_US);
            let mut paths = Vec::new();
            for (force_lua, name) in [(true, "lua"), (false, "mod")] {
                let prefix = format!("{name}{case}");
                let make = |lease: Option<Duration>| {
                    let builder = RedisStore::builder()
                        .prefix(&prefix)
                        .clock(clock.clone())
                        .timeout(Duration::from_secs(5))
                        .force_lua(force_lua);
                    let builder = match lease {
                        Some(l) => builder.lease(l),
                        None => builder,
                    };
                    let url = server.url();
                    async move {
                        let store = builder.build(&url).await.unwrap();
                        wait_connected(&store).await;
                        assert_eq!(store.uses_module(), !force_lua);
                        store
                    }
                };
                // A lease length the background sweep (every half of it, in real time) never
                // reaches during a case: sweeps come where the trace puts them. Leases end
                // at the fixed window's end (100 ms on the manual clock).
                let leased = make(Some(Duration::from_secs(120))).await;
                let exact = make(None).await;
                paths.push((prefix, leased, exact));
            }
            let mut decided: [Vec<String>; 2] = Default::default();
            for (step, op) in &trace {
                clock.advance(Duration::from_micros(*step));
                for (i, (_, leased, exact)) in paths.iter().enumerate() {
                    let out = match op {
                        Op::Check { key, rules, cost, leased: through_lease } => {
                            let store = if *through_lease { leased } else { exact };
                            format!("{:?}", store.check(&[*key], &rule_sets[*rules], *cost).await)
                        }
                        Op::GiveBack { key, rules, ago_us } => {
                            let at = clock.now_us().saturating_sub(*ago_us);
                            format!("{:?}", exact.refund(&[*key], &rule_sets[*rules], 1, at).await)
                        }
                        Op::Block { key, ms } => format!(
                            "{:?}",
                            exact.block(&[*key], ms.map(Duration::from_millis)).await
                        ),
                        Op::Sweep => {
                            leased.sweep_leases().await;
                            String::new()
                        }
                        Op::Settle { key, rules, charged, actual, ago_us } => {
                            let at = clock.now_us().saturating_sub(*ago_us);
                            let rules = &rule_sets[*rules];
                            format!("{:?}", exact.settle(&[*key], rules, *charged, *actual, at).await)
                        }
                    };
                    decided[i].push(out);
                }
            }
            (decided, paths.into_iter().map(|(p, _, _)| p).collect::<Vec<_>>())
        });
        prop_assert_eq!(&decided[0], &decided[1]);
        let lua = values_under(&mut con.borrow_mut(), &prefixes[0]);
        let module = values_under(&mut con.borrow_mut(), &prefixes[1]);
        prop_assert_eq!(lua, module);
    });
    // The traces reached every command of both paths.
    let stats = common::commandstats(&mut con.borrow_mut());
    // (Give-backs, debt, lease refunds and blocks ride the check commands: edits in
    // batches.)
    let calls = stats.get("ratelimit.check_state").map_or(0, |s| s.0);
    assert!(calls > 20, "ratelimit.check_state: {calls} calls");
    for command in ["ratelimit.refund", "ratelimit.block"] {
        let alone = stats.get(command).map_or(0, |s| s.0);
        assert_eq!(alone, 0, "{command}: calls of their own");
    }
    alive(&server);
}

/// A batch of more than 256 distinct packed values (here, 299 costs) goes in the older
/// form, whose checks carry their own: the compact form refers to at most 256.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_of_more_than_256_distinct_checks_goes_in_the_older_form() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let store = RedisStore::builder()
        .pool_size(1)
        .max_batch(512)
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "1000/h fixed-window".parse().unwrap();
    common::reset_stats(&mut con);
    let tasks: Vec<_> = (0..300u64)
        .map(|i| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(
                async move { store.check(format!("k{i}").as_bytes(), &rules, i + 1).await },
            )
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let decided = task.await.unwrap().expect("check");
        assert_eq!(decided.rules()[0].remaining, 1000 - (i as u64 + 1));
    }
    let stats = common::commandstats(&mut con);
    let calls = |command: &str| stats.get(command).map_or(0, |s| s.0);
    // The first check alone, the 299 queued behind it in one call.
    assert_eq!(calls("ratelimit.check_state"), 1);
    assert_eq!(calls("ratelimit.check_many"), 1);
    assert_eq!(calls("ratelimit.check_states"), 0);
}

/// Batch protocol 2: a compact call with an id is decided once. Sent again (after a lost
/// connection), it answers its first run's reply and charges nothing more; a resend
/// whose first run never happened runs; `RATELIMIT.STATS` counts the replies kept.
#[test]
fn a_call_with_an_id_is_decided_once() {
    use ratelimit_core::packed::{self, CALL_ID_LEN, REF_LEN};
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "100/h fixed-window".parse().unwrap();
    let pack = packed::pack_check(&rules, Some(1_700_000_000_000_000), 7, 1_000, None);
    let refs = |id: u8, resent: bool| {
        let mut refs = Vec::with_capacity(REF_LEN + CALL_ID_LEN);
        packed::write_ref(&mut refs, 0, None);
        refs.extend_from_slice(&[id; 16]);
        refs.push(u8::from(resent));
        refs
    };
    let check = |con: &mut redis::Connection, id: u8, resent: bool| -> Vec<u8> {
        redis::cmd("RATELIMIT.CHECK_STATE")
            .arg("once:{a}:s")
            .arg(refs(id, resent))
            .arg(&pack)
            .query(con)
            .expect("a decision")
    };
    let remaining = |reply: &[u8]| f64::from_le_bytes(reply[24..32].try_into().unwrap());
    // `remaining` after the charge of 7.
    let first = check(&mut con, 1, false);
    assert_eq!(remaining(&first), 93.0);
    // The same call again, as a resend and as a first send: the first run's reply, and
    // nothing charged.
    assert_eq!(check(&mut con, 1, true), first);
    assert_eq!(check(&mut con, 1, false), first);
    // A resend whose first run never reached the server runs now.
    let second = check(&mut con, 2, true);
    assert_eq!(remaining(&second), 86.0);
    // The batch forms take an id too.
    let batch: Vec<u8> = redis::cmd("RATELIMIT.CHECK_STATES")
        .arg(1)
        .arg("once:{a}:s")
        .arg(refs(3, false))
        .arg(&pack)
        .query(&mut con)
        .unwrap();
    assert_eq!(remaining(&batch), 79.0);
    let again: Vec<u8> = redis::cmd("RATELIMIT.CHECK_STATES")
        .arg(1)
        .arg("once:{a}:s")
        .arg(refs(3, true))
        .arg(&pack)
        .query(&mut con)
        .unwrap();
    assert_eq!(again, batch);
    let stats: Vec<Value> = redis::cmd("RATELIMIT.STATS").query(&mut con).unwrap();
    assert_eq!(stats[2], Value::SimpleString("replies".into()));
    assert_eq!(stats[3], Value::Int(3));
    // A flag other than 0 or 1 is refused, nothing run.
    let mut bad = refs(4, false);
    *bad.last_mut().unwrap() = 7;
    let err = redis::cmd("RATELIMIT.CHECK_STATE")
        .arg("once:{a}:s")
        .arg(bad)
        .arg(&pack)
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("RLARGS"), "{err}");
    assert_eq!(remaining(&check(&mut con, 5, false)), 72.0);
}
