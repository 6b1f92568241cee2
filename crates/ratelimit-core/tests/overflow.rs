//! No configuration overflows: every numeric field of every algorithm, at the extremes of
//! `u64`, is either refused with an error naming the field or gives a rule that decides
//! correctly. Tests run in debug builds, where an overflow panics.

use std::time::Duration;

use proptest::prelude::*;
use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::testing::proptest_config;
use ratelimit_core::{ConfigError, Rule, RuleSet, MAX_EXACT_PRODUCT};

const EXTREMES: [u64; 9] = [
    0,
    1,
    2,
    MAX_EXACT_PRODUCT,
    MAX_EXACT_PRODUCT + 1,
    1 << 53,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

fn field() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => proptest::sample::select(EXTREMES.to_vec()),
        1 => any::<u64>(),
        1 => 1u64..=1_000,
    ]
}

/// A period in microseconds: the extremes, or one that divides by small precisions.
fn period() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => proptest::sample::select(EXTREMES.to_vec()),
        1 => (1u64..=1_000).prop_map(|n| n * 1_000_000),
    ]
}

const T0: u64 = 1_700_000_000_000_000;

/// What each constructor calls its fields, in the order the strategy fills them.
fn build(
    algo: u8,
    limit: u64,
    period_us: u64,
    a: u64,
    b: u64,
) -> (Result<Rule, ConfigError>, &'static [&'static str]) {
    let period = Duration::from_micros(period_us);
    match algo {
        0 => (Rule::fixed_window(limit, period), &["limit", "period"]),
        1 => (
            Rule::sliding_window(limit, period, a),
            &["limit", "period", "precision"],
        ),
        2 => (Rule::sliding_log(limit, period), &["limit", "period"]),
        3 => (
            Rule::token_bucket(limit, period, a),
            &["limit", "period", "capacity"],
        ),
        4 => (
            Rule::leaky_meter(limit, period, a),
            &["limit", "period", "capacity"],
        ),
        5 => (
            Rule::leaky_shaper(limit, period, a, b),
            &["limit", "period", "burst", "delay"],
        ),
        _ => (Rule::gcra(limit, period, a), &["limit", "period", "burst"]),
    }
}

/// A fresh key takes a request of the rule's whole capacity at once; the next unit at the
/// same instant is denied, with a retry time after which (and not before) it is admitted.
fn decides_correctly(rule: &Rule) -> Result<(), TestCaseError> {
    let rules = RuleSet::from(rule.clone());
    let cap = rule.capacity();
    prop_assert!(rules.check_cost(cap).is_ok());
    prop_assert!(rules.check_cost(cap.saturating_add(1)).is_err() || cap == u64::MAX);
    let mut states = vec![RuleState::Fresh; 1];
    let peek = decide(&rules, &mut states, T0, 0);
    prop_assert!(peek.decision.is_allowed());
    prop_assert_eq!(peek.decision.rules()[0].remaining, cap);
    let full = decide(&rules, &mut states, T0, cap);
    prop_assert!(full.decision.is_allowed(), "{rule}: {:?}", full.decision);
    prop_assert_eq!(full.decision.rules()[0].remaining, 0);
    prop_assert!(full.expires_at_us > T0);
    let denied = decide(&rules, &mut states, T0, 1);
    prop_assert!(
        !denied.decision.is_allowed(),
        "{rule}: {:?}",
        denied.decision
    );
    let retry = denied
        .decision
        .retry_after()
        .expect("a denial has a retry time");
    let retry = u64::try_from(retry.as_micros()).unwrap();
    prop_assert!(
        retry > 0 && retry <= 2 * rule.period_us(),
        "{rule}: retry {retry}"
    );
    let mut before = states.clone();
    prop_assert!(!decide(&rules, &mut before, T0 + retry - 1, 1)
        .decision
        .is_allowed());
    let again = decide(&rules, &mut states, T0 + retry, 1);
    prop_assert!(
        again.decision.is_allowed(),
        "{rule}: at retry {retry}: {:?}",
        again.decision
    );
    Ok(())
}

