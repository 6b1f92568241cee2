use std::future::{ready, Future};
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::Duration;

use hashbrown::{Equivalent, HashMap, HashTable};
use parking_lot::Mutex;
use slab::Slab;
use smallvec::{smallvec, SmallVec};

use crate::algo::{
    self, carry_converting, debit, decide, decide_one_then, expires_at_for, refund, Carried,
    RuleState,
};
use crate::clock::{Clock, SystemClock};
use crate::decision::Decision;
use crate::error::CapacityError;
use crate::key::{digest, StoredKey, DIGEST_LEN, MAX_INLINE_KEY_LEN};
use crate::rule::{Algorithm, Rule, RuleSet};
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
/// * **Memory per key.** A shard keeps its entries side by side in one vector, found
///   through a hash table of their 2-byte positions (4 bytes in a shard of more than
///   65,536 keys). An entry is 48 bytes: the state of a one-rule set whose state is two
///   integers (fixed window, token bucket, leaky bucket, GCRA), the rule set that wrote
///   it, a key of up to 23 bytes (an IPv6 address under a short prefix) and one byte of
///   key length, eviction tier and form. A longer key, and the states of several rules
///   or of a sliding window counter or log, are held out of line, so only those pay for
///   them. At the default cap, a flood of one-shot keys under one rule levels off at
///   about 60 bytes per tracked key (`examples/flood.rs`).
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

/// One tracked key: 48 bytes, the whole of what a key of up to [`INLINE`] bytes under a
/// one-rule set of two-word state costs besides its slot in the shard's index.
///
/// A key's expiry is not stored for a packed state: it is computed from the state when
/// a shard sweeps or evicts (once per eighth of a shard's inserts), rather than kept in
/// every entry.
struct Entry {
    /// The state of a one-rule set whose state is two integers (fixed window, token
    /// bucket, GCRA, leaky bucket), as [`pack`] writes it; when [`Tag::SPILLED`], the
    /// index in [`Shard::spills`] of the states held out of line.
    words: [u64; 2],
    /// The rule set the state was written under.
    rules: RuleSet,
    /// The key when it has at most [`INLINE`] bytes; otherwise the index in
    /// [`Shard::long_keys`] of the held bytes, in the first four.
    key: [u8; INLINE],
    tag: Tag,
}

const INLINE: usize = MEMORY_INLINE_KEY_LEN;

/// Keys of up to this many bytes are held in their entry of a [`MemoryStore`], with no
/// allocation of their own: an IPv4 address or an IPv6 /64 network under a short prefix
/// (the tower layer's keys of IPv4 clients under its implicit namespace or a namespace of
/// up to 6 bytes are at most 23 bytes). Longer keys cost an allocation per tracked key.
pub const MEMORY_INLINE_KEY_LEN: usize = 23;

/// An entry's key kind, state form and eviction tier in one byte.
///
/// Bits 0-4: the key's length when inline (0 to [`INLINE`]), else [`Tag::LONG`] or
/// [`Tag::DIGEST`]. Bit 5: [`Tag::SPILLED`]. Bits 6-7: the tier, how close the entry is
/// to its limit (0 to 3).
#[derive(Clone, Copy)]
struct Tag(u8);

impl Tag {
    const KEY: u8 = 0b1_1111;
    /// A key longer than [`INLINE`] bytes, held out of line.
    const LONG: u8 = 30;
    /// The digest of a key longer than [`MAX_INLINE_KEY_LEN`] bytes, held out of line.
    const DIGEST: u8 = 31;
    /// The states are out of line (several rules, or a state that is not two words).
    const SPILLED: u8 = 1 << 5;
    const TIER_SHIFT: u32 = 6;
    /// Denying, or no unit left.
    const AT_LIMIT: u8 = 3;

    #[inline]
    fn key_code(self) -> u8 {
        self.0 & Self::KEY
    }

    #[inline]
    fn is_spilled(self) -> bool {
        self.0 & Self::SPILLED != 0
    }

    #[inline]
    fn tier(self) -> u8 {
        self.0 >> Self::TIER_SHIFT
    }

