//! The Lua scripts, how they are called, and how their replies become decisions.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ratelimit_core::{Algorithm, Clock, Decision, LeakyMode, Rule, RuleOutcome, RuleSet};
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};

use crate::error::RedisStoreError;
use crate::keys;

/// A Lua script and its SHA1, run with EVALSHA.
#[derive(Debug)]
pub(crate) struct Script {
    body: &'static str,
    sha: String,
}

impl Script {
    fn new(body: &'static str) -> Self {
        Self {
            body,
            sha: redis::Script::new(body).get_hash().to_owned(),
        }
    }

    /// The `SCRIPT LOAD` command for this script.
    pub(crate) fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(self.body);
        cmd
    }
}

/// The decision script; see `lua/check.lua` for its contract.
pub(crate) static CHECK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/check.lua")));
/// The block script; see `lua/block.lua` for its contract.
pub(crate) static BLOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/block.lua")));

/// One argument of a script call.
#[derive(Debug, Clone, Copy)]
enum Arg {
    Int(u64),
    /// The empty string: "use Redis TIME" / "no end".
    Empty,
}

/// The keys and arguments of one script call.
#[derive(Debug)]
pub(crate) struct Call {
    script: &'static Script,
    keys: Vec<String>,
    args: Vec<Arg>,
}

impl Call {
    fn cmd(&self, evalsha: bool) -> Cmd {
        let mut cmd = if evalsha {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(&self.script.sha);
            cmd
        } else {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(self.script.body);
            cmd
        };
        cmd.arg(self.keys.len());
        for key in &self.keys {
            cmd.arg(key.as_str());
        }
        for arg in &self.args {
            match *arg {
                Arg::Int(n) => cmd.arg(n),
                Arg::Empty => cmd.arg(""),
            };
        }
        cmd
    }

    /// Runs the call with EVALSHA, falling back to EVAL (which also caches the script in
    /// the server that answers) when that server does not know the script: after `SCRIPT
    /// FLUSH`, a restart, or a failover. EVAL goes to the node owning the keys, which
    /// makes it right for Redis Cluster too.
    pub(crate) async fn invoke<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> RedisResult<Value> {
        match self.cmd(true).query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                tracing::debug!("rate-limit script not cached by Redis; sending it with EVAL");
                self.cmd(false).query_async(conn).await
            }
            other => other,
        }
    }
}

/// The configuration both stores share.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) prefix: Arc<str>,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) ttl_floor_ms: u64,
    pub(crate) timeout: Duration,
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

/// Integers the script stores per rule set: 2 per rule, precision + 2 for a sliding window
/// counter, none for a sliding log (whose entries live in a list).
fn state_width(rules: &RuleSet) -> u64 {
    rules
        .rules()
        .iter()
        .map(|rule| match rule.algorithm() {
            Algorithm::SlidingLog => 0,
            Algorithm::SlidingWindow { precision } => precision + 2,
            _ => 2,
        })
        .sum()
}

/// The script's encoding of a rule: code, limit, period, a, b (see `lua/check.lua`).
fn encode(rule: &Rule) -> [u64; 5] {
    let (l, p) = (rule.limit(), rule.period_us());
    match rule.algorithm() {
        Algorithm::FixedWindow => [1, l, p, 0, 0],
        Algorithm::SlidingWindow { precision } => [2, l, p, precision, 0],
        Algorithm::SlidingLog => [3, l, p, 0, 0],
        Algorithm::TokenBucket { capacity } => [4, l, p, capacity, 0],
        Algorithm::Gcra { burst } => [5, l, p, burst, 0],
        Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => [5, l, p, capacity, 0],
        Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
            [5, l, p, burst + 1, delay + 1]
        }
    }
}

impl Shared {
    fn now(&self) -> Arg {
        match &self.clock {
            Some(clock) => Arg::Int(clock.now_us()),
            None => Arg::Empty,
        }
    }

