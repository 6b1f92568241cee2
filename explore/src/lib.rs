//! The algorithm explorer: replays one traffic pattern through several rule sets, each on
//! a fresh [`MemoryStore`] driven by a [`ManualClock`], and reports how each one treated
//! the same requests, as a table ([`Exploration::table`]) and an SVG chart
//! ([`Exploration::svg`]).
//!
//! The `explore` binary of this package is the command-line front end:
//!
//! ```text
//! cargo run -p ratelimit-explore -- --pattern boundary --svg boundary.svg
//! ```
//!
//! # What the table measures
//!
//! * **admitted / denied**: the verdicts of the requests offered at the pattern's times,
//!   each checked once. A request a shaping rule admits with a delay counts as admitted
//!   (and as "late").
//! * **most in any period**: the most requests admitted in any half-open span of the
//!   rule's period, `[t, t + period)`, for any `t` (for several rules, the longest
//!   period). This is the strictness the articles argue about: an exact limit never
//!   exceeds its `limit` here, a fixed window can reach twice it. A request admitted with
//!   a delay counts at the moment its delay ends, when it reaches the service.
//! * **longest wait** of a *steady client*: a client that offers the same requests at the
//!   same times, but honours `Retry-After` instead of giving up. It keeps the requests in
//!   order: a request is sent at its offered time, or as soon as the request before it
//!   has been admitted if that is later; when denied, it is sent again exactly
//!   `retry_after` later, until admitted. A request's wait is the time from its offered
//!   time to its admission, plus the delay a shaping rule gives it. The longest wait is
//!   the largest over all requests (zero when nothing is ever denied or delayed). It runs
//!   on its own fresh store, so it does not change the other columns. Under traffic that
//!   stays over the limit (`steady`), the client's backlog grows for as long as the
//!   pattern lasts, and so does the wait: it then says how far behind the client ends up.
//!
//! # What is compared
//!
//! [`lanes_for_quota`] builds one rule per algorithm from a rate such as `100/min`;
//! [`Lane::parse`] takes any rule set in the core's syntax. The traffic is a [`Builtin`]
//! pattern (the articles' worked scenarios and the shapes they argue about) or a file of
//! timestamps ([`Pattern::from_timestamps`]). The chart has one row per lane on the same
//! axes: requests offered (grey) and admitted (coloured) per time bin.
//!
//! ```
//! use ratelimit_explore::{lanes_for_quota, Builtin, Exploration, LaneOptions};
//! use std::time::Duration;
//!
//! let quota = Builtin::Boundary.default_quota(); // 100/min
//! let (lanes, skipped) = lanes_for_quota(quota, LaneOptions::default());
//! assert!(skipped.is_empty());
//! let run = Exploration::run(Builtin::Boundary.pattern(quota), lanes).unwrap();
//!
//! // 100 requests just before a window boundary and 100 just after: the fixed window
//! // admits all 200 within 10 seconds, the sliding log only the first 100.
//! assert_eq!(run.lane("fixed window").unwrap().stats().most_in_period, 200);
//! let log = run.lane("sliding log").unwrap().stats();
//! assert_eq!(log.most_in_period, 100);
//! assert_eq!(log.longest_wait, Some(Duration::from_secs(55)));
//!
//! println!("{}", run.table());
//! let svg = run.svg().unwrap();
//! assert!(svg.starts_with("<svg"));
//! ```

use std::fmt::{self, Write as _};
use std::str::FromStr;
use std::time::Duration;

use plotters::prelude::*;
use ratelimit_core::{
    Algorithm, CapacityError, ConfigError, LeakyMode, ManualClock, MemoryStore, Rule, RuleSet,
};

const SECOND_US: u64 = 1_000_000;
/// The most checks the steady client may make per offered request before the explorer
/// gives up on it; a `retry_after` that is exact needs at most two.
const STEADY_CHECKS_PER_REQUEST: u64 = 16;

/// What can go wrong when building or drawing an exploration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExploreError {
    /// The quota is not a rate such as `100/min`.
    #[error("bad quota {input:?}: {source}")]
    Quota {
        /// What was given.
        input: String,
        /// Why the core refused it.
        source: ConfigError,
    },
    /// A rule set is not in the core's rule syntax.
    #[error("bad rules {input:?}: {source}")]
    Rules {
        /// What was given.
        input: String,
        /// Why the core refused it.
        source: ConfigError,
    },
    /// A line of a timestamp file is neither seconds nor an RFC 3339 time.
    #[error(
        "line {line}: {text:?} is not a timestamp; write one per line, as seconds since the \
         Unix epoch (e.g. 1700000000.25) or in RFC 3339 (e.g. 2023-11-14T22:13:20.25Z)"
    )]
    Timestamp {
        /// 1-based line number.
        line: usize,
        /// The line's text.
        text: String,
    },
    /// A timestamp file holds no timestamp.
    #[error("no timestamps found: write one per line (blank lines and lines starting with # are skipped)")]
    NoTimestamps,
    /// A check was refused outright (only a rule that cannot admit one unit does that).
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// Plotting the chart failed.
    #[error("drawing the chart failed: {0}")]
    Chart(String),
}

