//! Decision speed: every algorithm's pure transition, MemoryStore next to governor's keyed
//! limiter on the same quota, and a 4-rule check.
//!
//! `cargo bench -p ratelimit-core --bench core`

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use std::hint::black_box;
use std::num::NonZeroU32;

use criterion::{criterion_group, criterion_main, Criterion};
use governor::{Quota, RateLimiter};
use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::{MemoryStore, RuleSet};

const T0: u64 = 1_700_000_000_000_000;

fn pure_decisions(c: &mut Criterion) {
    // Quotas of about one unit per microsecond, advanced 1 µs per decision, so each
    // iteration takes the admitting path and writes state.
    let cases = [
        ("fixed_window", "1000000/s fixed-window"),
        ("sliding_window_p1", "1000000/s sliding-window precision=1"),
        (
            "sliding_window_p10",
            "1000000/s sliding-window precision=10",
        ),
        ("sliding_log", "10000/10ms sliding-log"),
        ("token_bucket", "1000000/s token-bucket capacity=1000"),
        (
            "leaky_meter",
            "1000000/s leaky-bucket mode=meter capacity=1000",
        ),
        (
            "leaky_shaper",
            "1000000/s leaky-bucket mode=shaper burst=1000 delay=10",
        ),
        ("gcra", "1000000/s gcra burst=1000"),
    ];
    let mut group = c.benchmark_group("decide");
    for (name, text) in cases {
        let rules: RuleSet = text.parse().unwrap();
        let mut states = vec![RuleState::Fresh; rules.len()];
        let mut now = T0;
        group.bench_function(name, |b| {
            b.iter(|| {
                now += 1;
                black_box(decide(&rules, &mut states, black_box(now), 1))
            })
        });
    }
    group.finish();
}

fn hot_key(c: &mut Criterion) {
    let key = "203.0.113.7".to_owned();
    let mut group = c.benchmark_group("hot_key_gcra");
    // Same quota on both: 100M per second, burst 1M (admits on almost every call).
    let store = MemoryStore::new();
    let rules: RuleSet = "100000000/s gcra burst=1000000".parse().unwrap();
    group.bench_function("memory_store_check", |b| {
        b.iter(|| black_box(store.check_now(black_box(key.as_bytes()), &rules, 1)))
    });
    let quota = Quota::per_second(NonZeroU32::new(100_000_000).unwrap())
        .allow_burst(NonZeroU32::new(1_000_000).unwrap());
    let governor = RateLimiter::keyed(quota);
    group.bench_function("governor_check_key", |b| {
        b.iter(|| black_box(governor.check_key(black_box(&key))))
    });
    group.finish();

    let mut group = c.benchmark_group("multi_rule");
    let four: RuleSet = "1000000/s gcra burst=1000; 20000000/min sliding-window precision=4; \
                         100000000/h fixed-window; 2000000000/day fixed-window"
        .parse()
        .unwrap();
    group.bench_function("memory_store_4_rules", |b| {
        b.iter(|| black_box(store.check_now(black_box(key.as_bytes()), &four, 1)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = pure_decisions, hot_key
}
criterion_main!(benches);
