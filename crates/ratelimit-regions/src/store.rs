//! [`RegionStore`]: the local region's share, plus pool units leased from each key's home.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use ratelimit_core::{Algorithm, Decision, Outcome, RuleOutcome, RuleSet, Store};

use crate::config::{Regions, Shares};
use crate::error::RegionsError;
use crate::pool::{Block, Entry};
use crate::rebalance::Transfer;

/// The most (key, rule set) pools one instance tracks; past it, new keys are decided on
/// their regional share alone (fewer admissions, never more).
pub const MAX_POOLS: usize = 65_536;

/// How often one instance may ask a donor region for units of one key's share, by
/// default (see [`RegionStoreBuilder::rebalance_every`]).
pub const DEFAULT_REBALANCE_EVERY: Duration = Duration::from_secs(1);

/// The first byte of a key's name in a region's store: its base share or its pool.
const BASE_TAG: u8 = b'b';
const POOL_TAG: u8 = b'p';

fn tagged(tag: u8, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 1);
    out.push(tag);
    out.extend_from_slice(key);
    out
}

/// A rule set as this store enforces it: its shares, and what a check may cost of each.
#[derive(Debug)]
struct Split {
    rules: RuleSet,
    shares: Shares,
    /// The most one check can take of the local share (0: no share).
    base_cap: u64,
    /// The most one check can take of the pool (0: no pool).
    pool_cap: u64,
    /// The largest block reserved at once.
    block_cap: u64,
}

/// A store for one region of several: decides every check in the local region, from the
/// region's base share (one call to the region's store, or none under its instance
/// lease) or from pool units this instance reserved ahead of need at the key's home
/// region. See the [crate docs](crate) for the design and its bound.
///
/// `S` is the store type of every region (e.g. `ratelimit_redis::RedisStore`). The
/// builder takes:
///
/// * [`local`](RegionStoreBuilder::local): this region's store, which holds every key's
///   base share here (lease mode welcome: its lease length is the bound's ℓ_i);
/// * [`link`](RegionStoreBuilder::link), once per region (this one included): a store
///   on that region's server, **in exact mode** (no lease) and with a timeout that covers
///   a cross-region round trip. Pool units are reserved and given back through it, and
///   blocks and resets reach every region through it. All stores of one region must
///   share one key prefix.
///
/// Keys are stored as `b` + key (base share) and `p` + key (pool), so a key's share and
/// its pool never meet in one region's store.
#[derive(Debug)]
pub struct RegionStore<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for RegionStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

#[derive(Debug)]
struct Inner<S> {
    regions: Regions,
    region: usize,
    local: S,
    links: Vec<S>,
    lease_us: u64,
    /// T_rb in µs; 0: no rebalancing.
    rebalance_us: u64,
    /// A cross-region call's duration lately (µs on the local clock, a moving average;
    /// 0: none measured yet).
    flight_us: AtomicU64,
    splits: Mutex<HashMap<u64, Vec<Arc<Split>>>>,
    pools: Mutex<HashMap<Vec<u8>, Entry>>,
    transfers: Mutex<HashMap<Vec<u8>, Transfer>>,
    stats: Counters,
}

/// What a [`RegionStore`] did so far (counters since it was built).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionStats {
    /// Checks decided (cost > 0).
    pub decisions: u64,
    /// Admitted by the local region's share.
    pub base_admitted: u64,
    /// Admitted from pool units.
    pub pool_admitted: u64,
    /// Denied (limited or blocked).
    pub denied: u64,
    /// Reservation calls sent (to any home region).
    pub reservations: u64,
    /// Reservation calls that failed (no answer within the link's timeout, an error);
    /// their units, if home charged them, are lost until the algorithm refills them.
    pub reservations_failed: u64,
    /// Units granted by reservations.
    pub units_reserved: u64,
    /// Units given back to home (unspent at a block's expiry, a flush).
    pub units_refunded: u64,
    /// Units whose refund call failed (stranded at home until they drain).
    pub units_refund_failed: u64,
    /// Transfers asked of donor regions (a check of the units on the donor's share).
    pub transfers_asked: u64,
    /// Transfers a donor granted (its share had the units free, and they are now
    /// charged there).
    pub transfers_granted: u64,
    /// Transfers that failed (no answer within the link's timeout, an error); if the
    /// donor charged them, their units are lost until its share refills them.
    pub transfers_failed: u64,
    /// Units given to the local share after a donor granted them (the local store gives
    /// back only what has not drained since the transfer was sent).
    pub units_moved: u64,
    /// Units a donor granted that the local share did not get (the reply came after the
    /// transfer's deadline, or the give-back failed): lost capacity, never extra.
    pub units_lost: u64,
    /// Calls to another region's store (reservations, refunds, transfers, blocks,
    /// resets).
    pub cross_region_calls: u64,
}