/// A rate the algorithms are compared at: `limit` requests per `period`.
///
/// Parsed from the core's rule syntax (`"100/min"`, `"5 per 2 seconds"`); only the rate is
/// kept, an algorithm named in the text is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    limit: u64,
    period_us: u64,
}

impl Quota {
    /// `limit` requests per `period`; refused when the core would refuse the rate.
    pub fn new(limit: u64, period: Duration) -> Result<Self, ExploreError> {
        let rule = Rule::fixed_window(limit, period).map_err(|source| ExploreError::Quota {
            input: format!("{limit} per {period:?}"),
            source,
        })?;
        Ok(Self::from_rule(&rule))
    }

    fn from_rule(rule: &Rule) -> Self {
        Quota {
            limit: rule.limit(),
            period_us: rule.period_us(),
        }
    }

    /// Requests per period.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }
}

impl FromStr for Quota {
    type Err = ExploreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rule: Rule = s.parse().map_err(|source| ExploreError::Quota {
            input: s.to_owned(),
            source,
        })?;
        Ok(Self::from_rule(&rule))
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.limit, fmt_period(self.period_us))
    }
}

/// How [`lanes_for_quota`] sizes the algorithms that take a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneOptions {
    /// Requests the token bucket, leaky bucket and GCRA admit at once from idle; the
    /// shaper queues all but one of them. `None`: the quota's limit, so that every bucket
    /// holds one period's worth.
    pub burst: Option<u64>,
    /// Sub-windows of the finer sliding window counter (the other one has 1). The default,
    /// 2, is the articles' example.
    pub precision: u64,
}

impl Default for LaneOptions {
    fn default() -> Self {
        LaneOptions {
            burst: None,
            precision: 2,
        }
    }
}

/// One row of the comparison: a label and the rule set checked on every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    label: String,
    rules: RuleSet,
}

impl Lane {
    /// A lane with a label of your choosing.
    pub fn new(label: impl Into<String>, rules: RuleSet) -> Self {
        Lane {
            label: label.into(),
            rules,
        }
    }

    /// A lane from rules in the core's syntax (`"1/s sliding-log; 5/min sliding-log"`),
    /// labelled with the algorithms it uses.
    pub fn parse(text: &str) -> Result<Self, ExploreError> {
        let rules: RuleSet = text.parse().map_err(|source| ExploreError::Rules {
            input: text.to_owned(),
            source,
        })?;
        let mut names: Vec<String> = Vec::new();
        for rule in rules.rules() {
            let name = algorithm_name(rule.algorithm());
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(Lane::new(names.join(" + "), rules))
    }

    /// The label shown in the table and the chart.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The rules checked.
    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }
}

/// A short name for an algorithm, as the table and chart show it.
pub fn algorithm_name(algorithm: Algorithm) -> String {
    match algorithm {
        Algorithm::FixedWindow => "fixed window".into(),
        Algorithm::SlidingWindow { precision } => format!("sliding window p={precision}"),
        Algorithm::SlidingLog => "sliding log".into(),
        Algorithm::TokenBucket { .. } => "token bucket".into(),
        Algorithm::LeakyBucket(LeakyMode::Meter { .. }) => "leaky bucket meter".into(),
        Algorithm::LeakyBucket(LeakyMode::Shaper { .. }) => "leaky bucket shaper".into(),
        Algorithm::Gcra { .. } => "GCRA".into(),
        Algorithm::Concurrent => "concurrent".into(),
    }
}

