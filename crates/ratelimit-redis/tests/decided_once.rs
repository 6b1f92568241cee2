//! Calls decided once, by hand: a call sent again after its connection broke (its id's
//! last byte 1) answers its first run's reply and runs nothing; one whose first run
//! never happened runs. On the Lua functions through a record key per call, on the
//! module (protocol 4) for the commands that edit a state after its check.

mod common;

use ratelimit_core::packed;
use ratelimit_core::RuleSet;
use ratelimit_redis::testing::{check_script, check_script_args, RedisServer};
use redis::Value;

/// The call id `n` as the calls that carry it alone send it: 32 hex digits and the flag.
fn id(n: u8, resent: bool) -> Vec<u8> {
    let mut id = format!("{n:02x}").repeat(16).into_bytes();
    id.push(u8::from(resent));
    id
}

/// The state key of client key tag `tag` under prefix `once`, and its record of the
/// call `n`.
fn names(tag: &str, n: u8) -> (String, String) {
    (
        format!("once:{{{tag}}}:s"),
        format!("once:{{{tag}}}:r{}", format!("{n:02x}").repeat(16)),
    )
}

/// `remaining` of a check's reply (see `CheckReply`): the second rule value.
fn remaining(reply: &[u8]) -> f64 {
    f64::from_le_bytes(reply[24..32].try_into().unwrap())
}

#[test]
fn a_lua_call_with_a_record_is_decided_once() {
    let server = RedisServer::start();
    let mut con = common::conn(&server.url());
    let script = check_script();
    let _: Value = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(script.library)
        .query(&mut con)
        .unwrap();
    let rules: RuleSet = "100/h fixed-window".parse().unwrap();
    // An injected time: a give-back below finds the charge's window whatever the hour.
    let now = 1_700_000_000_000_000u64;
    let args = vec![packed::pack_check(&rules, Some(now), 7, 1_000, None)];
    let check = |con: &mut redis::Connection, n: u8, resent: bool| -> Vec<u8> {
        let (state, record) = names("a", n);
        redis::cmd("FCALL")
            .arg(script.function)
            .arg(2)
            .arg("once:{a}:b")
            .arg(&state)
            .arg(&args)
            .arg(&record)
            .arg(1_000)
            .arg(id(n, resent))
            .query(con)
            .expect("a decision")
    };
    let first = check(&mut con, 1, false);
    assert_eq!(remaining(&first), 93.0);
    // Its record: one key, kept no longer than asked.
    let (_, record) = names("a", 1);
    let ttl: i64 = redis::cmd("PTTL").arg(&record).query(&mut con).unwrap();
    assert!(0 < ttl && ttl <= 1_000, "{ttl}");
    // Sent again: the first run's reply, nothing charged.
    assert_eq!(check(&mut con, 1, true), first);
    // A resend whose first run never reached the server runs now.
    assert_eq!(remaining(&check(&mut con, 2, true)), 86.0);
    assert_eq!(remaining(&check(&mut con, 3, false)), 79.0);
    // Without the three values, a call runs as before (a store of the module's path
    // falling back to Lua).
    let plain: Vec<u8> = redis::cmd("FCALL")
        .arg(script.function)
        .arg(2)
        .arg("once:{a}:b")
        .arg("once:{a}:s")
        .arg(&args)
        .query(&mut con)
        .unwrap();
    assert_eq!(remaining(&plain), 72.0);
    // A bad id is refused before anything runs.
    for bad in [vec![b'1'; 32], {
        let mut b = id(4, false);
        *b.last_mut().unwrap() = 7;
        b
    }] {
        let err = redis::cmd("FCALL")
            .arg(script.function)
            .arg(2)
            .arg("once:{a}:b")
            .arg("once:{a}:s")
            .arg(&args)
            .arg("once:{a}:rx")
            .arg(1_000)
            .arg(bad)
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{err}");
    }
    assert_eq!(remaining(&check(&mut con, 5, false)), 65.0);

    // A give-back (an integer reply) sent again gives nothing back twice.
    let give_back = script
        .function
        .replace("ratelimit_check_", "ratelimit_give_back_");
    let back = |con: &mut redis::Connection, n: u8, resent: bool| -> i64 {
        let (state, record) = names("a", n);
        let packed = packed::pack_check(&rules, Some(now), 7, 1_000, None);
        redis::cmd("FCALL")
            .arg(&give_back)
            .arg(1)
            .arg(&state)
            .arg(packed)
            .arg(now)
            .arg(&record)
            .arg(1_000)
            .arg(id(n, resent))
            .query(con)
            .expect("a give-back")
    };
    let peek_args = vec![packed::pack_check(&rules, Some(now), 0, 1_000, None)];
    let peek = |con: &mut redis::Connection| -> f64 {
        let reply: Vec<u8> = redis::cmd("FCALL")
            .arg(script.function)
            .arg(2)
            .arg("once:{a}:b")
            .arg("once:{a}:s")
            .arg(&peek_args)
            .query(con)
            .unwrap();
        remaining(&reply)
    };
    // A charge of 7 at `now` given back: 65 + 7 left.
    assert_eq!(back(&mut con, 10, false), 1);
    assert_eq!(peek(&mut con), 72.0);
    assert_eq!(back(&mut con, 10, true), 1, "the first run's reply");
    assert_eq!(peek(&mut con), 72.0, "nothing given back twice");
}