#[derive(Debug, Default)]
struct Counters {
    decisions: AtomicU64,
    base_admitted: AtomicU64,
    pool_admitted: AtomicU64,
    denied: AtomicU64,
    reservations: AtomicU64,
    reservations_failed: AtomicU64,
    units_reserved: AtomicU64,
    units_refunded: AtomicU64,
    units_refund_failed: AtomicU64,
    transfers_asked: AtomicU64,
    transfers_granted: AtomicU64,
    transfers_failed: AtomicU64,
    units_moved: AtomicU64,
    units_lost: AtomicU64,
    cross_region_calls: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> RegionStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RegionStats {
            decisions: get(&self.decisions),
            base_admitted: get(&self.base_admitted),
            pool_admitted: get(&self.pool_admitted),
            denied: get(&self.denied),
            reservations: get(&self.reservations),
            reservations_failed: get(&self.reservations_failed),
            units_reserved: get(&self.units_reserved),
            units_refunded: get(&self.units_refunded),
            units_refund_failed: get(&self.units_refund_failed),
            transfers_asked: get(&self.transfers_asked),
            transfers_granted: get(&self.transfers_granted),
            transfers_failed: get(&self.transfers_failed),
            units_moved: get(&self.units_moved),
            units_lost: get(&self.units_lost),
            cross_region_calls: get(&self.cross_region_calls),
        }
    }
}

/// Builds a [`RegionStore`]; see [`RegionStore::builder`].
#[must_use]
pub struct RegionStoreBuilder<S> {
    regions: Regions,
    region: Option<String>,
    local: Option<S>,
    links: Vec<Option<S>>,
    rules: Vec<RuleSet>,
    rebalance_every: Option<Duration>,
}

impl<S> std::fmt::Debug for RegionStoreBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionStoreBuilder")
            .field("regions", &self.regions)
            .field("region", &self.region)
            .field("local", &self.local.is_some())
            .field("links", &self.links.iter().filter(|l| l.is_some()).count())
            .field("rebalance_every", &self.rebalance_every)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RegionStoreBuilder<S> {
    /// The region this instance runs in (a name of the [`Regions`]).
    pub fn region(mut self, name: &str) -> Self {
        self.region = Some(name.to_owned());
        self
    }

    /// This region's store: base shares, decided here.
    pub fn local(mut self, store: S) -> Self {
        self.local = Some(store);
        self
    }

    /// A store on region `name`'s server, in exact mode, with a timeout that covers a
    /// round trip there: pool reservations and refunds for keys homed there, blocks and
    /// resets. Needed for every region, this one included.
    pub fn link(mut self, name: &str, store: S) -> Self {
        if let Some(i) = self.regions.index(name) {
            self.links[i] = Some(store);
        } else {
            // Reported by `build`, which names the regions.
            self.region = Some(format!("\u{0}unknown link {name}"));
        }
        self
    }

    /// Refuses to build unless `rules` can be bounded across the regions (see
    /// [`Regions::split`]): a configuration error at start-up rather than at the first
    /// request. May be given several times.
    pub fn rules(mut self, rules: &RuleSet) -> Self {
        self.rules.push(rules.clone());
        self
    }

    /// How often this instance may ask another region for units of one key's base
    /// share, T_rb (default [`DEFAULT_REBALANCE_EVERY`], 1 s): when the local share
    /// denies a key and the pool holds too little, the instance asks a donor region, in
    /// the background, to charge units of the key to the donor's own share and, only
    /// once the donor granted them, gives as many back to the local share (the
    /// demarcation protocol; see the [crate docs](crate#rebalancing)). Shorter: more
    /// cross-region calls, capacity follows demand faster; the bound is the same.
    /// [`Duration::ZERO`] switches rebalancing off, as
    /// [`no_rebalance`](Self::no_rebalance) does.
    pub fn rebalance_every(mut self, every: Duration) -> Self {
        self.rebalance_every = (!every.is_zero()).then_some(every);
        self
    }

    /// Never rebalances base shares: each region keeps its configured share, and
    /// shifting demand is served by the pool alone.
    pub fn no_rebalance(mut self) -> Self {
        self.rebalance_every = None;
        self
    }

    /// Builds the store. Must run inside a tokio runtime: pool reservations and refunds
    /// run as tasks of their own, and a sweep gives back expired blocks every half pool
    /// lease.
    pub fn build(self) -> Result<RegionStore<S>, RegionsError> {
        let name = self.region.ok_or_else(|| {
            RegionsError::Config("name this instance's region with `.region(name)`".into())
        })?;
        if let Some(link) = name.strip_prefix("\u{0}unknown link ") {
            return Err(RegionsError::Config(format!(
                "`.link({link:?}, ..)` names no region; the regions are {:?}",
                (0..self.regions.len())
                    .map(|i| self.regions.name(i))
                    .collect::<Vec<_>>()
            )));
        }
        let region = self.regions.index(&name).ok_or_else(|| {
            RegionsError::Config(format!("`.region({name:?})` names none of the regions"))
        })?;
        let local = self.local.ok_or_else(|| {
            RegionsError::Config("give this region's store with `.local(store)`".into())
        })?;
        let mut links = Vec::with_capacity(self.links.len());
        for (i, link) in self.links.into_iter().enumerate() {
            links.push(link.ok_or_else(|| {
                RegionsError::Config(format!(
                    "no `.link({:?}, store)`: every region needs one, this one included",
                    self.regions.name(i)
                ))
            })?);
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| RegionsError::Config("build the store inside a tokio runtime".into()))?;
        let lease_us = u64::try_from(self.regions.lease().as_micros()).unwrap_or(u64::MAX / 4);
        let rebalance_us = self.rebalance_every.map_or(0, |every| {
            u64::try_from(every.as_micros())
                .unwrap_or(u64::MAX / 4)
                .max(1)
        });
        let inner = Arc::new(Inner {
            regions: self.regions,
            region,
            local,
            links,
            lease_us,
            rebalance_us,
            flight_us: AtomicU64::new(0),
            splits: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            transfers: Mutex::new(HashMap::new()),
            stats: Counters::default(),
        });
        for rules in &self.rules {
            inner.split(rules)?;
        }
        handle.spawn(sweep(Arc::downgrade(&inner)));
        Ok(RegionStore { inner })
    }
}

