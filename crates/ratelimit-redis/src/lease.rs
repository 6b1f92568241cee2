//! Lease mode: a store instance reserves a block of units for a hot (key, rule set) in one
//! call and spends it locally; see the crate docs ("Lease mode") for the promise it keeps.
//!
//! A reservation is an ordinary check of cost `b`: Redis charges the block atomically,
//! blocks included. What the lease did not spend when it ends goes back (the module's
//! `RATELIMIT.REFUND`, the `refund` function of `lua/check.lua`), lazily on the key's
//! next check or from the store's sweep.
//!
//! [`Leased`] is the top of the check path: it wraps the exact path ([`Exact`]) and
//! knows nothing below it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use ratelimit_core::util::BoundedLog;
use ratelimit_core::{Algorithm, Decision, LeakyMode, Outcome, RuleOutcome, RuleSet};
use tokio::sync::Notify;

use crate::error::RedisStoreError;
use crate::exact::{Exact, Unspent};
use crate::keys::KeyNames;

/// No instance reserves more than this fraction (1/8) of any rule's capacity at once, so
/// that a fleet of instances cannot strand a limit between them.
pub(crate) const SHARE_DIVISOR: u64 = 8;
/// Units a key must have been seen to take per lease length before it is leased: below
/// it, a block would mostly come back as a refund, one more call than exact checks.
pub(crate) const MIN_SEEN: u64 = 4;
/// The most (key, rule set) pairs one store tracks; past it, new keys are decided exactly.
pub(crate) const MAX_TRACKED: usize = 65_536;

/// The leases of one store.
struct Leases {
    length_us: u64,
    /// By the name of the client key's state in Redis (bounded whatever the key), then by
    /// rule set.
    table: Mutex<HashMap<Box<str>, Vec<Slot>>>,
    /// When a full table was last searched for idle slots: at most once per lease
    /// length, so that a flood of new keys does not scan it on every check.
    purged_us: AtomicU64,
    /// Refunds that failed, reported at a bounded rate.
    refund_log: BoundedLog,
}

/// What one store knows of one (key, rule set).
struct Slot {
    rules: RuleSet,
    lease: Option<Lease>,
    /// A refusal answered locally until this time (µs) on the store's clock.
    refused: Option<(u64, Decision)>,
    /// Units seen in the observation window starting at `seen_start`, and in the one
    /// before it: the key's rate per lease length.
    seen_start: u64,
    seen_cur: u64,
    seen_prev: u64,
    last_us: u64,
    /// Set when Redis refused a block: until it has a block to spare again, checks ask
    /// for their own cost, one call each, instead of a block first.
    starved: bool,
    /// Set while one check reserves for this slot; the others wait for its outcome.
    pending: Option<Arc<Notify>>,
}

/// Units reserved in Redis and not spent yet.
struct Lease {
    units: u64,
    /// The units the reservation charged.
    granted: u64,
    ends_us: u64,
    start_us: u64,
    /// Per rule: limit and time to reset as Redis said at the reservation.
    limits: Vec<(u64, Duration)>,
    /// Per rule: the fixed window the reservation charged (0 for other algorithms).
    windows: Vec<u64>,
}

/// Whether a reservation of this rule can keep the lease promise: an algorithm whose
/// charge can be undone exactly and never delays.
fn leasable(rules: &RuleSet) -> bool {
    rules.rules().iter().all(|rule| {
        matches!(
            rule.algorithm(),
            Algorithm::FixedWindow
                | Algorithm::TokenBucket { .. }
                | Algorithm::Gcra { .. }
                | Algorithm::LeakyBucket(LeakyMode::Meter { .. })
        )
    })
}

impl Slot {
    fn new(rules: &RuleSet, now: u64) -> Self {
        Self {
            rules: rules.clone(),
            lease: None,
            refused: None,
            seen_start: now,
            seen_cur: 0,
            seen_prev: 0,
            last_us: now,
            starved: false,
            pending: None,
        }
    }

    fn observe(&mut self, now: u64, cost: u64, length: u64) {
        if now.saturating_sub(self.seen_start) >= length {
            self.seen_prev = if now - self.seen_start < 2 * length {
                self.seen_cur
            } else {
                0
            };
            self.seen_cur = 0;
            self.seen_start = now;
        }
        self.seen_cur = self.seen_cur.saturating_add(cost);
        self.last_us = now;
    }

