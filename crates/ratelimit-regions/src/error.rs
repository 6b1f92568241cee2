//! What can go wrong.

/// An error of a [`RegionStore`](crate::RegionStore) or of its configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionsError {
    /// The regions or the store are misconfigured; the text says what to change.
    #[error("invalid multi-region configuration: {0}")]
    Config(String),
    /// A rule the store cannot bound across regions; the text says what to use instead.
    #[error("this rule cannot be limited across regions: {0}")]
    Unbounded(String),
    /// A cost above what any region's share and the pool can grant at once.
    #[error(
        "a cost of {cost} is more than a region's share ({base}) or the pool ({pool}) can \
         grant at once; split the request or give it more weight"
    )]
    CostTooLarge {
        /// The cost asked for.
        cost: u64,
        /// The most the local region's share grants at once.
        base: u64,
        /// The most the pool grants at once.
        pool: u64,
    },
    /// The local region's store failed (and the pool held nothing to spend instead).
    #[error("the local region's store failed: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl RegionsError {
    pub(crate) fn store(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Store(Box::new(e))
    }
}
