//! The store conformance suite: the same traces, with the same injected times, must give
//! the same decisions from every [`Store`].
//!
//! Every case (algorithms, multi-rule, cost, peek, blocks, key isolation, long keys,
//! rules that change under a key's state) is a function in [`cases`]. [`conformance_tests!`](crate::conformance_tests) expands each
//! into its own `#[test]` for a store, so a failure names its case and the others still
//! run; [`conformance`] runs them all in one call. [`run_trace`] and the [`strategy`]
//! module drive random traces, so a test can require identical answers from two stores,
//! and [`proptest_config`] keeps their shrunk failures in a committed file.
//!
//! ```
//! use ratelimit_core::{testing, MemoryStore};
//!
//! # futures::executor::block_on(async {
//! testing::conformance(|clock| async move { MemoryStore::builder().clock(clock).build() }).await;
//! # });
//! ```

use std::future::Future;
use std::time::Duration;

use crate::{Clock, Decision, ManualClock, Outcome, RuleSet, Store};

/// The conformance suite's start time: midnight UTC, so windows of up to a day align.
pub const T0_US: u64 = 1_699_920_000_000_000;

const MS: u64 = 1_000;
const S: u64 = 1_000_000;

struct Case<'a, St> {
    name: &'static str,
    store: &'a St,
    clock: &'a ManualClock,
}

impl<'a, St: Store> Case<'a, St> {
    fn new(store: &'a St, clock: &'a ManualClock, name: &'static str) -> Self {
        Case { name, store, clock }
    }

    fn rules(&self, text: &str) -> RuleSet {
        text.parse()
            .unwrap_or_else(|e| panic!("[{}] bad rules {text:?}: {e}", self.name))
    }

    async fn check(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Decision {
        self.store
            .check(key, rules, cost)
            .await
            .unwrap_or_else(|e| panic!("[{}] check failed: {e}", self.name))
    }

    async fn allowed(&self, key: &[u8], rules: &RuleSet, n: usize, what: &str) {
        for i in 0..n {
            let d = self.check(key, rules, 1).await;
            assert!(
                d.is_allowed(),
                "[{}] {what}: request {} of {n} should be allowed, got {d:?}",
                self.name,
                i + 1
            );
        }
    }

    async fn count_allowed(&self, key: &[u8], rules: &RuleSet, tries: usize) -> usize {
        let mut n = 0;
        for _ in 0..tries {
            if self.check(key, rules, 1).await.is_allowed() {
                n += 1;
            }
        }
        n
    }

    async fn denied(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        retry: Duration,
        what: &str,
    ) -> Decision {
        let d = self.check(key, rules, cost).await;
        assert_eq!(
            d.outcome(),
            Outcome::Limited,
            "[{}] {what}: {d:?}",
            self.name
        );
        assert_eq!(
            d.retry_after(),
            Some(retry),
            "[{}] {what}: retry_after of {d:?}",
            self.name
        );
        d
    }

    fn at(&self, offset_us: u64) {
        self.clock.set(T0_US + offset_us);
    }

    async fn refund(&self, key: &[u8], rules: &RuleSet, cost: u64, charged_at: u64) -> bool {
        self.store
            .refund(key, rules, cost, charged_at)
            .await
            .unwrap_or_else(|e| panic!("[{}] refund failed: {e}", self.name))
    }

    async fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        self.store
            .settle(key, rules, charged, actual, charged_at)
            .await
            .unwrap_or_else(|e| panic!("[{}] settle failed: {e}", self.name))
    }

    async fn release(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        self.store
            .release(key, rules, slot)
            .await
            .unwrap_or_else(|e| panic!("[{}] release failed: {e}", self.name))
    }

    async fn renew(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        self.store
            .renew(key, rules, slot)
            .await
            .unwrap_or_else(|e| panic!("[{}] renew failed: {e}", self.name))
    }

    /// An admitted check that took a slot: its number.
    async fn acquire(&self, key: &[u8], rules: &RuleSet, cost: u64, what: &str) -> u64 {
        let d = self.check(key, rules, cost).await;
        assert!(d.is_allowed(), "[{}] {what}: {d:?}", self.name);
        d.slot()
            .unwrap_or_else(|| panic!("[{}] {what}: no slot in {d:?}", self.name))
    }

    async fn block(&self, key: &[u8], d: Option<Duration>) {
        self.store
            .block(key, d)
            .await
            .unwrap_or_else(|e| panic!("[{}] block failed: {e}", self.name));
    }
}

/// Runs every conformance case in turn, each against a fresh store made by `make` with a
/// manual clock; panics with the case's name and the differing decision on the first
/// mismatch. [`conformance_tests!`](crate::conformance_tests) runs each case as its own
/// test instead.
///
/// Stores made by successive calls must not share state (use a fresh key prefix or
/// database per call when the backend is shared).
pub async fn conformance<St, F, Fut>(mut make: F)
where
    St: Store,
    F: FnMut(ManualClock) -> Fut,
    Fut: Future<Output = St>,
{
    macro_rules! run_all {
        ($($case:ident),* $(,)?) => {$(
            let clock = ManualClock::new(T0_US);
            let store = make(clock.clone()).await;
            cases::$case(&store, &clock).await;
        )*};
    }
    crate::__conformance_cases!(run_all);
}

/// Calls `$callback!` with the names of every conformance case.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($callback:ident $(, $($args:tt)*)?) => {
        $callback!($($($args)*,)?
            fixed_window_limit_remaining_reset_retry,
            fixed_window_double_burst_across_a_boundary,
            sliding_log_no_double_burst_across_a_boundary,
            sliding_window_precision_1_weights_the_previous_window,
            sliding_window_precision_2_weights_half_windows,
            sliding_window_retry_after_is_the_first_admitting_instant,
            sliding_log_rules_share_one_log,
            sliding_log_clock_stepping_back_counts_from_the_newest_entry,
            token_bucket_capacity_then_refill,
            gcra_burst_then_emission_interval,
            gcra_fractional_emission_interval,
            leaky_meter_admits_like_gcra,
            leaky_shaper_nginx_burst_and_delay,
            multi_rule_all_or_nothing,
            multi_rule_retry_after_is_the_largest,
            cost_consumes_units_and_too_large_is_an_error,
            peek_consumes_nothing,
            blocks_with_duration_without_end_lifted,
            reset_forgets_the_key,
            keys_are_data,
            idle_state_expires,
            long_keys_are_digests_distinct_from_short_keys,
            rule_change_limit_raised_keeps_usage,
            rule_change_limit_lowered_keeps_usage,
            rule_change_rule_added_starts_empty,
            rule_change_rule_removed_is_dropped_on_commit,
            rule_change_algorithm_changed_starts_afresh,
            rule_change_period_changed_starts_afresh,
            rule_change_named_rules_follow_their_names,
            rule_change_sliding_log_carries_while_a_log_rule_remains,
            refund_fixed_window_only_in_the_window_charged,
            refund_sliding_window_into_the_sub_window_charged,
            refund_sliding_log_removes_the_entry,
            refund_token_bucket_up_to_capacity,
            refund_gcra_and_leaky_bucket_move_the_arrival_time_back,
            refund_every_rule_and_nothing_after_the_rules_changed,
            settle_fixed_window_debt_until_the_window_ends,
            settle_sliding_window_debt_in_the_current_sub_window,
            settle_sliding_log_debt_fills_the_log,
            settle_token_bucket_below_empty,
            settle_gcra_and_leaky_bucket_push_the_arrival_time,
            settle_every_rule_capped_from_fresh_and_nothing_after_the_rules_changed,
            rule_change_gcra_carries_usage,
            rule_change_token_bucket_carries_usage,
            rule_change_leaky_meter_carries_usage,
            rule_change_leaky_shaper_carries_usage,
            concurrent_slots_up_to_the_limit_then_a_capped_hint,
            concurrent_release_is_idempotent_and_numbers_never_repeat,
            concurrent_slots_free_at_their_deadlines_and_renewal_moves_them,
            concurrent_with_a_rate_all_or_nothing,
            concurrent_peek_takes_no_slot_and_cost_takes_one,
            concurrent_slots_carry_over_a_limit_change,
            concurrent_refund_gives_units_back_and_keeps_the_slot,
        );
    };
}

/// Expands every conformance case into its own `#[test]` for one store, inside a module:
/// a failure names its case (`memory_store::gcra_fractional_emission_interval`) and the
/// other cases still run; one case runs alone with `cargo test <name>`.
///
/// * `setup` (optional): statements run at the start of each test, whose bindings live
///   for the whole test (a server to talk to, say);
/// * `run`: a closure that drives a future to completion (`block_on` of some runtime);
/// * `store`: an expression giving a `FnMut(ManualClock) -> impl Future<Output = impl
///   Store>`, called once per test with a manual clock set to [`testing::T0_US`](T0_US).
///
/// ```
/// use ratelimit_core::MemoryStore;
///
/// ratelimit_core::conformance_tests! {
///     mod memory_store {
///         run: |test| futures::executor::block_on(test),
///         store: |clock| async move { MemoryStore::builder().clock(clock).build() },
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (mod $module:ident {
        $(setup: { $($setup:stmt;)* },)?
        run: $run:expr,
        store: $store:expr $(,)?
    }) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            use $crate::__conformance_test;
            $crate::__conformance_cases!(
                __conformance_test, [$($($setup;)*)?] ($run) ($store)
            );
        }
    };
}

/// The statements inside a bracketed group, in the caller's scope.
#[doc(hidden)]
#[macro_export]
macro_rules! __unbracket {
    ($($t:tt)*) => { $($t)* };
}

/// One `#[test]` per case; the implementation of [`conformance_tests!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test {
    ($setup:tt $run:tt $store:tt, $($case:ident),* $(,)?) => {$(
        #[test]
        fn $case() {
            $crate::__unbracket! $setup;
            let mut make = $store;
            let run = $run;
            run(async move {
                let clock = $crate::ManualClock::new($crate::testing::T0_US);
                let store = make(clock.clone()).await;
                $crate::testing::cases::$case(&store, &clock).await;
            });
        }
    )*};
}

/// The conformance cases, one function each: every store's suite runs each as its own test
/// (see [`conformance_tests!`](crate::conformance_tests)), so a failure names its case and
/// the others still run. Each expects a fresh store on `clock`, set to
/// [`T0_US`].
pub mod cases {
    use std::time::Duration;

    use super::{Case, MS, S, T0_US};
    use crate::{ManualClock, Outcome, RuleSet, Store};