    /// The units to reserve: the rate seen per lease length, at least 2, at most the share,
    /// or only the check's cost while starved; `None` decides exactly (a key seen once or
    /// rarely, a cost as large as a block).
    fn block_size(&self, cost: u64) -> Option<u64> {
        let seen = self.seen_cur.max(self.seen_prev);
        let share = self
            .rules
            .rules()
            .iter()
            .map(|rule| rule.capacity() / SHARE_DIVISOR)
            .min()
            .unwrap_or(0);
        if seen < MIN_SEEN || share < 2 {
            return None;
        }
        let b = seen.clamp(2, share);
        if self.starved {
            return Some(cost);
        }
        (b > cost).then_some(b)
    }

    /// Whether the sweep may forget it: nothing held, nothing waited on, idle.
    fn idle(&self, now: u64, length: u64) -> bool {
        self.lease.is_none()
            && self.pending.is_none()
            && self.refused.as_ref().is_none_or(|(until, _)| *until <= now)
            && now.saturating_sub(self.last_us) >= 2 * length
    }
}

impl Lease {
    fn decision(&self, now: u64) -> Decision {
        let elapsed = Duration::from_micros(now.saturating_sub(self.start_us));
        Decision::from_rules(
            self.limits.iter().map(|&(limit, reset)| RuleOutcome {
                allowed: true,
                limit,
                remaining: self.units,
                reset_after: reset.saturating_sub(elapsed),
                retry_after: None,
            }),
            Duration::ZERO,
        )
    }
}

/// A local refusal: the refusal Redis gave, with the time left until it may change.
fn refusal(decision: &Decision, until: u64, now: u64) -> Decision {
    let left = Duration::from_micros(until.saturating_sub(now));
    if decision.outcome() == Outcome::Blocked {
        // A block without end stays one: the time left is only until it is asked about.
        return Decision::blocked(decision.retry_after().map(|_| left));
    }
    Decision::from_rules(
        decision.rules().iter().map(|r| RuleOutcome {
            retry_after: r.retry_after.map(|_| left),
            ..*r
        }),
        Duration::ZERO,
    )
}

/// Clears a slot's `pending` mark and wakes its waiters however the reserving check
/// ends, also when its future is dropped.
struct Pending<'a> {
    leases: &'a Leases,
    name: &'a str,
    rules: &'a RuleSet,
    notify: Arc<Notify>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.leases.with_slot(self.name, self.rules, |slot| {
            if slot
                .pending
                .as_ref()
                .is_some_and(|p| Arc::ptr_eq(p, &self.notify))
            {
                slot.pending = None;
            }
        });
        self.notify.notify_waiters();
    }
}

/// What the table says to do with a check.
enum Step {
    Answer(Decision),
    Wait(Arc<Notify>),
    Exact(Option<Lease>),
    Reserve(u64, Option<Lease>, Arc<Notify>),
}

impl Leases {
    fn new(length: Duration) -> Self {
        Self {
            length_us: u64::try_from(length.as_micros()).unwrap_or(u64::MAX).max(1),
            table: Mutex::new(HashMap::new()),
            purged_us: AtomicU64::new(0),
            refund_log: BoundedLog::new(),
        }
    }

    fn length(&self) -> Duration {
        Duration::from_micros(self.length_us)
    }