    #[inline]
    fn with_tier(self, tier: u8) -> Self {
        Tag((self.0 & !(3 << Self::TIER_SHIFT)) | (tier << Self::TIER_SHIFT))
    }

    #[inline]
    fn with_spilled(self, spilled: bool) -> Self {
        Tag((self.0 & !Self::SPILLED) | if spilled { Self::SPILLED } else { 0 })
    }
}

/// States held out of line: those of a set of several rules, or of a rule whose state is
/// not two integers (sliding window counter, sliding log), with their expiry.
struct Spill {
    states: Box<[RuleState]>,
    expires_at: u64,
}

/// A one-rule state as two words, when it is of the kind the rule's algorithm writes
/// (which [`unpack`] restores from the algorithm); `None` for any other (`Fresh`, the
/// sliding window's counts, the log), which is held out of line.
#[inline(always)]
fn pack(rule: &Rule, state: &RuleState) -> Option<[u64; 2]> {
    match (rule.algorithm(), state) {
        (Algorithm::FixedWindow, &RuleState::Window { index, count }) => Some([index, count]),
        (Algorithm::TokenBucket { .. }, &RuleState::Tokens { level, last }) => Some([level, last]),
        (Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_), &RuleState::Tat { us, frac }) => {
            Some([us, frac])
        }
        _ => None,
    }
}

/// The state [`pack`] gave `words` for, under the same rule.
#[inline(always)]
fn unpack(rule: &Rule, [a, b]: [u64; 2]) -> RuleState {
    match rule.algorithm() {
        Algorithm::FixedWindow => RuleState::Window { index: a, count: b },
        Algorithm::TokenBucket { .. } => RuleState::Tokens { level: a, last: b },
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => RuleState::Tat { us: a, frac: b },
        Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog | Algorithm::Concurrent => {
            unreachable!("only two-word states are packed")
        }
    }
}

/// The check of a packed entry, its state restored by `unpack` (the rule's own kind of
/// state, as [`unpack`] gives it): inlined in one arm per algorithm of the hot path.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn decide_packed(
    algorithm: Algorithm,
    entry: &mut Entry,
    spills: &mut Slab<Spill>,
    rules: &RuleSet,
    rule: &Rule,
    now: u64,
    cost: u64,
    unpack: impl FnOnce([u64; 2]) -> RuleState,
) -> Decision {
    let log_limit = rules.log_limit();
    let mut state = unpack(entry.words);
    let tag = &mut entry.tag;
    let capacity = algorithm.capacity(rule.limit());
    let decision = decide_one_then(
        algorithm,
        rule,
        &mut state,
        log_limit,
        now,
        cost,
        |c, _, o| {
            if c {
                *tag = tag.with_tier(rule_tier(capacity, o.remaining));
            } else if !o.allowed {
                *tag = tag.with_tier(Tag::AT_LIMIT);
            }
        },
    );
    // Written back whether or not the check committed (a denial leaves the state as it
    // was): one store, no branch. The rule's own commit writes its own kind of state.
    // Taken by value: a state packed is moved out, not dropped (a call per check).
    match state {
        RuleState::Window { index: a, count: b }
        | RuleState::Tokens { level: a, last: b }
        | RuleState::Tat { us: a, frac: b } => entry.words = [a, b],
        other => {
            let expires = expires_at_for(rules, std::slice::from_ref(&other));
            entry.spill(spills, smallvec![other], expires);
        }
    }
    decision
}

/// Saturation of an expiry in an eviction rank (2^56 µs is two thousand years after
/// the epoch); the tier takes the two bits above.
const RANK_EXPIRY: u64 = (1 << 56) - 1;

/// How close an admitted check left its rules to their limits: the largest over the rules
/// of 0 (at most one unit or an eighth of the capacity in use), 1 (at most half), 2 (more
/// than half) or [`Tag::AT_LIMIT`] (nothing left). Multiplications only: it runs on every
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
        Tag::AT_LIMIT
    } else if left + 1 >= cap || left * 8 >= cap * 7 {
        0
    } else if left * 2 >= cap {
        1
    } else {
        2
    }
}

