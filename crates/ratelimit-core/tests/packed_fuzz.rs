//! The packed encoding as the native module reads it, fuzzed without a server: arbitrary
//! and mutated checks, states and refund arguments go through the very functions the
//! module calls on every command ([`Header::parse`], [`PackedRules::parse`] and
//! [`PackedRules::check_header`], [`packed::decode_state`], [`algo::decide`],
//! [`packed::encode_state`], [`algo::refund`], [`algo::refund_unspent`]). Whatever the
//! bytes: no panic (tests run in debug builds, where an overflow panics), no allocation
//! sized by a value that was not checked against the rules, and a state never longer
//! than [`MAX_STATE_VALUES`].
//!
//! proptest rather than cargo-fuzz: cargo-fuzz needs a nightly toolchain, which this
//! project's machines do not have, and these properties run in the ordinary test suite.
//! `PROPTEST_CASES` raises the number of cases for a longer run; the cases found are
//! kept as the regression tests at the end of this file.

use std::time::Duration;

use proptest::prelude::*;
use ratelimit_core::algo::{self, RuleState};
use ratelimit_core::packed::{
    self, Header, PackedRules, HEADER, MAX_EXACT, MAX_STATE_BYTES, MAX_STATE_VALUES, PER_RULE,
};
use ratelimit_core::testing::proptest_config;
use ratelimit_core::{Rule, RuleSet};

const T0: u64 = 1_700_000_000_000_000;

/// Rule sets of every algorithm and shape the store sends, widest included.
const RULE_SETS: &[&str] = &[
    "10/s",
    "5/s fixed-window; 6/s sliding-window precision=4; 7/s sliding-log; 8/s token-bucket \
     capacity=9; 10/s gcra burst=3 name=api; 11/s leaky-bucket mode=meter capacity=4; 12/s \
     leaky-bucket mode=shaper burst=5 delay=2",
    "1/s sliding-log; 20/min sliding-log",
    "100/min sliding-window precision=1000",
    "1000/h fixed-window; 3/s token-bucket",
    "2/s leaky-bucket mode=shaper burst=10 delay=2",
    "10/s; 3 concurrent timeout=1s",
    "1000 concurrent timeout=1h; 5/s fixed-window",
];

fn rules(i: usize) -> RuleSet {
    RULE_SETS[i % RULE_SETS.len()].parse().unwrap()
}

/// A double's bytes for a value a hostile client might send.
fn hostile_value() -> impl Strategy<Value = [u8; 8]> {
    prop_oneof![
        proptest::sample::select(vec![
            0.0,
            1.0,
            2.0,
            1000.0,
            MAX_EXACT as f64,
            (MAX_EXACT - 1) as f64,
            (1u64 << 52) as f64,
            (1u64 << 53) as f64,
            f64::MAX,
            -1.0,
            0.5,
            f64::NAN,
            f64::INFINITY,
            16.0,
            17.0,
            MAX_STATE_VALUES as f64,
        ])
        .prop_map(f64::to_le_bytes),
        (0..=MAX_EXACT).prop_map(|x| (x as f64).to_le_bytes()),
        any::<[u8; 8]>(),
    ]
}

/// `bytes` with some of its 8-byte values replaced by hostile ones, and maybe cut or
/// extended.
fn mutated(bytes: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let values = bytes.len() / 8;
    (
        proptest::collection::vec((0..values.max(1), hostile_value()), 1..4),
        prop_oneof![4 => Just(0i64), 1 => -16i64..16],
    )
        .prop_map(move |(edits, resize)| {
            let mut out = bytes.clone();
            for (i, v) in edits {
                if let Some(slot) = out.get_mut(8 * i..8 * i + 8) {
                    slot.copy_from_slice(&v);
                }
            }
            let len = (out.len() as i64 + resize).max(0) as usize;
            out.resize(len, 0xff);
            out
        })
}

/// A packed check of one of [`RULE_SETS`], and its mutation.
fn check_case() -> impl Strategy<Value = (usize, Vec<u8>, Vec<u8>)> {
    (0..RULE_SETS.len(), 0u64..5, any::<bool>()).prop_flat_map(|(i, cost, injected)| {
        let bytes = packed::pack_check(&rules(i), injected.then_some(T0), cost, 0, None);
        (Just(i), Just(bytes.clone()), mutated(bytes))
    })
}

