//! The rule model: constructors refuse nonsense, text parses, serde reads config files.

use ratelimit_core::{Algorithm, ConfigError, LeakyMode, Rule, RuleSet};
use std::time::Duration;

#[test]
fn familiar_forms_parse() {
    let cases = [
        ("10/second", 10, 1_000_000),
        ("100 per minute", 100, 60_000_000),
        ("5/2 seconds", 5, 2_000_000),
        ("5/2s", 5, 2_000_000),
        ("1/s", 1, 1_000_000),
        ("20/min", 20, 60_000_000),
        ("200/h", 200, 3_600_000_000),
        ("800/day", 800, 86_400_000_000),
        ("3 / 500ms", 3, 500_000),
    ];
    for (text, limit, period_us) in cases {
        let rule: Rule = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(
            (rule.limit(), rule.period_us()),
            (limit, period_us),
            "{text}"
        );
        assert_eq!(
            rule.algorithm(),
            Algorithm::Gcra { burst: limit },
            "{text}: GCRA by default"
        );
    }
    let set: RuleSet = "1/s; 20/min; 200/h; 800/day".parse().unwrap();
    assert_eq!(set.len(), 4);
    assert_eq!(
        set.id(),
        "1/1s gcra burst=1; 20/1m gcra burst=20; 200/1h gcra burst=200; 800/1d gcra burst=800"
    );
}

#[test]
fn algorithms_and_options_parse() {
    let r: Rule = "2/s leaky-bucket mode=shaper burst=10 delay=2 name=api"
        .parse()
        .unwrap();
    assert_eq!(
        r.algorithm(),
        Algorithm::LeakyBucket(LeakyMode::Shaper {
            burst: 10,
            delay: 2
        })
    );
    assert_eq!(r.name(), Some("api"));
    let r: Rule = "100/min sliding-window precision=4".parse().unwrap();
    assert_eq!(r.algorithm(), Algorithm::SlidingWindow { precision: 4 });
    let r: Rule = "10/s token-bucket capacity=50".parse().unwrap();
    assert_eq!(r.capacity(), 50);
}

#[test]
fn nonsense_is_refused_with_the_field_and_the_fix() {
    let sec = Duration::from_secs(1);
    let cases: Vec<(Result<Rule, ConfigError>, &str)> = vec![
        (Rule::fixed_window(0, sec), "`limit` must be at least 1"),
        (
            Rule::fixed_window(1, Duration::ZERO),
            "`period` must be at least 1 microsecond",
        ),
        (
            Rule::fixed_window(1, Duration::from_nanos(1_500)),
            "whole number of microseconds",
        ),
        (Rule::gcra(1, sec, 0), "`burst` must be at least 1"),
        (
            Rule::token_bucket(1, sec, 0),
            "`capacity` must be at least 1",
        ),
        (Rule::sliding_window(10, sec, 0), "`precision` 0"),
        (
            Rule::sliding_window(10, Duration::from_micros(1_000_001), 2),
            "divide the period",
        ),
        (
            Rule::leaky_shaper(1, sec, 2, 3),
            "`delay` (3) must not exceed `burst` (2)",
        ),
        (
            Rule::sliding_log(20_000, sec),
            "use a sliding window counter",
        ),
        (
            Rule::gcra(1_000_000, Duration::from_secs(86_400), 1_000_000),
            "use a smaller `burst`",
        ),
        (
            Rule::fixed_window(1, Duration::from_secs(72 * 365 * 86_400)),
            "exceeds 2251799813685248",
        ),
        ("10/fortnight".parse(), "unknown time unit"),
        ("ten/second".parse(), "whole number"),
        ("10/s bogus".parse(), "unknown algorithm"),
        (
            "10/s gcra precision=2".parse(),
            "option `precision` does not apply",
        ),
        ("10/s gcra extra".parse(), "unexpected \"extra\""),
        (
            Rule::gcra(1, sec, 1).and_then(|r| r.named("no spaces")),
            "[A-Za-z0-9_.-]",
        ),
    ];
    for (result, needle) in cases {
        let err = result.expect_err(needle).to_string();
        assert!(err.contains(needle), "{err:?} should contain {needle:?}");
    }
    assert_eq!(RuleSet::new([]).unwrap_err(), ConfigError::EmptyRuleSet);
    assert!(matches!(
        "".parse::<RuleSet>(),
        Err(ConfigError::EmptyRuleSet)
    ));
}

