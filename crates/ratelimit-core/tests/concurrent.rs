//! `N concurrent` rules: the text form, its bounds, and the slots' invariants over
//! random traces of acquires, releases, renewals and time, in the pure transition and in
//! `MemoryStore`.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use ratelimit_core::algo::{self, RuleState};
use ratelimit_core::{ConfigError, ManualClock, MemoryStore, Rule, RuleSet};

#[test]
fn text_form_round_trips_with_its_defaults() {
    let r: Rule = "4 concurrent".parse().unwrap();
    assert!(r.is_concurrent());
    assert_eq!(r.limit(), 4);
    assert_eq!(r.period(), Duration::from_secs(60));
    assert_eq!(r.to_string(), "4 concurrent timeout=1m");
    let named: Rule = "8 CONCURRENT timeout=500ms name=llm".parse().unwrap();
    assert_eq!(named.to_string(), "8 concurrent timeout=500ms name=llm");
    assert_eq!(named.to_string().parse::<Rule>().unwrap(), named);
    let set: RuleSet = "60/min; 4 concurrent timeout=30s".parse().unwrap();
    assert_eq!(set.concurrent(), Some(1));
    assert_eq!(
        set.to_string(),
        "60/1m gcra burst=60; 4 concurrent timeout=30s"
    );
    // A changed limit or timeout keeps the rule's identity, so its held slots.
    let other: RuleSet = "60/min; 2 concurrent timeout=5s".parse().unwrap();
    assert_eq!(set.rule_ids()[1], other.rule_ids()[1]);
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    for (text, says) in [
        ("0 concurrent", "between 1 and 1000"),
        ("1001 concurrent", "between 1 and 1000"),
        ("4 concurrent timeout=99ms", "between 100 ms and 3600 s"),
        ("4 concurrent timeout=61min", "between 100 ms and 3600 s"),
        ("4 concurrent timeout=30", "a duration such as"),
        ("4 concurrent burst=3", "does not apply to concurrent"),
        ("4 concurrent timeout=1s timeout=2s", "given twice"),
        ("4 concurrent fast", "unexpected"),
        (
            "4 concurrent; 2 concurrent name=b",
            "at most one `concurrent` rule",
        ),
    ] {
        let err = text.parse::<RuleSet>().unwrap_err();
        assert!(err.to_string().contains(says), "{text}: {err}");
    }
    assert!(matches!(
        Rule::concurrent(1_001, Duration::from_secs(1)),
        Err(ConfigError::BadConcurrency { limit: 1_001, .. })
    ));
    // The bounds themselves are accepted.
    for text in ["1 concurrent timeout=100ms", "1000 concurrent timeout=1h"] {
        text.parse::<Rule>().unwrap();
    }
}

#[test]
fn any_cost_fits_a_concurrency_rule() {
    let set: RuleSet = "2 concurrent".parse().unwrap();
    set.check_cost(1_000_000).unwrap();
    let both: RuleSet = "5/s; 2 concurrent".parse().unwrap();
    assert_eq!(both.check_cost(6).unwrap_err().rule, 0);
}

#[derive(Debug, Clone)]
enum Op {
    Acquire(u64),
    /// Release the i-th slot ever taken (modulo), perhaps again.
    Release(usize),
    Renew(usize),
    Advance(u64),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => prop_oneof![Just(1u64), Just(0), 2u64..5].prop_map(Op::Acquire),
        4 => (0usize..64).prop_map(Op::Release),
        2 => (0usize..64).prop_map(Op::Renew),
        3 => prop_oneof![Just(0u64), 1u64..1_000, 1u64..3_000_000].prop_map(Op::Advance),
    ];
    proptest::collection::vec(op, 1..120)
}

/// A model of what must hold: the slots taken and not freed, each with its deadline.
struct Model {
    held: HashMap<u64, u64>,
    taken: Vec<u64>,
    timeout: u64,
}

