//! The multi-region test rig (multiregion.md §4): three redis-servers as regions, a
//! `LinkProxy` per directed pair of regions, instances in one process, a ledger of every
//! admission on one monotonic clock, and a checker that sweeps every interval.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use ratelimit_core::{Algorithm, LeakyMode, ManualClock, MemoryStore, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, LinkMode, LinkProxy, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_regions::{RegionStats, RegionStore, Regions};

/// Regions in the rig.
pub const R: usize = 3;
/// Instance lease ℓ_i of every region's store.
pub const LEASE_I: Duration = Duration::from_millis(50);
/// Pool lease ℓ_g.
pub const LEASE_G: Duration = Duration::from_millis(250);
/// One-way delay between regions, and its jitter.
pub const DELAY: Duration = Duration::from_millis(30);
pub const JITTER: Duration = Duration::from_millis(10);

/// Seconds per scenario (`RATELIMIT_REGIONS_SECONDS`, default 5).
pub fn seconds() -> f64 {
    std::env::var("RATELIMIT_REGIONS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0)
}

/// The region stores' T_rb: `RATELIMIT_REGIONS_REBALANCE=<ms>`, or `off` (zero: they do
/// not rebalance, for a comparison); `None`: the builder's default (1 s).
pub fn rebalancing() -> Option<Duration> {
    std::env::var("RATELIMIT_REGIONS_REBALANCE")
        .ok()
        .map(|v| match v.as_str() {
            "off" => Duration::ZERO,
            ms => Duration::from_millis(
                ms.parse()
                    .expect("RATELIMIT_REGIONS_REBALANCE: off or milliseconds"),
            ),
        })
}

pub struct Rig {
    pub servers: Vec<RedisServer>,
    /// `links[from][to]`, `None` on the diagonal.
    pub links: Vec<Vec<Option<LinkProxy>>>,
    pub module: bool,
}

impl Rig {
    pub async fn start(module: bool) -> Rig {
        let servers: Vec<RedisServer> = (0..R)
            .map(|_| {
                if module {
                    RedisServer::start_with_module()
                } else {
                    RedisServer::start()
                }
            })
            .collect();
        let mut links = Vec::new();
        for from in 0..R {
            let mut row = Vec::new();
            for (to, server) in servers.iter().enumerate() {
                row.push(if from == to {
                    None
                } else {
                    Some(
                        LinkProxy::start(server.port(), DELAY, JITTER)
                            .await
                            .expect("link proxy"),
                    )
                });
            }
            links.push(row);
        }
        Rig {
            servers,
            links,
            module,
        }
    }

    /// What region `from` dials to reach region `to`'s server.
    pub fn url(&self, from: usize, to: usize) -> String {
        match &self.links[from][to] {
            None => self.servers[to].url(),
            Some(link) => link.url(),
        }
    }

    pub fn link(&self, from: usize, to: usize) -> &LinkProxy {
        self.links[from][to]
            .as_ref()
            .expect("a link between two regions")
    }

    /// Every link into and out of `region` set to `mode`.
    pub fn isolate(&self, region: usize, mode: LinkMode) {
        for other in 0..R {
            if other != region {
                self.link(region, other).set_mode(mode);
                self.link(other, region).set_mode(mode);
            }
        }
    }

    pub fn heal(&self) {
        for row in &self.links {
            for link in row.iter().flatten() {
                link.set_mode(LinkMode::Up);
            }
        }
    }

    /// The region stores: `per_region` instances in each region.
    pub async fn instances(&self, regions: &Regions, per_region: usize) -> Vec<Instance> {
        let mut out = Vec::new();
        for region in 0..R {
            for index in 0..per_region {
                let local = RedisStore::builder()
                    .prefix("mr")
                    .lease(LEASE_I)
                    .timeout(Duration::from_millis(50))
                    .build(&self.servers[region].url())
                    .await
                    .expect("local store");
                wait_connected(&local).await;
                if self.module {
                    assert!(
                        local.uses_module(),
                        "the module path must run on the module"
                    );
                }
                let mut builder = RegionStore::builder(regions.clone())
                    .region(regions.name(region))
                    .local(local);
                for to in 0..R {
                    let link = RedisStore::builder()
                        .prefix("mr")
                        .timeout(Duration::from_millis(200))
                        .connect_timeout(Duration::from_secs(2))
                        .pool_size(1)
                        .build(&self.url(region, to))
                        .await
                        .expect("link store");
                    wait_connected(&link).await;
                    builder = builder.link(regions.name(to), link);
                }
                if let Some(every) = rebalancing() {
                    // Zero: no rebalancing.
                    builder = builder.rebalance_every(every);
                }
                out.push(Instance {
                    region,
                    index,
                    store: builder.build().expect("region store"),
                });
            }
        }
        out
    }
}

pub struct Instance {
    pub region: usize,
    pub index: usize,
    pub store: RegionStore<RedisStore>,
}

/// One admission, times in µs since the run's start on one monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    pub key: u32,
    pub region: u8,
    pub instance: u8,
    pub before: u64,
    pub after: u64,
}