/// A shard's keys: entries side by side in one vector, found through a table of their
/// positions.
///
/// A hash table is often only half full right after it grows; its slots are 2-byte
/// positions, so empty ones cost 3 bytes (with the table's control byte), not a whole
/// entry, and the entries themselves fill their vector.
struct Shard {
    index: Positions,
    entries: Vec<Entry>,
    long_keys: Slab<Box<[u8]>>,
    spills: Slab<Spill>,
    blocks: HashMap<HeldKey, u64, foldhash::fast::RandomState>,
    sweep_at: usize,
}

/// The positions of a shard's entries, by hash: 2 bytes a slot when the shard holds at
/// most 65,536 keys (the default cap over the default shards), else 4.
enum Positions {
    Narrow(HashTable<u16>),
    Wide(HashTable<u32>),
}

/// An entry's position as a [`Positions`] table holds it.
trait Position: Copy {
    fn get(self) -> usize;
    fn of(at: usize) -> Self;
}

impl Position for u16 {
    #[inline(always)]
    fn get(self) -> usize {
        usize::from(self)
    }
    fn of(at: usize) -> Self {
        u16::try_from(at).expect("a narrow shard holds at most 2^16 keys")
    }
}

impl Position for u32 {
    #[inline(always)]
    fn get(self) -> usize {
        self as usize
    }
    fn of(at: usize) -> Self {
        u32::try_from(at).expect("a shard holds at most 2^32 keys")
    }
}

/// Runs `$body` on the table of either width.
macro_rules! each_width {
    ($positions:expr, $table:ident => $body:expr) => {
        match $positions {
            Positions::Narrow($table) => $body,
            Positions::Wide($table) => $body,
        }
    };
}

impl Positions {
    fn for_cap(cap: usize) -> Self {
        if cap <= usize::from(u16::MAX) + 1 {
            Positions::Narrow(HashTable::new())
        } else {
            Positions::Wide(HashTable::new())
        }
    }

    fn insert(&mut self, hash: u64, at: usize, rehash: impl Fn(usize) -> u64) {
        each_width!(self, t => {
            t.insert_unique(hash, Position::of(at), |&i| rehash(i.get()));
        })
    }

    fn remove(&mut self, hash: u64, at: usize) {
        each_width!(self, t => {
            if let Ok(slot) = t.find_entry(hash, |&i| i.get() == at) {
                slot.remove();
            }
        })
    }

    fn renumber(&mut self, hash: u64, from: usize, to: usize) {
        each_width!(self, t => {
            if let Some(slot) = t.find_mut(hash, |&i| i.get() == from) {
                *slot = Position::of(to);
            }
        })
    }

    /// Drops the positions `moved_to` maps to `None`, renumbers the others.
    fn retain_moved(&mut self, moved_to: &[Option<usize>]) {
        each_width!(self, t => t.retain(|at| match moved_to[at.get()] {
            Some(to) => {
                *at = Position::of(to);
                true
            }
            None => false,
        }))
    }
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

    /// The position of the entry of the held bytes.
    #[inline(always)]
    fn find(&self, hash: u64, held: &[u8], is_digest: bool) -> Option<usize> {
        let (entries, long_keys) = (&self.entries, &self.long_keys);
        // The position the comparison matched, kept in a register: reading it back from
        // the table's slot costs a load and the entry's address once more.
        let mut found = 0;
        let mut holds = |at: usize| {
            found = at;
            entries[at].holds(held, is_digest, long_keys)
        };
        // A match per width rather than `Positions::find`: the comparison stays inlined.
        let hit = match &self.index {
            Positions::Narrow(t) => t.find(hash, |&at| holds(usize::from(at))).is_some(),
            Positions::Wide(t) => t.find(hash, |&at| holds(at as usize)).is_some(),
        };
        hit.then_some(found)
    }

    /// The moment from which the entry's state is equivalent to a fresh one.
    fn expires_at(&self, entry: &Entry) -> u64 {
        if entry.tag.is_spilled() {
            return self.spills[entry.words[0] as usize].expires_at;
        }
        let rule = &entry.rules.rules()[0];
        let state = unpack(rule, entry.words);
        expires_at_for(&entry.rules, std::slice::from_ref(&state))
    }

    /// Eviction order: lower ranks go first.
    fn rank(&self, entry: &Entry) -> u64 {
        self.expires_at(entry).min(RANK_EXPIRY) | u64::from(entry.tag.tier()) << 62
    }