    fn with_slot<R>(
        &self,
        name: &str,
        rules: &RuleSet,
        f: impl FnOnce(&mut Slot) -> R,
    ) -> Option<R> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let slots = table.get_mut(name)?;
        slots.iter_mut().find(|s| s.rules.same_as(rules)).map(f)
    }

    /// Decides from the table when it can, else says which call to make.
    fn step(&self, name: &str, rules: &RuleSet, cost: u64, now: u64) -> Step {
        let length = self.length_us;
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if !table.contains_key(name) && table.len() >= MAX_TRACKED {
            if now.saturating_sub(self.purged_us.load(Ordering::Relaxed)) < length {
                return Step::Exact(None);
            }
            self.purged_us.store(now, Ordering::Relaxed);
            table.retain(|_, slots| {
                slots.retain(|s| !s.idle(now, length));
                !slots.is_empty()
            });
            if table.len() >= MAX_TRACKED {
                return Step::Exact(None);
            }
        }
        let slots = table.entry(name.into()).or_default();
        let i = match slots.iter().position(|s| s.rules.same_as(rules)) {
            Some(i) => i,
            None => {
                slots.push(Slot::new(rules, now));
                slots.len() - 1
            }
        };
        let slot = &mut slots[i];
        if let Some(pending) = &slot.pending {
            return Step::Wait(pending.clone());
        }
        slot.observe(now, cost, length);
        let mut spent = None;
        if let Some(lease) = &mut slot.lease {
            if now < lease.ends_us && lease.units >= cost {
                lease.units -= cost;
                return Step::Answer(lease.decision(now));
            }
            spent = slot.lease.take().filter(|l| l.units > 0);
        }
        if let Some((until, decision)) = &slot.refused {
            if now < *until {
                return Step::Answer(refusal(decision, *until, now));
            }
            slot.refused = None;
        }
        match slot.block_size(cost) {
            Some(b) => {
                let notify = Arc::new(Notify::new());
                slot.pending = Some(notify.clone());
                Step::Reserve(b, spent, notify)
            }
            None => Step::Exact(spent),
        }
    }

    /// Records the outcome of a reservation of `b` units for a check of `cost`, and
    /// returns the answer to the check.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &self,
        name: &str,
        rules: &RuleSet,
        now: u64,
        b: u64,
        cost: u64,
        decision: Decision,
        starved: bool,
    ) -> Decision {
        let length = self.length_us;
        self.with_slot(name, rules, |slot| {
            slot.starved = starved;
            if decision.is_allowed() {
                let mut ends = now.saturating_add(length);
                let windows = rules
                    .rules()
                    .iter()
                    .map(|rule| {
                        if rule.algorithm() != Algorithm::FixedWindow {
                            return 0;
                        }
                        let period = rule.period_us();
                        let index = now / period;
                        // A fixed window's units count in their window only.
                        ends = ends.min((index + 1).saturating_mul(period));
                        index
                    })
                    .collect();
                let lease = Lease {
                    units: b - cost,
                    granted: b,
                    ends_us: ends,
                    start_us: now,
                    limits: decision
                        .rules()
                        .iter()
                        .map(|r| (r.limit, r.reset_after))
                        .collect(),
                    windows,
                };
                let answer = lease.decision(now);
                slot.lease = Some(lease);
                answer
            } else {
                let until = match decision.retry_after() {
                    Some(retry) => {
                        let retry = u64::try_from(retry.as_micros()).unwrap_or(u64::MAX);
                        Some(now.saturating_add(retry.max(1)))
                    }
                    // A block without end: asked about again after a lease length, as a
                    // new block is noticed within one.
                    None if decision.outcome() == Outcome::Blocked => {
                        Some(now.saturating_add(length))
                    }
                    None => None,
                };
                if let Some(until) = until {
                    slot.refused = Some((until, decision.clone()));
                }
                decision.clone()
            }
        })
        .unwrap_or(decision)
    }

    /// Takes every lease that has ended with units left, and forgets idle slots.
    fn ended(&self, now: u64) -> Vec<(Box<str>, RuleSet, Lease)> {
        let length = self.length_us;
        let mut out = Vec::new();
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        table.retain(|name, slots| {
            for slot in slots.iter_mut() {
                if slot.lease.as_ref().is_some_and(|l| l.ends_us <= now) {
                    if let Some(lease) = slot.lease.take().filter(|l| l.units > 0) {
                        out.push((name.clone(), slot.rules.clone(), lease));
                    }
                }
            }
            slots.retain(|s| !s.idle(now, length));
            !slots.is_empty()
        });
        out
    }

    /// Waits until the reservation `notify` belongs to has ended.
    async fn reserved(&self, name: &str, rules: &RuleSet, notify: Arc<Notify>) {
        let woken = notify.notified();
        // The reservation may have ended between the table's answer and the line above,
        // and another begun since: wait only while this one is pending, or no one would
        // ever wake this check (its reservation's wake-up went out before it listened).
        let pending = self
            .with_slot(name, rules, |slot| {
                slot.pending
                    .as_ref()
                    .is_some_and(|p| Arc::ptr_eq(p, &notify))
            })
            .unwrap_or(false);
        if pending {
            woken.await;
        }
    }

    /// Drops what this store holds for a client key (its state name).
    fn forget(&self, name: &str) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        table.remove(name);
    }
}

/// The check path of a store: the exact path, with lease mode's table in front of it
/// when the store was built with a lease length.
#[derive(Debug)]
pub(crate) struct Leased {
    exact: Exact,
    leases: Option<Leases>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("length", &self.length())
            .finish_non_exhaustive()
    }
}

impl Leased {
    pub(crate) fn new(exact: Exact, length: Option<Duration>) -> Self {
        Self {
            exact,
            leases: length.map(Leases::new),
        }
    }

    /// The exact path below, for what lease mode does not change.
    pub(crate) fn exact(&self) -> &Exact {
        &self.exact
    }

