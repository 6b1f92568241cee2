//! The Lua scripts, the layout of their arguments, and how their replies become decisions.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use ratelimit_core::{Algorithm, Clock, Decision, LeakyMode, Rule, RuleOutcome, RuleSet};
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

use crate::error::RedisStoreError;
use crate::keys::KeyNames;

/// A Lua script and its SHA1, run with EVALSHA; the decision script also as a Redis
/// function library, run with FCALL.
#[derive(Debug)]
pub(crate) struct Script {
    body: String,
    sha: String,
    function: Option<Function>,
}

/// A script as a Redis 7 function library: the library code and the function's name.
/// Both carry the script's SHA1, so stores of different versions sharing a server each
/// find their own.
#[derive(Debug)]
struct Function {
    library: String,
    name: String,
}

fn sha1(body: &str) -> String {
    redis::Script::new(body).get_hash().to_owned()
}

impl Script {
    fn new(body: String) -> Self {
        let sha = sha1(&body);
        Self {
            body,
            sha,
            function: None,
        }
    }

    /// check.lua as three scripts, `check`, `check_many` and `check_local`, and one
    /// function library registering all three under names tagged with the SHA1 of the
    /// first.
    fn decision_scripts() -> (Self, Self, Self) {
        let code = include_str!("../lua/check.lua");
        let one = format!("{code}{EVAL_TAIL}");
        let sha = sha1(&one);
        let tag = &sha[..16];
        let library = format!(
            "#!lua name=ratelimit_{tag}\n{code}\n\
             redis.register_function('ratelimit_check_{tag}', check)\n\
             redis.register_function('ratelimit_batch_{tag}', check_many)\n\
             redis.register_function{{function_name='ratelimit_local_{tag}', \
             callback=check_local, flags={{'allow-cross-slot-keys'}}}}\n"
        );
        let local = Self {
            function: Some(Function {
                library: library.clone(),
                name: format!("ratelimit_local_{tag}"),
            }),
            ..Self::new(format!("{code}{LOCAL_TAIL}"))
        };
        let many = Self {
            function: Some(Function {
                library: library.clone(),
                name: format!("ratelimit_batch_{tag}"),
            }),
            ..Self::new(format!("{code}{BATCH_TAIL}"))
        };
        let one = Self {
            function: Some(Function {
                library,
                name: format!("ratelimit_check_{tag}"),
            }),
            body: one,
            sha,
        };
        (one, many, local)
    }

    /// The `SCRIPT LOAD` command for this script.
    pub(crate) fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&self.body);
        cmd
    }

    /// The `FUNCTION LOAD` command for this script's library, if it has one.
    pub(crate) fn function_load_cmd(&self) -> Option<Cmd> {
        let function = self.function.as_ref()?;
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&function.library);
        Some(cmd)
    }

    /// `FCALL <function>` when `functions` says the server has them and this script is a
    /// library, else `EVALSHA <sha>`; then the number of keys, to be followed by the keys
    /// and arguments.
    pub(crate) fn call<'a>(
        &'static self,
        functions: &'a AtomicBool,
        keys: usize,
        capacity: usize,
    ) -> Call<'a> {
        let mut cmd = Cmd::with_capacity(3 + capacity, 64 + 48 * capacity);
        let fcall = match &self.function {
            Some(function) if functions.load(Ordering::Relaxed) => {
                cmd.arg("FCALL").arg(function.name.as_str());
                true
            }
            _ => {
                cmd.arg("EVALSHA").arg(self.sha.as_str());
                false
            }
        };
        cmd.arg(keys);
        Call {
            script: self,
            cmd,
            fcall,
            functions,
        }
    }
}

/// What the script form of check.lua appends to the file.
const EVAL_TAIL: &str = "\nreturn check(KEYS, ARGV)\n";
/// What the batch script form of check.lua appends to the file.
const BATCH_TAIL: &str = "\nreturn check_many(KEYS, ARGV)\n";
/// What the node batch script form of check.lua appends to the file.
const LOCAL_TAIL: &str = "\nreturn check_local(KEYS, ARGV)\n";

/// The decision script, the batch script and the node batch script; see `lua/check.lua` for their contracts.
static DECISIONS: LazyLock<(Script, Script, Script)> = LazyLock::new(Script::decision_scripts);
/// The decision script: one check.
pub(crate) static CHECK: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS.0);
/// The batch script: many checks in one call.
pub(crate) static BATCH: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS.1);
/// The node batch function: many checks of any slots one Cluster node serves, in one call.
pub(crate) static LOCAL: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS.2);
/// The block script; see `lua/block.lua` for its contract.
pub(crate) static BLOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/block.lua").to_owned()));

/// The refund script of lease mode; see `lua/refund.lua` for its contract.
pub(crate) static REFUND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/refund.lua").to_owned()));

