//! The native module fuzzed live: random and mutated commands of every kind the module
//! serves, on keys that hold the store's own values or foreign ones, sent to a real
//! redis-server and a real valkey-server with the module loaded. After each: the reply
//! parses (an error reply is printable ASCII), a command answered with an error changed
//! no key (value and expiry), and the server answers `PING`.
//!
//! The number of commands per server is `RATELIMIT_FUZZ_ITERATIONS` (3,000 by default,
//! a few seconds) and the generator's seed `RATELIMIT_FUZZ_SEED` (printed on failure, to
//! replay a case). The pure half of the fuzzing, without a server, is
//! `ratelimit-core`'s `tests/packed_fuzz.rs`; the cases either found are the regression
//! tests at the end of this file and of that one.

mod common;

use ratelimit_core::packed;
use ratelimit_core::RuleSet;
use ratelimit_redis::redis::{self, Connection, ErrorKind, Value};
use ratelimit_redis::testing::RedisServer;

const TAGS: [&str; 3] = ["{fz0}", "{fz1}", "{fz2}"];

/// The rule sets of the checks sent: their bytes land in the module's rule cache, so a
/// mutated header over known rule bytes meets the cache.
const RULES: [&str; 5] = [
    "10/s",
    "5/s fixed-window; 6/s sliding-window precision=4; 8/s token-bucket capacity=9",
    "3/min sliding-log; 1/s sliding-log",
    "2/s leaky-bucket mode=shaper burst=10 delay=2; 100/h fixed-window",
    "10/s; 3 concurrent timeout=1s",
];

/// xorshift64*: a generator with a seed to replay, and no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

fn name(tag: &str, kind: char) -> Vec<u8> {
    format!("fz:{tag}:{kind}").into_bytes()
}

fn all_keys() -> Vec<Vec<u8>> {
    TAGS.iter()
        .flat_map(|t| ['b', 's', 'l'].map(|k| name(t, k)))
        .collect()
}

fn pack(rules: &str, cost: u64, injected: bool) -> Vec<u8> {
    let set: RuleSet = rules.parse().unwrap();
    let now = injected.then_some(1_700_000_000_000_000);
    packed::pack_check(&set, now, cost, 1_000, None)
}