    /// The lease length; `None` in exact mode.
    pub(crate) fn length(&self) -> Option<Duration> {
        self.leases.as_ref().map(Leases::length)
    }

    /// One check: from the lease table when it can answer, else through the exact path.
    pub(crate) async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, RedisStoreError> {
        let Some(leases) = &self.leases else {
            return self.exact.check(key, rules, cost).await;
        };
        // A leased check may wait for another's reservation, give units back, reserve
        // and reserve again, each a call of its own: the store's timeout bounds them all
        // together, as it bounds an exact check's one call.
        let leased = async {
            match check(&self.exact, leases, key, rules, cost).await {
                Some(decided) => decided,
                None => self.exact.check(key, rules, cost).await,
            }
        };
        let mut leased = std::pin::pin!(leased);
        // Most leased checks are answered from the table at the first poll: no timer.
        if let std::task::Poll::Ready(decided) = futures::poll!(&mut leased) {
            return decided;
        }
        let timeout = self.exact.shared().timeout;
        tokio::time::timeout(timeout, leased)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }

    /// Drops what this store holds for `key`, unspent units included: after a block or
    /// a reset they must not be spent.
    pub(crate) fn forget(&self, key: &[u8]) {
        if let Some(leases) = &self.leases {
            leases.forget(&state_name(&self.exact, key));
        }
    }

    /// Gives back the units of every lease that has ended.
    pub(crate) async fn sweep(&self) {
        let Some(leases) = &self.leases else {
            return;
        };
        // All at once: the refunds queue together and leave in the checks' batches.
        let ended = leases.ended(self.exact.shared().now_us());
        futures::future::join_all(ended.into_iter().map(|(name, rules, lease)| async move {
            refund_or_log(&self.exact, leases, &name, &rules, Some(lease)).await;
        }))
        .await;
    }

    /// Gives back the units of leases that ended, every half lease length, for as long
    /// as `held` lives: a key that goes quiet returns its units within about one lease
    /// length. Nothing in exact mode, or outside a Tokio runtime.
    pub(crate) fn spawn_sweep<T: Send + Sync + 'static>(
        held: Weak<T>,
        leased: fn(&T) -> &Leased,
        every: Duration,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(held) = held.upgrade() else {
                    return;
                };
                leased(&held).sweep().await;
            }
        });
    }
}

/// The name of a client key's state: the lease table's key.
fn state_name(exact: &Exact, key: &[u8]) -> Box<str> {
    KeyNames::new(&exact.shared().prefix, key).state().into()
}

/// A refund that failed strands its units until the state expires, as a crashed
/// instance's would: nothing more to do than to say so.
async fn refund_or_log(
    exact: &Exact,
    leases: &Leases,
    name: &str,
    rules: &RuleSet,
    lease: Option<Lease>,
) {
    let Some(lease) = lease else {
        return;
    };
    let unspent = Unspent {
        units: lease.units,
        start_us: lease.start_us,
        granted: lease.granted,
        windows: &lease.windows,
    };
    let Err(e) = exact.refund_unspent(name, rules, &unspent).await else {
        return;
    };
    match leases.refund_log.hit(exact.shared().now_us()) {
        Some(count) => tracing::warn!(
            error = %e,
            units = lease.units,
            failed_refunds = count,
            "a lease's unspent units could not be given back to Redis: they stay charged \
             until the key's state expires, so the key admits less than its limit until \
             then (reported at most every 10 s, with the refunds failed since the last \
             report)"
        ),
        None => tracing::debug!(error = %e, units = lease.units, "lease refund failed"),
    }
}

/// A check in lease mode; `None` when it goes to Redis exactly (peeks, rule sets a lease
/// cannot serve).
async fn check(
    exact: &Exact,
    leases: &Leases,
    key: &[u8],
    rules: &RuleSet,
    cost: u64,
) -> Option<Result<Decision, RedisStoreError>> {
    if cost == 0 || !leasable(rules) {
        return None;
    }
    let name = state_name(exact, key);
    loop {
        let now = exact.shared().now_us();
        match leases.step(&name, rules, cost, now) {
            Step::Answer(decision) => return Some(Ok(decision)),
            Step::Wait(notify) => leases.reserved(&name, rules, notify).await,
            Step::Exact(spent) => {
                refund_or_log(exact, leases, &name, rules, spent).await;
                return None;
            }
            Step::Reserve(b, spent, notify) => {
                let _pending = Pending {
                    leases,
                    name: &name,
                    rules,
                    notify,
                };
                refund_or_log(exact, leases, &name, rules, spent).await;
                return Some(reserve(exact, leases, &name, key, rules, cost, b).await);
            }
        }
    }
}