/// The decision script: its body as sent with `SCRIPT LOAD`, its SHA1, its function
/// library, the function's name and the batch function's name.
#[cfg(feature = "testing")]
pub(crate) fn check_forms() -> [&'static str; 5] {
    let function = CHECK.function.as_ref().expect("check.lua is a library");
    let batch = BATCH.function.as_ref().expect("check.lua is a library");
    [
        &CHECK.body,
        &CHECK.sha,
        &function.library,
        &function.name,
        &batch.name,
    ]
}

/// The scripts a store loads when it connects.
pub(crate) fn scripts() -> [&'static Script; 3] {
    [*CHECK, &BLOCK, &REFUND]
}

/// Whether the server answered that it has no such function (a restart, `FUNCTION
/// FLUSH`, a new node).
fn function_missing(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// Whether the server does not know the command (FCALL before Redis 7).
pub(crate) fn unknown_command(e: &RedisError) -> bool {
    e.to_string().contains("unknown command")
}

/// Whether a `FUNCTION LOAD` failed only because the library is there already.
pub(crate) fn already_loaded(e: &RedisError) -> bool {
    e.to_string().contains("already exists")
}

/// One script call: `FCALL` of the decision function or `EVALSHA` of a script, resent
/// after loading what the server lacks.
#[derive(Debug)]
pub(crate) struct Call<'a> {
    script: &'static Script,
    pub(crate) cmd: Cmd,
    fcall: bool,
    /// Cleared, for every later call of the store, when the server has no FCALL.
    functions: &'a AtomicBool,
}

impl Call<'_> {
    /// Runs the call. A server that lost the function library (restart, failover to a
    /// node without it) gets it again and the call is resent; a server without
    /// functions (Redis 6.2) gets EVALSHA from now on. EVALSHA falls back to EVAL (which
    /// also caches the script in the server that answers) when that server does not know
    /// the script: after `SCRIPT FLUSH`, a restart, or a failover. Every resend goes to
    /// the node owning the keys, which makes it right for Redis Cluster too.
    pub(crate) async fn invoke<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> RedisResult<Value> {
        match self.cmd.query_async(conn).await {
            Err(e) if self.fcall && function_missing(&e) => {
                tracing::debug!("rate-limit function not loaded in Redis; loading it");
                if let Some(load) = self.script.function_load_cmd() {
                    match load.query_async::<Value>(conn).await {
                        Err(e) if !already_loaded(&e) => return Err(e),
                        _ => {}
                    }
                }
                self.cmd.query_async(conn).await
            }
            Err(e) if self.fcall && unknown_command(&e) => {
                tracing::info!("Redis has no FCALL (before 7.0); using EVALSHA");
                self.functions.store(false, Ordering::Relaxed);
                let mut evalsha = redis::cmd("EVALSHA");
                evalsha.arg(self.script.sha.as_str());
                self.resend(conn, evalsha).await
            }
            Err(e) if !self.fcall && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                tracing::debug!("rate-limit script not cached by Redis; sending it with EVAL");
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.script.body);
                self.with_head(eval).query_async(conn).await
            }
            other => other,
        }
    }

    /// This call's keys and arguments after `head` (EVAL or EVALSHA and the script).
    fn with_head(&self, mut head: Cmd) -> Cmd {
        for arg in self.cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                head.arg(bytes);
            }
        }
        head
    }

    /// Sends the call as `head`, then as EVAL if the server does not know the script.
    async fn resend<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        head: Cmd,
    ) -> RedisResult<Value> {
        match self.with_head(head).query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.script.body);
                self.with_head(eval).query_async(conn).await
            }
            other => other,
        }
    }
}

impl Call<'_> {
    /// Runs the call on the Cluster node `routing` names. A node that lost the function
    /// library gets it again (on every primary) and the call is resent there; a node
    /// without functions fails the call, having run nothing, and turns FCALL off for
    /// the store.
    pub(crate) async fn invoke_routed(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
        routing: &redis::cluster_routing::RoutingInfo,
    ) -> RedisResult<Value> {
        match conn.route_command(self.cmd.clone(), routing.clone()).await {
            Err(e) if self.fcall && function_missing(&e) => {
                if let Some(load) = self.script.function_load_cmd() {
                    match load.query_async::<Value>(conn).await {
                        Err(e) if !already_loaded(&e) => return Err(e),
                        _ => {}
                    }
                }
                conn.route_command(self.cmd.clone(), routing.clone()).await
            }
            Err(e) if self.fcall && unknown_command(&e) => {
                // Nothing ran; the caller sends each check alone from now on.
                tracing::info!("Redis has no FCALL (before 7.0); using EVALSHA");
                self.functions.store(false, Ordering::Relaxed);
                Err(e)
            }
            other => other,
        }
    }
}

/// A request to Redis: a script call or a plain command.
#[derive(Debug)]
pub(crate) enum Request<'a> {
    /// A script, with the NOSCRIPT fallback.
    Call(Call<'a>),
    /// A plain command.
    Cmd(Cmd),
}

impl Request<'_> {
    pub(crate) async fn send<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<Value> {
        match self {
            Request::Call(call) => call.invoke(conn).await,
            Request::Cmd(cmd) => cmd.query_async(conn).await,
        }
    }
}