#[test]
fn a_misspelt_algorithm_is_told_the_one_it_meant() {
    let cases = [
        ("60/min slidng-window", "sliding-window"),
        ("60/min sliding-windwo", "sliding-window"),
        ("60/min slidng", "sliding-window"),
        ("60/min slidng-log", "sliding-log"),
        ("60/min fixd-window", "fixed-window"),
        ("60/min token-buket", "token-bucket"),
        ("60/min leaky-buckt mode=shaper", "leaky-bucket"),
        ("60/min gcar", "gcra"),
        ("60/min GCAR", "gcra"),
    ];
    for (text, meant) in cases {
        let err = text.parse::<Rule>().unwrap_err().to_string();
        assert!(
            err.contains(&format!("did you mean `{meant}`?")),
            "{text}: {err}"
        );
        // The list of algorithms stays in the message.
        assert!(
            err.contains(
                "algorithms: fixed-window, sliding-window, sliding-log, token-bucket, \
                 leaky-bucket, gcra"
            ),
            "{text}: {err}"
        );
    }
    // Nothing near: no guess.
    let err = "60/min bogus".parse::<Rule>().unwrap_err().to_string();
    assert!(err.contains("unknown algorithm \"bogus\";"), "{err}");
    assert!(!err.contains("did you mean"), "{err}");
    // In a set, the rule's own reason.
    let err = "10/s; 60/min slidng-window".parse::<RuleSet>().unwrap_err();
    assert!(
        err.to_string().contains("did you mean `sliding-window`?"),
        "{err}"
    );
}

#[test]
fn a_concurrency_rule_written_with_a_period_is_told_it_has_none() {
    for text in [
        "60/min concurrent",
        "4/s concurrent",
        "4 per minute concurent",
    ] {
        let err = text.parse::<Rule>().unwrap_err().to_string();
        let limit = text.split(['/', ' ']).next().unwrap();
        assert!(
            err.contains(&format!(
                "a concurrency rule has no period: write `{limit} concurrent`"
            )),
            "{text}: {err}"
        );
    }
    // As the message says.
    assert!("60 concurrent".parse::<Rule>().unwrap().is_concurrent());
}

#[test]
fn two_rules_of_a_set_with_one_name_are_refused_naming_it() {
    for (text, name) in [
        ("10/min name=a; 5/min name=a", "a"),
        (
            "60/min name=requests; 4 concurrent name=requests",
            "requests",
        ),
        (
            "1/s name=x; 10/min sliding-log name=y; 100/h fixed-window name=x",
            "x",
        ),
    ] {
        let err = text.parse::<RuleSet>().unwrap_err();
        assert_eq!(err, ConfigError::DuplicateName(name.to_owned()), "{text}");
        assert!(
            err.to_string()
                .starts_with(&format!("two rules of one set are named `{name}`")),
            "{err}"
        );
    }
    // The programmatic constructor refuses them too.
    let min = Duration::from_secs(60);
    let err = RuleSet::new([
        Rule::gcra(10, min, 10).unwrap().named("a").unwrap(),
        Rule::fixed_window(5, min).unwrap().named("a").unwrap(),
    ])
    .unwrap_err();
    assert_eq!(err, ConfigError::DuplicateName("a".to_owned()));
    // Names differing in case are two names, and unnamed rules of one algorithm and
    // period are told apart by their position, as before.
    let set: RuleSet = "10/min name=a; 5/min name=A".parse().unwrap();
    assert_eq!(set.len(), 2);
    let set: RuleSet = "10/min; 5/min; 10/min name=a".parse().unwrap();
    let ids = set.rule_ids();
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
}

#[test]
fn rule_sets_deserialize_from_config_files() {
    #[derive(Debug, serde::Deserialize)]
    struct Config {
        login: RuleSet,
        api: RuleSet,
    }
    let json = r#"{ "login": "1/s sliding-log; 5/min sliding-log",
                    "api": ["100/s gcra burst=20", "10000/day fixed-window"] }"#;
    let config: Config = serde_json::from_str(json).unwrap();
    assert_eq!(config.login.len(), 2);
    assert_eq!(config.api.rules()[0].capacity(), 20);
    let bad = serde_json::from_str::<Config>(r#"{ "login": "0/s", "api": "1/s" }"#);
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("`limit` must be at least 1"));
    let text = serde_json::to_string(&config.login).unwrap();
    assert_eq!(text, r#""1/1s sliding-log; 5/1m sliding-log""#);
}

