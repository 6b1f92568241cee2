//! The response fields of draft-ietf-httpapi-ratelimit-headers (structured-field lists of
//! one item per rule) and `Retry-After`.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use ratelimit_core::util::{fnv1a, period_parts};
use ratelimit_core::{Decision, Rule, RuleOutcome, RuleSet};

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
    /// A `RATELIMIT_SHADOW` label; a static value keeps the fields (moved with every
    /// admitted request) small.
    pub(crate) shadow: Option<&'static HeaderValue>,
}

// The names again as constants: each use is a fresh value built in place, where a clone
// of the statics above goes through `Bytes`' clone function (about 20 instructions a name
// per admitted request).
const POLICY_NAME: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT_NAME: HeaderName = HeaderName::from_static("ratelimit");

impl Fields {
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        // Appended, not inserted: a stacked layer further in adds its own policies.
        if let Some(v) = self.policy {
            headers.append(POLICY_NAME, v);
        }
        if let Some(v) = self.ratelimit {
            headers.append(RATELIMIT_NAME, v);
        }
        if let Some(v) = self.shadow {
            headers.append(&RATELIMIT_SHADOW, v.clone());
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

/// The names of a tier's rules in metric labels: the rule's own name, or
/// `<limit>-per-<period>` (`<limit>-concurrent` for a concurrency rule), made unique
/// within the set by a `-<index>` suffix.
pub(crate) fn rule_names(rules: &RuleSet) -> Vec<String> {
    let mut names: Vec<String> = Vec::with_capacity(rules.len());
    for (i, rule) in rules.rules().iter().enumerate() {
        let mut name = match rule.name() {
            Some(n) => n.to_owned(),
            None if rule.is_concurrent() => format!("{}-concurrent", rule.limit()),
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

/// The names of a tier's rules in the fields: a named rule's name as written; an unnamed
/// rule's `<limit>-per-<period>` with `@` and the layer's tag, so that stacked layers with
/// the same rule text announce items a client can tell apart.
fn item_names(rules: &RuleSet, namespace: &str) -> Vec<String> {
    let tag = layer_tag(namespace);
    rule_names(rules)
        .into_iter()
        .zip(rules.rules())
        .map(|(name, rule)| match rule.name() {
            Some(_) => name,
            None => format!("{name}@{tag}"),
        })
        .collect()
}

/// What the name of an item a fallback store decided ends with. `/` is in neither a
/// rule's name nor a layer's tag, so such an item never takes the name of a rule the
/// store decides.
const FALLBACK_SUFFIX: &str = "/fallback";

/// The namespace when it is short and plain (`api`, `login.v2`), else 8 hex digits of its
/// FNV-1a hash (implicit namespaces, long or non-ASCII ones).
fn layer_tag(namespace: &str) -> String {
    let plain = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.');
    if namespace.len() <= 32 && namespace.bytes().all(plain) {
        namespace.to_owned()
    } else {
        format!("{:08x}", fnv1a(namespace.as_bytes()) >> 32)
    }
}

/// The quota a rule announces: its limit, or what it admits at once when that is more
/// (a token bucket's capacity, a shaper's burst): `r` never exceeds `q`.
fn quota(rule: &Rule) -> u64 {
    rule.limit().max(rule.capacity())
}

/// A tier's rate-limit fields as far as they are known when the layer is built: the whole
/// `RateLimit-Policy` value, and per rule the start of its `RateLimit` item and its quota.
///
/// A `N concurrent` rule has no item: the fields describe rate rules only. The drafts
/// since -08 name a quota unit for concurrent requests (`qu`), but a concurrency quota
/// has no window to announce (`w`) and no time at which it resets (`t`), and a client
/// that does not read `qu` would take `q=4` for four requests per window; its refusal
/// says when to retry in `Retry-After` alone.
pub(crate) struct Policy {
    /// `None` when no rule has an item (a set of one concurrency rule).
    pub(crate) header: Option<HeaderValue>,
    /// The position of the concurrency rule's outcome, which has no item.
    skip: Option<usize>,
    items: Box<[PolicyItem]>,
    /// The longest `RateLimit` value the items can make.
    max_len: usize,
}

struct PolicyItem {
    /// `"name";r=`
    prefix: Box<[u8]>,
    quota: u64,
}

/// The buffer `RateLimit` values are copied into, a thread's own: a value is a slice of
/// it (a reference count, no allocation), and once every value cut from it is dropped the
/// buffer's space is used again. A value kept long keeps its chunk (`VALUE_CHUNK` bytes)
/// alive, nothing more.
fn shared_copy(value: &[u8]) -> Bytes {
    thread_local! {
        static VALUES: RefCell<BytesMut> = RefCell::new(BytesMut::new());
    }
    VALUES.with(|values| {
        let mut values = values.borrow_mut();
        if values.capacity() < value.len() {
            // Takes the whole buffer back when no value cut from it is alive.
            values.reserve(VALUE_CHUNK.max(value.len()));
        }
        values.extend_from_slice(value);
        values.split().freeze()
    })
}

/// The size of the per-thread buffer `RateLimit` values are cut from.
const VALUE_CHUNK: usize = 2048;

/// `RateLimit` values up to this long are written on the stack.
const STACK_VALUE: usize = 256;

/// The most a `u64` takes in decimal.
const U64_DIGITS: usize = 20;

impl Policy {
    /// Names are limited to `[A-Za-z0-9_.-]` by the core, tags to the same plus `@` and
    /// the fallback's suffix to `/` and letters, so they need no escaping inside an
    /// sf-string.
    pub(crate) fn new(rules: &RuleSet, namespace: &str) -> Self {
        Self::named(rules, &item_names(rules, namespace))
    }

    /// The fields of the rules a fallback store decides with while the store fails: each
    /// item named as [`Policy::new`] names it, with [`FALLBACK_SUFFIX`]
    /// (`"login/fallback";q=25;w=60`), so that a client or an operator reading them
    /// tells the instance's own limit from the shared one, and matches each `RateLimit`
    /// item to the quota it counts down.
    pub(crate) fn fallback(rules: &RuleSet, namespace: &str) -> Self {
        let names = item_names(rules, namespace)
            .into_iter()
            .map(|name| name + FALLBACK_SUFFIX)
            .collect::<Vec<_>>();
        Self::named(rules, &names)
    }

    fn named(rules: &RuleSet, names: &[String]) -> Self {
        let mut header = String::new();
        let mut items = Vec::with_capacity(rules.len());
        for (rule, name) in rules.rules().iter().zip(names) {
            if rule.is_concurrent() {
                continue;
            }
            if !header.is_empty() {
                header.push_str(", ");
            }
            let quota = quota(rule);
            let _ = write!(header, "\"{name}\";q={quota}");
            // The draft's window is whole seconds: a period that is not is announced
            // without one (its name says it) rather than as a longer or shorter window.
            if rule.period().subsec_nanos() == 0 {
                let _ = write!(header, ";w={}", rule.period().as_secs());
            }
            items.push(PolicyItem {
                prefix: format!("\"{name}\";r=").into_bytes().into(),
                quota,
            });
        }
        let max_len = items
            .iter()
            .map(|i| ", ".len() + i.prefix.len() + U64_DIGITS + ";t=".len() + U64_DIGITS)
            .sum();
        Self {
            header: (!header.is_empty()).then(|| {
                HeaderValue::try_from(header).expect("names and digits are valid header text")
            }),
            skip: rules.concurrent(),
            items: items.into(),
            max_len,
        }
    }

    /// The `RateLimit` field for a decision; `None` when the decision has no rule
    /// outcomes (a blocked key).
    pub(crate) fn ratelimit(&self, decision: &Decision) -> Option<HeaderValue> {
        self.ratelimit_of(decision.rules(), Duration::ZERO)
    }

    /// As [`Policy::ratelimit`] for outcomes observed `elapsed` ago.
    pub(crate) fn ratelimit_of(
        &self,
        outcomes: &[RuleOutcome],
        elapsed: Duration,
    ) -> Option<HeaderValue> {
        if outcomes.is_empty() || self.items.is_empty() {
            return None;
        }
        // Written by hand into a buffer of the longest value's size rather than with
        // `format!` or a growable buffer: this runs on every admitted request, and an
        // exact-size copy costs one allocation where a growable buffer costs two, and no
        // capacity check per piece.
        let value = if self.max_len <= STACK_VALUE {
            let mut buf = [0; STACK_VALUE];
            let len = self.write(outcomes, elapsed, &mut buf);
            HeaderValue::from_maybe_shared(shared_copy(&buf[..len]))
        } else {
            let mut buf = vec![0; self.max_len];
            let len = self.write(outcomes, elapsed, &mut buf);
            buf.truncate(len);
            HeaderValue::try_from(buf)
        };
        Some(value.expect("names and digits are valid header text"))
    }

    /// A `RateLimit` value this policy wrote, with `cost` more units left in every item
    /// (at most the item's quota): the field of a request whose units went back.
    pub(crate) fn refunded(&self, value: &HeaderValue, cost: u64) -> Option<HeaderValue> {
        let mut rest = value.as_bytes();
        let mut out = Vec::with_capacity(rest.len() + 8 * self.items.len());
        let mut digits = itoa::Buffer::new();
        for (i, item) in self.items.iter().enumerate() {
            if i > 0 {
                rest = rest.strip_prefix(b", ")?;
                out.extend_from_slice(b", ");
            }
            rest = rest.strip_prefix(&*item.prefix)?;
            let end = rest.iter().position(|&b| b == b';')?;
            let remaining: u64 = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
            let remaining = remaining.saturating_add(cost).min(item.quota);
            out.extend_from_slice(&item.prefix);
            out.extend_from_slice(digits.format(remaining).as_bytes());
            rest = &rest[end..];
            let next = rest
                .windows(2)
                .position(|w| w == b", ")
                .unwrap_or(rest.len());
            if remaining == item.quota {
                // The quota is whole again: nothing to wait for.
                out.extend_from_slice(b";t=0");
            } else {
                out.extend_from_slice(&rest[..next]);
            }
            rest = &rest[next..];
        }
        HeaderValue::from_bytes(&out).ok()
    }

    /// Writes the `RateLimit` value into `out` (at least `max_len` long); its length.
    fn write(&self, outcomes: &[RuleOutcome], elapsed: Duration, out: &mut [u8]) -> usize {
        let mut len = 0;
        let mut put = |bytes: &[u8]| {
            out[len..len + bytes.len()].copy_from_slice(bytes);
            len += bytes.len();
        };
        let mut digits = itoa::Buffer::new();
        let skip = self.skip.unwrap_or(usize::MAX);
        let rated = outcomes
            .iter()
            .enumerate()
            .filter(|&(at, _)| at != skip)
            .map(|(_, o)| o);
        for (i, (o, item)) in rated.zip(self.items.iter()).enumerate() {
            if i > 0 {
                put(b", ");
            }
            let remaining = o.remaining.min(item.quota);
            // A whole quota has nothing to wait for, whatever time the store's state
            // still keeps (a sliding window's sub-windows, a refunded charge's window).
            let reset = if remaining == item.quota {
                0
            } else {
                ceil_secs(o.reset_after.saturating_sub(elapsed))
            };
            put(&item.prefix);
            put(digits.format(remaining).as_bytes());
            put(b";t=");
            put(digits.format(reset).as_bytes());
        }
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_readable() {
        let rules: RuleSet = "10/min; 10/min fixed-window; 5/2s name=login; 1/500ms"
            .parse()
            .unwrap();
        assert_eq!(
            rule_names(&rules),
            ["10-per-1min", "10-per-1min-1", "login", "1-per-500ms"]
        );
        assert_eq!(
            Policy::new(&rules, "api").header.unwrap(),
            "\"10-per-1min@api\";q=10;w=60, \"10-per-1min-1@api\";q=10;w=60, \
             \"login\";q=5;w=2, \"1-per-500ms@api\";q=1"
        );
    }

    #[test]
    fn fallback_items_are_named_apart_from_the_shared_ones() {
        let rules: RuleSet = "25/min name=api; 1/s; 2 concurrent".parse().unwrap();
        let policy = Policy::fallback(&rules, "x");
        assert_eq!(
            policy.header.as_ref().unwrap(),
            "\"api/fallback\";q=25;w=60, \"1-per-1s@x/fallback\";q=1;w=1"
        );
        let outcomes: Vec<RuleOutcome> = (rules.rules().iter())
            .map(|r| RuleOutcome {
                allowed: true,
                limit: r.limit(),
                remaining: r.limit() - 1,
                reset_after: Duration::from_secs(1),
                retry_after: None,
            })
            .collect();
        assert_eq!(
            policy.ratelimit_of(&outcomes, Duration::ZERO).unwrap(),
            "\"api/fallback\";r=24;t=1, \"1-per-1s@x/fallback\";r=0;t=1"
        );
    }

    #[test]
    fn layer_tags_are_plain_namespaces_or_a_short_hash() {
        assert_eq!(layer_tag("login.v2"), "login.v2");
        let implicit = layer_tag("@0123456789abcdef");
        assert_eq!(implicit.len(), 8);
        assert!(
            implicit.bytes().all(|b| b.is_ascii_hexdigit()),
            "{implicit}"
        );
        assert_ne!(implicit, layer_tag("@0123456789abcdee"));
        assert_eq!(layer_tag("Zürich").len(), 8);
    }

    #[test]
    fn quotas_hold_what_a_rule_admits_at_once() {
        let rules: RuleSet =
            "2/s leaky-bucket mode=shaper burst=10 name=s; 4/s token-bucket capacity=9 name=t; 100/s gcra burst=6 name=g"
                .parse()
                .unwrap();
        assert_eq!(
            Policy::new(&rules, "x").header.unwrap(),
            "\"s\";q=11;w=1, \"t\";q=9;w=1, \"g\";q=100;w=1"
        );
    }

    #[test]
    fn sub_second_and_fractional_windows_are_announced_without_w() {
        let rules: RuleSet = "3/1500ms name=a; 1/500ms name=b; 2/2s name=c"
            .parse()
            .unwrap();
        assert_eq!(
            Policy::new(&rules, "x").header.unwrap(),
            "\"a\";q=3, \"b\";q=1, \"c\";q=2;w=2"
        );
    }

    #[test]
    fn long_ratelimit_values_are_written_whole() {
        let text: Vec<String> = (1..=8)
            .map(|i| format!("{i}/h name={}", "n".repeat(60) + &i.to_string()))
            .collect();
        let rules: RuleSet = text.join("; ").parse().unwrap();
        let policy = Policy::new(&rules, "x");
        assert!(policy.max_len > STACK_VALUE);
        let outcomes: Vec<RuleOutcome> = rules
            .rules()
            .iter()
            .map(|r| RuleOutcome {
                allowed: true,
                limit: r.limit(),
                // Below the quota: a whole quota announces `t=0`, the shorter value.
                remaining: r.limit() - 1,
                reset_after: Duration::from_secs(u64::MAX / 2),
                retry_after: None,
            })
            .collect();
        let value = policy.ratelimit_of(&outcomes, Duration::ZERO).unwrap();
        let value = value.to_str().unwrap();
        assert_eq!(value.matches(";r=").count(), 8, "{value}");
        assert!(
            value.ends_with(&format!("\";r=7;t={}", u64::MAX / 2)),
            "{value}"
        );
    }

    #[test]
    fn values_cut_from_the_shared_buffer_stay_whole() {
        let rules: RuleSet = "100/min name=a; 7/s name=b".parse().unwrap();
        let policy = Policy::new(&rules, "x");
        let value = |remaining: u64| {
            let outcomes: Vec<RuleOutcome> = (rules.rules().iter())
                .map(|r| RuleOutcome {
                    allowed: true,
                    limit: r.limit(),
                    remaining: remaining % (r.limit() + 1),
                    reset_after: Duration::from_millis(remaining * 10),
                    retry_after: None,
                })
                .collect();
            policy.ratelimit_of(&outcomes, Duration::ZERO).unwrap()
        };
        let want = |remaining: u64| {
            // A whole quota has nothing to wait for.
            let t = |r: u64, quota: u64| {
                if r == quota {
                    0
                } else {
                    (remaining * 10).div_ceil(1000)
                }
            };
            format!(
                "\"a\";r={};t={}, \"b\";r={};t={}",
                remaining % 101,
                t(remaining % 101, 100),
                remaining % 8,
                t(remaining % 8, 7),
            )
        };
        // Many alive at once, over several of the buffer's chunks, some dropped between.
        let mut kept = Vec::new();
        for i in 0..1_000 {
            let v = value(i);
            if i % 3 == 0 {
                kept.push((i, v));
            }
        }
        for (i, v) in &kept {
            assert_eq!(v, &want(*i));
        }
        // From another thread too, and after all were dropped.
        drop(kept);
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(value(5), want(5)));
        });
        assert_eq!(value(1_000_000), want(1_000_000));
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_value(Duration::ZERO), "1");
        assert_eq!(retry_after_value(Duration::from_micros(1)), "1");
        assert_eq!(retry_after_value(Duration::from_secs(2)), "2");
        assert_eq!(retry_after_value(Duration::from_millis(2001)), "3");
    }
}
