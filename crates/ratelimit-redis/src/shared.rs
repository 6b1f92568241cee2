//! What every layer of one store reads: its configuration (prefix, clock, TTL floor,
//! timeout) and what the transport learned from its servers (which form the calls take,
//! their clock, their eviction policy). It knows no other part of the store.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_core::Clock;

use crate::script::{Paths, MAX_EXACT};

/// The configuration of a store.
pub(crate) struct Shared {
    pub(crate) prefix: Arc<str>,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) ttl_floor_ms: u64,
    pub(crate) timeout: Duration,
    /// Whether checks run as the native module's commands, as FCALL of the function
    /// library (Redis 7) or as EVALSHA.
    pub(crate) paths: Paths,
    /// The builder's `force_lua`: never the module.
    pub(crate) force_lua: bool,
    /// The Redis clock as seen from here, for deadlines.
    pub(crate) redis_clock: RedisClock,
    /// `maxmemory-policy` as last read, when the server allowed it.
    pub(crate) maxmemory_policy: std::sync::RwLock<Option<String>>,
    /// Detached edits (releases and settles no caller waits for) that failed for good,
    /// reported at a bounded rate.
    pub(crate) detached_log: ratelimit_core::util::BoundedLog,
    /// Detached edits not yet answered nor given up, and who waits for none to be left.
    pub(crate) detached: Outstanding,
    /// When a connection lost (or never made) last came back, on the store's clock (µs;
    /// 0: never): [`Store::recovered_at_us`](ratelimit_core::Store::recovered_at_us).
    pub(crate) recovered_at: std::sync::atomic::AtomicU64,
}

/// A count of operations under way, and a wake-up for those waiting until none are.
#[derive(Debug, Default)]
pub(crate) struct Outstanding {
    count: std::sync::atomic::AtomicUsize,
    none_left: tokio::sync::Notify,
}

impl Outstanding {
    pub(crate) fn start(&self) {
        self.count.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    pub(crate) fn end(&self) {
        if self.count.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.none_left.notify_waiters();
        }
    }

    /// Resolves once none is under way (at once when none is).
    pub(crate) async fn none(&self) {
        loop {
            let notified = self.none_left.notified();
            tokio::pin!(notified);
            // Registered before the count is read: an end in between still wakes it.
            notified.as_mut().enable();
            if self.count.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Shared {
    /// How long Redis keeps the record of a call decided once on the Lua functions, in
    /// ms: a call is sent again only within the store's timeout of its first send, and
    /// its record is written when it runs, after that send; twice the timeout and a
    /// second more leaves room for a slow reply. A record is one small key per call.
    pub(crate) fn record_keep_ms(&self) -> u64 {
        u64::try_from(self.timeout.as_millis())
            .unwrap_or(u64::MAX / 4)
            .saturating_mul(2)
            .saturating_add(1_000)
    }

    /// The time on the store's clock: the injected one, else the system's.
    pub(crate) fn now_us(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.now_us(),
            None => ratelimit_core::SystemClock.now_us(),
        }
    }

    /// The store's time as decisions read it: the injected clock, else this host's
    /// reading of the Redis server's `TIME` (this host's clock until one arrives).
    pub(crate) fn store_now_us(&self) -> u64 {
        match self.clock {
            Some(_) => self.now_us(),
            None => self.redis_clock.now().unwrap_or_else(|| self.now_us()),
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("prefix", &self.prefix)
            .field("clock", &clock_name(self.clock.as_ref()))
            .field("ttl_floor_ms", &self.ttl_floor_ms)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// How a store's time source shows in its `Debug` output.
pub(crate) fn clock_name(clock: Option<&Arc<dyn Clock>>) -> &'static str {
    if clock.is_some() {
        "injected"
    } else {
        "Redis TIME"
    }
}

/// This host's monotonic clock against the Redis server's, learned from Redis `TIME`
/// readings: enough to tell the script when the caller stops waiting.
#[derive(Debug)]
pub(crate) struct RedisClock {
    base: Instant,
    /// Redis time minus monotonic µs since `base`; `i64::MIN` until a reading arrives.
    offset_us: AtomicI64,
}

impl RedisClock {
    pub(crate) fn new() -> Self {
        Self {
            base: Instant::now(),
            offset_us: AtomicI64::new(i64::MIN),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(i64::MAX)
    }

    /// Records that Redis read `redis_us` at some instant before `received`. The reply
    /// took time to arrive, so a reading puts the offset too low, never too high: the
    /// largest one is the closest. Keeping the largest also means a deadline is never
    /// earlier than the caller's real one (a Cluster's nodes: the fastest clock wins).
    pub(crate) fn observe(&self, redis_us: u64, received: Instant) {
        let offset = i64::try_from(redis_us).unwrap_or(i64::MAX) - self.local_us(received);
        self.offset_us.fetch_max(offset, Ordering::Relaxed);
    }

    /// The time on the Redis clock now, at or before the server's own reading (on a
    /// Cluster, the fastest master's), once a reading arrived.
    pub(crate) fn now(&self) -> Option<u64> {
        let offset = self.offset_us.load(Ordering::Relaxed);
        if offset == i64::MIN {
            return None;
        }
        u64::try_from(self.local_us(Instant::now()).saturating_add(offset)).ok()
    }

    /// The instant `timeout` from now on the Redis clock, once a reading arrived.
    pub(crate) fn deadline(&self, timeout: Duration) -> Option<u64> {
        let offset = self.offset_us.load(Ordering::Relaxed);
        if offset == i64::MIN {
            return None;
        }
        let timeout = i64::try_from(timeout.as_micros()).unwrap_or(i64::MAX);
        let at = self
            .local_us(Instant::now())
            .saturating_add(offset)
            .saturating_add(timeout);
        u64::try_from(at).ok().filter(|&at| at <= MAX_EXACT)
    }
}