#[test]
fn the_exactness_bound_admits_everyday_quotas() {
    for text in [
        "800/day sliding-log",
        "20000/day fixed-window",
        "1000000/h fixed-window",
        "1000000/h sliding-window precision=60",
        "100000/min gcra",
        "1000000/h gcra burst=500",
    ] {
        text.parse::<Rule>()
            .unwrap_or_else(|e| panic!("{text}: {e}"));
    }
}

#[test]
fn rule_lists_as_limits_and_flask_limiter_write_them() {
    let want: RuleSet = "10/minute; 100/day".parse().unwrap();
    for text in [
        "10/minute, 100/day",
        "10/minute,100/day",
        "10 per minute | 100 per day",
        "10/minute; 100/day;",
        " 10/minute ,, 100/day ",
    ] {
        let set: RuleSet = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(set, want, "{text}");
    }
}

#[test]
fn week_is_a_unit_and_keeps_the_canonical_text() {
    for text in ["3/week", "3/1w", "3 per week", "3/wk", "6/2weeks"] {
        let rule: Rule = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(
            rule.period_us() / rule.limit(),
            604_800_000_000 / 3,
            "{text}"
        );
    }
    // The canonical text (and with it the fingerprint that names stored state) is in days.
    assert_eq!(
        "3/week".parse::<Rule>().unwrap().to_string(),
        "3/7d gcra burst=3"
    );
}

#[test]
fn a_repeated_option_is_reported_as_repeated() {
    for (text, field) in [
        ("10/s gcra burst=2 burst=3", "burst"),
        ("10/s gcra burst=2 BURST=2", "BURST"),
        (
            "10/s leaky-bucket mode=shaper burst=2 delay=1 delay=1",
            "delay",
        ),
        ("10/s token-bucket capacity=5 name=a capacity=6", "capacity"),
        ("10/s fixed-window name=a name=b", "name"),
    ] {
        let err = text.parse::<Rule>().unwrap_err().to_string();
        assert!(
            err.contains(&format!("`{field}` given twice")),
            "{text}: {err}"
        );
    }
}

#[test]
fn the_syntax_help_appears_once_per_error() {
    let help = "expected `<limit>/<period>";
    let one = "10/fortnight".parse::<Rule>().unwrap_err().to_string();
    assert_eq!(one.matches(help).count(), 1, "{one}");
    assert!(one.contains("unknown time unit \"fortnight\""), "{one}");
    // Several malformed rules: each named with its reason, the help once.
    let many = "10/fortnight; 5/s bogus, 1/s"
        .parse::<RuleSet>()
        .unwrap_err();
    let text = many.to_string();
    assert_eq!(text.matches(help).count(), 1, "{text}");
    assert!(
        text.contains("\"10/fortnight\": unknown time unit"),
        "{text}"
    );
    assert!(text.contains("\"5/s bogus\": unknown algorithm"), "{text}");
    // A value error needs no syntax help: it names the field and the fix.
    let invalid = "0/s, 1/s".parse::<RuleSet>().unwrap_err().to_string();
    assert!(!invalid.contains(help), "{invalid}");
    assert!(invalid.contains("`limit` must be at least 1"), "{invalid}");
}

/// The precisions a refusal suggests are ones the rule accepts: an operator who copies
/// one is done.
#[test]
fn a_refused_precision_suggests_only_precisions_that_pass() {
    for (limit_period, precision) in [
        ("10/s", 7),
        ("10/s", 6),
        ("10/s", 60),
        ("10/s", 0),
        ("10/s", 5_000),
        ("10/1500ms", 7),
        ("5/7us", 3),
        ("100/min", 7),
    ] {
        let text = format!("{limit_period} sliding-window precision={precision}");
        let message = text.parse::<Rule>().unwrap_err().to_string();
        let (_, suggested) = message
            .split_once("such as ")
            .unwrap_or_else(|| panic!("{text}: {message}"));
        let values: Vec<u64> = suggested
            .split([',', ' '])
            .filter_map(|word| word.parse().ok())
            .collect();
        assert!(!values.is_empty(), "{text}: {message}");
        for value in values {
            let fixed = format!("{limit_period} sliding-window precision={value}");
            fixed
                .parse::<Rule>()
                .unwrap_or_else(|e| panic!("{text} suggests {value}, refused: {e}"));
        }
    }
}
