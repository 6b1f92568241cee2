//! The limits a layer decides with, as built: what a request reads, one version at a time.

use std::sync::atomic::{AtomicU64, Ordering};

use super::spec::Limits;
use crate::error::BuildError;
use crate::fallback::FallbackRules;
use crate::policy::FailurePolicy;
use crate::tier::Tier;

/// One version of a layer's limits: its tiers with everything derived from their rules
/// (policy fields, fallback rules, metrics), ready for requests.
pub(crate) struct Version {
    pub(crate) tiers: Box<[Tier]>,
    pub(crate) default_tier: Option<usize>,
    /// The limits this version was built from, as given.
    pub(crate) limits: Limits,
}

/// What a layer keeps from one version of its limits to the next.
pub(crate) struct Settings {
    pub(crate) namespace: Box<str>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) fallback: FallbackRules,
    pub(crate) selector_set: bool,
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
    ) -> Self {
        Self {
            namespace,
            failure_policy,
            fallback,
            selector_set,
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
                let mut tier = Tier::new(
                    &self.namespace,
                    name,
                    rules.clone(),
                    self.failure_policy,
                    fallback_rules,
                );
                tier.generation = generation;
                Ok(tier)
            })
            .collect::<Result<Box<[Tier]>, BuildError>>()?;
        let default_tier = match &limits.default_tier {
            Some(name) => tiers.iter().position(|t| *t.name == **name),
            None => tiers.iter().position(|t| t.name.is_empty()),
        };
        Ok(Version {
            tiers,
            default_tier,
            limits,
        })
    }
}