/// A command the store could send, on one of the tags.
fn seed_command(rng: &mut Rng) -> Vec<Vec<u8>> {
    let tag = *rng.pick(&TAGS);
    let r = rng.below(RULES.len());
    let log = r == 2;
    let p = pack(RULES[r], rng.below(3) as u64, rng.below(2) == 0);
    let s = |t: &str| t.as_bytes().to_vec();
    let mut keys = vec![name(tag, 'b'), name(tag, 's')];
    if log {
        keys.push(name(tag, 'l'));
    }
    let mut refs = Vec::new();
    packed::write_ref(&mut refs, 0, None);
    // Half the compact calls carry a call id (protocol 2), some of them as resends, of
    // ids seen before or not.
    if rng.below(2) == 0 {
        refs.extend_from_slice(&(rng.below(64) as u128).to_le_bytes());
        refs.push(u8::from(rng.below(4) == 0));
    }
    // A slot number the checks give (numbered from the injected time) or not.
    let slot = (1_700_000_000_000_000 + rng.below(4) as u64)
        .to_string()
        .into_bytes();
    let now = s(if rng.below(2) == 0 {
        ""
    } else {
        "1700000000000000"
    });
    match rng.below(14) {
        13 => {
            // A take (a fallback's slot handed over), which rides a batch only.
            let set: RuleSet = RULES[r].parse().unwrap();
            let at = (rng.below(2) == 0).then_some(1_700_000_000_000_000);
            let take = packed::pack_edit(packed::Edit::Take, Some(&set), at, 1, 1_000);
            vec![
                s("RATELIMIT.CHECK_STATES"),
                s("1"),
                name(tag, 's'),
                refs,
                take,
            ]
        }
        11 => vec![s("RATELIMIT.RELEASE"), name(tag, 's'), now, slot],
        12 => vec![
            s("RATELIMIT.RENEW"),
            name(tag, 's'),
            now,
            slot,
            s(if rng.below(4) == 0 { "0" } else { "1000000" }),
            s("1000"),
        ],
        10 => {
            // A settle's excess: a few units, or as many as the encoding holds.
            let units = *rng.pick(&[0, 1, 7, 1_000_000, packed::MAX_EXACT]);
            [
                vec![s("RATELIMIT.DEBIT"), name(tag, 's')],
                if log { vec![name(tag, 'l')] } else { vec![] },
                vec![pack(RULES[r], units, rng.below(2) == 0)],
            ]
            .concat()
        }
        9 => vec![s("RATELIMIT.CHECK_STATE"), name(tag, 's'), refs, p],
        0 => [vec![s("RATELIMIT.CHECK")], keys, vec![p]].concat(),
        1 => [
            vec![
                s("RATELIMIT.CHECK_MANY"),
                keys.len().to_string().into_bytes(),
            ],
            keys.clone(),
            vec![keys.len().to_string().into_bytes(), p],
        ]
        .concat(),
        2 => [
            vec![s("RATELIMIT.CHECK_LOCAL"), s("0")],
            vec![keys.len().to_string().into_bytes(), p],
            keys,
        ]
        .concat(),
        3 => vec![s("RATELIMIT.CHECK_STATES"), s("1"), name(tag, 's'), refs, p],
        4 => vec![
            s("RATELIMIT.CHECK_LOCAL_STATES"),
            s("0"),
            refs,
            p,
            name(tag, 's'),
        ],
        5 => vec![
            s("RATELIMIT.REFUND"),
            name(tag, 's'),
            s("1700000000000000"),
            s("1"),
            s("1700000000000000"),
            s("2"),
            s("17"),
            s("6"),
            s("10"),
            s("1000000"),
            s("0"),
        ],
        6 => [
            vec![s("RATELIMIT.GIVE_BACK"), name(tag, 's')],
            if log { vec![name(tag, 'l')] } else { vec![] },
            vec![p, s("1700000000000000")],
        ]
        .concat(),
        7 => vec![
            s("RATELIMIT.BLOCK"),
            name(tag, 'b'),
            s(if rng.below(2) == 0 {
                ""
            } else {
                "1700000000000000"
            }),
            s(if rng.below(4) == 0 { "" } else { "5000000" }),
            s("1000"),
        ],
        _ => vec![s(if rng.below(2) == 0 {
            "RATELIMIT.VERSION"
        } else {
            "RATELIMIT.STATS"
        })],
    }
}

/// Bytes a hostile client might put in an argument.
fn hostile(rng: &mut Rng) -> Vec<u8> {
    let fixed: [&[u8]; 14] = [
        b"",
        b"0",
        b"-1",
        b"18446744073709551615",
        b"9223372036854775808",
        b"9007199254740993",
        b"abc",
        "µs".as_bytes(),
        b"\0",
        b"\r\n",
        b"5",
        b"2",
        b"3",
        b"x{a}:s",
    ];
    match rng.below(4) {
        0 => {
            let len = rng.below(64);
            (0..len).map(|_| rng.next() as u8).collect()
        }
        1 => {
            let n = rng.below(4);
            let mut r = Vec::new();
            for _ in 0..n {
                packed::write_ref(&mut r, rng.next() as u8, Some(rng.next() >> 8));
            }
            r
        }
        _ => rng.pick(&fixed).to_vec(),
    }
}

fn hostile_double(rng: &mut Rng) -> [u8; 8] {
    let values = [
        packed::MAX_EXACT as f64,
        (1u64 << 53) as f64,
        f64::NAN,
        f64::INFINITY,
        -1.0,
        0.5,
        0.0,
        1.0,
        16.0,
        17.0,
        1e4,
        1e12,
        f64::MAX,
    ];
    if rng.below(4) == 0 {
        rng.next().to_le_bytes()
    } else {
        rng.pick(&values).to_le_bytes()
    }
}

