use std::sync::Arc;
use std::time::Duration;

use crate::error::{CapacityError, ConfigError};
use crate::util::fnv1a;

mod divisor;
#[cfg(feature = "serde")]
mod serde;
mod text;

pub(crate) use divisor::Divisor;

/// The largest integer every store holds exactly (2^53 - 1): the Redis store's Lua
/// computes with doubles. The packed encoding holds it as its `MAX_EXACT`.
pub(crate) const MAX_EXACT: u64 = (1 << 53) - 1;

/// The largest `capacity × period_us` accepted. Every intermediate product of the
/// algorithms stays below 2^53, so Rust's `u64` and Redis Lua's doubles compute the very
/// same integers.
pub const MAX_EXACT_PRODUCT: u64 = 1 << 51;
/// The most timestamps a sliding log keeps per key.
pub const MAX_LOG_LIMIT: u64 = 10_000;
/// The finest sliding window counter precision accepted.
pub const MAX_PRECISION: u64 = 1_000;
/// The most rules one rule set may hold.
pub const MAX_RULES: usize = 16;
/// The most slots a `N concurrent` rule may hold per key: its state is one deadline per
/// held slot, read on every check.
pub const MAX_CONCURRENT: u64 = 1_000;
/// The shortest `timeout` of a concurrency rule, in microseconds (100 ms): a layer renews
/// a slot at a fraction of it, so much less would be a store call per few milliseconds.
pub const MIN_SLOT_TIMEOUT_US: u64 = 100_000;
/// The longest `timeout` of a concurrency rule, in microseconds (1 hour): what a crashed
/// process's slots may stay taken at most.
pub const MAX_SLOT_TIMEOUT_US: u64 = 3_600_000_000;
/// A concurrency rule's `timeout` when none is given, in microseconds (60 s).
pub const DEFAULT_SLOT_TIMEOUT_US: u64 = 60_000_000;

/// How a leaky bucket treats a request that finds the bucket non-empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeakyMode {
    /// Admit while the bucket has room for the request, reject otherwise; never delay.
    Meter {
        /// Bucket size: units admitted at once from idle.
        capacity: u64,
    },
    /// Admit with a delay so that admitted requests leave at the leak rate, as nginx
    /// `limit_req` does: up to `burst` requests wait in the queue, the first `delay` of
    /// them pass at once (`delay = burst` is nginx's `nodelay`), a request that finds the
    /// queue full is rejected.
    Shaper {
        /// Queue length beyond the request being served (nginx `burst`).
        burst: u64,
        /// Queued requests forwarded without delay (nginx `delay=N`).
        delay: u64,
    },
}

/// The algorithm of a [`Rule`], with its algorithm-specific parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// One counter per window aligned to the epoch. Cheapest; admits up to twice the limit
    /// across a window boundary.
    FixedWindow,
    /// Counters per sub-window (`precision` of them per period); the oldest one weighted by
    /// the part of it still inside the sliding window.
    SlidingWindow {
        /// Sub-windows per period; 1 is the classic two-counter scheme.
        precision: u64,
    },
    /// Exact: the timestamps of the last `limit` admitted units.
    SlidingLog,
    /// Tokens refilled at `limit` per `period`, up to `capacity`.
    TokenBucket {
        /// Bucket size: units admitted at once from idle.
        capacity: u64,
    },
    /// A bucket leaking at `limit` per `period`.
    LeakyBucket(LeakyMode),
    /// Generic cell rate algorithm: one theoretical arrival time per key.
    Gcra {
        /// Requests admitted at once from idle (governor's and redis_rate's meaning; the
        /// classic "burst of 5 on top of the regular request" is `burst = 6`).
        burst: u64,
    },
    /// `N concurrent`: at most `limit` requests in flight per key, each holding a slot
    /// from its admission until it is released, or until its deadline (the rule's period,
    /// its `timeout`, after the admission or the last renewal) passes. A request holds one
    /// slot whatever its cost. See "Concurrent requests" in the `algo` module.
    Concurrent,
}