    pub(crate) fn check_call(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Call {
        let k = keys::check_keys(&self.prefix, key, rules);
        let mut args = Vec::with_capacity(7 + 5 * rules.len());
        args.extend([
            self.now(),
            Arg::Int(cost),
            Arg::Int(self.ttl_floor_ms),
            Arg::Int(rules.log_limit()),
            Arg::Int(rules.log_period_us()),
            Arg::Int(rules.len() as u64),
            Arg::Int(state_width(rules)),
        ]);
        for rule in rules.rules() {
            args.extend(encode(rule).map(Arg::Int));
        }
        Call {
            script: &CHECK,
            keys: vec![k.block, k.state, k.log],
            args,
        }
    }

    pub(crate) fn block_call(&self, key: &[u8], duration: Option<Duration>) -> Call {
        let length = match duration {
            Some(d) => Arg::Int(
                u64::try_from(d.as_micros()).map_or(MAX_BLOCK_US, |us| us.min(MAX_BLOCK_US)),
            ),
            None => Arg::Empty,
        };
        Call {
            script: &BLOCK,
            keys: vec![keys::block_key(&self.prefix, key)],
            args: vec![self.now(), length, Arg::Int(self.ttl_floor_ms)],
        }
    }

    pub(crate) fn unblock_cmd(&self, key: &[u8]) -> Cmd {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(keys::block_key(&self.prefix, key));
        cmd
    }

    pub(crate) fn reset_cmd(&self, key: &[u8], rules: &RuleSet) -> Cmd {
        let k = keys::check_keys(&self.prefix, key, rules);
        let mut cmd = redis::cmd("DEL");
        cmd.arg(k.state).arg(k.log);
        cmd
    }
}

fn unexpected(what: &str, reply: &Value) -> RedisStoreError {
    RedisStoreError::UnexpectedReply(format!("{what}, got {reply:?}"))
}

/// Turns the check script's reply into a [`Decision`].
pub(crate) fn decision(rules: &RuleSet, reply: Value) -> Result<Decision, RedisStoreError> {
    let ints: Option<Vec<i64>> = match &reply {
        Value::Array(items) => items
            .iter()
            .map(|v| match v {
                Value::Int(n) => Some(*n),
                _ => None,
            })
            .collect(),
        _ => None,
    };
    let Some(ints) = ints else {
        return Err(unexpected(
            "the check script should return an array of integers",
            &reply,
        ));
    };
    let us = |n: i64| u64::try_from(n).map(Duration::from_micros).ok();
    match ints.as_slice() {
        [1, -1] => Ok(Decision::blocked(None)),
        [1, left] => us(*left)
            .map(|left| Decision::blocked(Some(left)))
            .ok_or_else(|| unexpected("a block's time left cannot be negative", &reply)),
        [0, delay, per_rule @ ..] if per_rule.len() == 4 * rules.len() => {
            let delay = us(*delay).ok_or_else(|| unexpected("negative delay", &reply))?;
            let mut outcomes = Vec::with_capacity(rules.len());
            for (rule, r) in rules.rules().iter().zip(per_rule.chunks_exact(4)) {
                let (Some(remaining), Some(reset), Some(retry)) =
                    (u64::try_from(r[1]).ok(), us(r[2]), us(r[3]))
                else {
                    return Err(unexpected("negative rule values", &reply));
                };
                let allowed = match r[0] {
                    1 => true,
                    0 => false,
                    _ => return Err(unexpected("allowed must be 0 or 1", &reply)),
                };
                outcomes.push(RuleOutcome {
                    allowed,
                    limit: rule.limit(),
                    remaining,
                    reset_after: reset,
                    retry_after: (!allowed).then_some(retry),
                });
            }
            Ok(Decision::from_rules(outcomes, delay))
        }
        _ => Err(unexpected(
            &format!(
                "the check script should return {{1, left}} or {{0, delay, 4 values x {} rules}}",
                rules.len()
            ),
            &reply,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    #[test]
    fn replies_become_decisions() {
        let r = rules("10/s fixed-window; 2/s leaky-bucket mode=shaper burst=4 delay=1");
        let ints = |v: &[i64]| Value::Array(v.iter().map(|n| Value::Int(*n)).collect());
        let d = decision(&r, ints(&[0, 500, 1, 9, 1000, 0, 1, 3, 2000, 0])).unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.delay(), Duration::from_micros(500));
        assert_eq!(d.rules()[0].remaining, 9);
        assert_eq!(d.rules()[1].limit, 2);
        let d = decision(&r, ints(&[0, 0, 1, 9, 1000, 7, 0, 0, 2000, 300])).unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_micros(300)));
        assert_eq!(d.rules()[0].retry_after, None);
        assert_eq!(
            decision(&r, ints(&[1, -1])).unwrap(),
            Decision::blocked(None)
        );
        assert_eq!(
            decision(&r, ints(&[1, 5])).unwrap(),
            Decision::blocked(Some(Duration::from_micros(5)))
        );
    }

    #[test]
    fn malformed_replies_are_errors() {
        let r = rules("10/s");
        let ints = |v: &[i64]| Value::Array(v.iter().map(|n| Value::Int(*n)).collect());
        for bad in [
            Value::Nil,
            Value::Int(1),
            ints(&[]),
            ints(&[0, 0, 1, 2, 3]),
            ints(&[0, 0, 2, 1, 1, 1]),
            ints(&[0, -1, 1, 1, 1, 1]),
            ints(&[1, -2]),
            ints(&[2, 0]),
        ] {
            let err = decision(&r, bad).unwrap_err();
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
        let codes: Vec<[u64; 5]> = r.rules().iter().map(encode).collect();
        let s = 1_000_000;
        assert_eq!(
            codes,
            [
                [1, 5, s, 0, 0],
                [2, 6, s, 4, 0],
                [3, 7, s, 0, 0],
                [4, 8, s, 9, 0],
                [5, 10, s, 3, 0],
                [5, 11, s, 4, 0],
                [5, 12, s, 6, 3],
            ]
        );
        // Fixed window 2, sliding window 4 + 2, log none, and 2 for each of the other four.
        assert_eq!(state_width(&r), 16);
    }
}