/// What a decision function answers: admitted or not, or an error.
pub type Decide = Arc<dyn Fn(Vec<u8>) -> BoxFuture<'static, Result<bool, String>> + Send + Sync>;

/// The per-instance offered load: requests per second at time `t` (s) in `region`.
pub type Demand = Arc<dyn Fn(f64, usize) -> f64 + Send + Sync>;

/// Which key a request names.
#[derive(Clone)]
pub enum Keys {
    One,
    /// Zipf over `n` keys with exponent `s`.
    Zipf {
        n: usize,
        s: f64,
    },
}

impl Keys {
    fn sampler(&self) -> Vec<f64> {
        match self {
            Keys::One => vec![1.0],
            Keys::Zipf { n, s } => {
                let weights: Vec<f64> = (1..=*n).map(|k| 1.0 / (k as f64).powf(*s)).collect();
                let total: f64 = weights.iter().sum();
                let mut acc = 0.0;
                weights
                    .iter()
                    .map(|w| {
                        acc += w / total;
                        acc
                    })
                    .collect()
            }
        }
    }
}

/// An event at a time in the run.
pub type Event = Box<dyn FnMut(&mut Rig) + Send>;

pub struct Load {
    pub name: &'static str,
    pub rules: RuleSet,
    pub key_prefix: String,
    pub keys: Keys,
    pub demand: Demand,
    /// Instead of a steady stream: this many requests per instance at each window start
    /// (a second on the wall clock).
    pub window_bursts: Option<u32>,
    pub seconds: f64,
}

pub struct Run {
    pub admissions: Vec<Admission>,
    /// (key, time) of every request, for the reference limiter.
    pub requests: Vec<(u32, u64)>,
    pub latencies_us: Vec<u64>,
    pub errors: u64,
    pub t0_wall_us: u64,
    pub decisions: u64,
}

fn wall_us() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