/// One lane per algorithm at `quota`: fixed window, sliding window counter with precision
/// 1 and with `options.precision`, sliding log, token bucket, leaky bucket meter, leaky
/// bucket shaper (nginx's `burst` = burst − 1, no `delay`: everything beyond the first
/// request is smoothed to the rate) and GCRA.
///
/// Returns the lanes and, for each algorithm the core cannot build at this quota (a
/// sliding log longer than [`ratelimit_core::MAX_LOG_LIMIT`], a precision that does not
/// divide the period...), a note saying why it was left out.
pub fn lanes_for_quota(quota: Quota, options: LaneOptions) -> (Vec<Lane>, Vec<String>) {
    let (limit, period) = (quota.limit, quota.period());
    let burst = options.burst.unwrap_or(limit);
    let mut candidates = vec![
        ("fixed window".to_owned(), Rule::fixed_window(limit, period)),
        (
            "sliding window p=1".to_owned(),
            Rule::sliding_window(limit, period, 1),
        ),
    ];
    if options.precision != 1 {
        candidates.push((
            format!("sliding window p={}", options.precision),
            Rule::sliding_window(limit, period, options.precision),
        ));
    }
    candidates.extend([
        ("sliding log".to_owned(), Rule::sliding_log(limit, period)),
        (
            "token bucket".to_owned(),
            Rule::token_bucket(limit, period, burst),
        ),
        (
            "leaky bucket meter".to_owned(),
            Rule::leaky_meter(limit, period, burst),
        ),
        (
            "leaky bucket shaper".to_owned(),
            Rule::leaky_shaper(limit, period, burst.saturating_sub(1), 0),
        ),
        ("GCRA".to_owned(), Rule::gcra(limit, period, burst)),
    ]);
    let mut lanes = Vec::new();
    let mut skipped = Vec::new();
    for (label, rule) in candidates {
        match rule {
            Ok(rule) => lanes.push(Lane::new(label, rule.into())),
            Err(e) => skipped.push(format!("{label} left out: {e}")),
        }
    }
    (lanes, skipped)
}

/// Request times to replay, in microseconds since the Unix epoch, and how the chart's time
/// axis shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    name: String,
    description: String,
    origin_us: u64,
    start_us: u64,
    end_us: u64,
    times_us: Vec<u64>,
}

impl Pattern {
    /// A pattern of the given request times (sorted here). The chart shows it from the
    /// first request to the last, counting seconds from the first; see
    /// [`Pattern::with_axis`].
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        mut times_us: Vec<u64>,
    ) -> Self {
        times_us.sort_unstable();
        let first = times_us.first().copied().unwrap_or(0);
        let last = times_us.last().copied().unwrap_or(0);
        Pattern {
            name: name.into(),
            description: description.into(),
            origin_us: first,
            start_us: first,
            end_us: last + 1,
            times_us,
        }
    }

    /// Shows the time axis from `start_us` to `end_us` (widened to hold every request),
    /// counting seconds from `origin_us` (at most `start_us`).
    #[must_use]
    pub fn with_axis(mut self, origin_us: u64, start_us: u64, end_us: u64) -> Self {
        let first = self.times_us.first().copied().unwrap_or(start_us);
        let last = self.times_us.last().copied().unwrap_or(end_us);
        self.start_us = start_us.min(first);
        self.origin_us = origin_us.min(self.start_us);
        self.end_us = end_us.max(last + 1).max(self.start_us + 1);
        self
    }

    /// Reads one timestamp per line: seconds since the Unix epoch (fractions allowed,
    /// kept to the microsecond) or an RFC 3339 time (`2023-11-14T22:13:20.25Z`, any
    /// offset). Blank lines and lines starting with `#` are skipped; the lines need not be
    /// sorted. The requests are replayed at these very times, so fixed windows line up
    /// with the clock as they would in production.
    pub fn from_timestamps(name: &str, text: &str) -> Result<Self, ExploreError> {
        let mut times = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            times.push(
                parse_timestamp(line).ok_or_else(|| ExploreError::Timestamp {
                    line: i + 1,
                    text: line.to_owned(),
                })?,
            );
        }
        let (Some(&first), Some(&last)) = (times.iter().min(), times.iter().max()) else {
            return Err(ExploreError::NoTimestamps);
        };
        let description = format!(
            "{} timestamps read from a file, spanning {}",
            times.len(),
            fmt_secs(Duration::from_micros(last - first))
        );
        Ok(Pattern::new(name, description, times))
    }

    /// The pattern's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One line saying what the pattern is.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Where the chart's time axis counts from (µs since the epoch).
    pub fn origin_us(&self) -> u64 {
        self.origin_us
    }

    /// Where the chart's time axis starts (µs since the epoch).
    pub fn start_us(&self) -> u64 {
        self.start_us
    }

    /// Where the chart's time axis ends, at least (µs since the epoch).
    pub fn end_us(&self) -> u64 {
        self.end_us
    }

    /// The request times, sorted (µs since the epoch).
    pub fn times_us(&self) -> &[u64] {
        &self.times_us
    }
}

fn parse_timestamp(text: &str) -> Option<u64> {
    if let Ok(secs) = text.parse::<f64>() {
        // An f64 holds epoch seconds to well under a microsecond until the year 2100.
        return (secs.is_finite() && secs >= 0.0).then(|| (secs * 1e6).round() as u64);
    }
    let time = chrono::DateTime::parse_from_rfc3339(text).ok()?;
    u64::try_from(time.timestamp_micros()).ok()
}

