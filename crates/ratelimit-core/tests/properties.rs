//! Invariants each algorithm promises, over random arrival traces.

use proptest::prelude::*;
use ratelimit_core::algo::{
    carry, carry_converting, debit, debt_cap, decide, refund, settle, Carried, RuleState,
};
use ratelimit_core::testing::{proptest_config, strategy};
use ratelimit_core::{Algorithm, Rule, RuleSet};
use std::time::Duration;

/// Arrival times (µs, non-decreasing) with gaps from 0 to ~3 periods of `period_us`.
fn arrivals(period_us: u64, n: usize) -> impl Strategy<Value = Vec<u64>> {
    let gap = prop_oneof![
        4 => Just(0u64),
        4 => 0..period_us / 10 + 1,
        2 => 0..period_us,
        1 => 0..3 * period_us,
    ];
    proptest::collection::vec(gap, 1..n).prop_map(|gaps| {
        let mut t = 1_700_000_000_000_000u64;
        gaps.into_iter()
            .map(|g| {
                t += g;
                t
            })
            .collect()
    })
}

/// Replays `times` (each a request of cost 1) and returns the admitted times, each paired
/// with its delay.
fn admitted(rules: &RuleSet, times: &[u64]) -> Vec<(u64, u64)> {
    let mut states = vec![RuleState::Fresh; rules.len()];
    times
        .iter()
        .filter_map(|&t| {
            let tr = decide(rules, &mut states, t, 1);
            tr.decision
                .is_allowed()
                .then(|| (t, tr.decision.delay().as_micros() as u64))
        })
        .collect()
}

