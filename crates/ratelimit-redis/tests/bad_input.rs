//! Bad input on both paths, the Lua functions and the native module: a value the store
//! did not write at a limiter key, a truncated or oversized state, arguments out of
//! range, a key of 64 KiB. Each is answered for its own check only, in the middle of a
//! batch whose other checks are decided as if it were not there and charged once; the
//! server stays up. A value that is replaced is said so in the check's reply (status 2),
//! from which the store logs its WARN.

mod common;

use ratelimit_core::RuleSet;
use ratelimit_redis::redis::{self, Connection, Value};
use ratelimit_redis::testing::{check_script, check_script_args, RedisServer};

/// The two paths of a batch on one server: `FCALL` of the batch function, or
/// `RATELIMIT.CHECK_MANY`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Lua,
    Module,
}

/// One check of a batch: its keys and packed values.
struct Check {
    keys: Vec<Vec<u8>>,
    packed: Vec<u8>,
}

fn keys_of(tag: &str, log: bool) -> Vec<Vec<u8>> {
    let mut keys = vec![
        format!("bad:{{{tag}}}:b").into_bytes(),
        format!("bad:{{{tag}}}:s").into_bytes(),
    ];
    if log {
        keys.push(format!("bad:{{{tag}}}:l").into_bytes());
    }
    keys
}

/// Each check's reply in a batch reply: `Ok(values)` or `Err(message)`.
fn split(bytes: &[u8], rules: &[usize]) -> Vec<Result<Vec<f64>, String>> {
    let value = |at: usize| f64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let mut at = 0;
    let mut out = Vec::new();
    for &n in rules {
        let status = value(at);
        if status == -1.0 {
            let len = value(at + 8) as usize;
            out.push(Err(
                String::from_utf8_lossy(&bytes[at + 16..at + 16 + len]).into_owned()
            ));
            at += 16 + len;
            continue;
        }
        let len = if status == 1.0 || status == 3.0 {
            16
        } else {
            16 + 32 * n
        };
        out.push(Ok((0..len / 8).map(|i| value(at + 8 * i)).collect()));
        at += len;
    }
    assert_eq!(at, bytes.len(), "the reply holds one answer per check");
    out
}

fn batch(con: &mut Connection, path: Path, checks: &[Check]) -> Vec<u8> {
    let script = check_script();
    let mut cmd = match path {
        Path::Lua => {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(script.batch_function);
            cmd
        }
        Path::Module => redis::cmd("RATELIMIT.CHECK_MANY"),
    };
    cmd.arg(checks.iter().map(|c| c.keys.len()).sum::<usize>());
    for check in checks {
        for key in &check.keys {
            cmd.arg(&key[..]);
        }
    }
    let counts: String = checks.iter().map(|c| c.keys.len().to_string()).collect();
    cmd.arg(counts);
    for check in checks {
        cmd.arg(&check.packed[..]);
    }
    cmd.query(con).expect("a batch answers")
}

fn alive(con: &mut Connection) {
    let pong: String = redis::cmd("PING").query(con).expect("the server answers");
    assert_eq!(pong, "PONG");
}