/// The built-in traffic patterns: the articles' worked scenarios and the shapes they argue
/// about. Each is built around a [`Quota`] (its own by default, see
/// [`Builtin::default_quota`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Builtin {
    /// Twice the quota, evenly spaced, for three periods.
    Steady,
    /// The quota in the last twelfth of a window, then again in the first twelfth of the
    /// next: the fixed window's double burst (100 at 55-60 s, 100 at 60-65 s).
    Boundary,
    /// The quota evenly over one period, idle for half a period, then the quota again in
    /// a burst over a twentieth of a period.
    IdleBurst,
    /// The ClassDojo example: the quota in the first quarter period, then the quota again
    /// all at once at 1.25 periods.
    Classdojo,
    /// The same, with the second burst at 1.75 periods.
    ClassdojoLate,
    /// The GCRA example at 100/s with a burst of 6: ten requests at once, then one every
    /// fifth of an emission interval (2 ms) for 20 intervals.
    Gcra,
    /// The DomainTools timeline under "1/s; 5/min": five requests from 12:33:35 to
    /// 12:34:28, one at 12:34:31 (four seconds too early), one at 12:34:40.
    Domaintools,
}

impl Builtin {
    /// Every built-in pattern.
    pub const ALL: [Builtin; 7] = [
        Builtin::Steady,
        Builtin::Boundary,
        Builtin::IdleBurst,
        Builtin::Classdojo,
        Builtin::ClassdojoLate,
        Builtin::Gcra,
        Builtin::Domaintools,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Steady => "steady",
            Builtin::Boundary => "boundary",
            Builtin::IdleBurst => "idle-burst",
            Builtin::Classdojo => "classdojo",
            Builtin::ClassdojoLate => "classdojo-late",
            Builtin::Gcra => "gcra",
            Builtin::Domaintools => "domaintools",
        }
    }

    /// The rate the articles use for this pattern: 100/s for [`Builtin::Gcra`], 100/min
    /// otherwise.
    pub fn default_quota(self) -> Quota {
        let period = match self {
            Builtin::Gcra => Duration::from_secs(1),
            _ => Duration::from_secs(60),
        };
        Quota {
            limit: 100,
            period_us: period.as_micros() as u64,
        }
    }

    /// The lane options the articles use: a burst of 6 for [`Builtin::Gcra`].
    pub fn default_options(self) -> LaneOptions {
        LaneOptions {
            burst: (self == Builtin::Gcra).then_some(6),
            ..LaneOptions::default()
        }
    }

    /// Rule sets this pattern is compared under when none are given, in the core's syntax;
    /// empty when the lanes come from the quota ([`lanes_for_quota`]).
    pub fn default_rules(self) -> &'static [&'static str] {
        match self {
            Builtin::Domaintools => &[
                "1/s sliding-log; 5/min sliding-log",
                "1/s fixed-window; 5/min fixed-window",
                "1/s gcra burst=1; 5/min gcra burst=5",
            ],
            _ => &[],
        }
    }

    /// The pattern, built around `quota` ([`Builtin::Domaintools`] is the article's fixed
    /// timeline whatever the quota).
    pub fn pattern(self, quota: Quota) -> Pattern {
        let (l, p) = (quota.limit, quota.period_us);
        // Each spreads `n` requests evenly over `[from, from + span)`.
        let spread = |from: u64, span: u64, n: u64| (0..n).map(move |k| from + k * span / n);
        // The chart starts at 0, but the boundary one at half a period: nothing happens
        // before, and the boundary stands out more in the middle.
        let mut start = 0;
        let (times, end): (Vec<u64>, u64) = match self {
            Builtin::Steady => (spread(0, 3 * p, 6 * l).collect(), 3 * p),
            Builtin::Boundary => {
                start = p / 2;
                (
                    spread(p - p / 12, p / 12, l)
                        .chain(spread(p, p / 12, l))
                        .collect(),
                    2 * p,
                )
            }
            Builtin::IdleBurst => (
                spread(0, p, l)
                    .chain(spread(3 * p / 2, p / 20, l))
                    .collect(),
                2 * p,
            ),
            Builtin::Classdojo | Builtin::ClassdojoLate => {
                let at = if self == Builtin::Classdojo {
                    5 * p / 4
                } else {
                    7 * p / 4
                };
                (
                    spread(0, p / 4, l)
                        .chain(std::iter::repeat_n(at, l as usize))
                        .collect(),
                    2 * p,
                )
            }
            Builtin::Gcra => {
                let interval = p / l;
                let times = std::iter::repeat_n(0, 10)
                    .chain(spread(0, 20 * interval, 100).skip(1))
                    .collect();
                (times, 20 * interval)
            }
            Builtin::Domaintools => {
                let base = (12 * 3600 + 33 * 60) * SECOND_US;
                let times = [35, 37, 74, 86, 88, 91, 100]
                    .iter()
                    .map(|s| base + s * SECOND_US)
                    .collect();
                return Pattern::new(
                    self.name(),
                    "the DomainTools timeline: requests at 12:33:35, :37, 12:34:14, :26, :28, \
                     :31 and :40 (seconds counted from 12:33:00)",
                    times,
                )
                .with_axis(base, base, base + 120 * SECOND_US);
            }
        };
        let description = match self {
            Builtin::Steady => format!("twice {quota}, evenly spaced, for three periods"),
            Builtin::Boundary => format!(
                "{l} requests in the last twelfth of a window, {l} in the first twelfth of the \
                 next (quota {quota})"
            ),
            Builtin::IdleBurst => format!(
                "{l} requests over one period, idle half a period, then {l} in a twentieth of \
                 a period (quota {quota})"
            ),
            Builtin::Classdojo => format!(
                "{l} requests in the first quarter period, then {l} at once at 1.25 periods \
                 (quota {quota})"
            ),
            Builtin::ClassdojoLate => format!(
                "{l} requests in the first quarter period, then {l} at once at 1.75 periods \
                 (quota {quota})"
            ),
            Builtin::Gcra => format!(
                "10 requests at once, then 5 per emission interval for 20 intervals (quota \
                 {quota})"
            ),
            Builtin::Domaintools => unreachable!("returned above"),
        };
        Pattern::new(self.name(), description, times).with_axis(0, start, end)
    }
}

