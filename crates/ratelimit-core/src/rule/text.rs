//! The text form of rules: `"10/minute"`, `"100/s gcra burst=6"`, `"1/s; 20/min"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{Algorithm, LeakyMode, Rule, RuleSet, MAX_EXACT_PRODUCT};
use crate::error::ConfigError;
use crate::util::period_parts;

/// The canonical period text: the largest whole unit, minutes as `m`.
fn fmt_period(us: u64) -> String {
    let (count, unit) = period_parts(Duration::from_micros(us));
    let unit = if unit == "min" { "m" } else { unit };
    format!("{count}{unit}")
}

impl fmt::Display for Rule {
    /// The canonical text form; parsing it gives the same rule back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.algorithm == Algorithm::Concurrent {
            write!(
                f,
                "{} concurrent timeout={}",
                self.limit,
                fmt_period(self.period_us)
            )?;
        } else {
            write!(f, "{}/{}", self.limit, fmt_period(self.period_us))?;
        }
        match self.algorithm {
            Algorithm::Concurrent => {}
            Algorithm::FixedWindow => write!(f, " fixed-window")?,
            Algorithm::SlidingWindow { precision } => {
                write!(f, " sliding-window precision={precision}")?
            }
            Algorithm::SlidingLog => write!(f, " sliding-log")?,
            Algorithm::TokenBucket { capacity } => write!(f, " token-bucket capacity={capacity}")?,
            Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => {
                write!(f, " leaky-bucket mode=meter capacity={capacity}")?
            }
            Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
                write!(f, " leaky-bucket mode=shaper burst={burst} delay={delay}")?
            }
            Algorithm::Gcra { burst } => write!(f, " gcra burst={burst}")?,
        }
        if let Some(name) = &self.name {
            write!(f, " name={name}")?;
        }
        Ok(())
    }
}

fn unit_us(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "us" | "µs" | "micro" | "micros" | "microsecond" | "microseconds" => 1,
        "ms" | "milli" | "millis" | "millisecond" | "milliseconds" => 1_000,
        "s" | "sec" | "secs" | "second" | "seconds" => 1_000_000,
        "m" | "min" | "mins" | "minute" | "minutes" => 60_000_000,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000_000,
        "d" | "day" | "days" => 86_400_000_000,
        "w" | "wk" | "wks" | "week" | "weeks" => 604_800_000_000,
        _ => return None,
    })
}

/// A duration written as one token, `30s`, `500ms`, `2min` (the count defaults to 1).
fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (count, unit) = text.split_at(split);
    let count: u64 = if count.is_empty() {
        1
    } else {
        count
            .parse()
            .map_err(|_| format!("{text:?}: the count must be a whole number"))?
    };
    let unit = unit_us(unit).ok_or_else(|| format!("{text:?}: a duration such as `30s`"))?;
    Ok(Duration::from_micros(count.saturating_mul(unit)))
}

/// `<limit> concurrent [timeout=<duration>] [name=<name>]`, after the limit.
fn parse_concurrent<'a>(
    limit: u64,
    tokens: impl Iterator<Item = &'a str>,
) -> Result<Rule, ParseFailure> {
    let (mut timeout, mut name) = (None, None);
    for token in tokens {
        let Some((k, v)) = token.split_once('=') else {
            return Err(format!("unexpected {token:?} after `concurrent`").into());
        };
        let slot = match k.to_ascii_lowercase().as_str() {
            "timeout" => &mut timeout,
            "name" => &mut name,
            _ => return Err(format!("option `{k}` does not apply to concurrent").into()),
        };
        if slot.replace(v).is_some() {
            return Err(format!("`{k}` given twice").into());
        }
    }
    let timeout = match timeout {
        Some(t) => parse_duration(t)?,
        None => Duration::from_micros(super::DEFAULT_SLOT_TIMEOUT_US),
    };
    let mut rule = Rule::concurrent(limit, timeout).map_err(ParseFailure::Invalid)?;
    if let Some(name) = name {
        rule = rule.named(name).map_err(ParseFailure::Invalid)?;
    }
    Ok(rule)
}

