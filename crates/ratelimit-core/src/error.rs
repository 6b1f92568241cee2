use std::time::Duration;

/// The accepted rule syntax, shown once in every parse error.
const RULE_SYNTAX: &str = "expected `<limit>/<period> [algorithm] [option=value ...]` with \
rules separated by `;`, `,` or `|`, e.g. `10/second`, `100 per minute`, `5/2 seconds`, \
`10/minute, 100/day`, `20/min sliding-window precision=4`, `100/s gcra burst=6`, \
`2/s leaky-bucket mode=shaper burst=10 delay=2`, `4 concurrent timeout=30s`; units: us, ms, s, min, h, day, week; \
algorithms: fixed-window, sliding-window, sliding-log, token-bucket, leaky-bucket, gcra \
(the default)";

/// A rule or rule set that cannot be built, with what to change.
///
/// Every variant names the offending field and its `Display` text says how to fix it, so
/// a bad configuration file fails at start-up with a message an operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `limit` was 0.
    #[error("`limit` must be at least 1 (got 0); to refuse all traffic, block the key instead")]
    ZeroLimit,
    /// `period` was zero or shorter than one microsecond.
    #[error("`period` must be at least 1 microsecond (got {0:?})")]
    ZeroPeriod(Duration),
    /// `period` was not a whole number of microseconds.
    #[error(
        "`period` must be a whole number of microseconds (got {0:?}); round it to microseconds"
    )]
    SubMicrosecondPeriod(Duration),
    /// A burst, capacity or queue size was 0 where at least 1 is needed.
    #[error("`{field}` must be at least 1 (got 0); use 1 for no burst beyond a single request")]
    ZeroBurst {
        /// The field: `burst` or `capacity`.
        field: &'static str,
    },
    /// The sliding window precision was 0, too large, or does not divide the period.
    #[error(
        "`precision` {precision} must be between 1 and {max} and divide the period ({period_us} µs) \
         into whole microseconds; pick one such as {}",
        PrecisionsNear { precision: *precision, period_us: *period_us, max: *max }
    )]
    BadPrecision {
        /// The precision asked for.
        precision: u64,
        /// The rule's period in microseconds.
        period_us: u64,
        /// The largest precision accepted.
        max: u64,
    },
    /// The shaper's no-delay allowance was larger than its queue.
    #[error("`delay` ({delay}) must not exceed `burst` ({burst}); use delay = burst for nginx's `nodelay`")]
    DelayExceedsBurst {
        /// The no-delay allowance.
        delay: u64,
        /// The queue size.
        burst: u64,
    },
    /// A field on its own is beyond the range where decisions are exact.
    #[error(
        "`{field}` {value} exceeds {max}, the largest value for which decisions are exact in \
         both Rust and Redis Lua; use a smaller `{field}`"
    )]
    TooLarge {
        /// The field: `limit`, `period` (in microseconds), `burst` or `capacity`.
        field: &'static str,
        /// The value given (`u64::MAX` for a period beyond it).
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// capacity × period (or limit × sub-window) is outside the range where the shared
    /// integer arithmetic is exact.
    #[error(
        "`{field}` {capacity} × period {period_us} µs exceeds {max}, the bound within which \
         decisions are exact in both Rust and Redis Lua; use a smaller `{field}`, a shorter \
         period with a proportional limit (1000/hour instead of 24000/day), or a sliding window \
         with a higher precision"
    )]
    OutOfExactRange {
        /// The field multiplied by the period: `limit` (sliding window counter, per
        /// sub-window), `burst` (GCRA, shaper: burst + 1) or `capacity`.
        field: &'static str,
        /// The count multiplied: the burst or capacity (bucket algorithms) or the limit.
        capacity: u64,
        /// The rule's period in microseconds.
        period_us: u64,
        /// The largest accepted product.
        max: u64,
    },
    /// A sliding log would keep too many timestamps per key.
    #[error(
        "sliding log `limit` {limit} exceeds {max} timestamps per key; use a sliding window counter \
         (O(1) memory) for large limits"
    )]
    LogTooLong {
        /// The limit asked for.
        limit: u64,
        /// The largest accepted limit.
        max: u64,
    },
    /// A concurrency rule's slot count was 0 or above the bound.
    #[error(
        "`{limit} concurrent` must be between 1 and {max} slots: each held slot is a deadline \
         kept in the key's state and read on every check, so the count is bounded; to refuse \
         all traffic, block the key instead; for more in flight, limit a coarser key"
    )]
    BadConcurrency {
        /// The slot count asked for.
        limit: u64,
        /// The largest accepted count.
        max: u64,
    },
    /// A concurrency rule's `timeout` was outside its range.
    #[error(
        "`timeout` of a concurrency rule must be between {min_ms} ms and {max_s} s (got {got:?}): \
         it bounds how long a crashed process's slots stay taken, and a long stream renews \
         its slot well before it runs out"
    )]
    BadTimeout {
        /// The timeout given.
        got: Duration,
        /// The shortest accepted, in milliseconds.
        min_ms: u64,
        /// The longest accepted, in seconds.
        max_s: u64,
    },
    /// A rule set held two concurrency rules.
    #[error(
        "a rule set holds at most one `concurrent` rule (got {0}); a request holds one slot, \
         so two slot counts on one key would be the smaller one"
    )]
    TwoConcurrencyRules(usize),
    /// A rule set had no rules.
    #[error("a rule set needs at least one rule")]
    EmptyRuleSet,
    /// A rule set held too many rules.
    #[error("a rule set holds at most {max} rules (got {got}); split them across layers")]
    TooManyRules {
        /// Rules given.
        got: usize,
        /// The largest accepted count.
        max: usize,
    },
    /// Two rules of one set had the same name.
    #[error(
        "two rules of one set are named `{0}`: a name identifies a rule's state and its \
         `RateLimit-Policy` item, so each rule needs a name of its own; rename one"
    )]
    DuplicateName(String),
    /// A rule name contains characters that cannot appear in a header or store key.
    #[error("rule name {0:?} must be 1-64 characters of [A-Za-z0-9_.-]")]
    BadName(String),
    /// A rule string could not be parsed. The message shows the accepted syntax once,
    /// after what is wrong.
    #[error("cannot parse rule {input:?}: {reason}; {}", RULE_SYNTAX)]
    Parse {
        /// The text given.
        input: String,
        /// What is wrong (the syntax help is not repeated here).
        reason: String,
    },
}

