//! Limits per customer: a resolver from the client key to its own rules (a database, a
//! config service), its answers cached with a bounded size and a time to live.
//!
//! The hot path reads the cache without a lock ([`moka`]'s concurrent cache); a miss
//! calls the resolver once for every request waiting on that key (concurrent misses
//! share one call, through a map of calls in flight that only a miss touches).
//!
//! Answers expire on the store's clock, passed in by the caller, not on moka's time to
//! live (the wall clock): a test on a manual clock sees a contract change when it moves
//! the clock past the time to live, as production does when the time passes. moka only
//! bounds the number of entries.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{FutureExt, Shared};
use parking_lot::Mutex;
use ratelimit_core::key::{digest, MAX_INLINE_KEY_LEN};
use ratelimit_core::util::BoundedLog;
use ratelimit_core::RuleSet;

use crate::fallback::FallbackRules;
use crate::key::{ClientKey, KeyDigest};
use crate::limits::{Clip, Version};
use crate::policy::FailurePolicy;
use crate::tier::Tier;

/// Customers whose limits a layer caches by default.
pub const DEFAULT_CUSTOMER_CACHE: u64 = 100_000;
/// How long a resolver's answer is used by default.
pub const DEFAULT_CUSTOMER_TTL: Duration = Duration::from_secs(60);

/// A resolver's answer, type-erased: a customer's own rules, `None` for the layer's
/// default limits, or the resolver's error as text.
pub(crate) type Resolved = Result<Option<RuleSet>, String>;
type ResolveFuture = Pin<Box<dyn Future<Output = Resolved> + Send>>;
pub(crate) type Resolver = Arc<dyn Fn(ClientKey) -> ResolveFuture + Send + Sync>;

/// Wraps a user's resolver.
pub(crate) fn resolver<F, Fut, E>(resolve: F) -> Resolver
where
    F: Fn(ClientKey) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<RuleSet>, E>> + Send + 'static,
    E: fmt::Display,
{
    Arc::new(move |key: ClientKey| {
        let answer = resolve(key);
        Box::pin(async move { answer.await.map_err(|e| e.to_string()) })
    })
}

/// The key a customer is cached under: the client key, or its digest when long (a
/// client-controlled key must not make an entry large).
type CacheKey = Box<[u8]>;

fn cache_key(client: &[u8]) -> CacheKey {
    if client.len() <= MAX_INLINE_KEY_LEN {
        client.into()
    } else {
        // A leading byte no short key of this length can collide with: the lengths differ.
        let mut key = Vec::with_capacity(MAX_INLINE_KEY_LEN + 1);
        key.extend_from_slice(&digest(client));
        key.resize(MAX_INLINE_KEY_LEN + 1, 0);
        key.into()
    }
}

/// A customer's rules as the layer uses them: a tier of its own under the selected
/// tier's name (the same store keys, so usage carries when the customer's limits change
/// or go), or `None` for the selected tier's rules.
pub(crate) type Own = Option<Arc<Tier>>;

type InFlight = Shared<Pin<Box<dyn Future<Output = Own> + Send>>>;

/// A cached answer and when it expires, in microseconds on the store's clock.
#[derive(Clone)]
struct Entry {
    own: Own,
    expires_us: u64,
}

/// The layer's customers: the resolver, its cached answers and the calls in flight.
pub(crate) struct Customers {
    resolve: Resolver,
    cache: moka::sync::Cache<(u64, usize, CacheKey), Entry>,
    ttl_us: u64,
    in_flight: Mutex<HashMap<(u64, usize, CacheKey), InFlight>>,
    errors: Arc<BoundedLog>,
    /// How a customer's own rules are shared while the store is down (the layer's
    /// fallback policy); `None` without that policy.
    fallback: Option<FallbackRules>,
    /// Customers' rules without a share, reported apart from the resolver's failures.
    share_errors: BoundedLog,
}

impl fmt::Debug for Customers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Customers")
            .field("cached", &self.cache.entry_count())
            .finish_non_exhaustive()
    }
}

/// What the cache knows of a client.
pub(crate) enum Lookup {
    Known(Own),
    /// Not cached: ask the resolver ([`Customers::resolve`]).
    Unknown,
}