impl Algorithm {
    /// [`Rule::capacity`] of a rule of this algorithm and `limit`: for a caller holding
    /// the algorithm as a value, whose matches on it then fold into one.
    #[inline]
    pub(crate) fn capacity(self, limit: u64) -> u64 {
        match self {
            Algorithm::FixedWindow | Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog => {
                limit
            }
            // A request takes one slot whatever its cost: no cost is too large for it.
            Algorithm::Concurrent => MAX_EXACT,
            Algorithm::TokenBucket { capacity }
            | Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => capacity,
            // Validation keeps `burst` below `MAX_EXACT_PRODUCT`.
            Algorithm::LeakyBucket(LeakyMode::Shaper { burst, .. }) => burst.saturating_add(1),
            Algorithm::Gcra { burst } => burst,
        }
    }
}

/// One limit: an algorithm, a number of units per period, and an optional name.
///
/// Built through constructors that refuse nonsense with an error naming the field, or
/// parsed from text:
///
/// ```
/// use ratelimit_core::Rule;
/// use std::time::Duration;
///
/// let a = Rule::gcra(100, Duration::from_secs(1), 6).unwrap();
/// let b: Rule = "100/second gcra burst=6".parse().unwrap();
/// assert_eq!(a, b);
/// assert_eq!(b.to_string(), "100/1s gcra burst=6");
///
/// let err = Rule::fixed_window(0, Duration::from_secs(1)).unwrap_err();
/// assert!(err.to_string().contains("`limit` must be at least 1"));
///
/// // Every option has a default: a sliding window's precision is 1.
/// let p: Rule = "100/min sliding-window".parse().unwrap();
/// assert_eq!(p.to_string(), "100/1m sliding-window precision=1");
/// ```
///
/// # Text form
///
/// `<limit>/<period> [algorithm] [option=value ...]`: `per` may stand for `/`, the
/// period's count defaults to 1 (`10/s`, `5/2 seconds`), its unit is one of `us`, `ms`,
/// `s`, `min` (`m`), `h`, `d`, `w` or their long forms. Options and their defaults:
///
/// | algorithm (aliases) | option | default |
/// |---|---|---|
/// | `gcra` (the algorithm when none is named) | `burst` | the limit |
/// | `sliding-window` (`sliding`, `sliding-counter`) | `precision`: sub-windows per period, 1 to 1,000, dividing the period | 1 (the two-counter scheme) |
/// | `sliding-log`, `fixed-window` (`fixed`) | none | |
/// | `token-bucket` (`token`) | `capacity` | the limit |
/// | `leaky-bucket` (`leaky`) | `mode`: `meter` or `shaper` | `meter` |
/// | `leaky-bucket mode=meter` | `capacity` | the limit |
/// | `leaky-bucket mode=shaper` | `burst` (queued beyond the rate), `delay` (of those, admitted without waiting) | 0 and 0 |
/// | any | `name`: 1 to 64 of `A-Z a-z 0-9 _ - .`, a different one for each rule of a set | none: the rule is known by its algorithm and period |
///
/// A concurrency rule is `<limit> concurrent [timeout=<duration>] [name=...]`: at most
/// `limit` (1 to 1,000) requests in flight per key, a slot held without renewal for at
/// most `timeout` (100 ms to 1 h, default 60 s; `30s`, `500ms`, `2min`). Its identity is
/// its name, else `concurrent` alone: a changed limit or timeout keeps the held slots.
///
/// An option the algorithm does not take, or the same option twice, is refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    algorithm: Algorithm,
    limit: u64,
    period_us: u64,
    name: Option<Arc<str>>,
    /// Division by `limit`, and by the span a decision divides time by: the sub-window of
    /// a sliding window counter, the period otherwise. Fixed by the fields above.
    limit_div: Divisor,
    span_div: Divisor,
}

fn period_us(period: Duration) -> Result<u64, ConfigError> {
    if period.as_micros() == 0 {
        return Err(ConfigError::ZeroPeriod(period));
    }
    if period.subsec_nanos() % 1_000 != 0 {
        return Err(ConfigError::SubMicrosecondPeriod(period));
    }
    let us = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
    at_most("period", us, MAX_EXACT_PRODUCT)?;
    Ok(us)
}

/// Refuses `value` above `max`, naming the field.
fn at_most(field: &'static str, value: u64, max: u64) -> Result<(), ConfigError> {
    if value > max {
        return Err(ConfigError::TooLarge { field, value, max });
    }
    Ok(())
}

