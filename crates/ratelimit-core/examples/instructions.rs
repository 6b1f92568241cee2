//! A fixed number of calls of each measured operation, for counting instructions, which
//! unlike times do not depend on what else the machine runs:
//!
//! ```sh
//! cargo build --release -p ratelimit-core --example instructions
//! valgrind --tool=callgrind --callgrind-out-file=cg.out \
//!     target/release/examples/instructions 200000
//! callgrind_annotate --inclusive=yes cg.out | grep -E 'run_'
//! ```
//!
//! Each `run_*` function makes the given number of calls, so its inclusive count divided by
//! that number is the cost of one call (loop overhead included, a few instructions).

use std::hint::black_box;
use std::num::NonZeroU32;

use governor::{Quota, RateLimiter};
use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::{MemoryStore, RuleSet};

const T0: u64 = 1_700_000_000_000_000;

#[inline(never)]
fn run_decide(name: &str, text: &str, n: u64) {
    let rules: RuleSet = text.parse().unwrap();
    let mut states = vec![RuleState::Fresh; rules.len()];
    let mut admitted = 0;
    for i in 0..n {
        let t = black_box(decide(&rules, &mut states, black_box(T0 + i), 1));
        admitted += u64::from(t.decision.is_allowed());
    }
    println!("{name}: {admitted} of {n} admitted");
}

macro_rules! decide_fns {
    ($($fn:ident => $text:literal),* $(,)?) => {$(
        #[inline(never)]
        fn $fn(n: u64) {
            run_decide(stringify!($fn), $text, n)
        }
    )*};
}

decide_fns! {
    run_decide_fixed_window => "1000000/s fixed-window",
    run_decide_sliding_window_p1 => "1000000/s sliding-window precision=1",
    run_decide_sliding_window_p10 => "1000000/s sliding-window precision=10",
    run_decide_sliding_log => "10000/10ms sliding-log",
    run_decide_token_bucket => "1000000/s token-bucket capacity=1000",
    run_decide_leaky_meter => "1000000/s leaky-bucket mode=meter capacity=1000",
    run_decide_leaky_shaper => "1000000/s leaky-bucket mode=shaper burst=1000 delay=10",
    run_decide_gcra => "1000000/s gcra burst=1000",
}

#[inline(never)]
fn run_memory_store_check(store: &MemoryStore, rules: &RuleSet, key: &str, n: u64) {
    for _ in 0..n {
        black_box(
            store
                .check_now(black_box(key.as_bytes()), rules, 1)
                .unwrap(),
        );
    }
}

#[inline(never)]
fn run_governor_check_key<L>(check: L, n: u64)
where
    L: Fn() -> bool,
{
    for _ in 0..n {
        black_box(check());
    }
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(200_000, |a| a.parse().expect("calls"));
    run_decide_fixed_window(n);
    run_decide_sliding_window_p1(n);
    run_decide_sliding_window_p10(n);
    run_decide_sliding_log(n);
    run_decide_token_bucket(n);
    run_decide_leaky_meter(n);
    run_decide_leaky_shaper(n);
    run_decide_gcra(n);

    // The hot-key comparison of `benches/core.rs`: the same quota on both.
    let key = "203.0.113.7".to_owned();
    let store = MemoryStore::new();
    let rules: RuleSet = "100000000/s gcra burst=1000000".parse().unwrap();
    // The clock's one-time calibration outside the counted calls.
    store.check_now(b"warm-up", &rules, 1).unwrap();
    run_memory_store_check(&store, &rules, &key, n);
    let quota = Quota::per_second(NonZeroU32::new(100_000_000).unwrap())
        .allow_burst(NonZeroU32::new(1_000_000).unwrap());
    let governor = RateLimiter::keyed(quota);
    let _ = governor.check_key(&"warm-up".to_owned());
    run_governor_check_key(|| governor.check_key(black_box(&key)).is_ok(), n);
}