impl Model {
    fn live(&self, now: u64) -> u64 {
        self.held.values().filter(|&&d| d > now).count() as u64
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Never more than the limit live at once; a slot frees at its deadline; a release
    /// frees its own slot once and never another; numbers never repeat; the transition
    /// and MemoryStore agree on every answer.
    #[test]
    fn slots_never_exceed_the_limit_and_release_once(limit in 1u64..5, ops in ops()) {
        let rules: RuleSet = format!("{limit} concurrent timeout=1s").parse().unwrap();
        let mut states = vec![RuleState::Fresh];
        let mut now = 1_700_000_000_000_000u64;
        let clock = ManualClock::new(now);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let mut model = Model { held: HashMap::new(), taken: Vec::new(), timeout: 1_000_000 };
        for op in ops {
            match op {
                Op::Acquire(cost) => {
                    let t = algo::decide(&rules, &mut states, now, cost);
                    let d = store.check_now(b"k", &rules, cost).unwrap();
                    prop_assert_eq!(&t.decision, &d);
                    let live = model.live(now);
                    prop_assert_eq!(d.is_allowed(), live < limit, "live {}", live);
                    prop_assert_eq!(d.rules()[0].remaining, limit - live.min(limit) - u64::from(d.slot().is_some()));
                    if let Some(slot) = d.slot() {
                        prop_assert!(cost > 0);
                        prop_assert!(!model.taken.contains(&slot), "number {} given twice", slot);
                        model.held.insert(slot, now + model.timeout);
                        model.taken.push(slot);
                    } else if d.is_allowed() {
                        prop_assert_eq!(cost, 0);
                    } else {
                        let retry = d.retry_after().unwrap();
                        prop_assert!(retry > Duration::ZERO && retry <= Duration::from_secs(1));
                    }
                    prop_assert!(model.live(now) <= limit);
                }
                Op::Release(i) if !model.taken.is_empty() => {
                    let slot = model.taken[i % model.taken.len()];
                    let freed = algo::release(&mut states, slot, now);
                    prop_assert_eq!(freed, store.release_now(b"k", slot));
                    let was_live = model.held.remove(&slot).is_some_and(|d| d > now);
                    prop_assert_eq!(freed, was_live);
                }
                Op::Renew(i) if !model.taken.is_empty() => {
                    let slot = model.taken[i % model.taken.len()];
                    let renewed = algo::renew(&mut states, slot, model.timeout, now);
                    prop_assert_eq!(renewed, store.renew_now(b"k", &rules, slot));
                    match model.held.get_mut(&slot) {
                        Some(d) if *d > now => {
                            prop_assert!(renewed);
                            *d = now + model.timeout;
                        }
                        _ => prop_assert!(!renewed),
                    }
                }
                Op::Advance(us) => {
                    now += us;
                    clock.set(now);
                }
                _ => {}
            }
            let peek = store.check_now(b"k", &rules, 0).unwrap();
            prop_assert_eq!(peek.rules()[0].remaining, limit - model.live(now).min(limit));
        }
    }
}

/// A wait that gives up (its turn is later than its maximum wait) releases the slot its
/// check took, as it gives the units back.
#[tokio::test]
async fn a_wait_that_gives_up_releases_its_slot() {
    use ratelimit_core::{Store, StoreExt, WaitError};
    let store = MemoryStore::builder()
        .clock(ManualClock::new(1_700_000_000_000_000))
        .build();
    let rules: RuleSet = "1/s leaky-bucket mode=shaper burst=5; 2 concurrent"
        .parse()
        .unwrap();
    let first = store
        .until_ready(b"k", &rules, 1, Duration::from_millis(100))
        .await
        .unwrap();
    assert!(first.slot().is_some());
    let late = store
        .until_ready(b"k", &rules, 1, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(late, WaitError::TooLong { .. }), "{late:?}");
    // One slot held (the first's), the second given back.
    let peek = store.check(b"k", &rules, 0).await.unwrap();
    assert_eq!(peek.rules()[1].remaining, 1, "{peek:?}");
}

#[test]
fn a_slot_taken_whatever_the_limit_counts_until_released() {
    let clock = ManualClock::new(1_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let rules: RuleSet = "10/min fixed-window; 2 concurrent timeout=10s"
        .parse()
        .unwrap();
    let first = store.check_now(b"k", &rules, 1).unwrap().slot().unwrap();
    let second = store.check_now(b"k", &rules, 1).unwrap().slot().unwrap();
    assert!(!store.check_now(b"k", &rules, 1).unwrap().is_allowed());
    // Full, and taken all the same: numbered after the others, a unit charged.
    let taken = store.take_slot_now(b"k", &rules).unwrap();
    assert!(taken > second && second > first);
    let peek = store.check_now(b"k", &rules, 0).unwrap();
    assert_eq!(peek.rules()[0].remaining, 7);
    // Three held against a limit of 2: refused until two are released.
    store.release_now(b"k", first);
    assert!(!store.check_now(b"k", &rules, 1).unwrap().is_allowed());
    store.release_now(b"k", taken);
    assert!(store.check_now(b"k", &rules, 1).unwrap().is_allowed());

    // A key the store holds nothing for is taken from fresh.
    assert!(store.take_slot_now(b"new", &rules).is_some());
    let peek = store.check_now(b"new", &rules, 0).unwrap();
    assert_eq!(peek.rules()[0].remaining, 9);
    assert_eq!(peek.rules()[1].remaining, 1);
    // Nothing to take without a concurrency rule, nor on a state of other rules.
    let rates: RuleSet = "10/min".parse().unwrap();
    assert_eq!(store.take_slot_now(b"rates", &rates), None);
    store.check_now(b"rates", &rates, 1).unwrap();
    assert_eq!(store.take_slot_now(b"rates", &rules), None);
    assert_eq!(
        store.check_now(b"rates", &rates, 0).unwrap().rules()[0].remaining,
        9
    );
}

#[test]
fn slots_taken_whatever_the_limit_stop_at_the_most_a_state_holds() {
    let clock = ManualClock::new(1_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let rules: RuleSet = "1 concurrent timeout=10s".parse().unwrap();
    for _ in 0..ratelimit_core::MAX_CONCURRENT {
        assert!(store.take_slot_now(b"k", &rules).is_some());
    }
    assert_eq!(store.take_slot_now(b"k", &rules), None);
    // Past their deadlines, they make room again.
    clock.advance(Duration::from_secs(10));
    assert!(store.take_slot_now(b"k", &rules).is_some());
}
