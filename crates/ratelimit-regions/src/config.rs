//! The regions, their shares, and how a rule set is divided among them.

use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::util::fnv1a;
use ratelimit_core::{Algorithm, LeakyMode, Rule, RuleSet};

use crate::error::RegionsError;

/// Parts per [`BASIS`]: the pooled fraction and the shares are held in basis points, so
/// that every division is an exact integer one.
pub(crate) const BASIS: u64 = 10_000;

/// The most regions a [`Regions`] holds.
pub const MAX_REGIONS: usize = 64;

/// The default pool lease ℓ_g: how long a block of pool units may be spent after its
/// reservation was sent.
pub const DEFAULT_POOL_LEASE: Duration = Duration::from_secs(2);

/// A function naming a key's home region.
type HomeFn = Arc<dyn Fn(&[u8]) -> usize + Send + Sync>;

/// Where a key's pool lives.
#[derive(Clone)]
enum HomeRule {
    /// FNV-1a of the key, modulo the number of regions.
    Hash,
    /// A function of the key (pinned per tier, per customer, ...).
    Custom(HomeFn),
}

/// The regions one limit is divided among, and how.
///
/// * Each region `r` has a weight `w_r`; its **base share** is
///   `f_r = (1 − g) · w_r / Σ w` of every rule (even by default: weight 1 each).
/// * The **pooled fraction** `g` (default 0.5) of every rule is kept at the key's
///   **home region**; every region leases pool units from there ahead of need. Rule sets
///   with a sliding window or a sliding log pool nothing (`g = 0` for them): their units
///   cannot be leased.
/// * A key's home is FNV-1a of the key modulo the number of regions, unless
///   [`home_by`](Regions::home_by) says otherwise.
/// * The **pool lease** ℓ_g ([`pool_lease`](Regions::pool_lease), default 2 s): a block
///   of pool units is spent at most ℓ_g after its reservation was sent, then what is left
///   goes back.
///
/// Every region's stores must be built from the same `Regions` (same regions in the same
/// order, weights, pooled fraction): the bound assumes the shares add up.
///
/// ```
/// use ratelimit_regions::Regions;
/// use std::time::Duration;
///
/// let regions = Regions::new([("eu", 2), ("us", 1), ("ap", 1)])
///     .unwrap()
///     .pooled(0.5)
///     .unwrap()
///     .pool_lease(Duration::from_millis(500));
/// assert_eq!(regions.index("us"), Some(1));
/// // eu holds half of the base: (1 - 0.5) * 2 / 4 = 25 % of every rule.
/// let shares = regions.split(&"1000/min gcra burst=100".parse().unwrap()).unwrap();
/// assert_eq!(shares.base(0).unwrap().to_string(), "250/1m gcra burst=25");
/// assert_eq!(shares.pool().unwrap().to_string(), "500/1m gcra burst=50");
/// ```
#[derive(Clone)]
pub struct Regions {
    names: Vec<Arc<str>>,
    weights: Vec<u64>,
    pooled_bp: u64,
    pool_lease: Duration,
    home: HomeRule,
}

impl std::fmt::Debug for Regions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Regions")
            .field("names", &self.names)
            .field("weights", &self.weights)
            .field("pooled", &(self.pooled_bp as f64 / BASIS as f64))
            .field("pool_lease", &self.pool_lease)
            .field(
                "home",
                &match self.home {
                    HomeRule::Hash => "hash",
                    HomeRule::Custom(_) => "custom",
                },
            )
            .finish()
    }
}

