use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::decision::Decision;
use crate::rule::RuleSet;

/// Where rate-limit state lives: process memory ([`MemoryStore`](crate::MemoryStore)),
/// Redis, or anything else that can apply the core's transitions atomically per key.
///
/// The trait is generic (its methods return `impl Future + Send`) rather than object safe:
/// the middleware is generic over its store, so a check through
/// [`MemoryStore`](crate::MemoryStore) costs no allocation and no dynamic call. Wrap a store in an
/// [`Arc`] to share it between layers; `Arc<S>` is a store too.
///
/// Keys are arbitrary bytes (an IP, an API key, a user id). A key's state belongs to the
/// key; inside it, each rule's state belongs to the rule's identity
/// ([`RuleSet::rule_ids`](crate::RuleSet::rule_ids)), so a check under changed rules
/// keeps the client's usage as [`algo`](crate::algo#changing-rules) says, the same in
/// every store. Blocks belong to the key and stop every rule set.
pub trait Store: Send + Sync + 'static {
    /// What can go wrong: an unreachable backend, a timeout, a cost no rule can grant.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Decides a request of `cost` units for `key` against every rule of `rules` in one
    /// atomic step: admitted only if every rule admits, and a denial consumes nothing.
    /// `cost == 0` peeks without consuming.
    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send;

    /// Decides at once, without a future, when the store can (an in-process store);
    /// `None` means "call [`Store::check`]". Middleware calls this first so that a check
    /// against process memory costs no boxed future. The default answers `None`.
    fn check_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Option<Result<Decision, Self::Error>> {
        let _ = (key, rules, cost);
        None
    }

    /// Blocks `key` for `duration`, or until [`Store::unblock`] when `None`. A block
    /// replaces any earlier one.
    fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Lifts a block on `key` (no-op when not blocked).
    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Forgets what `key` consumed, under every rule, as if it had never been seen. The
    /// state of a key is one whatever the rules, so `rules` does not narrow it; a block
    /// stays.
    fn reset(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Gives back `cost` units that a check of `key` under `rules` charged, for a request
    /// that turned out not to count (charging by outcome). `charged_at` is a reading of
    /// [`Store::now_us`] taken before that check. Per algorithm, as
    /// [`algo`](crate::algo#giving-units-back) says: never more than was charged, never
    /// into another window; a key whose state was since written under other rules gets
    /// nothing back. Answers whether anything was given back.
    ///
    /// The default gives nothing back (and answers `false`): a store that cannot refund
    /// charges every request, which limits more, never less.
    fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = (key, rules, cost, charged_at);
        std::future::ready(Ok(false))
    }

    /// Gives back at once, without a future, when the store can (an in-process store);
    /// `None` means "call [`Store::refund`]". The default answers `None`.
    fn refund_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        let _ = (key, rules, cost, charged_at);
        None
    }

    /// Settles a charge of `charged` units that a check of `key` under `rules` made at
    /// `charged_at` (a reading of [`Store::now_us`] taken before that check) to the
    /// request's `actual` cost, known only once it has been served (tokens an LLM
    /// answered with, bytes sent), in one atomic step:
    ///
    /// * `actual < charged`: the difference goes back, as [`Store::refund`] gives it;
    /// * `actual > charged`: the excess is charged **unconditionally**, as debt the key
    ///   repays before it is admitted again, as [`algo`](crate::algo#settling-a-charge)
    ///   says per algorithm; one settle adds at most one period's limit of each rule
    ///   ([`algo::debt_cap`](crate::algo::debt_cap)), and a state holds at most its
    ///   capacity plus that much;
    /// * `actual == charged`: nothing to do (and no call to make).
    ///
    /// A key whose state was since written under other rules keeps what it was charged.
    /// Answers whether any state changed.
    ///
    /// The default gives back a smaller actual through [`Store::refund`] and charges no
    /// excess (answering `false`): a store that cannot hold debt limits metered costs
    /// by their estimates alone.
    fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let refund =
            (actual < charged).then(|| self.refund(key, rules, charged - actual, charged_at));
        async move {
            match refund {
                Some(refund) => refund.await,
                None => Ok(false),
            }
        }
    }

    /// Settles at once, without a future, when the store can (an in-process store);
    /// `None` means "call [`Store::settle`]". The default answers `None`.
    fn settle_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        let _ = (key, rules, charged, actual, charged_at);
        None
    }

    /// Frees the slot numbered `slot` ([`Decision::slot`]) that a check of `key` under
    /// `rules` took for a request that has now ended, as
    /// [`algo::release`](crate::algo::release) says: whatever rules the key's state was
    /// since written under, and once only (a release resent after a lost connection
    /// frees nothing more). Answers whether the slot was held and live.
    ///
    /// The default frees nothing and answers `false`: a store without concurrency rules
    /// never hands out a slot.
    fn release(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = (key, rules, slot);
        std::future::ready(Ok(false))
    }

    /// Releases at once, without a future, when the store can (an in-process store);
    /// `None` means "call [`Store::release`]". The default answers `None`.
    fn release_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> Option<Result<bool, Self::Error>> {
        let _ = (key, rules, slot);
        None
    }

    /// Hands a release to the store to carry out on its own, for a caller that does not
    /// wait for the answer (a middleware, once the response has gone): a networked store
    /// queues it with its next call instead of a call and a task of its own. Answers
    /// `false` when the store does not take it, and the caller releases through
    /// [`Store::release_sync`] or [`Store::release`].
    ///
    /// A store that answers `true` owns the release from then on: it sends it again after
    /// a lost connection (freeing the slot once), retries it after the waits of
    /// [`RELEASE_RETRY_WAITS`](crate::util::RELEASE_RETRY_WAITS) while the store is
    /// unreachable, and reports one that never ran (the slot stays taken until its
    /// deadline). The default answers `false`.
    fn release_detached(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        let _ = (key, rules, slot);
        false
    }

    /// Hands a settle to the store to carry out on its own, as
    /// [`release_detached`](Store::release_detached) does a release: `true` when the store
    /// took it (or there was nothing to do, `actual == charged`). A give-back is tried
    /// once (a second run would lend units other requests may take); a debt may be tried
    /// again (twice limits more, never less). A settle that failed is reported by the
    /// store: the estimate stays charged. The default answers `false`.
    fn settle_detached(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        let _ = (key, rules, charged, actual, charged_at);
        false
    }

    /// Moves the deadline of the live slot numbered `slot` on to now plus the timeout of
    /// the `N concurrent` rule of `rules`, for a request that runs on (a long stream), as
    /// [`algo::renew`](crate::algo::renew) says. Answers whether the slot was live; a
    /// slot past its deadline is not renewed (it was free, and may be another request's
    /// since). `rules` without a concurrency rule renews nothing.
    ///
    /// The default renews nothing and answers `false`.
    fn renew(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = (key, rules, slot);
        std::future::ready(Ok(false))
    }

    /// Takes a slot of the `N concurrent` rule of `rules` for `key` whatever its limit,
    /// and charges every rate rule one unit unconditionally (as debt where it passes the
    /// limit), as [`algo::take`](crate::algo::take) says: a request admitted elsewhere (by
    /// a fallback while the store was down) handed to the store, which then counts it
    /// among the key's requests in flight until it is released or its deadline passes. A
    /// key the store holds nothing for is taken from fresh states. Answers the slot's
    /// number; `None`, with nothing changed, when the key's state was since written
    /// under other rules or `rules` have no concurrency rule.
    ///
    /// The store may then hold more than `N` slots: it refuses new requests until fewer
    /// than `N` are held, so the requests in flight it counts are never fewer than those
    /// running. The default takes nothing and answers `None`.
    fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<Option<u64>, Self::Error>> + Send {
        let _ = (key, rules);
        std::future::ready(Ok(None))
    }

    /// The time on this store's clock, in microseconds since the Unix epoch.
    ///
    /// Whatever keeps time beside a store (a middleware's cache of recent denials, say)
    /// reads it here, so that a store on a [`ManualClock`](crate::ManualClock) moves every
    /// such notion of time with it and a test behaves like production. A store that takes
    /// its time from elsewhere on each decision (the Redis server's clock) answers with its
    /// best local reading of that time. The default reads [`SystemClock`].
    fn now_us(&self) -> u64 {
        SystemClock.now_us()
    }

    /// When this store last regained its connection after losing it (or after failing to
    /// make it), on its clock ([`now_us`](Store::now_us)); 0 when it never lost one.
    ///
    /// Middleware uses it to know that an outage just ended even when none of its own
    /// requests failed (a call resent over the new connection), and so that other
    /// instances may still be deciding without the store. The default answers 0: an
    /// in-process store never loses its connection.
    fn recovered_at_us(&self) -> u64 {
        0
    }

    /// Whether other processes see this store's state (Redis: yes; process memory: no).
    ///
    /// Middleware uses it to warn about what only matters across processes, such as a
    /// budget named by where a layer is built in the source, which a deploy that moves
    /// that line renames. The default answers `false`.
    fn is_shared(&self) -> bool {
        false
    }
}