    /// Fixed window: limit, remaining, reset, retry.
    pub async fn fixed_window_limit_remaining_reset_retry<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "fixed window: limit, remaining, reset, retry");
        let r = c.rules("3/min fixed-window");
        c.at(10 * S);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(d.rules()[0].remaining, 2, "[{}] {d:?}", c.name);
        assert_eq!(
            d.rules()[0].reset_after,
            Duration::from_secs(50),
            "[{}] {d:?}",
            c.name
        );
        c.allowed(b"k", &r, 2, "rest of the window").await;
        c.denied(b"k", &r, 1, Duration::from_secs(50), "fourth in the window")
            .await;
        c.at(60 * S);
        c.allowed(b"k", &r, 3, "next window").await;
    }

    /// Fixed window: double burst across a boundary (documented weakness).
    pub async fn fixed_window_double_burst_across_a_boundary<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "fixed window: double burst across a boundary (documented weakness)",
        );
        let r = c.rules("100/min fixed-window");
        c.at(55 * S);
        assert_eq!(
            c.count_allowed(b"k", &r, 150).await,
            100,
            "[{}] before boundary",
            c.name
        );
        c.at(61 * S);
        assert_eq!(
            c.count_allowed(b"k", &r, 150).await,
            100,
            "[{}] after boundary",
            c.name
        );
    }

    /// Sliding log: no double burst across a boundary.
    pub async fn sliding_log_no_double_burst_across_a_boundary<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "sliding log: no double burst across a boundary",
        );
        let r = c.rules("100/min sliding-log");
        c.at(55 * S);
        assert_eq!(
            c.count_allowed(b"k", &r, 150).await,
            100,
            "[{}] before boundary",
            c.name
        );
        c.at(61 * S);
        assert_eq!(
            c.count_allowed(b"k", &r, 150).await,
            0,
            "[{}] after boundary",
            c.name
        );
        c.at(115 * S);
        assert_eq!(
            c.count_allowed(b"k", &r, 150).await,
            100,
            "[{}] a minute later",
            c.name
        );
    }

    /// Sliding window counter, precision 1: 25 at 1.25 min, 75 at 1.75 min.
    pub async fn sliding_window_precision_1_weights_the_previous_window<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "sliding window counter, precision 1: 25 at 1.25 min, 75 at 1.75 min",
        );
        let r = c.rules("100/min sliding-window precision=1");
        c.at(0);
        c.allowed(b"a", &r, 100, "first quarter minute").await;
        c.allowed(b"b", &r, 100, "first quarter minute").await;
        c.at(75 * S);
        assert_eq!(
            c.count_allowed(b"a", &r, 200).await,
            25,
            "[{}] at 1.25 min",
            c.name
        );
        c.at(105 * S);
        assert_eq!(
            c.count_allowed(b"b", &r, 200).await,
            75,
            "[{}] at 1.75 min",
            c.name
        );
    }

    /// Sliding window counter, precision 2: 50 at 1.25 min.
    pub async fn sliding_window_precision_2_weights_half_windows<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "sliding window counter, precision 2: 50 at 1.25 min",
        );
        let r = c.rules("100/min sliding-window precision=2");
        c.at(0);
        c.allowed(b"a", &r, 100, "first quarter minute").await;
        c.at(75 * S);
        assert_eq!(
            c.count_allowed(b"a", &r, 200).await,
            50,
            "[{}] at 1.25 min",
            c.name
        );
    }

    /// Sliding window counter: retry_after is the exact first admitting instant.
    pub async fn sliding_window_retry_after_is_the_first_admitting_instant<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "sliding window counter: retry_after is the exact first admitting instant",
        );
        let r = c.rules("10/min sliding-window precision=4");
        c.at(S);
        c.allowed(b"k", &r, 10, "burst").await;
        c.at(20 * S);
        let d = c.check(b"k", &r, 1).await;
        let retry = d.retry_after().expect("denied");
        c.at(20 * S + retry.as_micros() as u64 - 1);
        assert!(
            !c.check(b"k", &r, 1).await.is_allowed(),
            "[{}] just before retry_after",
            c.name
        );
        c.at(20 * S + retry.as_micros() as u64);
        assert!(
            c.check(b"k", &r, 1).await.is_allowed(),
            "[{}] at retry_after {retry:?}",
            c.name
        );
    }

    /// Sliding log: 1/s and 5/min share one log (the four-second wait).
    pub async fn sliding_log_rules_share_one_log<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "sliding log: 1/s and 5/min share one log (the four-second wait)",
        );
        let r = c.rules("1/s sliding-log; 5/min sliding-log");
        let hms = |m: u64, s: u64| (12 * 3600 + m * 60 + s) * S;
        for (m, s) in [(33, 35), (33, 37), (34, 14), (34, 26), (34, 28)] {
            c.at(hms(m, s));
            c.allowed(b"k", &r, 1, "the five logged requests").await;
        }
        c.at(hms(34, 31));
        let d = c
            .denied(b"k", &r, 1, Duration::from_secs(4), "at 12:34:31")
            .await;
        assert!(
            d.rules()[0].allowed && !d.rules()[1].allowed,
            "[{}] {d:?}",
            c.name
        );
        c.at(hms(34, 40));
        c.allowed(b"k", &r, 1, "at 12:34:40").await;
        c.denied(b"k", &r, 1, Duration::from_secs(1), "right after")
            .await;
    }

    /// Sliding log under a clock that steps back past the newest entry: the check is
    /// decided and logged as if at the newest entry's time, and the times it reports
    /// count from the clock's reading.
    pub async fn sliding_log_clock_stepping_back_counts_from_the_newest_entry<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "sliding log: a clock stepping back counts from the newest entry",
        );
        let r = c.rules("3/s sliding-log");
        let one = |d: &crate::Decision| {
            (
                d.is_allowed(),
                d.rules()[0].remaining,
                d.rules()[0].reset_after,
            )
        };
        c.at(0);
        c.allowed(b"k", &r, 1, "at 0").await;
        c.at(1_500 * MS);
        c.allowed(b"k", &r, 1, "at 1.5 s").await;
        // Back to 0.5 s: as at 1.5 s, the entry of 0 has left the window.
        c.at(500 * MS);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(
            one(&d),
            (true, 1, Duration::from_secs(2)),
            "[{}] back at 0.5 s: {d:?}",
            c.name
        );
        // Logged at 1.5 s, so the log stays newest first: the third unit is free at 1.5 s.
        c.at(600 * MS);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(
            one(&d),
            (true, 0, Duration::from_millis(1_900)),
            "[{}] back at 0.6 s: {d:?}",
            c.name
        );
        c.at(700 * MS);
        c.denied(b"k", &r, 1, Duration::from_millis(1_800), "back at 0.7 s")
            .await;
        c.at(2_499 * MS);
        c.denied(b"k", &r, 3, Duration::from_millis(1), "at 2.499 s")
            .await;
        c.at(2_500 * MS);
        let d = c.check(b"k", &r, 3).await;
        assert!(d.is_allowed(), "[{}] at 2.5 s: {d:?}", c.name);
    }

    /// Token bucket: capacity then refill.
    pub async fn token_bucket_capacity_then_refill<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "token bucket: capacity then refill");
        let r = c.rules("1/s token-bucket capacity=5");
        c.at(0);
        c.allowed(b"k", &r, 5, "full bucket").await;
        c.denied(b"k", &r, 1, Duration::from_secs(1), "empty bucket")
            .await;
        c.at(2_500 * MS);
        c.allowed(b"k", &r, 2, "2.5 tokens").await;
        c.denied(b"k", &r, 1, Duration::from_millis(500), "half a token")
            .await;
    }

    /// GCRA: 100/s with burst 6 (the seed's burst of 5 on top of one).
    pub async fn gcra_burst_then_emission_interval<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "GCRA: 100/s with burst 6 (the seed's burst of 5 on top of one)",
        );
        let r = c.rules("100/s gcra burst=6");
        c.at(500 * MS);
        for left in (0..6).rev() {
            let d = c.check(b"k", &r, 1).await;
            assert!(d.is_allowed(), "[{}] {d:?}", c.name);
            assert_eq!(d.rules()[0].remaining, left, "[{}] {d:?}", c.name);
        }
        c.denied(b"k", &r, 1, Duration::from_millis(10), "seventh")
            .await;
        c.at(510 * MS);
        c.allowed(b"k", &r, 1, "one emission interval later").await;
        c.denied(b"k", &r, 1, Duration::from_millis(10), "again")
            .await;
        c.at(10 * S);
        c.allowed(b"k", &r, 6, "idle again").await;
    }

    /// GCRA: emission interval that is not a whole microsecond.
    pub async fn gcra_fractional_emission_interval<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "GCRA: emission interval that is not a whole microsecond",
        );
        let r = c.rules("3/10us gcra burst=1");
        c.at(0);
        let mut admitted = 0;
        for _ in 0..30 {
            admitted += c.count_allowed(b"k", &r, 2).await;
            c.clock.advance(Duration::from_micros(1));
        }
        // The emission interval is 3⅓ µs and requests arrive on whole microseconds, so each
        // admission lands on the first whole microsecond at or after its theoretical time:
        // 0, 4, 8, ..., 28. Rounding the interval to 3 µs would admit 10, to 4 µs 8 at
        // other instants; the exact fraction is what both stores must agree on.
        assert_eq!(admitted, 8, "[{}] 3 per 10 µs over 30 µs", c.name);
    }

    /// Leaky bucket meter admits like GCRA.
    pub async fn leaky_meter_admits_like_gcra<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "leaky bucket meter admits like GCRA");
        let r = c.rules("100/s leaky-bucket mode=meter capacity=6");
        c.at(0);
        c.allowed(b"k", &r, 6, "bucket").await;
        c.denied(b"k", &r, 1, Duration::from_millis(10), "full")
            .await;
    }

    /// Leaky bucket shaper: nginx burst and delay.
    pub async fn leaky_shaper_nginx_burst_and_delay<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "leaky bucket shaper: nginx burst and delay");
        let r = c.rules("10/s leaky-bucket mode=shaper burst=3 delay=0");
        c.at(0);
        for want in [0, 100, 200, 300] {
            let d = c.check(b"a", &r, 1).await;
            assert!(d.is_allowed(), "[{}] {d:?}", c.name);
            assert_eq!(d.delay(), Duration::from_millis(want), "[{}] {d:?}", c.name);
        }
        c.denied(b"a", &r, 1, Duration::from_millis(100), "queue full")
            .await;
        let r = c.rules("10/s leaky-bucket mode=shaper burst=3 delay=2");
        for want in [0, 0, 0, 100] {
            let d = c.check(b"b", &r, 1).await;
            assert_eq!(d.delay(), Duration::from_millis(want), "[{}] {d:?}", c.name);
        }
        c.at(1_000 * MS);
        let d = c.check(b"b", &r, 1).await;
        assert_eq!(d.delay(), Duration::ZERO, "[{}] drained: {d:?}", c.name);
    }

    /// Multi-rule: all or nothing.
    pub async fn multi_rule_all_or_nothing<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "multi-rule: all or nothing");
        let r = c.rules("10/min fixed-window; 1/s gcra burst=1");
        c.at(0);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(d.rules()[0].remaining, 9, "[{}] {d:?}", c.name);
        let d = c
            .denied(
                b"k",
                &r,
                1,
                Duration::from_secs(1),
                "second in the same second",
            )
            .await;
        assert!(d.rules()[0].allowed, "[{}] {d:?}", c.name);
        assert_eq!(
            d.rules()[0].remaining,
            9,
            "[{}] nothing consumed: {d:?}",
            c.name
        );
        c.at(S);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(d.rules()[0].remaining, 8, "[{}] {d:?}", c.name);
    }

    /// Multi-rule: retry_after is the largest over denying rules.
    pub async fn multi_rule_retry_after_is_the_largest<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "multi-rule: retry_after is the largest over denying rules",
        );
        let r = c.rules("2/min fixed-window; 1/s fixed-window");
        c.at(0);
        c.allowed(b"k", &r, 1, "first").await;
        c.denied(b"k", &r, 1, Duration::from_secs(1), "second, same second")
            .await;
        c.at(S);
        c.allowed(b"k", &r, 1, "second").await;
        c.denied(b"k", &r, 1, Duration::from_secs(59), "both deny")
            .await;
    }

    /// Cost: consumes several units; too large a cost is an error.
    pub async fn cost_consumes_units_and_too_large_is_an_error<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "cost: consumes several units; too large a cost is an error",
        );
        let r = c.rules("10/s gcra burst=10");
        c.at(0);
        let d = c.check(b"k", &r, 4).await;
        assert_eq!(d.rules()[0].remaining, 6, "[{}] {d:?}", c.name);
        c.denied(
            b"k",
            &r,
            7,
            Duration::from_millis(100),
            "cost 7 with 6 left",
        )
        .await;
        let d = c.check(b"k", &r, 6).await;
        assert!(
            d.is_allowed() && d.rules()[0].remaining == 0,
            "[{}] {d:?}",
            c.name
        );
        assert!(
            c.store.check(b"k", &r, 11).await.is_err(),
            "[{}] cost 11 > burst 10",
            c.name
        );
        let log = c.rules("5/min sliding-log");
        let d = c.check(b"log", &log, 3).await;
        assert_eq!(d.rules()[0].remaining, 2, "[{}] {d:?}", c.name);
        c.denied(
            b"log",
            &log,
            3,
            Duration::from_secs(60),
            "cost 3 with 2 left",
        )
        .await;
    }

    /// Peek: cost 0 consumes nothing and predicts a request of cost 1.
    pub async fn peek_consumes_nothing<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "peek: cost 0 consumes nothing and predicts a request of cost 1",
        );
        let r = c.rules("3/min fixed-window; 5/min sliding-window precision=2");
        c.at(0);
        for _ in 0..3 {
            let d = c.check(b"k", &r, 0).await;
            assert!(d.is_allowed(), "[{}] {d:?}", c.name);
            assert_eq!(d.rules()[0].remaining, 3, "[{}] {d:?}", c.name);
        }
        c.allowed(b"k", &r, 3, "after peeks").await;
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(d.outcome(), Outcome::Limited, "[{}] {d:?}", c.name);
        assert_eq!(d.rules()[0].remaining, 0, "[{}] {d:?}", c.name);
        assert_eq!(d.rules()[1].remaining, 2, "[{}] {d:?}", c.name);
        let g = c.rules("1/s gcra burst=2");
        assert_eq!(
            c.check(b"g", &g, 0).await.rules()[0].remaining,
            2,
            "[{}]",
            c.name
        );
        c.allowed(b"g", &g, 2, "peek left the burst").await;
    }

    /// Blocks: with a duration, without end, lifted.
    pub async fn blocks_with_duration_without_end_lifted<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "blocks: with a duration, without end, lifted");
        let r = c.rules("100/s gcra burst=100");
        c.at(0);
        c.block(b"k", Some(Duration::from_secs(30))).await;
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(d.outcome(), Outcome::Blocked, "[{}] {d:?}", c.name);
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_secs(30)),
            "[{}] {d:?}",
            c.name
        );
        c.allowed(b"other", &r, 1, "another key").await;
        c.at(10 * S);
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_secs(20)),
            "[{}] peek while blocked {d:?}",
            c.name
        );
        c.at(30 * S);
        c.allowed(b"k", &r, 1, "block over").await;
        c.block(b"k", None).await;
        c.at(86_400 * S);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(
            (d.outcome(), d.retry_after()),
            (Outcome::Blocked, None),
            "[{}] {d:?}",
            c.name
        );
        c.store
            .unblock(b"k")
            .await
            .unwrap_or_else(|e| panic!("unblock: {e}"));
        c.allowed(b"k", &r, 1, "unblocked").await;
    }

    /// Reset forgets every rule's state of the key; a block stays.
    pub async fn reset_forgets_the_key<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "reset forgets every rule's state of the key");
        let r = c.rules("2/min fixed-window; 3/min gcra burst=3");
        let other = c.rules("5/min fixed-window name=other");
        c.at(0);
        c.allowed(b"k", &r, 2, "quota").await;
        c.allowed(b"j", &r, 2, "another key's quota").await;
        c.store
            .reset(b"k", &other)
            .await
            .unwrap_or_else(|e| panic!("reset: {e}"));
        c.allowed(b"k", &r, 2, "after reset, whatever the rules named")
            .await;
        c.denied(
            b"j",
            &r,
            1,
            Duration::from_secs(60),
            "another key untouched",
        )
        .await;
        c.block(b"k", None).await;
        c.store
            .reset(b"k", &r)
            .await
            .unwrap_or_else(|e| panic!("reset: {e}"));
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(
            d.outcome(),
            Outcome::Blocked,
            "[{}] block stays {d:?}",
            c.name
        );
    }

    /// Keys are data: no collisions between awkward keys.
    pub async fn keys_are_data<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "keys are data: no collisions between awkward keys",
        );
        let long = vec![b'x'; 10 * 1024];
        let keys: [&[u8]; 10] = [
            b"",
            b"a",
            b"a:b",
            b"a:",
            b":b",
            b"{a}",
            b"a}",
            b"{",
            b"\r\n*1\r\n$4\r\nPING\r\n",
            &long,
        ];
        let binary: &[u8] = &[0xff, 0xfe, 0x00, 0x7b, 0x7d];
        let r = c.rules("1/min fixed-window; 2/min sliding-log");
        c.at(0);
        for key in keys.iter().copied().chain([binary]) {
            c.allowed(key, &r, 1, "first use of each key").await;
        }
        for key in keys.iter().copied().chain([binary]) {
            c.denied(key, &r, 1, Duration::from_secs(60), "second use")
                .await;
        }
    }

    /// Long keys: a key above the inline threshold is held by its digest, so it is one key
    /// (blocks and resets included), and a short key equal to that digest is another.
    pub async fn long_keys_are_digests_distinct_from_short_keys<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "long keys are digests, distinct from short keys",
        );
        let r = c.rules("2/min fixed-window");
        let mut long = vec![b'L'; 64 * 1024];
        let digest = crate::key::digest(&long);
        c.at(0);
        c.allowed(&long, &r, 2, "a 64 KiB key").await;
        c.denied(&long, &r, 1, Duration::from_secs(60), "the same 64 KiB key")
            .await;
        c.allowed(&digest, &r, 2, "a short key equal to its digest")
            .await;
        long[32 * 1024] = b'M';
        c.allowed(&long, &r, 2, "a 64 KiB key differing in one byte")
            .await;
        long[32 * 1024] = b'L';
        c.block(&long, None).await;
        let d = c.check(&long, &r, 0).await;
        assert_eq!(d.outcome(), Outcome::Blocked, "[{}] {d:?}", c.name);
        let d = c.check(&digest, &r, 0).await;
        assert_eq!(d.outcome(), Outcome::Limited, "[{}] {d:?}", c.name);
        c.store
            .unblock(&long)
            .await
            .unwrap_or_else(|e| panic!("unblock: {e}"));
        c.store
            .reset(&long, &r)
            .await
            .unwrap_or_else(|e| panic!("reset: {e}"));
        c.allowed(&long, &r, 2, "after the reset").await;
    }

    /// State expires: a long-idle key starts fresh.
    pub async fn idle_state_expires<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "state expires: a long-idle key starts fresh");
        let r = c.rules(
            "2/h sliding-window precision=6; 3/day sliding-log; 1/min token-bucket capacity=1",
        );
        c.at(0);
        c.allowed(b"k", &r, 1, "first").await;
        c.at(86_400 * S * 3);
        let d = c.check(b"k", &r, 1).await;
        assert!(d.is_allowed(), "[{}] {d:?}", c.name);
        assert_eq!(d.rules()[1].remaining, 2, "[{}] {d:?}", c.name);
    }

    /// The remaining units of each rule, from a peek.
    async fn remaining<St: Store>(
        c: &Case<'_, St>,
        key: &[u8],
        rules: &crate::RuleSet,
    ) -> Vec<u64> {
        let d = c.check(key, rules, 0).await;
        d.rules().iter().map(|r| r.remaining).collect()
    }

    /// A raised limit keeps what was spent: 3 of `5/h` leave 7 of `10/h`, under every
    /// algorithm (a raised capacity alone too).
    pub async fn rule_change_limit_raised_keeps_usage<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "rule change: a raised limit keeps usage");
        c.at(0);
        for (before, after, left) in [
            ("5/h fixed-window", "10/h fixed-window", 7),
            (
                "5/h sliding-window precision=2",
                "10/h sliding-window precision=2",
                7,
            ),
            ("5/h sliding-log", "10/h sliding-log", 7),
            ("1/min gcra burst=5", "1/min gcra burst=10", 7),
            (
                "1/min leaky-bucket mode=meter capacity=5",
                "1/min leaky-bucket mode=meter capacity=10",
                7,
            ),
            (
                "1/h token-bucket capacity=5",
                "1/h token-bucket capacity=10",
                7,
            ),
        ] {
            let (before, after) = (c.rules(before), c.rules(after));
            let key = before.to_string();
            c.allowed(key.as_bytes(), &before, 3, "before the change")
                .await;
            assert_eq!(
                remaining(&c, key.as_bytes(), &after).await,
                [left],
                "[{}] {after}",
                c.name
            );
            assert_eq!(
                c.count_allowed(key.as_bytes(), &after, 20).await,
                left as usize,
                "[{}] {before} -> {after}",
                c.name
            );
        }
    }

    /// A lowered limit keeps what was spent: 3 of `5/h` leave none of `3/h`; 3 used of a
    /// token bucket of 10 leave 2 of 5; a GCRA's debt beyond a lowered burst waits to
    /// drain.
    pub async fn rule_change_limit_lowered_keeps_usage<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "rule change: a lowered limit keeps usage");
        c.at(0);
        let (before, after) = (c.rules("5/h fixed-window"), c.rules("3/h fixed-window"));
        c.allowed(b"fw", &before, 3, "3 of 5/h").await;
        c.denied(b"fw", &after, 1, Duration::from_secs(3600), "none of 3/h")
            .await;
        c.allowed(b"fw", &before, 2, "the rest of 5/h, on the same count")
            .await;

        let (before, after) = (
            c.rules("1/h token-bucket capacity=10"),
            c.rules("1/h token-bucket capacity=5"),
        );
        c.allowed(b"tb", &before, 3, "3 of 10 tokens").await;
        assert_eq!(
            c.count_allowed(b"tb", &after, 10).await,
            2,
            "[{}] 3 used of 10 leave 2 of 5",
            c.name
        );

        let (before, after) = (
            c.rules("1/min gcra burst=10"),
            c.rules("1/min gcra burst=4"),
        );
        c.allowed(b"g", &before, 8, "8 of a burst of 10").await;
        c.denied(
            b"g",
            &after,
            1,
            Duration::from_secs(300),
            "8 owed of a burst of 4",
        )
        .await;
        c.at(300 * S);
        c.allowed(b"g", &after, 1, "once the debt is within the burst")
            .await;
        c.denied(b"g", &after, 1, Duration::from_secs(60), "then full again")
            .await;
    }

    /// A rule added to the set starts empty; the others keep their state.
    pub async fn rule_change_rule_added_starts_empty<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "rule change: an added rule starts empty");
        c.at(0);
        let before = c.rules("5/h fixed-window");
        let after = c.rules("5/h fixed-window; 2/min gcra burst=2; 4/min token-bucket capacity=4");
        c.allowed(b"k", &before, 3, "3 of 5/h").await;
        assert_eq!(remaining(&c, b"k", &after).await, [2, 2, 4], "[{}]", c.name);
        assert_eq!(c.count_allowed(b"k", &after, 5).await, 2, "[{}]", c.name);
    }

    /// A rule removed from the set is dropped when a check under the smaller set
    /// commits; until then (denials, peeks) the state stays as it was.
    pub async fn rule_change_rule_removed_is_dropped_on_commit<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "rule change: a removed rule is dropped on commit",
        );
        c.at(0);
        let both = c.rules("5/h fixed-window; 2/min fixed-window");
        let one = c.rules("5/h fixed-window");
        c.allowed(b"k", &both, 2, "2 of 2/min").await;
        assert_eq!(remaining(&c, b"k", &one).await, [3], "[{}]", c.name);
        c.denied(
            b"k",
            &both,
            1,
            Duration::from_secs(60),
            "a peek dropped nothing",
        )
        .await;
        c.allowed(b"k", &one, 1, "a check under the smaller set")
            .await;
        assert_eq!(
            remaining(&c, b"k", &both).await,
            [2, 2],
            "[{}] 2/min dropped, 5/h kept",
            c.name
        );
    }

    /// A new algorithm starts afresh, named or not; a leaky bucket's mode is not an
    /// algorithm (the level carries between meter and shaper).
    pub async fn rule_change_algorithm_changed_starts_afresh<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "rule change: a new algorithm starts afresh");
        c.at(0);
        for (before, after, n) in [
            ("5/h fixed-window", "5/h sliding-window precision=1", 5),
            (
                "5/h sliding-window precision=1",
                "5/h sliding-window precision=2",
                5,
            ),
            (
                "3/min gcra burst=3 name=api",
                "3/min token-bucket capacity=3 name=api",
                3,
            ),
            (
                "3/min gcra burst=3",
                "3/min leaky-bucket mode=meter capacity=3",
                3,
            ),
        ] {
            let (before, after) = (c.rules(before), c.rules(after));
            let key = before.to_string();
            c.allowed(key.as_bytes(), &before, n, "the whole limit")
                .await;
            assert_eq!(
                c.count_allowed(key.as_bytes(), &after, 2 * n).await,
                n,
                "[{}] {before} -> {after}",
                c.name
            );
        }
        let meter = c.rules("1/s leaky-bucket mode=meter capacity=4");
        let shaper = c.rules("1/s leaky-bucket mode=shaper burst=3 delay=3");
        c.allowed(b"leaky", &meter, 4, "a full meter").await;
        c.denied(
            b"leaky",
            &shaper,
            1,
            Duration::from_secs(1),
            "the shaper is as full",
        )
        .await;
    }

    /// A new period starts afresh, named or not.
    pub async fn rule_change_period_changed_starts_afresh<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "rule change: a new period starts afresh");
        c.at(0);
        for (before, after, n, m) in [
            ("5/h fixed-window", "120/day fixed-window", 5, 120),
            ("5/h fixed-window name=x", "5/min fixed-window name=x", 5, 5),
            ("2/s gcra burst=2", "2/min gcra burst=2", 2, 2),
        ] {
            let (before, after) = (c.rules(before), c.rules(after));
            let key = before.to_string();
            c.allowed(key.as_bytes(), &before, n, "the whole limit")
                .await;
            assert_eq!(
                c.count_allowed(key.as_bytes(), &after, m + 10).await,
                m,
                "[{}] {before} -> {after}",
                c.name
            );
        }
    }

    /// Named rules keep their state by name wherever they stand in the set.
    pub async fn rule_change_named_rules_follow_their_names<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "rule change: named rules follow their names");
        c.at(0);
        let before = c.rules("5/h fixed-window name=a; 5/h fixed-window name=b");
        c.allowed(b"k", &before, 2, "2 of each").await;
        c.allowed(b"k", &c.rules("5/h fixed-window name=a"), 1, "a third of a")
            .await;
        let after = c.rules("6/h fixed-window name=b; 7/h fixed-window name=a");
        assert_eq!(
            remaining(&c, b"k", &after).await,
            [6, 4],
            "[{}] b was dropped by the commit under a alone",
            c.name
        );
        c.allowed(b"k", &after, 1, "one under the swapped set")
            .await;
        assert_eq!(remaining(&c, b"k", &after).await, [5, 3], "[{}]", c.name);
    }

    /// The sliding log is one per key, shared by every sliding-log rule: it carries while
    /// a sliding-log rule writes it and its writers' longest period has not run out,
    /// and is dropped by a commit under rules without a sliding log.
    pub async fn rule_change_sliding_log_carries_while_a_log_rule_remains<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "rule change: the sliding log carries while a sliding-log rule remains",
        );
        c.at(0);
        c.allowed(b"k", &c.rules("3/min sliding-log"), 2, "2 of 3/min")
            .await;
        assert_eq!(
            remaining(&c, b"k", &c.rules("4/min sliding-log")).await,
            [2]
        );
        c.at(2 * S);
        let two = c.rules("1/s sliding-log; 5/min sliding-log");
        assert_eq!(remaining(&c, b"k", &two).await, [1, 3], "[{}]", c.name);
        c.allowed(b"k", &c.rules("5/h fixed-window"), 1, "no sliding log")
            .await;
        assert_eq!(
            c.count_allowed(b"k", &c.rules("3/min sliding-log"), 5)
                .await,
            3,
            "[{}] the log was dropped",
            c.name
        );
        c.allowed(b"short", &c.rules("1/s sliding-log"), 1, "1/s")
            .await;
        c.at(5 * S);
        assert_eq!(
            remaining(&c, b"short", &c.rules("1/h sliding-log")).await,
            [1],
            "[{}] a log whose writers' period ran out starts empty",
            c.name
        );
        // Reading such a log as empty writes nothing: a peek under other rules leaves it
        // to its writers, whose next commit adds to it, and a reader is vouched for again.
        c.at(10 * S);
        c.allowed(b"kept", &c.rules("2/s sliding-log"), 1, "2/s")
            .await;
        c.at(13 * S);
        assert_eq!(
            remaining(&c, b"kept", &c.rules("2/h sliding-log")).await,
            [2],
            "[{}] the writers' period ran out",
            c.name
        );
        c.allowed(b"kept", &c.rules("2/s sliding-log"), 1, "2/s again")
            .await;
        assert_eq!(
            remaining(&c, b"kept", &c.rules("2/h sliding-log")).await,
            [0],
            "[{}] the peek under other rules left the log to its writers",
            c.name
        );
    }

    /// Charging by outcome, fixed window: a refund gives units back while the window
    /// charged is still counted, and nothing once another window counts.
    pub async fn refund_fixed_window_only_in_the_window_charged<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "refund: fixed window, window charged only");
        let r = c.rules("3/min fixed-window");
        c.at(10 * S);
        let t = c.store.now_us();
        c.allowed(b"k", &r, 3, "the window's 3").await;
        c.denied(b"k", &r, 1, Duration::from_secs(50), "spent")
            .await;
        assert!(c.refund(b"k", &r, 1, t).await, "[{}] a unit back", c.name);
        c.allowed(b"k", &r, 1, "the unit given back").await;
        c.denied(b"k", &r, 1, Duration::from_secs(50), "spent again")
            .await;
        // The next window: a charge of the last one is not given to it.
        c.at(70 * S);
        c.allowed(b"k", &r, 1, "first of the next window").await;
        assert!(
            !c.refund(b"k", &r, 1, t).await,
            "[{}] a charge of an ended window gave a unit to the next one",
            c.name
        );
        c.allowed(b"k", &r, 2, "the rest of the next window").await;
        c.denied(b"k", &r, 1, Duration::from_secs(50), "next window spent")
            .await;
    }

    /// Charging by outcome, sliding window counter: into the sub-window charged, and
    /// nothing once it has left the state.
    pub async fn refund_sliding_window_into_the_sub_window_charged<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "refund: sliding window, sub-window charged");
        let r = c.rules("4/min sliding-window precision=2");
        c.at(10 * S);
        let t1 = c.store.now_us();
        c.allowed(b"k", &r, 2, "two in the first half-minute").await;
        c.at(40 * S);
        c.allowed(b"k", &r, 2, "two in the second").await;
        assert!(
            !c.check(b"k", &r, 1).await.is_allowed(),
            "[{}] spent",
            c.name
        );
        assert!(c.refund(b"k", &r, 1, t1).await, "[{}] a unit back", c.name);
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(d.rules()[0].remaining, 1, "[{}] {d:?}", c.name);
        // Three minutes on, the first half-minute has left the state.
        c.at(190 * S);
        c.allowed(b"k", &r, 1, "a new charge").await;
        assert!(
            !c.refund(b"k", &r, 1, t1).await,
            "[{}] a sub-window that left the state took a refund",
            c.name
        );
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(d.rules()[0].remaining, 3, "[{}] {d:?}", c.name);
    }

    /// Charging by outcome, sliding log: the charge's entry leaves the log.
    pub async fn refund_sliding_log_removes_the_entry<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "refund: sliding log, the entry removed");
        let r = c.rules("2/min sliding-log");
        c.at(0);
        let t0 = c.store.now_us();
        c.allowed(b"k", &r, 1, "at 0 s").await;
        c.at(10 * S);
        let t1 = c.store.now_us();
        c.allowed(b"k", &r, 1, "at 10 s").await;
        c.at(20 * S);
        c.denied(b"k", &r, 1, Duration::from_secs(40), "full").await;
        assert!(c.refund(b"k", &r, 1, t1).await, "[{}] 10 s back", c.name);
        c.allowed(b"k", &r, 1, "at 20 s, in the entry's place")
            .await;
        // The log holds 20 s and 0 s: the entry of 0 s goes, so the window next frees at
        // 80 s, when the entry of 20 s leaves.
        c.at(30 * S);
        assert!(c.refund(b"k", &r, 1, t0).await, "[{}] 0 s back", c.name);
        c.allowed(b"k", &r, 1, "at 30 s").await;
        c.denied(b"k", &r, 1, Duration::from_secs(50), "full again")
            .await;
    }

    /// Charging by outcome, token bucket: tokens go back, never past the capacity.
    pub async fn refund_token_bucket_up_to_capacity<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "refund: token bucket, up to capacity");
        let r = c.rules("1/s token-bucket capacity=5");
        c.at(S);
        let t = c.store.now_us();
        c.allowed(b"k", &r, 5, "the bucket").await;
        c.denied(b"k", &r, 1, Duration::from_secs(1), "empty").await;
        assert!(c.refund(b"k", &r, 2, t).await, "[{}] two back", c.name);
        c.allowed(b"k", &r, 2, "the two given back").await;
        c.denied(b"k", &r, 1, Duration::from_secs(1), "empty again")
            .await;
        // More than was ever taken fills the bucket and no more.
        assert!(c.refund(b"k", &r, 50, t).await, "[{}] fifty back", c.name);
        assert_eq!(c.count_allowed(b"k", &r, 8).await, 5, "[{}] capped", c.name);
    }

    /// Charging by outcome, GCRA and the leaky bucket: the arrival time moves back by the
    /// units' intervals, never before now (an idle key gets nothing to lend).
    pub async fn refund_gcra_and_leaky_bucket_move_the_arrival_time_back<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "refund: GCRA, arrival time back");
        for (key, text) in [
            (&b"gcra"[..], "10/s gcra burst=2"),
            (&b"meter"[..], "10/s leaky-bucket mode=meter capacity=2"),
        ] {
            c.at(S);
            let r = c.rules(text);
            let t = c.store.now_us();
            c.allowed(key, &r, 2, text).await;
            c.denied(key, &r, 1, Duration::from_millis(100), text).await;
            assert!(
                c.refund(key, &r, 1, t).await,
                "[{}] {text}: one back",
                c.name
            );
            c.allowed(key, &r, 1, text).await;
            c.denied(key, &r, 1, Duration::from_millis(100), text).await;
            // Idle a second later: a refund lends nothing.
            c.at(2 * S);
            assert!(
                !c.refund(key, &r, 5, t).await,
                "[{}] {text}: an idle key took a refund",
                c.name
            );
            assert_eq!(c.count_allowed(key, &r, 5).await, 2, "[{}] {text}", c.name);
        }
        // What drained since the charge is not given back: another check may have taken
        // it. A at 10 s, B 50 ms later, A's refund then: the state is as if only B had
        // come (one more fits the burst of 2, then 100 ms to wait).
        let r = c.rules("10/s gcra burst=2");
        c.at(10 * S);
        let t = c.store.now_us();
        c.allowed(b"drained", &r, 1, "A").await;
        c.at(10 * S + 50 * MS);
        c.allowed(b"drained", &r, 1, "B").await;
        assert!(c.refund(b"drained", &r, 1, t).await, "[{}] A back", c.name);
        c.allowed(b"drained", &r, 1, "the burst's second").await;
        c.denied(
            b"drained",
            &r,
            1,
            Duration::from_millis(100),
            "as without A",
        )
        .await;
    }

    /// Charging by outcome, several rules: every rule gets the units back; a key whose
    /// state was since written under other rules gets nothing.
    pub async fn refund_every_rule_and_nothing_after_the_rules_changed<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "refund: every rule; nothing after a change");
        let r = c.rules("2/s fixed-window; 3/min fixed-window");
        c.at(10 * S + 100 * MS);
        let t = c.store.now_us();
        c.allowed(b"k", &r, 2, "2/s").await;
        assert!(c.refund(b"k", &r, 2, t).await, "[{}] both back", c.name);
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(
            (d.rules()[0].remaining, d.rules()[1].remaining),
            (2, 3),
            "[{}] {d:?}",
            c.name
        );
        let other = c.rules("2/s fixed-window; 4/min fixed-window");
        c.allowed(b"k", &other, 1, "under other rules").await;
        assert!(
            !c.refund(b"k", &r, 1, t).await,
            "[{}] a state of other rules took a refund",
            c.name
        );
        let d = c.check(b"k", &other, 0).await;
        assert_eq!(d.rules()[1].remaining, 3, "[{}] {d:?}", c.name);
    }

    /// Metered costs, fixed window (the issue's example): `1000/h`, an estimate of 100
    /// and an actual of 300 per request: four admitted, the fifth refused until the
    /// window ends, the count at 1,200. A settle at the charge does nothing; one below
    /// it gives the difference back.
    pub async fn settle_fixed_window_debt_until_the_window_ends<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "settle: fixed window, debt until the window ends",
        );
        let r = c.rules("1000/h fixed-window");
        c.at(10 * S);
        for i in 0..4 {
            let t = c.store.now_us();
            let d = c.check(b"k", &r, 100).await;
            assert!(d.is_allowed(), "[{}] request {}: {d:?}", c.name, i + 1);
            assert!(
                c.settle(b"k", &r, 100, 300, t).await,
                "[{}] settled",
                c.name
            );
            assert!(!c.settle(b"k", &r, 100, 100, t).await, "[{}] no-op", c.name);
        }
        c.denied(b"k", &r, 100, Duration::from_secs(3590), "the fifth")
            .await;
        c.denied(b"k", &r, 1, Duration::from_secs(3590), "in debt")
            .await;
        // 1,200 counted: 400 back leave 800, so 200 fit.
        let t = c.store.now_us();
        assert!(
            c.settle(b"k", &r, 500, 100, t).await,
            "[{}] 400 back",
            c.name
        );
        let d = c.check(b"k", &r, 0).await;
        assert_eq!(d.rules()[0].remaining, 200, "[{}] {d:?}", c.name);
        // The next window starts clean.
        c.at(3600 * S);
        let d = c.check(b"k", &r, 1000).await;
        assert!(d.is_allowed(), "[{}] next window: {d:?}", c.name);
    }

    /// Metered costs, sliding window counter: the debt sits in the current sub-window,
    /// seen whole for a period, then weighted out.
    pub async fn settle_sliding_window_debt_in_the_current_sub_window<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "settle: sliding window, current sub-window");
        let r = c.rules("4/min sliding-window precision=2");
        c.at(10 * S);
        let t = c.store.now_us();
        c.allowed(b"k", &r, 1, "the charge").await;
        assert!(c.settle(b"k", &r, 1, 5, t).await, "[{}] settled", c.name);
        // 5 in the sub-window of 0-30 s: nothing fits until it weighs 5 × (30 − 12) /
        // 30 = 3 at 72 s.
        c.denied(b"k", &r, 1, Duration::from_secs(62), "in debt")
            .await;
        c.at(72 * S);
        c.allowed(b"k", &r, 1, "debt weighted out").await;
    }

    /// Metered costs, sliding log: the excess is logged at the settle, at most a full
    /// log (the largest sliding-log limit).
    pub async fn settle_sliding_log_debt_fills_the_log<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "settle: sliding log, a full log at most");
        let r = c.rules("3/min sliding-log");
        c.at(10 * S);
        let t = c.store.now_us();
        c.allowed(b"k", &r, 1, "the charge").await;
        c.at(20 * S);
        assert!(c.settle(b"k", &r, 1, 100, t).await, "[{}] settled", c.name);
        c.denied(b"k", &r, 1, Duration::from_secs(60), "in debt")
            .await;
        c.at(80 * S);
        c.allowed(b"k", &r, 3, "the log's entries left").await;
    }

    /// Metered costs, token bucket: below empty, the refill resuming once the debt is
    /// repaid; a refund repays the debt first.
    pub async fn settle_token_bucket_below_empty<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "settle: token bucket, below empty");
        let r = c.rules("10/s token-bucket capacity=5");
        c.at(S);
        let t = c.store.now_us();
        let d = c.check(b"k", &r, 2).await;
        assert!(d.is_allowed(), "[{}] {d:?}", c.name);
        // 3 left; of the 30 more, the cap (one period's limit, 10) leaves 7 owed: 0.7 s.
        assert!(c.settle(b"k", &r, 2, 32, t).await, "[{}] settled", c.name);
        c.denied(b"k", &r, 1, Duration::from_millis(800), "in debt")
            .await;
        // The charge of 2 given back: 0.2 s less to wait, nothing to spend yet.
        assert!(c.refund(b"k", &r, 2, t).await, "[{}] refunded", c.name);
        c.denied(b"k", &r, 1, Duration::from_millis(600), "less debt")
            .await;
        c.at(S + 600 * MS);
        c.allowed(b"k", &r, 1, "repaid").await;
        c.denied(b"k", &r, 1, Duration::from_millis(100), "empty")
            .await;
    }

    /// Metered costs, GCRA and leaky bucket: the arrival time pushed past the burst,
    /// at most one period's limit past it whatever the excess.
    pub async fn settle_gcra_and_leaky_bucket_push_the_arrival_time<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "settle: GCRA, arrival time pushed");
        for (key, text) in [
            (&b"gcra"[..], "10/s gcra burst=5"),
            (&b"meter"[..], "10/s leaky-bucket mode=meter capacity=5"),
        ] {
            c.at(S);
            let r = c.rules(text);
            let t = c.store.now_us();
            c.allowed(key, &r, 1, text).await;
            // 1.1 s ahead: 0.7 s until a unit fits the burst of 0.5 s.
            assert!(c.settle(key, &r, 1, 11, t).await, "[{}] {text}", c.name);
            c.denied(key, &r, 1, Duration::from_millis(700), text).await;
            // A hostile actual: 1.5 s ahead at most (the burst and one period).
            assert!(
                c.settle(key, &r, 1, u64::MAX, t).await,
                "[{}] {text}",
                c.name
            );
            c.denied(key, &r, 1, Duration::from_millis(1100), text)
                .await;
            assert!(
                !c.settle(key, &r, 1, u64::MAX, t).await,
                "[{}] {text}",
                c.name
            );
            c.at(2100 * MS);
            c.allowed(key, &r, 1, text).await;
        }
    }

    /// Metered costs, several rules: every rule charged, each at most its limit; a key
    /// never charged (an estimate of 0) is charged from fresh; a key whose state was
    /// since written under other rules is charged nothing.
    pub async fn settle_every_rule_capped_from_fresh_and_nothing_after_the_rules_changed<
        St: Store,
    >(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "settle: every rule; nothing after a change");
        let r = c.rules("2/s fixed-window; 10/min gcra burst=10");
        c.at(10 * S + 100 * MS);
        let t = c.store.now_us();
        let d = c.check(b"k", &r, 0).await;
        assert!(d.is_allowed(), "[{}] the estimate of 0: {d:?}", c.name);
        assert!(c.settle(b"k", &r, 0, 5, t).await, "[{}] settled", c.name);
        // The window takes 2 (its limit), the GCRA all 5.
        let d = c
            .denied(b"k", &r, 1, Duration::from_millis(900), "2/s spent")
            .await;
        assert_eq!(
            (d.rules()[0].remaining, d.rules()[1].remaining),
            (0, 5),
            "[{}] {d:?}",
            c.name
        );
        c.at(11 * S);
        let other = c.rules("2/s fixed-window; 20/min gcra burst=10");
        c.allowed(b"k", &other, 1, "under other rules").await;
        let before = c.check(b"k", &other, 0).await;
        assert!(
            !c.settle(b"k", &r, 1, 5, t).await,
            "[{}] a state of other rules took a settle",
            c.name
        );
        let after = c.check(b"k", &other, 0).await;
        assert_eq!(before, after, "[{}] charged under other rules", c.name);
    }

    /// GCRA, raised and lowered: 3 used of `5/h` leave 7 under `10/h` and none under
    /// `3/h`, and a denial under the new limit keeps its `retry_after` on the next check.
    pub async fn rule_change_gcra_carries_usage<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "rule change: GCRA carries usage");
        carries_usage(&c, "gcra", "burst").await;
    }

    /// Token bucket, raised and lowered: as [`rule_change_gcra_carries_usage`].
    pub async fn rule_change_token_bucket_carries_usage<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "rule change: token bucket carries usage");
        carries_usage(&c, "token-bucket", "capacity").await;
    }

    /// Leaky bucket as a meter, raised and lowered: as [`rule_change_gcra_carries_usage`].
    pub async fn rule_change_leaky_meter_carries_usage<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(
            store,
            clock,
            "rule change: leaky bucket meter carries usage",
        );
        carries_usage(&c, "leaky-bucket mode=meter", "capacity").await;
    }

    /// Leaky bucket as a shaper, raised and lowered: as
    /// [`rule_change_gcra_carries_usage`].
    pub async fn rule_change_leaky_shaper_carries_usage<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(
            store,
            clock,
            "rule change: leaky bucket shaper carries usage",
        );
        carries_usage(&c, "leaky-bucket mode=shaper", "shaper").await;
    }

    /// `2 concurrent`: two slots, numbered from the clock; the third request is refused
    /// with `retry_after` the earliest deadline capped at 1 s, `remaining` 0 and
    /// `reset_after` the last deadline.
    pub async fn concurrent_slots_up_to_the_limit_then_a_capped_hint<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: up to the limit, capped hint");
        let r = c.rules("2 concurrent timeout=5s");
        c.at(0);
        let a = c.acquire(b"k", &r, 1, "first slot").await;
        assert_eq!(a, T0_US, "[{}] numbered from the clock", c.name);
        c.at(MS);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(
            d.slot(),
            Some(T0_US + MS),
            "[{}] second slot: {d:?}",
            c.name
        );
        assert_eq!(d.rules()[0].remaining, 0, "[{}] {d:?}", c.name);
        assert_eq!(
            d.rules()[0].reset_after,
            Duration::from_micros(5 * S),
            "[{}] {d:?}",
            c.name
        );
        let refused = c.denied(b"k", &r, 1, Duration::from_secs(1), "third").await;
        assert_eq!(refused.slot(), None, "[{}] {refused:?}", c.name);
        assert_eq!(refused.rules()[0].remaining, 0, "[{}] {refused:?}", c.name);
        c.at(4_700 * MS);
        c.denied(
            b"k",
            &r,
            1,
            Duration::from_millis(300),
            "near the first deadline",
        )
        .await;
        c.at(5 * S);
        let b = c
            .acquire(b"k", &r, 1, "the first slot free at its deadline")
            .await;
        assert_eq!(b, T0_US + 5 * S, "[{}] numbered from the clock", c.name);
        c.denied(b"k", &r, 1, Duration::from_millis(1), "both held again")
            .await;
    }

    /// A release frees its slot once: sent again, it frees nothing, and the slot taken
    /// meanwhile (at the same instant) has another number.
    pub async fn concurrent_release_is_idempotent_and_numbers_never_repeat<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: release once, numbers unique");
        let r = c.rules("1 concurrent timeout=10s");
        c.at(0);
        let a = c.acquire(b"k", &r, 1, "first").await;
        assert!(c.release(b"k", &r, a).await, "[{}] released", c.name);
        let b = c
            .acquire(b"k", &r, 1, "after the release, same instant")
            .await;
        assert_ne!(a, b, "[{}] a number given twice", c.name);
        assert!(
            !c.release(b"k", &r, a).await,
            "[{}] a resent release freed another slot",
            c.name
        );
        c.denied(b"k", &r, 1, Duration::from_secs(1), "b still held")
            .await;
        assert!(c.release(b"k", &r, b).await, "[{}] b released", c.name);
        assert!(!c.release(b"k", &r, b).await, "[{}] b twice", c.name);
        assert!(
            !c.release(b"other", &r, b).await,
            "[{}] another key's release",
            c.name
        );
        c.acquire(b"k", &r, 1, "free again").await;
        // After every slot has expired and the state with it, numbers still grow.
        c.at(60 * S);
        let late = c.acquire(b"k", &r, 1, "much later").await;
        assert!(late > b, "[{}] {late} after {b}", c.name);
    }

    /// A slot not released frees itself at its deadline; a renewal before it moves it on
    /// by the timeout; a renewal after it fails (the slot may be another's by then).
    pub async fn concurrent_slots_free_at_their_deadlines_and_renewal_moves_them<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: deadlines, renewal");
        let r = c.rules("1 concurrent timeout=1s");
        c.at(0);
        let a = c.acquire(b"k", &r, 1, "first").await;
        c.at(900 * MS);
        assert!(c.renew(b"k", &r, a).await, "[{}] renewed", c.name);
        c.at(1_500 * MS);
        c.denied(b"k", &r, 1, Duration::from_millis(400), "renewed to 1.9 s")
            .await;
        c.at(1_900 * MS);
        assert!(
            !c.renew(b"k", &r, a).await,
            "[{}] renewed at its deadline",
            c.name
        );
        let b = c.acquire(b"k", &r, 1, "free at the deadline").await;
        assert!(!c.renew(b"k", &r, a).await, "[{}] a's renewal", c.name);
        assert!(!c.release(b"k", &r, a).await, "[{}] a's release", c.name);
        c.denied(b"k", &r, 1, Duration::from_secs(1), "b held")
            .await;
        assert!(c.renew(b"k", &r, b).await, "[{}] b renewed", c.name);
    }

    /// `3/min; 1 concurrent`: a request refused for want of a slot consumes nothing from
    /// the rate; one refused by the rate takes no slot.
    pub async fn concurrent_with_a_rate_all_or_nothing<St: Store>(store: &St, clock: &ManualClock) {
        let c = Case::new(store, clock, "concurrent: with a rate, all or nothing");
        let r = c.rules("3/min fixed-window; 1 concurrent timeout=30s");
        c.at(0);
        let a = c.acquire(b"k", &r, 1, "first").await;
        let d = c
            .denied(b"k", &r, 1, Duration::from_secs(1), "no slot")
            .await;
        assert!(d.rules()[0].allowed, "[{}] {d:?}", c.name);
        assert_eq!(d.rules()[0].remaining, 2, "[{}] the rate untouched", c.name);
        assert!(!d.rules()[1].allowed, "[{}] {d:?}", c.name);
        assert!(c.release(b"k", &r, a).await);
        let b = c.acquire(b"k", &r, 1, "second").await;
        assert!(c.release(b"k", &r, b).await);
        let d = c.check(b"k", &r, 1).await;
        assert_eq!(d.rules()[0].remaining, 0, "[{}] third: {d:?}", c.name);
        assert_eq!(d.rules()[1].remaining, 0, "[{}] third: {d:?}", c.name);
        assert!(c.release(b"k", &r, d.slot().expect("a slot")).await);
        let d = c
            .denied(b"k", &r, 1, Duration::from_secs(60), "the rate spent")
            .await;
        assert!(d.rules()[1].allowed, "[{}] {d:?}", c.name);
        let peek = c.check(b"k", &r, 0).await;
        assert_eq!(
            peek.rules()[1].remaining,
            1,
            "[{}] a refusal by the rate took a slot: {peek:?}",
            c.name
        );
    }

    /// A peek reports the free slots and takes none; a check of cost 5 takes one slot.
    pub async fn concurrent_peek_takes_no_slot_and_cost_takes_one<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: peek, cost");
        let r = c.rules("2 concurrent; 10/s fixed-window");
        c.at(0);
        let d = c.check(b"k", &r, 5).await;
        assert!(d.is_allowed() && d.slot().is_some(), "[{}] {d:?}", c.name);
        assert_eq!(d.rules()[0].remaining, 1, "[{}] one slot: {d:?}", c.name);
        assert_eq!(d.rules()[1].remaining, 5, "[{}] five units: {d:?}", c.name);
        for _ in 0..3 {
            let p = c.check(b"k", &r, 0).await;
            assert!(p.is_allowed() && p.slot().is_none(), "[{}] {p:?}", c.name);
            assert_eq!(p.rules()[0].remaining, 1, "[{}] {p:?}", c.name);
        }
        c.acquire(b"k", &r, 1, "the second slot").await;
        let p = c.check(b"k", &r, 0).await;
        assert!(!p.is_allowed() && p.slot().is_none(), "[{}] {p:?}", c.name);
    }

    /// Held slots carry over a changed limit and timeout: 3 held under `3 concurrent`
    /// refuse under `2 concurrent` until two are released.
    pub async fn concurrent_slots_carry_over_a_limit_change<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: slots carry over a change");
        let three = c.rules("3 concurrent timeout=10s");
        let two = c.rules("2 concurrent timeout=20s; 5/min fixed-window");
        c.at(0);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(c.acquire(b"k", &three, 1, "under three").await);
        }
        c.denied(b"k", &two, 1, Duration::from_secs(1), "3 held of 2")
            .await;
        assert!(
            c.release(b"k", &two, held[0]).await,
            "[{}] released",
            c.name
        );
        c.denied(b"k", &two, 1, Duration::from_secs(1), "2 held of 2")
            .await;
        assert!(
            c.release(b"k", &two, held[1]).await,
            "[{}] released",
            c.name
        );
        let d = c.acquire(b"k", &two, 1, "1 held of 2").await;
        assert!(d > held[2], "[{}] numbers grow across the change", c.name);
        // The slot kept from the old rules renews under the new timeout.
        c.at(9 * S);
        assert!(c.renew(b"k", &two, held[2]).await, "[{}] renewed", c.name);
        c.at(15 * S);
        c.denied(b"k", &two, 1, Duration::from_secs(1), "both held")
            .await;
    }

    /// Charging by outcome beside a concurrency rule: a refund gives the rate's units
    /// back and leaves the slot held (a slot goes back by release).
    pub async fn concurrent_refund_gives_units_back_and_keeps_the_slot<St: Store>(
        store: &St,
        clock: &ManualClock,
    ) {
        let c = Case::new(store, clock, "concurrent: a refund keeps the slot");
        let r = c.rules("3/min fixed-window; 1 concurrent timeout=10s");
        c.at(0);
        let t = T0_US;
        let a = c.acquire(b"k", &r, 1, "first").await;
        assert!(c.refund(b"k", &r, 1, t).await, "[{}] a unit back", c.name);
        let d = c
            .denied(b"k", &r, 1, Duration::from_secs(1), "the slot held")
            .await;
        assert_eq!(d.rules()[0].remaining, 3, "[{}] {d:?}", c.name);
        assert!(c.release(b"k", &r, a).await, "[{}] released", c.name);
        c.acquire(b"k", &r, 1, "free again").await;
    }

    /// `n/h` of `algorithm`, with room for `n` at once (`size`: the parameter that gives
    /// it, or "shaper" for a shaper's burst and delay).
    fn per_hour<St: Store>(c: &Case<'_, St>, n: u64, algorithm: &str, size: &str) -> RuleSet {
        let text = match size {
            "shaper" => format!("{n}/h {algorithm} burst={} delay={}", n - 1, n - 1),
            _ => format!("{n}/h {algorithm} {size}={n}"),
        };
        c.rules(&text)
    }

    /// 3 used of `5/h` leave 7 under `10/h` and none under `3/h`. A denial under the new
    /// rule writes the converted state, so the next check keeps its `retry_after`:
    /// converting again from the old state later would give another (a TAT or tokens
    /// that drained at the old rate meanwhile).
    async fn carries_usage<St: Store>(c: &Case<'_, St>, algorithm: &str, size: &str) {
        let five = per_hour(c, 5, algorithm, size);
        let ten = per_hour(c, 10, algorithm, size);
        let three = per_hour(c, 3, algorithm, size);
        c.at(0);
        c.allowed(b"up", &five, 3, "3 of 5/h").await;
        c.allowed(b"down", &five, 3, "3 of 5/h").await;

        assert_eq!(remaining(c, b"up", &ten).await, [7], "[{}] {ten}", c.name);
        assert_eq!(
            c.count_allowed(b"up", &ten, 20).await,
            7,
            "[{}] {five} -> {ten}",
            c.name
        );

        assert_eq!(
            remaining(c, b"down", &three).await,
            [0],
            "[{}] {three}",
            c.name
        );
        // 3 used of 3/h: the next unit in 20 minutes.
        c.denied(b"down", &three, 1, Duration::from_secs(1200), "none of 3/h")
            .await;
        c.at(600 * S);
        c.denied(
            b"down",
            &three,
            1,
            Duration::from_secs(600),
            "the denial kept the state converted at its time",
        )
        .await;
        c.at(1200 * S);
        c.allowed(b"down", &three, 1, "at the retry time").await;
        c.denied(b"down", &three, 1, Duration::from_secs(1200), "then none")
            .await;

        // Denied first under the raised limit: 8 of the 7 left need one more unit, 6
        // minutes at 10/h.
        c.at(2000 * S);
        c.allowed(b"up-denied", &five, 3, "3 of 5/h").await;
        c.denied(
            b"up-denied",
            &ten,
            8,
            Duration::from_secs(360),
            "8 of 7 left",
        )
        .await;
        c.at(2100 * S);
        c.denied(
            b"up-denied",
            &ten,
            8,
            Duration::from_secs(260),
            "the denial kept the state converted at its time",
        )
        .await;
        c.at(2360 * S);
        let d = c.check(b"up-denied", &ten, 8).await;
        assert!(d.is_allowed(), "[{}] 8 at the retry time: {d:?}", c.name);
    }
}