impl Rule {
    /// Every field is checked on its own before any arithmetic on it, so no value (up to
    /// `u64::MAX`) can overflow here or in a decision: each bound keeps every
    /// intermediate of the algorithms below 2^53.
    fn build(algorithm: Algorithm, limit: u64, period: Duration) -> Result<Self, ConfigError> {
        if limit == 0 && algorithm == Algorithm::Concurrent {
            return Err(ConfigError::BadConcurrency {
                limit,
                max: MAX_CONCURRENT,
            });
        }
        if limit == 0 {
            return Err(ConfigError::ZeroLimit);
        }
        at_most("limit", limit, MAX_EXACT_PRODUCT)?;
        let period_us = period_us(period)?;
        // The count that multiplies a (sub-)period in the arithmetic, its field, and that
        // span; fixed windows and logs only compare counts.
        let (field, count, span_us) = match algorithm {
            Algorithm::FixedWindow => ("limit", limit, 1),
            Algorithm::Concurrent => {
                if limit > MAX_CONCURRENT {
                    return Err(ConfigError::BadConcurrency {
                        limit,
                        max: MAX_CONCURRENT,
                    });
                }
                if !(MIN_SLOT_TIMEOUT_US..=MAX_SLOT_TIMEOUT_US).contains(&period_us) {
                    return Err(ConfigError::BadTimeout {
                        got: period,
                        min_ms: MIN_SLOT_TIMEOUT_US / 1_000,
                        max_s: MAX_SLOT_TIMEOUT_US / 1_000_000,
                    });
                }
                ("limit", limit, 1)
            }
            Algorithm::SlidingLog => {
                if limit > MAX_LOG_LIMIT {
                    return Err(ConfigError::LogTooLong {
                        limit,
                        max: MAX_LOG_LIMIT,
                    });
                }
                ("limit", limit, 1)
            }
            Algorithm::SlidingWindow { precision } => {
                if precision == 0 || precision > MAX_PRECISION || period_us % precision != 0 {
                    return Err(ConfigError::BadPrecision {
                        precision,
                        period_us,
                        max: MAX_PRECISION,
                    });
                }
                ("limit", limit, period_us / precision)
            }
            Algorithm::TokenBucket { capacity }
            | Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => {
                if capacity == 0 {
                    return Err(ConfigError::ZeroBurst { field: "capacity" });
                }
                at_most("capacity", capacity, MAX_EXACT_PRODUCT)?;
                ("capacity", capacity, period_us)
            }
            Algorithm::Gcra { burst } => {
                if burst == 0 {
                    return Err(ConfigError::ZeroBurst { field: "burst" });
                }
                at_most("burst", burst, MAX_EXACT_PRODUCT)?;
                ("burst", burst, period_us)
            }
            Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
                // The queue plus the request being served.
                at_most("burst", burst, MAX_EXACT_PRODUCT - 1)?;
                if delay > burst {
                    return Err(ConfigError::DelayExceedsBurst { delay, burst });
                }
                ("burst", burst + 1, period_us)
            }
        };
        if count
            .checked_mul(span_us)
            .is_none_or(|p| p > MAX_EXACT_PRODUCT)
        {
            return Err(ConfigError::OutOfExactRange {
                field,
                capacity: count,
                period_us,
                max: MAX_EXACT_PRODUCT,
            });
        }
        let span = match algorithm {
            Algorithm::SlidingWindow { precision } => period_us / precision,
            _ => period_us,
        };
        Ok(Rule {
            algorithm,
            limit,
            period_us,
            name: None,
            limit_div: Divisor::new(limit),
            span_div: Divisor::new(span),
        })
    }

    /// A fixed window: at most `limit` units per window of `period`, windows aligned to
    /// the Unix epoch.
    pub fn fixed_window(limit: u64, period: Duration) -> Result<Self, ConfigError> {
        Self::build(Algorithm::FixedWindow, limit, period)
    }

    /// A sliding window counter with `precision` sub-windows per period (1 = the classic
    /// previous/current pair; must divide the period).
    pub fn sliding_window(
        limit: u64,
        period: Duration,
        precision: u64,
    ) -> Result<Self, ConfigError> {
        Self::build(Algorithm::SlidingWindow { precision }, limit, period)
    }

    /// An exact sliding log: never more than `limit` units in any window of `period`.
    pub fn sliding_log(limit: u64, period: Duration) -> Result<Self, ConfigError> {
        Self::build(Algorithm::SlidingLog, limit, period)
    }

    /// A token bucket refilled with `limit` tokens per `period`, holding up to `capacity`.
    pub fn token_bucket(limit: u64, period: Duration, capacity: u64) -> Result<Self, ConfigError> {
        Self::build(Algorithm::TokenBucket { capacity }, limit, period)
    }

    /// A leaky bucket meter leaking `limit` per `period`, holding up to `capacity`.
    pub fn leaky_meter(limit: u64, period: Duration, capacity: u64) -> Result<Self, ConfigError> {
        Self::build(
            Algorithm::LeakyBucket(LeakyMode::Meter { capacity }),
            limit,
            period,
        )
    }

    /// A leaky bucket shaper leaking `limit` per `period` with nginx's `burst` and `delay`.
    pub fn leaky_shaper(
        limit: u64,
        period: Duration,
        burst: u64,
        delay: u64,
    ) -> Result<Self, ConfigError> {
        Self::build(
            Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }),
            limit,
            period,
        )
    }

    /// GCRA at `limit` per `period`, admitting `burst` requests at once from idle.
    pub fn gcra(limit: u64, period: Duration, burst: u64) -> Result<Self, ConfigError> {
        Self::build(Algorithm::Gcra { burst }, limit, period)
    }

    /// `limit` concurrent requests per key (1 to [`MAX_CONCURRENT`]), a slot held without
    /// renewal for at most `timeout` (100 ms to 1 h; [`Rule::period`] gives it back).
    ///
    /// ```
    /// use ratelimit_core::Rule;
    /// use std::time::Duration;
    ///
    /// let r = Rule::concurrent(4, Duration::from_secs(30)).unwrap();
    /// assert_eq!(r, "4 concurrent timeout=30s".parse().unwrap());
    /// assert!(Rule::concurrent(1001, Duration::from_secs(30)).is_err());
    /// ```
    pub fn concurrent(limit: u64, timeout: Duration) -> Result<Self, ConfigError> {
        Self::build(Algorithm::Concurrent, limit, timeout)
    }

    /// Whether this is a `N concurrent` rule (a slot count, not a rate).
    #[inline]
    pub fn is_concurrent(&self) -> bool {
        self.algorithm == Algorithm::Concurrent
    }

    /// Whether `name` can name a rule (or anything else shown beside rules in
    /// `RateLimit-Policy`): 1 to 64 ASCII letters, digits, `_`, `-` or `.`, so it needs no
    /// quoting in a header or in the rule text.
    #[must_use]
    pub fn is_valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    }

    /// Names the rule (shown in `RateLimit-Policy`; part of the rule's identity).
    pub fn named(mut self, name: &str) -> Result<Self, ConfigError> {
        if !Self::is_valid_name(name) {
            return Err(ConfigError::BadName(name.to_owned()));
        }
        self.name = Some(name.into());
        Ok(self)
    }

    /// The algorithm and its parameters.
    #[inline]
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Units per period.
    #[inline]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// The period in microseconds.
    #[inline]
    pub fn period_us(&self) -> u64 {
        self.period_us
    }

    /// Divides by the limit.
    #[inline]
    pub(crate) fn limit_div(&self) -> Divisor {
        self.limit_div
    }

    /// Divides by the sub-window of a sliding window counter, by the period otherwise.
    #[inline]
    pub(crate) fn span_div(&self) -> Divisor {
        self.span_div
    }

    /// The name, if one was given.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The most units a single check can be granted: larger costs can never be admitted.
    #[inline]
    pub fn capacity(&self) -> u64 {
        self.algorithm.capacity(self.limit)
    }
}