/// A check asked for more units than a rule can ever grant at once.
///
/// Such a request could never be admitted, however long the client waits, so it is
/// reported as an error rather than as a denial with a meaningless retry time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cost {cost} exceeds the capacity {capacity} of rule #{rule}; it can never be admitted")]
pub struct CapacityError {
    /// The cost asked for.
    pub cost: u64,
    /// The most the rule grants at once.
    pub capacity: u64,
    /// Index of the rule in its rule set.
    pub rule: usize,
}

/// The precisions nearest to `precision` that a rule of `period_us` accepts, as a list
/// for an error message: only values that pass, so an operator who copies one is done.
struct PrecisionsNear {
    precision: u64,
    period_us: u64,
    max: u64,
}

impl std::fmt::Display for PrecisionsNear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // At most `max` (1,000) candidates, and only on the error path.
        let mut valid: Vec<u64> = (1..=self.max.min(self.period_us))
            .filter(|d| self.period_us % d == 0)
            .collect();
        valid.sort_by_key(|d| (d.abs_diff(self.precision), *d));
        valid.truncate(6);
        valid.sort_unstable();
        for (i, d) in valid.iter().enumerate() {
            match i {
                0 => write!(f, "{d}")?,
                _ if i + 1 == valid.len() => write!(f, " or {d}")?,
                _ => write!(f, ", {d}")?,
            }
        }
        Ok(())
    }
}