/// Algorithm codes of `lua/check.lua`, in the order of the core's algorithm files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Code {
    FixedWindow = 1,
    SlidingWindow = 2,
    SlidingLog = 3,
    TokenBucket = 4,
    LeakyBucket = 5,
    Gcra = 6,
}

/// The argument layout of `lua/check.lua` and the shape of its reply: the one place both
/// are written down on the Rust side.
///
/// The one argument, `ARGV[1]`, packs [`HEADER`](Self::HEADER) values (injected, now,
/// cost, TTL floor, rules, state width, log limit, log period, layout, deadline) and
/// [`PER_RULE`](Self::PER_RULE) per rule (`code, limit, period_us, a, b, id`) as
/// little-endian doubles, so that the script reads every argument in one C call instead
/// of parsing text (the script derives the struct formats from the lengths). The reply is one string
/// of little-endian doubles, every one an integer (cheaper for Redis to send than an
/// array): `{1, block left}`, `{3, Redis time}` or `{status, delay, 4 values per rule}`.
/// The deadline is on the Redis clock whatever the check's own clock, so a check on an
/// injected clock is turned away past it too.
#[derive(Debug)]
pub(crate) struct CheckArgs;

/// Where a check takes its time from, and when its caller stops waiting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Time {
    /// The injected clock's reading; `None`: Redis `TIME`.
    pub(crate) now: Option<u64>,
    /// The caller's deadline on the Redis clock, when known (whatever `now` is).
    pub(crate) deadline: Option<u64>,
}

impl Time {
    /// An injected time without a deadline.
    #[cfg(test)]
    pub(crate) fn injected(now: u64) -> Self {
        Self {
            now: Some(now),
            deadline: None,
        }
    }
}

/// This host's monotonic clock against the Redis server's, learned from Redis `TIME`
/// readings: enough to tell the script when the caller stops waiting.
#[derive(Debug)]
pub(crate) struct RedisClock {
    base: Instant,
    /// Redis time minus monotonic µs since `base`; `i64::MIN` until a reading arrives.
    offset_us: AtomicI64,
}

impl RedisClock {
    pub(crate) fn new() -> Self {
        Self {
            base: Instant::now(),
            offset_us: AtomicI64::new(i64::MIN),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(i64::MAX)
    }

    /// Records that Redis read `redis_us` at some instant before `received`. The reply
    /// took time to arrive, so a reading puts the offset too low, never too high: the
    /// largest one is the closest. Keeping the largest also means a deadline is never
    /// earlier than the caller's real one (a Cluster's nodes: the fastest clock wins).
    pub(crate) fn observe(&self, redis_us: u64, received: Instant) {
        let offset = i64::try_from(redis_us).unwrap_or(i64::MAX) - self.local_us(received);
        self.offset_us.fetch_max(offset, Ordering::Relaxed);
    }

    /// The instant `timeout` from now on the Redis clock, once a reading arrived.
    fn deadline(&self, timeout: Duration) -> Option<u64> {
        let offset = self.offset_us.load(Ordering::Relaxed);
        if offset == i64::MIN {
            return None;
        }
        let timeout = i64::try_from(timeout.as_micros()).unwrap_or(i64::MAX);
        let at = self
            .local_us(Instant::now())
            .saturating_add(offset)
            .saturating_add(timeout);
        u64::try_from(at).ok().filter(|&at| at <= MAX_EXACT)
    }
}

/// Values above this are not exact in Lua's doubles.
const MAX_EXACT: u64 = (1 << 53) - 1;

impl CheckArgs {
    /// Values before the first rule.
    pub(crate) const HEADER: usize = 10;
    /// Values per rule.
    pub(crate) const PER_RULE: usize = 6;

    /// The layout of a rule set's state: its fingerprint, cut to what a double holds.
    fn layout(rules: &RuleSet) -> u64 {
        rules.fingerprint() & ((1 << 52) - 1)
    }

    /// The values of one rule: code, limit, period_us, a, b, id.
    fn rule(rule: &Rule, id: u64) -> [u64; 6] {
        let (l, p) = (rule.limit(), rule.period_us());
        let (code, a, b) = match rule.algorithm() {
            Algorithm::FixedWindow => (Code::FixedWindow, 0, 0),
            // The core refuses a precision that does not divide the period.
            Algorithm::SlidingWindow { precision } => {
                (Code::SlidingWindow, precision, p / precision.max(1))
            }
            Algorithm::SlidingLog => (Code::SlidingLog, 0, 0),
            Algorithm::TokenBucket { capacity } => (Code::TokenBucket, capacity, 0),
            Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => {
                (Code::LeakyBucket, capacity, 0)
            }
            // `delay + 1` keeps 0 free for "meter"; the core bounds delay far below u64::MAX.
            Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
                (Code::LeakyBucket, burst, delay.saturating_add(1))
            }
            Algorithm::Gcra { burst } => (Code::Gcra, burst, 0),
        };
        [code as u64, l, p, a, b, id]
    }

