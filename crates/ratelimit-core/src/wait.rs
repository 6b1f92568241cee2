//! Waiting for a turn: [`StoreExt::until_ready`], for outbound calls that must wait for
//! their slot rather than fail.

use std::future::Future;
use std::time::Duration;

use crate::decision::{Decision, Outcome};
use crate::rule::RuleSet;
use crate::store::Store;

/// Why [`StoreExt::until_ready`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum WaitError<E> {
    /// The store failed.
    #[error("the rate-limit store failed: {0}")]
    Store(#[source] E),
    /// The turn comes later than the maximum wait: nothing is charged.
    #[error("the next turn is {wait:?} away, beyond the maximum wait of {max_wait:?}")]
    TooLong {
        /// How long the caller would have had to wait (at least; a block without end:
        /// [`Duration::MAX`]).
        wait: Duration,
        /// The maximum wait it was given.
        max_wait: Duration,
    },
    /// The cost is more than a rule can ever grant, or the key is blocked without end.
    #[error("the request can never be admitted: {0}")]
    Never(&'static str),
}

/// Waiting for a turn, on every [`Store`]: `use ratelimit_core::StoreExt`.
///
/// ```
/// use std::time::Duration;
/// use ratelimit_core::{MemoryStore, RuleSet, StoreExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// // A partner API allows 10 calls a second; callers queue for their slot.
/// let rules: RuleSet = "10/s leaky-bucket mode=shaper burst=20".parse().unwrap();
/// let decision = store
///     .until_ready(b"partner-api", &rules, 1, Duration::from_secs(5))
///     .await
///     .unwrap();
/// assert!(decision.is_allowed());
/// # }
/// ```
pub trait StoreExt: Store {
    /// Waits until the store admits `cost` units for `key` under `rules`, at most
    /// `max_wait`, and answers the admitting decision; nothing is charged when it gives
    /// up.
    ///
    /// * With a shaping rule (`leaky-bucket mode=shaper`), the store hands out the slot
    ///   in the one check: the caller sleeps the decision's delay, so a fleet of waiters
    ///   each get their own slot from one store call each, with no retry loop. A delay
    ///   beyond `max_wait` gives the slot back ([`Store::refund`]) and fails with
    ///   [`WaitError::TooLong`].
    /// * With other rules, a denial says when the units fit (`retry_after`): the caller
    ///   sleeps that long, plus a jitter of up to a tenth so that waiters denied
    ///   together do not all come back at once, and asks again.
    ///
    /// Dropping the future while it sleeps on a slot gives the slot back where the
    /// algorithm allows (the refund of a shaper's arrival time) on a store that answers
    /// in process; on a remote store the slot stays taken (it limits more, never less).
    ///
    /// With a `N concurrent` rule the admitting decision holds a slot
    /// ([`Decision::slot`](crate::Decision::slot)): the caller releases it with
    /// [`Store::release`] once its call has ended (or it frees itself at its deadline).
    /// A wait that gives up releases the slot its check took, as it refunds the units.
    fn until_ready(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Decision, WaitError<Self::Error>>> + Send {
        async move {
            if rules.check_cost(cost).is_err() {
                return Err(WaitError::Never("the cost is above a rule's capacity"));
            }
            let start = tokio::time::Instant::now();
            let mut attempt = 0u64;
            loop {
                let charged_at = self.now_us();
                let decision = self
                    .check(key, rules, cost)
                    .await
                    .map_err(WaitError::Store)?;
                let waited = start.elapsed();
                let left = max_wait.saturating_sub(waited);
                match decision.outcome() {
                    Outcome::Allowed => {
                        let delay = decision.delay();
                        if delay.is_zero() {
                            return Ok(decision);
                        }
                        if delay > left {
                            let _ = self.refund(key, rules, cost, charged_at).await;
                            if let Some(taken) = decision.slot() {
                                let _ = self.release(key, rules, taken).await;
                            }
                            return Err(WaitError::TooLong {
                                wait: waited + delay,
                                max_wait,
                            });
                        }
                        let mut slot = Slot {
                            store: self,
                            key,
                            rules,
                            cost,
                            charged_at,
                            taken: decision.slot(),
                            armed: true,
                        };
                        tokio::time::sleep(delay).await;
                        slot.armed = false;
                        return Ok(decision);
                    }
                    Outcome::Limited | Outcome::Blocked => {
                        let Some(retry) = decision.retry_after() else {
                            return Err(if decision.outcome() == Outcome::Blocked {
                                WaitError::Never("the key is blocked without end")
                            } else {
                                WaitError::TooLong {
                                    wait: Duration::MAX,
                                    max_wait,
                                }
                            });
                        };
                        if retry > left {
                            return Err(WaitError::TooLong {
                                wait: waited + retry,
                                max_wait,
                            });
                        }
                        attempt += 1;
                        let pause = (retry + jitter(retry, key, attempt)).min(left);
                        tokio::time::sleep(pause.max(Duration::from_micros(1))).await;
                    }
                }
            }
        }
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

/// Up to a tenth of `retry`, spread by the key and the attempt (no random source needed:
/// waiters differ by their own clock readings and keys, and the point is only that they
/// do not all return at the same instant).
fn jitter(retry: Duration, key: &[u8], attempt: u64) -> Duration {
    let tenth = u64::try_from(retry.as_micros() / 10).unwrap_or(u64::MAX);
    if tenth == 0 {
        return Duration::ZERO;
    }
    let seed = crate::util::fnv1a(key)
        ^ attempt.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos()),
        );
    Duration::from_micros(seed % tenth)
}

/// A slot a waiter holds while it sleeps: given back if the wait is dropped.
struct Slot<'a, S: Store + ?Sized> {
    store: &'a S,
    key: &'a [u8],
    rules: &'a RuleSet,
    cost: u64,
    charged_at: u64,
    /// A concurrency rule's slot the check took, released with the rest.
    taken: Option<u64>,
    armed: bool,
}

impl<S: Store + ?Sized> Drop for Slot<'_, S> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Only a store that answers in process can give back from a drop; on a remote
        // store the slot stays charged, which limits more, never less.
        let _ = self
            .store
            .refund_sync(self.key, self.rules, self.cost, self.charged_at);
        if let Some(taken) = self.taken {
            let _ = self.store.release_sync(self.key, self.rules, taken);
        }
    }
}