    /// Drops the entries `drop` names (by position), keeping the others in order.
    fn remove_where(&mut self, mut drop: impl FnMut(usize, &Self) -> bool) {
        let doomed: Vec<bool> = (0..self.entries.len()).map(|at| drop(at, self)).collect();
        if !doomed.contains(&true) {
            return;
        }
        let (mut at, mut kept) = (0, 0usize);
        let mut moved_to = Vec::with_capacity(doomed.len());
        let (long_keys, spills) = (&mut self.long_keys, &mut self.spills);
        self.entries.retain(|entry| {
            let gone = doomed[at];
            at += 1;
            if gone {
                entry.free(long_keys, spills);
                moved_to.push(None);
            } else {
                moved_to.push(Some(kept));
                kept += 1;
            }
            !gone
        });
        // Positions change, hashes do not: the table is renumbered, not rebuilt.
        self.index.retain_moved(&moved_to);
    }

    /// Drops the entry at `at`: the last entry takes its place.
    fn remove_at(&mut self, at: usize, hash: u64, hasher: &foldhash::fast::RandomState) {
        self.index.remove(hash, at);
        let entry = self.entries.swap_remove(at);
        entry.free(&mut self.long_keys, &mut self.spills);
        if let Some(moved) = self.entries.get(at) {
            let last = self.entries.len();
            let hash = hasher.hash_one(moved.held(&self.long_keys));
            self.index.renumber(hash, last, at);
        }
    }

    fn sweep(&mut self, now: u64) {
        self.remove_where(|at, shard| shard.expires_at(&shard.entries[at]) <= now);
        self.blocks.retain(|_, until| *until > now);
    }

    /// Makes room for one more entry; see the type's docs for the policy.
    fn make_room(&mut self, cap: usize, now: u64) {
        if self.entries.len() >= self.sweep_at {
            self.sweep(now);
            self.sweep_at = (self.entries.len() * 2).max(MIN_SWEEP);
        }
        if self.entries.len() < cap {
            return;
        }
        self.sweep(now);
        if self.entries.len() > cap - cap / 8 {
            let mut ranks: Vec<u64> = self.entries.iter().map(|e| self.rank(e)).collect();
            let evict = (cap / 8).max(1).min(ranks.len());
            let (below, threshold, _) = ranks.select_nth_unstable(evict - 1);
            let threshold = *threshold;
            // Entries sharing the threshold rank are dropped only as far as needed, so
            // a flood of keys seen at the same instant loses an eighth, not all of them.
            let mut ties = evict - below.iter().filter(|&&x| x < threshold).count();
            self.remove_where(|at, shard| {
                let rank = shard.rank(&shard.entries[at]);
                if rank < threshold {
                    true
                } else if rank == threshold && ties > 0 {
                    ties -= 1;
                    true
                } else {
                    false
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
        let shard_cap = self.max_keys.div_ceil(shards);
        MemoryStore {
            shards: (0..shards)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        index: Positions::for_cap(shard_cap),
                        entries: Vec::new(),
                        long_keys: Slab::new(),
                        spills: Slab::new(),
                        blocks: HashMap::default(),
                        sweep_at: MIN_SWEEP,
                    }))
                })
                .collect(),
            shard_cap,
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
        self.shards.iter().map(|s| s.0.lock().entries.len()).sum()
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
        let Some(at) = shard.find(hash, held, is_digest) else {
            return Ok(self.insert(&mut shard, held, is_digest, hash, rules, now, cost));
        };
        let Shard {
            entries, spills, ..
        } = &mut *shard;
        let entry = &mut entries[at];
        if !entry.rules.same_as(rules) {
            return Ok(Self::check_changed(entry, spills, rules, now, cost));
        }
        if !entry.tag.is_spilled() {
            // Packed: the set has one rule (the one that packed it, since the set is the
            // same), whose state is two words. One arm per algorithm, each with the
            // decision inlined: within an arm the state's kind, the algorithm's step and
            // the rule's capacity are known, so the check dispatches on the rule once
            // rather than four times (unpacking, deciding, the tier, packing back).
            let rule = &rules.rules()[0];
            let a = rule.algorithm();
            let decision = match a {
                Algorithm::Gcra { .. } => {
                    decide_packed(a, entry, spills, rules, rule, now, cost, |[a, b]| {
                        RuleState::Tat { us: a, frac: b }
                    })
                }
                Algorithm::LeakyBucket(_) => {
                    decide_packed(a, entry, spills, rules, rule, now, cost, |[a, b]| {
                        RuleState::Tat { us: a, frac: b }
                    })
                }
                Algorithm::FixedWindow => {
                    decide_packed(a, entry, spills, rules, rule, now, cost, |[a, b]| {
                        RuleState::Window { index: a, count: b }
                    })
                }
                Algorithm::TokenBucket { .. } => {
                    decide_packed(a, entry, spills, rules, rule, now, cost, |[a, b]| {
                        RuleState::Tokens { level: a, last: b }
                    })
                }
                Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog | Algorithm::Concurrent => {
                    unreachable!("only two-word states are packed")
                }
            };
            return Ok(decision);
        }
        let Spill { states, expires_at } = &mut spills[entry.words[0] as usize];
        if let ([rule], [state]) = (rules.rules(), &mut states[..]) {
            let tag = &mut entry.tag;
            let decision = decide_one_then(
                rule.algorithm(),
                rule,
                state,
                rules.log_limit(),
                now,
                cost,
                |c, exp, o| {
                    if c {
                        *expires_at = exp;
                        *tag = tag.with_tier(rule_tier(rule.capacity(), o.remaining));
                    } else if !o.allowed {
                        *tag = tag.with_tier(Tag::AT_LIMIT);
                    }
                },
            );
            return Ok(decision);
        }
        let t = decide(rules, states, now, cost);
        if t.committed {
            *expires_at = t.expires_at_us;
            entry.tag = entry.tag.with_tier(tier(rules, &t.decision));
        } else if !t.decision.is_allowed() {
            entry.tag = entry.tag.with_tier(Tag::AT_LIMIT);
        }
        Ok(t.decision)
    }

