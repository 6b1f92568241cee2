//! Rules chosen per request: tiers (plans) and the selector that picks one.

use http::Request;
use ratelimit_core::RuleSet;

#[cfg(feature = "metrics")]
use crate::headers::rule_names;
use crate::headers::Policy;
#[cfg(feature = "metrics")]
use crate::metrics::Metrics;
use crate::namespace::key_prefix;
use crate::policy::FailurePolicy;

/// Picks the tier (plan) a request is decided under, by name; `None` is the layer's
/// default tier. Set with
/// [`select_tier`](crate::RateLimitLayerBuilder::select_tier).
///
/// Implemented for closures `Fn(&Request<B>) -> Option<T>` where `T: AsRef<str>`
/// (`&'static str`, `String`).
pub trait SelectTier<B>: Send + Sync + 'static {
    /// A tier name.
    type Name: AsRef<str>;

    /// The tier of `req`, or `None` for the default tier.
    fn select(&self, req: &Request<B>) -> Option<Self::Name>;
}

impl<B, F, T> SelectTier<B> for F
where
    F: Fn(&Request<B>) -> Option<T> + Send + Sync + 'static,
    T: AsRef<str>,
{
    type Name = T;

    fn select(&self, req: &Request<B>) -> Option<T> {
        self(req)
    }
}

/// Every request is decided under the layer's one tier (the default selector).
#[derive(Debug, Clone, Copy, Default)]
pub struct OneTier;

impl<B> SelectTier<B> for OneTier {
    type Name = &'static str;

    #[inline]
    fn select(&self, _: &Request<B>) -> Option<&'static str> {
        None
    }
}

/// A tier as built: its rules, the fields that describe them, and the bytes that put its
/// budgets apart from every other tier's and layer's in the store.
pub(crate) struct Tier {
    pub(crate) name: Box<str>,
    pub(crate) rules: RuleSet,
    /// The smallest capacity of the rules: a cost up to it fits every rule.
    pub(crate) min_capacity: u64,
    /// The tier's fields, rendered once.
    pub(crate) policy: Policy,
    /// `[len(namespace)] namespace [len(tier)] tier`, prepended to every client key.
    pub(crate) prefix: Box<[u8]>,
    pub(crate) fallback_rules: Option<RuleSet>,
    /// The fields of the fallback rules, rendered once: what a request the fallback store
    /// decides is told.
    pub(crate) fallback_policy: Option<Policy>,
    /// The version of the layer's limits this tier belongs to.
    pub(crate) generation: u64,
    #[cfg(feature = "metrics")]
    pub(crate) metrics: Metrics,
    /// The tier's label in metrics: its name, or `other` past the layer's cap.
    #[cfg(feature = "metrics")]
    metrics_label: Box<str>,
}

impl Tier {
    /// The tier `name`; its metrics labelled `metrics_label` (the name, or `other` past
    /// the layer's cap on tier labels).
    pub(crate) fn new(
        namespace: &str,
        name: &str,
        metrics_label: &str,
        rules: RuleSet,
        failure_policy: FailurePolicy,
        fallback_rules: Option<RuleSet>,
    ) -> Self {
        // The failure policy and the label only label metrics.
        #[cfg(not(feature = "metrics"))]
        let _ = (failure_policy, metrics_label);
        Self {
            name: name.into(),
            policy: Policy::new(&rules, namespace),
            #[cfg(feature = "metrics")]
            metrics: Metrics::new(
                namespace,
                metrics_label,
                &rule_names(&rules),
                failure_policy,
            ),
            #[cfg(feature = "metrics")]
            metrics_label: metrics_label.into(),
            prefix: key_prefix(namespace, name),
            min_capacity: min_capacity(&rules),
            rules,
            fallback_policy: fallback_rules
                .as_ref()
                .map(|rules| Policy::fallback(rules, namespace)),
            fallback_rules,
            generation: 0,
        }
    }

