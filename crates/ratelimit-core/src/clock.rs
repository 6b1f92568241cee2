use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of the current time, in whole microseconds since the Unix epoch.
///
/// Every decision takes its time from a clock so that tests (and the conformance suite)
/// can replay exact traces with [`ManualClock`], while production uses [`SystemClock`]
/// (or, in the Redis store, the Redis server's own clock).
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The wall clock, read once per process and then advanced by a monotonic clock.
///
/// Reading the wall clock on every decision costs a system call's worth of time and goes
/// backwards when the clock is stepped; instead the epoch is read once and the rest comes
/// from [`quanta`] (the CPU's invariant TSC where available, the OS monotonic clock
/// otherwise), so time only moves forward and a reading costs a few nanoseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

/// The epoch time at `start_raw`, and the clock it was read from. Reading a clock of our
/// own (as governor does) skips the global and thread-local lookups of
/// `quanta::Instant::now`, and working on raw counter values converts once, from counter
/// ticks to nanoseconds, instead of through an `Instant` and a `Duration`.
struct Anchor {
    epoch_us: u64,
    clock: quanta::Clock,
    start_raw: u64,
}

static ANCHOR: OnceLock<Anchor> = OnceLock::new();

impl Clock for SystemClock {
    #[inline]
    fn now_us(&self) -> u64 {
        let anchor = ANCHOR.get_or_init(|| {
            let clock = quanta::Clock::new();
            let epoch_us = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            let start_raw = clock.raw();
            Anchor {
                epoch_us,
                clock,
                start_raw,
            }
        });
        let since_ns = anchor
            .clock
            .delta_as_nanos(anchor.start_raw, anchor.clock.raw());
        anchor.epoch_us + since_ns / 1_000
    }
}

/// A clock that only moves when told to; clones share the same time.
///
/// ```
/// use ratelimit_core::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(1_000);
/// let view = clock.clone();
/// clock.advance(Duration::from_millis(2));
/// assert_eq!(view.now_us(), 3_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `now_us` microseconds since the epoch.
    pub fn new(now_us: u64) -> Self {
        Self(Arc::new(AtomicU64::new(now_us)))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_micros() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to an absolute time (it may move backwards).
    pub fn set(&self, now_us: u64) {
        self.0.store(now_us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    #[inline]
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }
}