/// Every spelling of an algorithm the text form accepts, with the name to suggest for
/// it: a misspelt alias (`slidng`) is told the algorithm's own name.
const ALGORITHMS: &[(&str, &str)] = &[
    ("fixed-window", "fixed-window"),
    ("fixed", "fixed-window"),
    ("sliding-window", "sliding-window"),
    ("sliding-counter", "sliding-window"),
    ("sliding", "sliding-window"),
    ("sliding-log", "sliding-log"),
    ("log", "sliding-log"),
    ("token-bucket", "token-bucket"),
    ("token", "token-bucket"),
    ("leaky-bucket", "leaky-bucket"),
    ("leaky", "leaky-bucket"),
    ("gcra", "gcra"),
    ("concurrent", "concurrent"),
];

/// The reason for an algorithm `word` (lowercased) that none is called, in a rule of
/// `limit` per a period: the algorithm it most likely meant, or, for `concurrent`, that
/// a concurrency rule has no period.
fn unknown_algorithm(word: &str, limit: u64) -> String {
    // A typo is a letter or two off, a swap counting one: "slidng-window", "gcar". More
    // than a third of the word changed is another word, and no guess is better than a
    // wrong one.
    let nearest = ALGORITHMS
        .iter()
        .map(|&(spelling, name)| (strsim::osa_distance(word, spelling), name))
        .filter(|&(distance, _)| distance * 3 <= word.chars().count())
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, name)| name);
    match nearest {
        Some("concurrent") => format!(
            "a concurrency rule has no period: write `{limit} concurrent` (a slot is held \
             until its request ends, or at most its `timeout=`), or leave `concurrent` out \
             for a rate"
        ),
        Some(name) => format!("unknown algorithm {word:?}: did you mean `{name}`?"),
        None => format!("unknown algorithm {word:?}"),
    }
}