/// One step of a trace for [`run_trace`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Move the clock forward by this many microseconds.
    Advance(u64),
    /// Move the clock back by this many microseconds (Redis `TIME` after a failover to a
    /// server with another clock can, and so can an injected clock).
    Rewind(u64),
    /// Check `key` against rule set number `rules` with `cost`.
    Check {
        /// Key number (the key is the prefix plus this byte).
        key: u8,
        /// Index into the trace's rule sets.
        rules: usize,
        /// Units; 0 peeks.
        cost: u64,
    },
    /// Block `key` for this many milliseconds, or without end.
    Block {
        /// Key number.
        key: u8,
        /// Block length in milliseconds; `None` blocks until lifted.
        ms: Option<u64>,
    },
    /// Lift a block.
    Unblock {
        /// Key number.
        key: u8,
    },
    /// Forget a key's state (every rule's; `rules` is passed to [`Store::reset`]).
    Reset {
        /// Key number.
        key: u8,
        /// Index into the trace's rule sets.
        rules: usize,
    },
    /// Settle a charge of `key` under rule set number `rules`, made `ago_us` before now,
    /// from `charged` units to `actual` ([`Store::settle`]); its result is a peek of the
    /// key under those rules (cost 0) right after, which shows what the settle did.
    Settle {
        /// Key number.
        key: u8,
        /// Index into the trace's rule sets.
        rules: usize,
        /// The units the charge took.
        charged: u64,
        /// The actual cost.
        actual: u64,
        /// How long before now the charge was made, in µs.
        ago_us: u64,
        /// Handed to the store ([`Store::settle_detached`]) rather than awaited, where
        /// the store takes it: the peek after it must see it all the same.
        detached: bool,
    },
    /// Release a slot the trace took before: the `nth` (modulo their number) of the
    /// slots checks of this trace took, on `key` (perhaps not the key that took it, and
    /// perhaps again). Nothing when no check took a slot yet.
    Release {
        /// Key number.
        key: u8,
        /// Which slot, of those taken so far.
        nth: usize,
        /// Handed to the store ([`Store::release_detached`]) rather than awaited, where
        /// the store takes it; its result is then nothing (a detached release answers
        /// nothing), and the steps after it must see it.
        detached: bool,
    },
    /// Renew a slot the trace took before, as [`Step::Release`] picks it, under rule set
    /// number `rules`.
    Renew {
        /// Key number.
        key: u8,
        /// Index into the trace's rule sets.
        rules: usize,
        /// Which slot, of those taken so far.
        nth: usize,
    },
    /// Take a slot of rule set number `rules`' concurrency rule whatever its limit
    /// ([`Store::take_slot`]); its result is a decision allowing with a delay of the
    /// slot's number in µs (0 when it took none), and the slot joins those later
    /// releases and renewals pick from.
    Take {
        /// Key number.
        key: u8,
        /// Index into the trace's rule sets.
        rules: usize,
    },
}