/// On a Cluster node, `check_local`'s record lies in the first check's slot; a node that
/// does not serve it answers every check of the call as moved, nothing run.
#[test]
fn a_node_batch_whose_record_is_elsewhere_runs_nothing() {
    let cluster = ratelimit_redis::testing::RedisCluster::start();
    let script = check_script();
    let local = script
        .function
        .replace("ratelimit_check_", "ratelimit_local_");
    let rules: RuleSet = "100/h fixed-window".parse().unwrap();
    let args = check_script_args(&rules, 1);
    // A node, and a client key of a slot another node serves.
    let mut con = common::conn(&cluster.urls()[0]);
    let _: Value = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(script.library)
        .query(&mut con)
        .unwrap();
    let tag = (0..1000)
        .map(|i| format!("t{i}"))
        .find(|tag| {
            let reply: redis::RedisResult<Value> = redis::cmd("GET")
                .arg(format!("once:{{{tag}}}:s"))
                .query(&mut con);
            reply.is_err()
        })
        .expect("a key served elsewhere");
    let (state, record) = names(&tag, 1);
    let reply: Vec<u8> = redis::cmd("FCALL")
        .arg(&local)
        .arg(0)
        .arg("2")
        .arg(&args[0])
        .arg(format!("once:{{{tag}}}:b"))
        .arg(&state)
        .arg(&record)
        .arg(1_000)
        .arg(id(1, false))
        .query(&mut con)
        .expect("a batch reply");
    // {-1, length} and the message.
    assert_eq!(f64::from_le_bytes(reply[..8].try_into().unwrap()), -1.0);
    let message = String::from_utf8_lossy(&reply[16..]);
    assert!(message.starts_with("RLMOVED"), "{message}");
}

/// Module protocol 4: a give-back, a debit, a release and a renewal with an id are
/// decided once.
#[test]
fn a_module_edit_with_an_id_is_decided_once() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "100/h fixed-window; 2 concurrent timeout=60s"
        .parse()
        .unwrap();
    let now = 1_700_000_000_000_000u64;
    let pack = |cost| packed::pack_check(&rules, Some(now), cost, 1_000, None);
    let state = "m:{a}:s";
    let check = |con: &mut redis::Connection| -> Vec<u8> {
        let mut refs = Vec::new();
        packed::write_ref(&mut refs, 0, None);
        redis::cmd("RATELIMIT.CHECK_STATE")
            .arg(state)
            .arg(refs)
            .arg(pack(7))
            .query(con)
            .expect("a decision")
    };
    let first = check(&mut con);
    assert_eq!(remaining(&first), 93.0);
    let peek = |con: &mut redis::Connection| -> f64 {
        let mut refs = Vec::new();
        packed::write_ref(&mut refs, 0, None);
        let reply: Vec<u8> = redis::cmd("RATELIMIT.CHECK_STATE")
            .arg(state)
            .arg(refs)
            .arg(pack(0))
            .query(con)
            .unwrap();
        remaining(&reply)
    };
    let give_back = |con: &mut redis::Connection, n: u8, resent: bool| -> i64 {
        redis::cmd("RATELIMIT.GIVE_BACK")
            .arg(state)
            .arg(pack(3))
            .arg(now)
            .arg(id(n, resent))
            .query(con)
            .expect("a give-back")
    };
    assert_eq!(give_back(&mut con, 1, false), 1);
    assert_eq!(peek(&mut con), 96.0);
    assert_eq!(give_back(&mut con, 1, true), 1, "the first run's reply");
    assert_eq!(peek(&mut con), 96.0, "nothing given back twice");
    let debit = |con: &mut redis::Connection, n: u8, resent: bool| -> i64 {
        redis::cmd("RATELIMIT.DEBIT")
            .arg(state)
            .arg(pack(5))
            .arg(id(n, resent))
            .query(con)
            .expect("a debit")
    };
    assert_eq!(debit(&mut con, 2, false), 1);
    assert_eq!(debit(&mut con, 2, true), 1);
    assert_eq!(peek(&mut con), 91.0, "charged once");
    // The slot the check took (the first of the state) released once: a resend answers
    // 1 as the first run did, and frees nothing more.
    let slot = 1_700_000_000_000_000u64;
    let release = |con: &mut redis::Connection, n: u8, resent: bool| -> i64 {
        redis::cmd("RATELIMIT.RELEASE")
            .arg(state)
            .arg(now)
            .arg(slot)
            .arg(id(n, resent))
            .query(con)
            .expect("a release")
    };
    assert_eq!(release(&mut con, 3, false), 1);
    assert_eq!(release(&mut con, 3, true), 1, "the first run's reply");
    assert_eq!(release(&mut con, 4, false), 0, "the slot is free");
    let stats: Vec<Value> = redis::cmd("RATELIMIT.STATS").query(&mut con).unwrap();
    assert_eq!(stats[3], Value::Int(4), "one record per edit with an id");
}