struct Xorshift(u64);
impl Xorshift {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub fn key_name(prefix: &str, key: u32) -> Vec<u8> {
    format!("{prefix}:{key}").into_bytes()
}

/// Drives `load` through `deciders` (one per instance: (region, instance, decide)),
/// running `events` at their times (s) on the rig, and collects the ledger.
pub async fn drive(
    rig: &mut Rig,
    load: &Load,
    deciders: Vec<(usize, usize, Decide)>,
    mut events: Vec<(f64, Event)>,
) -> Run {
    let t0 = Instant::now();
    let t0_wall_us = wall_us();
    let admissions = Arc::new(Mutex::new(Vec::new()));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(0u64));
    let end = Duration::from_secs_f64(load.seconds);
    let cdf = Arc::new(load.keys.sampler());
    let mut drivers = Vec::new();
    for (n, (region, instance, decide)) in deciders.into_iter().enumerate() {
        let admissions = Arc::clone(&admissions);
        let requests = Arc::clone(&requests);
        let latencies = Arc::clone(&latencies);
        let errors = Arc::clone(&errors);
        let demand = Arc::clone(&load.demand);
        let cdf = Arc::clone(&cdf);
        let prefix = load.key_prefix.clone();
        let bursts = load.window_bursts;
        drivers.push(tokio::spawn(async move {
            let mut rng = Xorshift(0x1234_5678_9abc_def1 ^ ((n as u64 + 1) * 0x9e37_79b9));
            let mut tasks = Vec::new();
            let mut next = t0 + Duration::from_micros((n as u64 * 7_919) % 10_000);
            loop {
                let now = Instant::now();
                if now >= t0 + end {
                    break;
                }
                let count = if let Some(k) = bursts {
                    // Sleep to the next wall-clock second.
                    let wall = wall_us();
                    let wait = 1_000_000 - wall % 1_000_000;
                    if now + Duration::from_micros(wait) >= t0 + end {
                        break;
                    }
                    tokio::time::sleep(Duration::from_micros(wait)).await;
                    k
                } else {
                    let rate = demand(now.duration_since(t0).as_secs_f64(), region);
                    if rate <= 0.0 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        next = Instant::now();
                        continue;
                    }
                    next += Duration::from_secs_f64(1.0 / rate);
                    if next > now {
                        tokio::time::sleep_until(next.into()).await;
                    }
                    1
                };
                for _ in 0..count {
                    let u = rng.next_f64();
                    let key = cdf.iter().position(|c| u <= *c).unwrap_or(cdf.len() - 1) as u32;
                    let decide = Arc::clone(&decide);
                    let admissions = Arc::clone(&admissions);
                    let requests = Arc::clone(&requests);
                    let latencies = Arc::clone(&latencies);
                    let errors = Arc::clone(&errors);
                    let name = key_name(&prefix, key);
                    tasks.push(tokio::spawn(async move {
                        let before = Instant::now();
                        let answer = decide(name).await;
                        let after = Instant::now();
                        let b = u64::try_from(before.duration_since(t0).as_micros()).unwrap();
                        let a = u64::try_from(after.duration_since(t0).as_micros()).unwrap();
                        requests.lock().unwrap().push((key, b));
                        latencies.lock().unwrap().push(a - b);
                        match answer {
                            Ok(true) => admissions.lock().unwrap().push(Admission {
                                key,
                                region: region as u8,
                                instance: instance as u8,
                                before: b,
                                after: a,
                            }),
                            Ok(false) => {}
                            Err(_) => *errors.lock().unwrap() += 1,
                        }
                    }));
                }
                tasks.retain(|t| !t.is_finished());
            }
            for t in tasks {
                let _ = t.await;
            }
        }));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (at, mut event) in events {
        let when = t0 + Duration::from_secs_f64(at);
        tokio::time::sleep_until(when.into()).await;
        tokio::task::block_in_place(|| event(rig));
    }
    for d in drivers {
        d.await.expect("driver");
    }
    rig.heal();
    let mut admissions = std::mem::take(&mut *admissions.lock().unwrap());
    admissions.sort_by_key(|a| a.after);
    let mut requests = std::mem::take(&mut *requests.lock().unwrap());
    requests.sort_by_key(|r| r.1);
    let mut latencies_us = std::mem::take(&mut *latencies.lock().unwrap());
    latencies_us.sort_unstable();
    let errors = *errors.lock().unwrap();
    Run {
        decisions: requests.len() as u64,
        admissions,
        requests,
        latencies_us,
        errors,
        t0_wall_us,
    }
}

/// Region stores as deciders.
pub fn region_deciders(instances: &[Instance], rules: &RuleSet) -> Vec<(usize, usize, Decide)> {
    instances
        .iter()
        .map(|i| {
            let store = i.store.clone();
            let rules = rules.clone();
            let decide: Decide = Arc::new(move |key: Vec<u8>| {
                let store = store.clone();
                let rules = rules.clone();
                Box::pin(async move {
                    store
                        .check(&key, &rules, 1)
                        .await
                        .map(|d| d.is_allowed())
                        .map_err(|e| e.to_string())
                })
            });
            (i.region, i.index, decide)
        })
        .collect()
}

/// Negative control: each region limits on its own, the whole limit per region.
pub fn uncoordinated_deciders(
    instances: &[Instance],
    rules: &RuleSet,
) -> Vec<(usize, usize, Decide)> {
    instances
        .iter()
        .map(|i| {
            let store = i.store.clone();
            let rules = rules.clone();
            let decide: Decide = Arc::new(move |key: Vec<u8>| {
                let store = store.clone();
                let rules = rules.clone();
                Box::pin(async move {
                    store
                        .local()
                        .check(&key, &rules, 1)
                        .await
                        .map(|d| d.is_allowed())
                        .map_err(|e| e.to_string())
                })
            });
            (i.region, i.index, decide)
        })
        .collect()
}

