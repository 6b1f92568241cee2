//! Events logged at a bounded rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// An event logged at most once per 10 s with the number since the last report, so that
/// a steady cause (another program writing under the prefix, a Redis that stays down)
/// cannot flood the log.
#[derive(Debug)]
pub(crate) struct BoundedLog {
    base: Instant,
    /// µs after `base` of the last report; `u64::MAX` before the first.
    last_us: AtomicU64,
    pending: AtomicU64,
}

impl BoundedLog {
    const INTERVAL_US: u64 = 10_000_000;

    pub(crate) fn new() -> Self {
        Self {
            base: Instant::now(),
            last_us: AtomicU64::new(u64::MAX),
            pending: AtomicU64::new(0),
        }
    }

    /// Counts one event now; the events to report when a report is due.
    pub(crate) fn hit(&self) -> Option<u64> {
        let now_us = u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
        self.hit_at(now_us)
    }

    fn hit_at(&self, now_us: u64) -> Option<u64> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let last = self.last_us.load(Ordering::Relaxed);
        let due = last == u64::MAX || now_us.saturating_sub(last) >= Self::INTERVAL_US;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_at_most_every_10_s_with_a_count() {
        let log = BoundedLog::new();
        assert_eq!(log.hit_at(0), Some(1), "the first is reported at once");
        assert_eq!(log.hit_at(1), None);
        assert_eq!(log.hit_at(9_999_999), None);
        assert_eq!(log.hit_at(10_000_000), Some(3), "then the count since");
        assert_eq!(log.hit_at(10_000_001), None);
        assert_eq!(log.hit_at(25_000_000), Some(2));
    }
}