impl<S: Store> RegionStore<S> {
    /// A builder for the region store of one instance.
    pub fn builder(regions: Regions) -> RegionStoreBuilder<S> {
        let n = regions.len();
        RegionStoreBuilder {
            regions,
            region: None,
            local: None,
            links: (0..n).map(|_| None).collect(),
            rules: Vec::new(),
            rebalance_every: Some(DEFAULT_REBALANCE_EVERY),
        }
    }

    /// The regions.
    pub fn regions(&self) -> &Regions {
        &self.inner.regions
    }

    /// This instance's region (its index in [`regions`](Self::regions)).
    pub fn region(&self) -> usize {
        self.inner.region
    }

    /// The local region's store.
    pub fn local(&self) -> &S {
        &self.inner.local
    }

    /// What the store did so far.
    pub fn stats(&self) -> RegionStats {
        self.inner.stats.snapshot()
    }

    /// Pool units this instance holds now, over every key.
    pub fn pool_units(&self) -> u64 {
        self.inner.pools.lock().values().map(Entry::live).sum()
    }

    /// Gives back every pool unit this instance holds (before a shutdown, say) and
    /// answers how many units went back.
    pub async fn flush(&self) -> u64 {
        let mut work = Vec::new();
        {
            let mut pools = self.inner.pools.lock();
            for (name, entry) in pools.iter_mut() {
                let mut blocks = Vec::new();
                entry.take_all(&mut blocks);
                if !blocks.is_empty() {
                    work.push((name.clone(), entry.home, entry.pool.clone(), blocks));
                }
            }
        }
        let mut given = 0;
        for (name, home, pool, blocks) in work {
            for block in blocks {
                if self.inner.refund(&name, home, &pool, block).await {
                    given += block.units;
                }
            }
        }
        given
    }
}

/// A pool's name in this instance's table: the rule set's fingerprint, then the key.
fn pool_name(key: &[u8], rules: &RuleSet) -> Vec<u8> {
    let mut name = Vec::with_capacity(key.len() + 8);
    name.extend_from_slice(&rules.fingerprint().to_le_bytes());
    name.extend_from_slice(key);
    name
}