/// `command` changed in one to three places.
fn mutate(rng: &mut Rng, mut command: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    for _ in 0..=rng.below(3) {
        if command.len() < 2 {
            break;
        }
        let i = 1 + rng.below(command.len() - 1);
        match rng.below(7) {
            0 => command[i] = hostile(rng),
            1 | 2
                if command[i].len() >= 8 * packed::HEADER && command[i].len().is_multiple_of(8) =>
            {
                let at = rng.below(command[i].len() / 8);
                let v = hostile_double(rng);
                command[i][8 * at..8 * at + 8].copy_from_slice(&v);
            }
            3 => {
                command.remove(i);
            }
            4 => {
                let arg = command[i].clone();
                command.insert(i, arg);
            }
            5 => {
                let len = rng.below(command[i].len() + 1);
                command[i].truncate(len);
            }
            _ => {
                let j = 1 + rng.below(command.len() - 1);
                command.swap(i, j);
            }
        }
    }
    command
}

/// A value someone else might have left at one of the store's keys.
fn foreign(rng: &mut Rng, con: &mut Connection) {
    let key = rng.pick(&all_keys()).clone();
    let _: Value = redis::cmd("DEL").arg(&key).query(con).unwrap();
    let _: Value = match rng.below(6) {
        // The value that stalled the server for 26 s: 4 MiB of distinct entries.
        0 => redis::cmd("SET").arg(&key).arg(big_state()).query(con),
        1 => redis::cmd("RPUSH").arg(&key).arg("x").arg("1").query(con),
        2 => redis::cmd("HSET").arg(&key).arg("f").arg("v").query(con),
        3 => redis::cmd("RPUSH")
            .arg(&key)
            .arg("1700000000000000")
            .arg("nope")
            .query(con),
        // A value of the state's shape whose values are anyone's.
        _ => {
            let layout = packed::pack_check(&RULES[1].parse().unwrap(), None, 1, 0, None);
            let (header, _) = packed::Header::parse(&layout).unwrap();
            let mut raw: Vec<u8> = (0..header.width)
                .flat_map(|_| hostile_double(rng))
                .collect();
            raw[..8].copy_from_slice(&(header.layout as f64).to_le_bytes());
            redis::cmd("SET").arg(&key).arg(raw).query(con)
        }
    }
    .unwrap();
}

/// 4 MiB of entries `{id, 0}` of distinct identities after a layout value.
fn big_state() -> Vec<u8> {
    let mut raw = Vec::with_capacity(4 << 20);
    raw.extend_from_slice(&1f64.to_le_bytes());
    let mut id = 1_000u64;
    while raw.len() + 16 <= 4 << 20 {
        raw.extend_from_slice(&(id as f64).to_le_bytes());
        raw.extend_from_slice(&0f64.to_le_bytes());
        id += 1;
    }
    raw
}

/// Every key's value and absolute expiry, but for keys that expire within a second
/// (they may expire between two snapshots); a key that expires later and is gone from
/// a later snapshot was deleted.
fn snapshot(con: &mut Connection) -> Snapshot {
    let keys = all_keys();
    let mut pipe = redis::pipe();
    pipe.cmd("TIME");
    for key in &keys {
        pipe.cmd("DUMP").arg(key).cmd("PEXPIRETIME").arg(key);
    }
    let replies: Vec<Value> = pipe.query(con).expect("snapshot");
    let now_ms = match &replies[0] {
        Value::Array(t) => match (&t[0], &t[1]) {
            (Value::BulkString(s), Value::BulkString(us)) => {
                let s: i64 = std::str::from_utf8(s).unwrap().parse().unwrap();
                let us: i64 = std::str::from_utf8(us).unwrap().parse().unwrap();
                s * 1000 + us / 1000
            }
            other => panic!("TIME: {other:?}"),
        },
        other => panic!("TIME: {other:?}"),
    };
    let keys = keys
        .into_iter()
        .zip(replies[1..].chunks(2))
        .map(|(key, pair)| {
            let at = match pair[1] {
                Value::Int(at) => at,
                _ => -2,
            };
            (key, pair[0].clone(), at)
        })
        .collect();
    Snapshot { now_ms, keys }
}