impl Regions {
    /// Regions by name and weight (their traffic's share, roughly). Weights need not add
    /// up to anything; a weight of 0 gives a region no base share (it lives on the pool).
    pub fn new<N: AsRef<str>>(
        regions: impl IntoIterator<Item = (N, u32)>,
    ) -> Result<Self, RegionsError> {
        let mut names: Vec<Arc<str>> = Vec::new();
        let mut weights = Vec::new();
        for (name, weight) in regions {
            let name = name.as_ref();
            if name.is_empty() || names.iter().any(|n| &**n == name) {
                return Err(RegionsError::Config(format!(
                    "region names must be distinct and not empty (got {name:?} twice or empty)"
                )));
            }
            names.push(name.into());
            weights.push(u64::from(weight));
        }
        if names.is_empty() || names.len() > MAX_REGIONS {
            return Err(RegionsError::Config(format!(
                "give 1 to {MAX_REGIONS} regions (got {})",
                names.len()
            )));
        }
        if weights.iter().all(|w| *w == 0) {
            return Err(RegionsError::Config(
                "at least one region needs a weight above 0".into(),
            ));
        }
        Ok(Self {
            names,
            weights,
            pooled_bp: BASIS / 2,
            pool_lease: DEFAULT_POOL_LEASE,
            home: HomeRule::Hash,
        })
    }

    /// Regions of equal weight.
    pub fn even<N: AsRef<str>>(names: impl IntoIterator<Item = N>) -> Result<Self, RegionsError> {
        Self::new(names.into_iter().map(|n| (n, 1)))
    }

    /// The pooled fraction g, from 0 (pure regional shares, no cross-region call ever) to
    /// 1 (everything leased from the home region), in steps of 0.0001.
    pub fn pooled(mut self, g: f64) -> Result<Self, RegionsError> {
        if !(0.0..=1.0).contains(&g) {
            return Err(RegionsError::Config(format!(
                "the pooled fraction must be between 0 and 1 (got {g})"
            )));
        }
        // In [0, 1] by the check above: the cast neither truncates nor loses the sign.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bp = (g * BASIS as f64).round() as u64;
        self.pooled_bp = bp;
        Ok(self)
    }

    /// The pool lease ℓ_g (default 2 s): a block of pool units is spent at most this long
    /// after its reservation was sent. Longer leases spend fewer cross-region calls and
    /// loosen the bound by `g · ℓ_g / T` units.
    #[must_use]
    pub fn pool_lease(mut self, lease: Duration) -> Self {
        self.pool_lease = lease.max(Duration::from_millis(1));
        self
    }

    /// Names each key's home region (an index below [`len`](Self::len); larger indexes
    /// wrap around), e.g. by tier. Every region must use the same function.
    #[must_use]
    pub fn home_by(mut self, home: impl Fn(&[u8]) -> usize + Send + Sync + 'static) -> Self {
        self.home = HomeRule::Custom(Arc::new(home));
        self
    }

    /// Pins tiers to home regions: a key that `RateLimitLayer` composed for a pinned tier
    /// (its store key is `[len] namespace [len] tier client-key`) is homed in the tier's
    /// region; other keys (other tiers, other callers' keys) by the hash. For a plan whose
    /// customers sit in one region, so that their pool is near them.
    ///
    /// ```
    /// use ratelimit_regions::Regions;
    ///
    /// let regions = Regions::even(["eu", "us"])
    ///     .unwrap()
    ///     .home_by_tier([("enterprise-eu", "eu"), ("enterprise-us", "us")])
    ///     .unwrap();
    /// // What the layer of namespace "api" sends for tier "enterprise-us", client "k-1":
    /// let key = [&[3][..], b"api", &[13], b"enterprise-us", b"k-1"].concat();
    /// assert_eq!(regions.home(&key), 1);
    /// ```
    pub fn home_by_tier<T: AsRef<str>, R: AsRef<str>>(
        self,
        pins: impl IntoIterator<Item = (T, R)>,
    ) -> Result<Self, RegionsError> {
        let mut table: Vec<(Box<[u8]>, usize)> = Vec::new();
        for (tier, region) in pins {
            let (tier, region) = (tier.as_ref(), region.as_ref());
            let index = self.index(region).ok_or_else(|| {
                RegionsError::Config(format!(
                    "tier {tier:?} is pinned to {region:?}, which is none of the regions"
                ))
            })?;
            table.push((tier.as_bytes().into(), index));
        }
        let n = self.names.len() as u64;
        Ok(self.home_by(move |key: &[u8]| {
            let tier = key.first().and_then(|&ns| {
                let at = 1 + usize::from(ns);
                let len = usize::from(*key.get(at)?);
                key.get(at + 1..at + 1 + len)
            });
            tier.and_then(|tier| table.iter().find(|(t, _)| &**t == tier))
                .map_or_else(|| (fnv1a(key) % n) as usize, |(_, region)| *region)
        }))
    }