impl fmt::Display for Builtin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one offered request got in the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// When it was offered (µs since the epoch).
    pub at_us: u64,
    /// Whether it was admitted.
    pub admitted: bool,
    /// The delay a shaping rule gave it (zero otherwise).
    pub delay: Duration,
}

impl Verdict {
    /// When an admitted request reaches the service: its offered time plus its delay.
    pub fn passes_at_us(&self) -> Option<u64> {
        self.admitted
            .then(|| self.at_us + self.delay.as_micros() as u64)
    }
}

fn store_at(start_us: u64) -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new(start_us);
    (MemoryStore::builder().clock(clock.clone()).build(), clock)
}

const KEY: &[u8] = b"client";

/// Checks every request of `pattern` once against `rules`, on a fresh store, at the
/// request's time.
pub fn replay(pattern: &Pattern, rules: &RuleSet) -> Result<Vec<Verdict>, ExploreError> {
    let (store, clock) = store_at(pattern.start_us);
    pattern
        .times_us
        .iter()
        .map(|&at_us| {
            clock.set(at_us);
            let decision = store.check_now(KEY, rules, 1)?;
            Ok(Verdict {
                at_us,
                admitted: decision.is_allowed(),
                delay: decision.delay(),
            })
        })
        .collect()
}

/// The longest wait of the steady client (see the [module docs](self)) replaying `pattern`
/// against `rules` on a fresh store. `None` if it gave up: more than 16 checks per
/// request on average, which only a `retry_after` far too early would cause.
pub fn steady_client_wait(
    pattern: &Pattern,
    rules: &RuleSet,
) -> Result<Option<Duration>, ExploreError> {
    let (store, clock) = store_at(pattern.start_us);
    let budget = STEADY_CHECKS_PER_REQUEST * pattern.times_us.len() as u64;
    let mut checks = 0u64;
    let mut longest = 0u64;
    let mut ready = 0u64;
    for &offered in &pattern.times_us {
        let mut send = offered.max(ready);
        loop {
            checks += 1;
            if checks > budget {
                return Ok(None);
            }
            clock.set(send);
            let decision = store.check_now(KEY, rules, 1)?;
            if decision.is_allowed() {
                let delay = decision.delay().as_micros() as u64;
                longest = longest.max(send - offered + delay);
                ready = send;
                break;
            }
            let retry = decision.retry_after().map_or(0, |d| d.as_micros() as u64);
            // A zero retry_after would resend at the same instant forever.
            send += retry.max(1);
        }
    }
    Ok(Some(Duration::from_micros(longest)))
}

/// The most of the sorted `times_us` inside any half-open span `[t, t + window_us)`.
pub fn most_in_any_window(times_us: &[u64], window_us: u64) -> u64 {
    let mut most = 0;
    let mut first = 0;
    for (last, &t) in times_us.iter().enumerate() {
        while times_us[first] + window_us <= t {
            first += 1;
        }
        most = most.max(last - first + 1);
    }
    most as u64
}