    /// The check of a key whose state was written under other rules: decided on the
    /// states carried over (see [`algo`](crate::algo#changing-rules)), which replace the
    /// entry's when the check commits, or when it is denied after a state was converted
    /// (the converted state depends on the time, so it is kept from the first check on).
    /// Otherwise a denial or a peek leaves the state as the other rules wrote it (as a
    /// store shared with processes on those rules must).
    #[cold]
    #[inline(never)]
    fn check_changed(
        entry: &mut Entry,
        spills: &mut Slab<Spill>,
        rules: &RuleSet,
        now: u64,
        cost: u64,
    ) -> Decision {
        let Carried {
            mut states,
            converted,
        } = if entry.tag.is_spilled() {
            let old = &spills[entry.words[0] as usize].states;
            carry_converting(&entry.rules, old, rules, now)
        } else {
            let old = unpack(&entry.rules.rules()[0], entry.words);
            carry_converting(&entry.rules, std::slice::from_ref(&old), rules, now)
        };
        let t = decide(rules, &mut states, now, cost);
        let (expires, tier) = if t.committed {
            (t.expires_at_us, tier(rules, &t.decision))
        } else if converted && cost > 0 {
            // Denied: the states are the carried ones, unchanged by `decide`.
            (expires_at_for(rules, &states), Tag::AT_LIMIT)
        } else {
            if !t.decision.is_allowed() {
                entry.tag = entry.tag.with_tier(Tag::AT_LIMIT);
            }
            return t.decision;
        };
        entry.rules = rules.clone();
        entry.tag = entry.tag.with_tier(tier);
        entry.set_states(spills, states, expires);
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
            let tier = tier(rules, &t.decision);
            let key = (held, is_digest, hash);
            self.add(shard, key, rules, states, t.expires_at_us, tier, now);
        }
        t.decision
    }

    /// Makes room in `shard` and adds the entry of a key it does not hold (`key`: its
    /// held bytes, whether they are a digest, and its hash), its `states` written under
    /// `rules`.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &self,
        shard: &mut Shard,
        (held, is_digest, hash): (&[u8], bool, u64),
        rules: &RuleSet,
        states: SmallVec<[RuleState; 1]>,
        expires_at: u64,
        tier: u8,
        now: u64,
    ) {
        shard.make_room(self.shard_cap, now);
        let Shard {
            index,
            entries,
            long_keys,
            spills,
            ..
        } = shard;
        let key = Entry::hold(held, is_digest, long_keys);
        let mut entry = Entry {
            words: [0; 2],
            rules: rules.clone(),
            key: key.0,
            tag: Tag(key.1).with_tier(tier),
        };
        entry.set_states(spills, states, expires_at);
        let at = entries.len();
        entries.push(entry);
        let hasher = &self.hasher;
        index.insert(hash, at, |i| hasher.hash_one(entries[i].held(long_keys)));
    }

    /// The synchronous form of [`Store::refund`]: gives back `cost` units that a check
    /// of `key` under `rules` charged at `charged_at`; nothing when the key's state was
    /// since written under other rules, or has been dropped.
    pub fn refund_now(&self, key: &[u8], rules: &RuleSet, cost: u64, charged_at: u64) -> bool {
        if cost == 0 {
            return false;
        }
        let now = self.clock.now_us();
        self.with_entry(key, |entry, spills| {
            // A refund only brings the expiry nearer: the one held stays good.
            entry.rules.same_as(rules)
                && entry.edit_states(spills, false, |states| {
                    refund(rules, states, cost, charged_at, now)
                })
        })
    }

    /// The synchronous form of [`Store::settle`]: settles a charge of `charged` units
    /// that a check of `key` under `rules` made at `charged_at` to its `actual` cost,
    /// as [`algo`](crate::algo#settling-a-charge) says: below the charge through
    /// [`Self::refund_now`], above it the excess charged as debt, from fresh states when
    /// the key's entry has been dropped; nothing when the key's state was since written
    /// under other rules. Answers whether any state changed.
    pub fn settle_now(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        match actual.cmp(&charged) {
            std::cmp::Ordering::Less => self.refund_now(key, rules, charged - actual, charged_at),
            std::cmp::Ordering::Equal => false,
            std::cmp::Ordering::Greater => self.debit_now(key, rules, actual - charged),
        }
    }

    /// Charges `units` to `key` under `rules` unconditionally ([`debit`]).
    fn debit_now(&self, key: &[u8], rules: &RuleSet, units: u64) -> bool {
        let now = self.clock.now_us();
        self.charge_unconditionally(key, rules, now, |states| debit(rules, states, units, now))
    }

    /// The synchronous form of [`Store::take_slot`]: takes a slot of `rules`' concurrency
    /// rule for `key` whatever its limit, and charges one unit as debt ([`algo::take`]),
    /// from fresh states when the key's entry has been dropped; `None` when the key's
    /// state was since written under other rules, or `rules` have no concurrency rule.
    pub fn take_slot_now(&self, key: &[u8], rules: &RuleSet) -> Option<u64> {
        rules.concurrent()?;
        let now = self.clock.now_us();
        let mut slot = None;
        self.charge_unconditionally(key, rules, now, |states| {
            slot = algo::take(rules, states, now);
            slot.is_some()
        });
        slot
    }

    /// Runs `charge` (a charge no limit refuses at `now`: debt, a slot taken whatever the
    /// limit) on the states of `key` under `rules`: fresh ones when the store holds
    /// nothing for it (never charged, expired, or evicted), an entry added when it
    /// changed them; nothing when the key's state was since written under other rules.
    /// Answers what `charge` did. A charged key is at its limit, or near it: the last to
    /// forget; its expiry moves on (a debt lasts longer than the charge it adds to).
    fn charge_unconditionally(
        &self,
        key: &[u8],
        rules: &RuleSet,
        now: u64,
        charge: impl FnOnce(&mut [RuleState]) -> bool,
    ) -> bool {
        let held = StoredKey::new(key);
        let (hash, shard) = self.locate(held.as_bytes());
        let mut shard = shard.lock();
        let Some(at) = shard.find(hash, held.as_bytes(), held.is_digest()) else {
            let mut states: SmallVec<[RuleState; 1]> =
                (0..rules.len()).map(|_| RuleState::Fresh).collect();
            if !charge(&mut states) {
                return false;
            }
            let expires = expires_at_for(rules, &states);
            let key = (held.as_bytes(), held.is_digest(), hash);
            self.add(&mut shard, key, rules, states, expires, Tag::AT_LIMIT, now);
            return true;
        };
        let Shard {
            entries, spills, ..
        } = &mut *shard;
        let entry = &mut entries[at];
        if !entry.rules.same_as(rules) {
            return false;
        }
        let changed = entry.edit_states(spills, true, charge);
        if changed {
            entry.tag = entry.tag.with_tier(Tag::AT_LIMIT);
        }
        changed
    }

    /// The synchronous form of [`Store::release`]: frees slot `slot` of `key`, whatever
    /// rules its state was since written under; `false` when it was not held and live.
    pub fn release_now(&self, key: &[u8], slot: u64) -> bool {
        let now = self.clock.now_us();
        self.with_slots(key, |states| algo::release(states, slot, now))
    }

    /// The synchronous form of [`Store::renew`]: moves the deadline of live slot `slot`
    /// of `key` to now plus the timeout of `rules`' concurrency rule.
    pub fn renew_now(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        let Some(at) = rules.concurrent() else {
            return false;
        };
        let timeout = rules.rules()[at].period_us();
        let now = self.clock.now_us();
        self.with_slots(key, |states| algo::renew(states, slot, timeout, now))
    }

    /// Runs `f` on the states of `key` when they may hold slots (held out of line), and
    /// moves the entry's expiry to the states' own afterwards: a renewal pushes it on.
    fn with_slots(&self, key: &[u8], f: impl FnOnce(&mut [RuleState]) -> bool) -> bool {
        self.with_entry(key, |entry, spills| {
            entry.tag.is_spilled() && entry.edit_states(spills, true, f)
        })
    }

    /// Runs `f` on the entry of `key` and the shard's states held out of line, under the
    /// shard's lock; `false` when the store holds nothing for `key`.
    fn with_entry(&self, key: &[u8], f: impl FnOnce(&mut Entry, &mut Slab<Spill>) -> bool) -> bool {
        let held = StoredKey::new(key);
        let (hash, shard) = self.locate(held.as_bytes());
        let mut shard = shard.lock();
        let Some(at) = shard.find(hash, held.as_bytes(), held.is_digest()) else {
            return false;
        };
        let Shard {
            entries, spills, ..
        } = &mut *shard;
        f(&mut entries[at], spills)
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
        if let Some(at) = shard.find(hash, held.as_bytes(), held.is_digest()) {
            shard.remove_at(at, hash, &self.hasher);
        }
    }
}