/// What a step produced: the decision of a check (or its error text), the answer of a
/// release or renewal (or its error text), nothing otherwise.
pub type StepResult = Option<Result<Decision, String>>;

/// Replays `steps` against `store`, moving `clock` (which the store must read), with keys
/// `prefix + [key number]`. Two stores that agree give equal result vectors.
pub async fn run_trace<St: Store>(
    store: &St,
    clock: &ManualClock,
    prefix: &[u8],
    rulesets: &[RuleSet],
    steps: &[Step],
) -> Vec<StepResult> {
    let key = |k: u8| {
        let mut key = prefix.to_vec();
        key.push(k);
        key
    };
    let mut out = Vec::with_capacity(steps.len());
    // The slots checks took, in order: every store numbers them alike.
    let mut slots: Vec<u64> = Vec::new();
    // A release's or renewal's answer, as a result of the one shape steps have: a
    // decision allowing with a delay of 1 µs when the slot was live, of 0 otherwise.
    let answer = |r: Result<bool, String>| {
        Some(r.map(|live| Decision::from_rules([], Duration::from_micros(u64::from(live)))))
    };
    for step in steps {
        out.push(match step {
            Step::Advance(us) => {
                clock.advance(Duration::from_micros(*us));
                None
            }
            Step::Rewind(us) => {
                clock.set(clock.now_us().saturating_sub(*us));
                None
            }
            Step::Check {
                key: k,
                rules,
                cost,
            } => {
                let decided = store
                    .check(&key(*k), &rulesets[*rules], *cost)
                    .await
                    .map_err(|e| e.to_string());
                if let Some(slot) = decided.as_ref().ok().and_then(Decision::slot) {
                    slots.push(slot);
                }
                Some(decided)
            }
            Step::Release {
                key: k,
                nth,
                detached,
            } => match slots.get(nth % slots.len().max(1)) {
                Some(&slot) if *detached => {
                    // Nothing to compare but a failure: a store that does not take it
                    // releases as asked, and whether the slot was live is dropped.
                    if store.release_detached(&key(*k), &rulesets[0], slot) {
                        None
                    } else {
                        (store.release(&key(*k), &rulesets[0], slot).await)
                            .err()
                            .map(|e| Err(e.to_string()))
                    }
                }
                Some(&slot) => answer(
                    store
                        .release(&key(*k), &rulesets[0], slot)
                        .await
                        .map_err(|e| e.to_string()),
                ),
                None => None,
            },
            Step::Renew { key: k, rules, nth } => match slots.get(nth % slots.len().max(1)) {
                Some(&slot) => answer(
                    store
                        .renew(&key(*k), &rulesets[*rules], slot)
                        .await
                        .map_err(|e| e.to_string()),
                ),
                None => None,
            },
            Step::Take { key: k, rules } => {
                let taken = store
                    .take_slot(&key(*k), &rulesets[*rules])
                    .await
                    .map_err(|e| e.to_string());
                if let Ok(Some(slot)) = taken {
                    slots.push(slot);
                }
                Some(
                    taken.map(|slot| {
                        Decision::from_rules([], Duration::from_micros(slot.unwrap_or(0)))
                    }),
                )
            }
            Step::Block { key: k, ms } => {
                let res = store.block(&key(*k), ms.map(Duration::from_millis)).await;
                res.err().map(|e| Err(e.to_string()))
            }
            Step::Unblock { key: k } => store
                .unblock(&key(*k))
                .await
                .err()
                .map(|e| Err(e.to_string())),
            Step::Reset { key: k, rules } => store
                .reset(&key(*k), &rulesets[*rules])
                .await
                .err()
                .map(|e| Err(e.to_string())),
            Step::Settle {
                key: k,
                rules,
                charged,
                actual,
                ago_us,
                detached,
            } => {
                let at = clock.now_us().saturating_sub(*ago_us);
                let rules = &rulesets[*rules];
                let settled =
                    if *detached && store.settle_detached(&key(*k), rules, *charged, *actual, at) {
                        Ok(true)
                    } else {
                        store.settle(&key(*k), rules, *charged, *actual, at).await
                    };
                match settled {
                    Ok(_) => Some(
                        store
                            .check(&key(*k), rules, 0)
                            .await
                            .map_err(|e| e.to_string()),
                    ),
                    Err(e) => Some(Err(e.to_string())),
                }
            }
        });
    }
    out
}