    /// Values the script keeps for a rule set: the layout; an entry per rule but the
    /// sliding logs (identity, length, then the state: 2 values for a fixed window,
    /// precision + 2 for a sliding window counter, the writer's limit and capacity and
    /// 2 values for the others); and the log marker (3 values) when a rule is a
    /// sliding log.
    fn state_width(rules: &RuleSet) -> u64 {
        let entries: u64 = rules
            .rules()
            .iter()
            .map(|rule| match rule.algorithm() {
                Algorithm::SlidingLog => 0,
                Algorithm::FixedWindow => 2 + 2,
                Algorithm::SlidingWindow { precision } => 2 + precision + 2,
                _ => 2 + 4,
            })
            .sum();
        let marker = if rules.log_limit() > 0 { 3 } else { 0 };
        1 + entries + marker
    }

    /// Every packed value of a check, in order.
    fn values(
        time: Time,
        cost: u64,
        ttl_floor_ms: u64,
        rules: &RuleSet,
    ) -> impl Iterator<Item = u64> + '_ {
        let header = [
            u64::from(time.now.is_some()),
            time.now.unwrap_or(0),
            cost,
            ttl_floor_ms.min(MAX_EXACT),
            rules.len() as u64,
            Self::state_width(rules),
            rules.log_limit(),
            rules.log_period_us(),
            Self::layout(rules),
            time.deadline.unwrap_or(0),
        ];
        header.into_iter().chain(
            rules
                .rules()
                .iter()
                .zip(rules.rule_ids())
                .flat_map(|(rule, &id)| Self::rule(rule, id)),
        )
    }

    /// The one argument of a check: its values packed.
    fn pack(time: Time, cost: u64, ttl_floor_ms: u64, rules: &RuleSet) -> Vec<u8> {
        let count = Self::HEADER + Self::PER_RULE * rules.len();
        let mut packed = Vec::with_capacity(8 * count);
        for value in Self::values(time, cost, ttl_floor_ms, rules) {
            // Exact: rules, costs and times stay below 2^53 (see the tests).
            packed.extend_from_slice(&(value as f64).to_le_bytes());
        }
        packed
    }

    /// Appends the arguments of a check to `cmd`.
    fn write(cmd: &mut Cmd, time: Time, cost: u64, ttl_floor_ms: u64, rules: &RuleSet) {
        cmd.arg(Self::pack(time, cost, ttl_floor_ms, rules));
    }

    /// The length in bytes of the reply at the start of `bytes` in a batch reply, for a
    /// check of `rules` rules: `Ok` for a decision, `Err` with the message's range for a
    /// check that failed; `None` when `bytes` cannot hold one.
    pub(crate) fn reply_len(
        rules: usize,
        bytes: &[u8],
    ) -> Option<Result<usize, std::ops::Range<usize>>> {
        let value = |i: usize| {
            let chunk = bytes.get(8 * i..8 * i + 8)?;
            Some(f64::from_le_bytes(chunk.try_into().ok()?))
        };
        let len = match value(0)? {
            -1.0 => {
                let n = value(1)?;
                if !(n >= 0.0 && n.fract() == 0.0 && n <= bytes.len() as f64) {
                    return None;
                }
                let range = 16..16 + n as usize;
                return (range.end <= bytes.len()).then_some(Err(range));
            }
            1.0 | 3.0 => 16,
            0.0 | 2.0 => 16 + 32 * rules,
            _ => return None,
        };
        (len <= bytes.len()).then_some(Ok(len))
    }

    /// The arguments of a check, for tools that send the script by hand.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn to_args(
        time: Time,
        cost: u64,
        ttl_floor_ms: u64,
        rules: &RuleSet,
    ) -> Vec<Vec<u8>> {
        let mut cmd = Cmd::new();
        Self::write(&mut cmd, time, cost, ttl_floor_ms, rules);
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Turns the script's reply into a [`Decision`]; the flag says the script found and
    /// discarded a value it did not write. `Ok(None)` with the Redis time: the check
    /// arrived past its deadline and was not run.
    pub(crate) fn decision(
        rules: &RuleSet,
        reply: &Value,
    ) -> Result<Result<(Decision, bool), u64>, RedisStoreError> {
        let Value::BulkString(bytes) = reply else {
            return Err(unexpected("the check script should return a string", reply));
        };
        Self::decision_from(rules, bytes)
    }

    /// As [`decision`](Self::decision), from the reply's bytes.
    pub(crate) fn decision_from(
        rules: &RuleSet,
        bytes: &[u8],
    ) -> Result<Result<(Decision, bool), u64>, RedisStoreError> {
        let reply = &Bytes(bytes);
        let mut ints = [0i64; 2 + 4 * ratelimit_core::MAX_RULES];
        if !bytes.len().is_multiple_of(8) {
            return Err(unexpected("the reply should be whole doubles", reply));
        }
        if bytes.len() / 8 > ints.len() {
            return Err(unexpected("too many values", reply));
        }
        for (slot, chunk) in ints.iter_mut().zip(bytes.chunks_exact(8)) {
            let x = f64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            // Exact integers only: the script's values stay below 2^53.
            if !(x.fract() == 0.0 && x.abs() <= MAX_EXACT as f64) {
                return Err(unexpected("the check script should return integers", reply));
            }
            *slot = x as i64;
        }
        let ints = &ints[..bytes.len() / 8];
        let us = |n: i64| u64::try_from(n).map(Duration::from_micros).ok();
        match ints {
            [1, -1] => Ok(Ok((Decision::blocked(None), false))),
            [1, left] => us(*left)
                .map(|left| Ok((Decision::blocked(Some(left)), false)))
                .ok_or_else(|| unexpected("a block's time left cannot be negative", reply)),
            [3, now] => u64::try_from(*now)
                .map(Err)
                .map_err(|_| unexpected("Redis time cannot be negative", reply)),
            [status @ (0 | 2), delay, per_rule @ ..] if per_rule.len() == 4 * rules.len() => {
                let delay = us(*delay).ok_or_else(|| unexpected("negative delay", reply))?;
                let mut outcomes = Vec::with_capacity(rules.len());
                for (rule, r) in rules.rules().iter().zip(per_rule.chunks_exact(4)) {
                    let (Some(remaining), Some(reset), Some(retry)) =
                        (u64::try_from(r[1]).ok(), us(r[2]), us(r[3]))
                    else {
                        return Err(unexpected("negative rule values", reply));
                    };
                    let allowed = match r[0] {
                        1 => true,
                        0 => false,
                        _ => return Err(unexpected("allowed must be 0 or 1", reply)),
                    };
                    outcomes.push(RuleOutcome {
                        allowed,
                        limit: rule.limit(),
                        remaining,
                        reset_after: reset,
                        retry_after: (!allowed).then_some(retry),
                    });
                }
                Ok(Ok((Decision::from_rules(outcomes, delay), *status == 2)))
            }
            _ => Err(unexpected(
                &format!(
                    "the check script should return {{1, left}} or {{0, delay, 4 values x {} rules}}",
                    rules.len()
                ),
                reply,
            )),
        }
    }
}