impl Entry {
    /// The key bytes and tag key code that hold `held`, putting a key too long for the
    /// entry in `long_keys`.
    fn hold(held: &[u8], is_digest: bool, long_keys: &mut Slab<Box<[u8]>>) -> ([u8; INLINE], u8) {
        let mut key = [0; INLINE];
        if !is_digest && held.len() <= INLINE {
            key[..held.len()].copy_from_slice(held);
            // At most INLINE (23): fits the five bits of the key code.
            return (key, held.len() as u8);
        }
        let at = u32::try_from(long_keys.insert(held.into())).expect("fewer than 2^32 keys");
        key[..4].copy_from_slice(&at.to_ne_bytes());
        (key, if is_digest { Tag::DIGEST } else { Tag::LONG })
    }

    /// The index of the out-of-line key.
    #[inline]
    fn long_key(&self) -> usize {
        u32::from_ne_bytes([self.key[0], self.key[1], self.key[2], self.key[3]]) as usize
    }

    /// The held bytes: the key, or its digest.
    fn held<'a>(&'a self, long_keys: &'a Slab<Box<[u8]>>) -> &'a [u8] {
        let code = self.tag.key_code();
        if usize::from(code) <= INLINE {
            &self.key[..usize::from(code)]
        } else {
            &long_keys[self.long_key()]
        }
    }