/// A proptest configuration running `cases` cases that keeps every shrunk failure in
/// `path` (relative to the package being tested, e.g.
/// `"proptest-regressions/traces.txt"`), so the failure is replayed first on every later
/// run until it passes. Commit the file.
pub fn proptest_config(cases: u32, path: &'static str) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct(path),
        )),
        ..proptest::test_runner::Config::default()
    }
}

/// proptest strategies for rules, rule sets and traces.
pub mod strategy {
    use super::Step;
    use crate::{Rule, RuleSet};
    use proptest::prelude::*;
    use std::time::Duration;

    /// A valid rule of any algorithm with small limits and periods from 1 ms to 1 min.
    pub fn rule() -> impl Strategy<Value = Rule> {
        let period = prop_oneof![
            Just(1_000u64),
            Just(7_000),
            Just(100_000),
            Just(1_000_000),
            Just(60_000_000)
        ];
        (1u64..=12, period, 0u8..7, 1u64..=6, 0u64..=4).prop_map(
            |(limit, period_us, algo, p, extra)| {
                let period = Duration::from_micros(period_us);
                match algo {
                    0 => Rule::fixed_window(limit, period),
                    1 => {
                        let precision = [1, 2, 4, 5, 10, 1][p as usize - 1];
                        Rule::sliding_window(limit, period, precision)
                    }
                    2 => Rule::sliding_log(limit, period),
                    3 => Rule::token_bucket(limit, period, limit + extra),
                    4 => Rule::leaky_meter(limit, period, p),
                    5 => Rule::leaky_shaper(limit, period, extra, extra.min(p - 1)),
                    _ => Rule::gcra(limit, period, p),
                }
                .expect("generated rules are valid")
            },
        )
    }