/// The table's numbers for one lane; see the [module docs](self) for their definitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted, delayed ones included.
    pub admitted: u64,
    /// Of the admitted, those a shaping rule delayed.
    pub delayed: u64,
    /// Requests denied.
    pub denied: u64,
    /// The span `most_in_period` is measured over: the lane's longest rule period.
    pub period: Duration,
    /// The most requests admitted in any span of `period` (delayed ones counted when
    /// their delay ends).
    pub most_in_period: u64,
    /// The steady client's longest wait; `None` if the explorer gave up on it.
    pub longest_wait: Option<Duration>,
}

/// One lane's replay.
#[derive(Debug, Clone)]
pub struct LaneResult {
    lane: Lane,
    verdicts: Vec<Verdict>,
    stats: Stats,
}

impl LaneResult {
    /// The lane.
    pub fn lane(&self) -> &Lane {
        &self.lane
    }

    /// Each offered request's verdict, in time order.
    pub fn verdicts(&self) -> &[Verdict] {
        &self.verdicts
    }

    /// The table's numbers.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// When the admitted requests reach the service, sorted (µs since the epoch).
    pub fn passes_us(&self) -> Vec<u64> {
        let mut passes: Vec<u64> = self
            .verdicts
            .iter()
            .filter_map(Verdict::passes_at_us)
            .collect();
        passes.sort_unstable();
        passes
    }
}

/// A pattern replayed through several lanes.
#[derive(Debug, Clone)]
pub struct Exploration {
    pattern: Pattern,
    lanes: Vec<LaneResult>,
}

impl Exploration {
    /// Replays `pattern` through each lane (each on its own fresh store) and measures it.
    pub fn run(pattern: Pattern, lanes: Vec<Lane>) -> Result<Self, ExploreError> {
        let lanes = lanes
            .into_iter()
            .map(|lane| {
                let verdicts = replay(&pattern, lane.rules())?;
                let longest_wait = steady_client_wait(&pattern, lane.rules())?;
                let period_us = lane
                    .rules()
                    .rules()
                    .iter()
                    .map(Rule::period_us)
                    .max()
                    .unwrap_or(1);
                let admitted = verdicts.iter().filter(|v| v.admitted).count() as u64;
                let mut result = LaneResult {
                    lane,
                    stats: Stats {
                        offered: verdicts.len() as u64,
                        admitted,
                        delayed: verdicts
                            .iter()
                            .filter(|v| v.admitted && !v.delay.is_zero())
                            .count() as u64,
                        denied: verdicts.len() as u64 - admitted,
                        period: Duration::from_micros(period_us),
                        most_in_period: 0,
                        longest_wait,
                    },
                    verdicts,
                };
                result.stats.most_in_period = most_in_any_window(&result.passes_us(), period_us);
                Ok(result)
            })
            .collect::<Result<_, ExploreError>>()?;
        Ok(Exploration { pattern, lanes })
    }

    /// The pattern replayed.
    pub fn pattern(&self) -> &Pattern {
        &self.pattern
    }

    /// Every lane's replay, in the order given.
    pub fn lanes(&self) -> &[LaneResult] {
        &self.lanes
    }

    /// The first lane labelled `label`.
    pub fn lane(&self, label: &str) -> Option<&LaneResult> {
        self.lanes.iter().find(|l| l.lane.label == label)
    }