proptest! {
    #![proptest_config(proptest_config(2_000, "proptest-regressions/overflow.txt"))]

    #[test]
    fn extreme_fields_are_refused_by_name_or_decide_correctly(
        algo in 0u8..7,
        limit in field(),
        period_us in period(),
        a in field(),
        b in field(),
    ) {
        let (built, fields) = build(algo, limit, period_us, a, b);
        match built {
            Err(e) => {
                let text = e.to_string();
                prop_assert!(
                    fields.iter().any(|f| text.contains(&format!("`{f}`"))),
                    "{e} names none of {fields:?}"
                );
            }
            Ok(rule) => {
                decides_correctly(&rule)?;
                // The text form parses back to the same rule: the parser meets the same bounds.
                let again: Rule = rule.to_string().parse().map_err(|e| TestCaseError::fail(format!("{rule}: {e}")))?;
                prop_assert_eq!(again, rule);
            }
        }
    }

    #[test]
    fn extreme_fields_in_text_are_refused_by_name_or_parse(
        algo in 0u8..7,
        limit in field(),
        count in field(),
        a in field(),
        b in field(),
    ) {
        let options = match algo {
            0 => "fixed-window".to_owned(),
            1 => format!("sliding-window precision={a}"),
            2 => "sliding-log".to_owned(),
            3 => format!("token-bucket capacity={a}"),
            4 => format!("leaky-bucket mode=meter capacity={a}"),
            5 => format!("leaky-bucket mode=shaper burst={a} delay={b}"),
            _ => format!("gcra burst={a}"),
        };
        for unit in ["us", "s", "day", "week"] {
            let text = format!("{limit}/{count}{unit} {options}");
            match text.parse::<Rule>() {
                Ok(rule) => {
                    decides_correctly(&rule)?;
                }
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(
                        ["`limit`", "`period`", "`precision`", "`capacity`", "`burst`", "`delay`"]
                            .iter()
                            .any(|f| msg.contains(f)),
                        "{text}: {msg}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_reported_shaper_is_refused_naming_burst() {
    let err = "1/s leaky-bucket mode=shaper burst=18446744073709551615 delay=0"
        .parse::<Rule>()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("`burst` 18446744073709551615 exceeds"),
        "{err}"
    );
    let err = Rule::leaky_shaper(1, Duration::from_secs(1), u64::MAX, 0).unwrap_err();
    assert_eq!(
        err,
        ConfigError::TooLarge {
            field: "burst",
            value: u64::MAX,
            max: MAX_EXACT_PRODUCT - 1
        }
    );
}

#[test]
fn the_largest_accepted_values_decide_correctly() {
    let max = MAX_EXACT_PRODUCT;
    let us = Duration::from_micros(1);
    let cases = [
        Rule::fixed_window(max, us),
        Rule::fixed_window(1, Duration::from_micros(max)),
        Rule::sliding_window(max, us, 1),
        Rule::sliding_window(1, Duration::from_micros(max - max % 1_000), 1_000),
        Rule::sliding_log(10_000, Duration::from_micros(max)),
        Rule::token_bucket(max, us, max),
        Rule::token_bucket(1, Duration::from_micros(max), 1),
        Rule::leaky_meter(max, us, max),
        Rule::leaky_shaper(max, us, max - 1, max - 1),
        Rule::gcra(max, us, max),
        Rule::gcra(1, Duration::from_micros(max), 1),
    ];
    for rule in cases {
        let rule = rule.unwrap();
        let rules = RuleSet::from(rule.clone());
        let mut states = vec![RuleState::Fresh];
        let t = decide(&rules, &mut states, T0, rule.capacity().min(10_000));
        assert!(t.decision.is_allowed(), "{rule}: {:?}", t.decision);
        let t = decide(&rules, &mut states, T0, 1);
        assert!(t.decision.rules()[0].remaining < rule.capacity(), "{rule}");
    }
}

#[test]
fn periods_beyond_u64_microseconds_are_refused_naming_period() {
    for period in [
        Duration::MAX,
        Duration::from_secs(u64::MAX / 1_000),
        Duration::from_micros(u64::MAX),
    ] {
        let err = Rule::gcra(1, period, 1).unwrap_err();
        assert!(err.to_string().contains("`period`"), "{period:?}: {err}");
    }
    let err = "1/18446744073709551615d".parse::<Rule>().unwrap_err();
    assert!(err.to_string().contains("`period`"), "{err}");
}
