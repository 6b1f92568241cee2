//! Small pieces the store and middleware crates of this family share, so that each exists
//! once: a log that reports at a bounded rate, a fixed 64-bit hash, the text of a
//! period, and the waits before a failed release is tried again.
//!
//! ```
//! use ratelimit_core::util::{fnv1a, period_parts, BoundedLog};
//! use std::time::Duration;
//!
//! // A steady stream of failures is reported once per 10 s, with a count.
//! let log = BoundedLog::new();
//! assert_eq!(log.hit(0), Some(1));
//! assert_eq!(log.hit(5_000_000), None);
//! assert_eq!(log.hit(10_000_000), Some(2));
//!
//! assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
//! assert_eq!(period_parts(Duration::from_secs(120)), (2, "min"));
//! assert_eq!(period_parts(Duration::from_millis(1500)), (1500, "ms"));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The waits before each retry of a concurrency slot's release that failed, one after
/// the other: a store back within about a second still frees the slot at once. What a
/// middleware awaiting a release waits, and what a store that takes one over
/// ([`Store::release_detached`](crate::Store::release_detached)) waits.
pub const RELEASE_RETRY_WAITS: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_millis(1_000),
];

/// Counts events and lets one report through per 10 s of the caller's clock, with the
/// number of events since the last report: a steady cause (a store outage, a
/// misconfiguration, a foreign writer) is seen at once and keeps being seen, without one
/// log line per event.
#[derive(Debug)]
pub struct BoundedLog {
    /// When the last report was let through; `u64::MAX` before the first.
    last_us: AtomicU64,
    pending: AtomicU64,
}

impl Default for BoundedLog {
    fn default() -> Self {
        Self::new()
    }
}

impl BoundedLog {
    /// The shortest time between two reports.
    pub const INTERVAL: Duration = Duration::from_secs(10);

    const INTERVAL_US: u64 = 10_000_000;

    /// A log whose first event is reported at once.
    pub const fn new() -> Self {
        Self {
            last_us: AtomicU64::new(u64::MAX),
            pending: AtomicU64::new(0),
        }
    }

    /// Counts one event at `now_us` (microseconds on any clock that does not go back);
    /// returns the number of events to report, this one included, when a report is due.
    pub fn hit(&self, now_us: u64) -> Option<u64> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let last = self.last_us.load(Ordering::Relaxed);
        let due = last == u64::MAX || now_us.saturating_sub(last) >= Self::INTERVAL_US;
        // `u64::MAX` marks "never reported": a report at that very time counts as one at
        // the time before.
        let now_us = now_us.min(u64::MAX - 1);
        if due
            && self
                .last_us
                .compare_exchange(last, now_us, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.pending.swap(0, Ordering::Relaxed));
        }
        None
    }
}

/// 64-bit FNV-1a: fixed by its specification, so a value derived from it (a rule set's
/// fingerprint, a layer's namespace) never changes with a dependency's version. Not
/// collision resistant: for names chosen by the program, never for client input.
pub const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

/// A period as a count of its largest whole unit: `(2, "min")` for 120 s, `(1500, "ms")`
/// for 1.5 s. The units are `d`, `h`, `min`, `s`, `ms` and `us`.
pub fn period_parts(period: Duration) -> (u64, &'static str) {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000_000, "d"),
        (3_600_000_000, "h"),
        (60_000_000, "min"),
        (1_000_000, "s"),
        (1_000, "ms"),
    ];
    let us = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
    for (size, unit) in UNITS {
        if us % size == 0 {
            return (us / size, unit);
        }
    }
    (us, "us")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_log_reports_once_per_interval_with_a_count() {
        let log = BoundedLog::new();
        assert_eq!(log.hit(0), Some(1), "the first is reported at once");
        assert_eq!(log.hit(1), None);
        assert_eq!(log.hit(9_999_999), None);
        assert_eq!(log.hit(10_000_000), Some(3), "then the count since");
        assert_eq!(log.hit(10_000_001), None);
        assert_eq!(log.hit(25_000_000), Some(2));
    }

    #[test]
    fn fnv1a_matches_the_specification() {
        // Test vectors of the FNV reference (draft-eastlake-fnv).
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn periods_in_their_largest_whole_unit() {
        let p = |us| period_parts(Duration::from_micros(us));
        assert_eq!(p(86_400_000_000), (1, "d"));
        assert_eq!(p(7_200_000_000), (2, "h"));
        assert_eq!(p(90_000_000), (90, "s"));
        assert_eq!(p(1_000), (1, "ms"));
        assert_eq!(p(1_500), (1500, "us"));
    }
}
