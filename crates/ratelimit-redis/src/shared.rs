//! What every part of one store shares: its configuration (prefix, clock, TTL floor,
//! timeout), what it learned from its servers (whether they have functions, their
//! clock, their eviction policy), and how each store operation becomes the request it
//! sends.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_core::{Clock, RuleSet};
use redis::Cmd;

use crate::keys::KeyNames;
use crate::script::{
    self, block_us, Call, CheckArgs, CheckJob, Paths, Time, BLOCK, CHECK, GIVE_BACK, MAX_EXACT,
};

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
}

impl Shared {
    /// The time on the store's clock: the injected one, else the system's.
    pub(crate) fn now_us(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.now_us(),
            None => ratelimit_core::SystemClock.now_us(),
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
    fn deadline(&self, timeout: Duration) -> Option<u64> {
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

impl Shared {
    fn now(&self) -> Option<u64> {
        self.clock.as_ref().map(|clock| clock.now_us())
    }

    fn time(&self) -> Time {
        Time {
            now: self.now(),
            deadline: self.redis_clock.deadline(self.timeout),
        }
    }

    pub(crate) fn check_call(&self, key: &[u8], rules: &RuleSet, cost: u64) -> Call<'_> {
        let has_log = rules.log_limit() > 0;
        let keys = 2 + usize::from(has_log);
        let mut names = KeyNames::new(&self.prefix, key);
        let mut call = CHECK.call(&self.paths, names.block().as_bytes(), keys, keys + 1);
        call.cmd.arg(names.block());
        call.cmd.arg(names.state());
        if has_log {
            call.cmd.arg(names.log());
        }
        CheckArgs::write(&mut call.cmd, self.time(), cost, self.ttl_floor_ms, rules);
        call
    }

    /// One check as a batch carries it.
    pub(crate) fn check_job(&self, key: &[u8], rules: &RuleSet, cost: u64) -> CheckJob {
        CheckJob::new(
            &self.prefix,
            key,
            rules,
            self.time(),
            cost,
            self.ttl_floor_ms,
        )
    }

    /// The call that decides `job` alone: the same as [`check_call`](Self::check_call).
    pub(crate) fn single_call(&self, job: &CheckJob) -> Call<'_> {
        job.single_call(&self.paths)
    }

    /// The call that decides `jobs` in order, in one run of `check_many`.
    pub(crate) fn batch_call<'a, 'j>(
        &'a self,
        jobs: impl Iterator<Item = &'j CheckJob> + Clone,
    ) -> Call<'a> {
        script::batch_call(&self.paths, jobs)
    }

    /// The call that decides `jobs` in order, in one run of `check_local` on the Cluster
    /// node it is sent to.
    pub(crate) fn node_batch_call<'a, 'j>(
        &'a self,
        jobs: impl Iterator<Item = &'j CheckJob> + Clone,
    ) -> Call<'a> {
        script::node_batch_call(&self.paths, jobs)
    }

    /// Gives back `cost` units a check of `key` under `rules` charged at `charged_at`.
    pub(crate) fn give_back_call(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Call<'_> {
        let has_log = rules.log_limit() > 0;
        let keys = 1 + usize::from(has_log);
        let mut names = KeyNames::new(&self.prefix, key);
        let mut call = GIVE_BACK.call(&self.paths, names.state().as_bytes(), keys, keys + 2);
        call.cmd.arg(names.state());
        if has_log {
            call.cmd.arg(names.log());
        }
        let time = Time {
            now: self.now(),
            deadline: None,
        };
        CheckArgs::write(&mut call.cmd, time, cost, self.ttl_floor_ms, rules);
        call.cmd.arg(charged_at);
        call
    }

    pub(crate) fn block_call(&self, key: &[u8], duration: Option<Duration>) -> Call<'_> {
        let mut names = KeyNames::new(&self.prefix, key);
        let mut call = BLOCK.call(&self.paths, names.block().as_bytes(), 1, 4);
        call.cmd.arg(names.block());
        match self.now() {
            Some(now) => call.cmd.arg(now),
            None => call.cmd.arg(""),
        };
        match duration {
            Some(d) => call.cmd.arg(block_us(d)),
            None => call.cmd.arg(""),
        };
        call.cmd.arg(self.ttl_floor_ms);
        call
    }

    pub(crate) fn unblock_cmd(&self, key: &[u8]) -> Cmd {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(KeyNames::new(&self.prefix, key).block());
        cmd
    }

    /// Forgets every rule's state of `key`: the state and the log (a block stays).
    pub(crate) fn reset_cmd(&self, key: &[u8]) -> Cmd {
        let mut names = KeyNames::new(&self.prefix, key);
        let mut cmd = redis::cmd("DEL");
        cmd.arg(names.state());
        cmd.arg(names.log());
        cmd
    }
}