    /// A `N concurrent` rule: 1 to 4 slots, held 100 ms, 1 s or a minute.
    pub fn concurrent_rule() -> impl Strategy<Value = Rule> {
        let timeout = prop_oneof![Just(100_000u64), Just(1_000_000), Just(60_000_000)];
        (1u64..=4, timeout).prop_map(|(limit, us)| {
            Rule::concurrent(limit, Duration::from_micros(us)).expect("generated rules are valid")
        })
    }

    /// A rule set of one to four rules, now and then with a concurrency rule besides.
    pub fn rule_set() -> impl Strategy<Value = RuleSet> {
        (
            proptest::collection::vec(rule(), 1..=4),
            proptest::option::weighted(0.3, concurrent_rule()),
        )
            .prop_map(|(mut rules, concurrent)| {
                rules.extend(concurrent);
                RuleSet::new(rules).expect("valid")
            })
    }

    /// `versions` rule sets (at least one) that one service could go through: the first
    /// of one to four rules, some named; each later one the same rules with new limits,
    /// capacities or bursts (a leaky bucket may switch mode), some rules dropped, some
    /// moved to a new algorithm or period, some reordered, and a rule added. Traces over
    /// them change rules under the keys' state, with identities that match.
    pub fn rule_set_versions(versions: usize) -> impl Strategy<Value = Vec<RuleSet>> {
        let edit = (0u8..10, 1u64..=12, 0u64..=4);
        let version = (
            proptest::collection::vec(edit, 4),
            proptest::option::of(rule()),
            any::<bool>(),
        );
        (
            proptest::collection::vec((rule(), any::<bool>()), 1..=4),
            proptest::collection::vec(version, versions.saturating_sub(1)),
            proptest::option::weighted(0.3, concurrent_rule()),
        )
            .prop_map(|(base, edits, concurrent)| {
                let base: Vec<Rule> = base
                    .into_iter()
                    .enumerate()
                    .map(|(i, (rule, named))| {
                        if named {
                            rule.named(&format!("r{i}")).expect("a valid name")
                        } else {
                            rule
                        }
                    })
                    .chain(concurrent)
                    .collect();
                let mut sets = vec![RuleSet::new(base.clone()).expect("valid")];
                for (per_rule, added, reverse) in edits {
                    let mut rules: Vec<Rule> = base
                        .iter()
                        .zip(per_rule)
                        .filter_map(|(rule, (op, limit, extra))| match op {
                            0 => None,
                            1..=4 => Some(relimited(rule, limit, extra, op == 4)),
                            5 => Some(moved(rule, limit)),
                            _ => Some(rule.clone()),
                        })
                        .collect();
                    if reverse {
                        rules.reverse();
                    }
                    rules.extend(added);
                    if rules.is_empty() {
                        rules.push(base[0].clone());
                    }
                    sets.push(RuleSet::new(rules).expect("valid"));
                }
                sets
            })
    }