/// One check as a batch carries it: its key names, its packed values, its number of rules.
#[derive(Debug)]
pub(crate) struct CheckJob {
    /// The key names one after the other; each ends at `ends[i]`.
    names: String,
    ends: [usize; 3],
    keys: usize,
    packed: Vec<u8>,
    /// Rules of the check, which the length of its reply depends on.
    pub(crate) rules: usize,
}

impl CheckJob {
    /// The Redis Cluster slot of the check's keys (all share one hash tag).
    pub(crate) fn slot(&self) -> u16 {
        key_slot(&self.names.as_bytes()[..self.ends[0]])
    }

    fn key_names(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends[..self.keys].iter().map(move |&end| {
            let name = &self.names[start..end];
            start = end;
            name
        })
    }
}

/// The Redis Cluster slot of the key `name`: CRC16 (XMODEM) of its hash tag (the text
/// between the first `{` and the next `}`, when not empty), else of the whole name.
pub(crate) fn key_slot(name: &[u8]) -> u16 {
    let tag = name
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &name[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(name);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

/// The configuration of a store.
pub(crate) struct Shared {
    pub(crate) prefix: Arc<str>,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) ttl_floor_ms: u64,
    pub(crate) timeout: Duration,
    /// Whether checks run as FCALL of the function library (Redis 7) or as EVALSHA.
    pub(crate) functions: AtomicBool,
    /// The Redis clock as seen from here, for deadlines.
    pub(crate) redis_clock: RedisClock,
    /// `maxmemory-policy` as last read, when the server allowed it.
    pub(crate) maxmemory_policy: std::sync::RwLock<Option<String>>,
}

impl Shared {
    /// The time on the store's clock: the injected one, else the system's.
    pub(crate) fn now_us(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.now_us(),
            None => ratelimit_core::SystemClock.now_us(),
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("prefix", &self.prefix)
            .field(
                "clock",
                &if self.clock.is_some() {
                    "injected"
                } else {
                    "Redis TIME"
                },
            )
            .field("ttl_floor_ms", &self.ttl_floor_ms)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Block lengths are capped so that `now + length` stays exact in Lua (about 142 years).
const MAX_BLOCK_US: u64 = 1 << 52;

impl Shared {
    fn now(&self) -> Option<u64> {
        self.clock.as_ref().map(|clock| clock.now_us())
    }

    fn time(&self) -> Time {
        Time {
            now: self.now(),
            deadline: self.redis_clock.deadline(self.timeout),
        }
    }

    pub(crate) fn check_call(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Call<'_> {
        let has_log = rules.log_limit() > 0;
        let keys = 2 + usize::from(has_log);
        let mut call = CHECK.call(&self.functions, keys, keys + 1);
        let mut names = KeyNames::new(&self.prefix, key);
        call.cmd.arg(names.block());
        call.cmd.arg(names.state());
        if has_log {
            call.cmd.arg(names.log());
        }
        CheckArgs::write(&mut call.cmd, self.time(), cost, self.ttl_floor_ms, rules);
        call
    }

    /// One check as a batch carries it.
    pub(crate) fn check_job(&self, key: &[u8], rules: &RuleSet, cost: u64) -> CheckJob {
        let has_log = rules.log_limit() > 0;
        let mut names = KeyNames::new(&self.prefix, key);
        let mut all = String::with_capacity(3 * (self.prefix.len() + 48));
        let mut ends = [0; 3];
        all.push_str(names.block());
        ends[0] = all.len();
        all.push_str(names.state());
        ends[1] = all.len();
        if has_log {
            all.push_str(names.log());
        }
        ends[2] = all.len();
        CheckJob {
            names: all,
            ends,
            keys: 2 + usize::from(has_log),
            packed: CheckArgs::pack(self.time(), cost, self.ttl_floor_ms, rules),
            rules: rules.len(),
        }
    }

    /// The call that decides `job` alone: the same as [`check_call`](Self::check_call).
    pub(crate) fn single_call(&self, job: &CheckJob) -> Call<'_> {
        let mut call = CHECK.call(&self.functions, job.keys, job.keys + 1);
        for name in job.key_names() {
            call.cmd.arg(name);
        }
        call.cmd.arg(&job.packed[..]);
        call
    }

    /// The call that decides `jobs` in order, in one run of `check_many`.
    pub(crate) fn batch_call<'a, 'j>(
        &'a self,
        jobs: impl Iterator<Item = &'j CheckJob> + Clone,
    ) -> Call<'a> {
        self.many_call(&BATCH, jobs)
    }

    /// The call that decides `jobs` in order, in one run of `check_local` on the Cluster
    /// node it is sent to: the keys travel as arguments, after the packed values.
    pub(crate) fn node_batch_call<'a, 'j>(
        &'a self,
        jobs: impl Iterator<Item = &'j CheckJob> + Clone,
    ) -> Call<'a> {
        self.many_call(&LOCAL, jobs)
    }

    fn many_call<'a, 'j>(
        &'a self,
        script: &'static Script,
        jobs: impl Iterator<Item = &'j CheckJob> + Clone,
    ) -> Call<'a> {
        let (count, keys) = jobs
            .clone()
            .fold((0, 0), |(n, keys), job| (n + 1, keys + job.keys));
        let declared = std::ptr::eq(script, *BATCH);
        let mut call = script.call(
            &self.functions,
            if declared { keys } else { 0 },
            keys + 1 + count,
        );
        if declared {
            for job in jobs.clone() {
                for name in job.key_names() {
                    call.cmd.arg(name);
                }
            }
        }
        let counts: Vec<u8> = jobs.clone().map(|job| b'0' + job.keys as u8).collect();
        call.cmd.arg(counts);
        for job in jobs.clone() {
            call.cmd.arg(&job.packed[..]);
        }
        if !declared {
            for job in jobs {
                for name in job.key_names() {
                    call.cmd.arg(name);
                }
            }
        }
        call
    }

    pub(crate) fn block_call(&self, key: &[u8], duration: Option<Duration>) -> Call<'_> {
        let mut call = BLOCK.call(&self.functions, 1, 4);
        call.cmd.arg(KeyNames::new(&self.prefix, key).block());
        match self.now() {
            Some(now) => call.cmd.arg(now),
            None => call.cmd.arg(""),
        };
        match duration {
            Some(d) => call
                .cmd
                .arg(u64::try_from(d.as_micros()).map_or(MAX_BLOCK_US, |us| us.min(MAX_BLOCK_US))),
            None => call.cmd.arg(""),
        };
        call.cmd.arg(self.ttl_floor_ms);
        call
    }

    pub(crate) fn unblock_cmd(&self, key: &[u8]) -> Cmd {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(KeyNames::new(&self.prefix, key).block());
        cmd
    }

    /// Forgets every rule's state of `key`: the state and the log (a block stays).
    pub(crate) fn reset_cmd(&self, key: &[u8]) -> Cmd {
        let mut names = KeyNames::new(&self.prefix, key);
        let mut cmd = redis::cmd("DEL");
        cmd.arg(names.state());
        cmd.arg(names.log());
        cmd
    }
}

