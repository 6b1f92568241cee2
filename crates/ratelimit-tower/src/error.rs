//! Why a layer cannot be built.

use ratelimit_core::ConfigError;

/// A layer that cannot be built, with what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The rules are not valid (none at all, too many, a bad rule).
    #[error(transparent)]
    Rules(#[from] ConfigError),
    /// A namespace that is empty or longer than 255 bytes.
    #[error("namespace {0:?} must be 1 to 255 bytes long")]
    BadNamespace(String),
    /// Two layers built in different places of this process whose implicit namespaces
    /// (derived from where each is built) are the same: their budgets would be one.
    #[error(
        "the layers built at {here} and at {other} derive the same implicit namespace \
         {namespace:?}, so they would share their budgets; name one of them with \
         `RateLimitLayer::builder(store, key).namespace(\"...\")`"
    )]
    ImplicitNamespaceClash {
        /// The namespace both derive.
        namespace: String,
        /// Where the layer refused is built.
        here: String,
        /// Where the layer that derived it first is built.
        other: String,
    },
    /// A tier name that is empty, longer than 64 bytes, or not `[A-Za-z0-9_.-]` (shown cut
    /// to 200 bytes).
    #[error("tier name {0:?} must be 1 to 64 characters of A-Z, a-z, 0-9, `_`, `-`, `.`")]
    BadTierName(String),
    /// The same tier name twice.
    #[error("tier {0:?} is configured twice")]
    DuplicateTier(String),
    /// Tiers without a selector, or a selector without tiers.
    #[error(
        "tiers and `select_tier` go together: add tiers with `.tier(name, rules)` and choose \
         one per request with `.select_tier(|req| ...)`"
    )]
    TiersWithoutSelector,
    /// Tiers chosen by a selector, but no default tier: a request in a tier the limits
    /// lack would have no rules to be decided under.
    #[error(
        "a layer with `select_tier` needs a default tier, for requests in no tier or in a \
         tier the limits lack: add top-level rules (the tier \"\") or name one of the tiers \
         with `default_tier`"
    )]
    NoDefaultTier,
    /// A default tier that is not configured.
    #[error("default tier {0:?} is not one of the configured tiers")]
    UnknownDefaultTier(String),
    /// A status for requests without a key that is not a client error (4xx).
    #[error(
        "the status for requests whose client left out the key must be a client error \
         (4xx), not {0}"
    )]
    OmittedKeyStatus(http::StatusCode),
    /// A fleet share that leaves a rule nothing.
    #[error(
        "rule `{rule}` cannot be shared by {instances} instances: its {field} of {value} \
         divided by {instances} is 0; give the fallback rules of its own with \
         `fallback_rules`, or share among fewer instances"
    )]
    ShareTooSmall {
        /// The rule.
        rule: String,
        /// `limit`, `capacity` or `burst`.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The number of instances.
        instances: u64,
    },
}