/// The limiter keys at a time.
#[derive(Debug)]
struct Snapshot {
    now_ms: i64,
    keys: Vec<(Vec<u8>, Value, i64)>,
}

impl Snapshot {
    /// The keys that exist and last past a second after `now_ms`.
    fn lasting(&self, now_ms: i64) -> Vec<&(Vec<u8>, Value, i64)> {
        self.keys
            .iter()
            .filter(|(_, _, at)| *at == -1 || *at > now_ms + 1_000)
            .collect()
    }
}

/// Whether `after` holds what `before` held, for every key of `before` that would not
/// have expired by now, and nothing new that lasts.
fn unchanged(before: &Snapshot, after: &Snapshot) -> bool {
    before.lasting(after.now_ms) == after.lasting(after.now_ms)
}

fn show(command: &[Vec<u8>]) -> String {
    command
        .iter()
        .map(|a| {
            if a.len() > 48 {
                format!("<{} bytes>", a.len())
            } else {
                format!("{:?}", String::from_utf8_lossy(a))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn fuzz(server: &RedisServer) {
    let iterations: usize = std::env::var("RATELIMIT_FUZZ_ITERATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3_000);
    let seed: u64 = std::env::var("RATELIMIT_FUZZ_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0x5eed_2026_1127);
    let mut rng = Rng(seed | 1);
    let mut con = common::conn(&server.url());
    let (mut refused, mut answered) = (0, 0);
    for i in 0..iterations {
        if rng.below(25) == 0 {
            foreign(&mut rng, &mut con);
        }
        let mut command = seed_command(&mut rng);
        // One in four goes as the store would send it: the keys fill with its values and
        // the module's rule cache with its rules.
        if rng.below(4) != 0 {
            command = mutate(&mut rng, command);
        }
        let before = snapshot(&mut con);
        let mut cmd = redis::cmd(std::str::from_utf8(&command[0]).unwrap());
        for arg in &command[1..] {
            cmd.arg(&arg[..]);
        }
        let case = || format!("command {i} of seed {seed}: {}", show(&command));
        match cmd.query::<Value>(&mut con) {
            Ok(_) => answered += 1,
            Err(e) => {
                assert!(
                    !matches!(
                        e.kind(),
                        ErrorKind::Io | ErrorKind::Parse | ErrorKind::Client
                    ),
                    "an unparseable reply or a broken connection ({e}) for {}",
                    case()
                );
                let text = e.to_string();
                assert!(
                    text.is_ascii(),
                    "an error that is not ASCII: {text:?} for {}",
                    case()
                );
                let after = snapshot(&mut con);
                assert!(
                    unchanged(&before, &after),
                    "a command answered with an error ({text}) changed a key: {}\n\
                     before: {:?}\nafter: {:?}",
                    case(),
                    before.lasting(after.now_ms),
                    after.lasting(after.now_ms)
                );
                refused += 1;
            }
        }
        let pong: String = redis::cmd("PING")
            .query(&mut con)
            .unwrap_or_else(|e| panic!("no PING after {}: {e}", case()));
        assert_eq!(pong, "PONG");
    }
    assert!(
        refused > iterations / 10 && answered > iterations / 10,
        "{refused} refused, {answered} answered: the mutations miss one side"
    );
    eprintln!(
        "{iterations} commands ({refused} refused, {answered} answered) on {}",
        server.url()
    );
}

#[test]
fn random_and_mutated_commands_on_redis() {
    fuzz(&RedisServer::start_with_module());
}

#[test]
fn random_and_mutated_commands_on_valkey() {
    fuzz(&RedisServer::start_valkey_with_module());
}

fn state_key(tag: &str) -> Vec<u8> {
    name(tag, 's')
}

/// The command that aborted redis-server: a check whose rule bytes the module had
/// cached, under a header claiming a state of 2^53 - 1 values.
#[test]
fn a_header_lying_about_known_rules_is_refused() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let good = pack(RULES[0], 1, false);
    let keys = [name(TAGS[0], 'b'), state_key(TAGS[0])];
    let _: Vec<u8> = redis::cmd("RATELIMIT.CHECK")
        .arg(&keys[..])
        .arg(&good)
        .query(&mut con)
        .expect("a check the store would send");
    let before = snapshot(&mut con);
    for (index, lie) in [(5, packed::MAX_EXACT as f64), (6, 1e4), (7, 1e9)] {
        let mut bad = good.clone();
        bad[8 * index..8 * index + 8].copy_from_slice(&lie.to_le_bytes());
        let err = redis::cmd("RATELIMIT.CHECK")
            .arg(&keys[..])
            .arg(&bad)
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{err}");
        assert!(err.to_string().is_ascii(), "{err}");
    }
    assert!(unchanged(&before, &snapshot(&mut con)));
}

/// The value that stalled redis-server: 4 MiB at a state key is read as fresh after a
/// look at its length, and replaced by a check; the module spends no more on it than the
/// Lua script does on the same value.
#[test]
fn a_four_mib_value_is_replaced_without_a_stall() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let good = pack(RULES[0], 1, false);
    let script = ratelimit_redis::testing::check_script();
    for tag in [TAGS[0], TAGS[1]] {
        let _: Value = redis::cmd("SET")
            .arg(state_key(tag))
            .arg(big_state())
            .query(&mut con)
            .unwrap();
        let mut cmd = if tag == TAGS[0] {
            redis::cmd("RATELIMIT.CHECK")
        } else {
            let mut eval = redis::cmd("EVAL");
            eval.arg(script.body).arg(2);
            eval
        };
        let reply: Vec<u8> = cmd
            .arg(name(tag, 'b'))
            .arg(state_key(tag))
            .arg(&good)
            .query(&mut con)
            .expect("a decision");
        // Status 2: a value this store did not write was found and replaced.
        assert_eq!(&reply[..8], &2f64.to_le_bytes(), "{tag}");
        let len: usize = redis::cmd("STRLEN")
            .arg(state_key(tag))
            .query(&mut con)
            .unwrap();
        assert!(len < 1024, "the state was replaced: {len} bytes");
    }
    let stats = common::commandstats(&mut con);
    let (module, lua) = (stats["ratelimit.check"].1, stats["eval"].1);
    // The module looks at the value's length; Lua decodes 4 MiB of doubles. Generous
    // (the quadratic walk it replaces took 300 times Lua's time).
    assert!(
        module <= lua.max(1_000.0),
        "the module took {module} us on the 4 MiB value, Lua {lua} us"
    );
}

/// Error replies are ASCII: a message about a time in µs arrives as "us".
#[test]
fn error_replies_are_ascii_and_parse() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let mut bad = pack(RULES[0], 1, false);
    // A sliding-log rule with a log period the header does not carry.
    let log = pack(RULES[2], 1, false);
    bad.clone_from(&log);
    bad[8 * 7..8 * 7 + 8].copy_from_slice(&123f64.to_le_bytes());
    let err = redis::cmd("RATELIMIT.CHECK")
        .arg(name(TAGS[2], 'b'))
        .arg(state_key(TAGS[2]))
        .arg(name(TAGS[2], 'l'))
        .arg(&bad)
        .query::<Value>(&mut con)
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("RLARGS") && text.contains(" us"), "{text}");
    assert!(text.is_ascii(), "{text:?}");
    // The connection is still usable.
    let pong: String = redis::cmd("PING").query(&mut con).unwrap();
    assert_eq!(pong, "PONG");
    // A client's bytes quoted in a message are escaped.
    let err = redis::cmd("RATELIMIT.CHECK_MANY")
        .arg(1)
        .arg("k")
        .arg("µ\u{0}\r\n")
        .arg(pack(RULES[0], 1, false))
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("\\x"), "{err}");
    assert!(err.to_string().is_ascii(), "{err}");
}

/// Refused writes write nothing: a block past 2^53 us, a TTL floor that would wrap the
/// expiry into the past, a refund's charge time that is no number.
#[test]
fn refused_commands_write_nothing() {
    let server = RedisServer::start_with_module();
    let mut con = common::conn(&server.url());
    let marker = name(TAGS[0], 'b');
    let before = snapshot(&mut con);
    for (now, length, floor) in [
        ("", "9223372036854775808", "0"),
        ("", "18446744073709551615", "0"),
        ("1700000000000000", "5000000", "18446744073709551615"),
        ("18446744073709551615", "1", "0"),
        ("", "4503599627370497", "0"),
        ("abc", "1", "0"),
        // A TTL floor is checked under the server's clock too, where it goes unused.
        ("", "1", "abc"),
        ("", "", "abc"),
        ("", "1", "18446744073709551615"),
        ("", "", "9007199254740993"),
    ] {
        let err = redis::cmd("RATELIMIT.BLOCK")
            .arg(&marker)
            .arg(now)
            .arg(length)
            .arg(floor)
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{err}");
        assert!(
            unchanged(&before, &snapshot(&mut con)),
            "{now} {length} {floor}"
        );
    }
    let err = redis::cmd("RATELIMIT.GIVE_BACK")
        .arg(state_key(TAGS[0]))
        .arg(pack(RULES[0], 1, false))
        .arg("not a time")
        .query::<Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("RLARGS"), "{err}");
    // A debit whose keys do not match its rules (a sliding log without its log's key,
    // or a log's key without one) is refused before anything is read or written.
    for (rules, keys) in [(RULES[2], 1), (RULES[0], 2)] {
        let mut cmd = redis::cmd("RATELIMIT.DEBIT");
        cmd.arg(state_key(TAGS[0]));
        if keys == 2 {
            cmd.arg(state_key(TAGS[0]));
        }
        let err = cmd
            .arg(pack(rules, 5, false))
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{err}");
        assert!(unchanged(&before, &snapshot(&mut con)), "{rules}");
    }
    // Slots: a state holding one, then releases and renewals with bad arguments.
    let state = state_key(TAGS[0]);
    redis::cmd("RATELIMIT.CHECK_STATE")
        .arg(&state)
        .arg({
            let mut refs = Vec::new();
            packed::write_ref(&mut refs, 0, None);
            refs
        })
        .arg(pack(RULES[4], 1, true))
        .query::<Value>(&mut con)
        .unwrap();
    let before = snapshot(&mut con);
    for args in [
        vec!["RATELIMIT.RELEASE", "", "x"],
        vec!["RATELIMIT.RELEASE", "9007199254740993", "1700000000000000"],
        vec!["RATELIMIT.RELEASE", ""],
        vec!["RATELIMIT.RENEW", "", "1700000000000000", "0", "0"],
        vec!["RATELIMIT.RENEW", "", "1700000000000000", "3600000001", "0"],
        vec!["RATELIMIT.RENEW", "", "1700000000000000", "1000000", "-1"],
        // A TTL floor near 2^64 would wrap the key's expiry: refused, the deadline kept.
        vec![
            "RATELIMIT.RENEW",
            "",
            "1700000000000000",
            "1000000",
            "18446744073709551614",
        ],
        vec![
            "RATELIMIT.RENEW",
            "1700000000000000",
            "1700000000000000",
            "1000000",
            "18446744073709551614",
        ],
        vec!["RATELIMIT.RENEW", "", "1700000000000000", "1000000", "abc"],
    ] {
        let err = redis::cmd(args[0])
            .arg(&state)
            .arg(&args[1..])
            .query::<Value>(&mut con)
            .unwrap_err();
        assert!(err.to_string().contains("RLARGS"), "{args:?}: {err}");
        assert!(unchanged(&before, &snapshot(&mut con)), "{args:?}");
    }
    // The slot the check took, released once.
    let release = || {
        redis::cmd("RATELIMIT.RELEASE")
            .arg(&state)
            .arg("1700000000000000")
            .arg("1700000000000000")
            .query::<i64>(&mut common::conn(&server.url()))
            .unwrap()
    };
    assert_eq!((release(), release()), (1, 0));
}
