use std::future::{ready, Future};
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::Duration;

use hashbrown::{Equivalent, HashMap, HashTable};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::algo::{
    carry_converting, decide, decide_one_then, expires_at_for, refund, Carried, RuleState,
};
use crate::clock::{Clock, SystemClock};
use crate::decision::Decision;
use crate::error::CapacityError;
use crate::key::{digest, StoredKey, DIGEST_LEN, MAX_INLINE_KEY_LEN};
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
///   also drops the eighth of its entries that cost least to forget. Each entry is ranked
///   by how much of its quota its last check left in use, in four tiers: at most one unit
///   or an eighth used (a one-shot key), at most half, more than half, and at its limit
///   (no unit left, or its last check denied); within a tier, the entry whose state
///   expires soonest (the one nearest to fresh) goes first. A flood of one-shot keys
///   (spoofed addresses) therefore evicts only other one-shot keys: it cannot grow memory
///   past the cap, and it cannot reset a client that is at its limit. To evict such a
///   client an attacker must fill the shards with entries that are themselves at their
///   limit and expire later: about `max_keys` distinct keys, each driven to its own limit
///   (`max_keys × limit` admitted requests) within one period of the client's rule. Keys
///   are spread over shards with a per-process random seed, so no cheaper targeted attack
///   on one shard exists.
/// * **One entry per key.** A key's entry holds one state per rule, named by the rule's
///   identity, and the rule set that wrote it (a shared pointer). A check under other
///   rules (a changed limit, a second rule set on the same key) starts from the states
///   carried over by identity (see [`algo`](crate::algo#changing-rules)), and the
///   entry takes the new rules' states when that check commits, or is denied after a
///   state was converted to a changed limit. A rule set's rules make the entry no
///   larger than before: the memory per key is bounded by the rules of the set that
///   last wrote it.
/// * **Long keys** are held as a 32-byte digest (see [`key`](crate::key)): memory per
///   entry does not grow with the length of the client's key.
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
    /// The held key: the client key, or its digest when [`Meta::is_digest`].
    key: Box<[u8]>,
    /// The rule set `states` were written under (a pointer: the entry stays 72 bytes).
    rules: RuleSet,
    meta: Meta,
    states: SmallVec<[RuleState; 1]>,
}

/// An entry's expiry, eviction tier and key kind in one word (the entry stays 72 bytes).
///
/// Bits 0-55: the time from which the state is equivalent to a fresh one (µs, saturated;
/// 2^56 µs is two thousand years after the epoch). Bit 61: the key is a digest. Bits
/// 62-63: the tier, how close the entry is to its limit (0 to 3). With the key bit
/// cleared, a larger word is an entry that costs more to forget.
#[derive(Clone, Copy)]
struct Meta(u64);

impl Meta {
    const EXPIRY: u64 = (1 << 56) - 1;
    const DIGEST: u64 = 1 << 61;
    const TIER_SHIFT: u32 = 62;
    /// Denying, or no unit left.
    const AT_LIMIT: u8 = 3;

    #[inline]
    fn new(expires_at: u64, tier: u8, digest: bool) -> Self {
        Meta(
            expires_at.min(Self::EXPIRY)
                | (u64::from(tier) << Self::TIER_SHIFT)
                | if digest { Self::DIGEST } else { 0 },
        )
    }

    #[inline]
    fn expires_at(self) -> u64 {
        self.0 & Self::EXPIRY
    }

    #[inline]
    fn is_digest(self) -> bool {
        self.0 & Self::DIGEST != 0
    }

    /// Eviction order: lower ranks go first.
    #[inline]
    fn rank(self) -> u64 {
        self.0 & !Self::DIGEST
    }

    #[inline]
    fn with(self, expires_at: u64, tier: u8) -> Self {
        Self::new(expires_at, tier, self.is_digest())
    }

    #[inline]
    fn with_tier(self, tier: u8) -> Self {
        Self::new(self.expires_at(), tier, self.is_digest())
    }
}

/// How close an admitted check left its rules to their limits: the largest over the rules
/// of 0 (at most one unit or an eighth of the capacity in use), 1 (at most half), 2 (more
/// than half) or [`Meta::AT_LIMIT`] (nothing left). Multiplications only: it runs on every
/// admitted check.
#[inline]
fn tier(rules: &RuleSet, decision: &Decision) -> u8 {
    if let ([rule], [outcome]) = (rules.rules(), decision.rules()) {
        return rule_tier(rule.capacity(), outcome.remaining);
    }
    let mut tier = 0;
    for (rule, outcome) in rules.rules().iter().zip(decision.rules()) {
        tier = tier.max(rule_tier(rule.capacity(), outcome.remaining));
    }
    tier
}

