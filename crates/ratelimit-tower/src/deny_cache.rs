//! Recent denials kept in process, so that a key hammering the service after its denial is
//! answered without asking the store until its retry time has passed.
//!
//! Time is the store's clock ([`Store::now_us`](ratelimit_core::Store::now_us)), passed
//! in by the caller: a store on a manual clock moves the cache with it.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ratelimit_core::Decision;

use crate::tier::Tier;

/// Settings of the local deny cache; see
/// [`RateLimitLayerBuilder::deny_cache`](crate::RateLimitLayerBuilder::deny_cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenyCacheConfig {
    pub(crate) max_keys: usize,
    pub(crate) max_ttl: Duration,
}

impl Default for DenyCacheConfig {
    fn default() -> Self {
        Self {
            max_keys: 10_000,
            max_ttl: Duration::from_secs(10),
        }
    }
}

impl DenyCacheConfig {
    /// Keeps at most `max_keys` denied keys (10,000 by default); when full, new denials
    /// are not cached until old ones expire.
    #[must_use]
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// Keeps a denial at most `max_ttl` (10 s by default) even when its retry time is
    /// later: an unblock or reset done in the store is seen within this time.
    #[must_use]
    pub fn max_ttl(mut self, max_ttl: Duration) -> Self {
        self.max_ttl = max_ttl;
        self
    }
}

struct Denial {
    /// The version of the limits that denied: a denial says nothing about other limits.
    generation: u64,
    at_us: u64,
    until_us: u64,
    cost: u64,
    decision: Decision,
    /// The customer's own tier when its rules refused (`None`: the selected tier's): a
    /// refusal from the cache carries the fields of the rules that refused.
    own: Option<Arc<Tier>>,
    /// Whether the fallback store refused (the store had failed): its fields are the
    /// fallback rules'.
    by_fallback: bool,
}

type Shard = HashMap<Box<[u8]>, Denial, foldhash::fast::RandomState>;

pub(crate) struct DenyCache {
    shards: Box<[Mutex<Shard>]>,
    shard_cap: usize,
    hasher: foldhash::fast::RandomState,
    len: AtomicUsize,
    max_ttl_us: u64,
}

const SHARDS: usize = 16;

/// A cached denial: the decision as the store gave it, and how long ago.
pub(crate) struct Hit {
    pub(crate) decision: Decision,
    pub(crate) elapsed: Duration,
    /// The decision's retry time, counted down (not the cache entry's lifetime, which
    /// may be shorter).
    pub(crate) retry_after: Option<Duration>,
    /// The customer's own tier, when its rules refused.
    pub(crate) own: Option<Arc<Tier>>,
    /// Whether the fallback store refused.
    pub(crate) by_fallback: bool,
}