    /// `rule` with the same identity and new limits (a leaky bucket switches mode when
    /// `flip`).
    fn relimited(rule: &Rule, limit: u64, extra: u64, flip: bool) -> Rule {
        use crate::{Algorithm, LeakyMode};
        let period = rule.period();
        let p = extra + 1;
        let new = match rule.algorithm() {
            Algorithm::FixedWindow => Rule::fixed_window(limit, period),
            Algorithm::SlidingWindow { precision } => {
                Rule::sliding_window(limit, period, precision)
            }
            Algorithm::SlidingLog => Rule::sliding_log(limit, period),
            Algorithm::TokenBucket { .. } => Rule::token_bucket(limit, period, limit + extra),
            Algorithm::LeakyBucket(mode) => match (mode, flip) {
                (LeakyMode::Meter { .. }, false) | (LeakyMode::Shaper { .. }, true) => {
                    Rule::leaky_meter(limit, period, p)
                }
                _ => Rule::leaky_shaper(limit, period, extra, extra.min(limit)),
            },
            Algorithm::Gcra { .. } => Rule::gcra(limit, period, p),
            Algorithm::Concurrent => Rule::concurrent(limit.min(crate::MAX_CONCURRENT), period),
        }
        .expect("generated rules are valid");
        named_as(new, rule)
    }