/// One rule's tier, from its capacity and the units its last check left.
#[inline]
fn rule_tier(cap: u64, left: u64) -> u8 {
    // Both at most 2^51: the products cannot overflow.
    if left == 0 {
        Meta::AT_LIMIT
    } else if left + 1 >= cap || left * 8 >= cap * 7 {
        0
    } else if left * 2 >= cap {
        1
    } else {
        2
    }
}

#[derive(Default)]
struct Shard {
    // Boxed entries keep the table's slots at one pointer: a hash table is often only half
    // full right after it grows, and empty slots then cost 8 bytes, not a whole entry.
    table: HashTable<Box<Entry>>,
    blocks: HashMap<HeldKey, u64, foldhash::fast::RandomState>,
    sweep_at: usize,
}

const MIN_SWEEP: usize = 1024;

impl Shard {
    /// The decision for a blocked key, dropping a block that has ended.
    #[cold]
    #[inline(never)]
    fn blocked(&mut self, key: StoredKey<'_>, now: u64) -> Option<Decision> {
        let &until = self.blocks.get(&key)?;
        if until > now {
            let left = (until != u64::MAX).then(|| Duration::from_micros(until - now));
            return Some(Decision::blocked(left));
        }
        self.blocks.remove(&key);
        None
    }

    fn sweep(&mut self, now: u64) {
        self.table.retain(|e| e.meta.expires_at() > now);
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
            let mut ranks: Vec<u64> = self.table.iter().map(|e| e.meta.rank()).collect();
            let evict = (cap / 8).max(1).min(ranks.len());
            let (below, threshold, _) = ranks.select_nth_unstable(evict - 1);
            let threshold = *threshold;
            // Entries sharing the threshold rank are dropped only as far as needed, so
            // a flood of keys seen at the same instant loses an eighth, not all of them.
            let mut ties = evict - below.iter().filter(|&&x| x < threshold).count();
            self.table.retain(|e| {
                let rank = e.meta.rank();
                if rank < threshold {
                    false
                } else if rank == threshold && ties > 0 {
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
    /// Caps the number of tracked keys; at least 1.
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

    /// Number of tracked keys, expired ones included until swept.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().table.len()).sum()
    }

    /// True when nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn locate(&self, held: &[u8]) -> (u64, &Mutex<Shard>) {
        // The held bytes alone: a digest and a short key with the same bytes may share a
        // hash, never an entry (the key's kind is compared too).
        let hash = self.hasher.hash_one(held);
        // The table hashes with the low bits, the shard is picked with the high ones.
        let shard = (hash >> 32) as usize & (self.shards.len() - 1);
        (hash, &self.shards[shard].0)
    }

    /// The synchronous form of [`Store::check`]; never blocks on I/O.
    #[inline]
    pub fn check_now(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, CapacityError> {
        rules.check_cost(cost)?;
        if key.len() <= MAX_INLINE_KEY_LEN {
            self.check_held(key, false, rules, cost)
        } else {
            self.check_long(key, rules, cost)
        }
    }

    /// [`Self::check_now`] for a key held as its digest: out of line, so the common
    /// short-key path stays small.
    #[inline(never)]
    fn check_long(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, CapacityError> {
        self.check_held(&digest(key), true, rules, cost)
    }

    /// A check of the held bytes of a key (the key itself, or its digest when
    /// `is_digest`), passed as a slice and a flag rather than a [`StoredKey`] so the hot
    /// path keeps both in registers. Returns the caller's own type, so the decision is
    /// written once, in place, instead of being copied into an `Ok`.
    #[inline(always)]
    fn check_held(
        &self,
        held: &[u8],
        is_digest: bool,
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, CapacityError> {
        let now = self.clock.now_us();
        let (hash, shard) = self.locate(held);
        let mut shard = shard.lock();
        if !shard.blocks.is_empty() {
            if let Some(decision) = shard.blocked(stored(held, is_digest), now) {
                return Ok(decision);
            }
        }
        let found = shard.table.find_mut(hash, |e| e.holds(held, is_digest));
        if let Some(entry) = found {
            if !entry.rules.same_as(rules) {
                return Ok(Self::check_changed(entry, rules, now, cost));
            }
            if let ([rule], [state]) = (rules.rules(), &mut entry.states[..]) {
                let meta = &mut entry.meta;
                let decision =
                    decide_one_then(rule, state, rules.log_limit(), now, cost, |c, exp, o| {
                        if c {
                            *meta = meta.with(exp, rule_tier(rule.capacity(), o.remaining));
                        } else if !o.allowed {
                            *meta = meta.with_tier(Meta::AT_LIMIT);
                        }
                    });
                return Ok(decision);
            }
            let t = decide(rules, &mut entry.states, now, cost);
            if t.committed {
                entry.meta = entry.meta.with(t.expires_at_us, tier(rules, &t.decision));
            } else if !t.decision.is_allowed() {
                entry.meta = entry.meta.with_tier(Meta::AT_LIMIT);
            }
            return Ok(t.decision);
        }
        Ok(self.insert(&mut shard, held, is_digest, hash, rules, now, cost))
    }

    /// The check of a key whose state was written under other rules: decided on the
    /// states carried over (see [`algo`](crate::algo#changing-rules)), which replace the
    /// entry's when the check commits, or when it is denied after a state was converted
    /// (the converted state depends on the time, so it is kept from the first check on).
    /// Otherwise a denial or a peek leaves the state as the other rules wrote it (as a
    /// store shared with processes on those rules must).
    #[cold]
    #[inline(never)]
    fn check_changed(entry: &mut Entry, rules: &RuleSet, now: u64, cost: u64) -> Decision {
        let Carried {
            mut states,
            converted,
        } = carry_converting(&entry.rules, &entry.states, rules, now);
        let t = decide(rules, &mut states, now, cost);
        if t.committed {
            entry.meta = entry.meta.with(t.expires_at_us, tier(rules, &t.decision));
        } else if converted && cost > 0 {
            // Denied: the states are the carried ones, unchanged by `decide`.
            let expires = expires_at_for(rules, &states);
            entry.meta = entry.meta.with(expires, Meta::AT_LIMIT);
        } else {
            if !t.decision.is_allowed() {
                entry.meta = entry.meta.with_tier(Meta::AT_LIMIT);
            }
            return t.decision;
        }
        entry.states = states;
        entry.rules = rules.clone();
        t.decision
    }

    /// The check of a key without an entry: decided from fresh states, and the entry
    /// created if the check commits.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        shard: &mut Shard,
        held: &[u8],
        is_digest: bool,
        hash: u64,
        rules: &RuleSet,
        now: u64,
        cost: u64,
    ) -> Decision {
        let mut states: SmallVec<[RuleState; 1]> =
            (0..rules.len()).map(|_| RuleState::Fresh).collect();
        let t = decide(rules, &mut states, now, cost);
        if t.committed {
            shard.make_room(self.shard_cap, now);
            let hasher = &self.hasher;
            shard.table.insert_unique(
                hash,
                Box::new(Entry {
                    key: held.into(),
                    rules: rules.clone(),
                    meta: Meta::new(t.expires_at_us, tier(rules, &t.decision), is_digest),
                    states,
                }),
                |e| hasher.hash_one(&*e.key),
            );
        }
        t.decision
    }

    /// The synchronous form of [`Store::refund`]: gives back `cost` units that a check
    /// of `key` under `rules` charged at `charged_at`; nothing when the key's state was
    /// since written under other rules, or has been dropped.
    pub fn refund_now(&self, key: &[u8], rules: &RuleSet, cost: u64, charged_at: u64) -> bool {
        if cost == 0 {
            return false;
        }
        let now = self.clock.now_us();
        let held = StoredKey::new(key);
        let (hash, shard) = self.locate(held.as_bytes());
        let mut shard = shard.lock();
        let found = shard
            .table
            .find_mut(hash, |e| e.holds(held.as_bytes(), held.is_digest()));
        match found {
            Some(entry) if entry.rules.same_as(rules) => {
                refund(rules, &mut entry.states, cost, charged_at, now)
            }
            _ => false,
        }
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
        let held = StoredKey::new(key);
        let (_, shard) = self.locate(held.as_bytes());
        shard.lock().blocks.insert(HeldKey::from(held), until);
    }

    /// The synchronous form of [`Store::unblock`].
    pub fn unblock_now(&self, key: &[u8]) {
        let held = StoredKey::new(key);
        let (_, shard) = self.locate(held.as_bytes());
        shard.lock().blocks.remove(&held);
    }

    /// The synchronous form of [`Store::reset`]: forgets every rule's state of `key`
    /// (whatever `rules`); a block stays.
    pub fn reset_now(&self, key: &[u8], rules: &RuleSet) {
        let _ = rules;
        let held = StoredKey::new(key);
        let (hash, shard) = self.locate(held.as_bytes());
        let mut shard = shard.lock();
        if let Ok(entry) = shard
            .table
            .find_entry(hash, |e| e.holds(held.as_bytes(), held.is_digest()))
        {
            entry.remove();
        }
    }
}

impl Entry {
    /// Whether this is the entry of `key`: the key's kind is compared too, so a short key
    /// equal to some digest is another key.
    #[inline]
    fn holds(&self, held: &[u8], is_digest: bool) -> bool {
        self.meta.is_digest() == is_digest && same_bytes(&self.key, held)
    }
}

/// Whether `a == b`, comparing keys of up to 32 bytes (addresses, most API keys) with two
/// overlapping word loads each instead of a call to `memcmp`.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    fn word<const W: usize>(s: &[u8], at: usize) -> [u8; W] {
        s[at..at + W].try_into().unwrap()
    }
    // Comparing the first and the last W bytes covers every byte when W <= n <= 2W.
    match n {
        16..=32 => {
            word::<16>(a, 0) == word::<16>(b, 0) && word::<16>(a, n - 16) == word::<16>(b, n - 16)
        }
        8..=15 => {
            u64::from_ne_bytes(word(a, 0)) == u64::from_ne_bytes(word(b, 0))
                && u64::from_ne_bytes(word(a, n - 8)) == u64::from_ne_bytes(word(b, n - 8))
        }
        4..=7 => {
            u32::from_ne_bytes(word(a, 0)) == u32::from_ne_bytes(word(b, 0))
                && u32::from_ne_bytes(word(a, n - 4)) == u32::from_ne_bytes(word(b, n - 4))
        }
        _ => a == b,
    }
}

/// A blocked key as the block map owns it.
#[derive(PartialEq, Eq)]
enum HeldKey {
    Inline(Box<[u8]>),
    Digest([u8; DIGEST_LEN]),
}

impl From<StoredKey<'_>> for HeldKey {
    fn from(key: StoredKey<'_>) -> Self {
        match key {
            StoredKey::Inline(bytes) => HeldKey::Inline(bytes.into()),
            StoredKey::Digest(digest) => HeldKey::Digest(digest),
        }
    }
}

/// The [`StoredKey`] of held bytes.
fn stored(held: &[u8], is_digest: bool) -> StoredKey<'_> {
    if is_digest {
        StoredKey::Digest(held.try_into().expect("a digest is DIGEST_LEN bytes"))
    } else {
        StoredKey::Inline(held)
    }
}

