//! Redis and Redis Cluster stores for [`ratelimit_core`]: a fleet of app servers sharing
//! limits, one atomic Lua script call per decision.
//!
//! [`RedisStore`] (one server, through a `bb8` pool) and [`RedisClusterStore`] (a
//! cluster, through the `redis` crate's cluster connection) implement the core
//! [`Store`](ratelimit_core::Store) trait and make exactly the decisions
//! [`MemoryStore`](ratelimit_core::MemoryStore) makes: the Lua is an integer translation
//! of [`ratelimit_core::algo::decide`], and the core's conformance suite runs against both.
//!
//! ```no_run
//! use ratelimit_core::{RuleSet, Store};
//! use ratelimit_redis::RedisStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
//! // The DomainTools rules: 1 per second, 20 per minute, 200 per hour, 800 per day.
//! let rules: RuleSet = "1/s sliding-log; 20/min sliding-log; 200/h sliding-log; 800/day sliding-log"
//!     .parse()?;
//! let decision = store.check(b"203.0.113.7", &rules, 1).await?;
//! if !decision.is_allowed() {
//!     println!("429, retry after {:?}", decision.retry_after());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # One round trip per check
//!
//! A check is one `EVALSHA` of `lua/check.lua`, however many rules: the key's block
//! marker and every rule's state are read, decided and written inside the script, all or
//! nothing, so concurrent app servers never admit more than the rules allow. The scripts
//! are loaded when the store is built; when Redis forgets them (`SCRIPT FLUSH`, a restart,
//! a failover) the store resends the body with `EVAL` once and carries on.
//!
//! Work in Redis is O(1) per rule for fixed window, token bucket, leaky bucket and GCRA,
//! O(precision) for the sliding window counter, and a few `LINDEX` for the sliding log
//! (one list per key and rule set, trimmed to the largest sliding-log limit and read by
//! binary search). No sorted sets, no scans.
//!
//! # Time
//!
//! By default time comes from the Redis server's `TIME`, read inside the script: app
//! servers with skewed clocks still agree. [`RedisStoreBuilder::clock`] injects a clock
//! instead (tests, the conformance suite).
//!
//! # Keys and TTLs
//!
//! Keys are `<prefix>:{k<hex>}:b` (block marker), `<prefix>:{k<hex>}:s:<rule set>` (a
//! string: the rules' state as a MessagePack array of integers, written with its expiry
//! in one `SET`) and `<prefix>:{k<hex>}:l:<rule set>` (a list: the sliding log), where
//! `<hex>` is the client key hex-encoded and `<rule set>` is
//! [`RuleSet::fingerprint`](ratelimit_core::RuleSet::fingerprint) in hex. Client keys are
//! data, never syntax: any bytes (braces, colons, CRLF, non-UTF-8, kilobytes) map to
//! distinct printable names that stay behind the prefix, and all keys of one client share
//! one hash tag, hence one Cluster slot.
//!
//! Every key expires when its state becomes equivalent to a fresh one (the core's
//! `expires_at`, rounded up to the millisecond): no cleanup job exists or is needed. Block
//! markers expire with the block; a block without end has no TTL. Under an injected clock,
//! TTLs are relative and never shorter than [`RedisStoreBuilder::ttl_floor`].
//!
//! # Failures
//!
//! Every call is bounded by a timeout (default 50 ms) and fails with a typed
//! [`RedisStoreError`] saying what failed: connection, timeout, script, unexpected reply,
//! wrong type. Nothing panics. A dead pooled connection is replaced on the spot, so the
//! same store recovers when Redis comes back. Whether to fail open or closed is the
//! caller's policy.
//!
//! Requires Redis 6.2 or newer (tested with 7.0).
//!
//! # Features
//!
//! - `testing`: `testing::RedisServer` and `testing::RedisCluster`, throwaway servers
//!   on free ports for tests.

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod cluster;
mod error;
mod keys;
mod options;
mod script;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use cluster::{RedisClusterStore, RedisClusterStoreBuilder};
pub use error::RedisStoreError;
pub use store::{RedisStore, RedisStoreBuilder};

/// Re-exported so a pool can be built for [`RedisStoreBuilder::build_with_pool`] without
/// naming the exact versions.
pub use bb8;
pub use bb8_redis;
pub use redis;