impl Customers {
    pub(crate) fn new(
        resolve: Resolver,
        max_entries: u64,
        ttl: Duration,
        fallback: Option<FallbackRules>,
    ) -> Self {
        Self {
            resolve,
            cache: moka::sync::Cache::builder()
                .max_capacity(max_entries)
                .build(),
            ttl_us: u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX),
            in_flight: Mutex::new(HashMap::new()),
            errors: Arc::new(BoundedLog::new()),
            fallback,
            share_errors: BoundedLog::new(),
        }
    }

    /// The fallback rules of a customer's own `rules`: its share, as the tier's are the
    /// tier's. `None` (the tier's then apply) without the fallback policy, or when the
    /// share cannot be made (said in a WARN).
    fn fallback_of(&self, rules: &RuleSet, client: &str, now_us: u64) -> Option<RuleSet> {
        match self.fallback.as_ref()?.for_customer(rules) {
            Ok(rules) => Some(rules),
            Err(error) => {
                if let Some(count) = self.share_errors.hit(now_us) {
                    tracing::warn!(
                        key = %client,
                        error = %error,
                        requests = count,
                        "rate limit: a customer's own rules have no share for the fallback \
                         store; the tier's fallback rules apply to it while the store is \
                         down (reported at most every 10 s)"
                    );
                }
                None
            }
        }
    }

    /// The cached answer for `client` in the tier at `tier` of the limits of
    /// `generation` (limits replaced meanwhile make every answer stale), unless it has
    /// expired by `now_us`.
    pub(crate) fn lookup(
        &self,
        generation: u64,
        tier: usize,
        client: &[u8],
        now_us: u64,
    ) -> Lookup {
        match self.fresh(&(generation, tier, cache_key(client)), now_us) {
            Some(own) => Lookup::Known(own),
            None => Lookup::Unknown,
        }
    }

    /// The answer cached under `key`, unless it has expired by `now_us`. An expired one
    /// stays until the next answer replaces it (or the cache's bound evicts it).
    fn fresh(&self, key: &(u64, usize, CacheKey), now_us: u64) -> Option<Own> {
        self.cache
            .get(key)
            .filter(|entry| now_us < entry.expires_us)
            .map(|entry| entry.own)
    }

    /// Asks the resolver about `client` (the resolver is handed `ask()`: the key as the
    /// client sent it, and its source), once for every request waiting on it, and
    /// caches the answer until `now_us` plus the time to live. A resolver that fails,
    /// panics or answers rules that cannot serve (none of them at all) gives the tier's
    /// default rules, with a WARN at a bounded rate.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resolve(
        self: &Arc<Self>,
        version: &Arc<Version>,
        tier: usize,
        namespace: Arc<str>,
        failure_policy: FailurePolicy,
        client: &[u8],
        ask: impl FnOnce() -> ClientKey,
        now_us: u64,
    ) -> impl Future<Output = Own> + Send + 'static {
        let key = (version.tiers[tier].generation, tier, cache_key(client));
        let call = {
            let mut in_flight = self.in_flight.lock();
            if let Some(call) = in_flight.get(&key) {
                call.clone()
            } else if let Some(own) = self.fresh(&key, now_us) {
                // A call that ended between the caller's lookup and this lock: its answer
                // is cached (a call caches before it leaves the map), and asking again
                // would call the resolver twice for one miss.
                let ready: Pin<Box<dyn Future<Output = Own> + Send>> =
                    Box::pin(std::future::ready(own));
                ready.shared()
            } else {
                let this = Arc::clone(self);
                let answer =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                        || (self.resolve)(ask()),
                    ));
                let expires_us = now_us.saturating_add(self.ttl_us);
                let version = Arc::clone(version);
                let client_shown = KeyDigest(client).to_string();
                let key2 = key.clone();
                let call: Pin<Box<dyn Future<Output = Own> + Send>> = Box::pin(async move {
                    let answer = match answer {
                        Ok(future) => std::panic::AssertUnwindSafe(future)
                            .catch_unwind()
                            .await
                            .unwrap_or_else(|_| Err("the resolver panicked".to_owned())),
                        Err(_) => Err("the resolver panicked".to_owned()),
                    };
                    let own = match answer {
                        Ok(Some(rules)) => {
                            let fallback = this.fallback_of(&rules, &client_shown, now_us);
                            Some(Arc::new(version.tiers[tier].customer(
                                &namespace,
                                rules,
                                failure_policy,
                                fallback,
                            )))
                        }
                        Ok(None) => None,
                        Err(error) => {
                            if let Some(count) = this.errors.hit(now_us) {
                                tracing::warn!(
                                    key = %client_shown,
                                    error = %Clip(&error),
                                    requests = count,
                                    "rate limit: the customer-limits resolver failed; the \
                                     tier's default rules apply until the next try (reported \
                                     at most every 10 s, with the failures since the last \
                                     report)"
                                );
                            }
                            None
                        }
                    };
                    this.cache.insert(
                        key2.clone(),
                        Entry {
                            own: own.clone(),
                            expires_us,
                        },
                    );
                    this.in_flight.lock().remove(&key2);
                    own
                });
                let call = call.shared();
                in_flight.insert(key, call.clone());
                call
            }
        };
        call
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::fallback::FallbackRules;
    use crate::limits::{Limits, Settings};

    #[tokio::test]
    async fn a_miss_whose_call_ended_before_it_asked_takes_the_cached_answer() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let customers = Arc::new(Customers::new(
            resolver(move |_: ClientKey| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, String>("7/h".parse().ok()) }
            }),
            100,
            Duration::from_secs(60),
            None,
        ));
        let settings = Settings::new(
            "ns".into(),
            FailurePolicy::FailOpen,
            FallbackRules::Same,
            false,
            0,
        );
        let version = Arc::new(
            settings
                .version(Limits::new("1/s".parse().unwrap()))
                .unwrap(),
        );
        let generation = version.tiers[0].generation;
        let resolve = || {
            customers.resolve(
                &version,
                0,
                "ns".into(),
                FailurePolicy::FailOpen,
                b"acme",
                || ClientKey::new(crate::key::KeySource::Other, &b"acme"[..]),
                0,
            )
        };
        // Two requests miss at once; the first one's call ends before the second asks.
        assert!(matches!(
            customers.lookup(generation, 0, b"acme", 0),
            Lookup::Unknown
        ));
        assert!(matches!(
            customers.lookup(generation, 0, b"acme", 0),
            Lookup::Unknown
        ));
        let first = resolve().await.expect("acme's own rules");
        let second = resolve().await.expect("acme's own rules");
        assert!(Arc::ptr_eq(&first, &second), "the first call's answer");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "one resolver call for one miss"
        );
    }
}