/// Rule identities and layout fingerprints are kept below 2^52, so that Lua's doubles
/// hold them exactly.
const ID_MASK: u64 = (1 << 52) - 1;

impl Rule {
    /// What the rule's state is made of: the algorithm without its limits, and the period.
    /// Two rules of one class keep state of the same meaning; a leaky bucket's mode is a
    /// limit (both modes keep the same level), a sliding window's precision is not (it
    /// cuts the period into other sub-windows).
    fn state_class(&self) -> String {
        let kind = match self.algorithm {
            Algorithm::FixedWindow => "fixed-window".to_owned(),
            Algorithm::SlidingWindow { precision } => format!("sliding-window/{precision}"),
            Algorithm::SlidingLog => "sliding-log".to_owned(),
            Algorithm::TokenBucket { .. } => "token-bucket".to_owned(),
            Algorithm::LeakyBucket(_) => "leaky-bucket".to_owned(),
            Algorithm::Gcra { .. } => "gcra".to_owned(),
            // Slots mean the same under any timeout: a changed timeout keeps them.
            Algorithm::Concurrent => return "concurrent".to_owned(),
        };
        format!("{kind}/{}us", self.period_us)
    }
}

/// The identity of each rule's state; see [`RuleSet::rule_ids`].
fn rule_ids(rules: &[Rule]) -> Box<[u64]> {
    let mut seen: Vec<String> = Vec::with_capacity(rules.len());
    rules
        .iter()
        .map(|rule| {
            let base = match &rule.name {
                Some(name) => format!("name={name};{}", rule.state_class()),
                None => rule.state_class(),
            };
            let ordinal = seen.iter().filter(|s| **s == base).count();
            let id = fnv1a(format!("{base}#{ordinal}").as_bytes()) & ID_MASK;
            seen.push(base);
            // 0 names no rule: a store may use it for state shared by the whole set.
            id.max(1)
        })
        .collect()
}