impl<S: Store> Store for Arc<S> {
    type Error = S::Error;

    fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send {
        (**self).check(key, rules, cost)
    }

    fn check_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Option<Result<Decision, Self::Error>> {
        (**self).check_sync(key, rules, cost)
    }

    fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        (**self).block(key, duration)
    }

    fn unblock(&self, key: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
        (**self).unblock(key)
    }

    fn reset(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        (**self).reset(key, rules)
    }

    fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        (**self).refund(key, rules, cost, charged_at)
    }

    fn refund_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        (**self).refund_sync(key, rules, cost, charged_at)
    }

    fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        (**self).settle(key, rules, charged, actual, charged_at)
    }

    fn settle_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> Option<Result<bool, Self::Error>> {
        (**self).settle_sync(key, rules, charged, actual, charged_at)
    }

    fn release(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        (**self).release(key, rules, slot)
    }

    fn release_sync(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> Option<Result<bool, Self::Error>> {
        (**self).release_sync(key, rules, slot)
    }

    fn release_detached(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        (**self).release_detached(key, rules, slot)
    }

    fn settle_detached(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        (**self).settle_detached(key, rules, charged, actual, charged_at)
    }

    fn renew(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        (**self).renew(key, rules, slot)
    }

    fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> impl Future<Output = Result<Option<u64>, Self::Error>> + Send {
        (**self).take_slot(key, rules)
    }

    fn now_us(&self) -> u64 {
        (**self).now_us()
    }

    fn is_shared(&self) -> bool {
        (**self).is_shared()
    }

    fn recovered_at_us(&self) -> u64 {
        (**self).recovered_at_us()
    }
}
