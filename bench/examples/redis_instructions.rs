//! Instructions a redis-server executes per decision, counted by callgrind: a figure that
//! stays the same from run to run on a shared machine, where CPU time moves by a third.
//!
//! Starts `redis-server` under `valgrind --tool=callgrind` on a free port, loads the
//! store's function library, and counts (between `callgrind_control -z` and `-d`) what
//! the server runs for each row, per decision:
//!
//! - `PING`: one `PING` per decision, 64 to a write, as 64 tasks send them through one
//!   multiplexed connection: the floor of any request;
//! - the least an exact limiter with a TTL on every key can ask of Redis per decision,
//!   batched as the store batches: a function that reads every key with one `MGET`,
//!   writes one 56-byte state with `SET .. PXAT` per check and replies 48 bytes per check;
//! - `check_many` of `lua/check.lua` on batches of 64 checks, one rule and four rules;
//!   and as a store sends it, with the call's record (decided once: one `SET .. PX` of
//!   the reply per call);
//! - the same batches as `RATELIMIT.CHECK_MANY` of the native module, when the server
//!   loads it: `$RATELIMIT_MODULE` names the module's `.so`, else
//!   `target/release/libratelimit_redis_module.so` when it is there (build it first);
//!   and in its compact form, `RATELIMIT.CHECK_STATES` (one argument per check and the
//!   packed value once; a module before it fails that row).
//!
//! Every key is a new one for its round, so every check is admitted and writes its state;
//! but in the last rows, which check the same 64 keys in every batch (a limiter's steady
//! state: each key's state read, decided, rewritten with its new expiry), under a rule
//! that admits them all.
//!
//! Then a metered request's calls, each sent alone (64 to a write), on the same 64 keys:
//! a check (`check`, `RATELIMIT.CHECK_STATE`), a settle above the estimate (`debit`,
//! `RATELIMIT.DEBIT`) and one below it (`give_back`, `RATELIMIT.GIVE_BACK`), through the
//! Lua functions and the module.
//!
//! ```sh
//! apt-get install valgrind   # Debian; callgrind_control comes with it
//! cargo build --release -p ratelimit-redis-module   # for the module's rows
//! cargo run --release -p ratelimit-bench --example redis_instructions
//! # ROUNDS (20) batches of 64 per row
//! KEEP=/tmp/profiles cargo run --release -p ratelimit-bench --example redis_instructions
//! callgrind_annotate --inclusive=yes /tmp/profiles/3-RATELIMIT.CHECK_MANY.out | head -60
//! ```
//!
//! Then what an entry of a Lua batch costs before any work of its own, part by part (its
//! strings passed into Lua, its share of the batch's `MGET`, a `pcall` and its reply,
//! the header unpacked, one `SET` through `redis.call`), on test functions shaped as
//! `check_many`.
//!
//! Then edits riding a batch, as a store sends settles and releases (batch protocol 5):
//! a batch of 64 checks, then one of 64 edits of the same keys (a slot released, a unit
//! given back, a unit of debt), through `check_many` and `RATELIMIT.CHECK_STATES`; each
//! edit's cost as the difference from the checks alone, and its ratio to a check's,
//! both without the server's timer and the rehashing of its growing keyspace, which
//! land on whichever row runs when they do (`ONLY=edits`: the `PING` floor and these
//! rows alone, after the Lua entry's parts).
//!
//! Last, a peer's design: a GCRA limiter as one Lua script per decision, the algorithm of
//! go-redis/redis_rate's `allowN` (`bench/redis_rate_gcra.lua`), by `EVALSHA`, one
//! decision per call, 64 to a write, on new keys and on the same 64 keys. `ONLY=redis_rate`
//! measures the `PING` floor and these rows alone (no module needed).
//!
//! `CLUSTER=1` measures instead, on a Cluster node serving every slot with the module
//! loaded, the module's batches as `RATELIMIT.CHECK_MANY` and as `RATELIMIT.CHECK_LOCAL`
//! and `RATELIMIT.CHECK_LOCAL_STATES` (the Cluster's per-node batches, each check's slot
//! checked, in the older and the compact form).
//!
//! `KEEP` names a directory where each row's callgrind dump is kept (`<row>-<path>.out`),
//! to see where a row's instructions go.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ratelimit_bench::env_or;
use ratelimit_core::RuleSet;
use ratelimit_redis::testing::{check_script, check_script_args};
use redis::Connection;

/// Checks per batch, the store's default `max_batch`.
const BATCH: usize = 64;