fn unexpected(what: &str, reply: &dyn std::fmt::Debug) -> RedisStoreError {
    RedisStoreError::UnexpectedReply(format!("{what}, got {reply:?}"))
}

/// A reply's bytes as the error messages show them: the doubles they pack.
struct Bytes<'a>(&'a [u8]);

impl std::fmt::Debug for Bytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for chunk in self.0.chunks(8) {
            match <[u8; 8]>::try_from(chunk) {
                Ok(bytes) => list.entry(&f64::from_le_bytes(bytes)),
                Err(_) => list.entry(&chunk),
            };
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    /// A reply as the script packs it.
    fn ints(v: &[i64]) -> Value {
        Value::BulkString(v.iter().flat_map(|&n| (n as f64).to_le_bytes()).collect())
    }

    #[test]
    fn replies_become_decisions() {
        let r = rules("10/s fixed-window; 2/s leaky-bucket mode=shaper burst=4 delay=1");
        let (d, healed) = CheckArgs::decision(&r, &ints(&[0, 500, 1, 9, 1000, 0, 1, 3, 2000, 0]))
            .unwrap()
            .unwrap();
        assert!(d.is_allowed());
        assert!(!healed);
        assert_eq!(d.delay(), Duration::from_micros(500));
        assert_eq!(d.rules()[0].remaining, 9);
        assert_eq!(d.rules()[1].limit, 2);
        let (d, healed) = CheckArgs::decision(&r, &ints(&[2, 0, 1, 9, 1000, 7, 0, 0, 2000, 300]))
            .unwrap()
            .unwrap();
        assert!(!d.is_allowed());
        assert!(healed);
        assert_eq!(d.retry_after(), Some(Duration::from_micros(300)));
        assert_eq!(d.rules()[0].retry_after, None);
        assert_eq!(
            CheckArgs::decision(&r, &ints(&[1, -1])).unwrap().unwrap().0,
            Decision::blocked(None)
        );
        assert_eq!(
            CheckArgs::decision(&r, &ints(&[1, 5])).unwrap().unwrap().0,
            Decision::blocked(Some(Duration::from_micros(5)))
        );
        assert_eq!(
            CheckArgs::decision(&r, &ints(&[3, 1_763_683_200_000_000])).unwrap(),
            Err(1_763_683_200_000_000)
        );
    }