impl<S: Store> Inner<S> {
    /// Runs `op` on every region's store: this region's own, the others' through their
    /// links (a cross-region call each). Every region is tried; the first failure is
    /// answered.
    async fn in_every_region<'a, F, Fut>(&'a self, op: F) -> Result<(), RegionsError>
    where
        F: Fn(&'a S) -> Fut,
        Fut: std::future::Future<Output = Result<(), S::Error>>,
    {
        let mut first = None;
        for r in 0..self.links.len() {
            let store = if r == self.region {
                &self.local
            } else {
                bump(&self.stats.cross_region_calls, 1);
                &self.links[r]
            };
            if let Err(e) = op(store).await {
                first.get_or_insert(RegionsError::store(e));
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn split(&self, rules: &RuleSet) -> Result<Arc<Split>, RegionsError> {
        let fp = rules.fingerprint();
        if let Some(found) = self
            .splits
            .lock()
            .get(&fp)
            .and_then(|v| v.iter().find(|s| s.rules.same_as(rules)))
        {
            return Ok(Arc::clone(found));
        }
        let shares = self.regions.split(rules)?;
        let cap = |set: Option<&RuleSet>| {
            set.map_or(0, |s| {
                s.rules().iter().map(|r| r.capacity()).min().unwrap_or(0)
            })
        };
        let base_cap = cap(shares.base(self.region));
        let pool_cap = cap(shares.pool());
        let split = Arc::new(Split {
            rules: rules.clone(),
            base_cap,
            pool_cap,
            block_cap: (pool_cap / 8).max(1),
            shares,
        });
        let mut splits = self.splits.lock();
        if splits.len() > 4_096 {
            splits.clear();
        }
        splits.entry(fp).or_default().push(Arc::clone(&split));
        Ok(split)
    }

    /// Spends `cost` pool units for `key`, if this instance holds them, and starts a
    /// reservation when the pool runs low. Never waits for another region.
    ///
    /// `asked`: the local share denied the check (what counts as demand on the pool);
    /// otherwise only units already held are spent, so that they are not left to
    /// expire, and nothing is reserved for a key whose share did not deny lately.
    fn take_pool(self: &Arc<Self>, key: &[u8], split: &Arc<Split>, cost: u64, asked: bool) -> bool {
        let now = self.local.now_us();
        let name = pool_name(key, &split.rules);
        let mut expired = Vec::new();
        let (spent, reserve, home) = {
            let mut pools = self.pools.lock();
            let known = pools.contains_key(&name);
            if !known && (!asked || pools.len() >= MAX_POOLS) {
                return false;
            }
            let home = self.regions.home(key);
            let Some(pool) = split.shares.pool() else {
                return false;
            };
            let entry = pools
                .entry(name.clone())
                .or_insert_with(|| Entry::new(home, pool.clone(), now));
            if asked {
                entry.note_demand(cost, now, self.lease_us);
            }
            entry.take_expired(now, &mut expired);
            let spent = entry.spend(cost);
            // A block is what the pool was asked over a lease length lately: about what
            // can be spent before it expires (what is left then drains unused).
            let target = entry
                .demand()
                .clamp(cost.min(split.block_cap).max(1), split.block_cap)
                .min(split.pool_cap);
            let low_water = (target / 2).max(cost);
            let reserve = (!entry.reserving
                && entry.demand() > 0
                && now >= entry.not_before_us
                && entry.live() < low_water)
                .then(|| {
                    entry.reserving = true;
                    target.max(cost)
                });
            (spent, reserve, entry.home)
        };
        for block in expired {
            let this = Arc::clone(self);
            let name = name.clone();
            let split = Arc::clone(split);
            tokio::spawn(async move {
                if let Some(pool) = split.shares.pool() {
                    this.refund(&name, home, pool, block).await;
                }
            });
        }
        if let Some(units) = reserve {
            let this = Arc::clone(self);
            let split = Arc::clone(split);
            let key = key.to_vec();
            tokio::spawn(async move { this.reserve(key, name, split, home, units).await });
        }
        spent
    }

    /// Reserves `units` of `key`'s pool at its home: an ordinary check of that cost on
    /// the pool's rules. The block is spendable until the send time plus ℓ_g (and, with a
    /// fixed window, never past home's window end, converted to the local clock from the
    /// send time), so every unit is spent at most ℓ_g after home charged it.
    async fn reserve(
        self: Arc<Self>,
        key: Vec<u8>,
        name: Vec<u8>,
        split: Arc<Split>,
        home: usize,
        units: u64,
    ) {
        let Some(pool) = split.shares.pool() else {
            return;
        };
        let link = &self.links[home];
        let pool_key = tagged(POOL_TAG, &key);
        let mut units = units;
        // After a refusal: how long until home could grant the whole block.
        let mut short: Option<Duration> = None;
        // Ok(block) or Err(back off for).
        let result: Result<Block, Duration> = loop {
            let send = self.local.now_us();
            let charged_at = link.now_us();
            bump(&self.stats.reservations, 1);
            if home != self.region {
                bump(&self.stats.cross_region_calls, 1);
            }
            let answer = link.check(&pool_key, pool, units).await;
            if home != self.region {
                self.note_flight(send);
            }
            match answer {
                Ok(d) if d.is_allowed() => {
                    let mut expiry = send.saturating_add(self.lease_us);
                    if split.shares.ends_with_window() {
                        for (rule, outcome) in pool.rules().iter().zip(d.rules()) {
                            if rule.algorithm() == Algorithm::FixedWindow {
                                let end = send.saturating_add(
                                    u64::try_from(outcome.reset_after.as_micros())
                                        .unwrap_or(u64::MAX),
                                );
                                expiry = expiry.min(end);
                            }
                        }
                    }
                    bump(&self.stats.units_reserved, units);
                    break Ok(Block {
                        units,
                        expiry_us: expiry,
                        charged_at,
                    });
                }
                Ok(d) if d.outcome() == Outcome::Limited && short.is_none() => {
                    let left = d.rules().iter().map(|r| r.remaining).min().unwrap_or(0);
                    if left >= 1 && left < units {
                        units = left;
                        short = Some(d.retry_after().unwrap_or_default());
                        continue;
                    }
                    break Err(d
                        .retry_after()
                        .unwrap_or(Duration::from_micros(self.lease_us / 4)));
                }
                Ok(d) => {
                    break Err(d
                        .retry_after()
                        .unwrap_or(Duration::from_micros(self.lease_us / 4)))
                }
                Err(e) => {
                    bump(&self.stats.reservations_failed, 1);
                    tracing::debug!(error = %e, home = self.regions.name(home), "pool reservation failed");
                    break Err(Duration::from_micros(self.lease_us / 4));
                }
            }
        };
        let now = self.local.now_us();
        let mut give_back = None;
        {
            let mut pools = self.pools.lock();
            match pools.get_mut(&name) {
                Some(entry) => {
                    entry.reserving = false;
                    if let (Ok(_), Some(wait)) = (&result, short) {
                        // Home is short: ask again when it could grant the whole block,
                        // not at once (a call per unit).
                        let wait = u64::try_from(wait.as_micros())
                            .unwrap_or(u64::MAX)
                            .min(self.lease_us / 4);
                        entry.not_before_us = now.saturating_add(wait);
                    }
                    match result {
                        Ok(block) if now < block.expiry_us => entry.add(block),
                        Ok(block) => give_back = Some(block),
                        Err(wait) => {
                            let wait = u64::try_from(wait.as_micros())
                                .unwrap_or(u64::MAX)
                                .min(self.lease_us);
                            entry.not_before_us = now.saturating_add(wait);
                        }
                    }
                }
                // Reset or swept meanwhile: nothing may spend the block.
                None => give_back = result.ok(),
            }
        }
        if let Some(block) = give_back {
            self.refund(&name, home, pool, block).await;
        }
    }

    /// The local share denied `cost` units of `key`: counts the demand and, at most once
    /// per T_rb and never while one is in flight, starts a rebalancing round in the
    /// background. Never waits for another region.
    fn share_denied(self: &Arc<Self>, key: &[u8], split: &Arc<Split>, cost: u64) {
        if self.rebalance_us == 0 || !split.shares.rebalances() || self.donors(split).is_empty() {
            return;
        }
        let now = self.local.now_us();
        let name = pool_name(key, &split.rules);
        let (want, first) = {
            let mut transfers = self.transfers.lock();
            if !transfers.contains_key(&name) && transfers.len() >= MAX_POOLS {
                return;
            }
            // Instances (and keys) start their rounds at different donors: the clock's
            // microseconds are as good as a random number here.
            let entry = transfers
                .entry(name.clone())
                .or_insert_with(|| Transfer::new(now, (now % 65_536) as usize));
            let Some(want) = entry.note_denied(cost, now, self.rebalance_us) else {
                return;
            };
            let first = entry.next_donor;
            entry.next_donor = entry.next_donor.wrapping_add(1);
            (want, first)
        };
        let this = Arc::clone(self);
        let split = Arc::clone(split);
        let key = key.to_vec();
        tokio::spawn(async move { this.rebalance(key, name, split, want, first).await });
    }

    /// The regions that may give units of `split`'s shares to this one: every other
    /// region with a base share.
    fn donors(&self, split: &Split) -> Vec<usize> {
        if self.region_cap(split, self.region) == 0 {
            return Vec::new();
        }
        (0..self.links.len())
            .filter(|&r| r != self.region && self.region_cap(split, r) > 0)
            .collect()
    }

    /// The most one check can take of region `r`'s share (0: no share).
    fn region_cap(&self, split: &Split, r: usize) -> u64 {
        if r == self.region {
            return split.base_cap;
        }
        split.shares.base(r).map_or(0, |set| {
            set.rules()
                .iter()
                .map(|rule| rule.capacity())
                .min()
                .unwrap_or(0)
        })
    }

    /// One rebalancing round for `key`, in the background; then the next round may come
    /// after T_rb (later after rounds that moved nothing).
    async fn rebalance(
        self: Arc<Self>,
        key: Vec<u8>,
        name: Vec<u8>,
        split: Arc<Split>,
        want: u64,
        first: usize,
    ) {
        let moved = self.round(&key, &split, want, first).await;
        if let Some(t) = self.transfers.lock().get_mut(&name) {
            t.finish(moved);
        }
    }

    /// The demarcation protocol, donor first, for `key`; answers whether units moved.
    ///
    /// 1. Peeks (a check of cost 0, which consumes nothing) at every donor's share of the
    ///    key, at once, and picks the one with the most units free (ties: from `first`).
    /// 2. Asks it for Δ: what the local share was denied (`want`), at most half what
    ///    the donor has free and half the smaller of the two bursts, and no fewer than
    ///    are worth moving. The ask is an ordinary check of Δ on the donor's store, on
    ///    the key's share there (the same key and scaled rules the donor's instances
    ///    decide on): admitted means the donor's share had Δ free and has now spent them;
    ///    refused means nothing moved.
    /// 3. Only after a grant, and only if it came within the transfer's deadline (the
    ///    send time plus ℓ_g on the local clock, and with a fixed window never past the
    ///    donor's window end converted from the send time), gives Δ back to the local
    ///    share with the local store's give-back dated at the send: a bucket or GCRA gets
    ///    back only what has not drained since, a fixed window only within the window of
    ///    the send. A lost reply loses the units.
    async fn round(
        self: &Arc<Self>,
        key: &[u8],
        split: &Arc<Split>,
        want: u64,
        first: usize,
    ) -> bool {
        let donors = self.donors(split);
        let base_key = tagged(BASE_TAG, key);
        let Some(mine) = split.shares.base(self.region) else {
            return false;
        };
        // Fewer than 2 units is not worth three cross-region calls; nor is what drains
        // before the give-back.
        let least = self.worth_moving(mine).max(2);
        if split.base_cap / 2 < least {
            return false;
        }
        let mut peeks = Vec::with_capacity(donors.len());
        for k in 0..donors.len() {
            let donor = donors[first.wrapping_add(k) % donors.len()];
            let (this, split, base_key) = (Arc::clone(self), Arc::clone(split), base_key.clone());
            bump(&self.stats.cross_region_calls, 1);
            peeks.push((
                donor,
                tokio::spawn(async move {
                    let theirs = split.shares.base(donor)?;
                    let send = this.local.now_us();
                    let answer = this.links[donor].check(&base_key, theirs, 0).await;
                    this.note_flight(send);
                    match answer {
                        Ok(d) if d.is_allowed() => d.rules().iter().map(|r| r.remaining).min(),
                        Ok(_) => None,
                        Err(e) => {
                            tracing::debug!(
                                error = %e,
                                donor = this.regions.name(donor),
                                "rebalancing: no answer to a peek"
                            );
                            None
                        }
                    }
                }),
            ));
        }
        let mut best: Option<(usize, u64)> = None;
        for (donor, peek) in peeks {
            if let Ok(Some(free)) = peek.await {
                if best.is_none_or(|(_, most)| free > most) {
                    best = Some((donor, free));
                }
            }
        }
        let Some((donor, free)) = best else {
            return false;
        };
        let Some(theirs) = split.shares.base(donor) else {
            return false;
        };
        // Half what the donor has free (it keeps some for its own demand), half the
        // smaller burst (the local share can hold it); more than the local share refills
        // over a round trip (that much drains before the give-back).
        let cap = (self.region_cap(split, donor).min(split.base_cap) / 2).max(1);
        let units = want.min(free / 2).min(cap);
        if units < least {
            tracing::debug!(
                donor = self.regions.name(donor),
                free,
                least,
                "rebalancing: no donor has enough free"
            );
            return false;
        }
        // Read before the send, so at or before the donor's charge: the deadline and the
        // give-back's date.
        let send = self.local.now_us();
        bump(&self.stats.transfers_asked, 1);
        bump(&self.stats.cross_region_calls, 1);
        let answer = self.links[donor].check(&base_key, theirs, units).await;
        self.note_flight(send);
        match answer {
            Ok(d) if d.is_allowed() => {
                bump(&self.stats.transfers_granted, 1);
                let mut deadline = send.saturating_add(self.lease_us);
                for (rule, outcome) in theirs.rules().iter().zip(d.rules()) {
                    if rule.algorithm() == Algorithm::FixedWindow {
                        let end = send.saturating_add(
                            u64::try_from(outcome.reset_after.as_micros()).unwrap_or(u64::MAX),
                        );
                        deadline = deadline.min(end);
                    }
                }
                self.credit(&base_key, mine, units, send, deadline, donor)
                    .await
            }
            Ok(d) => {
                let free = d.rules().iter().map(|r| r.remaining).min().unwrap_or(0);
                tracing::debug!(
                    donor = self.regions.name(donor),
                    asked = units,
                    free,
                    outcome = ?d.outcome(),
                    "rebalancing: the donor's share refused; nothing moved"
                );
                false
            }
            Err(e) => {
                bump(&self.stats.transfers_failed, 1);
                tracing::debug!(
                    error = %e,
                    donor = self.regions.name(donor),
                    units,
                    "rebalancing: no answer from the donor; its units, if charged, are lost"
                );
                false
            }
        }
    }

    /// Records a cross-region call sent at `send` (local clock) that has just answered.
    fn note_flight(&self, send: u64) {
        let took = self.local.now_us().saturating_sub(send);
        let old = self.flight_us.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { (old * 7 + took) / 8 };
        self.flight_us.store(new.max(1), Ordering::Relaxed);
    }

    /// The fewest units worth moving to a share of `rules`: one more than the share
    /// refills over a cross-region call lately (what drains before a give-back).
    fn worth_moving(&self, rules: &RuleSet) -> u64 {
        let flight = u128::from(self.flight_us.load(Ordering::Relaxed));
        rules
            .rules()
            .iter()
            .map(|r| {
                let drained = flight * u128::from(r.limit()) / u128::from(r.period_us().max(1));
                u64::try_from(drained).unwrap_or(u64::MAX).saturating_add(1)
            })
            .max()
            .unwrap_or(1)
    }

    /// Gives `units` a donor granted back to the local share, if the reply came before
    /// `deadline` (local clock), dated `send` (the local store's clock before the
    /// donor's charge).
    async fn credit(
        &self,
        base_key: &[u8],
        mine: &RuleSet,
        units: u64,
        send: u64,
        deadline: u64,
        donor: usize,
    ) -> bool {
        let now = self.local.now_us();
        if now >= deadline {
            bump(&self.stats.units_lost, units);
            tracing::debug!(
                donor = self.regions.name(donor),
                units,
                late_us = now - deadline,
                "rebalancing: the donor's grant came after the deadline; its units are lost"
            );
            return false;
        }
        match self.local.refund(base_key, mine, units, send).await {
            Ok(true) => {
                bump(&self.stats.units_moved, units);
                tracing::debug!(
                    donor = self.regions.name(donor),
                    units,
                    "rebalancing: units moved from the donor's share to this region's"
                );
                true
            }
            Ok(false) => {
                bump(&self.stats.units_lost, units);
                tracing::debug!(
                    donor = self.regions.name(donor),
                    units,
                    "rebalancing: the local share took nothing back (another window, or rules changed)"
                );
                false
            }
            Err(e) => {
                bump(&self.stats.units_lost, units);
                tracing::debug!(error = %e, units, "rebalancing: the local give-back failed; the units are lost");
                false
            }
        }
    }

    /// Gives `block`'s unspent units back at home; answers whether home took them.
    async fn refund(&self, name: &[u8], home: usize, pool: &RuleSet, block: Block) -> bool {
        // The table's name is the fingerprint, then the key.
        let key = &name[8..];
        if home != self.region {
            bump(&self.stats.cross_region_calls, 1);
        }
        let pool_key = tagged(POOL_TAG, key);
        match self.links[home]
            .refund(&pool_key, pool, block.units, block.charged_at)
            .await
        {
            Ok(_) => {
                bump(&self.stats.units_refunded, block.units);
                true
            }
            Err(e) => {
                bump(&self.stats.units_refund_failed, block.units);
                tracing::debug!(error = %e, "pool refund failed; the units stay charged");
                false
            }
        }
    }

    /// Drops `key`'s pools at this instance (a block, a reset): what they held is not
    /// given back (a reset forgets it at home anyway; a blocked key spends nothing).
    fn forget(&self, key: &[u8]) {
        self.pools.lock().retain(|name, _| &name[8..] != key);
        self.transfers
            .lock()
            .retain(|name, t| t.in_flight || &name[8..] != key);
    }

    /// `outcomes` relabelled with the limits of the rules as configured (not the share's).
    fn relabel(split: &Split, decision: &Decision, pool_left: Option<u64>) -> Decision {
        if decision.outcome() == Outcome::Blocked {
            return decision.clone();
        }
        let outcomes = split
            .rules
            .rules()
            .iter()
            .zip(decision.rules())
            .map(|(rule, o)| {
                let mut o = *o;
                o.limit = rule.limit();
                if let Some(left) = pool_left {
                    o.allowed = true;
                    o.retry_after = None;
                    o.remaining = o.remaining.saturating_add(left);
                }
                o
            });
        Decision::from_rules(outcomes, decision.delay())
    }

    /// A decision from the pool alone (no local share to ask).
    fn pool_only(split: &Split, admitted: bool, left: u64, retry: Duration) -> Decision {
        let outcomes = split.rules.rules().iter().map(|rule| RuleOutcome {
            allowed: admitted,
            limit: rule.limit(),
            remaining: left,
            reset_after: Duration::ZERO,
            retry_after: (!admitted).then_some(retry),
        });
        Decision::from_rules(outcomes, Duration::ZERO)
    }

    fn pool_left(&self, key: &[u8], rules: &RuleSet) -> u64 {
        self.pools
            .lock()
            .get(&pool_name(key, rules))
            .map_or(0, Entry::live)
    }
}

/// Every half pool lease: gives back the blocks that expired and forgets idle pools.
async fn sweep<S: Store>(inner: Weak<Inner<S>>) {
    let period = match inner.upgrade() {
        Some(i) => Duration::from_micros((i.lease_us / 2).max(1_000)),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = inner.local.now_us();
        let mut work = Vec::new();
        {
            let mut pools = inner.pools.lock();
            pools.retain(|name, entry| {
                let mut blocks = Vec::new();
                entry.take_expired(now, &mut blocks);
                if !blocks.is_empty() {
                    work.push((name.clone(), entry.home, entry.pool.clone(), blocks));
                }
                !(entry.is_idle() && now.saturating_sub(entry.last_seen_us) > 2 * inner.lease_us)
            });
        }
        if inner.rebalance_us > 0 {
            let idle = 2 * inner.rebalance_us.max(inner.lease_us);
            inner.transfers.lock().retain(|_, t| !t.is_idle(now, idle));
        }
        for (name, home, pool, blocks) in work {
            for block in blocks {
                let inner = Arc::clone(&inner);
                let name = name.clone();
                let pool = pool.clone();
                tokio::spawn(async move {
                    inner.refund(&name, home, &pool, block).await;
                });
            }
        }
    }
}

impl<S: Store> Store for RegionStore<S> {
    type Error = RegionsError;

    /// Spends pool units this instance holds, if any; else tries the local region's
    /// share (one regional call, or none under its lease), and when that denies, starts
    /// a reservation at the key's home if the pool runs low. Never waits for another region:
    /// a pool that runs low is refilled in the background.
    async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, RegionsError> {
        let inner = &self.inner;
        let split = inner.split(rules)?;
        let base = split.shares.base(inner.region);
        if cost == 0 {
            return match base {
                Some(base) => {
                    let d = inner
                        .local
                        .check(&tagged(BASE_TAG, key), base, 0)
                        .await
                        .map_err(RegionsError::store)?;
                    let left = inner.pool_left(key, rules);
                    let mut d = Inner::<S>::relabel(&split, &d, None);
                    if d.is_allowed() {
                        d = Inner::<S>::relabel(&split, &d, Some(left));
                    }
                    Ok(d)
                }
                None => Ok(Inner::<S>::pool_only(
                    &split,
                    true,
                    inner.pool_left(key, rules),
                    Duration::ZERO,
                )),
            };
        }
        if cost > split.base_cap && cost > split.pool_cap {
            return Err(RegionsError::CostTooLarge {
                cost,
                base: split.base_cap,
                pool: split.pool_cap,
            });
        }
        bump(&inner.stats.decisions, 1);
        // Pool units held are spent first: they expire, the share does not.
        if split.pool_cap >= cost && inner.take_pool(key, &split, cost, false) {
            bump(&inner.stats.pool_admitted, 1);
            let left = inner.pool_left(key, rules);
            return Ok(Inner::<S>::pool_only(&split, true, left, Duration::ZERO));
        }
        let mut denied = None;
        let mut failed = None;
        if let (Some(base), true) = (base, cost <= split.base_cap) {
            match inner.local.check(&tagged(BASE_TAG, key), base, cost).await {
                Ok(d) if d.is_allowed() => {
                    bump(&inner.stats.base_admitted, 1);
                    return Ok(Inner::<S>::relabel(&split, &d, None));
                }
                Ok(d) if d.outcome() == Outcome::Blocked => {
                    bump(&inner.stats.denied, 1);
                    inner.forget(key);
                    return Ok(d);
                }
                Ok(d) => denied = Some(d),
                Err(e) => failed = Some(e),
            }
        }
        if split.pool_cap >= cost && inner.take_pool(key, &split, cost, true) {
            bump(&inner.stats.pool_admitted, 1);
            let left = inner.pool_left(key, rules);
            return Ok(match &denied {
                Some(d) => Inner::<S>::relabel(&split, d, Some(left)),
                None => Inner::<S>::pool_only(&split, true, left, Duration::ZERO),
            });
        }
        if let Some(e) = failed {
            return Err(RegionsError::store(e));
        }
        bump(&inner.stats.denied, 1);
        if denied.is_some() {
            // The share denied and the pool held too little: demand a donor may serve.
            inner.share_denied(key, &split, cost);
        }
        Ok(match denied {
            Some(d) => Inner::<S>::relabel(&split, &d, None),
            None => Inner::<S>::pool_only(
                &split,
                false,
                0,
                Duration::from_micros((inner.lease_us / 4).max(1_000)),
            ),
        })
    }

    /// Blocks the key in every region (this one through its local store, so that its
    /// instance lease drops at once; the others through their links). Every region is
    /// tried; the first failure is answered. A region that cannot be reached gets the
    /// block when it is sent again.
    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), RegionsError> {
        let inner = &self.inner;
        inner.forget(key);
        let base_key = tagged(BASE_TAG, key);
        inner
            .in_every_region(|store| store.block(&base_key, duration))
            .await
    }

    /// Lifts a block in every region, as [`block`](Store::block) places it.
    async fn unblock(&self, key: &[u8]) -> Result<(), RegionsError> {
        let base_key = tagged(BASE_TAG, key);
        self.inner
            .in_every_region(|store| store.unblock(&base_key))
            .await
    }

    /// Forgets the key's usage in every region's share and in its pool at home, and the
    /// pool units this instance holds for it. Every region is tried; the first failure is
    /// answered.
    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), RegionsError> {
        let inner = &self.inner;
        inner.forget(key);
        let base_key = tagged(BASE_TAG, key);
        let shares = inner
            .in_every_region(|store| store.reset(&base_key, rules))
            .await;
        let home = inner.regions.home(key);
        if home != inner.region {
            bump(&inner.stats.cross_region_calls, 1);
        }
        let pool = inner.links[home].reset(&tagged(POOL_TAG, key), rules).await;
        shares.and(pool.map_err(RegionsError::store))
    }

    /// Gives nothing back (answers `false`): a check's units came from the local share
    /// or from the pool, and the store does not remember which, so giving them back to
    /// the share could admit more than the bound. Charging by outcome therefore charges
    /// every request across regions: it limits more, never less.
    async fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Result<bool, RegionsError> {
        let _ = (key, rules, cost, charged_at);
        Ok(false)
    }

    /// An actual cost above the charge is charged as debt to the local region's share
    /// (fewer admissions later, never more); one below it gives nothing back (see
    /// [`refund`](Store::refund)).
    async fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> Result<bool, RegionsError> {
        if actual <= charged {
            return Ok(false);
        }
        let inner = &self.inner;
        let split = inner.split(rules)?;
        let Some(base) = split.shares.base(inner.region) else {
            return Ok(false);
        };
        inner
            .local
            .settle(&tagged(BASE_TAG, key), base, charged, actual, charged_at)
            .await
            .map_err(RegionsError::store)
    }

    /// The local region's store's clock.
    fn now_us(&self) -> u64 {
        self.inner.local.now_us()
    }

    /// When the local region's store last came back after a loss: every check goes there
    /// first, and only its failures reach the caller (a link to another region that
    /// fails costs a transfer, never a decision), so its recovery is the one after
    /// which the tower layer's grace applies.
    fn recovered_at_us(&self) -> u64 {
        self.inner.local.recovered_at_us()
    }

    /// Always: the state lives in the regions' stores.
    fn is_shared(&self) -> bool {
        true
    }
}