impl DenyCache {
    pub(crate) fn new(config: DenyCacheConfig) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_cap: config.max_keys.div_ceil(SHARDS),
            hasher: foldhash::fast::RandomState::default(),
            len: AtomicUsize::new(0),
            max_ttl_us: micros(config.max_ttl),
        }
    }

    fn shard(&self, key: &[u8]) -> &Mutex<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[(h >> 60) as usize % SHARDS]
    }

    /// A denial of `key` under the limits of `generation`, still in force for a request of
    /// `cost` (a denial at some cost says nothing about a cheaper request). Peeks
    /// (`cost == 0`) always go to the store.
    #[inline]
    pub(crate) fn get(
        &self,
        key: &[u8],
        generation: u64,
        cost: u64,
        now_us: impl FnOnce() -> u64,
    ) -> Option<Hit> {
        // The common case, nobody denied lately, costs one atomic load, inlined into
        // every request's path.
        if cost == 0 || self.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.look_up(key, generation, cost, now_us())
    }

    #[inline(never)]
    fn look_up(&self, key: &[u8], generation: u64, cost: u64, now: u64) -> Option<Hit> {
        let mut shard = self.shard(key).lock();
        let denial = shard.get(key)?;
        if now >= denial.until_us || denial.generation != generation {
            shard.remove(key);
            self.len.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if cost < denial.cost {
            return None;
        }
        let elapsed = Duration::from_micros(now.saturating_sub(denial.at_us));
        Some(Hit {
            decision: denial.decision.clone(),
            elapsed,
            retry_after: denial
                .decision
                .retry_after()
                .map(|r| r.saturating_sub(elapsed)),
            own: denial.own.clone(),
            by_fallback: denial.by_fallback,
        })
    }

    /// Remembers a denial of a request of `cost` for `key` under the limits of
    /// `generation` (by the customer's tier `own`, when its rules refused; by the
    /// fallback store's rules when `by_fallback`), until its retry time (at most the
    /// configured maximum).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert(
        &self,
        key: &[u8],
        generation: u64,
        cost: u64,
        decision: &Decision,
        own: Option<&Arc<Tier>>,
        by_fallback: bool,
        now: u64,
    ) {
        if cost == 0 {
            return;
        }
        let ttl = decision
            .retry_after()
            .map_or(self.max_ttl_us, |d| micros(d).min(self.max_ttl_us));
        if ttl == 0 {
            return;
        }
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.shard_cap && !shard.contains_key(key) {
            let before = shard.len();
            shard.retain(|_, d| d.until_us > now);
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
            if shard.len() >= self.shard_cap {
                return;
            }
        }
        let denial = Denial {
            generation,
            at_us: now,
            until_us: now.saturating_add(ttl),
            cost,
            decision: decision.clone(),
            own: own.cloned(),
            by_fallback,
        };
        if shard.insert(key.into(), denial).is_none() {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratelimit_core::RuleOutcome;

    fn denial(retry: Duration) -> Decision {
        Decision::from_rules(
            [RuleOutcome {
                allowed: false,
                limit: 1,
                remaining: 0,
                reset_after: retry,
                retry_after: Some(retry),
            }],
            Duration::ZERO,
        )
    }

    const T: u64 = 1_000_000_000;

    #[test]
    fn expires_and_respects_cost() {
        let cache = DenyCache::new(DenyCacheConfig::default());
        cache.insert(b"k", 0, 2, &denial(Duration::from_secs(3)), None, false, T);
        assert!(
            cache.get(b"k", 0, 1, || T).is_none(),
            "cheaper request may pass"
        );
        assert!(
            cache.get(b"k", 0, 0, || T).is_none(),
            "peeks go to the store"
        );
        let hit = cache.get(b"k", 0, 2, || T).unwrap();
        assert_eq!(hit.retry_after, Some(Duration::from_secs(3)));
        let hit = cache.get(b"k", 0, 5, || T + 2_500_000).unwrap();
        assert_eq!(hit.elapsed, Duration::from_millis(2500));
        assert_eq!(hit.retry_after, Some(Duration::from_millis(500)));
        assert!(cache.get(b"k", 0, 2, || T + 3_000_000).is_none());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn denials_under_other_limits_do_not_answer() {
        let cache = DenyCache::new(DenyCacheConfig::default());
        cache.insert(b"k", 3, 1, &denial(Duration::from_secs(3)), None, false, T);
        assert!(cache.get(b"k", 3, 1, || T).is_some());
        assert!(cache.get(b"k", 4, 1, || T).is_none(), "replaced limits");
        assert_eq!(cache.len(), 0, "an entry of replaced limits is dropped");
    }

    #[test]
    fn bounded_and_capped_ttl() {
        let cache = DenyCache::new(
            DenyCacheConfig::default()
                .max_keys(32)
                .max_ttl(Duration::from_secs(1)),
        );
        for i in 0..1000u32 {
            cache.insert(
                &i.to_be_bytes(),
                0,
                1,
                &denial(Duration::from_secs(60)),
                None,
                false,
                T,
            );
        }
        assert!(cache.len() <= 32, "{}", cache.len());
        let key = 0u32.to_be_bytes();
        let hit = cache.get(&key, 0, 1, || T).unwrap();
        assert_eq!(
            hit.retry_after,
            Some(Duration::from_secs(60)),
            "the real retry time"
        );
        assert!(
            cache.get(&key, 0, 1, || T + 1_000_000).is_none(),
            "max_ttl caps a long retry time"
        );
        // Once entries expired, a full shard takes new ones again.
        cache.insert(
            b"new",
            0,
            1,
            &denial(Duration::from_secs(60)),
            None,
            false,
            T + 1_000_000,
        );
        assert!(cache.get(b"new", 0, 1, || T + 1_000_000).is_some());
    }
}
