use std::collections::HashMap;
use std::future::{ready, Future};
use std::hash::BuildHasher;
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::algo::{decide, RuleState};
use crate::clock::{Clock, SystemClock};
use crate::decision::Decision;
use crate::error::CapacityError;
use crate::rule::RuleSet;
use crate::store::Store;

/// Keys tracked by default before the store starts evicting.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The in-process store: sharded, lock per shard, no background task.
///
/// * **Concurrency.** Keys hash (with a per-process random seed) to one of many shards,
///   each behind its own mutex held only for the O(1) decision, so checks on different
///   keys rarely contend and there is no global lock.
/// * **Idle keys** are dropped by the store itself: each entry knows when its state becomes
///   equivalent to a fresh one, and a shard drops such entries whenever it has doubled in
///   size since its last sweep (amortized O(1) per insert; nothing for the user to run).
/// * **The cap.** At most `max_keys` entries are tracked (default 1,000,000). When a shard
///   is full it first drops expired entries; if that frees less than an eighth of it, it
///   also drops the eighth of its entries whose state would expire soonest (those closest
///   to fresh). A flood of distinct keys (spoofed addresses) therefore cannot grow memory
///   past the cap; the price is that, under such a flood, some clients' partly used
///   quotas are forgotten early, which errs toward admitting them.
///
/// ```
/// use ratelimit_core::{ManualClock, MemoryStore, RuleSet, Store};
/// # futures::executor::block_on(async {
/// let clock = ManualClock::new(0);
/// let store = MemoryStore::builder().clock(clock.clone()).build();
/// let rules: RuleSet = "2/second fixed-window".parse().unwrap();
///
/// assert!(store.check(b"10.0.0.1", &rules, 1).await.unwrap().is_allowed());
/// assert!(store.check(b"10.0.0.1", &rules, 1).await.unwrap().is_allowed());
/// let third = store.check(b"10.0.0.1", &rules, 1).await.unwrap();
/// assert!(!third.is_allowed());
/// assert_eq!(third.retry_after(), Some(std::time::Duration::from_secs(1)));
/// # });
/// ```
pub struct MemoryStore<C: Clock = SystemClock> {
    shards: Box<[Padded<Mutex<Shard>>]>,
    shard_cap: usize,
    hasher: foldhash::fast::RandomState,
    clock: C,
}

impl<C: Clock> std::fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("max_keys", &(self.shard_cap * self.shards.len()))
            .field("len", &self.len())
            .finish()
    }
}

#[repr(align(128))]
struct Padded<T>(T);

struct Entry {
    key: Box<[u8]>,
    fingerprint: u64,
    expires_at: u64,
    states: SmallVec<[RuleState; 1]>,
}

#[derive(Default)]
struct Shard {
    // Boxed entries keep the table's slots at one pointer: a hash table is often only half
    // full right after it grows, and empty slots then cost 8 bytes, not a whole entry.
    table: HashTable<Box<Entry>>,
    blocks: HashMap<Box<[u8]>, u64>,
    sweep_at: usize,
}

const MIN_SWEEP: usize = 1024;

impl Shard {
    fn sweep(&mut self, now: u64) {
        self.table.retain(|e| e.expires_at > now);
        self.blocks.retain(|_, until| *until > now);
    }

    /// Makes room for one more entry; see the type's docs for the policy.
    fn make_room(&mut self, cap: usize, now: u64) {
        if self.table.len() >= self.sweep_at {
            self.sweep(now);
            self.sweep_at = (self.table.len() * 2).max(MIN_SWEEP);
        }
        if self.table.len() < cap {
            return;
        }
        self.sweep(now);
        if self.table.len() > cap - cap / 8 {
            let mut expiries: Vec<u64> = self.table.iter().map(|e| e.expires_at).collect();
            let evict = (cap / 8).max(1).min(expiries.len());
            let (below, threshold, _) = expiries.select_nth_unstable(evict - 1);
            let threshold = *threshold;
            // Entries sharing the threshold expiry are dropped only as far as needed, so
            // a flood of keys seen at the same instant loses an eighth, not all of them.
            let mut ties = evict - below.iter().filter(|&&x| x < threshold).count();
            self.table.retain(|e| {
                if e.expires_at < threshold {
                    false
                } else if e.expires_at == threshold && ties > 0 {
                    ties -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }
}

/// Builds a [`MemoryStore`].
#[derive(Debug)]
#[must_use]
pub struct MemoryStoreBuilder<C: Clock = SystemClock> {
    max_keys: usize,
    shards: usize,
    clock: C,
}

impl MemoryStoreBuilder<SystemClock> {
    fn new() -> Self {
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        Self {
            max_keys: DEFAULT_MAX_KEYS,
            shards: (cpus * 8).next_power_of_two().clamp(16, 1024),
            clock: SystemClock,
        }
    }
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// Caps the number of tracked (key, rule set) pairs; at least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// Number of shards (rounded up to a power of two, at most 4096).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 4096).next_power_of_two();
        self
    }

    /// Takes time from `clock` instead of the system clock.
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryStoreBuilder<C2> {
        MemoryStoreBuilder {
            max_keys: self.max_keys,
            shards: self.shards,
            clock,
        }
    }

    /// The store.
    pub fn build(self) -> MemoryStore<C> {
        let shards = self.shards.min(self.max_keys.next_power_of_two()).max(1);
        MemoryStore {
            shards: (0..shards)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        sweep_at: MIN_SWEEP,
                        ..Shard::default()
                    }))
                })
                .collect(),
            shard_cap: self.max_keys.div_ceil(shards),
            hasher: foldhash::fast::RandomState::default(),
            clock: self.clock,
        }
    }
}