/// The rules checked together on one key: a request is admitted only if every rule admits
/// it, and a denied request consumes nothing.
///
/// A key's state belongs to the key; inside it, each rule's state belongs to the rule's
/// identity ([`RuleSet::rule_ids`]), so a rule set that replaces another on the same key
/// carries each client's usage over rule by rule (the `algo` module's docs, "Changing
/// rules", say what carries). Cheap to clone.
///
/// ```
/// use ratelimit_core::RuleSet;
///
/// let rules: RuleSet = "1/s sliding-log; 20/min sliding-log; 200/h sliding-log; 800/day sliding-log"
///     .parse()
///     .unwrap();
/// assert_eq!(rules.len(), 4);
/// ```
#[derive(Debug, Clone)]
pub struct RuleSet {
    inner: Arc<RuleSetInner>,
}

#[derive(Debug)]
struct RuleSetInner {
    rules: Box<[Rule]>,
    id: String,
    fingerprint: u64,
    rule_ids: Box<[u64]>,
    log_limit: u64,
    log_period_us: u64,
    /// The smallest capacity over the rules: the largest cost every rule can grant.
    max_cost: u64,
    /// The position of the `N concurrent` rule, if any.
    concurrent: Option<usize>,
}

impl PartialEq for RuleSet {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for RuleSet {}

impl RuleSet {
    /// A rule set from one or more rules (at most [`MAX_RULES`], at most one of them a
    /// concurrency rule, and no two with the same name: a name is the identity of a
    /// rule's state and its item in `RateLimit-Policy`).
    pub fn new(rules: impl IntoIterator<Item = Rule>) -> Result<Self, ConfigError> {
        let rules: Box<[Rule]> = rules.into_iter().collect();
        if rules.is_empty() {
            return Err(ConfigError::EmptyRuleSet);
        }
        if rules.len() > MAX_RULES {
            return Err(ConfigError::TooManyRules {
                got: rules.len(),
                max: MAX_RULES,
            });
        }
        let concurrent = rules.iter().filter(|r| r.is_concurrent()).count();
        if concurrent > 1 {
            return Err(ConfigError::TwoConcurrencyRules(concurrent));
        }
        // At most `MAX_RULES` (16) rules: a quadratic scan allocates nothing.
        for (i, rule) in rules.iter().enumerate() {
            if let Some(name) = rule.name() {
                if rules[..i].iter().any(|r| r.name() == Some(name)) {
                    return Err(ConfigError::DuplicateName(name.to_owned()));
                }
            }
        }
        let id = rules
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        // FNV-1a, not a hasher of std or a dependency: the fingerprint may name state in
        // a shared store, so it must not change with a toolchain or a dependency.
        let fingerprint = fnv1a(id.as_bytes());
        let logs = rules
            .iter()
            .filter(|r| r.algorithm == Algorithm::SlidingLog);
        let log_limit = logs.clone().map(|r| r.limit).max().unwrap_or(0);
        let log_period_us = logs.map(|r| r.period_us).max().unwrap_or(0);
        let max_cost = rules.iter().map(Rule::capacity).min().unwrap_or(0);
        let concurrent = rules.iter().position(Rule::is_concurrent);
        Ok(Self {
            inner: Arc::new(RuleSetInner {
                rule_ids: rule_ids(&rules),
                rules,
                id,
                fingerprint,
                log_limit,
                log_period_us,
                max_cost,
                concurrent,
            }),
        })
    }