    /// The number of regions.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Always false: there is at least one region.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The index of the region named `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| &**n == name)
    }

    /// The name of region `index`.
    pub fn name(&self, index: usize) -> &str {
        &self.names[index]
    }

    /// The pooled fraction g, as configured (before rounding rules to whole units).
    pub fn pooled_fraction(&self) -> f64 {
        self.pooled_bp as f64 / BASIS as f64
    }

    /// The pool lease ℓ_g.
    pub fn lease(&self) -> Duration {
        self.pool_lease
    }

    /// Region `index`'s base share f_r of a rule set that pools (`(1 − g) · w_r / Σ w`);
    /// of one that does not (sliding windows and logs), `w_r / Σ w`.
    pub fn share(&self, index: usize, pooled: bool) -> f64 {
        let total: u64 = self.weights.iter().sum();
        let base = if pooled {
            BASIS - self.pooled_bp
        } else {
            BASIS
        };
        (self.weights[index] * base) as f64 / (total * BASIS) as f64
    }

    /// The home region of `key`.
    pub fn home(&self, key: &[u8]) -> usize {
        match &self.home {
            HomeRule::Hash => (fnv1a(key) % self.names.len() as u64) as usize,
            HomeRule::Custom(f) => f(key) % self.names.len(),
        }
    }

    /// Divides `rules` among the regions and the pool, or says why it cannot:
    ///
    /// * GCRA, token bucket, leaky bucket as a meter: limit and burst (capacity) scaled by
    ///   the share, rounded down, the period kept (so the emission interval becomes
    ///   `T / f_r`);
    /// * fixed window: the limit scaled, rounded down;
    /// * sliding window counter, sliding log: the limit scaled; the set pools nothing;
    /// * leaky bucket as a shaper and `N concurrent`: refused (a delay or a slot cannot
    ///   be divided into shares that add up to the whole).
    ///
    /// A region whose share of some rule rounds to 0 units is refused (raise the limit or
    /// the region's weight), unless its weight is 0 (it has no base share). A pool whose
    /// share rounds to 0 is dropped for the set (the regions' shares alone then hold).
    pub fn split(&self, rules: &RuleSet) -> Result<Shares, RegionsError> {
        let mut pools = true;
        for rule in rules.rules() {
            match rule.algorithm() {
                Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog => pools = false,
                Algorithm::LeakyBucket(LeakyMode::Shaper { .. }) => {
                    return Err(RegionsError::Unbounded(format!(
                        "`{rule}`: a shaper admits late rather than refusing, and delays \
                         decided in separate regions cannot be bounded together; use \
                         `gcra` or `leaky-bucket mode=meter` across regions"
                    )))
                }
                Algorithm::Concurrent => {
                    return Err(RegionsError::Unbounded(format!(
                        "`{rule}`: requests in flight cannot be counted across regions \
                         without a cross-region call per request; limit concurrency per \
                         region with a store of its own"
                    )))
                }
                _ => {}
            }
        }
        let pooled_bp = if pools { self.pooled_bp } else { 0 };
        let total: u64 = self.weights.iter().sum();
        let mut base = Vec::with_capacity(self.len());
        for (r, &weight) in self.weights.iter().enumerate() {
            if weight == 0 {
                base.push(None);
                continue;
            }
            // (1 - g) * w_r / Σw, as a fraction num / den.
            let num = u128::from(weight) * u128::from(BASIS - pooled_bp);
            let den = u128::from(total) * u128::from(BASIS);
            if num == 0 {
                base.push(None);
                continue;
            }
            let scaled = scale(rules, num, den).map_err(|(rule, field, value)| {
                RegionsError::Config(format!(
                    "region {:?} gets {} of `{rule}`, which rounds its `{field}` ({value}) to 0: \
                     raise the limit, give the region more weight, or pool less",
                    self.names[r],
                    format_fraction(num, den),
                ))
            })?;
            base.push(Some(scaled));
        }
        let pool = if pooled_bp == 0 {
            None
        } else {
            scale(rules, u128::from(pooled_bp), u128::from(BASIS)).ok()
        };
        Ok(Shares {
            pooled: pool.is_some(),
            rebalances: pools,
            base,
            pool,
            window_end: rules
                .rules()
                .iter()
                .any(|r| r.algorithm() == Algorithm::FixedWindow),
        })
    }
}