/// Negative control: a broken rebalancing. Each instance decides on its region store;
/// when that denies, at most once a second, it first gives its region's share half the
/// smaller share burst back (the local store's give-back, dated now) and only then asks
/// the next region's share for as many, whatever that answers: a recipient that credits
/// before the donor's reply.
pub async fn credit_first_deciders(
    rig: &Rig,
    instances: &[Instance],
    regions: &Regions,
    rules: &RuleSet,
) -> Vec<(usize, usize, Decide)> {
    let shares = regions.split(rules).expect("shares");
    let mut out = Vec::new();
    for i in instances {
        let donor = (i.region + 1) % R;
        let link = RedisStore::builder()
            .prefix("mr")
            .timeout(Duration::from_millis(200))
            .build(&rig.url(i.region, donor))
            .await
            .expect("link store");
        wait_connected(&link).await;
        let link = Arc::new(link);
        let own = shares.base(i.region).expect("a share").clone();
        let theirs = shares.base(donor).expect("a share").clone();
        let burst = |set: &RuleSet| set.rules().iter().map(|r| r.capacity()).min().unwrap();
        let units = (burst(&own).min(burst(&theirs)) / 2).max(1);
        let store = i.store.clone();
        let rules = rules.clone();
        let last: Arc<Mutex<Option<Instant>>> = Arc::default();
        let decide: Decide = Arc::new(move |key: Vec<u8>| {
            let (store, rules, link, last) = (
                store.clone(),
                rules.clone(),
                Arc::clone(&link),
                Arc::clone(&last),
            );
            let (own, theirs) = (own.clone(), theirs.clone());
            Box::pin(async move {
                let d = store
                    .check(&key, &rules, 1)
                    .await
                    .map_err(|e| e.to_string())?;
                if d.is_allowed() {
                    return Ok(true);
                }
                let due = {
                    let mut last = last.lock().unwrap();
                    let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                    if due {
                        *last = Some(Instant::now());
                    }
                    due
                };
                if due {
                    // The region store's key for the key's base share: `b` + key.
                    let base_key = [&b"b"[..], &key].concat();
                    let now = store.local().now_us();
                    let _ = store.local().refund(&base_key, &own, units, now).await;
                    let _ = link.check(&base_key, &theirs, units).await;
                }
                Ok(false)
            })
        });
        out.push((i.region, i.index, decide));
    }
    out
}

/// The bound the checker holds a run to.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// Slack in µs added to every interval: (1−g)·ℓ_i + g·ℓ_g (+ the measurement error).
    pub slack_us: u64,
    /// Units beyond the formula the scenario's faults are stated to add (a region's
    /// store restarted empty: f_r·B).
    pub extra: u64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Verdict {
    pub violations: u64,
    /// The smallest (bound − admitted) over every interval checked, in units.
    pub worst_margin: i64,
}

/// Sweeps every interval of every key's admissions against `rules` (per rule).
pub fn check(run: &Run, rules: &RuleSet, bound: Bound) -> Verdict {
    let eps = run
        .admissions
        .iter()
        .map(|a| a.after - a.before)
        .max()
        .unwrap_or(0)
        + 1_000;
    let mut by_key: HashMap<u32, Vec<Admission>> = HashMap::new();
    for a in &run.admissions {
        by_key.entry(a.key).or_default().push(*a);
    }
    let mut verdict = Verdict {
        violations: 0,
        worst_margin: i64::MAX,
    };
    for list in by_key.values() {
        for rule in rules.rules() {
            let v = match rule.algorithm() {
                Algorithm::Gcra { burst: b }
                | Algorithm::TokenBucket { capacity: b }
                | Algorithm::LeakyBucket(LeakyMode::Meter { capacity: b }) => sweep_rate(
                    list,
                    b + bound.extra,
                    rule.limit(),
                    rule.period_us(),
                    bound.slack_us + eps,
                ),
                Algorithm::FixedWindow => fixed_windows(
                    list,
                    run.t0_wall_us,
                    rule.limit() + bound.extra,
                    rule.period_us(),
                ),
                Algorithm::SlidingLog => sliding(
                    list,
                    rule.limit() + bound.extra,
                    rule.period_us().saturating_sub(eps + 1),
                ),
                Algorithm::SlidingWindow { precision } => sliding(
                    list,
                    rule.limit() + bound.extra,
                    (rule.period_us() - rule.period_us() / precision).saturating_sub(eps + 1),
                ),
                other => panic!("the rig does not check {other:?}"),
            };
            verdict.violations += v.violations;
            verdict.worst_margin = verdict.worst_margin.min(v.worst_margin);
        }
    }
    verdict
}

