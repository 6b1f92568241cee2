//! Rate-limiting algorithms as exact, pure state transitions; the rule model; the
//! [`Store`] trait; and [`MemoryStore`], the in-process store for single nodes and tests.
//!
//! Every algorithm is a function `(state, now, rules, cost) -> (decision, state)` in
//! [`algo`], computed with integers only, so that the Redis store's Lua translation makes
//! the very same decisions. A check evaluates several rules on one key atomically: it is
//! admitted only if every rule admits it, and a denied check consumes nothing. A key's
//! state belongs to the key, each rule's to the rule's identity, so rules that change
//! keep every client's usage (see [`algo`](algo#changing-rules)).
//!
//! | algorithm | memory per key | strictness |
//! |---|---|---|
//! | fixed window | 1 counter | up to 2 × limit across a window boundary |
//! | sliding window counter | precision + 1 counters | approximate; finer with precision |
//! | sliding log | `limit` timestamps | exact |
//! | token bucket / GCRA / leaky meter | 2 integers | `burst + rate × t` over any span `t` |
//! | leaky shaper | 2 integers | admits late instead of rejecting (nginx `limit_req`) |
//!
//! ```
//! use ratelimit_core::{ManualClock, MemoryStore, Outcome, RuleSet, Store};
//! use std::time::Duration;
//!
//! # futures::executor::block_on(async {
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::builder().clock(clock.clone()).build();
//! // The multi-rule log from the DomainTools article: 1 per second and 5 per minute.
//! let rules: RuleSet = "1/s sliding-log; 5/min sliding-log".parse().unwrap();
//!
//! for _ in 0..5 {
//!     assert!(store.check(b"user-1", &rules, 1).await.unwrap().is_allowed());
//!     clock.advance(Duration::from_secs(2));
//! }
//! let denied = store.check(b"user-1", &rules, 1).await.unwrap();
//! assert_eq!(denied.outcome(), Outcome::Limited);
//! // The oldest of the five requests leaves the minute window 50 s from now.
//! assert_eq!(denied.retry_after(), Some(Duration::from_secs(50)));
//! # });
//! ```

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod algo;
mod clock;
mod decision;
mod error;
pub mod key;
mod memory;
pub mod packed;
mod rule;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod util;
#[cfg(feature = "tokio")]
mod wait;

pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::{Decision, Outcome, RuleOutcome};
pub use error::{CapacityError, ConfigError};
pub use memory::{MemoryStore, MemoryStoreBuilder, DEFAULT_MAX_KEYS, MEMORY_INLINE_KEY_LEN};
pub use rule::{
    Algorithm, LeakyMode, Rule, RuleSet, DEFAULT_SLOT_TIMEOUT_US, MAX_CONCURRENT,
    MAX_EXACT_PRODUCT, MAX_LOG_LIMIT, MAX_PRECISION, MAX_RULES, MAX_SLOT_TIMEOUT_US,
    MIN_SLOT_TIMEOUT_US,
};
pub use store::Store;
#[cfg(feature = "tokio")]
pub use wait::{StoreExt, WaitError};