fn format_fraction(num: u128, den: u128) -> String {
    format!("{:.4}", num as f64 / den as f64)
}

/// `rules` scaled by `num / den`, or the rule, field and value that round to 0.
fn scale(rules: &RuleSet, num: u128, den: u128) -> Result<RuleSet, (String, &'static str, u64)> {
    let mut out = Vec::with_capacity(rules.len());
    for rule in rules.rules() {
        let part = |value: u64, field: &'static str| {
            // value < 2^51 and num <= den: no overflow, and the result fits u64.
            let p = (u128::from(value) * num / den) as u64;
            if p == 0 {
                Err((rule.to_string(), field, value))
            } else {
                Ok(p)
            }
        };
        let limit = part(rule.limit(), "limit")?;
        let period = rule.period();
        let built = match rule.algorithm() {
            Algorithm::FixedWindow => Rule::fixed_window(limit, period),
            Algorithm::SlidingWindow { precision } => {
                Rule::sliding_window(limit, period, precision)
            }
            Algorithm::SlidingLog => Rule::sliding_log(limit, period),
            Algorithm::TokenBucket { capacity } => {
                Rule::token_bucket(limit, period, part(capacity, "capacity")?)
            }
            Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => {
                Rule::leaky_meter(limit, period, part(capacity, "capacity")?)
            }
            Algorithm::Gcra { burst } => Rule::gcra(limit, period, part(burst, "burst")?),
            // Refused by `split` before scaling.
            Algorithm::LeakyBucket(LeakyMode::Shaper { .. }) | Algorithm::Concurrent => {
                return Err((rule.to_string(), "algorithm", 0))
            }
        };
        // A part of a valid rule is valid: smaller limits and bursts, the same period.
        let built = built.map_err(|_| (rule.to_string(), "limit", rule.limit()))?;
        let built = match rule.name() {
            Some(name) => built
                .named(name)
                .map_err(|_| (rule.to_string(), "name", 0))?,
            None => built,
        };
        out.push(built);
    }
    RuleSet::new(out).map_err(|_| (rules.id().to_owned(), "rules", 0))
}

/// A rule set divided among the regions and the pool: what [`Regions::split`] answers.
#[derive(Debug, Clone)]
pub struct Shares {
    base: Vec<Option<RuleSet>>,
    pool: Option<RuleSet>,
    pooled: bool,
    rebalances: bool,
    window_end: bool,
}

impl Shares {
    /// Region `index`'s base share of the rules, enforced in that region's store; `None`
    /// for a region of weight 0.
    pub fn base(&self, index: usize) -> Option<&RuleSet> {
        self.base[index].as_ref()
    }

    /// The pool's share, enforced at each key's home region; `None` when the set pools
    /// nothing (g = 0, a sliding window or log, or a pool share that rounds to 0).
    pub fn pool(&self) -> Option<&RuleSet> {
        self.pool.as_ref()
    }

    /// Whether the set pools anything.
    pub fn is_pooled(&self) -> bool {
        self.pooled
    }

    /// Whether the regions' shares of the set may be rebalanced (no sliding window or
    /// log: a unit given back to a sub-window or a log is not the unit a donor charged).
    pub fn rebalances(&self) -> bool {
        self.rebalances
    }

    /// Whether a pool block must end with the window (the set has a fixed window).
    pub(crate) fn ends_with_window(&self) -> bool {
        self.window_end
    }
}