fn parse_rule(input: &str) -> Result<Rule, ParseFailure> {
    let spaced = input.replace('/', " / ");
    let mut tokens = spaced.split_whitespace().peekable();
    let limit: u64 = tokens
        .next()
        .ok_or("empty rule")?
        .parse()
        .map_err(|_| "`limit` must be a whole number")?;
    if tokens
        .peek()
        .is_some_and(|t| t.eq_ignore_ascii_case("concurrent"))
    {
        tokens.next();
        return parse_concurrent(limit, tokens);
    }
    match tokens.next() {
        Some("/") => {}
        Some(t) if t.eq_ignore_ascii_case("per") => {}
        _ => return Err("expected `/` or `per` after the limit".into()),
    }
    let period_token = tokens.next().ok_or("missing period")?;
    let split = period_token
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(period_token.len());
    let (count, unit) = period_token.split_at(split);
    let (count, unit) = if unit.is_empty() {
        let unit = tokens.next().ok_or("missing period unit")?;
        (count, unit)
    } else {
        (count, unit)
    };
    let count: u64 = if count.is_empty() {
        1
    } else {
        count
            .parse()
            .map_err(|_| "the `period` count must be a whole number")?
    };
    let unit = unit_us(unit).ok_or_else(|| format!("unknown time unit {unit:?}"))?;
    let period_us =
        count
            .checked_mul(unit)
            .ok_or(ParseFailure::Invalid(ConfigError::TooLarge {
                field: "period",
                value: u64::MAX,
                max: MAX_EXACT_PRODUCT,
            }))?;
    let period = Duration::from_micros(period_us);

    let mut algorithm: Option<&str> = None;
    let mut options: Vec<(&str, &str)> = Vec::new();
    for token in tokens {
        if let Some((k, v)) = token.split_once('=') {
            if options.iter().any(|(seen, _)| seen.eq_ignore_ascii_case(k)) {
                return Err(format!("`{k}` given twice").into());
            }
            options.push((k, v));
        } else if algorithm.is_none() {
            algorithm = Some(token);
        } else {
            return Err(format!("unexpected {token:?}").into());
        }
    }
    fn take<'a>(options: &mut Vec<(&'a str, &'a str)>, key: &str) -> Option<&'a str> {
        let pos = options
            .iter()
            .position(|(k, _)| k.eq_ignore_ascii_case(key));
        pos.map(|i| options.remove(i).1)
    }
    fn num<'a>(
        options: &mut Vec<(&'a str, &'a str)>,
        key: &str,
        default: u64,
    ) -> Result<u64, String> {
        match take(options, key) {
            Some(v) => v
                .parse()
                .map_err(|_| format!("`{key}` must be a whole number")),
            None => Ok(default),
        }
    }
    let o = &mut options;
    let algo = algorithm.unwrap_or("gcra").to_ascii_lowercase();
    let built = match algo.as_str() {
        "fixed-window" | "fixed" => Rule::fixed_window(limit, period),
        "sliding-window" | "sliding-counter" | "sliding" => {
            Rule::sliding_window(limit, period, num(o, "precision", 1)?)
        }
        "sliding-log" | "log" => Rule::sliding_log(limit, period),
        "token-bucket" | "token" => Rule::token_bucket(limit, period, num(o, "capacity", limit)?),
        "gcra" => Rule::gcra(limit, period, num(o, "burst", limit)?),
        "leaky-bucket" | "leaky" => {
            let mode = take(o, "mode").unwrap_or("meter").to_ascii_lowercase();
            match mode.as_str() {
                "meter" => Rule::leaky_meter(limit, period, num(o, "capacity", limit)?),
                "shaper" => {
                    let burst = num(o, "burst", 0)?;
                    Rule::leaky_shaper(limit, period, burst, num(o, "delay", 0)?)
                }
                other => {
                    return Err(
                        format!("unknown leaky-bucket mode {other:?}: meter or shaper").into(),
                    )
                }
            }
        }
        other => return Err(unknown_algorithm(other, limit).into()),
    };
    let mut rule = built.map_err(ParseFailure::Invalid)?;
    if let Some(name) = take(o, "name") {
        rule = rule.named(name).map_err(ParseFailure::Invalid)?;
    }
    if let Some((k, _)) = options.first() {
        return Err(format!("option `{k}` does not apply to {algo}").into());
    }
    Ok(rule)
}

/// Why a rule string was refused: bad syntax, or well-formed but invalid values.
enum ParseFailure {
    Syntax(String),
    Invalid(ConfigError),
}

impl<T: Into<String>> From<T> for ParseFailure {
    fn from(reason: T) -> Self {
        ParseFailure::Syntax(reason.into())
    }
}

impl FromStr for Rule {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_rule(s).map_err(|failure| match failure {
            ParseFailure::Invalid(e) => e,
            ParseFailure::Syntax(reason) => ConfigError::Parse {
                input: s.to_owned(),
                reason,
            },
        })
    }
}

/// Rules are separated by `;`, `,` or `|`, as in `limits` and Flask-Limiter
/// (`"10/minute, 100/day"`). Every rule is parsed; when several are malformed, one error
/// lists each with its reason.
impl FromStr for RuleSet {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut rules = Vec::new();
        let mut malformed = Vec::new();
        for text in s.split([';', ',', '|']).map(str::trim) {
            if text.is_empty() {
                continue;
            }
            match parse_rule(text) {
                Ok(rule) => rules.push(rule),
                Err(ParseFailure::Invalid(e)) => return Err(e),
                Err(ParseFailure::Syntax(reason)) => malformed.push((text, reason)),
            }
        }
        match malformed.as_slice() {
            [] => RuleSet::new(rules),
            [(text, reason)] => Err(ConfigError::Parse {
                input: (*text).to_owned(),
                reason: reason.clone(),
            }),
            all => Err(ConfigError::Parse {
                input: s.to_owned(),
                reason: all
                    .iter()
                    .map(|(text, reason)| format!("{text:?}: {reason}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            }),
        }
    }
}

impl fmt::Display for RuleSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}