/// The most admitted times in any half-open window `[t, t + period)`.
fn max_in_window(times: &[u64], period: u64) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= period {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

const PERIODS: [u64; 4] = [1_000, 10_000, 1_000_000, 60_000_000];

proptest! {
    #![proptest_config(proptest_config(256, "proptest-regressions/properties.txt"))]

    #[test]
    fn sliding_log_never_exceeds_limit_in_any_window(
        limit in 1u64..20, p in 0usize..4, seed in arrivals(1_000_000, 300)
    ) {
        let period = PERIODS[p];
        let times: Vec<u64> = seed.iter().map(|t| t / (1_000_000 / period.min(1_000_000))).collect();
        let rules = RuleSet::from(Rule::sliding_log(limit, Duration::from_micros(period)).unwrap());
        let ok: Vec<u64> = admitted(&rules, &times).into_iter().map(|(t, _)| t).collect();
        prop_assert!(max_in_window(&ok, period) as u64 <= limit);
    }

    #[test]
    fn fixed_window_admits_at_most_twice_the_limit_in_any_window(
        limit in 1u64..20, times in arrivals(1_000_000, 300)
    ) {
        let rules = RuleSet::from(Rule::fixed_window(limit, Duration::from_secs(1)).unwrap());
        let ok: Vec<u64> = admitted(&rules, &times).into_iter().map(|(t, _)| t).collect();
        prop_assert!(max_in_window(&ok, 1_000_000) as u64 <= 2 * limit);
    }

    #[test]
    fn buckets_admit_at_most_burst_plus_rate_times_span(
        limit in 1u64..20, burst in 1u64..10, algo in 0u8..3, times in arrivals(1_000_000, 250)
    ) {
        let period = Duration::from_secs(1);
        let rule = match algo {
            0 => Rule::gcra(limit, period, burst),
            1 => Rule::token_bucket(limit, period, burst),
            _ => Rule::leaky_meter(limit, period, burst),
        }.unwrap();
        let ok: Vec<u64> = admitted(&RuleSet::from(rule), &times).into_iter().map(|(t, _)| t).collect();
        for i in 0..ok.len() {
            for j in i..ok.len() {
                let span = ok[j] - ok[i];
                let bound = burst + span * limit / 1_000_000;
                prop_assert!((j - i + 1) as u64 <= bound, "{} admitted within {span} µs", j - i + 1);
            }
        }
    }

    #[test]
    fn gcra_token_bucket_and_leaky_meter_decide_alike(
        limit in 1u64..20, burst in 1u64..10, p in 0usize..4, seed in arrivals(1_000_000, 200)
    ) {
        let period = Duration::from_micros(PERIODS[p]);
        let sets = [
            RuleSet::from(Rule::gcra(limit, period, burst).unwrap()),
            RuleSet::from(Rule::token_bucket(limit, period, burst).unwrap()),
            RuleSet::from(Rule::leaky_meter(limit, period, burst).unwrap()),
        ];
        let runs: Vec<_> = sets.iter().map(|r| admitted(r, &seed)).collect();
        prop_assert_eq!(&runs[0], &runs[1]);
        prop_assert_eq!(&runs[0], &runs[2]);
    }

    #[test]
    fn shaper_output_never_exceeds_the_leak_rate(
        limit in 1u64..20, burst in 0u64..8, nodelay in 0u64..8, p in 0usize..4,
        seed in arrivals(1_000_000, 200)
    ) {
        let period = PERIODS[p];
        let delay = nodelay.min(burst);
        let rule = Rule::leaky_shaper(limit, Duration::from_micros(period), burst, delay).unwrap();
        let mut out: Vec<u64> = admitted(&RuleSet::from(rule), &seed)
            .into_iter()
            .map(|(t, d)| t + d)
            .collect();
        out.sort_unstable();
        for i in 0..out.len() {
            for j in i + 1..out.len() {
                // Beyond the `delay` requests let through early, outputs leave one emission
                // interval apart; each is rounded up to a whole microsecond, hence the + 1.
                let n = (j - i) as u64;
                prop_assert!(
                    n.saturating_sub(delay) * period <= (out[j] - out[i] + 1) * limit,
                    "{n} outputs in {} µs", out[j] - out[i]
                );
            }
        }
    }

    #[test]
    fn a_denied_check_changes_no_state_and_a_peek_never_does(
        sets in strategy::rule_set(), seed in arrivals(1_000_000, 120), costs in proptest::collection::vec(0u64..4, 120)
    ) {
        let mut states = vec![RuleState::Fresh; sets.len()];
        for (i, t) in seed.iter().enumerate() {
            let cost = costs[i % costs.len()];
            if sets.check_cost(cost).is_err() {
                continue;
            }
            let before = states.clone();
            let tr = decide(&sets, &mut states, *t, cost);
            if !tr.decision.is_allowed() || cost == 0 {
                prop_assert_eq!(&states, &before, "cost {} changed state: {:?}", cost, tr.decision);
                prop_assert!(!tr.committed);
            } else {
                prop_assert!(tr.committed);
            }
        }
    }

    /// Carrying a state to the rules that wrote it changes no decision, whenever it
    /// happens: a store may read in place or carry, alike.
    #[test]
    fn carrying_to_the_same_rules_decides_as_the_state_given(
        sets in strategy::rule_set(), seed in arrivals(1_000_000, 120), costs in proptest::collection::vec(0u64..4, 120)
    ) {
        let mut states = vec![RuleState::Fresh; sets.len()];
        for (i, t) in seed.iter().enumerate() {
            let cost = costs[i % costs.len()];
            if sets.check_cost(cost).is_err() {
                continue;
            }
            let mut carried = carry(&sets, &states, &sets, *t).into_vec();
            let want = decide(&sets, &mut states, *t, cost);
            let got = decide(&sets, &mut carried, *t, cost);
            prop_assert_eq!(&want.decision, &got.decision);
            prop_assert_eq!(want.expires_at_us, got.expires_at_us);
        }
    }

    /// Under rules that changed, a denial's retry_after still holds: the same check at
    /// that instant is admitted (carried states are states the new rules can keep their
    /// promises on), through any history of commits under random versions.
    #[test]
    fn after_a_rule_change_retry_after_still_holds(
        // A concurrency rule's retry_after is a hint (capped at a second), not a promise.
        sets in strategy::rule_set_versions(3)
            .prop_filter("rates only", |sets| sets.iter().all(|s| s.concurrent().is_none())),
        seed in arrivals(1_000_000, 120),
        picks in proptest::collection::vec((0usize..3, 1u64..4), 120)
    ) {
        let (mut writer, mut states) = (sets[0].clone(), vec![RuleState::Fresh; sets[0].len()]);
        for (i, t) in seed.iter().enumerate() {
            let (v, cost) = picks[i % picks.len()];
            let rules = &sets[v];
            if rules.check_cost(cost).is_err() {
                continue;
            }
            let Carried { states: next, converted } = carry_converting(&writer, &states, rules, *t);
            let mut next = next.into_vec();
            let tr = decide(rules, &mut next, *t, cost);
            // As a store does: the carried states are written on a commit, and on a
            // denial after a conversion.
            if tr.committed || converted {
                (writer, states) = (rules.clone(), next);
            }
            if let Some(retry) = tr.decision.retry_after() {
                let later = *t + retry.as_micros() as u64;
                let mut again = carry(&writer, &states, rules, later).into_vec();
                let d = decide(rules, &mut again, later, cost).decision;
                prop_assert!(
                    d.is_allowed(),
                    "{} after {}: denied at +{:?} ({:?}), then {:?}",
                    rules, writer, retry, tr.decision, d
                );
            }
        }
    }

    /// What a GCRA client owes is the same under any limit: carried to another limit
    /// and back at one instant, the TAT is exactly what it was; and the usage under the
    /// other limit is the same number of units.
    #[test]
    fn a_tat_carried_to_another_limit_and_back_is_unchanged(
        (l1, l2) in (1u64..=1_000, 1u64..=1_000), period_ms in 1u64..=86_400_000,
        used in 1u64..=20, gap in 0u64..1_000_000_000,
    ) {
        let period = Duration::from_millis(period_ms);
        let a: RuleSet = RuleSet::new(vec![Rule::gcra(l1, period, 20).unwrap()]).unwrap();
        let b: RuleSet = RuleSet::new(vec![Rule::gcra(l2, period, 20).unwrap()]).unwrap();
        let t0 = 1_700_000_000_000_000u64;
        let mut states = vec![RuleState::Fresh];
        prop_assert!(decide(&a, &mut states, t0, used).committed);
        let now = t0 + gap;
        let there = carry_converting(&a, &states, &b, now);
        let back = carry_converting(&b, &there.states, &a, now);
        if let RuleState::Tat { us, .. } = states[0] {
            if us > now {
                prop_assert_eq!(&back.states[..], &states[..]);
                prop_assert_eq!(there.converted, l1 != l2);
                // The units left are the same count of units used, under either limit.
                let left_a = decide(&a, &mut states.clone(), now, 0).decision.rules()[0].remaining;
                let left_b = decide(&b, &mut there.states.to_vec(), now, 0).decision.rules()[0].remaining;
                prop_assert_eq!(left_a, left_b);
            }
        }
    }

    #[test]
    fn rules_round_trip_through_their_text(rule in strategy::rule()) {
        let text = rule.to_string();
        let back: Rule = text.parse().unwrap();
        prop_assert_eq!(back, rule);
    }

    #[test]
    fn retry_after_is_exact_for_every_algorithm(
        sets in strategy::rule_set().prop_filter("rates only", |s| s.concurrent().is_none()),
        seed in arrivals(1_000_000, 80)
    ) {
        // Whenever a check is denied, waiting exactly `retry_after` (with nothing else
        // happening) admits that rule, and waiting one microsecond less does not, for the
        // rule that determines the overall `retry_after`.
        let mut states = vec![RuleState::Fresh; sets.len()];
        for t in seed {
            let tr = decide(&sets, &mut states, t, 1);
            if let Some(retry) = tr.decision.retry_after() {
                let retry = retry.as_micros() as u64;
                let mut probe = states.clone();
                let later = decide(&sets, &mut probe, t + retry, 0);
                let worst = tr.decision.rules().iter().enumerate()
                    .max_by_key(|(_, r)| r.retry_after).map(|(i, _)| i).unwrap();
                prop_assert!(later.decision.rules()[worst].allowed, "not admitted at retry_after");
                if retry > 0 {
                    let mut probe = states.clone();
                    let early = decide(&sets, &mut probe, t + retry - 1, 0);
                    prop_assert!(!early.decision.rules()[worst].allowed, "admitted before retry_after");
                }
            }
        }
    }
}

/// Every value a state holds, for the bound the Redis store's Lua needs (below 2^53).
fn values(state: &RuleState) -> Vec<u64> {
    match state {
        RuleState::Fresh => vec![],
        RuleState::Window { index, count } => vec![*index, *count],
        RuleState::Counters { index, counts } => {
            let mut v = vec![*index];
            v.extend(counts.iter());
            v
        }
        RuleState::Log(log) => log.iter().copied().collect(),
        RuleState::Tokens { level, last } => vec![*level, *last],
        RuleState::Tat { us, frac } => vec![*us, *frac],
        RuleState::Slots(table) => std::iter::once(table.next)
            .chain(table.held.iter().flat_map(|&(d, n)| [d, n]))
            .collect(),
    }
}

proptest! {
    #![proptest_config(proptest_config(256, "proptest-regressions/properties.txt"))]

    /// A settle to the charge itself changes nothing; one below it is the refund of the
    /// difference, whatever the history.
    #[test]
    fn a_settle_at_or_below_the_charge_is_the_refund_of_the_difference(
        sets in strategy::rule_set(), seed in arrivals(1_000_000, 60),
        steps in proptest::collection::vec((1u64..4, 0u64..4, 0u64..2_000_000), 60)
    ) {
        let mut states = vec![RuleState::Fresh; sets.len()];
        for (i, t) in seed.iter().enumerate() {
            let (charged, actual, later) = steps[i % steps.len()];
            if sets.check_cost(charged).is_err() {
                continue;
            }
            if !decide(&sets, &mut states, *t, charged).committed {
                continue;
            }
            let now = *t + later;
            let mut same = states.clone();
            prop_assert!(!settle(&sets, &mut same, charged, charged, *t, now));
            prop_assert_eq!(&same, &states);
            if actual < charged {
                let mut settled = states.clone();
                let mut refunded = states.clone();
                let a = settle(&sets, &mut settled, charged, actual, *t, now);
                let b = refund(&sets, &mut refunded, charged - actual, *t, now);
                prop_assert_eq!(a, b);
                prop_assert_eq!(&settled, &refunded);
                states = settled;
            }
        }
    }

    /// Under checks and settles above their charges, a denial's retry_after holds: the
    /// same check at that instant is admitted (a debt says how long it lasts).
    #[test]
    fn retry_after_holds_for_a_key_in_debt(
        // A concurrency rule's retry is a hint: its slots are held until released.
        sets in strategy::rule_set().prop_filter("rates only", |s| s.concurrent().is_none()),
        seed in arrivals(1_000_000, 80),
        excess in proptest::collection::vec(prop_oneof![0u64..3, 0u64..50, Just(u64::MAX)], 80)
    ) {
        let mut states = vec![RuleState::Fresh; sets.len()];
        for (i, t) in seed.iter().enumerate() {
            let tr = decide(&sets, &mut states, *t, 1);
            if tr.committed {
                settle(&sets, &mut states, 1, 1u64.saturating_add(excess[i % excess.len()]), *t, *t);
            }
            if let Some(retry) = tr.decision.retry_after() {
                let later = *t + retry.as_micros() as u64;
                let d = decide(&sets, &mut states.clone(), later, 1).decision;
                prop_assert!(d.is_allowed(), "{}: denied at +{:?} ({:?}), then {:?}", sets, retry, tr.decision, d);
            }
        }
    }

    /// However large and however many the settles, every value stays below 2^53, one
    /// settle charges no rule more than its cap, and the key is admitted again within
    /// its capacity plus that cap at its rate, and a period.
    #[test]
    fn debt_is_bounded(sets in strategy::rule_set(), n in 1usize..6, at in 0u64..86_400_000_000) {
        let t = 1_700_000_000_000_000u64 + at;
        let mut states = vec![RuleState::Fresh; sets.len()];
        for _ in 0..n {
            debit(&sets, &mut states, u64::MAX, t);
            for s in &states {
                for v in values(s) {
                    prop_assert!(v < 1 << 53, "{} holds {}", sets, v);
                }
            }
        }
        // A concurrency rule takes no debt (and its one slot here is free again by then).
        let wait = sets.rules().iter().filter(|r| r.algorithm() != Algorithm::Concurrent).map(|r| {
            let cap = debt_cap(r);
            prop_assert!(cap >= 1 && cap <= r.limit());
            let drain = u128::from(r.capacity() + cap) * u128::from(r.period_us()) / u128::from(r.limit());
            Ok(u64::try_from(drain).unwrap() + r.period_us())
        }).collect::<Result<Vec<u64>, TestCaseError>>()?.into_iter().max().unwrap_or(0);
        let d = decide(&sets, &mut states.clone(), t + wait, 1).decision;
        prop_assert!(d.is_allowed(), "{} still in debt after {} us: {:?}", sets, wait, d);
    }
}
