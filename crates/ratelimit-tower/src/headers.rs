//! The response fields of draft-ietf-httpapi-ratelimit-headers (structured-field lists of
//! one item per rule) and `Retry-After`.

use std::fmt::Write as _;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use ratelimit_core::util::period_parts;
use ratelimit_core::{Decision, RuleOutcome, RuleSet};
use smallvec::SmallVec;

/// `RateLimit-Policy: "name";q=<quota>;w=<window seconds>`, one item per rule.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit: "name";r=<remaining>;t=<seconds until reset>`, one item per rule.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// Set in shadow mode on requests that would have been limited, blocked or delayed.
pub static RATELIMIT_SHADOW: HeaderName = HeaderName::from_static("ratelimit-shadow");

/// Fields added to an admitted request's response.
#[derive(Debug, Default)]
pub(crate) struct Fields {
    pub(crate) policy: Option<HeaderValue>,
    pub(crate) ratelimit: Option<HeaderValue>,
    /// A `RATELIMIT_SHADOW` label; a static string keeps the fields (moved with every
    /// admitted request) small.
    pub(crate) shadow: Option<&'static str>,
}

impl Fields {
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        // Appended, not inserted: a stacked layer further in adds its own policies.
        if let Some(v) = self.policy {
            headers.append(&RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.ratelimit {
            headers.append(&RATELIMIT, v);
        }
        if let Some(v) = self.shadow {
            headers.append(&RATELIMIT_SHADOW, HeaderValue::from_static(v));
        }
    }
}

/// The fields of a refusal: `Retry-After` replaces any the hook set, the rate-limit
/// fields are appended.
pub(crate) fn write_refusal(
    headers: &mut HeaderMap,
    retry_after: Option<Duration>,
    policy: Option<HeaderValue>,
    ratelimit: Option<HeaderValue>,
) {
    if let Some(retry) = retry_after {
        headers.insert(RETRY_AFTER, retry_after_value(retry));
    }
    if let Some(v) = policy {
        headers.append(&RATELIMIT_POLICY, v);
    }
    if let Some(v) = ratelimit {
        headers.append(&RATELIMIT, v);
    }
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `Retry-After` in whole seconds, rounded up and at least 1: a client told to retry
/// after 0 seconds retries at once and is denied again.
pub(crate) fn retry_after_value(d: Duration) -> HeaderValue {
    HeaderValue::from(ceil_secs(d).max(1))
}

/// Rule names as they appear in the fields and metric labels: the rule's own name, or
/// `<limit>-per-<period>` (made unique within the set by a `-<index>` suffix).
pub(crate) fn policy_names(rules: &RuleSet) -> Vec<String> {
    let mut names: Vec<String> = Vec::with_capacity(rules.len());
    for (i, rule) in rules.rules().iter().enumerate() {
        let mut name = match rule.name() {
            Some(n) => n.to_owned(),
            None => {
                let (count, unit) = period_parts(rule.period());
                format!("{}-per-{count}{unit}", rule.limit())
            }
        };
        if names.contains(&name) {
            let _ = write!(name, "-{i}");
        }
        names.push(name);
    }
    names
}

/// Names are limited to `[A-Za-z0-9_.-]` by the core, so they need no escaping inside an
/// sf-string.
pub(crate) fn policy_value(rules: &RuleSet, names: &[String]) -> HeaderValue {
    let mut out = String::new();
    for (rule, name) in rules.rules().iter().zip(names) {
        if !out.is_empty() {
            out.push_str(", ");
        }
        let window = ceil_secs(rule.period()).max(1);
        let _ = write!(out, "\"{name}\";q={};w={window}", rule.limit());
    }
    HeaderValue::try_from(out).expect("names and digits are valid header text")
}

/// The `RateLimit` field for a decision; `None` when the decision has no rule outcomes
/// (a blocked key).
pub(crate) fn ratelimit_value(decision: &Decision, names: &[String]) -> Option<HeaderValue> {
    ratelimit_value_of(decision.rules(), names, Duration::ZERO)
}

/// As [`ratelimit_value`] for outcomes observed `elapsed` ago.
pub(crate) fn ratelimit_value_of(
    outcomes: &[RuleOutcome],
    names: &[String],
    elapsed: Duration,
) -> Option<HeaderValue> {
    if outcomes.is_empty() {
        return None;
    }
    // Written by hand into a stack buffer rather than with `format!`: this runs on every
    // admitted request, and copying the result into an exact-size value costs one
    // allocation where a growable buffer would cost two.
    let mut out: SmallVec<[u8; 256]> = SmallVec::new();
    let mut digits = itoa::Buffer::new();
    for (o, name) in outcomes.iter().zip(names) {
        if !out.is_empty() {
            out.extend_from_slice(b", ");
        }
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\";r=");
        out.extend_from_slice(digits.format(o.remaining).as_bytes());
        out.extend_from_slice(b";t=");
        let t = ceil_secs(o.reset_after.saturating_sub(elapsed));
        out.extend_from_slice(digits.format(t).as_bytes());
    }
    Some(HeaderValue::from_bytes(&out).expect("names and digits are valid header text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_readable() {
        let rules: RuleSet = "10/min; 10/min fixed-window; 5/2s name=login; 1/500ms"
            .parse()
            .unwrap();
        let names = policy_names(&rules);
        assert_eq!(
            names,
            ["10-per-1min", "10-per-1min-1", "login", "1-per-500ms"]
        );
        assert_eq!(
            policy_value(&rules, &names),
            "\"10-per-1min\";q=10;w=60, \"10-per-1min-1\";q=10;w=60, \"login\";q=5;w=2, \
             \"1-per-500ms\";q=1;w=1"
        );
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_value(Duration::ZERO), "1");
        assert_eq!(retry_after_value(Duration::from_micros(1)), "1");
        assert_eq!(retry_after_value(Duration::from_secs(2)), "2");
        assert_eq!(retry_after_value(Duration::from_millis(2001)), "3");
    }
}