    /// The tier of a customer with rules of its own, in place of this one: the same name
    /// and store keys (so a customer's usage carries when its limits change, and back to
    /// the tier's), its own rules and fields; metric labels name its rules by position,
    /// so that they stay bounded however many customers there are. A store outage falls
    /// back on `fallback_rules` (the customer's share), or on this tier's without them.
    pub(crate) fn customer(
        &self,
        namespace: &str,
        rules: RuleSet,
        failure_policy: FailurePolicy,
        fallback_rules: Option<RuleSet>,
    ) -> Tier {
        let fallback_rules = fallback_rules.or_else(|| self.fallback_rules.clone());
        #[cfg(not(feature = "metrics"))]
        let _ = failure_policy;
        #[cfg(feature = "metrics")]
        let names: Vec<String> = (0..rules.len()).map(|i| format!("customer-{i}")).collect();
        Tier {
            name: self.name.clone(),
            policy: Policy::new(&rules, namespace),
            #[cfg(feature = "metrics")]
            metrics: Metrics::new(namespace, &self.metrics_label, &names, failure_policy),
            #[cfg(feature = "metrics")]
            metrics_label: self.metrics_label.clone(),
            prefix: self.prefix.clone(),
            min_capacity: min_capacity(&rules),
            rules,
            fallback_policy: (fallback_rules.as_ref())
                .map(|rules| Policy::fallback(rules, namespace)),
            fallback_rules,
            generation: self.generation,
        }
    }

    /// The fields of the rules that decided: the fallback rules' when the fallback store
    /// did (and the tier has them), else the tier's.
    #[inline]
    pub(crate) fn policy(&self, by_fallback: bool) -> &Policy {
        match (by_fallback, &self.fallback_policy) {
            (true, Some(policy)) => policy,
            _ => &self.policy,
        }
    }

    /// The rules that decided, as [`Tier::policy`] chooses.
    #[inline]
    pub(crate) fn rules(&self, by_fallback: bool) -> &RuleSet {
        match (by_fallback, &self.fallback_rules) {
            (true, Some(rules)) => rules,
            _ => &self.rules,
        }
    }

    /// The client's part of a store key built by [`Tier::store_key`], for logs: operators
    /// look for the client, not the prefix that sets budgets apart.
    #[inline]
    pub(crate) fn client_key<'k>(&self, store_key: &'k [u8]) -> &'k [u8] {
        store_key.get(self.prefix.len()..).unwrap_or(store_key)
    }

    /// The store key for `client`: the prefix, then the client key's bytes as they are.
    #[inline]
    pub(crate) fn store_key(&self, client: &[u8]) -> StoreKey {
        let mut key = StoreKey::new();
        self.write_store_key(client, &mut key);
        key
    }

    /// Writes the store key for `client` into `key` (empty): two copies when it fits the
    /// key's inline buffer, the common case, rather than `SmallVec`'s capacity checks.
    #[inline]
    pub(crate) fn write_store_key(&self, client: &[u8], key: &mut StoreKey) {
        let (prefix, len) = (self.prefix.len(), self.prefix.len() + client.len());
        if len <= key.inline_size() {
            let mut buf = [0; STORE_KEY_INLINE];
            buf[..prefix].copy_from_slice(&self.prefix);
            buf[prefix..len].copy_from_slice(client);
            *key = StoreKey::from_buf_and_len(buf, len);
        } else {
            key.reserve_exact(len);
            key.extend_from_slice(&self.prefix);
            key.extend_from_slice(client);
        }
    }
}

/// The smallest capacity of `rules`: a cost up to it fits every rule.
fn min_capacity(rules: &RuleSet) -> u64 {
    rules
        .rules()
        .iter()
        .map(|r| r.capacity())
        .min()
        .unwrap_or(0)
}

/// A store key, inline up to the length of any IP key under a namespace of 32 bytes.
pub(crate) type StoreKey = smallvec::SmallVec<[u8; STORE_KEY_INLINE]>;

/// The longest store key held without an allocation.
const STORE_KEY_INLINE: usize = 96;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_keys_are_the_prefix_then_the_client_key_at_every_length() {
        let tier = Tier::new(
            "@0123456789abcdef",
            "",
            "",
            "1/s".parse().unwrap(),
            FailurePolicy::FailOpen,
            None,
        );
        // Both sides of the key's inline buffer, and far past it.
        for len in [0, 1, 9, 76, 77, 78, 95, 96, 97, 1_000] {
            let client: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let key = tier.store_key(&client);
            assert_eq!(key[..tier.prefix.len()], *tier.prefix, "{len}");
            assert_eq!(key[tier.prefix.len()..], client[..], "{len}");
            assert_eq!(tier.client_key(&key), &client[..], "{len}");
        }
    }
}
