//! MemoryStore behaviour beyond the conformance suite: threads, eviction, the key cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::{ManualClock, MemoryStore, RuleSet};

const T0: u64 = 1_700_000_000_000_000;

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
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(4)
        .max_keys(4_000)
        .build();
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
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(1)
        .max_keys(80)
        .build();
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