impl MemoryStore<SystemClock> {
    /// A store with the system clock and default limits.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder<SystemClock> {
        MemoryStoreBuilder::new()
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// The clock decisions are taken with.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// Number of tracked (key, rule set) entries, expired ones included until swept.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().table.len()).sum()
    }

    /// True when nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn locate(&self, key: &[u8]) -> (u64, &Mutex<Shard>) {
        let hash = self.hasher.hash_one(key);
        // The table hashes with the low bits, the shard is picked with the high ones.
        let shard = (hash >> 32) as usize & (self.shards.len() - 1);
        (hash, &self.shards[shard].0)
    }

    /// The synchronous form of [`Store::check`]; never blocks on I/O.
    pub fn check_now(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, CapacityError> {
        rules.check_cost(cost)?;
        let now = self.clock.now_us();
        let (hash, shard) = self.locate(key);
        let fp = rules.fingerprint();
        let table_hash = hash ^ fp;
        let mut shard = shard.lock();
        if !shard.blocks.is_empty() {
            if let Some(&until) = shard.blocks.get(key) {
                if until > now {
                    let left = (until != u64::MAX).then(|| Duration::from_micros(until - now));
                    return Ok(Decision::blocked(left));
                }
                shard.blocks.remove(key);
            }
        }
        let found = shard.table.find_mut(table_hash, |e| {
            e.fingerprint == fp && e.states.len() == rules.len() && *e.key == *key
        });
        if let Some(entry) = found {
            let t = decide(rules, &mut entry.states, now, cost);
            if t.committed {
                entry.expires_at = t.expires_at_us;
            }
            return Ok(t.decision);
        }
        let mut states: SmallVec<[RuleState; 1]> =
            (0..rules.len()).map(|_| RuleState::Fresh).collect();
        let t = decide(rules, &mut states, now, cost);
        if t.committed {
            let cap = self.shard_cap;
            shard.make_room(cap, now);
            let hasher = &self.hasher;
            shard.table.insert_unique(
                table_hash,
                Box::new(Entry {
                    key: key.into(),
                    fingerprint: fp,
                    expires_at: t.expires_at_us,
                    states,
                }),
                |e| hasher.hash_one(&*e.key) ^ e.fingerprint,
            );
        }
        Ok(t.decision)
    }

    /// The synchronous form of [`Store::block`].
    pub fn block_now(&self, key: &[u8], duration: Option<Duration>) {
        let now = self.clock.now_us();
        let until = match duration {
            Some(d) => now
                .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
                .min(u64::MAX - 1),
            None => u64::MAX,
        };
        let (_, shard) = self.locate(key);
        shard.lock().blocks.insert(key.into(), until);
    }

    /// The synchronous form of [`Store::unblock`].
    pub fn unblock_now(&self, key: &[u8]) {
        let (_, shard) = self.locate(key);
        shard.lock().blocks.remove(key);
    }

    /// The synchronous form of [`Store::reset`].
    pub fn reset_now(&self, key: &[u8], rules: &RuleSet) {
        let (hash, shard) = self.locate(key);
        let fp = rules.fingerprint();
        let mut shard = shard.lock();
        if let Ok(entry) = shard
            .table
            .find_entry(hash ^ fp, |e| e.fingerprint == fp && *e.key == *key)
        {
            entry.remove();
        }
    }
}

impl<C: Clock> Store for MemoryStore<C> {
    type Error = CapacityError;

    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send {
        ready(self.check_now(key, rules, cost))
    }

    fn check_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Option<Result<Decision, Self::Error>> {
        Some(self.check_now(key, rules, cost))
    }

    fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.block_now(key, duration);
        ready(Ok(()))
    }

    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.unblock_now(key);
        ready(Ok(()))
    }

    fn reset(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.reset_now(key, rules);
        ready(Ok(()))
    }

    fn now_us(&self) -> u64 {
        self.clock.now_us()
    }
}