    /// Whether this is the entry of `key`: the key's kind is compared too, so a short key
    /// equal to some digest is another key.
    #[inline(always)]
    fn holds(&self, held: &[u8], is_digest: bool, long_keys: &Slab<Box<[u8]>>) -> bool {
        let code = self.tag.key_code();
        if usize::from(code) > INLINE {
            return self.holds_long(held, is_digest, long_keys);
        }
        !is_digest && held.len() == usize::from(code) && same_bytes(&self.key[..held.len()], held)
    }

    /// [`Self::holds`] for a key held out of line.
    #[cold]
    #[inline(never)]
    fn holds_long(&self, held: &[u8], is_digest: bool, long_keys: &Slab<Box<[u8]>>) -> bool {
        (self.tag.key_code() == Tag::DIGEST) == is_digest
            && same_bytes(&long_keys[self.long_key()], held)
    }

    /// Writes `states`, written under `self.rules` and expiring at `expires_at`: packed
    /// in the entry when they are one two-word state, else out of line.
    fn set_states(
        &mut self,
        spills: &mut Slab<Spill>,
        states: SmallVec<[RuleState; 1]>,
        expires_at: u64,
    ) {
        if let ([rule], [state]) = (self.rules.rules(), &states[..]) {
            if let Some(words) = pack(rule, state) {
                if self.tag.is_spilled() {
                    spills.remove(self.words[0] as usize);
                    self.tag = self.tag.with_spilled(false);
                }
                self.words = words;
                return;
            }
        }
        self.spill(spills, states, expires_at);
    }