/// A foreign value, bad bytes or bad arguments between two good checks: the good ones
/// are decided (and charged once), the bad one is answered alone: decided on a fresh
/// state and said replaced (status 2) when a value was replaced, an error naming the
/// problem when its arguments are bad.
#[test]
fn bad_input_is_answered_for_its_check_alone_on_both_paths() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let script = check_script();
    let _: Value = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(script.library)
        .query(&mut con)
        .unwrap();
    let rules: RuleSet = "10/s gcra burst=5; 100/min sliding-log".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let n = rules.len();
    let valid_state = {
        // A state as a check writes it, for the truncated and oversized cases.
        let keys = keys_of("template", true);
        let _ = batch(
            &mut con,
            Path::Lua,
            &[Check {
                keys: keys.clone(),
                packed: packed.clone(),
            }],
        );
        let raw: Vec<u8> = redis::cmd("GET").arg(&keys[1][..]).query(&mut con).unwrap();
        raw
    };
    // What is written where before the check: the key (0 block, 1 state, 2 log), the
    // command and its arguments after the key.
    let v = |bytes: &[u8]| bytes.to_vec();
    let foreign: Vec<(&str, usize, &str, Vec<Vec<u8>>)> = vec![
        (
            "a string of another shape at the state",
            1,
            "SET",
            vec![v(b"12 x")],
        ),
        (
            "bytes that are not values at the state",
            1,
            "SET",
            vec![vec![0xff; 80]],
        ),
        (
            "a truncated state",
            1,
            "SET",
            vec![v(&valid_state[..valid_state.len() - 8])],
        ),
        (
            "an oversized state",
            1,
            "SET",
            vec![[&valid_state[..], &[0u8; 8]].concat()],
        ),
        ("a hash at the state", 1, "HSET", vec![v(b"f"), v(b"v")]),
        ("a list at the state", 1, "RPUSH", vec![v(b"x")]),
        ("a string at the log", 2, "SET", vec![v(b"x")]),
        ("a hash at the log", 2, "HSET", vec![v(b"f"), v(b"v")]),
        (
            "a list of words at the log",
            2,
            "LPUSH",
            vec![v(b"yesterday")],
        ),
        ("a word at the block marker", 0, "SET", vec![v(b"soon")]),
    ];
    for path in [Path::Lua, Path::Module] {
        for (case, (what, at, command, args)) in foreign.iter().enumerate() {
            let good = |side: &str| Check {
                keys: keys_of(&format!("{path:?}{case}{side}"), true),
                packed: packed.clone(),
            };
            let bad_keys = keys_of(&format!("{path:?}{case}bad"), true);
            // A log counts only while the state vouches for it (else it is dropped as
            // stale, whatever it holds): for a foreign log, the key was checked once.
            let vouched = what.ends_with("at the log");
            if vouched {
                let check = Check {
                    keys: bad_keys.clone(),
                    packed: packed.clone(),
                };
                let _ = batch(&mut con, path, &[check]);
                redis::cmd("DEL")
                    .arg(&bad_keys[2][..])
                    .exec(&mut con)
                    .unwrap();
            }
            redis::cmd(command)
                .arg(&bad_keys[*at][..])
                .arg(args)
                .exec(&mut con)
                .unwrap();
            let checks = [
                good("a"),
                Check {
                    keys: bad_keys.clone(),
                    packed: packed.clone(),
                },
                good("b"),
            ];
            let reply = batch(&mut con, path, &checks);
            let parts = split(&reply, &[n, n, n]);
            for side in [0, 2] {
                let values = parts[side].as_ref().expect("a good check is decided");
                assert_eq!(values[0], 0.0, "{path:?}, {what}: the good check's status");
                // Allowed, one unit charged under each rule.
                assert_eq!((values[2], values[3]), (1.0, 4.0), "{path:?}, {what}");
            }
            let bad = parts[1]
                .as_ref()
                .unwrap_or_else(|e| panic!("{path:?}, {what}: {e}"));
            assert_eq!(
                bad[0], 2.0,
                "{path:?}, {what}: the reply says a value was replaced"
            );
            // A fresh state (the GCRA's, for a foreign log).
            let charged = if vouched { 2.0 } else { 1.0 };
            assert_eq!(
                (bad[2], bad[3]),
                (1.0, 5.0 - charged),
                "{path:?}, {what}: a fresh state"
            );
            // And the next check counts from there: charged once.
            let again = batch(&mut con, path, &checks[1..2]);
            let again = split(&again, &[n]).remove(0).unwrap();
            assert_eq!(
                (again[0], again[3]),
                (0.0, 4.0 - charged),
                "{path:?}, {what}"
            );
            alive(&mut con);
        }

        // Arguments out of range: an error for that check, the others decided.
        let mut huge_cost = packed.clone();
        huge_cost[16..24].copy_from_slice(&1e15f64.to_le_bytes());
        let mut negative = packed.clone();
        negative[8 * 11..8 * 12].copy_from_slice(&(-3f64).to_le_bytes());
        let mut nan = packed.clone();
        nan[8..16].copy_from_slice(&f64::NAN.to_le_bytes());
        let mut fraction = packed.clone();
        fraction[16..24].copy_from_slice(&1.5f64.to_le_bytes());
        for (i, (what, bad)) in [
            ("a cost above the capacity", huge_cost),
            ("a negative limit", negative),
            ("a NaN time", nan),
            ("a fractional cost", fraction),
            ("a truncated argument", packed[..packed.len() - 8].to_vec()),
        ]
        .into_iter()
        .enumerate()
        {
            let checks = [
                Check {
                    keys: keys_of(&format!("{path:?}args{i}a"), true),
                    packed: packed.clone(),
                },
                Check {
                    keys: keys_of(&format!("{path:?}args{i}bad"), true),
                    packed: bad,
                },
                Check {
                    keys: keys_of(&format!("{path:?}args{i}b"), true),
                    packed: packed.clone(),
                },
            ];
            let parts = split(&batch(&mut con, path, &checks), &[n, n, n]);
            assert!(
                matches!(&parts[1], Err(e) if e.starts_with("RLARGS")),
                "{path:?}, {what}: {:?}",
                parts[1]
            );
            for side in [0, 2] {
                let values = parts[side].as_ref().expect("decided");
                assert_eq!((values[0], values[3]), (0.0, 4.0), "{path:?}, {what}");
            }
            let written: bool = redis::cmd("EXISTS")
                .arg(&checks[1].keys[1][..])
                .query(&mut con)
                .unwrap();
            assert!(
                !written,
                "{path:?}, {what}: nothing written for a refused check"
            );
        }

        // A key of 64 KiB among ordinary ones.
        let long = "x".repeat(64 * 1024);
        let checks = [
            Check {
                keys: keys_of(&format!("{path:?}long{long}"), true),
                packed: packed.clone(),
            },
            Check {
                keys: keys_of(&format!("{path:?}short"), true),
                packed: packed.clone(),
            },
        ];
        for remaining in [4.0, 3.0] {
            let parts = split(&batch(&mut con, path, &checks), &[n, n]);
            for part in parts {
                let values = part.expect("decided");
                assert_eq!((values[0], values[3]), (0.0, remaining), "{path:?}");
            }
        }
        alive(&mut con);
    }
}