    /// Parses `"1/s; 20/min; 200/h; 800/day"` or `"10/minute, 100/day"`: rules separated by `;`,
    /// `,` or `|`.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        text.parse()
    }

    /// The rules, in the order given.
    #[inline]
    pub fn rules(&self) -> &[Rule] {
        &self.inner.rules
    }

    /// Number of rules.
    #[inline]
    pub fn len(&self) -> usize {
        self.inner.rules.len()
    }

    /// Always false: a rule set holds at least one rule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The canonical text of the whole set; two sets of one text are the same set.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// A 64-bit hash (FNV-1a) of [`RuleSet::id`], stable across versions and processes.
    #[inline]
    pub fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    /// Whether `other` is this rule set (the same one, or one with the same text).
    #[inline]
    pub fn same_as(&self, other: &RuleSet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.fingerprint == other.inner.fingerprint && self == other)
    }

    /// The identity of each rule's state, in rule order: what a store names a rule's
    /// state by inside a key's state, so that a rule keeps its state when the rules
    /// around it change.
    ///
    /// A rule is identified by its name when it has one, else by its algorithm and
    /// period (the sliding window counter's precision included; a leaky bucket's mode
    /// not), the position among the rules of the set with the same algorithm and period
    /// breaking ties between unnamed ones (two rules of a set never share a name); limits, capacities and bursts are not part of it. Each
    /// identity is a 52-bit FNV-1a hash of that text, never 0, stable across versions
    /// and processes. Two rules of one identity always share algorithm and period, so
    /// their state means the same thing; how it carries is in the `algo` module's
    /// docs, "Changing rules".
    ///
    /// ```
    /// use ratelimit_core::RuleSet;
    ///
    /// let before: RuleSet = "5/h fixed-window; 1/s gcra burst=2 name=api".parse().unwrap();
    /// let after: RuleSet = "10/s gcra burst=20 name=api; 10/h fixed-window".parse().unwrap();
    /// assert_eq!(before.rule_ids()[0], after.rule_ids()[1]);
    /// assert_eq!(before.rule_ids()[1], after.rule_ids()[0]);
    /// ```
    #[inline]
    pub fn rule_ids(&self) -> &[u64] {
        &self.inner.rule_ids
    }

    /// Entries the shared sliding log keeps (the largest sliding-log limit), 0 if none.
    #[inline]
    pub fn log_limit(&self) -> u64 {
        self.inner.log_limit
    }

    /// The position of the set's `N concurrent` rule (at most one), if it has one: a
    /// check that this set admits then holds a slot ([`Decision::slot`](crate::Decision::slot)).
    #[inline]
    pub fn concurrent(&self) -> Option<usize> {
        self.inner.concurrent
    }

    /// The longest sliding-log period in microseconds, 0 if none.
    pub fn log_period_us(&self) -> u64 {
        self.inner.log_period_us
    }

    /// Refuses a cost that some rule could never grant. Stores call this before deciding.
    #[inline]
    pub fn check_cost(&self, cost: u64) -> Result<(), CapacityError> {
        if cost <= self.inner.max_cost {
            return Ok(());
        }
        for (i, rule) in self.rules().iter().enumerate() {
            if cost > rule.capacity() {
                return Err(CapacityError {
                    cost,
                    capacity: rule.capacity(),
                    rule: i,
                });
            }
        }
        Ok(())
    }
}

impl From<Rule> for RuleSet {
    fn from(rule: Rule) -> Self {
        RuleSet::new([rule]).expect("one valid rule is a valid rule set")
    }
}