    #[test]
    fn a_batch_reply_divides_into_one_reply_per_check() {
        let bytes = |v: &[f64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        // A decision of 2 rules, a block, a check too late, then an error entry.
        let decided = bytes(&[0.0, 0.0, 1.0, 9.0, 1.0, 0.0, 1.0, 3.0, 1.0, 0.0]);
        assert_eq!(CheckArgs::reply_len(2, &decided), Some(Ok(80)));
        assert_eq!(
            CheckArgs::reply_len(3, &decided),
            None,
            "too short for 3 rules"
        );
        assert_eq!(CheckArgs::reply_len(5, &bytes(&[1.0, -1.0])), Some(Ok(16)));
        assert_eq!(CheckArgs::reply_len(5, &bytes(&[3.0, 1e15])), Some(Ok(16)));
        let mut failed = bytes(&[-1.0, 7.0]);
        failed.extend_from_slice(b"RLSTATE and more");
        assert_eq!(CheckArgs::reply_len(1, &failed), Some(Err(16..23)));
        for bad in [
            bytes(&[-1.0, 99.0]),
            bytes(&[-1.0, 0.5]),
            bytes(&[-1.0, -3.0]),
            bytes(&[4.0, 0.0]),
            bytes(&[f64::NAN, 0.0]),
            bytes(&[1.0]),
            vec![0; 7],
        ] {
            assert_eq!(CheckArgs::reply_len(1, &bad), None, "{bad:?}");
        }
    }

    #[test]
    fn slots_follow_redis_cluster_keyslot() {
        // The examples of the CLUSTER KEYSLOT documentation.
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"foo{hash_tag}"), 2515);
        assert_eq!(key_slot(b"{hash_tag}bar"), 2515);
        // An empty tag is no tag: the whole name counts.
        assert_ne!(key_slot(b"a{}b"), key_slot(b""));
        assert_eq!(
            key_slot(b"{}{x}"),
            crc16::State::<crc16::XMODEM>::calculate(b"{}{x}") % 16384
        );
    }

    #[test]
    fn malformed_replies_are_errors() {
        let r = rules("10/s");
        for bad in [
            Value::Nil,
            Value::Int(1),
            ints(&[]),
            ints(&[0, 0, 1, 2, 3]),
            ints(&[0, 0, 2, 1, 1, 1]),
            ints(&[0, -1, 1, 1, 1, 1]),
            ints(&[3, 0, 1, 1, 1, 1]),
            ints(&[1, -2]),
            ints(&[2, 0]),
            ints(&[0; 80]),
            ints(&[0, 0, 1, 1 << 54, 1, 1]),
            Value::BulkString(vec![0; 12]),
            Value::BulkString(
                [0.0, 0.0, 1.0, 1.5, 1.0, 1.0]
                    .iter()
                    .flat_map(|x: &f64| x.to_le_bytes())
                    .collect(),
            ),
            Value::BulkString(
                [0.0, 0.0, 1.0, f64::NAN, 1.0, 1.0]
                    .iter()
                    .flat_map(|x: &f64| x.to_le_bytes())
                    .collect(),
            ),
            Value::Array(vec![
                Value::Int(0),
                Value::Int(0),
                Value::Int(1),
                Value::Int(1),
                Value::Int(1),
                Value::Int(1),
            ]),
        ] {
            let err = CheckArgs::decision(&r, &bad).unwrap_err();
            assert!(
                matches!(err, RedisStoreError::UnexpectedReply(_)),
                "{err:?}"
            );
        }
    }

    #[test]
    fn rules_are_encoded_for_the_script() {
        let r = rules(
            "5/s fixed-window; 6/s sliding-window precision=4; 7/s sliding-log; \
             8/s token-bucket capacity=9; 10/s gcra burst=3; \
             11/s leaky-bucket mode=meter capacity=4; 12/s leaky-bucket mode=shaper burst=5 delay=2",
        );
        let codes: Vec<[u64; 6]> = r
            .rules()
            .iter()
            .zip(r.rule_ids())
            .map(|(rule, &id)| CheckArgs::rule(rule, id))
            .collect();
        let s = 1_000_000;
        let ids = r.rule_ids();
        assert_eq!(
            codes,
            [
                [1, 5, s, 0, 0, ids[0]],
                [2, 6, s, 4, s / 4, ids[1]],
                [3, 7, s, 0, 0, ids[2]],
                [4, 8, s, 9, 0, ids[3]],
                [6, 10, s, 3, 0, ids[4]],
                [5, 11, s, 4, 0, ids[5]],
                [5, 12, s, 5, 3, ids[6]],
            ]
        );
        // The layout; entries of 2 + 2 (fixed window), 2 + 6 (sliding window), none (log),
        // 2 + 4 for each of the other four; the log marker.
        assert_eq!(CheckArgs::state_width(&r), 1 + 4 + 8 + 4 * 6 + 3);
        let time = Time {
            now: Some(7),
            deadline: Some(9),
        };
        let args = CheckArgs::to_args(time, 2, 60_000, &r);
        let count = CheckArgs::HEADER + CheckArgs::PER_RULE * r.len();
        assert_eq!(args.len(), 1);
        assert_eq!(args[0].len(), 8 * count);
        let values: Vec<f64> = args[0]
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let layout = (r.fingerprint() & ((1 << 52) - 1)) as f64;
        assert_eq!(
            values[..10],
            [1.0, 7.0, 2.0, 60_000.0, 7.0, 40.0, 7.0, 1e6, layout, 9.0]
        );
        assert_eq!(values[10..16], [1.0, 5.0, 1e6, 0.0, 0.0, ids[0] as f64]);
    }

    /// Builds whatever rule the core accepts from arbitrary numbers.
    fn any_rule() -> impl Strategy<Value = Option<Rule>> {
        let extreme = prop_oneof![
            Just(0u64),
            Just(1),
            Just((1 << 51) - 1),
            Just(1 << 51),
            Just((1 << 53) - 1),
            Just(1 << 53),
            Just(u64::MAX - 1),
            Just(u64::MAX),
            any::<u64>(),
            0u64..10_000,
        ];
        (
            0u8..7,
            extreme.clone(),
            extreme.clone(),
            extreme.clone(),
            extreme,
        )
            .prop_map(|(kind, limit, period_us, a, b)| {
                let period = Duration::from_micros(period_us);
                match kind {
                    0 => Rule::fixed_window(limit, period),
                    1 => Rule::sliding_window(limit, period, a),
                    2 => Rule::sliding_log(limit, period),
                    3 => Rule::token_bucket(limit, period, a),
                    4 => Rule::gcra(limit, period, a),
                    5 => Rule::leaky_meter(limit, period, a),
                    _ => Rule::leaky_shaper(limit, period, a, b),
                }
                .ok()
            })
    }

    #[test]
    fn a_shaper_burst_at_the_top_of_u64_is_refused_by_name() {
        let err = Rule::leaky_shaper(1, Duration::from_secs(1), u64::MAX, 0).unwrap_err();
        assert!(err.to_string().contains("burst"), "{err}");
    }

    proptest! {
        /// Issue 9's overflow check for the Redis encoding: whatever rule the core accepts,
        /// its arguments are computed without overflow (debug builds panic on one) and every
        /// value is exact in Lua's doubles.
        #[test]
        fn every_accepted_rule_encodes_exactly(rule in any_rule(), cost in any::<u64>(), now in any::<u64>()) {
            if let Some(rule) = rule {
                let set = RuleSet::new(vec![rule]).unwrap();
                let now = now & MAX_EXACT;
                if set.check_cost(cost).is_ok() {
                    for value in CheckArgs::values(Time::injected(now), cost, u64::MAX, &set) {
                        prop_assert!(value <= MAX_EXACT, "{}: {} is not exact in Lua", set.rules()[0], value);
                    }
                }
                let args = CheckArgs::to_args(Time::injected(now), cost, u64::MAX, &set);
                prop_assert_eq!(args[0].len(), 8 * (CheckArgs::HEADER + CheckArgs::PER_RULE));
            }
        }

        /// Whatever integers come back, decoding answers a decision or an error, never a
        /// panic.
        #[test]
        fn any_reply_decodes_or_errs(values in proptest::collection::vec(any::<i64>(), 0..12)) {
            let r = rules("10/s; 5/min sliding-log");
            let _ = CheckArgs::decision(&r, &ints(&values));
            let mut shaped = vec![0, values.first().copied().unwrap_or(0)];
            shaped.extend(values.iter().copied().chain(std::iter::repeat(1)).take(8));
            let _ = CheckArgs::decision(&r, &ints(&shaped));
        }
    }
}