    /// Runs `edit` on the states the entry holds (written under `self.rules`) in place
    /// and keeps them: packed while they still fit, else out of line. With `reexpire`,
    /// states held out of line have their expiry recomputed after a change. Answers what
    /// `edit` answers.
    fn edit_states(
        &mut self,
        spills: &mut Slab<Spill>,
        reexpire: bool,
        edit: impl FnOnce(&mut [RuleState]) -> bool,
    ) -> bool {
        if self.tag.is_spilled() {
            let spill = &mut spills[self.words[0] as usize];
            let changed = edit(&mut spill.states);
            if changed && reexpire {
                spill.expires_at = expires_at_for(&self.rules, &spill.states);
            }
            return changed;
        }
        let rule = &self.rules.rules()[0];
        let mut state = unpack(rule, self.words);
        let changed = edit(std::slice::from_mut(&mut state));
        match pack(rule, &state) {
            Some(words) => self.words = words,
            None => {
                let expires = expires_at_for(&self.rules, std::slice::from_ref(&state));
                self.spill(spills, smallvec![state], expires);
            }
        }
        changed
    }

    /// Holds `states` out of line.
    #[cold]
    fn spill(
        &mut self,
        spills: &mut Slab<Spill>,
        states: SmallVec<[RuleState; 1]>,
        expires_at: u64,
    ) {
        let spill = Spill {
            states: states.into_vec().into_boxed_slice(),
            expires_at,
        };
        if self.tag.is_spilled() {
            spills[self.words[0] as usize] = spill;
        } else {
            self.words = [spills.insert(spill) as u64, 0];
            self.tag = self.tag.with_spilled(true);
        }
    }

    /// Gives back what the entry holds out of line.
    fn free(&self, long_keys: &mut Slab<Box<[u8]>>, spills: &mut Slab<Spill>) {
        if usize::from(self.tag.key_code()) > INLINE {
            long_keys.remove(self.long_key());
        }
        if self.tag.is_spilled() {
            spills.remove(self.words[0] as usize);
        }
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

    fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        ready(Ok(self.settle_now(key, rules, charged, actual, charged_at)))
    }

    fn settle_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        Some(Ok(self.settle_now(key, rules, charged, actual, charged_at)))
    }

    fn release(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = rules;
        ready(Ok(self.release_now(key, slot)))
    }

    fn release_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> Option<Result<bool, Self::Error>> {
        let _ = rules;
        Some(Ok(self.release_now(key, slot)))
    }

    fn renew(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        ready(Ok(self.renew_now(key, rules, slot)))
    }

    fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<Option<u64>, Self::Error>> + Send {
        ready(Ok(self.take_slot_now(key, rules)))
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
    fn an_entry_is_48_bytes() {
        assert_eq!(std::mem::size_of::<super::Entry>(), 48);
    }
}