/// A state written by a committed check of [`RULE_SETS`] `i` (over a short trace), and
/// its mutation.
fn state_case(i: usize) -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    (0u64..4, 0u64..3_000_000).prop_flat_map(move |(n, step)| {
        let set = rules(i);
        let bytes = packed::pack_check(&set, Some(T0), 1, 0, None);
        let (header, rest) = Header::parse(&bytes).unwrap();
        let parsed = PackedRules::parse(rest, &header).unwrap();
        let mut states = vec![RuleState::Fresh; set.len()];
        let mut now = T0;
        for _ in 0..n {
            algo::decide(&set, &mut states, now, 1);
            now += step;
        }
        let mut raw = Vec::new();
        packed::encode_state(&mut raw, &header, &parsed, &states, now);
        (Just(raw.clone()), mutated(raw))
    })
}

/// What a module command does with a check whose rules it has (maybe from its cache by
/// the rules' bytes, `cached`) and a stored value `raw`: never panics, and every length
/// it allocates by is one the rules vouch for.
fn run_check(bytes: &[u8], cached: Option<&PackedRules>, raw: &[u8], now: u64) {
    let Ok((header, rule_bytes)) = Header::parse(bytes) else {
        return;
    };
    let parsed;
    let rules = match cached {
        Some(rules) => {
            if rules.check_header(&header).is_err() {
                return;
            }
            rules
        }
        None => match PackedRules::parse(rule_bytes, &header) {
            Ok(rules) => {
                parsed = rules;
                &parsed
            }
            Err(_) => return,
        },
    };
    assert!(header.width <= MAX_STATE_VALUES, "{header:?}");
    assert!(header.log_limit <= ratelimit_core::MAX_LOG_LIMIT);
    if rules.rules().check_cost(header.cost).is_err() {
        return;
    }
    let now = header.now.unwrap_or(now);
    let mut states: Vec<RuleState> = match packed::decode_state(raw, &header, rules, now) {
        Some(stored) => stored.states.to_vec(),
        None => vec![RuleState::Fresh; rules.rules().len()],
    };
    let before = states.clone();
    let transition = algo::decide(rules.rules(), &mut states, now, header.cost);
    let mut out = Vec::new();
    packed::encode_decision(
        &mut out,
        &transition.decision,
        rules.rules().concurrent(),
        false,
    );
    if transition.committed {
        let mut state = Vec::new();
        packed::encode_state(&mut state, &header, rules, &states, now);
        // The fixed part, and a concurrency rule's slots after it.
        if rules.rules().concurrent().is_none() {
            assert_eq!(state.len(), 8 * header.width);
        } else {
            assert!(state.len() >= 8 * header.width && state.len() <= MAX_STATE_BYTES);
        }
    }
    // A slot released and renewed, as `RATELIMIT.RELEASE` and `RENEW` do on any value.
    for edit in [
        packed::SlotEdit::Release,
        packed::SlotEdit::Renew(1_000_000),
    ] {
        if let Some((out, _, _)) = packed::edit_slots(raw, now, now, edit) {
            assert!(out.len() <= raw.len().max(MAX_STATE_BYTES));
        }
    }
    // A charge given back, as `GIVE_BACK` does on a state of the check's own layout.
    let mut given = before;
    algo::refund(rules.rules(), &mut given, header.cost, now, now);
}

proptest! {
    #![proptest_config(proptest_config(2_000, "tests/packed_fuzz.proptest-regressions"))]

    #[test]
    fn arbitrary_bytes_are_refused_or_decided(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        raw in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        run_check(&bytes, None, &raw, T0);
    }

    #[test]
    fn mutated_checks_are_refused_or_decided_cached_or_not(
        (i, original, bytes) in check_case(),
    ) {
        // The module keeps parsed rules by their bytes: a mutated header whose rule
        // bytes are unchanged meets the rules parsed from the original.
        let (header, rest) = Header::parse(&original).unwrap();
        let cached = PackedRules::parse(rest, &header).unwrap();
        let state = {
            let mut raw = Vec::new();
            let set = rules(i);
            let mut states = vec![RuleState::Fresh; set.len()];
            algo::decide(&set, &mut states, T0, 1);
            packed::encode_state(&mut raw, &header, &cached, &states, T0);
            raw
        };
        run_check(&bytes, Some(&cached), &state, T0);
        run_check(&bytes, None, &state, T0);
    }

    #[test]
    fn mutated_states_are_read_or_refused_and_decided(
        (i, (clean, raw)) in (0..RULE_SETS.len()).prop_flat_map(|i| (Just(i), state_case(i))),
        later in 0u64..10_000_000_000,
    ) {
        let bytes = packed::pack_check(&rules(i), Some(T0 + later), 1, 0, None);
        run_check(&bytes, None, &clean, T0);
        run_check(&bytes, None, &raw, T0);
        // The same state read by another rule set: carried entry by entry.
        let other = packed::pack_check(&rules(i + 1), Some(T0 + later), 2, 0, None);
        run_check(&other, None, &raw, T0);
    }

    #[test]
    fn lease_refunds_take_any_numbers(
        algorithm in 0u8..4,
        limit in prop_oneof![Just(1u64), 1u64..1_000_000, Just(MAX_EXACT)],
        period_s in 1u64..100_000,
        level in 0..=MAX_EXACT,
        last in 0..=MAX_EXACT,
        unspent in prop_oneof![any::<u64>(), 0..=MAX_EXACT],
        granted in prop_oneof![any::<u64>(), 0..=MAX_EXACT],
        start in 0..=MAX_EXACT,
        now in 0..=MAX_EXACT,
    ) {
        // As `RATELIMIT.REFUND` builds each rule from the client's numbers.
        let period = Duration::from_secs(period_s);
        let (rule, mut state) = match algorithm {
            0 => (Rule::fixed_window(limit, period), RuleState::Window { index: level, count: last }),
            1 => (Rule::token_bucket(limit, period, limit), RuleState::Tokens { level, last }),
            _ => (Rule::gcra(limit, period, 1), RuleState::Tat { us: level, frac: last % limit.max(1) }),
        };
        if let Ok(rule) = rule {
            algo::refund_unspent(&rule, &mut state, unspent, granted, start, now);
        }
    }
}