/// The least work per decision: read every key at once, write each state with its expiry,
/// reply per check. What any exact design with a TTL on every key does.
const FLOOR_LIBRARY: &str = r#"#!lua name=ratelimit_floor
local function floor(KEYS, ARGV)
  local got = redis.call('MGET', unpack(KEYS))
  local t = redis.call('TIME')
  local at = string.format('%d', math.ceil((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000) + 1000)
  local out = {}
  for i = 2, #KEYS, 2 do
    redis.call('SET', KEYS[i], ARGV[1], 'PXAT', at)
    out[#out + 1] = ARGV[2]
  end
  return table.concat(out)
end
redis.register_function('ratelimit_floor', floor)
"#;

/// What `check_many` does for each entry of a batch before the entry's own work, in
/// growing parts (see [`stage_rows`]): an entry's strings passed into Lua (`stage_args`,
/// which does nothing), its share of the batch's `MGET` (`stage_mget`), a `pcall` of a
/// function answering a reply, and its share of the replies' concatenation
/// (`stage_entries`), the packed value's header unpacked (`stage_header`), and one
/// `redis.call('SET', .., 'KEEPTTL')` (`stage_set`).
const STAGES_LIBRARY: &str = r#"#!lua name=ratelimit_stages
local HEADER_FORMAT = '<dddddddddd'
local function reply(packed)
  return struct.pack('<dd', 4, 1)
end
local function header(packed)
  local injected, injected_now, cost, ttl_floor, n, width, log_limit, log_period, layout,
    deadline, pos = struct.unpack(HEADER_FORMAT, packed)
  return struct.pack('<dd', 4, 1)
end
local function entries(KEYS, ARGV, each, set)
  local got = redis.call('MGET', unpack(KEYS))
  local out = {}
  for i = 1, #ARGV - 1 do
    local ok, r = pcall(each, ARGV[i + 1])
    if set then
      redis.call('SET', KEYS[2 * i], got[2 * i], 'KEEPTTL')
    end
    out[i] = r
  end
  return table.concat(out)
end
redis.register_function('stage_args', function(KEYS, ARGV) return '' end)
redis.register_function('stage_mget', function(KEYS, ARGV)
  redis.call('MGET', unpack(KEYS))
  return ''
end)
redis.register_function('stage_entries', function(KEYS, ARGV)
  return entries(KEYS, ARGV, reply, false)
end)
redis.register_function('stage_header', function(KEYS, ARGV)
  return entries(KEYS, ARGV, header, false)
end)
redis.register_function('stage_set', function(KEYS, ARGV)
  return entries(KEYS, ARGV, header, true)
end)
"#;

struct Server {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn main() {
    let rounds = env_or("ROUNDS", 20) as usize;
    let module = module();
    if env_or("CLUSTER", 0) == 1 {
        return cluster_rows(
            rounds,
            module.as_deref().expect("CLUSTER=1 needs the module"),
        );
    }
    let server = start(module.as_deref(), false);
    let mut con = connect(&server);
    let script = check_script();
    for library in [script.library, FLOOR_LIBRARY, STAGES_LIBRARY] {
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(library)
            .query(&mut con)
            .unwrap();
    }

    println!("redis-server instructions per decision (callgrind), {rounds} batches of {BATCH}\n");
    println!("| row | instructions / decision | × PING |");
    println!("|---|---:|---:|");
    let ping = count(&server, "PING", &mut con, rounds, |con, _| {
        let mut pipe = redis::pipe();
        for _ in 0..BATCH {
            pipe.cmd("PING");
        }
        let _: Vec<String> = pipe.query(con).unwrap();
    });
    println!("| `PING`, {BATCH} to a write (the floor) | {ping:.0} | 1.00x |");
    if std::env::var("ONLY").is_ok_and(|only| only == "redis_rate") {
        return redis_rate_rows(&server, &mut con, rounds, ping);
    }
    if std::env::var("ONLY").is_ok_and(|only| only == "edits") {
        stage_rows(&server, &mut con, rounds);
        return edit_rows(&server, &mut con, rounds, module.is_some());
    }
    let floor = count(&server, "floor", &mut con, rounds, |con, round| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("ratelimit_floor").arg(2 * BATCH);
        for i in 0..BATCH {
            cmd.arg(format!("floor:{{{round}:{i}}}:b"))
                .arg(format!("floor:{{{round}:{i}}}:s"));
        }
        cmd.arg(vec![7u8; 56]).arg(vec![0u8; 48]);
        let _: Vec<u8> = cmd.query(con).unwrap();
    });
    println!(
        "| least an exact limiter asks: `MGET`, `SET .. PXAT` and a reply per check | {floor:.0} | {:.2}x |",
        floor / ping
    );
    let paths: &[(&str, Option<&str>)] = if module.is_some() {
        &[
            ("check_many", Some(script.batch_function)),
            // As a store sends it: the call's record, kept for a resend.
            ("check_many with a record", Some(script.batch_function)),
            ("RATELIMIT.CHECK_MANY", None),
            ("RATELIMIT.CHECK_STATES", None),
            // Batch protocol 2: the call carries an id, its reply kept for a resend.
            ("RATELIMIT.CHECK_STATES with an id", None),
        ]
    } else {
        &[
            ("check_many", Some(script.batch_function)),
            ("check_many with a record", Some(script.batch_function)),
        ]
    };
    for ((name, rules, same_keys), (path, function)) in [
        ("`100/s gcra burst=100`", "100/s gcra burst=100", false),
        (
            "4 rules (gcra, sliding p=1, fixed, token)",
            "100/s gcra burst=10; 1000/min sliding-window precision=1; 10000/h fixed-window; \
             100000/day token-bucket capacity=1000",
            false,
        ),
        // A limiter's steady state: keys checked again, their state read and rewritten.
        (
            "`1/min gcra burst=1000`, the same 64 keys every batch",
            "1/min gcra burst=1000",
            true,
        ),
    ]
    .into_iter()
    .flat_map(|row| paths.iter().map(move |path| (row, *path)))
    {
        let rules: RuleSet = rules.parse().expect("rules");
        let args = check_script_args(&rules, 1);
        assert_eq!(args.len(), 1, "one packed argument per check");
        // Block marker and state: none of these rules is a sliding log.
        let keys = 2;
        let cost = count(&server, path, &mut con, rounds, |con, round| {
            let mut cmd = match function {
                Some(function) => {
                    let mut cmd = redis::cmd("FCALL");
                    cmd.arg(function);
                    cmd
                }
                None => redis::cmd(path.split(' ').next().unwrap_or(path)),
            };
            let compact = path.starts_with("RATELIMIT.CHECK_STATES");
            cmd.arg(if compact { BATCH } else { keys * BATCH });
            // Each path its own keys, so that the second does not find the first's.
            for i in 0..BATCH {
                let tag = if same_keys {
                    format!("hot:{path}:{{{i}}}")
                } else {
                    format!("check:{path}:{{{round}:{i}}}")
                };
                if !compact {
                    cmd.arg(format!("{tag}:b"));
                }
                cmd.arg(format!("{tag}:s"));
            }
            if compact {
                // The compact form: the one packed value, referred to by every check.
                let mut refs = compact_refs();
                if path.ends_with("with an id") {
                    // A new id per call, as a store sends them.
                    static CALLS: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(0);
                    let id = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    refs.extend_from_slice(&u128::from(id).to_le_bytes());
                    refs.push(0);
                }
                cmd.arg(refs).arg(&args[0][..]);
            } else {
                cmd.arg(vec![b'0' + keys as u8; BATCH]);
                for _ in 0..BATCH {
                    cmd.arg(&args[0][..]);
                }
                if path.ends_with("with a record") {
                    // The record beside the first check's keys, kept 1.1 s (a store's
                    // default timeout: twice 50 ms and a second), and a new id per call.
                    static CALLS: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(0);
                    let id = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let hex = format!("{id:032x}");
                    let first = if same_keys {
                        format!("hot:{path}:{{0}}")
                    } else {
                        format!("check:{path}:{{{round}:0}}")
                    };
                    let mut text_id = hex.clone().into_bytes();
                    text_id.push(0);
                    cmd.arg(format!("{first}:r{hex}")).arg(1_100).arg(text_id);
                }
            }
            let reply: Vec<u8> = cmd.query(con).unwrap();
            assert!(reply.len() >= BATCH * 48, "every check decided");
            if same_keys {
                assert_eq!(allowed(&reply), BATCH, "every check admitted");
            }
        });
        println!("| `{path}`, {name} | {cost:.0} | {:.2}x |", cost / ping);
    }
    settle_rows(&server, &mut con, rounds, module.is_some(), &script, ping);
    concurrency_rows(&server, &mut con, rounds, ping, module.is_some());
    stage_rows(&server, &mut con, rounds);
    edit_rows(&server, &mut con, rounds, module.is_some());
    redis_rate_rows(&server, &mut con, rounds, ping);
}

/// A peer's design for comparison: a GCRA limiter as one Lua script per decision, the
/// algorithm of go-redis/redis_rate's `allowN` (`bench/redis_rate_gcra.lua`), sent as
/// that library sends it: `EVALSHA`, one decision per call, here 64 pipelined to a write
/// (concurrent requests on one connection), on new keys and on the same 64 keys.
fn redis_rate_rows(server: &Server, con: &mut Connection, rounds: usize, ping: f64) {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(include_str!("../redis_rate_gcra.lua"))
        .query(con)
        .unwrap();
    // redis_rate's AllowN arguments: burst, rate, period in seconds, cost.
    for (name, burst, rate, period, same_keys) in [
        ("`100/s burst 100`, new keys", 100, 100, 1, false),
        (
            "`1/min burst 1000`, the same 64 keys every batch",
            1000,
            1,
            60,
            true,
        ),
    ] {
        let label = format!("redis_rate {}", if same_keys { "same" } else { "new" });
        let cost = count(server, &label, con, rounds, |con, round| {
            let mut pipe = redis::pipe();
            for i in 0..BATCH {
                let key = if same_keys {
                    format!("rate:hot:{i}")
                } else {
                    format!("rate:new:{round}:{i}")
                };
                pipe.cmd("EVALSHA")
                    .arg(&sha)
                    .arg(1)
                    .arg(key)
                    .arg(burst)
                    .arg(rate)
                    .arg(period)
                    .arg(1);
            }
            let replies: Vec<Vec<redis::Value>> = pipe.query(con).unwrap();
            assert!(
                replies
                    .iter()
                    .all(|r| r.first() == Some(&redis::Value::Int(1))),
                "every decision admitted: {replies:?}"
            );
        });
        println!(
            "| redis_rate's GCRA script (`bench/redis_rate_gcra.lua`), `EVALSHA`, one decision per call, {name} | {cost:.0} | {:.2}x |",
            cost / ping
        );
    }
}

/// A metered request's calls one by one, as a store sends them (each alone, 64 to a
/// write from concurrent requests), on the same 64 keys: its check at the door, and its
/// settle above the estimate (`debit`, the excess as debt) or below it (`give_back`),
/// through the Lua functions and, with the module, its commands.
fn settle_rows(
    server: &Server,
    con: &mut Connection,
    rounds: usize,
    module: bool,
    script: &ratelimit_redis::testing::CheckScript,
    ping: f64,
) {
    let rules: RuleSet = "1/min gcra burst=1000".parse().expect("rules");
    let packed = check_script_args(&rules, 1).remove(0);
    // The library's functions share the check function's tag.
    let function = |name: &str| script.function.replacen("_check_", &format!("_{name}_"), 1);
    let mut paths = vec![false];
    if module {
        paths.push(true);
    }
    for on_module in paths {
        let via = if on_module { "module" } else { "lua" };
        for row in ["check", "debit", "give_back"] {
            let label = format!("{via}-{row}");
            let cost = count(server, &label, con, rounds, |con, _| {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_micros()
                    .to_string();
                let mut pipe = redis::pipe();
                for i in 0..BATCH {
                    let tag = format!("settle:{via}:{{{i}}}");
                    let state = format!("{tag}:s");
                    let cmd = match (on_module, row) {
                        (true, "check") => pipe
                            .cmd("RATELIMIT.CHECK_STATE")
                            .arg(&state)
                            .arg(vec![0u8; 9]),
                        (false, "check") => pipe
                            .cmd("FCALL")
                            .arg(function("check"))
                            .arg(2)
                            .arg(format!("{tag}:b"))
                            .arg(&state),
                        (true, "debit") => pipe.cmd("RATELIMIT.DEBIT").arg(&state),
                        (true, _) => pipe.cmd("RATELIMIT.GIVE_BACK").arg(&state),
                        (false, _) => pipe.cmd("FCALL").arg(function(row)).arg(1).arg(&state),
                    };
                    cmd.arg(&packed[..]);
                    if row == "give_back" {
                        cmd.arg(&now);
                    }
                }
                let replies: Vec<redis::Value> = pipe.query(con).unwrap();
                if row != "check" {
                    assert!(
                        replies.iter().all(|r| *r == redis::Value::Int(1)),
                        "every {row} changed its state: {replies:?}"
                    );
                }
            });
            let what = match row {
                "check" => "a check alone",
                "debit" => "a settle above the estimate (debt)",
                _ => "a settle below the estimate (refund)",
            };
            let command = match (on_module, row) {
                (true, "check") => "RATELIMIT.CHECK_STATE".to_owned(),
                (true, "debit") => "RATELIMIT.DEBIT".to_owned(),
                (true, _) => "RATELIMIT.GIVE_BACK".to_owned(),
                (false, _) => format!("FCALL {row}"),
            };
            println!(
                "| `{command}`, {what}, `1/min gcra burst=1000`, the same 64 keys | {cost:.0} | {:.2}x |",
                cost / ping
            );
        }
    }
}

/// What an entry of a Lua batch costs before its own work, stage by stage
/// ([`STAGES_LIBRARY`]): `FCALL`s of 64 entries as `check_many` takes them (a block
/// marker's and a state's key, the state 48 bytes, and a check's packed value each), on
/// the same 64 keys every round. Each row is the instructions per entry with one more
/// part of the work, and what that part adds.
fn stage_rows(server: &Server, con: &mut Connection, rounds: usize) {
    let rules: RuleSet = "100/s gcra burst=100; 4 concurrent".parse().expect("rules");
    let packed = check_script_args(&rules, 2).remove(0);
    let keys: Vec<String> = (0..BATCH)
        .flat_map(|i| [format!("stage:{{{i}}}:b"), format!("stage:{{{i}}}:s")])
        .collect();
    for state in keys.iter().skip(1).step_by(2) {
        let _: () = redis::cmd("SET")
            .arg(state)
            .arg(vec![1u8; 48])
            .query(con)
            .unwrap();
    }
    let mut before = 0.0;
    for (function, what) in [
        (
            "stage_args",
            "its two keys and packed value passed into Lua",
        ),
        ("stage_mget", "+ its share of the batch's `MGET`"),
        (
            "stage_entries",
            "+ a `pcall` answering a reply, and its share of the replies' concatenation",
        ),
        (
            "stage_header",
            "+ the packed value's header unpacked (10 values)",
        ),
        (
            "stage_set",
            "+ one `redis.call('SET', state, value, 'KEEPTTL')`",
        ),
    ] {
        let cost = count(server, function, con, rounds, |con, _| {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(function).arg(2 * BATCH).arg(&keys);
            cmd.arg(vec![b'2'; BATCH]);
            for _ in 0..BATCH {
                cmd.arg(&packed[..]);
            }
            let _: Vec<u8> = cmd.query(con).unwrap();
        });
        println!(
            "| a Lua batch's entry (`FCALL` of {BATCH}, as `check_many`'s): {what} | {cost:.0} | +{:.0} |",
            cost - before
        );
        before = cost;
    }
}

/// Edits riding a batch, as a store sends settles and releases (the Lua `check_many` and
/// the module's `RATELIMIT.CHECK_STATES`, batch protocol 5): per round, a batch of 64
/// checks on new keys, then a batch of 64 edits of the same keys (a slot released, a
/// unit given back, a unit of debt); the edit's cost is the difference from the checks
/// alone, and its ratio to a check's in the same batch.
fn edit_rows(server: &Server, con: &mut Connection, rounds: usize, module: bool) {
    use ratelimit_core::packed::{self, Edit};
    let script = check_script();
    let mut paths = vec!["check_many"];
    if module {
        paths.push("RATELIMIT.CHECK_STATES");
    }
    let now_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    };
    for path in paths {
        let compact = path == "RATELIMIT.CHECK_STATES";
        for (what, rules) in [
            ("a release", "100/s gcra burst=100; 4 concurrent"),
            (
                "a settle below the estimate (give_back)",
                "1/min gcra burst=1000",
            ),
            (
                "a settle above the estimate (debt)",
                "1/min gcra burst=1000",
            ),
        ] {
            let rules: RuleSet = rules.parse().expect("rules");
            let check = check_script_args(&rules, 2).remove(0);
            // One batch call of `packs` (one per key, each with its number).
            let batch = |tags: &[String], packs: &[(Vec<u8>, u64)]| {
                let mut cmd = if compact {
                    redis::cmd(path)
                } else {
                    let mut cmd = redis::cmd("FCALL");
                    cmd.arg(script.batch_function);
                    cmd
                };
                cmd.arg(if compact { BATCH } else { 2 * BATCH });
                for tag in tags {
                    if !compact {
                        cmd.arg(format!("{tag}:b"));
                    }
                    cmd.arg(format!("{tag}:s"));
                }
                if compact {
                    // One packed value, each job's number in its refs.
                    let mut refs = Vec::with_capacity(9 * BATCH);
                    for (_, number) in packs {
                        packed::write_ref(&mut refs, 0, Some(*number).filter(|&n| n > 0));
                    }
                    cmd.arg(refs).arg(&packs[0].0[..]);
                } else {
                    cmd.arg(vec![b'2'; BATCH]);
                    for (pack, _) in packs {
                        cmd.arg(&pack[..]);
                    }
                }
                cmd
            };
            let mut costs = [0.0; 2];
            for (i, with_edits) in [false, true].into_iter().enumerate() {
                let label = format!("{path} {what} {with_edits}");
                costs[i] = count_net(server, &label, con, rounds, |con, round| {
                    let tags: Vec<String> = (0..BATCH)
                        .map(|k| format!("edit:{label}:{{{round}:{k}}}"))
                        .collect();
                    let at = now_us();
                    let checks: Vec<(Vec<u8>, u64)> =
                        (0..BATCH).map(|_| (check.clone(), 0)).collect();
                    let reply: Vec<u8> = batch(&tags, &checks).query(con).unwrap();
                    if !with_edits {
                        return;
                    }
                    let per = reply.len() / BATCH;
                    let edits: Vec<(Vec<u8>, u64)> = reply
                        .chunks(per)
                        .map(|decided| {
                            let edit = match what {
                                "a release" => Edit::Release {
                                    // The concurrency rule's retry: the slot's number.
                                    slot: f64::from_le_bytes(decided[per - 8..].try_into().unwrap())
                                        as u64,
                                },
                                w if w.ends_with("(give_back)") => {
                                    Edit::GiveBack { charged_at: at }
                                }
                                _ => Edit::Debit,
                            };
                            (
                                packed::pack_edit(edit, Some(&rules), None, 1, 0),
                                edit.value(),
                            )
                        })
                        .collect();
                    let reply: Vec<u8> = batch(&tags, &edits).query(con).unwrap();
                    assert_eq!(reply.len(), 16 * BATCH, "an edit's reply each");
                    assert!(
                        reply.chunks(16).all(|r| r == packed_reply(true)),
                        "every {what} changed its state"
                    );
                });
            }
            // Per key: a check, then (second row) its edit.
            let check_cost = costs[0];
            let edit_cost = costs[1] - check_cost;
            println!(
                "| `{path}`, {what} riding a batch (difference, without cron and rehash), after a check each | {edit_cost:.0} | {:.2}x of a check ({check_cost:.0}) |",
                edit_cost / check_cost
            );
        }
    }
}

/// An edit's reply, `{4, 1}` or `{4, 0}`.
fn packed_reply(changed: bool) -> Vec<u8> {
    let mut out = Vec::new();
    ratelimit_core::packed::encode_edit(&mut out, changed);
    out
}

fn connect(server: &Server) -> Connection {
    redis::Client::open(format!("redis://127.0.0.1:{}", server.port))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// `CLUSTER=1`: a Cluster node serving every slot, the module's batches on the same 64
/// keys every batch, sent as `RATELIMIT.CHECK_MANY` (no slot checks) and as
/// `RATELIMIT.CHECK_LOCAL` (each check's slot checked): what the Cluster's per-node
/// batches add.
fn cluster_rows(rounds: usize, module: &str) {
    let server = start(Some(module), true);
    let mut con = connect(&server);
    let _: String = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16383)
        .query(&mut con)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !redis::cmd("CLUSTER")
        .arg("INFO")
        .query::<String>(&mut con)
        .unwrap()
        .contains("cluster_state:ok")
    {
        assert!(
            Instant::now() < deadline,
            "the node's cluster state is not ok"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "redis-server instructions per decision (callgrind), a Cluster node, {rounds} batches of {BATCH}\n"
    );
    println!("| row | instructions / decision |");
    println!("|---|---:|");
    let rules: RuleSet = "1/min gcra burst=1000".parse().expect("rules");
    let args = check_script_args(&rules, 1);
    for path in [
        "RATELIMIT.CHECK_MANY",
        "RATELIMIT.CHECK_LOCAL",
        "RATELIMIT.CHECK_LOCAL_STATES",
    ] {
        let cost = count(&server, path, &mut con, rounds, |con, _| {
            if path == "RATELIMIT.CHECK_LOCAL_STATES" {
                let mut cmd = redis::cmd(path);
                cmd.arg(0).arg(compact_refs()).arg(&args[0][..]);
                for i in 0..BATCH {
                    cmd.arg(format!("hot:{path}:{{{i}}}:s"));
                }
                let reply: Vec<u8> = cmd.query(con).unwrap();
                assert_eq!(allowed(&reply), BATCH, "every check admitted");
                return;
            }
            let names: Vec<String> = (0..BATCH)
                .flat_map(|i| {
                    [
                        format!("hot:{path}:{{{i}}}:b"),
                        format!("hot:{path}:{{{i}}}:s"),
                    ]
                })
                .collect();
            let mut cmd = redis::cmd(path);
            let local = path.ends_with("LOCAL");
            cmd.arg(if local { 0 } else { 2 * BATCH });
            if !local {
                cmd.arg(&names);
            }
            cmd.arg(vec![b'2'; BATCH]);
            for _ in 0..BATCH {
                cmd.arg(&args[0][..]);
            }
            if local {
                cmd.arg(&names);
            }
            let reply: Vec<u8> = cmd.query(con).unwrap();
            assert_eq!(allowed(&reply), BATCH, "every check admitted");
        });
        println!("| `{path}`, `1/min gcra burst=1000`, the same 64 keys every batch | {cost:.0} |");
    }
}

/// The admitted checks of a batch reply of one-rule decisions (6 values per check, the
/// third its `allowed`).
fn allowed(reply: &[u8]) -> usize {
    reply
        .chunks(48)
        .filter(|c| c.get(16..24) == Some(&1f64.to_le_bytes()[..]))
        .count()
}

/// The `refs` of a compact batch (`RATELIMIT.CHECK_STATES`) of `BATCH` checks of one
/// packed value without deadlines: per check, the value's index (0) and the deadline (0,
/// none), 9 bytes.
fn compact_refs() -> Vec<u8> {
    vec![0u8; 9 * BATCH]
}

/// The module's shared object, when there is one to load.
fn module() -> Option<String> {
    if let Ok(path) = std::env::var("RATELIMIT_MODULE") {
        return Some(path);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release/libratelimit_redis_module.so");
    built
        .is_file()
        .then(|| built.to_string_lossy().into_owned())
}

/// Instructions per decision of `rounds` runs of `batch` (each `BATCH` decisions), after
/// one run to warm up.
fn count(
    server: &Server,
    label: &str,
    con: &mut Connection,
    rounds: usize,
    batch: impl FnMut(&mut Connection, usize),
) -> f64 {
    let (total, _) = counted(server, label, con, rounds, batch);
    total as f64 / (rounds * BATCH) as f64
}

/// As [`count`], without what the server spends outside the commands' own work: its
/// timer (`serverCron`) and the steps of a growing keyspace's rehashing that the
/// commands' lookups take on (`dictRehash` not called by the timer's own rehashing).
/// Those come from the keys the rows before created and land on whichever row runs
/// when the table grows: about 3,000 instructions per decision at times, as large as
/// an edit's whole difference.
fn count_net(
    server: &Server,
    label: &str,
    con: &mut Connection,
    rounds: usize,
    batch: impl FnMut(&mut Connection, usize),
) -> f64 {
    let (total, dump) = counted(server, label, con, rounds, batch);
    let output = Command::new("callgrind_annotate")
        .args(["--inclusive=yes", "--threshold=100"])
        .arg(&dump)
        .output()
        .expect("callgrind_annotate (valgrind) on PATH");
    let text = String::from_utf8_lossy(&output.stdout);
    let inclusive = |function: &str| -> u64 {
        text.lines()
            .find(|line| line.contains(&format!(":{function} [")))
            .and_then(|line| line.split_whitespace().next())
            .map_or(0, |n| n.replace(',', "").parse().unwrap_or(0))
    };
    let outside = inclusive("serverCron") + inclusive("dictRehash")
        - inclusive("dictRehashMilliseconds").min(inclusive("dictRehash"));
    total.saturating_sub(outside) as f64 / (rounds * BATCH) as f64
}

/// Runs `batch` once to warm up, then `rounds` times under count: the instructions and
/// the dump's file.
fn counted(
    server: &Server,
    label: &str,
    con: &mut Connection,
    rounds: usize,
    mut batch: impl FnMut(&mut Connection, usize),
) -> (u64, PathBuf) {
    batch(con, usize::MAX);
    callgrind(server, "-z");
    for round in 0..rounds {
        batch(con, round);
    }
    let (total, dump) = callgrind(server, "-d");
    if let Ok(keep) = std::env::var("KEEP") {
        // Rows are told apart by their order and the name of what they ran.
        let n = KEPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!(
            "{n}-{}.out",
            label.replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_")
        );
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::copy(&dump, Path::new(&keep).join(name)).unwrap();
    }
    (total, dump)
}

static KEPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `callgrind_control <flag>` on the server; after `-d`, the instructions of the dump
/// and its file.
fn callgrind(server: &Server, flag: &str) -> (u64, PathBuf) {
    let before = dumps(&server.dir);
    let status = Command::new("callgrind_control")
        .arg(flag)
        .arg(server.child.id().to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("callgrind_control (valgrind) on PATH");
    assert!(status.success(), "callgrind_control {flag}");
    if flag != "-d" {
        return (0, PathBuf::new());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let new: Vec<PathBuf> = dumps(&server.dir)
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        if let Some(found) = new.iter().find_map(|p| Some((summary(p)?, p.clone()))) {
            return found;
        }
        assert!(Instant::now() < deadline, "no callgrind dump");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn dumps(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cg."))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The `summary:` (or `totals:`) line of a complete callgrind dump.
fn summary(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn start(module: Option<&str>, cluster: bool) -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("ratelimit-callgrind-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let child = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}/cg.%p", dir.display()))
        .args([
            "redis-server",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(module.map(|m| ["--loadmodule", m]).into_iter().flatten())
        .args(
            cluster
                .then_some(["--cluster-enabled", "yes"])
                .into_iter()
                .flatten(),
        )
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("valgrind and redis-server on PATH");
    let server = Server { child, dir, port };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) {
            if let Ok(mut con) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut con).is_ok() {
                    return server;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "redis-server under callgrind did not start"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A concurrency rule beside the rate: each check of a batch takes a slot (new keys every
/// round), then each slot is released, one call per release as the store sends them
/// (64 to a write). The release's own figure is the difference between the two rows.
fn concurrency_rows(server: &Server, con: &mut Connection, rounds: usize, ping: f64, module: bool) {
    let script = check_script();
    let release_function = script
        .batch_function
        .replace("ratelimit_batch_", "ratelimit_release_");
    let rules: RuleSet = "100/s gcra burst=100; 4 concurrent".parse().expect("rules");
    let args = check_script_args(&rules, 1);
    let mut paths = vec![("check_many", true)];
    if module {
        paths.push(("RATELIMIT.CHECK_MANY", false));
    }
    for (path, lua) in paths {
        let mut acquire_only = 0.0;
        for release in [false, true] {
            let label = format!("{path} concurrent {release}");
            let cost = count(server, &label, con, rounds, |con, round| {
                let mut cmd = if lua {
                    let mut cmd = redis::cmd("FCALL");
                    cmd.arg(script.batch_function);
                    cmd
                } else {
                    redis::cmd(path)
                };
                cmd.arg(2 * BATCH);
                let tags: Vec<String> = (0..BATCH)
                    .map(|i| format!("conc:{label}:{{{round}:{i}}}"))
                    .collect();
                for tag in &tags {
                    cmd.arg(format!("{tag}:b")).arg(format!("{tag}:s"));
                }
                cmd.arg(vec![b'2'; BATCH]);
                for _ in 0..BATCH {
                    cmd.arg(&args[0][..]);
                }
                let reply: Vec<u8> = cmd.query(con).unwrap();
                // Each check's reply: status, delay, 4 values per rule; the slot's number
                // is the concurrency rule's retry, its 10th value.
                let slots: Vec<u64> = reply
                    .chunks(80)
                    .map(|c| f64::from_le_bytes(c[72..80].try_into().unwrap()) as u64)
                    .collect();
                assert_eq!(slots.len(), BATCH);
                assert!(slots.iter().all(|&s| s > 0), "every check took a slot");
                if !release {
                    return;
                }
                let mut pipe = redis::pipe();
                for (tag, slot) in tags.iter().zip(&slots) {
                    if lua {
                        pipe.cmd("FCALL")
                            .arg(&release_function)
                            .arg(1)
                            .arg(format!("{tag}:s"))
                            .arg("")
                            .arg(*slot);
                    } else {
                        pipe.cmd("RATELIMIT.RELEASE")
                            .arg(format!("{tag}:s"))
                            .arg("")
                            .arg(*slot);
                    }
                }
                let freed: Vec<i64> = pipe.query(con).unwrap();
                assert!(freed.iter().all(|&f| f == 1), "every slot released");
            });
            if release {
                println!(
                    "| `{path}` + a release each, `100/s gcra burst=100; 4 concurrent` | {cost:.0} | {:.2}x |",
                    cost / ping
                );
                println!(
                    "| the release alone (difference) | {:.0} | {:.2}x |",
                    cost - acquire_only,
                    (cost - acquire_only) / ping
                );
            } else {
                acquire_only = cost;
                println!(
                    "| `{path}`, `100/s gcra burst=100; 4 concurrent` (a slot taken) | {cost:.0} | {:.2}x |",
                    cost / ping
                );
            }
        }
    }
}