impl HeldKey {
    fn as_stored(&self) -> StoredKey<'_> {
        match self {
            HeldKey::Inline(bytes) => StoredKey::Inline(bytes),
            HeldKey::Digest(digest) => StoredKey::Digest(*digest),
        }
    }
}

/// Hashes as the [`StoredKey`] it stands for, so a block is found without allocating.
impl Hash for HeldKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_stored().hash(state);
    }
}

impl Equivalent<HeldKey> for StoredKey<'_> {
    fn equivalent(&self, key: &HeldKey) -> bool {
        *self == key.as_stored()
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

    fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        ready(Ok(self.refund_now(key, rules, cost, charged_at)))
    }

    fn refund_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        Some(Ok(self.refund_now(key, rules, cost, charged_at)))
    }

    fn now_us(&self) -> u64 {
        self.clock.now_us()
    }
}

#[cfg(test)]
mod tests {
    use super::same_bytes;

    #[test]
    fn same_bytes_sees_every_byte_at_every_length() {
        for len in 0..=MAX {
            let a: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37)).collect();
            assert!(same_bytes(&a, &a.clone()), "equal keys of {len} bytes");
            for at in 0..len {
                let mut b = a.clone();
                b[at] ^= 0x80;
                assert!(!same_bytes(&a, &b), "{len} bytes differing at {at}");
            }
            let longer = [a.as_slice(), &[0]].concat();
            assert!(!same_bytes(&a, &longer), "{len} against {} bytes", len + 1);
        }
    }

    const MAX: usize = crate::key::MAX_INLINE_KEY_LEN + 2;

    /// The memory benches and the type's docs count on it.
    #[test]
    fn an_entry_is_72_bytes() {
        assert_eq!(std::mem::size_of::<super::Entry>(), 72);
    }
}