    /// The table printed by the `explore` binary: one row per lane, then what the
    /// columns mean.
    pub fn table(&self) -> String {
        let header = [
            "algorithm",
            "rule",
            "admitted",
            "denied",
            "most in any period",
            "longest wait",
        ];
        let rows: Vec<[String; 6]> = self
            .lanes
            .iter()
            .map(|l| {
                let s = l.stats;
                let admitted = if s.delayed > 0 {
                    format!("{} ({} late)", s.admitted, s.delayed)
                } else {
                    s.admitted.to_string()
                };
                [
                    l.lane.label.clone(),
                    l.lane.rules.to_string(),
                    admitted,
                    s.denied.to_string(),
                    format!(
                        "{}/{}",
                        s.most_in_period,
                        fmt_period(s.period.as_micros() as u64)
                    ),
                    s.longest_wait.map_or_else(|| "gave up".into(), fmt_secs),
                ]
            })
            .collect();
        let mut widths = header.map(str::len);
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: [&str; 6]| {
            let mut out = String::new();
            for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
                let pad = w - cell.chars().count();
                // Text columns are left-aligned, numbers right-aligned.
                if i < 2 {
                    out.push_str(cell);
                    out.extend(std::iter::repeat_n(' ', pad));
                } else {
                    out.extend(std::iter::repeat_n(' ', pad));
                    out.push_str(cell);
                }
                out.push_str("  ");
            }
            out.truncate(out.trim_end().len());
            out.push('\n');
            out
        };
        let p = &self.pattern;
        let mut out = String::new();
        let _ = writeln!(out, "pattern {}: {}", p.name, p.description);
        let at =
            |t: Option<&u64>| fmt_secs(Duration::from_micros(t.map_or(0, |t| t - p.origin_us)));
        let _ = writeln!(
            out,
            "{} requests offered, from {} to {}\n",
            p.times_us.len(),
            at(p.times_us.first()),
            at(p.times_us.last())
        );
        out.push_str(&line(header));
        for row in &rows {
            out.push_str(&line(row.each_ref().map(String::as_str)));
        }
        out.push_str(
            "\nmost in any period: the most requests admitted in any span of the rule's period \
             (for several rules, the longest);\n  a delayed request counts when its delay ends.\n\
             longest wait: a client that resends each denied request exactly Retry-After later, \
             keeping its requests in order;\n  the longest time from a request's offered time \
             to its admission, plus any shaping delay.\n",
        );
        out
    }

    /// The chart: one row per lane on the same axes, the requests offered (grey) and
    /// admitted (coloured) per time bin; a delayed request is drawn when its delay ends.
    /// Faint vertical lines mark the boundaries of the lanes' longest period.
    pub fn svg(&self) -> Result<String, ExploreError> {
        let p = &self.pattern;
        let passes: Vec<Vec<u64>> = self.lanes.iter().map(LaneResult::passes_us).collect();
        let end_us = passes
            .iter()
            .filter_map(|t| t.last().map(|t| t + 1))
            .fold(p.end_us, u64::max);
        let span_us = end_us - p.start_us;
        let bin_us = nice_bin_us(span_us.div_ceil(150));
        let offered = histogram(&p.times_us, p.start_us, bin_us, span_us);
        let admitted: Vec<Vec<u64>> = passes
            .iter()
            .map(|t| histogram(t, p.start_us, bin_us, span_us))
            .collect();
        let y_top = admitted
            .iter()
            .flatten()
            .chain(&offered)
            .copied()
            .max()
            .unwrap_or(0)
            .max(1) as f64
            * 1.15;
        let secs = |t: u64| (t - p.origin_us) as f64 / SECOND_US as f64;
        let x_range = secs(p.start_us)..secs(end_us);
        let to_x = |bin: usize| secs(p.start_us + bin as u64 * bin_us);
        let period_us = self
            .lanes
            .iter()
            .map(|l| l.stats.period.as_micros() as u64)
            .max()
            .unwrap_or(1);
        let first_boundary = p.start_us.div_ceil(period_us) * period_us;
        let boundaries: Vec<f64> = (0..)
            .map(|k| first_boundary + k * period_us)
            .take_while(|&t| t < end_us)
            .take(61)
            .map(secs)
            .collect();
        let draw_boundaries = boundaries.len() <= 60;

        let (width, header_h, row_h) = (1000u32, 64u32, 118u32);
        let height = header_h + row_h * self.lanes.len().max(1) as u32;
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            root.fill(&WHITE).map_err(chart_error)?;
            let (header, body) = root.split_vertically(header_h);
            let title = format!(
                "{}: {} requests offered, how each algorithm admits them",
                p.name,
                p.times_us.len()
            );
            header
                .draw(&Text::new(
                    title,
                    (12, 8),
                    ("sans-serif", 20).into_font().color(&BLACK),
                ))
                .map_err(chart_error)?;
            let legend_style = ("sans-serif", 13).into_font().color(&BLACK.mix(0.75));
            header
                .draw(&Rectangle::new([(12, 38), (24, 50)], OFFERED.filled()))
                .map_err(chart_error)?;
            header
                .draw(&Text::new(
                    format!(
                        "offered per {} bin",
                        fmt_secs(Duration::from_micros(bin_us))
                    ),
                    (30, 37),
                    legend_style.clone(),
                ))
                .map_err(chart_error)?;
            header
                .draw(&Rectangle::new(
                    [(190, 38), (202, 50)],
                    LANE_COLORS[0].filled(),
                ))
                .map_err(chart_error)?;
            header
                .draw(&Text::new(
                    "admitted, a colour per row (a delayed request when its delay ends)  ·  x: \
                     seconds  ·  vertical lines: period boundaries",
                    (208, 37),
                    legend_style,
                ))
                .map_err(chart_error)?;
            for (i, (area, lane)) in body
                .split_evenly((self.lanes.len().max(1), 1))
                .iter()
                .zip(&self.lanes)
                .enumerate()
            {
                let s = lane.stats;
                let caption = format!(
                    "{} ({}): admitted {} of {}, at most {} in any {}",
                    lane.lane.label,
                    lane.lane.rules,
                    s.admitted,
                    s.offered,
                    s.most_in_period,
                    fmt_period(s.period.as_micros() as u64)
                );
                let mut chart = ChartBuilder::on(area)
                    .margin_left(8)
                    .margin_right(24)
                    .margin_top(2)
                    .margin_bottom(2)
                    .caption(caption, ("sans-serif", 14))
                    .x_label_area_size(20)
                    .y_label_area_size(44)
                    .build_cartesian_2d(x_range.clone(), 0f64..y_top)
                    .map_err(chart_error)?;
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .y_labels(3)
                    .x_labels(13)
                    // Counts are whole: leave fractional ticks unlabelled.
                    .y_label_formatter(&|y| {
                        if y.fract() == 0.0 {
                            format!("{y:.0}")
                        } else {
                            String::new()
                        }
                    })
                    .x_label_formatter(&|x| fmt_axis(*x))
                    .max_light_lines(0)
                    .bold_line_style(BLACK.mix(0.08))
                    .label_style(("sans-serif", 11))
                    .draw()
                    .map_err(chart_error)?;
                if draw_boundaries {
                    chart
                        .draw_series(
                            boundaries.iter().map(|&x| {
                                PathElement::new(vec![(x, 0.0), (x, y_top)], BLACK.mix(0.3))
                            }),
                        )
                        .map_err(chart_error)?;
                }
                let bars = |counts: &[u64], style: ShapeStyle| {
                    counts
                        .iter()
                        .enumerate()
                        .filter(|(_, &c)| c > 0)
                        .map(move |(b, &c)| {
                            Rectangle::new([(to_x(b), 0.0), (to_x(b + 1), c as f64)], style)
                        })
                        .collect::<Vec<_>>()
                };
                chart
                    .draw_series(bars(&offered, OFFERED.filled()))
                    .map_err(chart_error)?;
                chart
                    .draw_series(bars(
                        &admitted[i],
                        LANE_COLORS[i % LANE_COLORS.len()].filled(),
                    ))
                    .map_err(chart_error)?;
            }
            root.present().map_err(chart_error)?;
        }
        Ok(svg)
    }
}