fn parse(bytes: &[u8]) -> (Header, PackedRules) {
    let (header, rest) = Header::parse(bytes).unwrap();
    let rules = PackedRules::parse(rest, &header).unwrap();
    (header, rules)
}

fn set_value(bytes: &mut [u8], i: usize, x: f64) {
    bytes[8 * i..8 * i + 8].copy_from_slice(&x.to_le_bytes());
}

/// The check that aborted redis-server: rules the module had parsed before (so served
/// from its cache by their bytes), under a header claiming a state of 2^53 - 1 values.
#[test]
fn a_header_that_lies_about_the_width_is_refused_for_cached_rules() {
    let set = rules(0);
    let bytes = packed::pack_check(&set, None, 1, 0, None);
    let (_, cached) = parse(&bytes);
    for (index, lie) in [(5, MAX_EXACT as f64), (6, 1e4), (7, 1e9), (4, 2.0)] {
        let mut hostile = bytes.clone();
        set_value(&mut hostile, index, lie);
        // The rule count is part of the length check: a lie there fails the parse.
        let Ok((header, _)) = Header::parse(&hostile) else {
            continue;
        };
        let err = cached.check_header(&header).unwrap_err();
        assert!(err.to_string().is_ascii(), "{err}");
    }
}

/// The value that stalled redis-server for 26 s: 4 MiB at a limiter key, 262,144
/// entries of distinct identities. Longer than any state: refused before it is walked.
#[test]
fn a_value_longer_than_any_state_is_not_one() {
    let (header, rules) = parse(&packed::pack_check(&rules(1), Some(T0), 1, 0, None));
    let mut raw = Vec::with_capacity(4 << 20);
    raw.extend_from_slice(&1f64.to_le_bytes());
    let mut id = 1u64;
    while raw.len() + 16 <= 4 << 20 {
        raw.extend_from_slice(&((id + 1_000) as f64).to_le_bytes());
        raw.extend_from_slice(&0f64.to_le_bytes());
        id += 1;
    }
    assert!(raw.len() > MAX_STATE_BYTES);
    assert_eq!(packed::decode_state(&raw, &header, &rules, T0), None);
    // At the bound, a value of foreign identities is walked once and read as fresh.
    // (An odd number of values after the layout: whole entries only.)
    raw.truncate(MAX_STATE_BYTES - 8);
    let stored = packed::decode_state(&raw, &header, &rules, T0).unwrap();
    assert!(stored.states.iter().all(|s| *s == RuleState::Fresh));
}

/// The widest rule set's state fits [`MAX_STATE_VALUES`] exactly: the bound refuses
/// nothing a store writes.
#[test]
fn the_widest_state_is_within_the_bound() {
    let text = vec!["100/s sliding-window precision=1000"; ratelimit_core::MAX_RULES]
        .iter()
        .enumerate()
        .map(|(i, r)| format!("{r} name=r{i}"))
        .collect::<Vec<_>>()
        .join("; ");
    let set: RuleSet = text.parse().unwrap();
    let widest = packed::state_width(&set) as usize;
    let with_log = widest + 3;
    assert!(
        with_log <= MAX_STATE_VALUES,
        "{with_log} > {MAX_STATE_VALUES}"
    );
    assert_eq!(HEADER + PER_RULE, 16);
}
