//! MemoryStore behaviour beyond the conformance suite: threads, eviction, the key cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::{Clock, ManualClock, MemoryStore, RuleSet};

const T0: u64 = 1_700_000_000_000_000;

/// A store on `clock` with `shards` shards and room for `max_keys` entries.
fn capped(clock: &ManualClock, shards: usize, max_keys: usize) -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(clock.clone())
        .shards(shards)
        .max_keys(max_keys)
        .build()
}

/// Every algorithm: 8 threads hammering one key while the clock moves admit exactly what
/// one thread replaying the same instants admits.
#[test]
fn eight_threads_on_one_key_admit_exactly_what_a_serial_run_admits() {
    let sets = [
        "50/s fixed-window",
        "50/s sliding-window precision=4",
        "50/s sliding-log",
        "50/s token-bucket capacity=20",
        "50/s leaky-bucket mode=meter capacity=20",
        "50/s leaky-bucket mode=shaper burst=10 delay=3",
        "50/s gcra burst=20",
        "20/s sliding-log; 50/s sliding-window precision=2; 100/s gcra burst=10",
    ];
    const THREADS: u64 = 8;
    const PER_STEP: u64 = 40;
    const STEPS: u64 = 50;
    for text in sets {
        let rules: RuleSet = text.parse().unwrap();
        // Serial reference: at each step, PER_STEP × THREADS requests at the same instant.
        let mut states = vec![RuleState::Fresh; rules.len()];
        let mut expected = 0;
        for step in 0..STEPS {
            for _ in 0..PER_STEP * THREADS {
                if decide(&rules, &mut states, T0 + step * 7_000, 1)
                    .decision
                    .is_allowed()
                {
                    expected += 1;
                }
            }
        }
        let clock = ManualClock::new(T0);
        let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
        let admitted = Arc::new(AtomicU64::new(0));
        for step in 0..STEPS {
            clock.set(T0 + step * 7_000);
            std::thread::scope(|s| {
                for _ in 0..THREADS {
                    let (store, rules, admitted) = (&store, &rules, &admitted);
                    s.spawn(move || {
                        for _ in 0..PER_STEP {
                            if store.check_now(b"hot", rules, 1).unwrap().is_allowed() {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
        }
        assert_eq!(admitted.load(Ordering::Relaxed), expected, "{text}");
        assert!(
            expected > 0 && expected < STEPS * PER_STEP * THREADS,
            "{text}: {expected}"
        );
    }
}

#[test]
fn a_flood_of_distinct_keys_stays_under_the_cap() {
    let clock = ManualClock::new(T0);
    let store = capped(&clock, 4, 4_000);
    let rules: RuleSet = "10/h gcra burst=10".parse().unwrap();
    for i in 0..50_000u32 {
        assert!(store
            .check_now(&i.to_be_bytes(), &rules, 1)
            .unwrap()
            .is_allowed());
        assert!(
            store.len() <= 4_000,
            "{} entries after {i} keys",
            store.len()
        );
    }
    assert!(
        store.len() > 3_000,
        "evicts an eighth at a time, not everything: {}",
        store.len()
    );
}

#[test]
fn at_the_cap_the_entries_nearest_to_fresh_go_first() {
    let clock = ManualClock::new(T0);
    let store = capped(&clock, 1, 80);
    let rules: RuleSet = "1/min gcra burst=1".parse().unwrap();
    // 40 keys used early (their state expires first), then 40 used 30 s later.
    for i in 0..40u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    clock.advance(Duration::from_secs(30));
    for i in 40..80u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    // The 81st key forces an eviction of an eighth (10 entries): all from the early group.
    store.check_now(b"new", &rules, 1).unwrap();
    assert_eq!(store.len(), 71);
    for i in 40..80u32 {
        let d = store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
        assert!(!d.is_allowed(), "late key {i} must still be limited");
    }
}

#[test]
fn idle_keys_are_dropped_without_a_sweeper() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(1)
        .build();
    let rules: RuleSet = "5/s fixed-window".parse().unwrap();
    for i in 0..1_000u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    assert_eq!(store.len(), 1_000);
    clock.advance(Duration::from_secs(2));
    // Growth past the sweep mark drops the expired thousand.
    for i in 1_000..2_100u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    assert!(store.len() <= 1_100, "{} entries", store.len());
}

#[test]
fn peeks_and_denials_create_no_entries() {
    let store = MemoryStore::new();
    let rules: RuleSet = "1/s fixed-window".parse().unwrap();
    store.check_now(b"a", &rules, 0).unwrap();
    assert!(store.is_empty());
    store.check_now(b"a", &rules, 1).unwrap();
    store.check_now(b"a", &rules, 1).unwrap();
    assert_eq!(store.len(), 1);
    assert!(
        store.check_now(b"a", &rules, 2).is_err(),
        "cost above capacity"
    );
}

/// The attack from the issue, at a small cap: a client at its limit, then a flood of
/// one-shot keys many times the cap. Fixed windows give every flood key the same expiry as
/// the client (they tie on expiry); GCRA gives the flood keys a later one.
#[test]
fn a_flood_of_one_shot_keys_never_resets_a_client_at_its_limit() {
    for text in [
        "5/min fixed-window",
        "5/min",
        "5/min sliding-log; 100/h fixed-window",
    ] {
        let clock = ManualClock::new(T0 - T0 % 60_000_000);
        let store = capped(&clock, 2, 64);
        let rules: RuleSet = text.parse().unwrap();
        for _ in 0..5 {
            assert!(store.check_now(b"victim", &rules, 1).unwrap().is_allowed());
        }
        // A client that used 4 of its 5 is near its limit: it must outlive the flood too.
        for _ in 0..4 {
            assert!(store.check_now(b"near", &rules, 1).unwrap().is_allowed());
        }
        assert!(!store.check_now(b"victim", &rules, 1).unwrap().is_allowed());
        for i in 0..20_000u32 {
            clock.advance(Duration::from_micros(5));
            assert!(store
                .check_now(&i.to_be_bytes(), &rules, 1)
                .unwrap()
                .is_allowed());
            if i % 97 == 0 {
                let d = store.check_now(b"victim", &rules, 1).unwrap();
                assert!(!d.is_allowed(), "{text}: victim reset after {i} keys");
            }
            assert!(store.len() <= 64);
        }
        let near = store.check_now(b"near", &rules, 1).unwrap();
        assert!(near.is_allowed(), "{text}: the fifth unit of `near`");
        assert!(
            !store.check_now(b"near", &rules, 1).unwrap().is_allowed(),
            "{text}: `near` kept its four units through the flood"
        );
    }
}

/// Tier beats expiry: clients at their limit whose state expires first still outlive
/// one-shot keys that expire later; within a tier, the soonest expiry goes first.
#[test]
fn eviction_order_is_closeness_to_the_limit_then_expiry() {
    let clock = ManualClock::new(T0);
    let store = capped(&clock, 1, 80);
    // GCRA 5/min: one unit costs 12 s of state, five cost 60 s.
    let rules: RuleSet = "5/min".parse().unwrap();
    let limited = |i: u32| format!("limited-{i}");
    for i in 0..20 {
        for _ in 0..5 {
            store.check_now(limited(i).as_bytes(), &rules, 1).unwrap();
        }
    }
    // One-shot keys 50 s and 55 s later: their states expire at 62 s and 67 s, after the
    // limited ones' 60 s.
    clock.advance(Duration::from_secs(50));
    for i in 0..30u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    clock.advance(Duration::from_secs(5));
    for i in 30..60u32 {
        store.check_now(&i.to_be_bytes(), &rules, 1).unwrap();
    }
    assert_eq!(store.len(), 80);
    // The 81st key evicts an eighth (10 entries): the earliest one-shot keys.
    store.check_now(b"new", &rules, 1).unwrap();
    assert_eq!(store.len(), 71);
    // 55 s after their five units the limited keys have 4 back (GCRA returns one per
    // 12 s); forgotten, they would have 5.
    for i in 0..20 {
        let d = store.check_now(limited(i).as_bytes(), &rules, 0).unwrap();
        assert_eq!(d.rules()[0].remaining, 4, "limited key {i} was forgotten");
    }
    let remaining = |i: u32| {
        store
            .check_now(&i.to_be_bytes(), &rules, 0)
            .unwrap()
            .rules()[0]
            .remaining
    };
    let forgotten = (0..60).filter(|&i| remaining(i) == 5).collect::<Vec<_>>();
    assert_eq!(forgotten.len(), 10, "{forgotten:?}");
    assert!(forgotten.iter().all(|&i| i < 30), "{forgotten:?}");
}

/// Long keys are held as digests: distinct long keys stay distinct, one long key maps to
/// one entry, and a short key equal to a long key's digest is another key.
#[test]
fn long_keys_are_held_by_digest_and_never_collide_with_short_ones() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let rules: RuleSet = "1/min fixed-window".parse().unwrap();
    let mut long = vec![b'k'; 64 * 1024];
    for i in 0..50u32 {
        long[..4].copy_from_slice(&i.to_be_bytes());
        assert!(store.check_now(&long, &rules, 1).unwrap().is_allowed());
        assert!(!store.check_now(&long, &rules, 1).unwrap().is_allowed());
    }
    assert_eq!(store.len(), 50);
    let digest = ratelimit_core::key::digest(&long);
    assert!(store.check_now(&digest, &rules, 1).unwrap().is_allowed());
    // Blocks and resets find long keys the same way.
    store.block_now(&long, None);
    assert!(!store.check_now(&long, &rules, 0).unwrap().is_allowed());
    assert_ne!(
        store.check_now(&digest, &rules, 0).unwrap().outcome(),
        ratelimit_core::Outcome::Blocked
    );
    store.unblock_now(&long);
    store.reset_now(&long, &rules);
    assert!(store.check_now(&long, &rules, 1).unwrap().is_allowed());
}

/// Keys of every length (held in the entry, out of line, as digests) under rule sets of
/// every shape (one packed state, one state held out of line, several rules), with resets
/// that move other entries and changes of rules: every check answers as the pure
/// transition does on a state of its own, and a flood of one-shot keys, which makes the
/// shard evict and renumber its entries, forgets none of those at their limit.
#[test]
fn keys_of_every_length_under_every_rule_shape_keep_their_own_state() {
    let clock = ManualClock::new(T0);
    let store = capped(&clock, 1, 512);
    let sets: Vec<RuleSet> = [
        "3/min",
        "3/min token-bucket capacity=3",
        "3/min fixed-window",
        "3/min sliding-window precision=2",
        "3/min sliding-log",
        "3/min; 10/h fixed-window",
    ]
    .iter()
    .map(|t| t.parse().unwrap())
    .collect();
    let key = |len: usize, tag: u8| -> Vec<u8> { (0..len).map(|i| tag ^ i as u8).collect() };
    let mut model: Vec<(Vec<u8>, usize, Vec<RuleState>)> = Vec::new();
    for len in 1..=80 {
        for (s, rules) in sets.iter().enumerate() {
            model.push((
                key(len, s as u8 * 16 + 1),
                s,
                vec![RuleState::Fresh; rules.len()],
            ));
        }
    }
    let step = |model: &mut Vec<(Vec<u8>, usize, Vec<RuleState>)>, round: usize| {
        clock.advance(Duration::from_millis(700));
        let now = clock.now_us();
        for (i, (key, s, reference)) in model.iter_mut().enumerate() {
            if (i + round) % 11 == 0 {
                store.reset_now(key, &sets[*s]);
                reference.iter_mut().for_each(|r| *r = RuleState::Fresh);
                continue;
            }
            let got = store.check_now(key, &sets[*s], 1).unwrap();
            let want = decide(&sets[*s], reference, now, 1).decision;
            assert_eq!(got, want, "key of {} bytes, rules {}", key.len(), sets[*s]);
        }
    };
    for round in 0..8 {
        step(&mut model, round);
    }
    // Every key moves to the next rule set: the state carries (or starts over) in the
    // store as in the pure transition.
    for (_, s, reference) in model.iter_mut() {
        let next = (*s + 1) % sets.len();
        *reference = ratelimit_core::algo::carry(&sets[*s], reference, &sets[next], clock.now_us())
            .into_vec();
        *s = next;
    }
    for round in 8..12 {
        step(&mut model, round);
    }
    // The keys whose last check was denied are at their limit; the flood evicts one-shot
    // keys only, renumbering the entries each time, and they keep their states.
    let now = clock.now_us();
    let mut limited = Vec::new();
    for (i, (key, s, reference)) in model.iter_mut().enumerate() {
        let got = store.check_now(key, &sets[*s], 1).unwrap();
        assert_eq!(got, decide(&sets[*s], reference, now, 1).decision);
        if !got.is_allowed() {
            limited.push(i);
        }
    }
    assert!(limited.len() > 200, "{} keys at their limit", limited.len());
    for i in 0..5_000u32 {
        clock.advance(Duration::from_micros(5));
        store.check_now(&i.to_be_bytes(), &sets[0], 1).unwrap();
        assert!(store.len() <= 512);
    }
    let now = clock.now_us();
    for i in limited {
        let (key, s, reference) = &mut model[i];
        let got = store.check_now(key, &sets[*s], 1).unwrap();
        let want = decide(&sets[*s], reference, now, 1).decision;
        assert_eq!(got, want, "key of {} bytes, rules {}", key.len(), sets[*s]);
    }
}

/// A settle above the charge: the example through the store, for a key held
/// packed and for one held out of line; a key whose entry is gone is charged from
/// fresh; a key written under other rules keeps what it was charged.
#[test]
fn settles_charge_debt_where_the_key_is_held() {
    let clock = ManualClock::new(T0 / 3_600_000_000 * 3_600_000_000);
    let store = capped(&clock, 4, 1_000);
    for text in [
        "1000/h fixed-window",
        "1000/h fixed-window; 5000/d gcra burst=5000",
    ] {
        let rules: RuleSet = text.parse().unwrap();
        let key = text.as_bytes();
        for i in 0..4 {
            let at = clock.now_us();
            assert!(
                store.check_now(key, &rules, 100).unwrap().is_allowed(),
                "{text}: {i}"
            );
            assert!(store.settle_now(key, &rules, 100, 300, at));
            // Nothing to do when the actual is the charge.
            assert!(!store.settle_now(key, &rules, 100, 100, at));
        }
        let fifth = store.check_now(key, &rules, 100).unwrap();
        assert!(!fifth.is_allowed(), "{text}");
        assert_eq!(fifth.rules()[0].remaining, 0);
        // Below the charge: the refund of the difference.
        let at = clock.now_us();
        assert!(store.settle_now(key, &rules, 300, 100, at));
        assert!(store.check_now(key, &rules, 0).unwrap().rules()[0].remaining == 0);
    }

    let rules: RuleSet = "10/s gcra burst=10".parse().unwrap();
    let at = clock.now_us();
    assert!(store.settle_now(b"estimate 0", &rules, 0, 10, at));
    assert!(!store
        .check_now(b"estimate 0", &rules, 1)
        .unwrap()
        .is_allowed());

    let other: RuleSet = "20/s gcra burst=20".parse().unwrap();
    assert!(store.check_now(b"changed", &other, 1).unwrap().is_allowed());
    assert!(!store.settle_now(b"changed", &rules, 1, 10, at));
    let left = store.check_now(b"changed", &other, 0).unwrap().rules()[0].remaining;
    assert_eq!(left, 19);
}

/// The worked example of the `algo` docs ("Settling a charge"): at `40000/min gcra` (a
/// token every 1,500 µs, 666⅔ a second), an estimate of 2,000 charged at the door and
/// settled to 200 after a 1 s stream gives back the 1,800 less the 666⅔ that refilled
/// meanwhile.
#[test]
fn a_settle_below_the_estimate_keeps_what_refilled_while_the_request_ran() {
    let clock = ManualClock::new(T0);
    let store = capped(&clock, 1, 100);
    let rules: RuleSet = "40000/min gcra".parse().unwrap();
    let left = |key: &[u8]| store.check_now(key, &rules, 0).unwrap().rules()[0].remaining;
    let t0 = clock.now_us();
    // An idle key: the estimate at the door (TAT t0 + 3 s), the actual at the settle.
    let check = store.check_now(b"idle", &rules, 2_000).unwrap();
    assert_eq!(check.rules()[0].remaining, 38_000);
    // Beside it, a key charged the actual at the door: TAT t0 + 0.3 s.
    assert!(store.check_now(b"ideal", &rules, 200).unwrap().is_allowed());
    clock.advance(Duration::from_secs(1));
    // 2 s of TAT ahead: 1,333⅓ in use.
    assert_eq!(left(b"idle"), 38_666);
    assert!(store.settle_now(b"idle", &rules, 2_000, 200, t0));
    // 1,800 tokens (2.7 s) less 1 s drained: 1.7 s goes back, TAT t0 + 1.3 s, 0.3 s
    // ahead of now: the 200 in use as if charged now, where the door's 200 have drained.
    assert_eq!(left(b"idle"), 39_800);
    assert_eq!(left(b"ideal"), 40_000);

    // A key kept busy by another request's 10,000 (never settled): the settle leaves its
    // TAT 1 s (666⅔ tokens) later than charging the actual at the door would have.
    let t0 = clock.now_us();
    for key in [&b"busy"[..], b"busy ideal"] {
        assert!(store.check_now(key, &rules, 10_000).unwrap().is_allowed());
    }
    assert!(store
        .check_now(b"busy", &rules, 2_000)
        .unwrap()
        .is_allowed());
    assert!(store
        .check_now(b"busy ideal", &rules, 200)
        .unwrap()
        .is_allowed());
    clock.advance(Duration::from_secs(1));
    assert!(store.settle_now(b"busy", &rules, 2_000, 200, t0));
    // TAT t0 + 16.3 s against t0 + 15.3 s: 10,200 in use against 9,533⅓.
    assert_eq!(left(b"busy"), 29_800);
    assert_eq!(left(b"busy ideal"), 30_466);
    // A stream long enough to drain the whole difference (2.7 s) gets nothing back.
    let t0 = clock.now_us();
    assert!(store
        .check_now(b"long", &rules, 2_000)
        .unwrap()
        .is_allowed());
    clock.advance(Duration::from_millis(2_700));
    assert!(!store.settle_now(b"long", &rules, 2_000, 200, t0));
    assert_eq!(left(b"long"), 39_800);
}
