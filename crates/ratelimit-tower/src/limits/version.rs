//! The limits a layer decides with, as built: what a request reads, one version at a time.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use ratelimit_core::util::BoundedLog;

use super::clip::Clip;
use super::spec::Limits;
use crate::error::BuildError;
use crate::fallback::FallbackRules;
use crate::policy::FailurePolicy;
use crate::tier::Tier;

type Index = HashMap<Box<str>, usize, foldhash::fast::RandomState>;

/// How many unknown tier names a version warns about one by one; past them, one line per
/// 10 s for all the others, so that a client sending made-up plan names cannot grow the
/// set nor flood the log.
const UNKNOWN_NAMES: usize = 64;

/// One version of a layer's limits: its tiers with everything derived from their rules
/// (policy fields, fallback rules, metrics), ready for requests.
pub(crate) struct Version {
    pub(crate) tiers: Box<[Tier]>,
    /// Every version has one: [`Settings::version`] refuses limits without it.
    pub(crate) default_tier: usize,
    /// Tier name to index: a request finds its tier in constant time however many tiers
    /// the limits hold.
    index: Index,
    /// The unknown tier names warned about under this version (at most
    /// [`UNKNOWN_NAMES`]). Per version: limits that replace these may add the tier.
    warned: Mutex<HashSet<Box<str>, foldhash::fast::RandomState>>,
    /// The limits this version was built from, as given.
    pub(crate) limits: Limits,
}

/// A request's tier: one of the current limits' tiers, or a customer's own.
#[derive(Clone)]
pub(crate) enum TierRef {
    /// The tier at this position of the version's tiers.
    Index(usize),
    /// A customer's tier (see `Tier::customer`).
    Own(Arc<Tier>),
}

impl TierRef {
    /// The tier, in `version` when it is one of its tiers.
    #[inline]
    pub(crate) fn get<'a>(&'a self, version: &'a Version) -> &'a Tier {
        match self {
            TierRef::Index(i) => &version.tiers[*i],
            TierRef::Own(tier) => tier,
        }
    }
}

impl Version {
    /// The index of the tier `name`; for a name the limits lack, the default tier's,
    /// with a `WARN` the first time this version sees the name (past
    /// [`UNKNOWN_NAMES`] names, at most one per 10 s of `now_us` for all of them).
    pub(crate) fn tier_named(
        &self,
        name: &str,
        log: &BoundedLog,
        now_us: impl FnOnce() -> u64,
    ) -> usize {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        let first = {
            let mut warned = self.warned.lock();
            if warned.contains(name) {
                false
            } else if warned.len() < UNKNOWN_NAMES {
                warned.insert(name.into())
            } else {
                if let Some(count) = log.hit(now_us()) {
                    tracing::warn!(
                        tier = %Clip(name),
                        default_tier = ?&*self.tiers[self.default_tier].name,
                        requests = count,
                        "rate limit: the tier selector chose tiers the limits lack; deciding \
                         them under the default tier (reported at most every 10 s past the \
                         first {UNKNOWN_NAMES} names, with the requests since the last report)"
                    );
                }
                false
            }
        };
        if first {
            tracing::warn!(
                tier = %Clip(name),
                default_tier = ?&*self.tiers[self.default_tier].name,
                "rate limit: the tier selector chose a tier the limits lack; deciding it under \
                 the default tier (reported once per name until the limits change)"
            );
        }
        self.default_tier
    }
}

/// What a layer keeps from one version of its limits to the next.
pub(crate) struct Settings {
    pub(crate) namespace: Box<str>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) fallback: FallbackRules,
    pub(crate) selector_set: bool,
    #[cfg(feature = "metrics")]
    tier_labels: crate::metrics::TierLabels,
    /// Numbers the versions, so that a denial cached under one is not answered under the
    /// next.
    generations: AtomicU64,
}

impl Settings {
    pub(crate) fn new(
        namespace: Box<str>,
        failure_policy: FailurePolicy,
        fallback: FallbackRules,
        selector_set: bool,
        metrics_tier_labels: usize,
    ) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = metrics_tier_labels;
        Self {
            namespace,
            failure_policy,
            fallback,
            selector_set,
            #[cfg(feature = "metrics")]
            tier_labels: crate::metrics::TierLabels::new(metrics_tier_labels),
            generations: AtomicU64::new(0),
        }
    }

    /// Builds `limits` for a layer with these settings, or says what to change.
    pub(crate) fn version(&self, limits: Limits) -> Result<Version, BuildError> {
        limits.validate()?;
        // Named tiers nobody can select would be limits that never apply. A selector with
        // only the tier "" is fine: limits read from a file may add tiers later.
        if !limits.tiers.is_empty() && !self.selector_set {
            return Err(BuildError::TiersWithoutSelector);
        }
        // A request whose tier the limits lack is decided under the default tier, so
        // there must be one: limits without it are refused here, loudly, rather than
        // answering such requests with 500 while they are in force.
        let default_name = match &limits.default_tier {
            Some(name) => name.as_str(),
            None if limits.rules.is_some() => "",
            None => return Err(BuildError::NoDefaultTier),
        };
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        let fallback = self.failure_policy == FailurePolicy::Fallback;
        let tiers = limits
            .all_tiers()
            .map(|(name, rules)| {
                let fallback_rules = if fallback {
                    Some(self.fallback.for_tier(rules)?)
                } else {
                    None
                };
                #[cfg(feature = "metrics")]
                let label = self.tier_labels.label(name);
                #[cfg(not(feature = "metrics"))]
                let label = name;
                let mut tier = Tier::new(
                    &self.namespace,
                    name,
                    label,
                    rules.clone(),
                    self.failure_policy,
                    fallback_rules,
                );
                tier.generation = generation;
                Ok(tier)
            })
            .collect::<Result<Box<[Tier]>, BuildError>>()?;
        let index: Index = tiers
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        // `validate` checked that the default tier is one of the tiers.
        let default_tier = index[default_name];
        Ok(Version {
            tiers,
            default_tier,
            index,
            warned: Mutex::default(),
            limits,
        })
    }
}