    /// `rule` under another algorithm or period, with its name.
    fn moved(rule: &Rule, limit: u64) -> Rule {
        use crate::Algorithm;
        let period = rule.period();
        let new = match rule.algorithm() {
            Algorithm::FixedWindow => Rule::gcra(limit, period, 2),
            Algorithm::Gcra { .. } => Rule::token_bucket(limit, period, limit),
            Algorithm::TokenBucket { .. } => Rule::leaky_meter(limit, period, 3),
            Algorithm::SlidingWindow { .. } => Rule::fixed_window(limit, period * 2),
            _ => Rule::sliding_window(limit, period, 1),
        }
        .expect("generated rules are valid");
        named_as(new, rule)
    }

    fn named_as(new: Rule, old: &Rule) -> Rule {
        match old.name() {
            Some(name) => new.named(name).expect("a valid name"),
            None => new,
        }
    }

    /// A trace over `rulesets` rule sets and three keys: mostly checks (cost 0 to 3, so
    /// some exceed small capacities), clock steps from 0 to ~2 periods, now and then a
    /// step back (up to 2 s), and blocks.
    pub fn steps(rulesets: usize, len: usize) -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            8 => (0u8..3, 0..rulesets, prop_oneof![4 => Just(1u64), 1 => Just(0), 1 => 2u64..=3])
                .prop_map(|(key, rules, cost)| Step::Check { key, rules, cost }),
            4 => prop_oneof![0u64..2_000, 0u64..200_000, 0u64..2_000_000, Just(60_000_000)].prop_map(Step::Advance),
            1 => prop_oneof![1u64..2_000, 1u64..2_000_000].prop_map(Step::Rewind),
            1 => (0u8..3, proptest::option::of(1u64..3_000)).prop_map(|(key, ms)| Step::Block { key, ms }),
            1 => (0u8..3).prop_map(|key| Step::Unblock { key }),
            1 => (0u8..3, 0..rulesets).prop_map(|(key, rules)| Step::Reset { key, rules }),
            3 => (0u8..3, 0usize..16, any::<bool>())
                .prop_map(|(key, nth, detached)| Step::Release { key, nth, detached }),
            1 => (0u8..3, 0..rulesets, 0usize..16).prop_map(|(key, rules, nth)| Step::Renew { key, rules, nth }),
            2 => settle(rulesets),
            1 => (0u8..3, 0..rulesets).prop_map(|(key, rules)| Step::Take { key, rules }),
        ];
        proptest::collection::vec(step, 1..len)
    }

    /// A settle: mostly of a recent charge of a few units to a few more or fewer,
    /// sometimes to a hostile actual.
    pub fn settle(rulesets: usize) -> impl Strategy<Value = Step> {
        (
            0u8..3,
            0..rulesets,
            0u64..4,
            prop_oneof![6 => 0u64..8, 1 => 8u64..200, 1 => Just(u64::MAX)],
            prop_oneof![Just(0u64), 0u64..2_000, 0u64..2_000_000],
            any::<bool>(),
        )
            .prop_map(
                |(key, rules, charged, actual, ago_us, detached)| Step::Settle {
                    key,
                    rules,
                    charged,
                    actual,
                    ago_us,
                    detached,
                },
            )
    }
}