/// What a test's tracing subscriber wrote.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A value of another type at a limiter key is replaced with one WARN from the store,
/// on Lua and on the module alike; more within 10 s are counted into the next one.
#[tokio::test(flavor = "current_thread")]
async fn a_replaced_value_is_warned_about_on_both_paths() {
    use ratelimit_core::Store;

    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "10/s gcra burst=5".parse().unwrap();
    for (force_lua, prefix) in [(true, "warnlua"), (false, "warnmod")] {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let store = ratelimit_redis::RedisStore::builder()
            .prefix(prefix)
            .timeout(std::time::Duration::from_secs(5))
            .force_lua(force_lua)
            .build(&server.url())
            .await
            .unwrap();
        ratelimit_redis::testing::wait_connected(&store).await;
        assert_eq!(store.uses_module(), !force_lua);
        // The documented layout: "<prefix>:{k<hex of b"k">}:s".
        let state = format!("{prefix}:{{k6b}}:s");
        for value in ["a hash", "a list"] {
            redis::cmd("DEL").arg(&state).exec(&mut con).unwrap();
            let kind = if value == "a hash" { "HSET" } else { "RPUSH" };
            let mut cmd = redis::cmd(kind);
            cmd.arg(&state);
            if kind == "HSET" {
                cmd.arg("f");
            }
            cmd.arg("v").exec(&mut con).unwrap();
            assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
            let kind: String = redis::cmd("TYPE").arg(&state).query(&mut con).unwrap();
            assert_eq!(kind, "string", "{value} replaced");
        }
        // A healthy key says nothing.
        assert!(store.check(b"other", &rules, 1).await.unwrap().is_allowed());
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let warnings: Vec<&str> = logged
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("did not write"))
            .collect();
        assert_eq!(warnings.len(), 1, "force_lua {force_lua}: {logged}");
        assert!(warnings[0].contains(prefix), "{}", warnings[0]);
    }
}

/// A panic inside the module (the test-only one its `test-panic` feature builds in, as
/// the harness builds it) is caught at the command boundary: the server stays up, the
/// check is answered `RLPANIC`, and in a batch the other checks are decided.
#[test]
fn a_panic_in_the_module_is_that_checks_error() {
    use ratelimit_redis::testing::PANIC_KEY_TAG;

    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let rules: RuleSet = "10/s gcra burst=5".parse().unwrap();
    let packed = check_script_args(&rules, 1).remove(0);
    let panicking = vec![
        format!("p{PANIC_KEY_TAG}:b").into_bytes(),
        format!("p{PANIC_KEY_TAG}:s").into_bytes(),
    ];
    let err = redis::cmd("RATELIMIT.CHECK")
        .arg(&panicking[0][..])
        .arg(&panicking[1][..])
        .arg(&packed[..])
        .query::<Value>(&mut con)
        .expect_err("the check panics");
    assert!(
        err.to_string().contains("RLPANIC") && err.to_string().contains("test panic"),
        "{err}"
    );
    alive(&mut con);
    let good = |tag: &str| Check {
        keys: keys_of(tag, false),
        packed: packed.clone(),
    };
    for round in 0..2 {
        let checks = [
            good("panic-a"),
            Check {
                keys: panicking.clone(),
                packed: packed.clone(),
            },
            good("panic-b"),
        ];
        let parts = split(&batch(&mut con, Path::Module, &checks), &[1, 1, 1]);
        assert!(
            matches!(&parts[1], Err(e) if e.starts_with("RLPANIC")),
            "{:?}",
            parts[1]
        );
        for side in [0, 2] {
            let values = parts[side].as_ref().expect("decided");
            assert_eq!((values[0], values[3]), (0.0, 4.0 - f64::from(round)));
        }
        let written: bool = redis::cmd("EXISTS")
            .arg(&panicking[1][..])
            .query(&mut con)
            .unwrap();
        assert!(!written, "a check that panicked wrote nothing");
    }
    alive(&mut con);
}