/// Reserves `b` units; when Redis refuses, one more call for what is left (at least the
/// check's own cost), and a refusal of that one is answered locally until it may change.
async fn reserve(
    exact: &Exact,
    leases: &Leases,
    name: &str,
    key: &[u8],
    rules: &RuleSet,
    cost: u64,
    b: u64,
) -> Result<Decision, RedisStoreError> {
    let now = exact.shared().now_us();
    let decision = exact.check(key, rules, b).await?;
    let left = decision
        .rules()
        .iter()
        .map(|r| r.remaining)
        .min()
        .unwrap_or(0);
    if decision.is_allowed() || decision.outcome() == Outcome::Blocked || b == cost {
        // Starved until Redis has room for a block of 2 past this check again.
        let starved = !decision.is_allowed() || (b == cost && left < 2);
        return Ok(leases.settle(name, rules, now, b, cost, decision, starved));
    }
    // What Redis said is left now; take it if it covers the check, else ask for the
    // check's own cost, exactly.
    let again = cost.max(left.min(b));
    let now = exact.shared().now_us();
    let decision = exact.check(key, rules, again).await?;
    Ok(leases.settle(name, rules, now, again, cost, decision, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> RuleSet {
        "1000/s gcra burst=400".parse().unwrap()
    }

    #[test]
    fn a_key_seen_rarely_is_exact_and_a_warm_one_reserves() {
        let leases = Leases::new(Duration::from_millis(100));
        for t in 1..MIN_SEEN {
            assert!(matches!(
                leases.step("k", &rules(), 1, t),
                Step::Exact(None)
            ));
        }
        match leases.step("k", &rules(), 1, MIN_SEEN) {
            Step::Reserve(b, None, _) => assert_eq!(b, MIN_SEEN),
            _ => panic!("a warm key reserves a block"),
        }
    }

    #[test]
    fn blocks_are_capped_at_an_eighth_of_the_capacity() {
        let leases = Leases::new(Duration::from_millis(100));
        for t in 0..1_000 {
            leases.step("k", &rules(), 1, t);
            leases.with_slot("k", &rules(), |s| s.pending = None);
        }
        match leases.step("k", &rules(), 1, 1_000) {
            Step::Reserve(b, _, _) => assert_eq!(b, 400 / SHARE_DIVISOR),
            _ => panic!("a hot key reserves"),
        }
    }

    /// A check waits for a reservation that ended, and a new one began, between the
    /// table's answer and its listening: it must not wait for the new one's wake-up.
    #[tokio::test(start_paused = true)]
    async fn a_reservation_that_ended_before_its_waiter_listened_does_not_hold_it() {
        let leases = Leases::new(Duration::from_millis(100));
        let rules = rules();
        for t in 1..MIN_SEEN {
            leases.step("k", &rules, 1, t);
        }
        let Step::Reserve(_, _, first) = leases.step("k", &rules, 1, MIN_SEEN) else {
            panic!("a warm key reserves a block");
        };
        let Step::Wait(waited) = leases.step("k", &rules, 1, MIN_SEEN) else {
            panic!("a second check waits for the reservation");
        };
        drop(Pending {
            leases: &leases,
            name: "k",
            rules: &rules,
            notify: first,
        });
        let Step::Reserve(_, _, second) = leases.step("k", &rules, 1, MIN_SEEN + 1) else {
            panic!("the next check reserves again");
        };
        let wait = leases.reserved("k", &rules, waited);
        assert!(
            tokio::time::timeout(Duration::from_secs(10), wait)
                .await
                .is_ok(),
            "the waiter hangs on a reservation that ended"
        );
        // The live reservation is still waited for.
        let wait = leases.reserved("k", &rules, second.clone());
        assert!(tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .is_err());
    }

    #[test]
    fn a_full_table_decides_new_keys_exactly() {
        let leases = Leases::new(Duration::from_millis(100));
        for i in 0..MAX_TRACKED {
            leases.step(&format!("k{i}"), &rules(), 1, 1_000);
        }
        // Every slot was seen just now: none is idle, nothing to forget.
        assert!(matches!(
            leases.step("new", &rules(), 1, 1_000),
            Step::Exact(None)
        ));
        assert_eq!(leases.table.lock().unwrap().len(), MAX_TRACKED);
        // Idle ones make room, at the next search.
        assert!(matches!(
            leases.step("new", &rules(), 1, 1_000_000),
            Step::Exact(None)
        ));
        assert_eq!(leases.table.lock().unwrap().len(), 1);
    }
}