/// Admissions at after-times t_i..t_j (j−i+1 of them) violate `b + ⌊(t_j − t_i + s)·L/P⌋`
/// iff u_j − u_i > s·L + (b−1)·P with u_k = k·P − t_k·L: one pass with a running
/// minimum of u_i finds every violating end point.
fn sweep_rate(list: &[Admission], b: u64, limit: u64, period: u64, slack: u64) -> Verdict {
    let (p, l) = (i128::from(period), i128::from(limit));
    let threshold = i128::from(slack) * l + (i128::from(b) - 1) * p;
    let mut min_u = i128::MAX;
    let mut min_at = 0usize;
    let mut v = Verdict {
        violations: 0,
        worst_margin: i64::MAX,
    };
    for (k, a) in list.iter().enumerate() {
        let u = k as i128 * p - i128::from(a.after) * l;
        if u < min_u {
            min_u = u;
            min_at = k;
        }
        if u - min_u > threshold {
            v.violations += 1;
        }
        let count = (k - min_at + 1) as i128;
        let dt = i128::from(a.after - list[min_at].after);
        let allowed = i128::from(b) + (dt + i128::from(slack)) * l / p;
        v.worst_margin = v.worst_margin.min((allowed - count) as i64);
    }
    v
}

/// Admissions certainly inside one window (their [before, after] in it) per window.
fn fixed_windows(list: &[Admission], t0_wall: u64, limit: u64, period: u64) -> Verdict {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    for a in list {
        let (w0, w1) = ((t0_wall + a.before) / period, (t0_wall + a.after) / period);
        if w0 == w1 {
            *counts.entry(w0).or_default() += 1;
        }
    }
    let mut v = Verdict {
        violations: 0,
        worst_margin: i64::MAX,
    };
    for c in counts.values() {
        if *c > limit {
            v.violations += 1;
        }
        v.worst_margin = v.worst_margin.min(limit as i64 - *c as i64);
    }
    v
}

/// At most `limit` admissions whose after-times lie within any `span`.
fn sliding(list: &[Admission], limit: u64, span: u64) -> Verdict {
    let mut v = Verdict {
        violations: 0,
        worst_margin: i64::MAX,
    };
    let mut i = 0;
    for j in 0..list.len() {
        while list[j].after - list[i].after > span {
            i += 1;
        }
        let count = (j - i + 1) as u64;
        if count > limit {
            v.violations += 1;
        }
        v.worst_margin = v.worst_margin.min(limit as i64 - count as i64);
    }
    v
}

/// What one exact limiter admits of the same requests: a `MemoryStore` on a manual clock
/// fed the merged stream in time order.
pub async fn reference(run: &Run, rules: &RuleSet, prefix: &str) -> u64 {
    let clock = ManualClock::new(run.t0_wall_us);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let mut admitted = 0;
    for (key, t) in &run.requests {
        clock.set(run.t0_wall_us + t);
        if store
            .check(&key_name(prefix, *key), rules, 1)
            .await
            .unwrap()
            .is_allowed()
        {
            admitted += 1;
        }
    }
    admitted
}

pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub fn total_stats(instances: &[Instance]) -> RegionStats {
    let mut t = RegionStats::default();
    for i in instances {
        let s = i.store.stats();
        t.decisions += s.decisions;
        t.base_admitted += s.base_admitted;
        t.pool_admitted += s.pool_admitted;
        t.denied += s.denied;
        t.reservations += s.reservations;
        t.reservations_failed += s.reservations_failed;
        t.units_reserved += s.units_reserved;
        t.units_refunded += s.units_refunded;
        t.units_refund_failed += s.units_refund_failed;
        t.transfers_asked += s.transfers_asked;
        t.transfers_granted += s.transfers_granted;
        t.transfers_failed += s.transfers_failed;
        t.units_moved += s.units_moved;
        t.units_lost += s.units_lost;
        t.cross_region_calls += s.cross_region_calls;
    }
    t
}

pub fn diff(a: RegionStats, b: RegionStats) -> RegionStats {
    let mut t = RegionStats::default();
    t.decisions = b.decisions - a.decisions;
    t.base_admitted = b.base_admitted - a.base_admitted;
    t.pool_admitted = b.pool_admitted - a.pool_admitted;
    t.denied = b.denied - a.denied;
    t.reservations = b.reservations - a.reservations;
    t.reservations_failed = b.reservations_failed - a.reservations_failed;
    t.units_reserved = b.units_reserved - a.units_reserved;
    t.units_refunded = b.units_refunded - a.units_refunded;
    t.units_refund_failed = b.units_refund_failed - a.units_refund_failed;
    t.transfers_asked = b.transfers_asked - a.transfers_asked;
    t.transfers_granted = b.transfers_granted - a.transfers_granted;
    t.transfers_failed = b.transfers_failed - a.transfers_failed;
    t.units_moved = b.units_moved - a.units_moved;
    t.units_lost = b.units_lost - a.units_lost;
    t.cross_region_calls = b.cross_region_calls - a.cross_region_calls;
    t
}