const OFFERED: RGBColor = RGBColor(200, 200, 200);
/// Dark enough to stand out against the grey of the offered requests.
const LANE_COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x39, 0x3b, 0x79),
];

/// An axis tick in seconds, without a needless `.0`.
fn fmt_axis(x: f64) -> String {
    let s = format!("{x:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn chart_error(e: impl std::error::Error) -> ExploreError {
    ExploreError::Chart(e.to_string())
}

/// Counts of `times_us` per bin of `bin_us` from `start_us`, over `span_us`.
fn histogram(times_us: &[u64], start_us: u64, bin_us: u64, span_us: u64) -> Vec<u64> {
    let mut counts = vec![0; span_us.div_ceil(bin_us) as usize + 1];
    for &t in times_us {
        counts[((t - start_us) / bin_us) as usize] += 1;
    }
    counts
}

/// The smallest of 1, 2, 5 × 10^k microseconds that is at least `us`.
fn nice_bin_us(us: u64) -> u64 {
    let mut decade = 1u64;
    loop {
        for step in [1, 2, 5] {
            if step * decade >= us {
                return step * decade;
            }
        }
        decade *= 10;
    }
}

/// A period as the core writes it in a rule: `1m`, `30s`, `10ms`.
fn fmt_period(us: u64) -> String {
    // The core's own rule text ("1/1m fixed-window") keeps the table's periods and rules
    // written alike.
    Rule::fixed_window(1, Duration::from_micros(us))
        .ok()
        .and_then(|rule| {
            let text = rule.to_string();
            let (_, rest) = text.split_once('/')?;
            Some(rest.split(' ').next()?.to_owned())
        })
        .unwrap_or_else(|| format!("{us}us"))
}

/// A duration without trailing zeros, to the millisecond from one second up and to the
/// microsecond below: `0.0025s`, `4s`, `50.05s`, `2m 30s`, `11h 5m 1.779s`.
fn fmt_secs(d: Duration) -> String {
    let mut us = d.as_micros();
    if us >= 1_000_000 {
        us = (us + 500) / 1_000 * 1_000;
    }
    let (secs, frac) = (us / 1_000_000, us % 1_000_000);
    let (hours, minutes, secs) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut parts = Vec::new();
    if hours > 0 {
        parts.push(format!("{hours}h"));
    }
    if minutes > 0 {
        parts.push(format!("{minutes}m"));
    }
    if frac > 0 {
        let frac = format!("{frac:06}");
        parts.push(format!("{secs}.{}s", frac.trim_end_matches('0')));
    } else if secs > 0 || parts.is_empty() {
        parts.push(format!("{secs}s"));
    }
    parts.join(" ")
}
